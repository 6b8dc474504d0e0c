//! Gated Memory ("LIFT: Improving Long Context Understanding of Large Language Models through Long
//! Input Fine-Tuning", §3.4; layout from the authors' code): per layer and per query head, on the
//! head's pre-RoPE query `q` (d = head_dim),
//!   memory `m(q) = W2·SiLU(W1·q)`            (d → 2d → d)
//!   gate   `g(q) = sigmoid(3·(G2·SiLU(G1·q) − 1))`  (d → ⌊√d⌋ → 1, no bias on G2)
//! and the head's output becomes `(1 − g)·attn + g·m` before `o_proj`. Weights are grouped per head
//! (`[heads, in, out]`) so one batched matmul serves all heads. Biases exist only when the base
//! model's attention has biases.

use super::init::Rng;
use crate::kernels::gated_memory::{self as kernel, GmDims};
use crate::model::{Adapter, DecodeMix, ModelConfig};
use candle_core::{DType, Device, Result, Tensor, Var};
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// One layer's parameters; every tensor is `[heads, in, out]` (biases `[heads, 1, out]`).
#[derive(Clone)]
pub struct GatedMemoryLayer {
    pub mem_w1: Tensor,
    pub mem_b1: Option<Tensor>,
    pub mem_w2: Tensor,
    pub mem_b2: Option<Tensor>,
    pub gate_w1: Tensor,
    pub gate_b1: Option<Tensor>,
    pub gate_w2: Tensor,
    /// `packed()` made once, for layers whose tensors are plain (an answering adapter): the
    /// concatenation copies every parameter, per call and per sequence in a batch step.
    /// Trainable layers (`Var`s, updated in place) pack afresh each call.
    frozen_packed: OnceLock<Tensor>,
    /// A frozen CPU layer's weights as the batch decode mix reads them (int8, a quarter of the
    /// f32 bytes; `kernels::gated_memory::DecodeWeights`), made at its first decode step.
    frozen_decode: OnceLock<kernel::DecodeWeights>,
}

impl GatedMemoryLayer {
    /// Named tensors in a fixed order (for saving, optimizers and tests).
    pub fn named(&self) -> Vec<(&'static str, &Tensor)> {
        let mut v = vec![("mem_w1", &self.mem_w1)];
        if let Some(b) = &self.mem_b1 {
            v.push(("mem_b1", b));
        }
        v.push(("mem_w2", &self.mem_w2));
        if let Some(b) = &self.mem_b2 {
            v.push(("mem_b2", b));
        }
        v.push(("gate_w1", &self.gate_w1));
        if let Some(b) = &self.gate_b1 {
            v.push(("gate_b1", b));
        }
        v.push(("gate_w2", &self.gate_w2));
        v
    }

