//! `rope` and `rope_interleaved`: rotary position embeddings (rotate-half and interleaved pairs).

use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;
use super::{fused_f32, f32_data};

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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use super::super::tests::{var, rel_diff, assert_close, loss_of, grad, FWD_TOL, BWD_TOL};

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
}
