//! bf16 matmul on the CPU (AVX-512 BF16) for the trainable path's frozen linear layers:
//! `y = x·Wᵀ` with `W` packed once. Adapter training spends about half of every step in these
//! f32 gemms (forward `x·Wᵀ`, backward `g·W`); `vdpbf16ps` does twice the multiply-adds per
//! instruction of an f32 FMA, with f32 accumulation: the mixed precision every GPU recipe of the
//! papers trains in (the products of bf16 inputs are exact in f32; only the inputs are rounded).
//!
//! Weights are packed in strips of 32 output rows: for each pair of inputs `(2p, 2p+1)` the 32
//! rows' bf16 pairs sit side by side (two 512-bit registers), so one `vdpbf16ps` with a
//! broadcast of one activation pair adds into one f32 lane per output row — no horizontal sums.
//! A tile of `MR` activation rows shares each strip load.
//!
//! Every output element is computed by the same operations in the same order whatever the number
//! of rows in the call (a tile of `MR` rows or a tail tile of fewer runs the same per-row chain),
//! so a row's result does not depend on who shares its call.

use rayon::prelude::*;

/// Output rows per strip: two registers of 16 f32 lanes.
const STRIP: usize = 32;
/// Activation rows per tile (2·MR accumulators stay in registers).
const MR: usize = 8;
/// Activation rows per unit of parallel work.
const ROW_BLOCK: usize = 64;
/// Below this many multiply-adds a call stays on the calling thread.
const SERIAL_WORK: usize = 1 << 20;

/// Whether this CPU runs the kernel (AVX-512 F and BF16).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `x` rounded to bf16 (to nearest, ties to even; NaN stays NaN) — what `vcvtneps2bf16` gives for
/// normal numbers. Branch-free on the bits so the loops over rows vectorise.
#[inline]
pub fn round_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((b >> 16) | 0x40) as u16;
    if (b & 0x7FFF_FFFF) > 0x7F80_0000 {
        quiet_nan
    } else {
        rounded
    }
}

/// Rows of `cols` f32 values as bf16 pairs: `[n, ceil(cols/2)]` u32, the even input in the low
/// half (a pair as `vdpbf16ps` reads it), an odd last column padded with zero.
fn pairs_of(x: &[f32], n: usize, cols: usize) -> Vec<u32> {
    let pairs = cols.div_ceil(2);
    let mut out = vec![0u32; n * pairs];
    if pairs == 0 {
        return out;
    }
    let convert = |(row, dst): (&[f32], &mut [u32])| {
        let mut it = row.chunks_exact(2);
        for (d, p) in dst.iter_mut().zip(&mut it) {
            *d = round_bf16(p[0]) as u32 | (round_bf16(p[1]) as u32) << 16;
        }
        if let [last] = it.remainder() {
            dst[pairs - 1] = round_bf16(*last) as u32;
        }
    };
    x.chunks_exact(cols).zip(out.chunks_exact_mut(pairs)).for_each(convert);
    out
}

/// A frozen `[rows, cols]` weight (`rows` outputs of `cols` inputs) packed for the kernel.
pub struct PackedBf16 {
    rows: usize,
    cols: usize,
    pairs: usize,
    /// `[strip][pair][STRIP]` bf16 pairs; rows past `rows` are zero.
    data: Vec<u32>,
}

