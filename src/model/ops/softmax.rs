//! `softmax_last_dim`: a numerically stable softmax whose fully masked rows are zeros, not NaN.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;
use super::{fused_f32, f32_data, with_f32, cpu_tensor, softmax_row_inplace, softmax_bwd_row};

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
pub(super) fn softmax_composite(x: &Tensor) -> Result<Tensor> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use super::super::attention::causal_mask;
    use super::super::tests::{var, assert_close, loss_of, grad, FWD_TOL, BWD_TOL, plain_softmax};

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
}
