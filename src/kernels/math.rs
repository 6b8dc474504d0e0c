//! Scalar math shared by the CPU paths of the kernels and the fused training ops in
//! `model::ops`: a vectorisable exp and the sigmoid built on it.

/// exp(x) for f32, Cephes-style: range reduction to r in [-ln2/2, ln2/2], a degree-6
/// polynomial and an exponent splice; relative error < 5e-7 (tested). Unlike `f32::exp` (a libm
/// call) it is branch-free and inlines, so the loops that use it vectorise; the fused softmax and
/// the 49152-wide cross-entropy of `model::ops` spend most of their time here.
///
/// x < -87.33 (including -inf) returns exactly 0, x > 88.3 saturates at ~2.2e38, NaN stays
/// NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const LO: f32 = -87.33;
    const HI: f32 = 88.3;
    let xc = x.clamp(LO, HI);
    // n = round(x / ln2), within [-126, 127] thanks to the clamp, so 2^n is a normal float.
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
    let y = p * r * r + r + 1.0;
    // 2^n without a float→int conversion (which blocks vectorisation): n + 127 is an
    // integer in [1, 254], so adding 2^23 puts it verbatim in the low mantissa bits, and
    // shifting those into the exponent field drops everything else.
    let scale = f32::from_bits((n + (8_388_608.0 + 127.0)).to_bits() << 23);
    if x < LO {
        0.0
    } else {
        y * scale
    }
}

/// Sigmoid on [`exp_f32`] (relative error < 5e-7), for the fused CPU loops.
#[inline(always)]
pub(crate) fn sigmoid_fast(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

use half::f16;
use half::slice::HalfFloatSliceExt;

/// A float format the CPU KV cache keeps keys and values in (see `model::KvCache`), computed
/// with as f32: f16 (half the bytes a decode step reads) or f32 itself.
pub trait StoredFloat: Copy + Default + Send + Sync + 'static {
    /// `dst[i] = src[i]` as f32.
    fn to_f32s(src: &[Self], dst: &mut [f32]);
    /// `dst[i] = src[i]` rounded to this type.
    fn from_f32s(src: &[f32], dst: &mut [Self]);
    /// 16 elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p` points at 16 elements; the CPU has AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    /// 8 elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p` points at 8 elements; the CPU has AVX and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl StoredFloat for f32 {
    fn to_f32s(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn from_f32s(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's pointer covers 16 floats and the CPU has AVX-512F.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's pointer covers 8 floats and the CPU has AVX.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl StoredFloat for f16 {
    fn to_f32s(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    fn from_f32s(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's pointer covers 16 halves and the CPU has AVX-512F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's pointer covers 8 halves and the CPU has F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_matches_std() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp_f32(x), x.exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(100.0).is_finite());
    }
}
