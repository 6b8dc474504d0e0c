//! The batch decode mix: a frozen layer's weights in int8 with per-row scales (`DecodeWeights`),
//! one decoding row per head mixed with AVX-512 / AVX2 products, and a batch step's rows mixed in
//! one pass of candle's CPU thread pool.

use super::fast::add_bias;
use super::{head, GmDims};
use crate::kernels::math::sigmoid_fast;

/// A frozen layer's parameters as the batch decode mix reads them: each head's three weight
/// matrices (`w1` `[d, 2d]`, `w2` `[2d, d]`, `g1` `[d, s]`) in int8 with one f32 scale per row —
/// the row one input value multiplies, so `x·W = Σ_k (x_k·s_k)·q_k` — and the biases and `g2` in
/// f32: a quarter of the f32 bytes. At 16 sequences on 16 documents a decode step reads every
/// sequence's adapter (18.3 MB in f32 on the default model's 30 layers).
#[derive(Clone)]
pub struct DecodeWeights {
    dims: GmDims,
    heads: Vec<DecodeHead>,
}

#[derive(Clone)]
struct DecodeHead {
    w1: RowsQ8,
    w2: RowsQ8,
    g1: RowsQ8,
    b1: Option<Vec<f32>>,
    b2: Option<Vec<f32>>,
    c1: Option<Vec<f32>>,
    g2: Vec<f32>,
}

/// A row-major `[k, n]` matrix in int8, each row scaled by its largest magnitude / 127.
#[derive(Clone)]
struct RowsQ8 {
    q: Vec<i8>,
    scale: Vec<f32>,
    n: usize,
}

impl RowsQ8 {
    fn new(w: &[f32], n: usize) -> Self {
        let mut q = Vec::with_capacity(w.len());
        let mut scale = Vec::with_capacity(w.len() / n.max(1));
        for row in w.chunks(n) {
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let s = amax / 127.0;
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            q.extend(row.iter().map(|v| (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8));
            scale.push(s);
        }
        Self { q, scale, n }
    }

    fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scale.len()
    }

    /// `dst = x·W`: rows added in turn, each element's `(x_k·s_k)·q + o` fused, in the same order
    /// with AVX-512 or AVX2 (outputs in registers, a row's bytes widened as they load) as without.
    fn times(&self, dst: &mut [f32], x: &[f32]) {
        let n = self.n;
        assert!(dst.len() == n && self.q.len() >= x.len() * n && self.scale.len() >= x.len(), "a [k, n] product of other shapes");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F is present; the shapes are asserted above.
            let done = unsafe {
                match n {
                    64 => self.avx512_times::<4>(dst, x),
                    128 => self.avx512_times::<8>(dst, x),
                    16 => self.avx512_times::<1>(dst, x),
                    32 => self.avx512_times::<2>(dst, x),
                    _ => false,
                }
            };
            if done {
                return;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if n % 8 == 0 && avx2_fma() {
            // Passes of at most 64 outputs (8 registers).
            for col in (0..n).step_by(64) {
                // SAFETY: AVX2 and FMA are present; col + (n − col).min(64) ≤ n.
                unsafe {
                    match n - col {
                        8 => self.avx2_times::<1>(dst, x, col),
                        16 => self.avx2_times::<2>(dst, x, col),
                        24 => self.avx2_times::<3>(dst, x, col),
                        32 => self.avx2_times::<4>(dst, x, col),
                        40 => self.avx2_times::<5>(dst, x, col),
                        48 => self.avx2_times::<6>(dst, x, col),
                        56 => self.avx2_times::<7>(dst, x, col),
                        _ => self.avx2_times::<8>(dst, x, col),
                    }
                }
            }
            return;
        }
        dst.fill(0.0);
        for (k, &xv) in x.iter().enumerate() {
            let xs = xv * self.scale[k];
            for (o, &qv) in dst.iter_mut().zip(&self.q[k * n..(k + 1) * n]) {
                *o = xs.mul_add(qv as f32, *o);
            }
        }
    }

    /// # Safety
    /// The CPU has AVX-512F; `dst` is `16·B` values and the matrix has `x.len()` rows of them.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512_times<const B: usize>(&self, dst: &mut [f32], x: &[f32]) -> bool {
        use std::arch::x86_64::*;
        let n = 16 * B;
        if dst.len() != n {
            return false;
        }
        // SAFETY: every load is inside `q` (x.len() rows of n, the caller's contract), every
        // store inside `dst`.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); B];
            for (k, &xv) in x.iter().enumerate() {
                let xs = _mm512_set1_ps(xv * *self.scale.get_unchecked(k));
                let row = self.q.as_ptr().add(k * n);
                for (c, a) in acc.iter_mut().enumerate() {
                    let bytes = _mm_loadu_si128(row.add(16 * c).cast());
                    *a = _mm512_fmadd_ps(xs, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(dst.as_mut_ptr().add(16 * c), *a);
            }
        }
        true
    }

    /// Columns `col..col + 8·C` of `dst = x·W` (C ≤ 8: the outputs in registers), as `times`
    /// adds them: each row's `(x_k·s_k)·q + o` fused, rows in turn.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `col + 8·C ≤ n = dst.len()` and the matrix has `x.len()` rows.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_times<const C: usize>(&self, dst: &mut [f32], x: &[f32], col: usize) {
        use std::arch::x86_64::*;
        let n = self.n;
        assert!(col + 8 * C <= n && dst.len() == n);
        // SAFETY: every load is inside `q` (x.len() rows of n, the caller's contract), every
        // store inside `dst` (asserted).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); C];
            for (k, &xv) in x.iter().enumerate() {
                let xs = _mm256_set1_ps(xv * *self.scale.get_unchecked(k));
                let row = self.q.as_ptr().add(k * n + col);
                for (c, a) in acc.iter_mut().enumerate() {
                    let bytes = _mm_loadl_epi64(row.add(8 * c).cast());
                    *a = _mm256_fmadd_ps(xs, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), *a);
                }
            }
            for (c, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(dst.as_mut_ptr().add(col + 8 * c), *a);
            }
        }
    }
}

