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
//! Every op below is a candle `CustomOp` on CPU/f32 (one pass forward, one pass backward,
//! rayon-parallel over rows), and on any other device or dtype falls back to an equivalent
//! composite of differentiable candle ops, so callers never need to branch on the device.
//! Frozen inputs (linear/norm weights, rope tables, loss targets/weights) never receive a
//! gradient; in the custom-op paths none is even computed.
//!
//! With the `cuda` feature, `frozen_linear` runs the same custom op through cuBLAS and
//! `causal_attention` uses the masked-softmax kernel (`crate::kernels`) between two cuBLAS
//! matmuls; the other ops take their composites there (computed in f32 where it matters).
//!
//! Besides `crate::kernels` (the vectorisable exp, and the masked softmax on CUDA), only
//! candle-core, candle-nn, rayon and std are used.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape,
    Storage, Tensor, D,
};
use crate::kernels::bf16_matmul::{self, PackedBf16};
use crate::kernels::math::{exp_f32, sigmoid_fast};
use std::sync::Arc;
use rayon::prelude::*;

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

/// Smallest finite value of a float dtype, used by the composite softmax to keep the row
/// max finite.
fn dtype_lowest(dt: DType) -> f64 {
    match dt {
        DType::F16 => -65504.0,
        DType::BF16 => -3.38e38,
        DType::F32 => f32::MIN as f64,
        _ => f64::MIN,
    }
}

// ---------------------------------------------------------------------------------------
// 1. frozen_linear
// ---------------------------------------------------------------------------------------

/// y = x · wᵀ where the weight never receives a gradient. The forward is the exact gemm
/// call `x.matmul(&w.t())` makes; the backward only computes dL/dx = g · w, skipping the
/// weight-gradient gemm that `Tensor::matmul`'s backward always runs.
struct FrozenLinear;

impl CustomOp2 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        frozen_linear_fwd(xs, xl, ws, wl)
    }

    /// The same gemm through cuBLAS.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        frozen_linear_fwd(xs, xl, ws, wl)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(frozen_linear_dx(x, w, grad)?), None))
    }
}

/// dL/dx = g · w of `y = x · wᵀ` (`w` `[out, in]`), shaped as `x`.
fn frozen_linear_dx(x: &Tensor, w: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let (n, _k) = w.dims2()?;
    let m = grad.elem_count() / n.max(1);
    grad.reshape((m, n))?.matmul(&w.detach())?.reshape(x.shape())
}

fn frozen_linear_fwd<S: BackendStorage>(xs: &S, xl: &Layout, ws: &S, wl: &Layout) -> Result<(S, Shape)> {
    // wᵀ as a strided [k, n] view of the (any-strided 2-D) weight.
    linear_gemm(xs, xl, ws, &wl.transpose(0, 1)?)
}

/// `x · r` for `x` `[..., k]` (contiguous) and a 2-D right-hand side layout `rl` `[k, n]`.
fn linear_gemm<S: BackendStorage>(xs: &S, xl: &Layout, rs: &S, rl: &Layout) -> Result<(S, Shape)> {
    if !xl.is_contiguous() {
        bail!("frozen-linear: x must be contiguous");
    }
    let (k, n) = rl.shape().dims2()?;
    let dims = xl.dims();
    let m = xl.shape().elem_count() / k.max(1);
    // x viewed as [m, k].
    let lhs = Layout::contiguous_with_offset((m, k), xl.start_offset());
    let out = xs.matmul(rs, (1, m, n, k), &lhs, rl)?;
    let mut out_dims = dims.to_vec();
    if let Some(last) = out_dims.last_mut() {
        *last = n;
    }
    Ok((out, Shape::from(out_dims)))
}

/// `frozen_linear` with the weight also at hand transposed, `wt` = `[in, out]` contiguous: the
/// forward gemm reads a contiguous right-hand side instead of a transposed view of `w` (on the
/// CPU gemm's packing of a transposed operand costs ~1.4× at these shapes), the backward reads
/// `w` itself. CPU only (cuBLAS takes either layout at full speed).
struct FrozenLinearPretransposed;

impl CustomOp3 for FrozenLinearPretransposed {
    fn name(&self) -> &'static str {
        "frozen-linear-pretransposed"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        _ws: &CpuStorage,
        _wl: &Layout,
        wts: &CpuStorage,
        wtl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        linear_gemm(xs, xl, wts, wtl)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _wt: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(frozen_linear_dx(x, w, grad)?), None, None))
    }
}

/// `frozen_linear(x, w)` given also `wt` = `wᵀ` contiguous (`[in, out]`): the same result, a
/// faster forward on the CPU. Elsewhere it is `frozen_linear(x, w)`.
pub fn frozen_linear_pretransposed(x: &Tensor, w: &Tensor, wt: &Tensor) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    let all_f32 = [x, w, wt].iter().all(|t| t.dtype() == DType::F32);
    let usable = x.device().is_cpu() && all_f32 && wt.dims2()? == (k, n) && wt.is_contiguous();
    if !usable || x.elem_count() == 0 || x.dims().last() != Some(&k) {
        return frozen_linear(x, w);
    }
    x.contiguous()?.apply_op3(&w.detach(), &wt.detach(), FrozenLinearPretransposed)
}

/// `y = x · wᵀ` for a frozen weight `w` of shape `[out, in]`; `x` is `[..., in]` (any rank
/// ≥ 1, any strides). `w` never gets a gradient (even if it is a `Var`); only dL/dx flows.
///
/// CPU and CUDA: a custom op using candle's own gemm (same speed as `x.matmul(&w.t())`) for
/// every float dtype candle's matmul supports. Other devices: `x · detach(w)ᵀ`.
pub fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    let dims = x.dims();
    if dims.last() != Some(&k) {
        bail!(
            "frozen_linear: x {:?} does not end in the weight's in-features {k} (w {:?})",
            x.shape(),
            w.shape()
        );
    }
    if x.dtype() != w.dtype() {
        bail!(
            "frozen_linear: dtype mismatch {:?} vs {:?}",
            x.dtype(),
            w.dtype()
        );
    }
    let mut out_dims = dims.to_vec();
    if let Some(last) = out_dims.last_mut() {
        *last = n;
    }
    if x.elem_count() == 0 || n == 0 || k == 0 || !(x.device().is_cpu() || x.device().is_cuda()) {
        let m = x.elem_count() / k.max(1);
        return x
            .reshape((m, k))?
            .matmul(&w.detach().t()?)?
            .reshape(out_dims);
    }
    x.contiguous()?.apply_op2(&w.detach(), FrozenLinear)
}

/// A frozen weight `[out, in]` packed for `frozen_linear_bf16`: `w` for the forward `x·wᵀ`,
/// `wᵀ` for the backward `g·w` (~4 bytes per weight for the pair, made once).
pub struct Bf16Weight {
    fwd: PackedBf16,
    bwd: PackedBf16,
}

impl Bf16Weight {
    /// Packs `w` (`[out, in]` f32 on the CPU).
    pub fn new(w: &Tensor) -> Result<Self> {
        let (out, inp) = w.dims2()?;
        let data = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(Self { fwd: PackedBf16::pack(&data, out, inp), bwd: PackedBf16::pack_transposed(&data, out, inp) })
    }
}

/// `y = x·wᵀ` with bf16 inputs and f32 sums (`kernels::bf16_matmul`), `x` `[..., in]`; its
/// backward is the same op in the other direction, `dx = g·w` through the packing of `wᵀ`
/// (which has no backward of its own).
struct FrozenLinearBf16 {
    w: Arc<Bf16Weight>,
    backward: bool,
}

impl CustomOp1 for FrozenLinearBf16 {
    fn name(&self) -> &'static str {
        if self.backward {
            "frozen-linear-bf16-dx"
        } else {
            "frozen-linear-bf16"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let p = if self.backward { &self.w.bwd } else { &self.w.fwd };
        let x = f32_data(s, l, self.name())?;
        let k = p.cols();
        let mut dims = l.dims().to_vec();
        if dims.last() != Some(&k) {
            bail!("{}: input {dims:?} does not end in {k}", self.name());
        }
        let rows = x.len() / k.max(1);
        if let Some(last) = dims.last_mut() {
            *last = p.rows();
        }
        Ok((CpuStorage::F32(p.matmul(x, rows)), Shape::from(dims)))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if self.backward {
            bail!("frozen-linear-bf16-dx has no backward");
        }
        let dx = FrozenLinearBf16 { w: self.w.clone(), backward: true };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&dx)?))
    }
}

/// `frozen_linear(x, w)` in mixed precision: `x` (and, backward, the gradient) rounded to bf16,
/// the weight packed in bf16 (`packed`, from `Bf16Weight::new(w)`), sums in f32 — about twice
/// the f32 gemm's speed on CPUs with AVX-512 BF16 (`kernels::bf16_matmul::available`). CPU and
/// f32 only: elsewhere it is `frozen_linear(x, w)`.
pub fn frozen_linear_bf16(x: &Tensor, w: &Tensor, packed: &Arc<Bf16Weight>) -> Result<Tensor> {
    let usable = fused_f32(&[x]) && bf16_matmul::available() && x.dims().last() == Some(&packed.fwd.cols());
    if !usable || x.elem_count() == 0 {
        return frozen_linear(x, w);
    }
    x.contiguous()?.apply_op1(FrozenLinearBf16 { w: packed.clone(), backward: false })
}

// ---------------------------------------------------------------------------------------
// 2. rms_norm
// ---------------------------------------------------------------------------------------

struct RmsNorm {
    eps: f32,
}

