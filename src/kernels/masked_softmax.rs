//! Causal softmax of scaled attention scores plus an additive soft-mask bias, with backward
//! (`kernels/masked_softmax.cu` on CUDA): `P = softmax(scale·S + bias)` over the keys each query
//! may see (query i of tq sits at position tk − tq + i). The trainable attention on CUDA is
//! `S = q·kᵀ` (cuBLAS) → this op → `P·v` (cuBLAS): one saved activation (P) instead of the
//! composite's scaled, masked, biased and exponentiated copies.
//!
//! `reference_forward` / `reference_backward` are the plain CPU implementation the kernels are
//! tested against (`tests/cuda.rs`); they are the op's CPU path too (the CPU trainer uses the
//! faster block-causal op in `model::ops`).

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// Forward on `[rows, tk]` scores where row r is query `r % tq`; `bias` (same length, already
/// broadcast) or none. Rows with no visible key, or only −inf logits, give zeros.
pub fn reference_forward(s: &[f32], bias: Option<&[f32]>, tq: usize, tk: usize, scale: f32) -> Vec<f32> {
    let mut out = vec![0f32; s.len()];
    for (r, o) in out.chunks_mut(tk).enumerate() {
        let i = r % tq;
        let visible = (i + tk + 1).saturating_sub(tq).min(tk);
        let x: Vec<f32> = (0..visible).map(|j| scale * s[r * tk + j] + bias.map_or(0.0, |b| b[r * tk + j])).collect();
        let mx = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        if mx == f32::NEG_INFINITY {
            continue;
        }
        let sum: f32 = x.iter().map(|v| (v - mx).exp()).sum();
        for j in 0..visible {
            o[j] = (x[j] - mx).exp() / sum;
        }
    }
    out
}

/// Gradient of the logits `scale·S + bias` from `P` and `dP`: `P ⊙ (dP − Σ P·dP)` per row.
pub fn reference_backward(p: &[f32], dp: &[f32], tk: usize) -> Vec<f32> {
    let mut dx = vec![0f32; p.len()];
    for ((o, p), g) in dx.chunks_mut(tk).zip(p.chunks(tk)).zip(dp.chunks(tk)) {
        let dot: f32 = p.iter().zip(g).map(|(a, b)| a * b).sum();
        for j in 0..tk {
            o[j] = p[j] * (g[j] - dot);
        }
    }
    dx
}

fn cpu_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    // Strided (broadcast) inputs are gathered; the CPU path is a reference, not a fast path.
    let data = s.as_slice::<f32>()?;
    if let Some((a, b)) = l.contiguous_offsets() {
        return Ok(data[a..b].to_vec());
    }
    let (dims, strides) = (l.dims(), l.stride());
    let mut idx = vec![0usize; dims.len()];
    let mut out = Vec::with_capacity(l.shape().elem_count());
    for _ in 0..l.shape().elem_count() {
        out.push(data[l.start_offset() + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>()]);
        for d in (0..dims.len()).rev() {
            idx[d] += 1;
            if idx[d] < dims[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    Ok(out)
}

/// Forward op; with a second input (the bias, broadcast to the scores' shape) it is a
/// `CustomOp2`, without one a `CustomOp1`.
#[derive(Clone, Copy)]
struct MaskedSoftmax {
    scale: f32,
}

/// Backward op: (P, dP) → d(logits).
struct MaskedSoftmaxBwd;

impl MaskedSoftmax {
    fn cpu(&self, s: &CpuStorage, l: &Layout, bias: Option<(&CpuStorage, &Layout)>) -> Result<(CpuStorage, Shape)> {
        let (_, _, tq, tk) = l.shape().dims4()?;
        let b = bias.map(|(s, l)| cpu_f32(s, l)).transpose()?;
        let out = reference_forward(&cpu_f32(s, l)?, b.as_deref(), tq, tk, self.scale);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd_logits(&self, res: &Tensor, grad: &Tensor) -> Result<Tensor> {
        res.apply_op2_no_bwd(&grad.contiguous()?, &MaskedSoftmaxBwd)
    }
}

impl CustomOp1 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu(s, l, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::masked_softmax_fwd(s, l, None, self.scale)?, l.shape().clone()))
    }

    fn bwd(&self, _s: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some((self.bwd_logits(res, grad)? * self.scale as f64)?))
    }
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax-bias"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout, b: &CpuStorage, bl: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu(s, l, Some((b, bl)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::masked_softmax_fwd(s, l, Some((b, bl)), self.scale)?, l.shape().clone()))
    }

    fn bwd(&self, _s: &Tensor, _b: &Tensor, res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = self.bwd_logits(res, grad)?;
        Ok((Some((&dx * self.scale as f64)?), Some(dx)))
    }
}

