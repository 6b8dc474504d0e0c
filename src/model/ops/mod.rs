//! Fused CPU training ops with hand-written backward passes.
//!
//! Adapter training runs full forward + backward passes through a *frozen* base model on
//! CPU, so the per-op overheads of candle's composite ops dominate:
//!
//! * candle's fast ops (`candle_nn::ops::{softmax_last_dim, rms_norm}`, `rotary_emb::rope`)
//!   have no backward, so training code must fall back to long chains of elementwise ops,
//!   each allocating a full-size tensor and each adding a node whose backward allocates
//!   again (`GradStore::or_insert` zero-fills, then adds).
//! * `Tensor::matmul`'s backward always computes the gradient of *both* operands, so a
//!   frozen weight wastes a full gemm per linear layer in the backward pass.
//!
//! Every op here (one file per family, its tests beside it) is a candle `CustomOp` on
//! CPU/f32 (one pass forward, one pass backward, rayon-parallel over rows), and on any other
//! device or dtype falls back to an equivalent composite of differentiable candle ops, so
//! callers never need to branch on the device.
//! Frozen inputs (linear/norm weights, rope tables, loss targets/weights) never receive a
//! gradient; in the custom-op paths none is even computed.
//!
//! With the `cuda` feature, `frozen_linear` runs the same custom op through cuBLAS and
//! `causal_attention` uses the masked-softmax kernel (`crate::kernels`) between two cuBLAS
//! matmuls; the other ops take their composites there (computed in f32 where it matters).
//!
//! Besides `crate::kernels` (the vectorisable exp, and the masked softmax on CUDA), only
//! candle-core, candle-nn, rayon and std are used.

mod attention;
mod cross_entropy;
mod linear;
mod rms_norm;
mod rope;
mod silu_mul;
mod softmax;

pub use attention::causal_attention;
pub use cross_entropy::cross_entropy_masked;
pub use linear::{frozen_linear, frozen_linear_bf16, frozen_linear_pretransposed, Bf16Weight};
pub use rms_norm::rms_norm;
pub use rope::{rope, rope_interleaved};
pub use silu_mul::silu_mul;
pub use softmax::softmax_last_dim;

use candle_core::{bail, CpuStorage, DType, Device, Layout, Result, Shape, Storage, Tensor};
use crate::kernels::math::exp_f32;

// ---------------------------------------------------------------------------------------
// Small helpers shared by the kernels.
// ---------------------------------------------------------------------------------------

/// The fused kernels are written for f32 on the CPU; everything else takes the composite
/// path.
fn fused_f32(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32)
}

/// The contiguous f32 data of a custom-op input. The public wrappers make inputs
/// contiguous before applying an op, so anything else is an internal error.
fn f32_data<'a>(s: &'a CpuStorage, l: &Layout, op: &'static str) -> Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!("{op}: expected a contiguous f32 input, got layout {l:?}"),
    }
}

/// Runs `f` on the data of a contiguous f32 CPU tensor. Used by the backward passes, which
/// receive tensors rather than storages.
fn with_f32<R>(t: &Tensor, op: &'static str, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(f32_data(s, layout, op)?),
        _ => bail!("{op}: expected a cpu tensor"),
    }
}

fn cpu_tensor<S: Into<Shape>>(data: Vec<f32>, shape: S) -> Result<Tensor> {
    Tensor::from_vec(data, shape, &Device::Cpu)
}

/// Width of the manual accumulators below. f32 reductions are not reassociated by LLVM, so
/// a plain `iter().sum()` runs one scalar add per element; 16 independent lanes let the
/// loop vectorise (AVX2/AVX-512) and also shorten the rounding chains.
const LANES: usize = 16;

/// Max of a slice (-inf for an empty slice). NaNs are skipped here but still surface in the
/// result of the exp pass that follows.
#[inline]
fn max_f32(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    acc.iter()
        .chain(rem)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m })
}

#[inline]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// Σ exp(x - m) without storing anything (cross-entropy forward).
#[inline]
fn sum_exp_shifted(x: &[f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rem = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            acc[i] += exp_f32(c[i] - m);
        }
    }
    let tail: f32 = rem.iter().map(|&v| exp_f32(v - m)).sum();
    acc.iter().sum::<f32>() + tail
}

