//! `frozen_linear` and its variants: `y = x · wᵀ` through a weight that never receives a
//! gradient (the backward computes dL/dx only), pretransposed, and in bf16.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};
use crate::kernels::bf16_matmul::{self, PackedBf16};
use std::sync::Arc;
use super::{fused_f32, f32_data};

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

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::tests::{var, assert_close, loss_of, grad, FWD_TOL, BWD_TOL};

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
}
