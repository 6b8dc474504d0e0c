//! Decode attention on the CPU: one query row per sequence, each over its own KV cache, all
//! sequences of a batch step in one call (continuous batching). Done with candle ops it costs
//! some twenty small ops per sequence and layer, which for a batch of short answers costs more
//! than the matmuls; here it is one parallel loop over (sequence, head). A sequence alone takes
//! the same loop, so its arithmetic does not depend on who else is in the batch.

use super::math::{exp_f32, StoredFloat};
#[cfg(test)]
use half::f16;

/// One sequence's keys and values for one layer: `[kv_heads, capacity, d]` buffers of which
/// the first `len` positions are filled, and an additive bias per key (FltLM's soft mask).
pub struct DecodeCache<'a, T> {
    pub k: &'a [T],
    pub v: &'a [T],
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
pub fn decode_attention<T: StoredFloat>(q: &[f32], caches: &[DecodeCache<T>], heads: usize, kv_heads: usize, d: usize, scale: f32) -> Vec<f32> {
    decode_attention_on(simd(), q, caches, heads, kv_heads, d, scale)
}

/// [`decode_attention`] on the given instructions (which the CPU must have): tests compare them.
pub fn decode_attention_on<T: StoredFloat>(
    simd: Simd,
    q: &[f32],
    caches: &[DecodeCache<T>],
    heads: usize,
    kv_heads: usize,
    d: usize,
    scale: f32,
) -> Vec<f32> {
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
            let q = &q[first * d..(first + groups) * d];
            match (d, groups) {
                (64, 1) => attend_unit_64::<T, 1>(simd, q, &caches[i], kvh, scale, o, &mut scores),
                (64, 2) => attend_unit_64::<T, 2>(simd, q, &caches[i], kvh, scale, o, &mut scores),
                (64, 3) => attend_unit_64::<T, 3>(simd, q, &caches[i], kvh, scale, o, &mut scores),
                (64, 4) => attend_unit_64::<T, 4>(simd, q, &caches[i], kvh, scale, o, &mut scores),
                _ => attend_unit(q, &caches[i], kvh, d, scale, o, &mut scores),
            }
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
fn attend_unit<T: StoredFloat>(q: &[f32], c: &DecodeCache<T>, kvh: usize, d: usize, scale: f32, o: &mut [f32], scores: &mut Vec<f32>) {
    let g = q.len() / d;
    let base = kvh * c.capacity * d;
    let (k, v) = (&c.k[base..base + c.len * d], &c.v[base..base + c.len * d]);
    let mut row = vec![0f32; d];
    scores.clear();
    scores.resize(g * c.len, 0.0);
    for (j, kr) in k.chunks_exact(d).enumerate() {
        T::to_f32s(kr, &mut row);
        for h in 0..g {
            scores[h * c.len + j] = dot(&q[h * d..(h + 1) * d], &row) * scale;
        }
    }
    for (s, oh) in scores.chunks_exact_mut(c.len).zip(o.chunks_exact_mut(d)) {
        let inv = exp_scores(s, c.bias);
        for (w, vr) in s.iter().zip(v.chunks_exact(d)) {
            T::to_f32s(vr, &mut row);
            let w = w * inv;
            for (x, vx) in oh.iter_mut().zip(&row) {
                *x = w.mul_add(*vx, *x);
            }
        }
    }
}

/// One head's scores (scaled) into unnormalised softmax weights, in place: the bias added, the
/// maximum subtracted, exponentiated. Returns 1 / their sum (0 when every key is masked).
fn exp_scores(s: &mut [f32], bias: Option<&[f32]>) -> f32 {
    if let Some(bias) = bias {
        for (x, b) in s.iter_mut().zip(bias) {
            *x += b;
        }
    }
    let max = lane_max(s);
    for x in s.iter_mut() {
        *x = exp_f32(*x - max);
    }
    let sum = lane_sum(s);
    if sum > 0.0 {
        1.0 / sum
    } else {
        0.0
    }
}

/// The vector instructions [`attend_unit_64`] runs on, picked once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    /// 16-key score blocks and 16-lane value rows.
    Avx512,
    /// 8-key score blocks and 8-lane value rows (AVX2, FMA and F16C).
    Avx2,
    /// Plain loops (what the compiler vectorises of them).
    Scalar,
}

