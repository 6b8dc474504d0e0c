//! `silu_mul`: the SwiGLU activation `silu(gate) ⊙ up`, fused.

use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};
use crate::kernels::math::sigmoid_fast;
use rayon::prelude::*;
use super::{fused_f32, f32_data, with_f32, cpu_tensor, ELEMWISE_CHUNK, SERIAL_ELEMWISE};

struct SiluMul;

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

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::tests::{var, assert_close, loss_of, grad, FWD_TOL, BWD_TOL};

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
}
