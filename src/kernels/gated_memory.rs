//! Gated Memory's per-head MLPs and the mix `attn + g·(m − attn)` as one op with a hand-written
//! backward (`kernels/gated_memory.cu` on CUDA). The op's inputs are `q` and `attn`
//! (`[b, heads, t, d]`, f32) and the layer's parameters packed into one flat f32 vector (`pack`:
//! a differentiable concatenation, so the gradients reach every parameter `Var`).
//!
//! `reference_forward` / `reference_backward` are the plain CPU implementation of exactly what
//! the kernels compute; they also serve as the op's CPU path (tested against candle's autograd of
//! the composite in `GatedMemoryLayer::memory_and_gate`), and the CUDA kernels are tested against
//! them (`tests/cuda.rs`).

use crate::adapters::GatedMemoryLayer;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

/// Shapes of one layer: heads, head_dim, gate hidden size and whether biases exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GmDims {
    pub heads: usize,
    pub d: usize,
    pub s: usize,
    pub bias: bool,
}

impl GmDims {
    pub fn of(layer: &GatedMemoryLayer) -> Result<Self> {
        let (heads, d, s) = layer.gate_w1.dims3()?;
        Ok(Self { heads, d, s, bias: layer.mem_b1.is_some() })
    }

    /// Element offsets of mem_w1, mem_b1, mem_w2, mem_b2, gate_w1, gate_b1, gate_w2 in the packed
    /// vector (−1: absent) and its length; the order of `GatedMemoryLayer::named`.
    pub fn offsets(&self) -> ([i64; 7], usize) {
        let (h, d, s) = (self.heads, self.d, self.s);
        let sizes = [h * d * 2 * d, h * 2 * d, h * 2 * d * d, h * d, h * d * s, h * s, h * s];
        let present = [true, self.bias, true, self.bias, true, self.bias, true];
        let mut off = [-1i64; 7];
        let mut at = 0usize;
        for i in 0..7 {
            if present[i] {
                off[i] = at as i64;
                at += sizes[i];
            }
        }
        (off, at)
    }
}

/// The layer's parameters flattened and concatenated in the kernel's order (differentiable).
pub fn pack(layer: &GatedMemoryLayer) -> Result<Tensor> {
    let parts: Vec<Tensor> = layer.named().into_iter().map(|(_, t)| t.flatten_all()).collect::<Result<_>>()?;
    Tensor::cat(&parts, 0)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}
fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}
fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

/// One head's weights as slices of the packed vector.
struct HeadWeights<'a> {
    w1: &'a [f32],
    b1: Option<&'a [f32]>,
    w2: &'a [f32],
    b2: Option<&'a [f32]>,
    g1: &'a [f32],
    c1: Option<&'a [f32]>,
    g2: &'a [f32],
}

fn head<'a>(p: &'a [f32], dims: GmDims, h: usize) -> HeadWeights<'a> {
    let (off, _) = dims.offsets();
    let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
    let at = |i: usize, per: usize| -> Option<&'a [f32]> {
        (off[i] >= 0).then(|| &p[off[i] as usize + h * per..off[i] as usize + (h + 1) * per])
    };
    HeadWeights {
        w1: at(0, d * d2).unwrap(),
        b1: at(1, d2),
        w2: at(2, d2 * d).unwrap(),
        b2: at(3, d),
        g1: at(4, d * s).unwrap(),
        c1: at(5, s),
        g2: at(6, s).unwrap(),
    }
}

/// Per-row forward intermediates: pre-activations of both hidden layers, m and g.
struct RowFwd {
    h1: Vec<f32>,
    gh: Vec<f32>,
    m: Vec<f32>,
    g: f32,
}