impl PackedBf16 {
    /// Packs `w` (`[rows, cols]` row-major f32), rounding each weight to bf16.
    pub fn pack(w: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "weight is not [rows, cols]");
        // Output row r, input c is w[r·cols + c].
        Self::pack_with(rows, cols, |r, c| w[r * cols + c])
    }

    /// Packs `wᵀ` for `w` `[rows, cols]`: a `[cols, rows]` weight (the backward's `g·W`), read
    /// straight from `w` (a strip's 32 outputs are 32 neighbouring columns of one row of `w`).
    pub fn pack_transposed(w: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "weight is not [rows, cols]");
        Self::pack_with(cols, rows, |r, c| w[c * cols + r])
    }

    /// Packs the `[rows, cols]` weight whose element (output `r`, input `c`) is `at(r, c)`;
    /// strips in parallel.
    fn pack_with(rows: usize, cols: usize, at: impl Fn(usize, usize) -> f32 + Sync) -> Self {
        let pairs = cols.div_ceil(2);
        let strips = rows.div_ceil(STRIP);
        let mut data = vec![0u32; strips * pairs * STRIP];
        if pairs > 0 {
            data.par_chunks_mut(pairs * STRIP).enumerate().for_each(|(s, strip)| {
                for (p, lanes) in strip.chunks_exact_mut(STRIP).enumerate() {
                    for (lane, d) in lanes.iter_mut().enumerate() {
                        let r = s * STRIP + lane;
                        if r >= rows {
                            break;
                        }
                        let hi = if 2 * p + 1 < cols { round_bf16(at(r, 2 * p + 1)) as u32 } else { 0 };
                        *d = round_bf16(at(r, 2 * p)) as u32 | hi << 16;
                    }
                }
            });
        }
        Self { rows, cols, pairs, data }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// `x` `[n, cols]` row-major → `x·Wᵀ` `[n, rows]`, `x` rounded to bf16, sums in f32. Strips
    /// are shared out over rayon's pool (the training ops' pool).
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "activations are not [n, cols]");
        let xp = pairs_of(x, n, self.cols);
        let mut out = vec![0f32; n * self.rows];
        if n == 0 || self.rows == 0 {
            return out;
        }
        let dst = SharedOut(out.as_mut_ptr());
        let dst = &dst;
        // Units of (strip, block of ROW_BLOCK rows), strip-major: a few strips (a k or v
        // projection has 6) still make enough units for every thread.
        let blocks = n.div_ceil(ROW_BLOCK);
        // SAFETY: a unit writes only columns `32s..32s+32` of its own rows.
        let run = |u: usize| unsafe {
            let (s, b) = (u / blocks, u % blocks);
            self.strip(s, &xp, b * ROW_BLOCK..((b + 1) * ROW_BLOCK).min(n), dst.ptr())
        };
        let units = self.rows.div_ceil(STRIP) * blocks;
        if n * self.rows * self.cols < SERIAL_WORK {
            (0..units).for_each(run);
        } else {
            (0..units).into_par_iter().for_each(run);
        }
        out
    }

    /// Strip `s` for activation rows `rows`, `MR` rows at a time.
    unsafe fn strip(&self, s: usize, xp: &[u32], rows: std::ops::Range<usize>, out: *mut f32) {
        let w = self.data.as_ptr().add(s * self.pairs * STRIP);
        let valid = (self.rows - s * STRIP).min(STRIP);
        let (mut row, n) = (rows.start, rows.end);
        while row < n {
            let t = (n - row).min(MR);
            let x = xp.as_ptr().add(row * self.pairs);
            let o = out.add(row * self.rows + s * STRIP);
            let args = (x, self.pairs, w, o, self.rows, valid);
            #[cfg(target_arch = "x86_64")]
            match t {
                8 => avx512::tile::<8>(args),
                7 => avx512::tile::<7>(args),
                6 => avx512::tile::<6>(args),
                5 => avx512::tile::<5>(args),
                4 => avx512::tile::<4>(args),
                3 => avx512::tile::<3>(args),
                2 => avx512::tile::<2>(args),
                _ => avx512::tile::<1>(args),
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = args;
            row += t;
        }
    }

    /// The same product in plain scalar code, in the kernel's order per output (for each pair,
    /// the odd product then the even one added to the f32 sum); for tests.
    pub fn matmul_reference(&self, x: &[f32], n: usize) -> Vec<f32> {
        let xp = pairs_of(x, n, self.cols);
        let f = |h: u32| f32::from_bits(h << 16);
        let mut out = vec![0f32; n * self.rows];
        for i in 0..n {
            for r in 0..self.rows {
                let (s, lane) = (r / STRIP, r % STRIP);
                let mut acc = 0f32;
                for p in 0..self.pairs {
                    let a = xp[i * self.pairs + p];
                    let b = self.data[(s * self.pairs + p) * STRIP + lane];
                    acc += f(a >> 16) * f(b >> 16);
                    acc += f(a & 0xFFFF) * f(b & 0xFFFF);
                }
                out[i * self.rows + r] = acc;
            }
        }
        out
    }

}

struct SharedOut(*mut f32);
// SAFETY: the strips written through it are disjoint (see `matmul`).
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

