//! `cross_entropy_masked`: the weighted mean token cross-entropy of the training loss.

use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};
use crate::kernels::math::exp_f32;
use rayon::prelude::*;
use super::{fused_f32, f32_data, with_f32, cpu_tensor, max_f32, sum_exp_shifted};

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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use super::super::tests::{var, assert_close, grad, FWD_TOL, BWD_TOL};

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
}