    fn try_map(&self, f: &impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            mem_w1: f(&self.mem_w1)?,
            mem_b1: self.mem_b1.as_ref().map(f).transpose()?,
            mem_w2: f(&self.mem_w2)?,
            mem_b2: self.mem_b2.as_ref().map(f).transpose()?,
            gate_w1: f(&self.gate_w1)?,
            gate_b1: self.gate_b1.as_ref().map(f).transpose()?,
            gate_w2: f(&self.gate_w2)?,
            frozen_packed: OnceLock::new(),
            frozen_decode: OnceLock::new(),
        })
    }

    /// The layer's shapes as the fused kernel takes them.
    pub fn kernel_dims(&self) -> Result<GmDims> {
        let (heads, d, s) = self.gate_w1.dims3()?;
        Ok(GmDims { heads, d, s, bias: self.mem_b1.is_some() })
    }

    /// The parameters flattened and concatenated in `named` order, the kernel's packed layout
    /// (differentiable: the gradients reach every parameter).
    pub fn packed(&self) -> Result<Tensor> {
        let parts: Vec<Tensor> = self.named().into_iter().map(|(_, t)| t.flatten_all()).collect::<Result<_>>()?;
        Tensor::cat(&parts, 0)
    }

    /// `attn + g·(m − attn)` for `q`, `attn` `[b, heads, t, d]` (f32) through the fused kernel op,
    /// with gradients to `q`, `attn` and every parameter.
    pub fn mix(&self, q: &Tensor, attn: &Tensor) -> Result<Tensor> {
        let dims = self.kernel_dims()?;
        match self.frozen_packed_params()? {
            Some(packed) => kernel::mix(q, attn, packed, dims),
            None => kernel::mix(q, attn, &self.packed()?, dims),
        }
    }

    /// `frozen_decode` of a frozen layer on the CPU (made at the first call); `None` otherwise.
    fn frozen_decode_weights(&self) -> Option<&kernel::DecodeWeights> {
        if let Some(w) = self.frozen_decode.get() {
            return Some(w);
        }
        let packed = self.frozen_packed_params().ok()??;
        if !packed.device().is_cpu() {
            return None;
        }
        let (values, dims) = (packed.to_dtype(DType::F32).ok()?.to_vec1::<f32>().ok()?, self.kernel_dims().ok()?);
        Some(self.frozen_decode.get_or_init(|| kernel::DecodeWeights::new(&values, dims)))
    }

    /// `packed()` of a frozen layer, made at the first call and kept; `None` for a trainable
    /// one (its `Var`s change in place, so it packs afresh each call).
    fn frozen_packed_params(&self) -> Result<Option<&Tensor>> {
        if self.named().iter().any(|(_, t)| t.is_variable()) {
            return Ok(None);
        }
        Ok(Some(match self.frozen_packed.get() {
            Some(p) => p,
            None => {
                let p = self.packed()?;
                self.frozen_packed.get_or_init(|| p)
            }
        }))
    }

    /// `q`: `[b, heads, t, d]` → (memory `[b, heads, t, d]`, gate `[b, heads, t, 1]`).
    pub fn memory_and_gate(&self, q: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, h, t, d) = q.dims4()?;
        // [heads, b*t, d]: one batched matmul per projection for all heads.
        let x = q.transpose(0, 1)?.contiguous()?.reshape((h, b * t, d))?;
        let affine = |x: &Tensor, w: &Tensor, bias: &Option<Tensor>| -> Result<Tensor> {
            let y = x.matmul(w)?;
            match bias {
                Some(bias) => y.broadcast_add(bias),
                None => Ok(y),
            }
        };
        let m = affine(&candle_nn::ops::silu(&affine(&x, &self.mem_w1, &self.mem_b1)?)?, &self.mem_w2, &self.mem_b2)?;
        let g = candle_nn::ops::silu(&affine(&x, &self.gate_w1, &self.gate_b1)?)?.matmul(&self.gate_w2)?;
        let g = candle_nn::ops::sigmoid(&((g - 1.0)? * 3.0)?)?;
        let back = |y: Tensor, n: usize| -> Result<Tensor> { y.reshape((h, b, t, n))?.transpose(0, 1) };
        Ok((back(m, d)?, back(g, 1)?))
    }
}

/// The adapter: a set of adapted layers. Training holds `Var`s; `detached()` gives the plain
/// tensors used for inference (an autograd graph must never reach the KV cache).
#[derive(Clone)]
pub struct GatedMemory {
    pub layers: BTreeMap<usize, GatedMemoryLayer>,
    vars: Vec<Var>,
}

impl GatedMemory {
    /// Fresh trainable adapter on `layers` (kaiming-uniform: bound 1/√fan_in, as torch's Linear).
    pub fn new(cfg: &ModelConfig, layers: &[usize], bias: bool, seed: u64, device: &Device) -> Result<Self> {
        let (h, d) = (cfg.num_heads, cfg.head_dim);
        let s = (d as f64).sqrt().floor() as usize;
        let mut rng = Rng::new(seed);
        let mut vars = Vec::new();
        let mut param = |shape: (usize, usize, usize), fan_in: usize| -> Result<Tensor> {
            let bound = 1.0 / (fan_in as f32).sqrt();
            let data = rng.vec(shape.0 * shape.1 * shape.2, bound);
            let v = Var::from_tensor(&Tensor::from_vec(data, shape, device)?)?;
            let t = v.as_tensor().clone();
            vars.push(v);
            Ok(t)
        };
        let mut out = BTreeMap::new();
        for &l in layers {
            let layer = GatedMemoryLayer {
                mem_w1: param((h, d, 2 * d), d)?,
                mem_b1: if bias { Some(param((h, 1, 2 * d), d)?) } else { None },
                mem_w2: param((h, 2 * d, d), 2 * d)?,
                mem_b2: if bias { Some(param((h, 1, d), 2 * d)?) } else { None },
                gate_w1: param((h, d, s), d)?,
                gate_b1: if bias { Some(param((h, 1, s), d)?) } else { None },
                gate_w2: param((h, s, 1), s)?,
                frozen_packed: OnceLock::new(),
                frozen_decode: OnceLock::new(),
            };
            out.insert(l, layer);
        }
        Ok(Self { layers: out, vars })
    }

    /// Wraps loaded tensors; `trainable` makes them `Var`s again (to resume training).
    pub fn from_layers(layers: BTreeMap<usize, GatedMemoryLayer>, trainable: bool) -> Result<Self> {
        if !trainable {
            return Ok(Self { layers, vars: Vec::new() });
        }
        let vars = std::cell::RefCell::new(Vec::new());
        let mut out = BTreeMap::new();
        for (l, layer) in layers {
            let mapped = layer.try_map(&|t: &Tensor| {
                let v = Var::from_tensor(t)?;
                let tt = v.as_tensor().clone();
                vars.borrow_mut().push(v);
                Ok(tt)
            })?;
            out.insert(l, mapped);
        }
        Ok(Self { layers: out, vars: vars.into_inner() })
    }

