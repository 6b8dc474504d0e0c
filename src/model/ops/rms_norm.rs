//! `rms_norm`: RMSNorm over the last dim with a frozen weight.

use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;
use super::{fused_f32, f32_data, with_f32, cpu_tensor, dot_f32, SERIAL_ELEMWISE};

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

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::softmax_last_dim;
    use super::super::tests::{var, assert_close, loss_of, grad, FWD_TOL, BWD_TOL, plain_softmax};

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
}