fn row_forward(x: &[f32], w: &HeadWeights, dims: GmDims) -> RowFwd {
    let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
    let mut h1: Vec<f32> = (0..d2).map(|j| w.b1.map_or(0.0, |b| b[j])).collect();
    let mut gh: Vec<f32> = (0..s).map(|c| w.c1.map_or(0.0, |b| b[c])).collect();
    for k in 0..d {
        for j in 0..d2 {
            h1[j] += x[k] * w.w1[k * d2 + j];
        }
        for c in 0..s {
            gh[c] += x[k] * w.g1[k * s + c];
        }
    }
    let mut m: Vec<f32> = (0..d).map(|j| w.b2.map_or(0.0, |b| b[j])).collect();
    for k in 0..d2 {
        let a = silu(h1[k]);
        for j in 0..d {
            m[j] += a * w.w2[k * d + j];
        }
    }
    let z: f32 = (0..s).map(|c| silu(gh[c]) * w.g2[c]).sum();
    RowFwd { h1, gh, m, g: sigmoid(3.0 * (z - 1.0)) }
}

/// `q`, `attn`: `[b, heads, t, d]` row-major (row r belongs to head `(r / t) % heads`); `p`:
/// packed parameters. Returns the mixed output.
pub fn reference_forward(q: &[f32], attn: &[f32], p: &[f32], dims: GmDims, t: usize) -> Vec<f32> {
    let d = dims.d;
    let mut out = vec![0f32; q.len()];
    for (r, (o, (x, a))) in out.chunks_mut(d).zip(q.chunks(d).zip(attn.chunks(d))).enumerate() {
        let w = head(p, dims, (r / t.max(1)) % dims.heads);
        let f = row_forward(x, &w, dims);
        for j in 0..d {
            o[j] = a[j] + f.g * (f.m[j] - a[j]);
        }
    }
    out
}

/// Backward of `reference_forward` for the output gradient `gout`: `(dq, dattn, dp)`.
pub fn reference_backward(
    q: &[f32],
    attn: &[f32],
    p: &[f32],
    gout: &[f32],
    dims: GmDims,
    t: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (d, d2, s) = (dims.d, 2 * dims.d, dims.s);
    let (off, plen) = dims.offsets();
    let mut dq = vec![0f32; q.len()];
    let mut dattn = vec![0f32; q.len()];
    let mut dp = vec![0f32; plen];
    for r in 0..q.len() / d {
        let h = (r / t.max(1)) % dims.heads;
        let w = head(p, dims, h);
        let (x, a, go) = (&q[r * d..(r + 1) * d], &attn[r * d..(r + 1) * d], &gout[r * d..(r + 1) * d]);
        let f = row_forward(x, &w, dims);
        let mut dgate = 0f32;
        for j in 0..d {
            dattn[r * d + j] = (1.0 - f.g) * go[j];
            dgate += go[j] * (f.m[j] - a[j]);
        }
        let dz = dgate * 3.0 * f.g * (1.0 - f.g);
        let dm: Vec<f32> = go.iter().map(|g| f.g * g).collect();
        let dgh: Vec<f32> = (0..s).map(|c| w.g2[c] * dz * silu_grad(f.gh[c])).collect();
        let dh1: Vec<f32> =
            (0..d2).map(|k| (0..d).map(|j| w.w2[k * d + j] * dm[j]).sum::<f32>() * silu_grad(f.h1[k])).collect();
        for k in 0..d {
            let mut acc = 0f32;
            for j in 0..d2 {
                acc += w.w1[k * d2 + j] * dh1[j];
            }
            for c in 0..s {
                acc += w.g1[k * s + c] * dgh[c];
            }
            dq[r * d + k] = acc;
        }
        let mut add = |i: usize, per: usize, idx: usize, v: f32| {
            dp[off[i] as usize + h * per + idx] += v;
        };
        for k in 0..d {
            for j in 0..d2 {
                add(0, d * d2, k * d2 + j, x[k] * dh1[j]);
            }
            for c in 0..s {
                add(4, d * s, k * s + c, x[k] * dgh[c]);
            }
        }
        for k in 0..d2 {
            let act = silu(f.h1[k]);
            for j in 0..d {
                add(2, d2 * d, k * d + j, act * dm[j]);
            }
        }
        for c in 0..s {
            add(6, s, c, silu(f.gh[c]) * dz);
        }
        if dims.bias {
            for j in 0..d2 {
                add(1, d2, j, dh1[j]);
            }
            for j in 0..d {
                add(3, d, j, dm[j]);
            }
            for c in 0..s {
                add(5, s, c, dgh[c]);
            }
        }
    }
    (dq, dattn, dp)
}

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
        let out = reference_forward(cpu_f32(qs, ql)?, cpu_f32(a_s, al)?, cpu_f32(ps, pl)?, self.dims, t);
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
        let out = super::cuda::gated_memory_fwd(qs, ql, a_s, al, ps, pl, self.dims)?;
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
            reference_backward(cpu_f32(qs, ql)?, cpu_f32(a_s, al)?, cpu_f32(ps, pl)?, cpu_f32(gs, gl)?, self.dims, t);
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
        let (out, len) = super::cuda::gated_memory_bwd(qs, ql, a_s, al, ps, pl, gs, gl, self.dims)?;
        Ok((out, Shape::from(len)))
    }
}

