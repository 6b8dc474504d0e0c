//! Several training sequences packed into one row behind a shared prefix (e.g. auxiliary
//! questions that all follow the same head+tail document context). Each packed sequence attends
//! to the prefix and to its own earlier tokens only, and its RoPE positions continue from the
//! prefix's end as if it were alone, so one forward/backward over the row gives exactly the
//! losses and gradients of the separate sequences while the prefix is computed once.

use candle_core::{Device, Result, Tensor};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packing {
    /// RoPE position of each token.
    positions: Vec<u32>,
    /// Sequence of each token: 0 for the shared prefix, 1.. for the packed sequences.
    sequence: Vec<u32>,
}

impl Packing {
    /// A prefix of `prefix` tokens followed by sequences of `lens` tokens.
    pub fn new(prefix: usize, lens: &[usize]) -> Self {
        let total = prefix + lens.iter().sum::<usize>();
        let mut positions = Vec::with_capacity(total);
        let mut sequence = Vec::with_capacity(total);
        positions.extend(0..prefix as u32);
        sequence.resize(prefix, 0);
        for (s, &n) in lens.iter().enumerate() {
            positions.extend(prefix as u32..(prefix + n) as u32);
            sequence.extend(std::iter::repeat_n(s as u32 + 1, n));
        }
        Self { positions, sequence }
    }

    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Sequence of each token (0 = the shared prefix).
    pub fn sequence(&self) -> &[u32] {
        &self.sequence
    }

    /// The first `t` tokens (a row whose last token is not fed to the model, e.g. the inputs
    /// of next-token prediction).
    pub fn truncated(&self, t: usize) -> Self {
        Self { positions: self.positions[..t].to_vec(), sequence: self.sequence[..t].to_vec() }
    }

    /// Whether query `i` may attend key `j`: causal, same sequence or the prefix, and within
    /// the sliding window (by RoPE position) when the model has one.
    pub fn visible(&self, i: usize, j: usize, window: Option<usize>) -> bool {
        let (si, sj) = (self.sequence[i], self.sequence[j]);
        let (pi, pj) = (self.positions[i] as usize, self.positions[j] as usize);
        j <= i && (sj == 0 || sj == si) && window.is_none_or(|w| pi < w || pj > pi - w)
    }

    /// Additive attention mask `[t, t]` (0 or −∞) for the first `t` tokens.
    pub fn mask(&self, window: Option<usize>, device: &Device) -> Result<Tensor> {
        let t = self.len();
        let data: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| (i, j)))
            .map(|(i, j)| if self.visible(i, j, window) { 0.0 } else { f32::NEG_INFINITY })
            .collect();
        Tensor::from_vec(data, (t, t), device)
    }

    /// The rows of RoPE tables `[max_positions, d/2]` at each token's position.
    pub fn rope_tables(&self, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor)> {
        let max = cos.dim(0)?;
        if let Some(&p) = self.positions.iter().max().filter(|&&p| p as usize >= max) {
            candle_core::bail!("packed position {p} exceeds the model's {max} positions");
        }
        let idx = Tensor::new(self.positions.as_slice(), cos.device())?;
        Ok((cos.index_select(&idx, 0)?, sin.index_select(&idx, 0)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_see_the_prefix_and_themselves_only() {
        let p = Packing::new(2, &[2, 3]);
        assert_eq!(p.positions, vec![0, 1, 2, 3, 2, 3, 4]);
        assert_eq!(p.sequence(), &[0, 0, 1, 1, 2, 2, 2]);
        // Token 4 (sequence 2, position 2) sees the prefix and itself, not sequence 1.
        let seen: Vec<usize> = (0..7).filter(|&j| p.visible(4, j, None)).collect();
        assert_eq!(seen, vec![0, 1, 4]);
        let seen: Vec<usize> = (0..7).filter(|&j| p.visible(6, j, None)).collect();
        assert_eq!(seen, vec![0, 1, 4, 5, 6]);
        // The prefix is causal among itself.
        assert!(!p.visible(0, 1, None) && p.visible(1, 0, None));
        // A window of 2 positions hides prefix token 0 from position 3 (token 5).
        assert!(!p.visible(5, 0, Some(2)) && p.visible(5, 1, Some(3)));
        let m = p.mask(None, &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(m[4][2], f32::NEG_INFINITY);
        assert_eq!(m[4][0], 0.0);
        assert_eq!(p.truncated(5).sequence(), &[0, 0, 1, 1, 2]);
    }
}
