//! Decode attention on the CPU: one query row per sequence, each over its own KV cache, all
//! sequences of a batch step in one call (continuous batching). Done with candle ops it costs
//! some twenty small ops per sequence and layer, which for a batch of short answers costs more
//! than the matmuls; here it is one parallel loop over (sequence, head). A sequence alone takes
//! the same loop, so its arithmetic does not depend on who else is in the batch.

use super::math::exp_f32;
use rayon::prelude::*;

/// One sequence's keys and values for one layer: `[kv_heads, capacity, d]` buffers of which the
/// first `len` positions are filled, and an additive bias per key (FltLM's soft mask).
pub struct DecodeCache<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub capacity: usize,
    pub len: usize,
    pub bias: Option<&'a [f32]>,
}

/// `q`: `[n, heads, d]` (after RoPE); returns `[n, heads, d]`:
/// `softmax(q·Kᵀ·scale + bias)·V` per sequence and head, query head `h` reading KV head
/// `h / (heads / kv_heads)`.
pub fn decode_attention(q: &[f32], caches: &[DecodeCache], heads: usize, kv_heads: usize, d: usize, scale: f32) -> Vec<f32> {
    let groups = (heads / kv_heads.max(1)).max(1);
    let mut out = vec![0f32; caches.len() * heads * d];
    let one = |(row, o): (usize, &mut [f32])| {
        let (i, h) = (row / heads, row % heads);
        let c = &caches[i];
        let base = (h / groups) * c.capacity * d;
        let qrow = &q[row * d..(row + 1) * d];
        let mut scores: Vec<f32> = (0..c.len)
            .map(|j| {
                let k = &c.k[base + j * d..base + (j + 1) * d];
                let s = qrow.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                s + c.bias.map_or(0.0, |b| b[j])
            })
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for s in scores.iter_mut() {
            *s = exp_f32(*s - max);
            sum += *s;
        }
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        for (j, w) in scores.iter().enumerate() {
            let v = &c.v[base + j * d..base + (j + 1) * d];
            let w = w * inv;
            for (x, vx) in o.iter_mut().zip(v) {
                *x += w * vx;
            }
        }
    };
    // Small steps (one sequence, short caches) are not worth waking the thread pool for.
    let work: usize = caches.iter().map(|c| c.len).sum::<usize>() * heads * d;
    if work < PARALLEL_WORK {
        out.chunks_mut(d).enumerate().for_each(one);
    } else {
        out.par_chunks_mut(d).enumerate().for_each(one);
    }
    out
}

/// Multiply-adds below which the loop runs on the calling thread.
const PARALLEL_WORK: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// Against candle's ops (the prompt path's arithmetic): GQA, caches of different lengths in
    /// buffers with spare capacity, a bias with a masked key.
    #[test]
    fn matches_softmax_attention_of_candle_ops() {
        let (heads, kv_heads, d) = (6, 2, 8);
        let dev = Device::Cpu;
        let lens = [5usize, 1, 9];
        let cap = 12;
        let q = Tensor::randn(0f32, 1.0, (lens.len(), heads, d), &dev).unwrap();
        let ks: Vec<Tensor> = lens.iter().map(|_| Tensor::randn(0f32, 1.0, (kv_heads, cap, d), &dev).unwrap()).collect();
        let vs: Vec<Tensor> = lens.iter().map(|_| Tensor::randn(0f32, 1.0, (kv_heads, cap, d), &dev).unwrap()).collect();
        let mut bias = vec![0f32; lens[2]];
        bias[3] = f32::NEG_INFINITY;
        bias[4] = -1.5;
        let (kv, vv): (Vec<Vec<f32>>, Vec<Vec<f32>>) = ks
            .iter()
            .zip(&vs)
            .map(|(k, v)| (k.flatten_all().unwrap().to_vec1().unwrap(), v.flatten_all().unwrap().to_vec1().unwrap()))
            .unzip();
        let caches: Vec<DecodeCache> = (0..lens.len())
            .map(|i| DecodeCache { k: &kv[i], v: &vv[i], capacity: cap, len: lens[i], bias: (i == 2).then_some(&bias[..]) })
            .collect();
        let scale = 1.0 / (d as f32).sqrt();
        let got = decode_attention(&q.flatten_all().unwrap().to_vec1().unwrap(), &caches, heads, kv_heads, d, scale);
        for (i, &len) in lens.iter().enumerate() {
            let k = ks[i].narrow(1, 0, len).unwrap();
            let v = vs[i].narrow(1, 0, len).unwrap();
            let rep = |x: &Tensor| x.unsqueeze(1).unwrap().expand((kv_heads, heads / kv_heads, len, d)).unwrap().reshape((heads, len, d)).unwrap();
            let qi = q.get(i).unwrap().unsqueeze(1).unwrap();
            let mut s = (qi.matmul(&rep(&k).t().unwrap()).unwrap() * scale as f64).unwrap();
            if i == 2 {
                s = s.broadcast_add(&Tensor::new(bias.as_slice(), &dev).unwrap()).unwrap();
            }
            let p = candle_nn::ops::softmax_last_dim(&s).unwrap();
            let want: Vec<f32> = p.matmul(&rep(&v)).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let have = &got[i * heads * d..(i + 1) * heads * d];
            let diff = want.iter().zip(have).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-5, "sequence {i}: {diff}");
        }
    }
}