#[inline]
fn rms_inv(row: &[f32], eps: f32) -> f32 {
    1.0 / (dot_f32(row, row) / row.len() as f32 + eps).sqrt()
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_data(xs, xl, self.name())?;
        let w = f32_data(ws, wl, self.name())?;
        let dim = w.len();
        let mut out = vec![0f32; x.len()];
        let row = |(o, x): (&mut [f32], &[f32])| {
            let r = rms_inv(x, self.eps);
            for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                *o = x * r * w;
            }
        };
        // A decode step's few rows: waking the rayon pool costs more than the rows.
        if x.len() <= SERIAL_ELEMWISE {
            out.chunks_mut(dim).zip(x.chunks(dim)).for_each(row);
        } else {
            out.par_chunks_mut(dim).zip(x.par_chunks(dim)).for_each(row);
        }
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    /// With r = (mean(x²) + eps)^(-1/2) and gw = g ⊙ w:
    /// dx = r·gw − x · r³ · (Σ gw⊙x) / D. The weight is frozen: no gradient.
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let name = self.name();
        let eps = self.eps;
        let dx = with_f32(x, name, |x| {
            with_f32(w, name, |w| {
                with_f32(&grad, name, |g| {
                    let dim = w.len();
                    let mut dx = vec![0f32; x.len()];
                    dx.par_chunks_mut(dim)
                        .zip(x.par_chunks(dim).zip(g.par_chunks(dim)))
                        .for_each(|(dx, (x, g))| {
                            let r = rms_inv(x, eps);
                            for ((o, &g), &w) in dx.iter_mut().zip(g).zip(w) {
                                *o = g * w;
                            }
                            let c = dot_f32(dx, x) * r * r * r / dim as f32;
                            for (o, &x) in dx.iter_mut().zip(x) {
                                *o = *o * r - x * c;
                            }
                        });
                    Ok(dx)
                })
            })
        })?;
        Ok((Some(cpu_tensor(dx, x.shape())?), None))
    }
}

fn rms_norm_composite(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let dt = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
    let y = xf.broadcast_div(&(ms + eps as f64)?.sqrt()?)?;
    y.to_dtype(dt)?.broadcast_mul(&weight.detach())
}

/// RMSNorm over the last dim: `x / sqrt(mean(x²) + eps) * weight`, `weight` of shape
/// `[dim]` is frozen (never gets a gradient); dL/dx is exact.
///
/// CPU/f32: fused rayon-parallel rows, one pass forward, one pass backward. Otherwise the
/// composite (computed in f32, cast back).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    let dim = weight.dims1()?;
    if x.dims().last() != Some(&dim) {
        bail!(
            "rms_norm: x {:?} does not end in the weight's size {dim}",
            x.shape()
        );
    }
    if !fused_f32(&[x, weight]) || dim == 0 {
        return rms_norm_composite(x, weight, eps);
    }
    x.contiguous()?
        .apply_op2(&weight.detach().contiguous()?, RmsNorm { eps })
}

// ---------------------------------------------------------------------------------------
// 3. softmax_last_dim
// ---------------------------------------------------------------------------------------

struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "fused-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_data(s, l, self.name())?;
        let dim = l.dims().last().copied().unwrap_or(1).max(1);
        let mut out = x.to_vec();
        out.par_chunks_mut(dim).for_each(softmax_row_inplace);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let dim = y.dims().last().copied().unwrap_or(1).max(1);
        let dx = with_f32(y, self.name(), |y| {
            with_f32(&grad, self.name(), |g| {
                let mut dx = vec![0f32; y.len()];
                dx.par_chunks_mut(dim)
                    .zip(y.par_chunks(dim).zip(g.par_chunks(dim)))
                    .for_each(|(dx, (y, g))| softmax_bwd_row(y, g, dx));
                Ok(dx)
            })
        })?;
        Ok(Some(cpu_tensor(dx, y.shape())?))
    }
}

/// Differentiable composite softmax with the same fully-masked-row behaviour as the fused
/// kernel (zeros, not NaN). The max is detached: softmax is shift invariant, so this is
/// exact and skips the max's backward.
fn softmax_composite(x: &Tensor) -> Result<Tensor> {
    let max = x
        .max_keepdim(D::Minus1)?
        .detach()
        .maximum(dtype_lowest(x.dtype()))?;
    let num = x.broadcast_sub(&max)?.exp()?;
    // den ≥ 1 whenever the row max is finite (the max entry contributes exp(0) = 1), so
    // den == 0 only for a fully masked row. Adding a constant 1 there turns 0/0 into 0/1
    // and keeps the division's backward finite; other rows are untouched (a clamp such as
    // `maximum(1.0)` would halve their gradient when den == 1 exactly).
    let den = num.sum_keepdim(D::Minus1)?;
    let fix = den.eq(0.0)?.to_dtype(den.dtype())?;
    num.broadcast_div(&(den + fix)?)
}

/// Softmax over the last dim, numerically stable (row max subtracted).
///
/// `-inf` entries get probability exactly 0. A row that is entirely `-inf` (e.g. a fully
/// masked attention row) yields all zeros rather than NaN, and its gradient is zero, so
/// it cannot poison the gradients of the other rows. (candle's composite softmax gives NaN
/// there.) A NaN input still propagates NaN to its row. Backward: dx = y ⊙ (g − Σ g⊙y).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if !fused_f32(&[x]) || x.rank() == 0 {
        return softmax_composite(x);
    }
    x.contiguous()?.apply_op1(Softmax)
}

// ---------------------------------------------------------------------------------------
// 4. silu_mul
// ---------------------------------------------------------------------------------------

struct SiluMul;

/// Elements per rayon task for the purely elementwise kernels.
const ELEMWISE_CHUNK: usize = 1 << 14;

/// Elements up to which an elementwise forward runs on the calling thread.
const SERIAL_ELEMWISE: usize = 1 << 16;

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "fused-silu-mul"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = f32_data(gs, gl, self.name())?;
        let u = f32_data(us, ul, self.name())?;
        let mut out = vec![0f32; g.len()];
        let kernel = |o: &mut [f32], g: &[f32], u: &[f32]| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g * sigmoid_fast(g) * u;
            }
        };
        // A decode step's few rows take microseconds: waking the rayon pool costs more.
        if g.len() <= SERIAL_ELEMWISE {
            kernel(&mut out, g, u);
        } else {
            out.par_chunks_mut(ELEMWISE_CHUNK)
                .zip(g.par_chunks(ELEMWISE_CHUNK).zip(u.par_chunks(ELEMWISE_CHUNK)))
                .for_each(|(o, (g, u))| kernel(o, g, u));
        }
        Ok((CpuStorage::F32(out), gl.shape().clone()))
    }

    /// With s = σ(gate): d_up = G·gate·s, d_gate = G·up·s·(1 + gate·(1 − s)).
    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (want_gate, want_up) = (gate.track_op(), up.track_op());
        if !want_gate && !want_up {
            return Ok((None, None));
        }
        let grad = grad.contiguous()?;
        let name = self.name();
        let n = gate.elem_count();
        let (dg, du) = with_f32(gate, name, |g| {
            with_f32(up, name, |u| {
                with_f32(&grad, name, |gr| {
                    let mut dg = vec![0f32; if want_gate { n } else { 0 }];
                    let mut du = vec![0f32; if want_up { n } else { 0 }];
                    let c = ELEMWISE_CHUNK;
                    let inputs = g.par_chunks(c).zip(u.par_chunks(c)).zip(gr.par_chunks(c));
                    match (want_gate, want_up) {
                        (true, true) => dg
                            .par_chunks_mut(c)
                            .zip(du.par_chunks_mut(c))
                            .zip(inputs)
                            .for_each(|((dg, du), ((g, u), gr))| {
                                // Zipped iterators (no indexing) so the loop has no bounds
                                // checks and vectorises.
                                let outs = dg.iter_mut().zip(du.iter_mut());
                                for ((dg, du), ((&g, &u), &gr)) in outs.zip(g.iter().zip(u).zip(gr))
                                {
                                    let s = sigmoid_fast(g);
                                    *du = gr * g * s;
                                    *dg = gr * u * s * (1.0 + g * (1.0 - s));
                                }
                            }),
                        (true, false) => {
                            dg.par_chunks_mut(c)
                                .zip(inputs)
                                .for_each(|(dg, ((g, u), gr))| {
                                    for (dg, ((&g, &u), &gr)) in
                                        dg.iter_mut().zip(g.iter().zip(u).zip(gr))
                                    {
                                        let s = sigmoid_fast(g);
                                        *dg = gr * u * s * (1.0 + g * (1.0 - s));
                                    }
                                })
                        }
                        _ => du
                            .par_chunks_mut(c)
                            .zip(inputs)
                            .for_each(|(du, ((g, _u), gr))| {
                                for (du, (&g, &gr)) in du.iter_mut().zip(g.iter().zip(gr)) {
                                    *du = gr * g * sigmoid_fast(g);
                                }
                            }),
                    }
                    Ok((dg, du))
                })
            })
        })?;
        let dg = if want_gate {
            Some(cpu_tensor(dg, gate.shape())?)
        } else {
            None
        };
        let du = if want_up {
            Some(cpu_tensor(du, up.shape())?)
        } else {
            None
        };
        Ok((dg, du))
    }
}

/// SwiGLU activation `silu(gate) ⊙ up` (same shapes), fused; gradients flow to both inputs.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.shape() != up.shape() {
        bail!(
            "silu_mul: shape mismatch {:?} vs {:?}",
            gate.shape(),
            up.shape()
        );
    }
    if !fused_f32(&[gate, up]) {
        return gate.silu()? * up;
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMul)
}