/// Whether the CPU has AVX2 and FMA (checked once).
#[cfg(target_arch = "x86_64")]
fn avx2_fma() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

impl DecodeWeights {
    /// From a layer's packed f32 parameters (`GatedMemoryLayer::packed`).
    pub fn new(packed: &[f32], dims: GmDims) -> Self {
        let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
        let heads = (0..dims.heads)
            .map(|h| {
                let w = head(packed, dims, h);
                DecodeHead {
                    w1: RowsQ8::new(w.w1, d2),
                    w2: RowsQ8::new(w.w2, d),
                    g1: RowsQ8::new(w.g1, s),
                    b1: w.b1.map(<[f32]>::to_vec),
                    b2: w.b2.map(<[f32]>::to_vec),
                    c1: w.c1.map(<[f32]>::to_vec),
                    g2: w.g2.to_vec(),
                }
            })
            .collect();
        Self { dims, heads }
    }

    /// Bytes held (what a decode step reads for this layer).
    pub fn bytes(&self) -> usize {
        let small = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| 4 * v.len());
        self.heads
            .iter()
            .map(|h| h.w1.bytes() + h.w2.bytes() + h.g1.bytes() + small(&h.b1) + small(&h.b2) + small(&h.c1) + 4 * h.g2.len())
            .sum()
    }

    /// One head of one decoding row in place, `attn ← attn + g·(m − attn)` for the head's
    /// pre-RoPE query `q` — `mix_block` at `t` = 1 with these weights. `scratch` is reused
    /// between calls.
    pub fn mix_row(&self, q: &[f32], attn: &mut [f32], head_index: usize, scratch: &mut Vec<f32>) {
        let w = &self.heads[head_index];
        let (d, d2, s) = (self.dims.d, 2 * self.dims.d, self.dims.s);
        scratch.resize(2 * d2 + d + s, 0.0);
        let (a1, rest) = scratch.split_at_mut(d2);
        let (z1, rest) = rest.split_at_mut(d2);
        let (m, ag) = rest.split_at_mut(d);
        w.w1.times(a1, q);
        add_bias(a1, w.b1.as_deref());
        for (z, &v) in z1.iter_mut().zip(a1.iter()) {
            *z = v * sigmoid_fast(v);
        }
        w.w2.times(m, z1);
        add_bias(m, w.b2.as_deref());
        w.g1.times(ag, q);
        add_bias(ag, w.c1.as_deref());
        let z: f32 = (0..s).map(|c| ag[c] * sigmoid_fast(ag[c]) * w.g2[c]).sum();
        let g = sigmoid_fast(3.0 * (z - 1.0));
        for (a, mj) in attn.iter_mut().zip(m.iter()) {
            *a = *a + g * (mj - *a);
        }
    }
}