/// x <- exp(x - m) in place, returning the sum.
#[inline]
fn exp_shifted_inplace(x: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            let e = exp_f32(c[i] - m);
            c[i] = e;
            acc[i] += e;
        }
    }
    let mut tail = 0f32;
    for v in chunks.into_remainder() {
        *v = exp_f32(*v - m);
        tail += *v;
    }
    acc.iter().sum::<f32>() + tail
}

/// Numerically stable in-place softmax of one row. A row whose entries are all -inf (or an
/// empty row) becomes all zeros instead of 0/0 = NaN; NaN inputs still give a NaN row.
#[inline]
fn softmax_row_inplace(row: &mut [f32]) {
    let m = max_f32(row);
    if m == f32::NEG_INFINITY {
        // max_f32 skips NaNs, so an all-NaN row also lands here: keep it NaN.
        let fill = if row.iter().any(|v| v.is_nan()) {
            f32::NAN
        } else {
            0.0
        };
        row.fill(fill);
        return;
    }
    let inv = 1.0 / exp_shifted_inplace(row, m);
    row.iter_mut().for_each(|v| *v *= inv);
}

/// dx = y ⊙ (g − Σ g⊙y) for one row (softmax backward). All-zero rows (fully masked) give
/// a zero gradient.
#[inline]
fn softmax_bwd_row(y: &[f32], g: &[f32], dx: &mut [f32]) {
    let d = dot_f32(y, g);
    for ((o, &y), &g) in dx.iter_mut().zip(y).zip(g) {
        *o = y * (g - d);
    }
}

/// Elements per rayon task for the purely elementwise kernels.
const ELEMWISE_CHUNK: usize = 1 << 14;

/// Elements up to which an elementwise forward runs on the calling thread.
const SERIAL_ELEMWISE: usize = 1 << 16;

// ---------------------------------------------------------------------------------------
// Tests: helpers shared by every op's tests, and tests across ops
// ---------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Var, D};

    /// Deterministic pseudo-random values in [-scale, scale] (xorshift32).
    pub(super) fn fill(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    pub(super) fn rand_t<S: Into<Shape>>(shape: S, seed: u32, scale: f32) -> Tensor {
        let shape = shape.into();
        Tensor::from_vec(fill(shape.elem_count(), seed, scale), shape, &Device::Cpu).unwrap()
    }

    pub(super) fn var<S: Into<Shape>>(shape: S, seed: u32, scale: f32) -> Var {
        Var::from_tensor(&rand_t(shape, seed, scale)).unwrap()
    }

    /// max |a − b| / max(1, max |b|)
    pub(super) fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims(), "shape mismatch");
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let scale = b.iter().fold(1f32, |m, v| m.max(v.abs()));
        // Equal values (including matching infinities) count as 0; any NaN poisons.
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() })
            .fold(0f32, |m, v| {
                if v.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(v)
                }
            });
        diff / scale
    }

    pub(super) fn assert_close(a: &Tensor, b: &Tensor, tol: f32, what: &str) {
        let d = rel_diff(a, b);
        assert!(d <= tol, "{what}: relative max diff {d} > {tol}");
    }

    /// Random projection so that the upstream gradient is neither uniform nor stride-0.
    pub(super) fn loss_of(y: &Tensor, seed: u32) -> Tensor {
        let r = rand_t(y.shape().clone(), seed, 1.0);
        (y * r).unwrap().sum_all().unwrap()
    }

    pub(super) fn grad(g: &candle_core::backprop::GradStore, v: &Var) -> Tensor {
        g.get(v.as_tensor()).expect("missing gradient").clone()
    }

    pub(super) const FWD_TOL: f32 = 1e-5;
    pub(super) const BWD_TOL: f32 = 1e-4;

    pub(super) fn plain_softmax(x: &Tensor) -> Tensor {
        candle_nn::ops::softmax(x, D::Minus1).unwrap()
    }

    // Non-f32 inputs take the composite path and still work (bf16 smoke test).
    #[test]
    fn non_f32_falls_back() {
        let x = rand_t((3, 8), 1, 1.0).to_dtype(DType::BF16).unwrap();
        let w = rand_t(8, 2, 1.0).to_dtype(DType::BF16).unwrap();
        let y = rms_norm(&x, &w, 1e-5).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let y = softmax_last_dim(&x).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let y = silu_mul(&x, &x).unwrap();
        assert_eq!(y.dims(), &[3, 8]);
    }
}