// ---------------------------------------------------------------------------------------
// 5. rope
// ---------------------------------------------------------------------------------------

/// RoPE over contiguous x [b, h, t, d] with cos/sin [t, d/2]: rotate-half (pairs j, j + d/2)
/// or interleaved (pairs 2j, 2j + 1). The backward is the same kernel with sin negated (the
/// inverse rotation), applied without backward.
struct Rope {
    interleaved: bool,
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_data(xs, xl, self.name())?;
        let cos = f32_data(cs, cl, self.name())?;
        let sin = f32_data(ss, sl, self.name())?;
        let (_b, _h, t, d) = xl.shape().dims4()?;
        let hd = d / 2;
        let mut out = vec![0f32; x.len()];
        let interleaved = self.interleaved;
        out.par_chunks_mut(t * d)
            .zip(x.par_chunks(t * d))
            .for_each(|(o, x)| {
                for ti in 0..t {
                    let (c, s) = (&cos[ti * hd..(ti + 1) * hd], &sin[ti * hd..(ti + 1) * hd]);
                    if interleaved {
                        // Same expressions as candle_nn::rotary_emb::rope_i.
                        let (xr, or) = (&x[ti * d..(ti + 1) * d], &mut o[ti * d..(ti + 1) * d]);
                        for j in 0..hd {
                            let (x0, x1) = (xr[2 * j], xr[2 * j + 1]);
                            or[2 * j] = x0 * c[j] - x1 * s[j];
                            or[2 * j + 1] = x0 * s[j] + x1 * c[j];
                        }
                        continue;
                    }
                    let (x1, x2) = x[ti * d..(ti + 1) * d].split_at(hd);
                    let (o1, o2) = o[ti * d..(ti + 1) * d].split_at_mut(hd);
                    // Same expressions as candle_nn::rotary_emb::rope, so the result is
                    // bit-identical.
                    for j in 0..hd {
                        o1[j] = x1[j] * c[j] - x2[j] * s[j];
                        o2[j] = x1[j] * s[j] + x2[j] * c[j];
                    }
                }
            });
        Ok((CpuStorage::F32(out), xl.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dx = grad
            .contiguous()?
            .apply_op3_no_bwd(cos, &sin.neg()?, &Rope { interleaved: self.interleaved })?;
        Ok((Some(dx), None, None))
    }
}

fn rope_composite(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (_b, _h, t, d) = x.dims4()?;
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?.narrow(0, 0, t)?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?.narrow(0, 0, t)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

/// Rotate-half (non-interleaved, HF Llama) RoPE: `x` is `[b, h, t, d]`, `cos`/`sin` are
/// `[t_max, d/2]` with `t_max ≥ t` (the first `t` rows are used). First half:
/// `x1·cos − x2·sin`, second half: `x2·cos + x1·sin`.
///
/// Forward is bit-identical to `candle_nn::rotary_emb::rope`; backward is the inverse
/// rotation (sin → −sin). Only `x` gets a gradient (cos/sin are constant tables).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope_fused(x, cos, sin, false)
}

fn rope_fused(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    let (_b, _h, t, d) = x.dims4()?;
    let (tc, hc) = cos.dims2()?;
    let (ts, hs) = sin.dims2()?;
    if d % 2 != 0 || hc * 2 != d || hs * 2 != d || tc < t || ts < t {
        bail!(
            "rope: inconsistent shapes x {:?} cos {:?} sin {:?}",
            x.shape(),
            cos.shape(),
            sin.shape()
        );
    }
    let cos = cos.detach().narrow(0, 0, t)?;
    let sin = sin.detach().narrow(0, 0, t)?;
    if !fused_f32(&[x, &cos, &sin]) {
        return match interleaved {
            false => rope_composite(x, &cos, &sin),
            true => rope_interleaved_composite(x, &cos, &sin),
        };
    }
    x.contiguous()?
        .apply_op3(&cos.contiguous()?, &sin.contiguous()?, Rope { interleaved })
}

// ---------------------------------------------------------------------------------------
// 6. cross_entropy_masked
// ---------------------------------------------------------------------------------------

/// Output layout: `[1 + n]` = `[loss, lse_0, …, lse_{n-1}]`. The per-row log-sum-exp rides
/// along in the op's result so the backward can rebuild softmax in one pass
/// (exp(x − lse)) without re-reducing the 49152-wide rows; the public function narrows
/// element 0 out, so the lse entries never receive a gradient.
struct CrossEntropy;

const CE_MIN_DENOM: f32 = 1e-8;

impl CustomOp3 for CrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        ls: &CpuStorage,
        ll: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let logits = f32_data(ls, ll, self.name())?;
        let w = f32_data(ws, wl, self.name())?;
        let targets = match tl.contiguous_offsets() {
            Some((a, b)) => &ts.as_slice::<u32>()?[a..b],
            None => bail!("fused-cross-entropy: targets must be contiguous"),
        };
        let (n, vocab) = ll.shape().dims2()?;
        for (i, (&t, &w)) in targets.iter().zip(w).enumerate() {
            if w != 0.0 && t as usize >= vocab {
                bail!(
                    "cross_entropy_masked: target {t} at row {i} is out of range for vocab {vocab}"
                );
            }
        }
        let mut out = vec![0f32; 1 + n];
        // Masked rows (w == 0) are skipped entirely: they cost nothing and cannot inject
        // NaN/inf from garbage logits.
        let loss_sum: f64 = out[1..]
            .par_iter_mut()
            .zip(logits.par_chunks(vocab.max(1)))
            .zip(targets.par_iter().zip(w.par_iter()))
            .map(|((lse_out, row), (&t, &w))| {
                if w == 0.0 {
                    return 0.0;
                }
                let m = max_f32(row);
                let lse = m + sum_exp_shifted(row, m).ln();
                *lse_out = lse;
                w as f64 * (lse - row[t as usize]) as f64
            })
            .sum();
        let wsum: f64 = w.iter().map(|&w| w as f64).sum();
        out[0] = (loss_sum / wsum.max(CE_MIN_DENOM as f64)) as f32;
        Ok((CpuStorage::F32(out), Shape::from(1 + n)))
    }

    /// dlogits_i = (softmax_i − onehot(t_i)) · w_i / Σw · g, with softmax_i rebuilt as
    /// exp(x − lse_i). Targets and weights get no gradient.
    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        weights: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (_n, vocab) = logits.dims2()?;
        let g = grad.narrow(0, 0, 1)?.to_vec1::<f32>()?[0];
        let targets = targets.to_vec1::<u32>()?;
        let name = self.name();
        let dx = with_f32(logits, name, |x| {
            with_f32(weights, name, |w| {
                with_f32(res, name, |res| {
                    let wsum: f64 = w.iter().map(|&w| w as f64).sum();
                    let scale = g as f64 / wsum.max(CE_MIN_DENOM as f64);
                    let mut dx = vec![0f32; x.len()];
                    dx.par_chunks_mut(vocab.max(1))
                        .zip(x.par_chunks(vocab.max(1)))
                        .zip(
                            res[1..]
                                .par_iter()
                                .zip(targets.par_iter().zip(w.par_iter())),
                        )
                        .for_each(|((dx, x), (&lse, (&t, &w)))| {
                            if w == 0.0 {
                                return; // already zero
                            }
                            let c = (w as f64 * scale) as f32;
                            for (o, &x) in dx.iter_mut().zip(x) {
                                *o = exp_f32(x - lse) * c;
                            }
                            dx[t as usize] -= c;
                        });
                    Ok(dx)
                })
            })
        })?;
        Ok((Some(cpu_tensor(dx, logits.shape())?), None, None))
    }
}

fn cross_entropy_composite(logits: &Tensor, targets: &Tensor, weights: &Tensor) -> Result<Tensor> {
    let lsm = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let nll = lsm.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?;
    let weights = weights.detach().to_dtype(nll.dtype())?;
    let denom = weights.sum_all()?.maximum(CE_MIN_DENOM as f64)?;
    (nll * &weights)?.sum_all()?.div(&denom)
}

/// Weighted mean token cross-entropy:
/// `Σᵢ wᵢ · (−log softmax(logitsᵢ)[targetᵢ]) / max(Σᵢ wᵢ, 1e-8)`,
/// i.e. the mean over counted tokens when `weights` is a 0/1 mask (an all-zero mask gives
/// 0). `logits` `[n, vocab]`, `targets` `[n]` (u32; other integer dtypes are converted),
/// `weights` `[n]`. Returns a scalar (rank 0). Only `logits` gets a gradient.
///
/// CPU/f32: fused and rayon-parallel over rows; log-softmax is never materialised (the
/// forward keeps only one log-sum-exp per row), rows with weight 0 are skipped (their
/// targets are not range-checked either), and the backward allocates only dlogits.
/// Otherwise: composite log_softmax + gather.
pub fn cross_entropy_masked(logits: &Tensor, targets: &Tensor, weights: &Tensor) -> Result<Tensor> {
    let (n, _vocab) = logits.dims2()?;
    if targets.dims1()? != n || weights.dims1()? != n {
        bail!(
            "cross_entropy_masked: logits {:?}, targets {:?}, weights {:?} disagree",
            logits.shape(),
            targets.shape(),
            weights.shape()
        );
    }
    let targets = if targets.dtype() == DType::U32 {
        targets.clone()
    } else {
        targets.to_dtype(DType::U32)?
    };
    if !fused_f32(&[logits, weights]) || !targets.device().is_cpu() {
        return cross_entropy_composite(logits, &targets, weights);
    }
    let res = logits.contiguous()?.apply_op3(
        &targets.contiguous()?,
        &weights.detach().contiguous()?,
        CrossEntropy,
    )?;
    res.narrow(0, 0, 1)?.squeeze(0)
}