/// The best [`Simd`] this CPU runs.
pub fn simd() -> Simd {
    static SIMD: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
    *SIMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                return Simd::Avx512;
            }
            if avx2::available() {
                return Simd::Avx2;
            }
        }
        Simd::Scalar
    })
}

/// [`attend_unit`] for head size 64 and `G` query heads per KV head known at compile time
/// (1–4 covers the SmolLM2 family): the query heads and the output rows stay in registers for
/// the whole cache instead of being re-read and re-written per key, and the scores are made a
/// block of keys at a time (16 with AVX-512, 8 with AVX2), their horizontal sums folded together
/// in rounds of permutes ([`avx512::block_scores`], [`avx2::block_scores`]) in the order of
/// [`dot`]'s lanes: every path gives the scalar loop's scores and outputs bit for bit. The general
/// loop's sum per key and head, and its per-key read-modify-write of the output, bounded it at
/// ~7 GMAC/s per thread.
fn attend_unit_64<T: StoredFloat, const G: usize>(simd: Simd, q: &[f32], c: &DecodeCache<T>, kvh: usize, scale: f32, o: &mut [f32], scores: &mut Vec<f32>) {
    const D: usize = 64;
    let len = c.len;
    let base = kvh * c.capacity * D;
    let (k, v) = (&c.k[base..base + len * D], &c.v[base..base + len * D]);
    let qh: [&[f32; D]; G] = std::array::from_fn(|h| q[h * D..(h + 1) * D].try_into().expect("a 64-wide query head"));
    scores.clear();
    scores.resize(G * len, 0.0);
    match simd {
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => block_scores::<T, G, 16>(&qh, k, len, scores, |q, rows, out| {
            // SAFETY: `simd()` found AVX-512F.
            unsafe { avx512::block_scores(q, rows, out) }
        }),
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => block_scores::<T, G, 8>(&qh, k, len, scores, |q, rows, out| {
            // SAFETY: `simd()` found AVX2, FMA and F16C.
            unsafe { avx2::block_scores(q, rows, out) }
        }),
        _ => {
            let mut row = [0f32; D];
            for (j, kr) in k.chunks_exact(D).enumerate() {
                T::to_f32s(kr, &mut row);
                for (h, q) in qh.iter().enumerate() {
                    scores[h * len + j] = dot(&q[..], &row);
                }
            }
        }
    }
    let mut inv = [0f32; G];
    for (h, s) in scores.chunks_exact_mut(len).enumerate() {
        for x in s.iter_mut() {
            *x *= scale;
        }
        inv[h] = exp_scores(s, c.bias);
    }
    let mut acc = [[0f32; D]; G];
    match simd {
        // SAFETY: `simd()` found AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 => unsafe { avx512::weighted_values::<T, G>(scores, v, &mut acc) },
        // SAFETY: `simd()` found AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx2 => unsafe { avx2::weighted_values::<T, G>(scores, v, &mut acc) },
        _ => {
            let mut row = [0f32; D];
            for (j, vr) in v.chunks_exact(D).enumerate() {
                T::to_f32s(vr, &mut row);
                for h in 0..G {
                    let w = scores[h * len + j];
                    for (a, x) in acc[h].iter_mut().zip(&row) {
                        *a = w.mul_add(*x, *a);
                    }
                }
            }
        }
    }
    for (h, oh) in o.chunks_exact_mut(D).enumerate() {
        for (x, a) in oh.iter_mut().zip(&acc[h]) {
            *x = a * inv[h];
        }
    }
}

