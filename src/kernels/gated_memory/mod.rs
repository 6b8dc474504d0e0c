//! Gated Memory's per-head MLPs and the mix `attn + g·(m − attn)` as one op with a hand-written
//! backward (`kernels/gated_memory.cu` on CUDA). The op's inputs are `q` and `attn`
//! (`[b, heads, t, d]`, f32) and the layer's parameters packed into one flat f32 vector (the
//! adapter's `GatedMemoryLayer::packed`: a differentiable concatenation, so the gradients reach
//! every parameter `Var`).
//!
//! `reference_forward` / `reference_backward` are the plain per-row CPU implementation of exactly
//! what the kernels compute (tested against candle's autograd of the composite in
//! `GatedMemory::mix_attention_composite`, in `adapters::gated_memory`); the CUDA kernels
//! (`tests/cuda.rs`) and the op's fast CPU path (`fast_forward` / `fast_backward`, per-head gemm)
//! are tested against them.
//!
//! Here: the layer's shapes and the packed layout; the reference (`reference.rs`), the fast CPU
//! path (`fast.rs`), the int8 batch-decode mix (`decode.rs`) and the autograd op with its CPU and
//! CUDA launches (`op.rs`).

mod decode;
mod fast;
mod op;
mod reference;

pub use decode::{mix_decode_rows, DecodeWeights};
pub use fast::{fast_backward, fast_forward, mix_block};
pub use op::mix;
pub use reference::{reference_backward, reference_forward};

/// Shapes of one layer: heads, head_dim, gate hidden size and whether biases exist. The adapter
/// supplies them (`GatedMemoryLayer::kernel_dims`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GmDims {
    pub heads: usize,
    pub d: usize,
    pub s: usize,
    pub bias: bool,
}

impl GmDims {
    /// Elements per head of mem_w1, mem_b1, mem_w2, mem_b2, gate_w1, gate_b1, gate_w2 (the packed
    /// order, which `GatedMemoryLayer::named` follows), whether or not the biases exist.
    pub fn per_head_sizes(&self) -> [usize; 7] {
        let (d, d2, s) = (self.d, 2 * self.d, self.s);
        [d * d2, d2, d2 * d, d, d * s, s, s]
    }

    /// Element offsets of the seven tensors in the packed vector (−1: absent) and its length.
    pub fn offsets(&self) -> ([i64; 7], usize) {
        let sizes = self.per_head_sizes().map(|n| n * self.heads);
        let present = [true, self.bias, true, self.bias, true, self.bias, true];
        let mut off = [-1i64; 7];
        let mut at = 0usize;
        for i in 0..7 {
            if present[i] {
                off[i] = at as i64;
                at += sizes[i];
            }
        }
        (off, at)
    }
}


/// One head's weights as slices of the packed vector (f32, or f16 for decoding).
struct HeadWeights<'a, T = f32> {
    w1: &'a [T],
    b1: Option<&'a [T]>,
    w2: &'a [T],
    b2: Option<&'a [T]>,
    g1: &'a [T],
    c1: Option<&'a [T]>,
    g2: &'a [T],
}

fn head<T>(p: &[T], dims: GmDims, h: usize) -> HeadWeights<'_, T> {
    let (off, _) = dims.offsets();
    let per = dims.per_head_sizes();
    let at = |i: usize| -> Option<&[T]> {
        (off[i] >= 0).then(|| &p[off[i] as usize + h * per[i]..off[i] as usize + (h + 1) * per[i]])
    };
    HeadWeights {
        w1: at(0).unwrap(),
        b1: at(1),
        w2: at(2).unwrap(),
        b2: at(3),
        g1: at(4).unwrap(),
        c1: at(5),
        g2: at(6).unwrap(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;
    use candle_core::{Device, Tensor};

    pub(super) fn rand(shape: (usize, usize, usize, usize), seed: u64) -> Tensor {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        Tensor::from_vec(Rng::new(seed).vec(n, 1.0), shape, &Device::Cpu).unwrap()
    }

    /// The packed parameters of a freshly initialised layer (the values `GatedMemory::new` draws
    /// for `seed`: per tensor in packed order, kaiming-uniform with bound 1/√fan_in).
    pub(super) fn packed_layer(dims: GmDims, seed: u64) -> Vec<f32> {
        let (d, s) = (dims.d, dims.s);
        let fan_in = [d, d, 2 * d, 2 * d, d, d, s];
        let present = [true, dims.bias, true, dims.bias, true, dims.bias, true];
        let mut rng = Rng::new(seed);
        let mut p = Vec::new();
        for ((n, fan_in), present) in dims.per_head_sizes().into_iter().zip(fan_in).zip(present) {
            if present {
                p.extend(rng.vec(dims.heads * n, 1.0 / (fan_in as f32).sqrt()));
            }
        }
        p
    }

    // The fast CPU path (gemm per head) equals the per-row reference, forward and backward, with
    // and without biases, for batch 2 and a `t` that is not a multiple of any block size.
    #[test]
    fn fast_path_matches_reference() {
        for bias in [false, true] {
            let dims = GmDims { heads: 3, d: 16, s: 4, bias };
            let p = packed_layer(dims, 11);
            assert_eq!(p.len(), dims.offsets().1);
            let t = 7;
            let data = |seed| rand((2, 3, t, 16), seed).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (q, a, go) = (data(21), data(22), data(23));
            let close = |x: &[f32], y: &[f32], what: &str| {
                let scale = y.iter().fold(1f32, |m, v| m.max(v.abs()));
                let diff = x.iter().zip(y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(x.len() == y.len() && diff / scale < 1e-5, "{what} (bias {bias}): {diff}");
            };
            close(&fast_forward(&q, &a, &p, dims, t), &reference_forward(&q, &a, &p, dims, t), "forward");
            let fast = fast_backward(&q, &a, &p, &go, dims, t);
            let slow = reference_backward(&q, &a, &p, &go, dims, t);
            close(&fast.0, &slow.0, "dq");
            close(&fast.1, &slow.1, "dattn");
            close(&fast.2, &slow.2, "dp");
        }
    }
}