// ---------------------------------------------------------------------------------------
// 7. causal_attention
// ---------------------------------------------------------------------------------------
//
// Two private custom ops, both aware of the causal structure:
//   P = CausalProbs(q, k [, bias])   softmax(scale·q·kᵀ + bias) with future keys masked
//   O = CausalPv(P, v)               P·v
// Queries are processed in blocks of ATTN_BLOCK rows; a block only multiplies against the
// keys its last row can see, and the key-side gradients (dk, dv) are computed per key block
// from only the queries that see those keys. For tq = tk = 512 and 128-row blocks this
// skips ~3/8 of the six gemms' work, and the masked entries are never scaled, exponentiated
// or stored. All gemms go through candle's CPU gemm (`CpuStorage::matmul`) on strided views.
// P is the only saved activation (the composite keeps the raw scores, scaled scores, masked
// scores and P).

/// Query/key block size for the causal attention kernels.
const ATTN_BLOCK: usize = 128;

/// Number of keys query `i` may attend when `tq` queries are the last of `tk` positions.
#[inline]
fn visible_keys(i: usize, tq: usize, tk: usize) -> usize {
    (tk + i + 1).saturating_sub(tq).min(tk)
}

/// First query that sees key `j` (tq if none does).
#[inline]
fn first_query_seeing(j: usize, tq: usize, tk: usize) -> usize {
    (j + tq).saturating_sub(tk).min(tq)
}

/// `[start, end)` blocks of `ATTN_BLOCK` rows covering `0..n`.
fn blocks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(ATTN_BLOCK)
        .map(move |s| (s, (s + ATTN_BLOCK).min(n)))
}

/// A batch of strided matrices inside a CPU storage: element (b, r, c) lives at
/// `offset + b·bs + r·rs + c·cs`.
#[derive(Clone, Copy)]
struct MatView {
    offset: usize,
    bs: usize,
    rs: usize,
    cs: usize,
}

impl MatView {
    fn rows(offset: usize, bs: usize, rs: usize) -> Self {
        Self {
            offset,
            bs,
            rs,
            cs: 1,
        }
    }
    /// The transpose of a row-major view.
    fn cols(offset: usize, bs: usize, cs: usize) -> Self {
        Self {
            offset,
            bs,
            rs: 1,
            cs,
        }
    }
}

/// Sizes of a batched product: `batch` products of an m×k and a k×n matrix.
#[derive(Clone, Copy)]
struct GemmShape {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
}

/// out[b] = a[b] (m×k) · b[b] (k×n) for `batch` matrices, returned contiguous
/// (batch, m, n), via candle's CPU gemm. candle does not bounds-check matmul layouts (the
/// gemm reads raw pointers), so the views are checked here.
fn bgemm(a: &CpuStorage, av: MatView, b: &CpuStorage, bv: MatView, shape: GemmShape) -> Result<Vec<f32>> {
    let GemmShape { batch, m, n, k } = shape;
    if batch * m * n == 0 {
        return Ok(vec![]);
    }
    if k == 0 {
        return Ok(vec![0.0; batch * m * n]);
    }
    let fits = |v: &MatView, s: &CpuStorage, rows: usize, cols: usize| -> Result<bool> {
        let last = v.offset + (batch - 1) * v.bs + (rows - 1) * v.rs + (cols - 1) * v.cs;
        Ok(last < s.as_slice::<f32>()?.len())
    };
    if !fits(&av, a, m, k)? || !fits(&bv, b, k, n)? {
        bail!("fused-attention: internal error, gemm view out of bounds");
    }
    let al = Layout::new(
        Shape::from((batch, m, k)),
        vec![av.bs, av.rs, av.cs],
        av.offset,
    );
    let bl = Layout::new(
        Shape::from((batch, k, n)),
        vec![bv.bs, bv.rs, bv.cs],
        bv.offset,
    );
    match a.matmul(b, (batch, m, n, k), &al, &bl)? {
        CpuStorage::F32(v) => Ok(v),
        _ => bail!("fused-attention: expected an f32 gemm result"),
    }
}

/// One gemm result per row block: rows `[start, end)` of every batch entry, `width`
/// columns, stored contiguous (batch, end − start, width).
struct RowBlock {
    start: usize,
    width: usize,
    data: Vec<f32>,
}

/// Scatters per-block gemm results into a zeroed contiguous (batch, t, w) buffer, one
/// rayon task per row. Row `r` copies `row_width(r)` ≤ block width columns, multiplied by
/// `mul`. Blocks are `ATTN_BLOCK` rows, so block index = r / ATTN_BLOCK.
fn assemble(
    batch: usize,
    t: usize,
    w: usize,
    blocks: &[Option<RowBlock>],
    mul: f32,
    row_width: impl Fn(usize) -> usize + Sync,
) -> Vec<f32> {
    let mut out = vec![0f32; batch * t * w];
    out.par_chunks_mut(w.max(1))
        .enumerate()
        .for_each(|(idx, row)| {
            let (bi, r) = (idx / t, idx % t);
            if let Some(Some(blk)) = blocks.get(r / ATTN_BLOCK) {
                let rows = blk.data.len() / (batch * blk.width).max(1);
                let src = (bi * rows + (r - blk.start)) * blk.width;
                let n = row_width(r).min(blk.width);
                for (o, &s) in row[..n].iter_mut().zip(&blk.data[src..src + n]) {
                    *o = s * mul;
                }
            }
        });
    out
}

/// Runs `f` on the CPU storage and layout of a tensor.
fn with_cpu<R>(
    t: &Tensor,
    op: &'static str,
    f: impl FnOnce(&CpuStorage, &Layout) -> Result<R>,
) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => f(s, layout),
        _ => bail!("{op}: expected a cpu tensor"),
    }
}

/// `P = softmax(scale·q·kᵀ + bias)` over q [b,h,tq,d], k [b,h,tk,d] (contiguous) with
/// future keys masked, and an optional bias given as a (possibly stride-0 broadcast)
/// [b,h,tq,tk] view. Entries of P beyond a row's visible keys are exactly 0.
struct CausalProbs {
    scale: f32,
}

impl CausalProbs {
    fn fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, tq, d) = ql.shape().dims4()?;
        let (_, _, tk, _) = kl.shape().dims4()?;
        if !ql.is_contiguous() || !kl.is_contiguous() {
            bail!("fused-attention: q and k must be contiguous");
        }
        let bh = b * h;
        // Raw scores per query block, only against the keys the block can see.
        let mut scores = Vec::new();
        for (i0, i1) in blocks(tq) {
            let lim = visible_keys(i1 - 1, tq, tk);
            let data = bgemm(
                qs,
                MatView::rows(ql.start_offset() + i0 * d, tq * d, d),
                ks,
                MatView::cols(kl.start_offset(), tk * d, d),
                GemmShape { batch: bh, m: i1 - i0, n: lim, k: d },
            )?;
            scores.push(RowBlock {
                start: i0,
                width: lim,
                data,
            });
        }
        let bias = match bias {
            Some((s, l)) => Some((s.as_slice::<f32>()?, l.stride().to_vec(), l.start_offset())),
            None => None,
        };
        let scale = self.scale;
        let mut p = vec![0f32; bh * tq * tk];
        p.par_chunks_mut(tk).enumerate().for_each(|(idx, row)| {
            let (bhi, i) = (idx / tq, idx % tq);
            let lim = visible_keys(i, tq, tk);
            let blk = &scores[i / ATTN_BLOCK];
            let src =
                (bhi * (blk.data.len() / (bh * blk.width).max(1)) + i - blk.start) * blk.width;
            let (vis, src) = (&mut row[..lim], &blk.data[src..src + lim]);
            match &bias {
                None => {
                    for (v, &s) in vis.iter_mut().zip(src) {
                        *v = s * scale;
                    }
                }
                Some((data, st, off)) => {
                    let base = off + (bhi / h) * st[0] + (bhi % h) * st[1] + i * st[2];
                    if st[3] == 1 {
                        let bias = &data[base..base + lim];
                        for ((v, &s), &bb) in vis.iter_mut().zip(src).zip(bias) {
                            *v = s * scale + bb;
                        }
                    } else {
                        for (j, (v, &s)) in vis.iter_mut().zip(src).enumerate() {
                            *v = s * scale + data[base + j * st[3]];
                        }
                    }
                }
            }
            softmax_row_inplace(vis);
        });
        Ok((CpuStorage::F32(p), Shape::from((b, h, tq, tk))))
    }

    /// dS = P ⊙ (dP − Σ dP⊙P) on visible entries (dP beyond them is ignored);
    /// dq = scale·dS·k per query block, dk = scale·dSᵀ·q per key block (only the queries
    /// that see the block), dbias = dS (candle's broadcast backward sums it to the bias's
    /// own shape).
    fn bwd_impl(
        &self,
        q: &Tensor,
        k: &Tensor,
        bias_wants_grad: bool,
        p: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (want_q, want_k) = (q.track_op(), k.track_op());
        if !want_q && !want_k && !bias_wants_grad {
            return Ok((None, None, None));
        }
        let (b, h, tq, d) = q.dims4()?;
        let dims = AttnDims { bh: b * h, tq, tk: k.dim(2)?, d };
        let grad = grad.contiguous()?;
        let ds = CpuStorage::F32(causal_softmax_bwd(p, &grad, dims)?);
        let dq = if want_q { Some(cpu_tensor(causal_dq(&ds, k, dims, self.scale)?, q.shape())?) } else { None };
        let dk = if want_k { Some(cpu_tensor(causal_dk(&ds, q, dims, self.scale)?, k.shape())?) } else { None };
        let dbias = if bias_wants_grad {
            match ds {
                CpuStorage::F32(ds) => Some(cpu_tensor(ds, p.shape())?),
                _ => None,
            }
        } else {
            None
        };
        Ok((dq, dk, dbias))
    }
}