/// The scores of `G` query heads over `len` key rows of 64 (`k`), `B` keys at a time through
/// `block` (`q`, `B` rows, `B` scores); the last, partial block's rows are copied into a
/// zero-padded one.
#[cfg(target_arch = "x86_64")]
fn block_scores<T: StoredFloat, const G: usize, const B: usize>(
    qh: &[&[f32; 64]; G],
    k: &[T],
    len: usize,
    scores: &mut [f32],
    block: impl Fn(&[f32; 64], &[T], &mut [f32; B]),
) {
    const D: usize = 64;
    let mut padded: Option<[T; 16 * D]> = None;
    let mut out = [0f32; B];
    for start in (0..len).step_by(B) {
        let n = B.min(len - start);
        let rows = if n == B {
            &k[start * D..(start + B) * D]
        } else {
            let padded = padded.get_or_insert([T::default(); 16 * D]);
            padded[..n * D].copy_from_slice(&k[start * D..]);
            padded[n * D..B * D].fill(T::default());
            &padded[..B * D]
        };
        for (h, q) in qh.iter().enumerate() {
            block(q, rows, &mut out);
            scores[h * len + start..h * len + start + n].copy_from_slice(&out[..n]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::StoredFloat;
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    /// Lane indices of one folding round over groups of `2w` lanes: lane `m < w` of a group
    /// takes `a`'s lanes `m` and `m + w` of that group, lane `m ≥ w` takes `b`'s lanes `m − w`
    /// and `m` (indices ≥ 16 pick from `b`). After rounds of w = 8, 4, 2, 1 over pairs of
    /// vectors, lane `l` holds the whole sum of vector `l`.
    const fn fold_indices(w: usize, second: bool) -> [i32; 16] {
        let mut idx = [0i32; 16];
        let mut l = 0;
        while l < 16 {
            let (g, m) = (l / (2 * w) * 2 * w, l % (2 * w));
            let off = if second { w } else { 0 };
            idx[l] = if m < w { (g + m + off) as i32 } else { (16 + g + m - w + off) as i32 };
            l += 1;
        }
        idx
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold(a: __m512, b: __m512, first: &[i32; 16], second: &[i32; 16]) -> __m512 {
        // SAFETY: the index arrays are 16 i32s, as the unaligned loads read.
        let (i, j) = unsafe { (_mm512_loadu_si512(first.as_ptr().cast()), _mm512_loadu_si512(second.as_ptr().cast())) };
        _mm512_add_ps(_mm512_permutex2var_ps(a, i, b), _mm512_permutex2var_ps(a, j, b))
    }

    /// `out[r] = q · k[r]` for 16 key rows of 64 (`k`: `[16, 64]`).
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn block_scores<T: StoredFloat>(q: &[f32; 64], k: &[T], out: &mut [f32; 16]) {
        const R8: [[i32; 16]; 2] = [fold_indices(8, false), fold_indices(8, true)];
        const R4: [[i32; 16]; 2] = [fold_indices(4, false), fold_indices(4, true)];
        const R2: [[i32; 16]; 2] = [fold_indices(2, false), fold_indices(2, true)];
        const R1: [[i32; 16]; 2] = [fold_indices(1, false), fold_indices(1, true)];
        assert!(k.len() >= 16 * 64);
        // SAFETY: q holds 64 floats, k at least 16 rows of 64 (asserted), out 16.
        unsafe {
            let qv = [0, 16, 32, 48].map(|o| _mm512_loadu_ps(q.as_ptr().add(o)));
            let p: [__m512; 16] = std::array::from_fn(|r| {
                let row = k.as_ptr().add(r * 64);
                let mut acc = _mm512_mul_ps(qv[0], T::load16(row));
                for c in 1..4 {
                    acc = _mm512_fmadd_ps(qv[c], T::load16(row.add(c * 16)), acc);
                }
                acc
            });
            let t8: [__m512; 8] = std::array::from_fn(|r| fold(p[r], p[r + 8], &R8[0], &R8[1]));
            let t4: [__m512; 4] = std::array::from_fn(|r| fold(t8[r], t8[r + 4], &R4[0], &R4[1]));
            let t2: [__m512; 2] = std::array::from_fn(|r| fold(t4[r], t4[r + 2], &R2[0], &R2[1]));
            _mm512_storeu_ps(out.as_mut_ptr(), fold(t2[0], t2[1], &R1[0], &R1[1]));
        }
    }

    /// `acc[h] = Σ_j w[h·len + j] · v[j]` over the `len` value rows of 64 in `v` (`[len, 64]`):
    /// the `G` output rows in registers, each value row converted once for all of them; the
    /// same fused multiply-add per element, in the same order, as the scalar loop.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn weighted_values<T: StoredFloat, const G: usize>(w: &[f32], v: &[T], acc: &mut [[f32; 64]; G]) {
        let len = v.len() / 64;
        assert!(w.len() >= G * len);
        // SAFETY: v holds `len` rows of 64, w `G·len` weights (asserted), acc G rows of 64.
        unsafe {
            let mut a = [[_mm512_setzero_ps(); 4]; G];
            for j in 0..len {
                let row = v.as_ptr().add(j * 64);
                let x = [0, 16, 32, 48].map(|o| T::load16(row.add(o)));
                for h in 0..G {
                    let wj = _mm512_set1_ps(*w.get_unchecked(h * len + j));
                    for c in 0..4 {
                        a[h][c] = _mm512_fmadd_ps(wj, x[c], a[h][c]);
                    }
                }
            }
            for h in 0..G {
                for c in 0..4 {
                    _mm512_storeu_ps(acc[h].as_mut_ptr().add(c * 16), a[h][c]);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::StoredFloat;
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }

    /// `out[r] = q · k[r]` for 8 key rows of 64 (`k`: `[8, 64]`), summed as [`super::dot`] does:
    /// its 16 lanes are a low and a high vector of 8, added (round 8), then the 8 keys' vectors
    /// folded together in rounds 4, 2, 1 — 128-bit halves, then pairs of lanes, then neighbours.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn block_scores<T: StoredFloat>(q: &[f32; 64], k: &[T], out: &mut [f32; 8]) {
        assert!(k.len() >= 8 * 64);
        // SAFETY: q holds 64 floats, k at least 8 rows of 64 (asserted), out 8.
        unsafe {
            let qv: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(q.as_ptr().add(8 * i)));
            let s: [__m256; 8] = std::array::from_fn(|r| {
                let row = k.as_ptr().add(r * 64);
                // dot's lane l (< 8) sums q[16c + l]·k[16c + l], lane 8 + l q[16c + 8 + l]·…
                let mut lo = _mm256_mul_ps(qv[0], T::load8(row));
                let mut hi = _mm256_mul_ps(qv[1], T::load8(row.add(8)));
                for c in 1..4 {
                    lo = _mm256_fmadd_ps(qv[2 * c], T::load8(row.add(16 * c)), lo);
                    hi = _mm256_fmadd_ps(qv[2 * c + 1], T::load8(row.add(16 * c + 8)), hi);
                }
                _mm256_add_ps(lo, hi)
            });
            // Round 4: [a₀₋₃ + a₄₋₇ | b₀₋₃ + b₄₋₇] for keys (a, b) = (0, 1), (2, 3), …
            let x: [__m256; 4] = std::array::from_fn(|i| {
                let (a, b) = (s[2 * i], s[2 * i + 1]);
                _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(a, b), _mm256_permute2f128_ps::<0x31>(a, b))
            });
            // Round 2: lanes m and m + 2 of each half: keys [0, 2 | 1, 3] and [4, 6 | 5, 7].
            let y: [__m256; 2] = std::array::from_fn(|i| {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                _mm256_add_ps(_mm256_shuffle_ps::<0x44>(a, b), _mm256_shuffle_ps::<0xEE>(a, b))
            });
            // Round 1: neighbours; lanes hold keys [0, 2, 4, 6 | 1, 3, 5, 7].
            let z = _mm256_add_ps(_mm256_shuffle_ps::<0x88>(y[0], y[1]), _mm256_shuffle_ps::<0xDD>(y[0], y[1]));
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_permutevar8x32_ps(z, order));
        }
    }

    /// `acc[h] = Σ_j w[h·len + j] · v[j]` over the `len` value rows of 64 in `v` (`[len, 64]`),
    /// the same fused multiply-add per element, in the same order, as the scalar loop. The `G`
    /// output rows do not fit in 16 registers whole: they are made 32 columns at a time (16 for
    /// G = 4), each pass reading its part of every value row.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_values<T: StoredFloat, const G: usize>(w: &[f32], v: &[T], acc: &mut [[f32; 64]; G]) {
        let len = v.len() / 64;
        assert!(w.len() >= G * len);
        // SAFETY: the caller's contract (the CPU's features); the shapes are asserted.
        unsafe {
            if G <= 3 {
                for col in [0, 32] {
                    columns::<T, G, 4>(w, v, len, col, acc);
                }
            } else {
                for col in [0, 16, 32, 48] {
                    columns::<T, G, 2>(w, v, len, col, acc);
                }
            }
        }
    }

    /// Columns `col..col + 8·C` of [`weighted_values`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn columns<T: StoredFloat, const G: usize, const C: usize>(w: &[f32], v: &[T], len: usize, col: usize, acc: &mut [[f32; 64]; G]) {
        // SAFETY: v holds `len` rows of 64 and w `G·len` weights (checked by the caller);
        // col + 8·C ≤ 64.
        unsafe {
            let mut a = [[_mm256_setzero_ps(); C]; G];
            for j in 0..len {
                let row = v.as_ptr().add(j * 64 + col);
                let wj: [__m256; G] = std::array::from_fn(|h| _mm256_set1_ps(*w.get_unchecked(h * len + j)));
                for c in 0..C {
                    let x = T::load8(row.add(8 * c));
                    for h in 0..G {
                        a[h][c] = _mm256_fmadd_ps(wj[h], x, a[h][c]);
                    }
                }
            }
            for h in 0..G {
                for c in 0..C {
                    _mm256_storeu_ps(acc[h].as_mut_ptr().add(col + 8 * c), a[h][c]);
                }
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

/// `max x` in 16 lanes (a fold with `f32::max` is a serial chain; NaN-free inputs here).
#[inline(always)]
fn lane_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let c = x.chunks_exact(LANES);
    let tail = c.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for xs in c {
        for l in 0..LANES {
            acc[l] = if xs[l] > acc[l] { xs[l] } else { acc[l] };
        }
    }
    acc.iter().copied().fold(tail, f32::max)
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
    /// buffers with spare capacity, a bias with a masked key; the general loop (head size 8)
    /// and the specialised one (head size 64, 1–4 query heads per KV head, caches of full and
    /// partial 16-key blocks).
    #[test]
    fn matches_softmax_attention_of_candle_ops() {
        check_against_candle(6, 2, 8, &[5, 1, 9], 12);
        for (heads, kv_heads) in [(9, 3), (4, 4), (4, 2), (8, 2), (10, 2)] {
            check_against_candle(heads, kv_heads, 64, &[5, 1, 37, 16, 48], 50);
        }
    }

    /// Every vector path the CPU has gives the scalar loop's outputs bit for bit: head size 64,
    /// 1–4 query heads per KV head, caches of whole and partial blocks (of 8 and 16 keys), f16 and
    /// f32, with a bias.
    #[test]
    fn vector_paths_equal_the_scalar_loop() {
        let mut paths = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if avx512::available() {
                paths.push(Simd::Avx512);
            }
            if avx2::available() {
                paths.push(Simd::Avx2);
            }
        }
        let lens = [1usize, 7, 8, 16, 23, 40];
        let cap = 48;
        let dev = Device::Cpu;
        for (heads, kv_heads) in [(3, 3), (4, 2), (9, 3), (8, 2)] {
            let q: Vec<f32> = Tensor::randn(0f32, 1.0, (lens.len(), heads, 64), &dev).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let cached = || -> Vec<f32> { Tensor::randn(0f32, 1.0, (kv_heads, cap, 64), &dev).unwrap().flatten_all().unwrap().to_vec1().unwrap() };
            let (ks, vs): (Vec<Vec<f32>>, Vec<Vec<f32>>) = lens.iter().map(|_| (cached(), cached())).unzip();
            let bias: Vec<f32> = (0..cap).map(|j| if j == 2 { f32::NEG_INFINITY } else { -0.1 * (j % 5) as f32 }).collect();
            let caches: Vec<DecodeCache<f32>> = (0..lens.len())
                .map(|i| DecodeCache { k: &ks[i], v: &vs[i], capacity: cap, len: lens[i], bias: (i % 2 == 1).then_some(&bias[..]) })
                .collect();
            let halves = |x: &[f32]| -> Vec<f16> { x.iter().map(|&v| f16::from_f32(v)).collect() };
            let (kh, vh): (Vec<Vec<f16>>, Vec<Vec<f16>>) = ks.iter().zip(&vs).map(|(k, v)| (halves(k), halves(v))).unzip();
            let caches16: Vec<DecodeCache<f16>> = (0..lens.len())
                .map(|i| DecodeCache { k: &kh[i], v: &vh[i], capacity: cap, len: lens[i], bias: (i % 2 == 1).then_some(&bias[..]) })
                .collect();
            let want = decode_attention_on(Simd::Scalar, &q, &caches, heads, kv_heads, 64, 0.125);
            let want16 = decode_attention_on(Simd::Scalar, &q, &caches16, heads, kv_heads, 64, 0.125);
            for &simd in &paths {
                assert_eq!(decode_attention_on(simd, &q, &caches, heads, kv_heads, 64, 0.125), want, "{simd:?}, {heads}/{kv_heads} heads, f32");
                assert_eq!(decode_attention_on(simd, &q, &caches16, heads, kv_heads, 64, 0.125), want16, "{simd:?}, {heads}/{kv_heads} heads, f16");
            }
        }
        eprintln!("vector paths checked: {paths:?}");
    }

    fn check_against_candle(heads: usize, kv_heads: usize, d: usize, lens: &[usize], cap: usize) {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1.0, (lens.len(), heads, d), &dev).unwrap();
        // Values an f16 cache holds exactly; the reference reads the same values.
        let cached = || -> Tensor {
            let x = Tensor::randn(0f32, 1.0, (kv_heads, cap, d), &dev).unwrap();
            x.to_dtype(candle_core::DType::F16).unwrap().to_dtype(candle_core::DType::F32).unwrap()
        };
        let ks: Vec<Tensor> = lens.iter().map(|_| cached()).collect();
        let vs: Vec<Tensor> = lens.iter().map(|_| cached()).collect();
        let mut bias = vec![0f32; lens[2]];
        bias[3] = f32::NEG_INFINITY;
        bias[4] = -1.5;
        let halves = |x: &Tensor| -> Vec<f16> { x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|&v| f16::from_f32(v)).collect() };
        let (kv, vv): (Vec<Vec<f16>>, Vec<Vec<f16>>) = ks.iter().zip(&vs).map(|(k, v)| (halves(k), halves(v))).unzip();
        let caches: Vec<DecodeCache<f16>> = (0..lens.len())
            .map(|i| DecodeCache { k: &kv[i], v: &vv[i], capacity: cap, len: lens[i], bias: (i == 2).then_some(&bias[..]) })
            .collect();
        let scale = 1.0 / (d as f32).sqrt();
        let qv: Vec<f32> = q.flatten_all().unwrap().to_vec1().unwrap();
        let got = decode_attention(&qv, &caches, heads, kv_heads, d, scale);
        // The same values in an f32 cache: the same arithmetic, bit for bit.
        let floats = |x: &Tensor| -> Vec<f32> { x.flatten_all().unwrap().to_vec1::<f32>().unwrap() };
        let (kf, vf): (Vec<Vec<f32>>, Vec<Vec<f32>>) = ks.iter().zip(&vs).map(|(k, v)| (floats(k), floats(v))).unzip();
        let caches32: Vec<DecodeCache<f32>> = (0..lens.len())
            .map(|i| DecodeCache { k: &kf[i], v: &vf[i], capacity: cap, len: lens[i], bias: (i == 2).then_some(&bias[..]) })
            .collect();
        assert_eq!(decode_attention(&qv, &caches32, heads, kv_heads, d, scale), got, "an f32 cache of the same values");
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