impl CustomOp2 for MaskedSoftmaxBwd {
    fn name(&self) -> &'static str {
        "masked-softmax-bwd"
    }

    fn cpu_fwd(&self, p: &CpuStorage, pl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let tk = pl.dims().last().copied().unwrap_or(1);
        let out = reference_backward(&cpu_f32(p, pl)?, &cpu_f32(g, gl)?, tk);
        Ok((CpuStorage::F32(out), pl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        pl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::masked_softmax_bwd(p, pl, g, gl)?, pl.shape().clone()))
    }
}

/// `softmax(scale·scores + bias)` over the causally visible keys; `scores` `[b, h, tq, tk]`
/// (f32, or bf16 on CUDA), `bias` broadcastable to it (cast to the scores' dtype). Gradients flow
/// to `scores` and `bias` (reduced to the bias's shape by the broadcast's backward).
pub fn masked_softmax(scores: &Tensor, bias: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    let (b, h, tq, tk) = scores.dims4()?;
    let dt = scores.dtype();
    if dt != DType::F32 && !(dt == DType::BF16 && scores.device().is_cuda()) {
        bail!("masked_softmax: unsupported dtype {dt:?}");
    }
    let op = MaskedSoftmax { scale: scale as f32 };
    let s = scores.contiguous()?;
    match bias {
        None => s.apply_op1(op),
        Some(bias) => s.apply_op2(&bias.to_dtype(dt)?.broadcast_as((b, h, tq, tk))?, op),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_vec(crate::testing::Rng::new(seed).vec(n, 2.0), shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    // Reference vs the composite: scale, causal mask (tq < tk: a KV prefix), per-key bias with
    // one fully masked key, and gradients of scores and bias.
    #[test]
    fn reference_matches_composite() {
        let (b, h, tq, tk) = (2, 3, 4, 6);
        let s = Var::from_tensor(&rand(&[b, h, tq, tk], 1)).unwrap();
        let mut bv = crate::testing::Rng::new(2).vec(b * tk, 1.0);
        bv[3] = f32::NEG_INFINITY;
        let bias = Var::from_tensor(&Tensor::from_vec(bv, (b, 1, 1, tk), &Device::Cpu).unwrap()).unwrap();
        let w = rand(&[b, h, tq, tk], 3);
        let scale = 0.37;
        let p = masked_softmax(s.as_tensor(), Some(bias.as_tensor()), scale).unwrap();
        let mask: Vec<f32> = (0..tq)
            .flat_map(|i| (0..tk).map(move |j| if j <= i + tk - tq { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (tq, tk), &Device::Cpu).unwrap();
        let logits =
            (s.as_tensor() * scale).unwrap().broadcast_add(&mask).unwrap().broadcast_add(bias.as_tensor()).unwrap();
        let p_ref = candle_nn::ops::softmax(&logits, D::Minus1).unwrap();
        assert!(max_diff(&p, &p_ref) < 1e-6);
        let g = (p * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let g_ref = (p_ref * &w).unwrap().sum_all().unwrap().backward().unwrap();
        for t in [s.as_tensor(), bias.as_tensor()] {
            assert!(max_diff(g.get(t).unwrap(), g_ref.get(t).unwrap()) < 1e-5);
        }
    }

    // A query that sees no key (tq > tk) and a row of −inf logits give zeros, not NaN.
    #[test]
    fn empty_rows_are_zero() {
        // tq = 2 queries, tk = 1 key: query 0 sees nothing, query 1 sees the key.
        let out = reference_forward(&[1.0, 2.0, 3.0, 4.0], None, 2, 1, 1.0);
        assert_eq!(out, vec![0.0, 1.0, 0.0, 1.0]);
        let out = reference_forward(&[1.0, 2.0], Some(&[f32::NEG_INFINITY; 2]), 1, 2, 1.0);
        assert_eq!(out, vec![0.0, 0.0]);
    }
}
