//! TEMPORARY composite versions of the fused ops (replaced by the fused implementation).
use candle_core::{DType, Result, Tensor, D};

pub fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let inn = *dims.last().unwrap();
    let rows = x.elem_count() / inn;
    let y = x.reshape((rows, inn))?.matmul(&w.t()?)?;
    let mut out = dims.clone();
    *out.last_mut().unwrap() = w.dim(0)?;
    y.reshape(out)
}
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    candle_nn::ops::rms_norm_slow(x, w, eps)
}
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    candle_nn::ops::softmax(x, D::Minus1)
}
pub fn silu_mul(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    candle_nn::ops::silu(g)? * u
}
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (_b, _h, t, d) = x.dims4()?;
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?.reshape((1, 1, t, d))?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?.reshape((1, 1, t, d))?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?
}
pub fn cross_entropy_masked(logits: &Tensor, targets: &Tensor, weights: &Tensor) -> Result<Tensor> {
    let lsm = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let picked = lsm.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?;
    let total = weights.sum_all()?.to_scalar::<f32>()?.max(1e-8);
    ((picked * weights)?.sum_all()?.neg()? / total as f64)
}
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, bias: Option<&Tensor>) -> Result<Tensor> {
    let (_b, _h, tq, _d) = q.dims4()?;
    let tk = k.dim(2)?;
    let s = (q.matmul(&k.t()?)? * scale)?;
    let off = tk - tq;
    let m: Vec<f32> = (0..tq).flat_map(|i| (0..tk).map(move |j| if j > off + i { f32::NEG_INFINITY } else { 0.0 })).collect();
    let m = Tensor::from_vec(m, (tq, tk), q.device())?.to_dtype(DType::F32)?;
    let s = s.broadcast_add(&m)?;
    let s = match bias { Some(b) => s.broadcast_add(b)?, None => s };
    softmax_last_dim(&s)?.matmul(&v.contiguous()?)
}

/// Interleaved RoPE (pairs 2i, 2i+1), as rotate-half RoPE on de-interleaved dims.
pub fn rope_interleaved(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let to_halves: Vec<u32> = (0..d as u32).step_by(2).chain((1..d as u32).step_by(2)).collect();
    let mut back = vec![0u32; d];
    for (i, &j) in to_halves.iter().enumerate() {
        back[j as usize] = i as u32;
    }
    let to_halves = Tensor::new(to_halves, x.device())?;
    let back = Tensor::new(back, x.device())?;
    let y = rope(&x.index_select(&to_halves, 3)?, cos, sin)?;
    y.index_select(&back, 3)
}