/// `attn + g·(m − attn)` for `q`, `attn` `[b, heads, t, d]` (f32) through the fused op, with
/// gradients to `q`, `attn` and every parameter of `layer`.
pub fn mix(layer: &GatedMemoryLayer, q: &Tensor, attn: &Tensor) -> Result<Tensor> {
    let dims = GmDims::of(layer)?;
    let (_, h, _, d) = q.dims4()?;
    if (h, d) != (dims.heads, dims.d) || attn.dims() != q.dims() {
        bail!("gated-memory-mix: q {:?} / attn {:?} do not fit the layer {dims:?}", q.shape(), attn.shape());
    }
    let p = pack(layer)?;
    q.contiguous()?.apply_op3(&attn.contiguous()?, &p, GatedMemoryMix { dims })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::GatedMemory;
    use crate::model::Adapter;
    use candle_core::{Device, Var};

    fn cfg(heads: usize, d: usize) -> crate::model::ModelConfig {
        let mut c = crate::testing::smollm2_135m_config();
        c.num_heads = heads;
        c.head_dim = d;
        c
    }

    fn rand(shape: (usize, usize, usize, usize), seed: u64) -> Tensor {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        Tensor::from_vec(crate::testing::Rng::new(seed).vec(n, 1.0), shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    // The fused op (CPU reference inside) matches the composite adapter path, forward and every
    // gradient, with and without biases.
    #[test]
    fn reference_matches_composite_forward_and_backward() {
        for bias in [false, true] {
            let c = cfg(3, 16);
            let gm = GatedMemory::new(&c, &[0], bias, 7, &Device::Cpu).unwrap();
            let layer = &gm.layers[&0];
            let q = Var::from_tensor(&rand((2, 3, 5, 16), 1)).unwrap();
            let a = Var::from_tensor(&rand((2, 3, 5, 16), 2)).unwrap();
            let w = rand((2, 3, 5, 16), 3);
            let fused = mix(layer, q.as_tensor(), a.as_tensor()).unwrap();
            let composite = gm.mix_attention(0, q.as_tensor(), a.as_tensor().clone()).unwrap();
            assert!(max_diff(&fused, &composite) < 1e-5, "forward");
            let gf = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gc = (composite * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let mut checked = 0;
            for t in [q.as_tensor(), a.as_tensor()].into_iter().chain(gm.vars().iter().map(|v| v.as_tensor())) {
                let (x, y) = (gf.get(t).expect("fused grad"), gc.get(t).expect("composite grad"));
                let scale =
                    y.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap().max(1.0);
                assert!(max_diff(x, y) / scale < 1e-4, "gradient {checked} (bias {bias})");
                checked += 1;
            }
            assert_eq!(checked, 2 + if bias { 7 } else { 4 });
        }
    }

    #[test]
    fn offsets_follow_named_order() {
        let c = cfg(3, 16);
        for bias in [false, true] {
            let gm = GatedMemory::new(&c, &[0], bias, 1, &Device::Cpu).unwrap();
            let layer = &gm.layers[&0];
            let dims = GmDims::of(layer).unwrap();
            let (off, len) = dims.offsets();
            assert_eq!(len, pack(layer).unwrap().elem_count());
            assert_eq!(off[0], 0);
            assert_eq!(off[1] >= 0, bias);
        }
    }
}