impl SharedOut {
    fn ptr(&self) -> *mut f32 {
        self.0
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::STRIP;
    use std::arch::x86_64::*;

    /// `T` activation rows (bf16 pairs at `x`, `pairs` per row) against one strip at `w`;
    /// writes the strip's `valid` output columns of each row at `out + t·out_stride`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn tile<const T: usize>(
        (x, pairs, w, out, out_stride, valid): (*const u32, usize, *const u32, *mut f32, usize, usize),
    ) {
        let mut lo = [_mm512_setzero_ps(); T];
        let mut hi = [_mm512_setzero_ps(); T];
        for p in 0..pairs {
            let wp = w.add(p * STRIP);
            let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp as *const __m512i));
            let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(wp.add(16) as *const __m512i));
            for t in 0..T {
                let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(*x.add(t * pairs + p) as i32));
                lo[t] = _mm512_dpbf16_ps(lo[t], a, w0);
                hi[t] = _mm512_dpbf16_ps(hi[t], a, w1);
            }
        }
        let m0: __mmask16 = if valid >= 16 { 0xFFFF } else { (1u16 << valid) - 1 };
        let m1: __mmask16 = if valid >= 32 { 0xFFFF } else if valid > 16 { (1u16 << (valid - 16)) - 1 } else { 0 };
        for t in 0..T {
            let o = out.add(t * out_stride);
            _mm512_mask_storeu_ps(o, m0, lo[t]);
            _mm512_mask_storeu_ps(o.add(16), m1, hi[t]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// `x` as the kernel rounds it (each value to bf16 and back).
    fn rounded(x: &[f32]) -> Vec<f32> {
        x.iter().map(|&v| bf16::from_bits(round_bf16(v)).to_f32()).collect()
    }

    fn random(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        for v in [1.0f32, -2.5, 1e-3, std::f32::consts::PI, 65504.0, f32::INFINITY, 1.00390625, 1.01171875] {
            assert_eq!(round_bf16(v), bf16::from_f32(v).to_bits(), "{v}");
        }
        assert!(bf16::from_bits(round_bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn kernel_matches_reference_and_f32_product() {
        if !available() {
            eprintln!("skipped: no AVX-512 BF16");
            return;
        }
        let mut seed = 7;
        // Odd and even input counts, strips whole and partial, tiles whole and partial.
        for (rows, cols, n) in [(32, 64, 8), (45, 33, 11), (70, 128, 3), (16, 2, 1), (96, 576, 17)] {
            let w = random(rows * cols, &mut seed);
            let x = random(n * cols, &mut seed);
            let p = PackedBf16::pack(&w, rows, cols);
            let got = p.matmul(&x, n);
            let want = p.matmul_reference(&x, n);
            // The same products; the hardware may round the pair's two adds as one.
            let (wr, xr) = (rounded(&w), rounded(&x));
            for i in 0..n {
                for r in 0..rows {
                    let k = i * rows + r;
                    let mag: f32 = (0..cols).map(|c| (xr[i * cols + c] * wr[r * cols + c]).abs()).sum();
                    assert!((got[k] - want[k]).abs() <= 1e-6 * mag + 1e-30, "{rows}x{cols} n={n} [{i},{r}]: {} vs {}", got[k], want[k]);
                    // Against the f32 product: the inputs' rounding (2^-9 relative each) bounds it.
                    let exact: f32 = (0..cols).map(|c| x[i * cols + c] * w[r * cols + c]).sum();
                    let bound = 2.0 * 2f32.powi(-8) * (0..cols).map(|c| (x[i * cols + c] * w[r * cols + c]).abs()).sum::<f32>();
                    assert!((got[k] - exact).abs() <= bound, "[{i},{r}] {} vs f32 {}", got[k], exact);
                }
            }
        }
    }

    #[test]
    fn transposed_pack_is_the_transpose() {
        let mut seed = 3;
        let (rows, cols) = (41, 18);
        let w = random(rows * cols, &mut seed);
        let g = random(5 * rows, &mut seed);
        let t = PackedBf16::pack_transposed(&w, rows, cols);
        assert_eq!((t.rows(), t.cols()), (cols, rows));
        let mut wt = vec![0f32; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                wt[c * rows + r] = w[r * cols + c];
            }
        }
        assert_eq!(t.data, PackedBf16::pack(&wt, cols, rows).data, "the packing of the explicit transpose");
        let got = t.matmul_reference(&g, 5);
        for i in 0..5 {
            for c in 0..cols {
                let want: f32 = (0..rows).map(|r| g[i * rows + r] * w[r * cols + c]).sum();
                assert!((got[i * cols + c] - want).abs() < 0.05, "{} vs {}", got[i * cols + c], want);
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_alone_or_in_any_batch() {
        if !available() {
            return;
        }
        let mut seed = 11;
        let (rows, cols) = (64, 96);
        let w = random(rows * cols, &mut seed);
        let x = random(13 * cols, &mut seed);
        let p = PackedBf16::pack(&w, rows, cols);
        let all = p.matmul(&x, 13);
        for i in 0..13 {
            let alone = p.matmul(&x[i * cols..(i + 1) * cols], 1);
            assert_eq!(alone, all[i * rows..(i + 1) * rows], "row {i}");
        }
    }
}