    /// Sets the output layers of the memory and the gate (`mem_w2`, `mem_b2`, `gate_w2`) of a
    /// trainable adapter to zero, as LoRA starts its `B` at zero: the adapter then starts as
    /// `(1 − σ(−3))·attn` (m = 0, the gate exactly 0.047) whatever the size of the queries, and
    /// the first steps move the output layers first. For models whose queries are large where a
    /// kaiming-initialised memory outweighs the attention it is mixed with (see `lift::absorb::new_adapter`).
    pub fn zero_outputs(&self) -> Result<()> {
        let ids: Vec<_> = self
            .layers
            .values()
            .flat_map(|l| [Some(&l.mem_w2), l.mem_b2.as_ref(), Some(&l.gate_w2)])
            .flatten()
            .map(|t| t.id())
            .collect();
        for v in self.vars.iter().filter(|v| ids.contains(&v.as_tensor().id())) {
            v.set(&v.as_tensor().zeros_like()?)?;
        }
        Ok(())
    }

    /// Trainable parameters (empty for a detached copy).
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Plain-tensor copy for inference.
    pub fn detached(&self) -> Self {
        let layers = self
            .layers
            .iter()
            .map(|(l, x)| (*l, x.try_map(&|t| Ok(t.detach())).expect("detach cannot fail")))
            .collect();
        Self { layers, vars: Vec::new() }
    }

    pub fn num_parameters(&self) -> usize {
        self.layers.values().flat_map(|l| l.named().into_iter().map(|(_, t)| t.elem_count())).sum()
    }

    /// Names and shapes of one layer's tensors (in `GatedMemoryLayer::named` order) for a model.
    pub fn layer_shapes(cfg: &ModelConfig, bias: bool) -> Vec<(&'static str, Vec<usize>)> {
        let (h, d) = (cfg.num_heads, cfg.head_dim);
        let s = (d as f64).sqrt().floor() as usize;
        let mut v = vec![("mem_w1", vec![h, d, 2 * d])];
        if bias {
            v.push(("mem_b1", vec![h, 1, 2 * d]));
        }
        v.push(("mem_w2", vec![h, 2 * d, d]));
        if bias {
            v.push(("mem_b2", vec![h, 1, d]));
        }
        v.push(("gate_w1", vec![h, d, s]));
        if bias {
            v.push(("gate_b1", vec![h, 1, s]));
        }
        v.push(("gate_w2", vec![h, s, 1]));
        v
    }

    /// Parameters of an adapter on `num_layers` layers of a model (without allocating it).
    pub fn parameter_count(cfg: &ModelConfig, num_layers: usize, bias: bool) -> usize {
        let per_layer: usize = Self::layer_shapes(cfg, bias).iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        per_layer * num_layers
    }

    /// Builds one layer from its named tensors (names as in `GatedMemoryLayer::named`), checking
    /// names, shapes and dtype (f32) against the model. Biases: all three or none.
    pub fn layer_from_named(
        cfg: &ModelConfig,
        layer: usize,
        mut tensors: BTreeMap<String, Tensor>,
    ) -> Result<GatedMemoryLayer> {
        let bias = tensors.contains_key("mem_b1") || tensors.contains_key("mem_b2") || tensors.contains_key("gate_b1");
        let mut take = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let Some(t) = tensors.remove(name) else {
                candle_core::bail!("Gated Memory layers.{layer}.{name} is missing");
            };
            if t.dims() != shape {
                candle_core::bail!("Gated Memory layers.{layer}.{name}: shape {:?}, expected {shape:?}", t.dims());
            }
            if t.dtype() != candle_core::DType::F32 {
                candle_core::bail!("Gated Memory layers.{layer}.{name}: dtype {:?}, expected F32", t.dtype());
            }
            Ok(t)
        };
        let shapes: BTreeMap<&str, Vec<usize>> = Self::layer_shapes(cfg, bias).into_iter().collect();
        let mut opt = |name: &str| -> Result<Option<Tensor>> {
            if bias {
                take(name, &shapes[name]).map(Some)
            } else {
                Ok(None)
            }
        };
        let mem_b1 = opt("mem_b1")?;
        let mem_b2 = opt("mem_b2")?;
        let gate_b1 = opt("gate_b1")?;
        let l = GatedMemoryLayer {
            mem_w1: take("mem_w1", &shapes["mem_w1"])?,
            mem_b1,
            mem_w2: take("mem_w2", &shapes["mem_w2"])?,
            mem_b2,
            gate_w1: take("gate_w1", &shapes["gate_w1"])?,
            gate_b1,
            gate_w2: take("gate_w2", &shapes["gate_w2"])?,
            frozen_packed: OnceLock::new(),
            frozen_decode: OnceLock::new(),
        };
        if let Some(name) = tensors.keys().next() {
            candle_core::bail!("Gated Memory layers.{layer}.{name}: unknown tensor");
        }
        Ok(l)
    }
}