/// Sizes of a causal attention: batch × heads, queries, keys and head dim.
#[derive(Clone, Copy)]
struct AttnDims {
    bh: usize,
    tq: usize,
    tk: usize,
    d: usize,
}

/// The attention ops' name in errors.
const FUSED_ATTENTION: &str = "fused-attention";

/// dS = P ⊙ (dP − Σ dP⊙P) on each row's visible entries (zero beyond them), `[bh, tq, tk]`.
fn causal_softmax_bwd(p: &Tensor, grad: &Tensor, dims: AttnDims) -> Result<Vec<f32>> {
    let AttnDims { tq, tk, .. } = dims;
    with_f32(p, FUSED_ATTENTION, |p| {
        with_f32(grad, FUSED_ATTENTION, |g| {
            let mut ds = vec![0f32; p.len()];
            ds.par_chunks_mut(tk).zip(p.par_chunks(tk).zip(g.par_chunks(tk))).enumerate().for_each(
                |(idx, (ds, (p, g)))| {
                    let lim = visible_keys(idx % tq, tq, tk);
                    softmax_bwd_row(&p[..lim], &g[..lim], &mut ds[..lim]);
                },
            );
            Ok(ds)
        })
    })
}

/// dq = scale·dS·k.
fn causal_dq(ds: &CpuStorage, k: &Tensor, dims: AttnDims, scale: f32) -> Result<Vec<f32>> {
    with_cpu(k, FUSED_ATTENTION, |ks, kl| causal_times((ds, 0), (ks, kl.start_offset()), dims, scale))
}

/// dk = scale·dSᵀ·q.
fn causal_dk(ds: &CpuStorage, q: &Tensor, dims: AttnDims, scale: f32) -> Result<Vec<f32>> {
    with_cpu(q, FUSED_ATTENTION, |qs, ql| causal_transposed_times((ds, 0), (qs, ql.start_offset()), dims, scale))
}

/// `mul·A·B` for causal A `[bh, tq, tk]` (zero beyond each row's visible keys) and B
/// `[bh, tk, d]`, per query block against only the keys it sees: `[bh, tq, d]`. Each operand
/// is a contiguous storage and the offset it starts at. (`P·v` and `dq`.)
fn causal_times(a: (&CpuStorage, usize), b: (&CpuStorage, usize), dims: AttnDims, mul: f32) -> Result<Vec<f32>> {
    let AttnDims { bh, tq, tk, d } = dims;
    let blks = blocks(tq)
        .map(|(i0, i1)| {
            let lim = visible_keys(i1 - 1, tq, tk);
            let data = bgemm(
                a.0,
                MatView::rows(a.1 + i0 * tk, tq * tk, tk),
                b.0,
                MatView::rows(b.1, tk * d, d),
                GemmShape { batch: bh, m: i1 - i0, n: d, k: lim },
            )?;
            Ok(Some(RowBlock { start: i0, width: d, data }))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(assemble(bh, tq, d, &blks, mul, |_| d))
}

/// `mul·Aᵀ·B` for causal A `[bh, tq, tk]` and B `[bh, tq, d]`, per key block over only the
/// queries that see it: `[bh, tk, d]`. Operands as in [`causal_times`]. (`dv` and `dk`.)
fn causal_transposed_times(
    a: (&CpuStorage, usize),
    b: (&CpuStorage, usize),
    dims: AttnDims,
    mul: f32,
) -> Result<Vec<f32>> {
    let AttnDims { bh, tq, tk, d } = dims;
    let blks = blocks(tk)
        .map(|(j0, j1)| {
            let first = first_query_seeing(j0, tq, tk);
            if first >= tq {
                return Ok(None);
            }
            let data = bgemm(
                a.0,
                MatView::cols(a.1 + first * tk + j0, tq * tk, tk),
                b.0,
                MatView::rows(b.1 + first * d, tq * d, d),
                GemmShape { batch: bh, m: j1 - j0, n: d, k: tq - first },
            )?;
            Ok(Some(RowBlock { start: j0, width: d, data }))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(assemble(bh, tk, d, &blks, mul, |_| d))
}

impl CustomOp2 for CausalProbs {
    fn name(&self) -> &'static str {
        "fused-attention-probs"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd(qs, ql, ks, kl, None)
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, _) = self.bwd_impl(q, k, false, res, grad)?;
        Ok((dq, dk))
    }
}

impl CustomOp3 for CausalProbs {
    fn name(&self) -> &'static str {
        "fused-attention-probs-bias"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.fwd(qs, ql, ks, kl, Some((bs, bl)))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        bias: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.bwd_impl(q, k, bias.track_op(), res, grad)
    }
}

/// `O = P·v` for causal P [b,h,tq,tk] (as produced by `CausalProbs`: zero beyond each
/// row's visible keys, contiguous) and contiguous v [b,h,tk,d]. Only the visible part of
/// P is multiplied. Backward: dP = dO·vᵀ on visible entries only (CausalProbs ignores the
/// rest), dv = Pᵀ·dO per key block over the queries that see it.
struct CausalPv;

impl CustomOp2 for CausalPv {
    fn name(&self) -> &'static str {
        "fused-attention-pv"
    }

    fn cpu_fwd(
        &self,
        ps: &CpuStorage,
        pl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, tq, tk) = pl.shape().dims4()?;
        let d = vl.dim(3)?;
        if !pl.is_contiguous() || !vl.is_contiguous() {
            bail!("fused-attention: P and v must be contiguous");
        }
        let dims = AttnDims { bh: b * h, tq, tk, d };
        let out = causal_times((ps, pl.start_offset()), (vs, vl.start_offset()), dims, 1.0)?;
        Ok((CpuStorage::F32(out), Shape::from((b, h, tq, d))))
    }

    fn bwd(
        &self,
        p: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (b, h, tq, tk) = p.dims4()?;
        let d = v.dim(3)?;
        let bh = b * h;
        let grad = grad.contiguous()?;
        let (dp, dv) = with_cpu(&grad, FUSED_ATTENTION, |gs, gl| {
            with_cpu(p, FUSED_ATTENTION, |ps, pl| {
                with_cpu(v, FUSED_ATTENTION, |vs, vl| {
                    let dp = if p.track_op() {
                        let blks = blocks(tq)
                            .map(|(i0, i1)| {
                                let lim = visible_keys(i1 - 1, tq, tk);
                                let data = bgemm(
                                    gs,
                                    MatView::rows(gl.start_offset() + i0 * d, tq * d, d),
                                    vs,
                                    MatView::cols(vl.start_offset(), tk * d, d),
                                    GemmShape { batch: bh, m: i1 - i0, n: lim, k: d },
                                )?;
                                Ok(Some(RowBlock {
                                    start: i0,
                                    width: lim,
                                    data,
                                }))
                            })
                            .collect::<Result<Vec<_>>>()?;
                        let dp = assemble(bh, tq, tk, &blks, 1.0, |i| visible_keys(i, tq, tk));
                        Some(cpu_tensor(dp, p.shape())?)
                    } else {
                        None
                    };
                    let dv = if v.track_op() {
                        let dims = AttnDims { bh, tq, tk, d };
                        let dv = causal_transposed_times((ps, pl.start_offset()), (gs, gl.start_offset()), dims, 1.0)?;
                        Some(cpu_tensor(dv, v.shape())?)
                    } else {
                        None
                    };
                    Ok((dp, dv))
                })
            })
        })?;
        Ok((dp, dv))
    }
}

/// Additive causal mask [tq, tk]: 0 where key j is visible to query i, -inf elsewhere.
fn causal_mask(tq: usize, tk: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..tq)
        .flat_map(|i| {
            let lim = visible_keys(i, tq, tk);
            (0..tk).map(move |j| if j < lim { 0.0 } else { f32::NEG_INFINITY })
        })
        .collect();
    Tensor::from_vec(mask, (tq, tk), device)?.to_dtype(dtype)
}

fn causal_attention_composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let (_, _, tq, _) = q.dims4()?;
    let (_, _, tk, _) = k.dims4()?;
    let scores = (q.contiguous()?.matmul(&k.contiguous()?.t()?)? * scale)?;
    let scores = scores.broadcast_add(&causal_mask(tq, tk, scores.dtype(), q.device())?)?;
    let scores = match bias {
        Some(bias) => scores.broadcast_add(bias)?,
        None => scores,
    };
    softmax_composite(&scores)?.matmul(&v.contiguous()?)
}

