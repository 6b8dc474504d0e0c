//! The fused op for candle's autograd: the forward and its backward as custom ops, on the CPU
//! through the fast path and on CUDA through `kernels/gated_memory.cu` (`kernels::cuda`).

use super::fast::{fast_backward, fast_forward};
use super::GmDims;
#[cfg(feature = "cuda")]
use crate::kernels::cuda::CudaInput;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

fn cpu_f32<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<f32>()?[a..b]),
        None => bail!("gated-memory: expected contiguous f32 input"),
    }
}

/// Forward op: (q, attn, packed params) → mixed output.
struct GatedMemoryMix {
    dims: GmDims,
}

/// Backward op: (q, packed params, output gradient) with `attn` held → `[dq | dattn | dp]` flat.
struct GatedMemoryMixBwd {
    dims: GmDims,
    attn: Tensor,
}

impl CustomOp3 for GatedMemoryMix {
    fn name(&self) -> &'static str {
        "gated-memory-mix"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        a_s: &CpuStorage,
        al: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, t, _) = ql.shape().dims4()?;
        let out = fast_forward(cpu_f32(qs, ql)?, cpu_f32(a_s, al)?, cpu_f32(ps, pl)?, self.dims, t);
        Ok((CpuStorage::F32(out), ql.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        a_s: &candle_core::CudaStorage,
        al: &Layout,
        ps: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (q, attn, params) = (CudaInput::of(qs, ql), CudaInput::of(a_s, al), CudaInput::of(ps, pl));
        let out = crate::kernels::cuda::gated_memory_fwd(q, attn, params, self.dims)?;
        Ok((out, ql.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        attn: &Tensor,
        p: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = q.elem_count();
        let op = GatedMemoryMixBwd { dims: self.dims, attn: attn.detach() };
        let all = q.detach().apply_op3_no_bwd(&p.detach(), &grad.contiguous()?, &op)?;
        let dq = all.narrow(0, 0, n)?.reshape(q.shape())?;
        let dattn = all.narrow(0, n, n)?.reshape(q.shape())?;
        let dp = all.narrow(0, 2 * n, p.elem_count())?;
        Ok((Some(dq), Some(dattn), Some(dp)))
    }
}

impl CustomOp3 for GatedMemoryMixBwd {
    fn name(&self) -> &'static str {
        "gated-memory-mix-bwd"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ps: &CpuStorage,
        pl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, _, t, _) = ql.shape().dims4()?;
        let (storage, al) = self.attn.storage_and_layout();
        let Storage::Cpu(a_s) = &*storage else { bail!("gated-memory-mix-bwd: attn not on the cpu") };
        let (dq, dattn, dp) =
            fast_backward(cpu_f32(qs, ql)?, cpu_f32(a_s, al)?, cpu_f32(ps, pl)?, cpu_f32(gs, gl)?, self.dims, t);
        let mut all = dq;
        all.extend(dattn);
        all.extend(dp);
        let len = all.len();
        Ok((CpuStorage::F32(all), Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ps: &candle_core::CudaStorage,
        pl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (storage, al) = self.attn.storage_and_layout();
        let Storage::Cuda(a_s) = &*storage else { bail!("gated-memory-mix-bwd: attn not on the gpu") };
        let (q, attn) = (CudaInput::of(qs, ql), CudaInput::of(a_s, al));
        let (params, grad) = (CudaInput::of(ps, pl), CudaInput::of(gs, gl));
        let (out, len) = crate::kernels::cuda::gated_memory_bwd(q, attn, params, grad, self.dims)?;
        Ok((out, Shape::from(len)))
    }
}

/// `attn + g·(m − attn)` for `q`, `attn` `[b, heads, t, d]` (f32) through the fused op, for a
/// layer of shape `dims` whose parameters are `packed` (flat, in the packed order; a
/// differentiable concatenation, so the gradients reach every parameter), with gradients to `q`,
/// `attn` and `packed`.
pub fn mix(q: &Tensor, attn: &Tensor, packed: &Tensor, dims: GmDims) -> Result<Tensor> {
    let (_, h, _, d) = q.dims4()?;
    if (h, d) != (dims.heads, dims.d) || attn.dims() != q.dims() {
        bail!("gated-memory-mix: q {:?} / attn {:?} do not fit the layer {dims:?}", q.shape(), attn.shape());
    }
    q.contiguous()?.apply_op3(&attn.contiguous()?, packed, GatedMemoryMix { dims })
}
