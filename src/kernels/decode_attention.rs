//! Decode attention on the CPU: one query row per sequence, each over its own KV cache, all
//! sequences of a batch step in one call (continuous batching). Done with candle ops it costs
//! some twenty small ops per sequence and layer, which for a batch of short answers costs more
//! than the matmuls; here it is one parallel loop over (sequence, head). A sequence alone takes
//! the same loop, so its arithmetic does not depend on who else is in the batch.

use super::math::exp_f32;

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
///
/// One unit of work is a (sequence, KV head): its query heads share each key and value row read
/// from the cache. Units run on candle's CPU thread pool, the one the quantized matmuls around
/// this call use (a second pool would compete with its spinning workers for the cores).
pub fn decode_attention(q: &[f32], caches: &[DecodeCache], heads: usize, kv_heads: usize, d: usize, scale: f32) -> Vec<f32> {
    let kv_heads = kv_heads.max(1);
    let groups = (heads / kv_heads).max(1);
    let mut out = vec![0f32; caches.len() * heads * d];
    let units = caches.len() * kv_heads;
    let out_ptr = SharedOut(out.as_mut_ptr());
    let run = |range: std::ops::Range<usize>| {
        let out = &out_ptr;
        let mut scores = Vec::new();
        for unit in range {
            let (i, kvh) = (unit / kv_heads, unit % kv_heads);
            let first = i * heads + kvh * groups;
            // SAFETY: unit (i, kvh) writes only the rows of its own query heads.
            let o = unsafe { std::slice::from_raw_parts_mut(out.0.add(first * d), groups * d) };
            attend_unit(&q[first * d..(first + groups) * d], &caches[i], kvh, d, scale, o, &mut scores);
        }
    };
    // Small steps (one sequence, short caches) are not worth waking the thread pool for.
    let work: usize = caches.iter().map(|c| c.len).sum::<usize>() * heads * d;
    if work < PARALLEL_WORK {
        run(0..units);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(units, run);
    }
    out
}

/// The query heads `q` (`[g, d]`) of one KV head `kvh` over one cache, into `o` (`[g, d]`).
fn attend_unit(q: &[f32], c: &DecodeCache, kvh: usize, d: usize, scale: f32, o: &mut [f32], scores: &mut Vec<f32>) {
    let g = q.len() / d;
    let base = kvh * c.capacity * d;
    let (k, v) = (&c.k[base..base + c.len * d], &c.v[base..base + c.len * d]);
    scores.clear();
    scores.resize(g * c.len, 0.0);
    for (j, kr) in k.chunks_exact(d).enumerate() {
        for h in 0..g {
            scores[h * c.len + j] = dot(&q[h * d..(h + 1) * d], kr) * scale;
        }
    }
    for (s, oh) in scores.chunks_exact_mut(c.len).zip(o.chunks_exact_mut(d)) {
        if let Some(bias) = c.bias {
            for (x, b) in s.iter_mut().zip(bias) {
                *x += b;
            }
        }
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for x in s.iter_mut() {
            *x = exp_f32(*x - max);
        }
        let sum = lane_sum(s);
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        for (w, vr) in s.iter().zip(v.chunks_exact(d)) {
            let w = w * inv;
            for (x, vx) in oh.iter_mut().zip(vr) {
                *x = w.mul_add(*vx, *x);
            }
        }
    }
}

struct SharedOut(*mut f32);
// SAFETY: the units writing through it touch disjoint rows (see `decode_attention`).
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

/// Multiply-adds below which the loop runs on the calling thread.
const PARALLEL_WORK: usize = 1 << 16;

/// Lanes of the vector loops: one AVX-512 register of f32. A plain `zip().sum()` is a serial
/// chain the compiler may not reorder; 16 independent partial sums vectorise.
const LANES: usize = 16;

/// `a·b` in 16 lanes, the lanes then summed pairwise.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (xa, xb) in ac.zip(bc) {
        for l in 0..LANES {
            acc[l] = xa[l].mul_add(xb[l], acc[l]);
        }
    }
    fold_lanes(acc) + tail
}

/// `Σ x` in 16 lanes.
#[inline(always)]
fn lane_sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let c = x.chunks_exact(LANES);
    let tail: f32 = c.remainder().iter().sum();
    for xs in c {
        for l in 0..LANES {
            acc[l] += xs[l];
        }
    }
    fold_lanes(acc) + tail
}

#[inline(always)]
fn fold_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0]
}

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