/// Causal scaled-dot-product attention with an optional additive (trainable) bias.
///
/// `q` `[b, h, tq, d]`, `k`/`v` `[b, h, tk, d]` (KV heads already repeated for GQA).
/// Query `i` sits at absolute position `tk − tq + i` and attends keys `0..=tk − tq + i`;
/// if `tq > tk` the first `tq − tk` queries see no key and output zeros (zero gradient).
/// `bias` is broadcastable to `[b, h, tq, tk]` and is added after scaling; its gradient
/// flows (summed back to its own shape by candle's broadcast backward). Gradients flow to
/// q, k, v and bias.
///
/// CPU/f32: two fused custom ops (see `CausalProbs` / `CausalPv`): block-causal gemms that
/// skip fully masked key ranges, one rayon pass for scale + bias + mask + softmax, only P
/// saved for the backward, one pass for the softmax backward. Otherwise the composite
/// (matmul, mask, bias, softmax, matmul).
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let (b, h, tq, d) = q.dims4()?;
    let (kb, kh, tk, kd) = k.dims4()?;
    if (kb, kh, kd) != (b, h, d) || v.dims4()? != (b, h, tk, d) {
        bail!(
            "causal_attention: q {:?}, k {:?}, v {:?} disagree",
            q.shape(),
            k.shape(),
            v.shape()
        );
    }
    let mut all = vec![q, k, v];
    all.extend(bias);
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && matches!(q.dtype(), DType::F32 | DType::BF16) && tq > 0 && tk > 0 && d > 0 {
        // cuBLAS q·kᵀ, the fused masked softmax kernel (kernels/masked_softmax.cu), cuBLAS P·v.
        let scores = q.contiguous()?.matmul(&k.contiguous()?.t()?)?;
        let probs = crate::kernels::masked_softmax::masked_softmax(&scores, bias, scale)?;
        return probs.matmul(&v.contiguous()?);
    }
    if !fused_f32(&all) || tq == 0 || tk == 0 || d == 0 {
        return causal_attention_composite(q, k, v, scale, bias);
    }
    let op = CausalProbs {
        scale: scale as f32,
    };
    let (q, k) = (q.contiguous()?, k.contiguous()?);
    let probs = match bias {
        None => q.apply_op2(&k, op)?,
        Some(bias) => q.apply_op3(&k, &bias.broadcast_as((b, h, tq, tk))?, op)?,
    };
    probs.apply_op2(&v.contiguous()?, CausalPv)
}

/// Interleaved RoPE (pairs 2i, 2i+1; llama.cpp's layout for llama-architecture GGUF files):
/// one fused pass forward and backward (as `rope`); bit-identical to
/// `candle_nn::rotary_emb::rope_i`.
pub fn rope_interleaved(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope_fused(x, cos, sin, true)
}