impl Adapter for GatedMemory {
    fn mix_attention(&self, layer: usize, q_pre_rope: &Tensor, attn: Tensor) -> Result<Tensor> {
        let Some(l) = self.layers.get(&layer) else { return Ok(attn) };
        // The adapter computes in f32 whatever the base model's dtype (bf16 on CUDA).
        let dt = attn.dtype();
        let (q, attn) = (q_pre_rope.to_dtype(DType::F32)?, attn.to_dtype(DType::F32)?);
        // One fused op forward and backward: kernels/gated_memory.cu on CUDA, per-head gemm on
        // the CPU (measured: the composite below cost 9 ms per layer at 512 tokens).
        l.mix(&q, &attn)?.to_dtype(dt)
    }

    fn first_layer(&self) -> usize {
        self.layers.keys().next().copied().unwrap_or(usize::MAX)
    }

    fn decode_mix(&self, layer: usize) -> DecodeMix<'_> {
        let Some(l) = self.layers.get(&layer) else { return DecodeMix::Identity };
        if let Some(weights) = l.frozen_decode_weights() {
            return DecodeMix::GatedMemory(weights);
        }
        match (l.frozen_packed_params(), l.kernel_dims()) {
            (Ok(Some(packed)), Ok(dims)) if !packed.device().is_cpu() && packed.dtype() == DType::F32 => {
                DecodeMix::GatedMemoryPacked(packed, dims)
            }
            _ => DecodeMix::Opaque,
        }
    }
}

impl GatedMemory {
    /// `mix_attention` as a chain of candle ops (candle's autograd): the reference the fused op
    /// is tested against.
    pub fn mix_attention_composite(&self, layer: usize, q_pre_rope: &Tensor, attn: Tensor) -> Result<Tensor> {
        let Some(l) = self.layers.get(&layer) else { return Ok(attn) };
        let (m, g) = l.memory_and_gate(q_pre_rope)?;
        // (1 − g)·attn + g·m, written as attn + g·(m − attn).
        attn.clone() + g.broadcast_mul(&(m - attn)?)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn cfg(heads: usize, d: usize) -> ModelConfig {
        let mut c = crate::testing::smollm2_135m_config();
        c.num_heads = heads;
        c.head_dim = d;
        c
    }

    fn rand(shape: (usize, usize, usize, usize), seed: u64) -> Tensor {
        let n = shape.0 * shape.1 * shape.2 * shape.3;
        Tensor::from_vec(Rng::new(seed).vec(n, 1.0), shape, &Device::Cpu).unwrap()
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
            let fused = layer.mix(q.as_tensor(), a.as_tensor()).unwrap();
            let composite = gm.mix_attention_composite(0, q.as_tensor(), a.as_tensor().clone()).unwrap();
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

    // A zero-output start: the memory is 0 and the gate exactly σ(−3) for any query, however
    // large, so the mix is (1 − σ(−3))·attn; the output layers still get gradients.
    #[test]
    fn a_zero_output_start_scales_the_attention_for_any_query() {
        let c = cfg(3, 16);
        let gm = GatedMemory::new(&c, &[0], true, 7, &Device::Cpu).unwrap();
        gm.zero_outputs().unwrap();
        let layer = &gm.layers[&0];
        let q = (rand((1, 3, 4, 16), 1) * 50.0).unwrap();
        let a = rand((1, 3, 4, 16), 2);
        let out = layer.mix(&q, &a).unwrap();
        let g = 1.0 / (1.0 + 3f64.exp());
        assert!(max_diff(&out, &(&a * (1.0 - g)).unwrap()) < 1e-5);
        let grads = (out * rand((1, 3, 4, 16), 3)).unwrap().sum_all().unwrap().backward().unwrap();
        for t in [&layer.mem_w2, &layer.gate_w2] {
            let norm = grads.get(t).expect("a gradient").abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(norm > 0.0);
        }
    }

    #[test]
    fn offsets_follow_named_order() {
        let c = cfg(3, 16);
        for bias in [false, true] {
            let gm = GatedMemory::new(&c, &[0], bias, 1, &Device::Cpu).unwrap();
            let layer = &gm.layers[&0];
            let dims = layer.kernel_dims().unwrap();
            let (off, len) = dims.offsets();
            assert_eq!(len, layer.packed().unwrap().elem_count());
            assert_eq!(off[0], 0);
            assert_eq!(off[1] >= 0, bias);
        }
    }
}