/// The Gated Memory mixes of a batch decode step, in place, in one pass of candle's CPU thread
/// pool over (sequence, head): `attn` and `q` (pre-RoPE) are `[n, heads, d]`, one row per
/// decoding sequence; `rows` lists the sequences to mix with their layer's decode weights. One
/// call per sequence instead ran each mix on the calling thread in turn while the pool's other
/// workers waited. A row's arithmetic does not depend on the others.
pub fn mix_decode_rows(q: &[f32], attn: &mut [f32], rows: &[(usize, &DecodeWeights)]) {
    let Some(&(_, first)) = rows.first() else { return };
    let (heads, d) = (first.dims.heads, first.dims.d);
    let ptr = SharedRows(attn.as_mut_ptr());
    let len = attn.len();
    let run = |range: std::ops::Range<usize>| {
        let ptr = &ptr;
        let mut scratch = Vec::new();
        for unit in range {
            let (&(row, weights), h) = (&rows[unit / heads], unit % heads);
            let at = (row * heads + h) * d;
            assert!(at + d <= len && weights.dims.heads == heads && weights.dims.d == d, "a mix row outside the batch");
            // SAFETY: unit (row, h) alone touches these d values (rows are distinct sequences).
            let a = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(at), d) };
            weights.mix_row(&q[at..at + d], a, h, &mut scratch);
        }
    };
    if rows.len() < 2 {
        run(0..rows.len() * heads);
    } else {
        candle_core::utils::barrier_pool().execute_chunked(rows.len() * heads, run);
    }
}

struct SharedRows(*mut f32);
// SAFETY: the units writing through it touch disjoint rows (see `mix_decode_rows`).
unsafe impl Sync for SharedRows {}
unsafe impl Send for SharedRows {}

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::fast::mix_block;
    use super::super::tests::{packed_layer, rand};

    // The decode mix from int8 weights (per-row scales): close to the fast path's block at t = 1
    // with the f32 weights; a batch of rows in one pool pass bit for bit each row alone; the
    // AVX-512 product bit for bit the plain loop. Head size 64 (the default model's), with and
    // without biases.
    #[test]
    fn decode_rows_match_the_block_path() {
        for bias in [false, true] {
            let dims = GmDims { heads: 3, d: 64, s: 8, bias };
            let p = packed_layer(dims, 5);
            let weights = DecodeWeights::new(&p, dims);
            assert!(weights.bytes() * 3 < p.len() * 4, "int8 weights are not smaller: {}", weights.bytes());
            let n = 4;
            let data = |seed| rand((n, 3, 1, 64), seed).flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (q, a) = (data(31), data(32));
            let mut want = a.clone();
            for (i, (qb, ab)) in q.chunks(64).zip(want.chunks_mut(64)).enumerate() {
                mix_block(qb, ab, &p, dims, i % 3, 1);
            }
            let mut got = a.clone();
            let rows: Vec<(usize, &DecodeWeights)> = (0..n).map(|r| (r, &weights)).collect();
            mix_decode_rows(&q, &mut got, &rows);
            // The mixed output against the exact one: within 1% of the mix's own change
            // g·(m − attn) (0.18% measured).
            let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
            let diff = got.iter().zip(&want).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            let moved = want.iter().zip(&a).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(diff > 0.0 && diff < 0.01 * moved, "bias {bias}: int8 weights moved the mix by {diff} (the mix itself {moved}, scale {scale})");
            for r in 0..n {
                let mut alone = a.clone();
                mix_decode_rows(&q, &mut alone, &[(r, &weights)]);
                assert_eq!(alone[r * 192..(r + 1) * 192], got[r * 192..(r + 1) * 192], "bias {bias}: row {r}");
            }
            // The vector products (whichever path the CPU runs) against the plain loop, bit for
            // bit: w1 (128 outputs: two passes of AVX2's registers), w2 (64), g1 (8).
            let z: Vec<f32> = q.iter().chain(&a).take(128).copied().collect();
            let head = &weights.heads[1];
            for (m, x) in [(&head.w1, &q[..64]), (&head.w2, &z[..]), (&head.g1, &q[..64])] {
                let mut fast = vec![0f32; m.n];
                m.times(&mut fast, x);
                let mut plain = vec![0f32; m.n];
                for (k, &xv) in x.iter().enumerate() {
                    let xs = xv * m.scale[k];
                    for (o, &qv) in plain.iter_mut().zip(&m.q[k * m.n..(k + 1) * m.n]) {
                        *o = xs.mul_add(qv as f32, *o);
                    }
                }
                assert_eq!(fast, plain, "a product of {} outputs", m.n);
            }
        }
    }

}