/// Reference for `rope_interleaved` (and its path for non-f32 or CUDA tensors): rotate-half RoPE
/// on de-interleaved dims, differentiable through `index_select`.
fn rope_interleaved_composite(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let to_halves: Vec<u32> = (0..d as u32).step_by(2).chain((1..d as u32).step_by(2)).collect();
    let mut back = vec![0u32; d];
    for (i, &j) in to_halves.iter().enumerate() {
        back[j as usize] = i as u32;
    }
    let to_halves = Tensor::new(to_halves, x.device())?;
    let back = Tensor::new(back, x.device())?;
    let y = rope(&x.contiguous()?.index_select(&to_halves, 3)?, cos, sin)?;
    y.index_select(&back, 3)
}

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    /// Deterministic pseudo-random values in [-scale, scale] (xorshift32).
    fn fill(n: usize, seed: u32, scale: f32) -> Vec<f32> {
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

    fn rand_t<S: Into<Shape>>(shape: S, seed: u32, scale: f32) -> Tensor {
        let shape = shape.into();
        Tensor::from_vec(fill(shape.elem_count(), seed, scale), shape, &Device::Cpu).unwrap()
    }

    fn var<S: Into<Shape>>(shape: S, seed: u32, scale: f32) -> Var {
        Var::from_tensor(&rand_t(shape, seed, scale)).unwrap()
    }

    /// max |a − b| / max(1, max |b|)
    fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
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

    fn assert_close(a: &Tensor, b: &Tensor, tol: f32, what: &str) {
        let d = rel_diff(a, b);
        assert!(d <= tol, "{what}: relative max diff {d} > {tol}");
    }

    /// Random projection so that the upstream gradient is neither uniform nor stride-0.
    fn loss_of(y: &Tensor, seed: u32) -> Tensor {
        let r = rand_t(y.shape().clone(), seed, 1.0);
        (y * r).unwrap().sum_all().unwrap()
    }

    fn grad(g: &candle_core::backprop::GradStore, v: &Var) -> Tensor {
        g.get(v.as_tensor()).expect("missing gradient").clone()
    }

    const FWD_TOL: f32 = 1e-5;
    const BWD_TOL: f32 = 1e-4;

    fn plain_softmax(x: &Tensor) -> Tensor {
        candle_nn::ops::softmax(x, D::Minus1).unwrap()
    }

    // Checks forward + x-gradient against x·wᵀ for ranks 2, 3, 4 and a transposed x, and
    // that the (Var) weight gets no gradient entry.
    #[test]
    fn frozen_linear_pretransposed_matches_frozen_linear() {
        let w = var((24, 40), 1, 0.5);
        let wt = w.as_tensor().t().unwrap().contiguous().unwrap();
        for (si, shape) in [vec![7, 40], vec![2, 5, 40]].into_iter().enumerate() {
            let x = var(shape, 30 + si as u32, 1.0);
            let y = frozen_linear_pretransposed(x.as_tensor(), w.as_tensor(), &wt).unwrap();
            let y_ref = frozen_linear(x.as_tensor(), w.as_tensor()).unwrap();
            assert_close(&y, &y_ref, FWD_TOL, "pretransposed fwd");
            let g = loss_of(&y, 3).backward().unwrap();
            let g_ref = loss_of(&y_ref, 3).backward().unwrap();
            assert_close(&grad(&g, &x), &grad(&g_ref, &x), BWD_TOL, "pretransposed dx");
            assert!(g.get(w.as_tensor()).is_none() && g.get(&wt).is_none(), "weights get no gradient");
        }
    }

    #[test]
    fn frozen_linear_matches_matmul_and_freezes_weight() {
        let w = var((24, 40), 1, 0.5);
        let shapes: Vec<Vec<usize>> = vec![vec![7, 40], vec![2, 5, 40], vec![2, 3, 4, 40]];
        for (si, shape) in shapes.into_iter().enumerate() {
            let x = var(shape.clone(), 10 + si as u32, 1.0);
            let y = frozen_linear(x.as_tensor(), w.as_tensor()).unwrap();
            let y_ref = x
                .as_tensor()
                .broadcast_matmul(&w.as_tensor().t().unwrap())
                .unwrap();
            assert_close(&y, &y_ref, FWD_TOL, "frozen_linear fwd");
            let g = loss_of(&y, 3).backward().unwrap();
            let g_ref = loss_of(&y_ref, 3).backward().unwrap();
            assert_close(
                &grad(&g, &x),
                &grad(&g_ref, &x),
                BWD_TOL,
                "frozen_linear dx",
            );
            assert!(
                g.get(w.as_tensor()).is_none(),
                "weight must not get a gradient"
            );
            assert!(g_ref.get(w.as_tensor()).is_some());
        }
        // Non-contiguous x: [40, 6] transposed to [6, 40].
        let xt = var((40, 6), 20, 1.0);
        let x = xt.as_tensor().t().unwrap();
        assert!(!x.is_contiguous());
        let y = frozen_linear(&x, w.as_tensor()).unwrap();
        let y_ref = x.matmul(&w.as_tensor().t().unwrap()).unwrap();
        assert_close(&y, &y_ref, FWD_TOL, "frozen_linear fwd (transposed x)");
        let g = loss_of(&y, 4).backward().unwrap();
        let g_ref = loss_of(&y_ref, 4).backward().unwrap();
        assert_close(
            &grad(&g, &xt),
            &grad(&g_ref, &xt),
            BWD_TOL,
            "frozen_linear dx (transposed)",
        );
        assert!(g.get(w.as_tensor()).is_none());
    }

    fn rms_ref(x: &Tensor, w: &Tensor, eps: f32) -> Tensor {
        let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let r = (ms + eps as f64).unwrap().sqrt().unwrap().recip().unwrap();
        x.broadcast_mul(&r).unwrap().broadcast_mul(w).unwrap()
    }

    // Forward vs composite and candle_nn::ops::rms_norm, dx vs composite, no weight grad,
    // plus a narrowed (non-contiguous) input.
    #[test]
    fn rms_norm_matches_composite() {
        let eps = 1e-5;
        let w = var(64, 2, 1.0);
        let x = var((3, 5, 64), 1, 2.0);
        let y = rms_norm(x.as_tensor(), w.as_tensor(), eps).unwrap();
        let y_ref = rms_ref(x.as_tensor(), w.as_tensor(), eps);
        assert_close(&y, &y_ref, FWD_TOL, "rms fwd");
        let y_nn = candle_nn::ops::rms_norm(x.as_tensor(), w.as_tensor(), eps).unwrap();
        assert_close(&y, &y_nn, FWD_TOL, "rms fwd vs candle_nn");
        let g = loss_of(&y, 5).backward().unwrap();
        let g_ref = loss_of(&y_ref, 5).backward().unwrap();
        assert_close(&grad(&g, &x), &grad(&g_ref, &x), BWD_TOL, "rms dx");
        assert!(
            g.get(w.as_tensor()).is_none(),
            "weight must not get a gradient"
        );
        assert!(g_ref.get(w.as_tensor()).is_some());

        // Narrowed along the last dim → strided rows.
        let xb = var((6, 80), 7, 1.5);
        let x = xb.as_tensor().narrow(1, 8, 64).unwrap();
        assert!(!x.is_contiguous());
        let y = rms_norm(&x, w.as_tensor(), eps).unwrap();
        let y_ref = rms_ref(&x, w.as_tensor(), eps);
        assert_close(&y, &y_ref, FWD_TOL, "rms fwd (narrowed)");
        let g = loss_of(&y, 6).backward().unwrap();
        let g_ref = loss_of(&y_ref, 6).backward().unwrap();
        assert_close(
            &grad(&g, &xb),
            &grad(&g_ref, &xb),
            BWD_TOL,
            "rms dx (narrowed)",
        );
    }

    // x used twice (residual): gradients from both consumers must be summed.
    #[test]
    fn gradients_accumulate_across_consumers() {
        let w = var(32, 2, 1.0);
        let x = var((4, 32), 3, 1.0);
        let y = (rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap()
            + softmax_last_dim(x.as_tensor()).unwrap())
        .unwrap();
        let y = (y + x.as_tensor()).unwrap();
        let y_ref =
            (rms_ref(x.as_tensor(), w.as_tensor(), 1e-6) + plain_softmax(x.as_tensor())).unwrap();
        let y_ref = (y_ref + x.as_tensor()).unwrap();
        let g = loss_of(&y, 9).backward().unwrap();
        let g_ref = loss_of(&y_ref, 9).backward().unwrap();
        assert_close(&grad(&g, &x), &grad(&g_ref, &x), BWD_TOL, "accumulated dx");
    }

    // Forward/backward vs candle_nn::ops::softmax on a wide row set, on rows with some
    // -inf entries, and on a transposed (non-contiguous) input.
    #[test]
    fn softmax_matches_composite() {
        let x = var((4, 3, 300), 1, 6.0);
        let y = softmax_last_dim(x.as_tensor()).unwrap();
        let y_ref = plain_softmax(x.as_tensor());
        assert_close(&y, &y_ref, FWD_TOL, "softmax fwd");
        let y_nn = candle_nn::ops::softmax_last_dim(x.as_tensor()).unwrap();
        assert_close(&y, &y_nn, FWD_TOL, "softmax fwd vs candle_nn fast");
        let g = loss_of(&y, 2).backward().unwrap();
        let g_ref = loss_of(&y_ref, 2).backward().unwrap();
        assert_close(&grad(&g, &x), &grad(&g_ref, &x), BWD_TOL, "softmax dx");

        // Partially masked rows (causal pattern): identical to the composite.
        let x = var((5, 5), 3, 2.0);
        let xm = x
            .as_tensor()
            .broadcast_add(&causal_mask(5, 5, DType::F32, &Device::Cpu).unwrap())
            .unwrap();
        let y = softmax_last_dim(&xm).unwrap();
        let y_ref = plain_softmax(&xm);
        assert_close(&y, &y_ref, FWD_TOL, "softmax fwd (masked)");
        let g = loss_of(&y, 4).backward().unwrap();
        let g_ref = loss_of(&y_ref, 4).backward().unwrap();
        assert_close(
            &grad(&g, &x),
            &grad(&g_ref, &x),
            BWD_TOL,
            "softmax dx (masked)",
        );

        // Transposed input.
        let xt = var((33, 6), 8, 3.0);
        let x = xt.as_tensor().t().unwrap();
        let y = softmax_last_dim(&x).unwrap();
        let y_ref = plain_softmax(&x);
        assert_close(&y, &y_ref, FWD_TOL, "softmax fwd (transposed)");
        let g = loss_of(&y, 6).backward().unwrap();
        let g_ref = loss_of(&y_ref, 6).backward().unwrap();
        assert_close(
            &grad(&g, &xt),
            &grad(&g_ref, &xt),
            BWD_TOL,
            "softmax dx (transposed)",
        );
    }

    // A row that is entirely -inf gives zeros (no NaN), zero gradient, and leaves the other
    // rows' values and gradients identical to the plain composite; the composite fallback
    // used off-CPU behaves the same.
    #[test]
    fn softmax_fully_masked_row_is_zero_not_nan() {
        let x = var((3, 8), 1, 2.0);
        let mut m = vec![0f32; 24];
        m[8..16].fill(f32::NEG_INFINITY); // row 1 fully masked
        m[3] = f32::NEG_INFINITY; // row 0 partially masked
        let mask = Tensor::from_vec(m, (3, 8), &Device::Cpu).unwrap();
        let xm = (x.as_tensor() + &mask).unwrap();
        for (name, y) in [
            ("fused", softmax_last_dim(&xm).unwrap()),
            ("composite fallback", softmax_composite(&xm).unwrap()),
        ] {
            let yv = y.to_vec2::<f32>().unwrap();
            assert!(
                yv[1].iter().all(|&v| v == 0.0),
                "{name}: masked row must be zeros"
            );
            assert_eq!(yv[0][3], 0.0);
            let g = loss_of(&y, 3).backward().unwrap();
            let dx = grad(&g, &x).to_vec2::<f32>().unwrap();
            assert!(
                dx.iter().flatten().all(|v| v.is_finite()),
                "{name}: NaN in grads"
            );
            assert!(
                dx[1].iter().all(|&v| v == 0.0),
                "{name}: masked row grad must be 0"
            );
            // Unmasked rows agree with candle's composite softmax.
            let rows = Tensor::cat(
                &[xm.narrow(0, 0, 1).unwrap(), xm.narrow(0, 2, 1).unwrap()],
                0,
            )
            .unwrap();
            let y_ref = plain_softmax(&rows);
            let y_ours =
                Tensor::cat(&[y.narrow(0, 0, 1).unwrap(), y.narrow(0, 2, 1).unwrap()], 0).unwrap();
            assert_close(&y_ours, &y_ref, FWD_TOL, name);
        }
        // An all-NaN row is not mistaken for a fully masked one: it stays NaN.
        let nan_row = Tensor::from_vec(vec![f32::NAN; 4], (1, 4), &Device::Cpu).unwrap();
        let y = softmax_last_dim(&nan_row)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        assert!(y[0].iter().all(|v| v.is_nan()));
        // For contrast: candle's composite produces NaN on that row.
        let y_plain = plain_softmax(&xm).to_vec2::<f32>().unwrap();
        assert!(y_plain[1].iter().all(|v| v.is_nan()));
    }

    // Forward/backward to both inputs vs silu(gate)·up, including large |gate| and a
    // transposed gate.
    #[test]
    fn silu_mul_matches_composite() {
        let gate = var((6, 50), 1, 12.0);
        let up = var((6, 50), 2, 2.0);
        let y = silu_mul(gate.as_tensor(), up.as_tensor()).unwrap();
        let y_ref = (gate.as_tensor().silu().unwrap() * up.as_tensor()).unwrap();
        assert_close(&y, &y_ref, FWD_TOL, "silu_mul fwd");
        let g = loss_of(&y, 3).backward().unwrap();
        let g_ref = loss_of(&y_ref, 3).backward().unwrap();
        assert_close(
            &grad(&g, &gate),
            &grad(&g_ref, &gate),
            BWD_TOL,
            "silu_mul dgate",
        );
        assert_close(&grad(&g, &up), &grad(&g_ref, &up), BWD_TOL, "silu_mul dup");

        let gt = var((50, 6), 4, 4.0);
        let gate = gt.as_tensor().t().unwrap();
        let y = silu_mul(&gate, up.as_tensor()).unwrap();
        let y_ref = (gate.silu().unwrap() * up.as_tensor()).unwrap();
        assert_close(&y, &y_ref, FWD_TOL, "silu_mul fwd (transposed)");
        let g = loss_of(&y, 5).backward().unwrap();
        let g_ref = loss_of(&y_ref, 5).backward().unwrap();
        assert_close(
            &grad(&g, &gt),
            &grad(&g_ref, &gt),
            BWD_TOL,
            "silu_mul dgate (transposed)",
        );
        assert_close(
            &grad(&g, &up),
            &grad(&g_ref, &up),
            BWD_TOL,
            "silu_mul dup (transposed)",
        );
    }

    fn rope_tables(t: usize, hd: usize) -> (Tensor, Tensor) {
        let ang: Vec<f32> = (0..t)
            .flat_map(|p| (0..hd).map(move |i| p as f32 / 10000f32.powf(i as f32 / hd as f32)))
            .collect();
        let a = Tensor::from_vec(ang, (t, hd), &Device::Cpu).unwrap();
        (a.cos().unwrap(), a.sin().unwrap())
    }

    // Forward bit-identical to candle_nn's rope, and vs the composite; dx vs composite;
    // longer cos/sin tables and a transposed ([b,t,h,d] → [b,h,t,d]) input.
    #[test]
    fn rope_matches_candle_and_composite() {
        let (b, h, t, d) = (2, 3, 7, 16);
        let (cos, sin) = rope_tables(t + 5, d / 2);
        let x = var((b, h, t, d), 1, 1.0);
        let y = rope(x.as_tensor(), &cos, &sin).unwrap();
        let c = cos.narrow(0, 0, t).unwrap();
        let s = sin.narrow(0, 0, t).unwrap();
        let y_nn = candle_nn::rotary_emb::rope(x.as_tensor(), &c, &s).unwrap();
        assert_eq!(
            rel_diff(&y, &y_nn),
            0.0,
            "rope must match candle_nn exactly"
        );
        let y_ref = rope_composite(x.as_tensor(), &c, &s).unwrap();
        assert_close(&y, &y_ref, FWD_TOL, "rope fwd vs composite");
        let y_slow = candle_nn::rotary_emb::rope_slow(x.as_tensor(), &c, &s).unwrap();
        assert_close(&y, &y_slow, FWD_TOL, "rope fwd vs rope_slow");
        let g = loss_of(&y, 2).backward().unwrap();
        let g_ref = loss_of(&y_ref, 2).backward().unwrap();
        assert_close(&grad(&g, &x), &grad(&g_ref, &x), BWD_TOL, "rope dx");

        let xt = var((b, t, h, d), 3, 1.0);
        let x = xt.as_tensor().transpose(1, 2).unwrap();
        assert!(!x.is_contiguous());
        let y = rope(&x, &cos, &sin).unwrap();
        let y_ref = rope_composite(&x, &c, &s).unwrap();
        assert_close(&y, &y_ref, FWD_TOL, "rope fwd (transposed)");
        let g = loss_of(&y, 4).backward().unwrap();
        let g_ref = loss_of(&y_ref, 4).backward().unwrap();
        assert_close(
            &grad(&g, &xt),
            &grad(&g_ref, &xt),
            BWD_TOL,
            "rope dx (transposed)",
        );
    }

    // Interleaved: forward bit-identical to candle_nn's rope_i; forward and dx vs the
    // de-interleave → rotate-half → re-interleave composite (also on a transposed input).
    #[test]
    fn rope_interleaved_matches_candle_and_composite() {
        let (b, h, t, d) = (2, 3, 7, 16);
        let (cos, sin) = rope_tables(t + 5, d / 2);
        let c = cos.narrow(0, 0, t).unwrap();
        let s = sin.narrow(0, 0, t).unwrap();
        let x = var((b, h, t, d), 5, 1.0);
        let y = rope_interleaved(x.as_tensor(), &cos, &sin).unwrap();
        let y_nn = candle_nn::rotary_emb::rope_i(x.as_tensor(), &c, &s).unwrap();
        assert_eq!(rel_diff(&y, &y_nn), 0.0, "rope_interleaved must match candle_nn exactly");
        let y_ref = rope_interleaved_composite(x.as_tensor(), &c, &s).unwrap();
        assert_close(&y, &y_ref, FWD_TOL, "rope_interleaved fwd vs composite");
        let g = loss_of(&y, 6).backward().unwrap();
        let g_ref = loss_of(&y_ref, 6).backward().unwrap();
        assert_close(&grad(&g, &x), &grad(&g_ref, &x), BWD_TOL, "rope_interleaved dx");

        let xt = var((b, t, h, d), 7, 1.0);
        let x = xt.as_tensor().transpose(1, 2).unwrap();
        let y = rope_interleaved(&x, &cos, &sin).unwrap();
        let y_ref = rope_interleaved_composite(&x, &c, &s).unwrap();
        assert_close(&y, &y_ref, FWD_TOL, "rope_interleaved fwd (transposed)");
        let g = loss_of(&y, 8).backward().unwrap();
        let g_ref = loss_of(&y_ref, 8).backward().unwrap();
        assert_close(&grad(&g, &xt), &grad(&g_ref, &xt), BWD_TOL, "rope_interleaved dx (transposed)");
    }

    // Weighted loss and dlogits vs composite log_softmax + gather, with masked and
    // fractional weights; all-ones weights vs candle_nn::loss::cross_entropy; all-zero
    // weights give 0; out-of-range targets error.
    #[test]
    fn cross_entropy_matches_composite() {
        let (n, vocab) = (9, 1000);
        let logits = var((n, vocab), 1, 8.0);
        let tv: Vec<u32> = (0..n as u32)
            .map(|i| (i * 7919 + 13) % vocab as u32)
            .collect();
        let targets = Tensor::from_vec(tv, n, &Device::Cpu).unwrap();
        let w =
            Tensor::from_vec(vec![1f32, 0., 1., 1., 0.5, 0., 1., 2., 1.], n, &Device::Cpu).unwrap();
        let l = cross_entropy_masked(logits.as_tensor(), &targets, &w).unwrap();
        assert_eq!(l.rank(), 0);
        let l_ref = cross_entropy_composite(logits.as_tensor(), &targets, &w).unwrap();
        assert_close(&l, &l_ref, FWD_TOL, "ce loss");
        let g = (&l * 1.7).unwrap().backward().unwrap();
        let g_ref = (&l_ref * 1.7).unwrap().backward().unwrap();
        assert_close(
            &grad(&g, &logits),
            &grad(&g_ref, &logits),
            BWD_TOL,
            "ce dlogits",
        );
        assert!(g.get(&w).is_none());
        let masked_rows = grad(&g, &logits).to_vec2::<f32>().unwrap();
        assert!(masked_rows[1].iter().all(|&v| v == 0.0));

        let ones = Tensor::ones(n, DType::F32, &Device::Cpu).unwrap();
        let l = cross_entropy_masked(logits.as_tensor(), &targets, &ones).unwrap();
        let l_nn = candle_nn::loss::cross_entropy(logits.as_tensor(), &targets).unwrap();
        assert_close(&l, &l_nn, FWD_TOL, "ce vs candle_nn");

        let zeros = Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap();
        let l = cross_entropy_masked(logits.as_tensor(), &targets, &zeros).unwrap();
        assert_eq!(l.to_scalar::<f32>().unwrap(), 0.0);

        let bad = Tensor::from_vec(vec![vocab as u32; n], n, &Device::Cpu).unwrap();
        assert!(cross_entropy_masked(logits.as_tensor(), &bad, &ones).is_err());
    }

    fn attn_ref(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, bias: Option<&Tensor>) -> Tensor {
        causal_attention_composite(q, k, v, scale, bias).unwrap()
    }

    // Fused attention vs the composite for tq == tk and tq < tk (KV prefix), with no bias
    // and with biases of several broadcast shapes; gradients of q, k, v and bias.
    #[test]
    fn causal_attention_matches_composite() {
        let (b, h, d) = (2, 3, 16);
        let scale = 1.0 / (d as f64).sqrt();
        // 300/200/330 exercise several ATTN_BLOCK row and key blocks.
        for (tq, tk) in [(6, 6), (4, 9), (1, 5), (300, 300), (200, 330)] {
            let bias_shapes: Vec<Option<Vec<usize>>> = vec![
                None,
                Some(vec![tq, tk]),
                Some(vec![1, h, 1, tk]),
                Some(vec![b, h, tq, tk]),
                Some(vec![b, 1, tq, 1]),
            ];
            for (bi, bshape) in bias_shapes.into_iter().enumerate() {
                let seed = (tq * 100 + bi * 10) as u32;
                let q = var((b, h, tq, d), seed + 1, 2.0);
                let k = var((b, h, tk, d), seed + 2, 2.0);
                let v = var((b, h, tk, d), seed + 3, 1.0);
                let bias = bshape.map(|s| var(s, seed + 4, 1.0));
                let bt = bias.as_ref().map(|b| b.as_tensor());
                let what = format!("attn tq={tq} tk={tk} bias#{bi}");
                let y = causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale, bt)
                    .unwrap();
                let y_ref = attn_ref(q.as_tensor(), k.as_tensor(), v.as_tensor(), scale, bt);
                assert_close(&y, &y_ref, FWD_TOL, &format!("{what} fwd"));
                let g = loss_of(&y, 7).backward().unwrap();
                let g_ref = loss_of(&y_ref, 7).backward().unwrap();
                for (n, t) in [("q", &q), ("k", &k), ("v", &v)] {
                    assert_close(
                        &grad(&g, t),
                        &grad(&g_ref, t),
                        BWD_TOL,
                        &format!("{what} d{n}"),
                    );
                }
                if let Some(bias) = &bias {
                    let gb = grad(&g, bias);
                    assert_eq!(gb.dims(), bias.dims());
                    assert_close(&gb, &grad(&g_ref, bias), BWD_TOL, &format!("{what} dbias"));
                }
            }
        }
    }

    // q/k/v as transposed views of [b, t, h, d] tensors (the usual projection layout), and a
    // constant (non-Var) bias.
    #[test]
    fn causal_attention_non_contiguous_inputs() {
        let (b, h, t, d) = (2, 2, 5, 8);
        let qs = var((b, t, h, d), 1, 1.0);
        let ks = var((b, t, h, d), 2, 1.0);
        let vs = var((b, t, h, d), 3, 1.0);
        let q = qs.as_tensor().transpose(1, 2).unwrap();
        let k = ks.as_tensor().transpose(1, 2).unwrap();
        let v = vs.as_tensor().transpose(1, 2).unwrap();
        let bias = rand_t((t, t), 4, 0.5);
        let y = causal_attention(&q, &k, &v, 0.3, Some(&bias)).unwrap();
        let y_ref = attn_ref(&q, &k, &v, 0.3, Some(&bias));
        assert_close(&y, &y_ref, FWD_TOL, "attn fwd (transposed)");
        let g = loss_of(&y, 5).backward().unwrap();
        let g_ref = loss_of(&y_ref, 5).backward().unwrap();
        for (n, t) in [("q", &qs), ("k", &ks), ("v", &vs)] {
            assert_close(
                &grad(&g, t),
                &grad(&g_ref, t),
                BWD_TOL,
                &format!("attn d{n} (transposed)"),
            );
        }
        assert!(g.get(&bias).is_none());
    }

    // tq > tk: the leading queries see no key; fused gives zeros and finite gradients.
    #[test]
    fn causal_attention_queries_without_keys() {
        let q = var((1, 1, 4, 4), 1, 1.0);
        let k = var((1, 1, 2, 4), 2, 1.0);
        let v = var((1, 1, 2, 4), 3, 1.0);
        let y = causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.5, None).unwrap();
        let yv = y.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(yv[..8].iter().all(|&v| v == 0.0));
        let y_ref = attn_ref(q.as_tensor(), k.as_tensor(), v.as_tensor(), 0.5, None);
        assert_close(&y, &y_ref, FWD_TOL, "attn fwd (tq > tk)");
        let g = loss_of(&y, 4).backward().unwrap();
        let g_ref = loss_of(&y_ref, 4).backward().unwrap();
        for (n, t) in [("q", &q), ("k", &k), ("v", &v)] {
            assert_close(
                &grad(&g, t),
                &grad(&g_ref, t),
                BWD_TOL,
                &format!("attn d{n} (tq > tk)"),
            );
        }
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
