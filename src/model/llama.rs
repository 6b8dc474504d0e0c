//! The Llama-family decoder (Llama 1–3, Qwen2, Mistral; SmolLM2 is Llama) with two forward paths
//! over one set of frozen weights:
//! - `forward`: inference with a KV cache, candle's fused kernels and quantized matmuls;
//! - `forward_train`: differentiable ops only (our fused ops with hand-written backward), float
//!   weights that never receive gradients, so `backward()` reaches adapter parameters only.
//! Both call the same adapter and forward hooks at the same places.

use super::config::ModelConfig;
use super::hooks::{Adapter, DecodeMix, ForwardHooks, Projection};
use super::ops;
use super::packing::Packing;
use super::weights::{base_dtype, Linear};
use crate::kernels::decode_attention::DecodeCache;
use crate::kernels::math::StoredFloat;
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use half::f16;
use std::sync::Arc;

pub struct DecoderLayer {
    pub attn_norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub ffn_norm: Tensor,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl DecoderLayer {
    fn linear(&self, p: Projection) -> &Linear {
        match p {
            Projection::Q => &self.q,
            Projection::K => &self.k,
            Projection::V => &self.v,
            Projection::O => &self.o,
            Projection::Gate => &self.gate,
            Projection::Up => &self.up,
            Projection::Down => &self.down,
        }
    }

    fn linear_mut(&mut self, p: Projection) -> &mut Linear {
        match p {
            Projection::Q => &mut self.q,
            Projection::K => &mut self.k,
            Projection::V => &mut self.v,
            Projection::O => &mut self.o,
            Projection::Gate => &mut self.gate,
            Projection::Up => &mut self.up,
            Projection::Down => &mut self.down,
        }
    }
}

pub struct Decoder {
    pub config: ModelConfig,
    /// `[vocab, hidden]` in `dtype`; rows are looked up for inputs (and serve as the head when tied).
    pub embed: Tensor,
    pub layers: Vec<DecoderLayer>,
    pub norm: Tensor,
    pub lm_head: Linear,
    /// RoPE tables `[max_positions, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
    device: Device,
    /// Dtype of the float weights and activations: f32 on the CPU, bf16 on CUDA (`base_dtype`).
    /// Adapters stay f32: their inputs are cast at the hook, their outputs cast back; logits are
    /// returned as f32.
    dtype: DType,
    /// RoPE rotates adjacent pairs (2i, 2i+1) instead of halves (i, i + d/2). llama.cpp stores
    /// llama-architecture q/k rows permuted for this; keeping the file's layout keeps our
    /// arithmetic identical to llama.cpp/candle (quantized matmuls re-round activations to 8 bits,
    /// so even a reordered dot product shows up in the logits).
    pub rope_interleaved: bool,
    /// Prompts of at least this many rows go through float matmuls (compute-bound); shorter ones
    /// (decode) through the quantized weights (memory-bound). `usize::MAX`: always quantized.
    /// With our int8 kernel `usize::MAX` prefills 512 tokens 1.75× faster (719 vs 411 tok/s) at
    /// +0.10% next-token loss (3.7080 vs 3.7042 nats on 2,468 tokens of the test fixtures), but
    /// it flips the greedy first token of `greedy_chat_answer_knows_the_capital_of_france` (a
    /// near tie) into a wrong answer, so prompts keep the float weights by default.
    pub float_prefill_min_rows: usize,
    /// A batch step whose decoding rows (see `forward_batch`) number at least this many runs them
    /// through the float weights in one gemm. Below it they share the quantized matmul and get
    /// exactly the arithmetic they get alone. `usize::MAX` (never) where the weights run on our
    /// int8 kernel (`kernels::quant_matmul`), which reuses each weight across a batch's rows;
    /// 6 where candle's quantized kernels run instead (a row costs them the same alone or
    /// batched, so from a few rows the float gemm is faster).
    pub float_batch_min_rows: usize,
    /// What the CPU's KV cache stores keys and values as: F16 (default; half the bytes a decode
    /// step reads) or F32 (what the f32 reference computes with). See `KvCache`. Other devices
    /// keep the model's dtype.
    pub cpu_kv_dtype: DType,
    /// What the frozen float matmuls compute in on the CPU — the trainable path's, and prefill
    /// chunks' (at least `float_prefill_min_rows` tokens; decode rows run the int8 kernel):
    /// BF16 (default where the CPU has AVX-512 BF16: bf16 inputs, f32 sums, ~2× the f32 gemm;
    /// `kernels::bf16_matmul`) or F32 (what the f32 reference computes with;
    /// `LIFT_CPU_FLOAT_DTYPE=f32` sets it at load). Activations, adapters, the adapter's
    /// gradients and the optimizer stay f32.
    pub cpu_float_dtype: DType,
    /// candle's ops for RMSNorm, SwiGLU and prompt attention instead of the fused CPU ones
    /// (`ops::rms_norm`, `ops::silu_mul`, `ops::causal_attention`): with candle's quantized
    /// kernels, the arithmetic of candle-transformers' quantized models, bit for bit enough that
    /// 8-bit activation rounding does not amplify the difference (see
    /// [`Decoder::use_candle_quantized_kernels`]). The fused ops round differently (~1e-6) and
    /// are the default.
    pub reference_ops: bool,
    /// A frozen adapter under every other (a prepared base's LoRA): its deltas are added on the
    /// inference, frozen and trainable paths alike, so a document adapter trains and answers
    /// over it. Its tensors are plain (no `Var`): no gradient reaches it.
    pub base_adapter: Option<Arc<dyn Adapter>>,
    /// The base adapter's update is already in the float weights ([`Decoder::merge_base_adapter`]):
    /// only the quantized inference path (decode on a quantized file) still adds its deltas.
    pub base_merged: bool,
}

/// Which positions' logits `forward` returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

/// One sequence's part of a [`Decoder::forward_batch`] step.
pub struct SeqInput<'s> {
    /// The tokens to append: a prompt chunk, or the one token sampled last.
    pub ids: &'s [u32],
    pub cache: &'s mut KvCache,
    pub adapter: Option<&'s dyn Adapter>,
    /// Equal for sequences that share one adapter (0: none): their deltas run as one matmul.
    pub adapter_key: usize,
    pub hooks: &'s mut dyn ForwardHooks,
}

/// The most rows one adapter-delta matmul takes in a batch. Up to this many rows a float
/// matmul's rows come out exactly as they do in a matmul of two rows (the shape a sequence's
/// delta gets alone, see `Lora::linear_delta`); far beyond it the CPU gemm changes strategy.
pub const SHARED_DELTA_ROWS: usize = 32;

/// How a batch's rows are laid out: `order[j]` is the sequence whose rows are `spans[j]`;
/// `float[i]` says whether sequence `i` goes through the float weights.
struct BatchPlan<'a> {
    order: &'a [usize],
    spans: &'a [std::ops::Range<usize>],
    float: &'a [bool],
}

/// Per-sequence key/value cache for the inference path; grows by doubling.
///
/// On the CPU keys and values sit in plain buffers of the decoder's `kv_dtype`: f16 by default
/// (llama.cpp's default cache type) — a decode step of many sequences reads every cached key
/// and value once, and at 16 sequences of ~60 tokens those f32 reads (46 MB a step, more than
/// the L3) were a sixth of the step — or f32. Elsewhere they are tensors in the model's dtype.
/// Every reader sees the same stored values, the token just appended included, so a
/// sequence's arithmetic does not depend on which path reads its cache.
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    len: usize,
    capacity: usize,
}

/// One layer's keys and values.
#[derive(Clone)]
enum LayerKv {
    F16(HostKv<f16>),
    F32(HostKv<f32>),
    /// `[b, kv_heads, capacity, d]` tensors.
    Device { k: Tensor, v: Tensor },
}

/// CPU buffers `[rows, capacity, d]`, `rows` = batch × KV heads.
#[derive(Clone)]
struct HostKv<T> {
    k: Vec<T>,
    v: Vec<T>,
    batch: usize,
    heads: usize,
    d: usize,
}

impl<T: StoredFloat> HostKv<T> {
    fn new(batch: usize, heads: usize, d: usize, capacity: usize) -> Self {
        let zeros = vec![T::default(); batch * heads * capacity * d];
        Self { k: zeros.clone(), v: zeros, batch, heads, d }
    }

    /// The same first `len` positions in buffers of `capacity` positions (from `old_cap`).
    fn regrown(&self, len: usize, old_cap: usize, capacity: usize) -> Self {
        let mut new = Self::new(self.batch, self.heads, self.d, capacity);
        let d = self.d;
        for (dst, src) in [(&mut new.k, &self.k), (&mut new.v, &self.v)] {
            for r in 0..self.batch * self.heads {
                dst[r * capacity * d..][..len * d].copy_from_slice(&src[r * old_cap * d..][..len * d]);
            }
        }
        new
    }

    /// Writes positions `len..len + t` from `k`, `v` (`[rows, t, d]` f32, row-major).
    fn write(&mut self, len: usize, capacity: usize, t: usize, k: &[f32], v: &[f32]) {
        let d = self.d;
        for (buf, x) in [(&mut self.k, k), (&mut self.v, v)] {
            for (r, src) in x.chunks_exact(t * d).enumerate() {
                T::from_f32s(src, &mut buf[(r * capacity + len) * d..][..t * d]);
            }
        }
    }

    /// The first `len` positions as `[b, kv_heads, len, d]` f32 tensors.
    fn views(&self, len: usize, capacity: usize, device: &Device) -> Result<(Tensor, Tensor)> {
        let (b, h, d) = (self.batch, self.heads, self.d);
        let view = |buf: &[T]| -> Result<Tensor> {
            let mut out = vec![0f32; b * h * len * d];
            for (r, dst) in out.chunks_exact_mut(len * d).enumerate() {
                T::to_f32s(&buf[r * capacity * d..][..len * d], dst);
            }
            Tensor::from_vec(out, (b, h, len, d), device)
        };
        Ok((view(&self.k)?, view(&self.v)?))
    }
}

impl LayerKv {
    fn from_host<T: HostElem>(h: HostKv<T>) -> Self {
        T::wrap(h)
    }

    /// Zeroed buffers of `capacity` positions for keys shaped like `k` (`[b, kv_heads, t, d]`).
    fn empty(k: &Tensor, kv_dtype: DType, capacity: usize) -> Result<Self> {
        let (b, h, _, d) = k.dims4()?;
        Ok(match (k.device().is_cpu(), kv_dtype) {
            (true, DType::F16) => LayerKv::F16(HostKv::new(b, h, d, capacity)),
            (true, _) => LayerKv::F32(HostKv::new(b, h, d, capacity)),
            (false, _) => {
                let zeros = Tensor::zeros((b, h, capacity, d), k.dtype(), k.device())?;
                LayerKv::Device { k: zeros.clone(), v: zeros.copy()? }
            }
        })
    }

    fn bytes(&self) -> usize {
        match self {
            LayerKv::F16(h) => (h.k.len() + h.v.len()) * 2,
            LayerKv::F32(h) => (h.k.len() + h.v.len()) * 4,
            LayerKv::Device { k, v } => (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes(),
        }
    }

    fn regrown(&self, len: usize, old_cap: usize, capacity: usize) -> Result<Self> {
        Ok(match self {
            LayerKv::F16(h) => LayerKv::F16(h.regrown(len, old_cap, capacity)),
            LayerKv::F32(h) => LayerKv::F32(h.regrown(len, old_cap, capacity)),
            LayerKv::Device { k, v } => {
                let (b, h, _, d) = k.dims4()?;
                let nk = Tensor::zeros((b, h, capacity, d), k.dtype(), k.device())?;
                let nv = Tensor::zeros((b, h, capacity, d), v.dtype(), v.device())?;
                if len > 0 {
                    nk.slice_set(&k.narrow(2, 0, len)?, 2, 0)?;
                    nv.slice_set(&v.narrow(2, 0, len)?, 2, 0)?;
                }
                LayerKv::Device { k: nk, v: nv }
            }
        })
    }
}

/// The CPU cache element types, and how to find a layer's buffers of each.
trait HostElem: StoredFloat {
    fn wrap(h: HostKv<Self>) -> LayerKv;
    fn host(layer: &LayerKv) -> Option<&HostKv<Self>>;
    fn host_mut(layer: &mut LayerKv) -> Option<&mut HostKv<Self>>;
}

impl HostElem for f16 {
    fn wrap(h: HostKv<f16>) -> LayerKv {
        LayerKv::F16(h)
    }

    fn host(layer: &LayerKv) -> Option<&HostKv<f16>> {
        if let LayerKv::F16(h) = layer { Some(h) } else { None }
    }

    fn host_mut(layer: &mut LayerKv) -> Option<&mut HostKv<f16>> {
        if let LayerKv::F16(h) = layer { Some(h) } else { None }
    }
}

impl HostElem for f32 {
    fn wrap(h: HostKv<f32>) -> LayerKv {
        LayerKv::F32(h)
    }

    fn host(layer: &LayerKv) -> Option<&HostKv<f32>> {
        if let LayerKv::F32(h) = layer { Some(h) } else { None }
    }

    fn host_mut(layer: &mut LayerKv) -> Option<&mut HostKv<f32>> {
        if let LayerKv::F32(h) = layer { Some(h) } else { None }
    }
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self::with_capacity(num_layers, 0)
    }

    /// A cache whose buffers are made for `tokens` tokens at the first append (it still grows
    /// past them): a generation that knows its length never copies its cache to grow it, and
    /// holds what the engine's memory budget counted for it.
    pub fn with_capacity(num_layers: usize, tokens: usize) -> Self {
        Self { layers: (0..num_layers).map(|_| None).collect(), len: 0, capacity: tokens }
    }

    /// Tokens already in the cache (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the cache buffers.
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(LayerKv::bytes).sum()
    }

    /// A deep copy (so a shared prompt prefix can be extended by several requests).
    pub fn fork(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                Some(LayerKv::Device { k, v }) => Ok(Some(LayerKv::Device { k: k.copy()?, v: v.copy()? })),
                other => Ok(other.clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers, len: self.len, capacity: self.capacity })
    }

    /// Forgets everything after the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Room for `t` more tokens in every layer (grown at layer 0, before any layer appends).
    fn reserve(&mut self, layer: usize, t: usize) -> Result<()> {
        let needed = self.len + t;
        if layer == 0 && needed > self.capacity {
            let new_cap = needed.max(self.capacity * 2).max(64);
            for entry in self.layers.iter_mut().flatten() {
                *entry = entry.regrown(self.len, self.capacity, new_cap)?;
            }
            self.capacity = new_cap;
        }
        Ok(())
    }

    /// Appends `k`, `v` (`[b, kv_heads, t, d]`) for `layer` and returns views of the whole cache
    /// (`[b, kv_heads, len + t, d]`, in `k`'s dtype). A new layer's buffers are made in
    /// `kv_dtype` on the CPU. `self.len` is advanced by `commit` once every layer has appended.
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor, kv_dtype: DType) -> Result<(Tensor, Tensor)> {
        let (b, h, t, d) = k.dims4()?;
        self.reserve(layer, t)?;
        let (len, cap) = (self.len, self.capacity);
        let entry = match &mut self.layers[layer] {
            Some(entry) => entry,
            empty => empty.insert(LayerKv::empty(k, kv_dtype, cap)?),
        };
        let rows = |x: &Tensor| x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
        let (kv, vv) = match entry {
            LayerKv::Device { k: ck, v: cv } => {
                ck.slice_set(&k.contiguous()?, 2, len)?;
                cv.slice_set(&v.contiguous()?, 2, len)?;
                return Ok((ck.narrow(2, 0, len + t)?, cv.narrow(2, 0, len + t)?));
            }
            LayerKv::F16(hk) if (hk.batch, hk.heads, hk.d) == (b, h, d) => {
                hk.write(len, cap, t, &rows(k)?, &rows(v)?);
                hk.views(len + t, cap, k.device())?
            }
            LayerKv::F32(hk) if (hk.batch, hk.heads, hk.d) == (b, h, d) => {
                hk.write(len, cap, t, &rows(k)?, &rows(v)?);
                hk.views(len + t, cap, k.device())?
            }
            _ => candle_core::bail!("appending keys of shape {:?} to layer {layer}'s cache of another shape", k.dims()),
        };
        Ok((kv.to_dtype(k.dtype())?, vv.to_dtype(v.dtype())?))
    }

    /// Appends one position of a one-sequence CPU cache (the decode kernel's path): `k`, `v`
    /// `[kv_heads, d]` in f32, stored as `append` stores them.
    fn append_row<T: HostElem>(&mut self, layer: usize, k: &[f32], v: &[f32], heads: usize, d: usize) -> Result<()> {
        self.reserve(layer, 1)?;
        let (len, cap) = (self.len, self.capacity);
        let entry = match &mut self.layers[layer] {
            Some(entry) => entry,
            empty => empty.insert(LayerKv::from_host(HostKv::<T>::new(1, heads, d, cap))),
        };
        match T::host_mut(entry) {
            Some(hk) if (hk.batch, hk.heads, hk.d) == (1, heads, d) => {
                hk.write(len, cap, 1, k, v);
                Ok(())
            }
            _ => candle_core::bail!("layer {layer}'s cache is not one sequence's CPU buffers of {heads} heads of {d}"),
        }
    }

    /// Layer `layer`'s CPU key and value buffers (`[kv_heads, capacity, d]`, the first `len`
    /// positions filled, plus what was appended in the current step) and their capacity.
    fn host_buffers<T: HostElem>(&self, layer: usize) -> Result<(&[T], &[T], usize)> {
        match self.layers[layer].as_ref().and_then(T::host) {
            Some(hk) => Ok((&hk.k, &hk.v, self.capacity)),
            None => candle_core::bail!("layer {layer} has no CPU cache of the decoder's KV type"),
        }
    }

    /// Room for one more position in `layer`'s device buffers (made on first use as `append`
    /// makes them, `like` giving shape and dtype): the buffers and their capacity, for the CUDA
    /// decode kernel, which writes the position itself.
    #[cfg(feature = "cuda")]
    fn device_slot(&mut self, layer: usize, like: &Tensor) -> Result<(Tensor, Tensor, usize)> {
        self.reserve(layer, 1)?;
        let cap = self.capacity;
        let entry = match &mut self.layers[layer] {
            Some(entry) => entry,
            empty => empty.insert(LayerKv::empty(like, like.dtype(), cap)?),
        };
        match entry {
            LayerKv::Device { k, v } => Ok((k.clone(), v.clone(), cap)),
            _ => candle_core::bail!("layer {layer}'s cache is not on the device"),
        }
    }

    fn commit(&mut self, t: usize) {
        self.len += t;
    }
}

impl Decoder {
    pub fn new(
        config: ModelConfig,
        embed: Tensor,
        layers: Vec<DecoderLayer>,
        norm: Tensor,
        lm_head: Linear,
        device: &Device,
    ) -> Result<Self> {
        let dtype = base_dtype(device);
        let packed = !layers.is_empty() && layers.iter().all(|l| l.q.is_packed());
        let (cos, sin) = rope_tables(&config, device)?;
        let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        let mut layers = layers;
        for l in layers.iter_mut() {
            l.attn_norm = l.attn_norm.to_dtype(dtype)?;
            l.ffn_norm = l.ffn_norm.to_dtype(dtype)?;
        }
        Ok(Self {
            config,
            embed: embed.to_dtype(dtype)?,
            layers,
            norm: norm.to_dtype(dtype)?,
            lm_head,
            cos,
            sin,
            device: device.clone(),
            dtype,
            rope_interleaved: false,
            // `LIFT_FLOAT_MIN_ROWS=1` (a diagnostic) runs decode rows through the float weights
            // too, as on CUDA, to tell the int8 kernel's arithmetic from a device's.
            float_prefill_min_rows: std::env::var("LIFT_FLOAT_MIN_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(16),
            float_batch_min_rows: if packed { usize::MAX } else { 6 },
            base_adapter: None,
            base_merged: false,
            reference_ops: false,
            cpu_kv_dtype: DType::F16,
            cpu_float_dtype: default_cpu_float_dtype(),
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Dtype of the float weights and activations (f32 on the CPU, bf16 on CUDA).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Dtype the inference KV cache keeps keys and values in (`cpu_kv_dtype` on the CPU).
    pub fn kv_dtype(&self) -> DType {
        if self.device.is_cpu() {
            self.cpu_kv_dtype
        } else {
            self.dtype
        }
    }

    /// Whether the frozen float matmuls run in bf16 (`cpu_float_dtype`, CPU only).
    pub fn float_in_bf16(&self) -> bool {
        self.device.is_cpu() && self.cpu_float_dtype == DType::BF16
    }

    /// Input embeddings `[b, t, hidden]` for token ids `[b, t]` (in `dtype()`; callers may
    /// perturb them; the forward passes accept any float dtype).
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let flat = ids.flatten_all()?;
        self.embed.index_select(&flat, 0)?.reshape((b, t, self.config.hidden_size))
    }

    fn rope_slice(&self, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let max = self.cos.dim(0)?;
        if start + len > max {
            candle_core::bail!(
                "sequence of {} tokens exceeds the model's {} positions",
                start + len,
                max
            );
        }
        Ok((self.cos.narrow(0, start, len)?, self.sin.narrow(0, start, len)?))
    }

    /// Inference forward over ids `[b, t]` appended after what `cache` holds.
    /// Returns logits `[b, vocab]` (`Logits::Last`) or `[b, t, vocab]` (`Logits::All`).
    pub fn forward(
        &self,
        ids: &Tensor,
        cache: &mut KvCache,
        adapter: Option<&dyn Adapter>,
        hooks: &mut dyn ForwardHooks,
        which: Logits,
    ) -> Result<Tensor> {
        let x = self.embed(ids)?;
        self.forward_embeds(&x, cache, adapter, hooks, which)
    }

    /// Runs inference through candle's quantized matmuls instead of our int8 kernel
    /// (`kernels::quant_matmul`), and through candle's ops where fused ones would round
    /// differently (`reference_ops`): the arithmetic of candle-transformers' quantized models,
    /// which tests compare the decoder with.
    pub fn use_candle_quantized_kernels(&mut self) {
        self.reference_ops = true;
        for layer in self.layers.iter_mut() {
            for p in Projection::ALL {
                layer.linear_mut(p).drop_packed();
            }
        }
        self.lm_head.drop_packed();
        self.float_batch_min_rows = 6;
    }

    /// Last-position logits of a fresh prompt with a given float-matmul threshold (for comparing
    /// the quantized and float arithmetic in tests and benchmarks).
    pub fn forward_with_float_threshold(&self, ids: &Tensor, min_rows: usize) -> Result<Tensor> {
        let x = self.embed(ids)?;
        let mut cache = KvCache::new(self.layers.len());
        self.forward_inner(&x, &mut cache, None, &mut super::hooks::NoHooks, Logits::Last, min_rows)
    }

    /// Inference forward from embeddings `[b, t, hidden]`.
    pub fn forward_embeds(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        adapter: Option<&dyn Adapter>,
        hooks: &mut dyn ForwardHooks,
        which: Logits,
    ) -> Result<Tensor> {
        self.forward_inner(x, cache, adapter, hooks, which, self.float_prefill_min_rows)
    }

    fn forward_inner(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        adapter: Option<&dyn Adapter>,
        hooks: &mut dyn ForwardHooks,
        which: Logits,
        float_min_rows: usize,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let float = b * t >= float_min_rows;
        let x = self.run_layers(x, cache, adapter, hooks, float_min_rows, self.layers.len())?;
        cache.commit(t);
        let x = match which {
            Logits::Last => x.i((.., t - 1..t, ..))?,
            Logits::All => x,
        };
        let x = self.prompt_norm(&x, &self.norm, self.config.rms_norm_eps as f32)?;
        let logits = if float && which == Logits::All {
            self.lm_head.forward_float(&x, self.float_in_bf16())?
        } else {
            self.lm_head.forward(&x)?
        };
        let logits = logits.to_dtype(DType::F32)?;
        match which {
            Logits::Last => logits.squeeze(1),
            Logits::All => Ok(logits),
        }
    }

    /// The residual stream after the first `layers` layers over `x` (appended after what
    /// `cache` holds; the caller commits the cache).
    fn run_layers(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        adapter: Option<&dyn Adapter>,
        hooks: &mut dyn ForwardHooks,
        float_min_rows: usize,
        layers: usize,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let start = cache.len();
        let (cos, sin) = self.rope_slice(start, t)?;
        let float = b * t >= float_min_rows;
        let mask = causal_mask(t, start, self.config.sliding_window, &self.device)?;
        let causal_only = !window_cuts(self.config.sliding_window, start + t);
        let mask = mask.map(|m| m.to_dtype(self.dtype)).transpose()?;
        let mut x = x.to_dtype(self.dtype)?;
        for (li, layer) in self.layers.iter().enumerate().take(layers) {
            let ctx = LayerCtx { li, adapter, base: self.unmerged_base(float), float, bf16: self.float_in_bf16(), start };
            let h = self.prompt_norm(&x, &layer.attn_norm, self.config.rms_norm_eps as f32)?;
            let positions = Positions { cos: &cos, sin: &sin, mask: mask.as_ref(), causal_only };
            let attn = self.attention_infer(&ctx, layer, &h, positions, Some(&mut *cache), hooks)?;
            x = (x + attn)?;
            let h = self.prompt_norm(&x, &layer.ffn_norm, self.config.rms_norm_eps as f32)?;
            let gate = ctx.linear(layer, Projection::Gate, &h)?;
            let up = ctx.linear(layer, Projection::Up, &h)?;
            let mlp = ctx.linear(layer, Projection::Down, &self.swiglu(&gate, &up)?)?;
            x = (x + mlp)?;
            hooks.after_layer(li, &x)?;
        }
        Ok(x)
    }

    /// Runs a fresh prompt `ids` `[b, t]` through layers `0..=last` only, for hooks that read a
    /// middle layer (the FltLM filter's scores when re-ranking passages): the layers above it
    /// are never computed.
    pub fn run_through_layer(&self, ids: &Tensor, last: usize, hooks: &mut dyn ForwardHooks) -> Result<()> {
        let x = self.embed(ids)?;
        let mut cache = KvCache::new(self.layers.len());
        self.run_layers(&x, &mut cache, None, hooks, self.float_prefill_min_rows, last + 1)?;
        Ok(())
    }

    fn attention_infer(
        &self,
        ctx: &LayerCtx,
        layer: &DecoderLayer,
        h: &Tensor,
        positions: Positions,
        cache: Option<&mut KvCache>,
        hooks: &mut dyn ForwardHooks,
    ) -> Result<Tensor> {
        let q = ctx.linear(layer, Projection::Q, h)?;
        let k = ctx.linear(layer, Projection::K, h)?;
        let v = ctx.linear(layer, Projection::V, h)?;
        let attn = self.attend(ctx.li, ctx.adapter, ctx.start, [&q, &k, &v], positions, cache, hooks)?;
        ctx.linear(layer, Projection::O, &attn)
    }

    /// One sequence's attention from its projections `q`, `k`, `v` (`[b, t, heads·d]`, before
    /// RoPE) at positions `start..start+t`: RoPE, the KV cache, the mask and the hooks' bias, then
    /// the adapter's mix. Returns `[b, t, heads·d]`, the input of `o_proj`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        li: usize,
        adapter: Option<&dyn Adapter>,
        start: usize,
        [q, k, v]: [&Tensor; 3],
        positions: Positions,
        cache: Option<&mut KvCache>,
        hooks: &mut dyn ForwardHooks,
    ) -> Result<Tensor> {
        let Positions { cos, sin, mask, causal_only } = positions;
        let cfg = &self.config;
        let (b, t, _) = q.dims3()?;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let q = q.reshape((b, t, nh, hd))?.transpose(1, 2)?.contiguous()?;
        let k = k.reshape((b, t, nkv, hd))?.transpose(1, 2)?.contiguous()?;
        let v = v.reshape((b, t, nkv, hd))?.transpose(1, 2)?;
        let rope = if self.rope_interleaved { candle_nn::rotary_emb::rope_i } else { candle_nn::rotary_emb::rope };
        let q_rot = rope(&q, cos, sin)?;
        let k_rot = rope(&k, cos, sin)?;
        let (k_all, v_all) = match cache {
            Some(cache) => cache.append(li, &k_rot, &v, self.cpu_kv_dtype)?,
            None => (k_rot, v),
        };
        let tk = k_all.dim(2)?;
        let bias = hooks.attention_bias(li, start, t, tk)?;
        let bias = bias.map(|b| b.to_dtype(q_rot.dtype())).transpose()?;
        let mix = |attn: Tensor| -> Result<Tensor> {
            let attn = match adapter {
                Some(a) => a.mix_attention(li, &q, attn)?,
                None => attn,
            };
            attn.transpose(1, 2)?.reshape((b, t, nh * hd))
        };
        #[cfg(feature = "flash-attn")]
        if t > 1 && bias.is_none() && q_rot.device().is_cuda() {
            return mix(flash_attention(&q_rot, &k_all, &v_all, cfg)?);
        }

        let g = cfg.kv_groups();
        let scale = 1.0 / (hd as f64).sqrt();
        // Prompt rows on the CPU: the fused block-causal attention of the training path
        // (`ops::causal_attention`: gemms over the keys each block of queries sees, then one pass
        // of scale + bias + softmax on a vectorised exp, then P·V over the same keys). candle's
        // ops (full score matrix, a mask add, a bias add, a softmax on libm's exp) spent ~25% of
        // a 512-token prefill outside the matmuls. It is causal by construction ("query i sees
        // positions up to start + i"); a mask that hides more (a sliding window, packed rows)
        // joins the bias.
        if t > 1 && !self.reference_ops && q_rot.device().is_cpu() && q_rot.dtype() == DType::F32 {
            let bias = match (mask.filter(|_| !causal_only), bias) {
                (Some(m), Some(b)) => Some(b.broadcast_add(m)?),
                (Some(m), None) => Some(m.clone()),
                (None, b) => b,
            };
            let k_rep = repeat_kv(&k_all, g)?.contiguous()?;
            let v_rep = repeat_kv(&v_all, g)?.contiguous()?;
            return mix(ops::causal_attention(&q_rot, &k_rep, &v_rep, scale, bias.as_ref())?);
        }
        // Decode (one query row): the `g` query heads sharing a KV head are stacked so the cache
        // is read as is, never copied. Prompts here (CUDA, `reference_ops`): KV heads repeated,
        // the same matmul shapes as llama.cpp/candle (see `rope_interleaved` for why the
        // arithmetic should match).
        let (scores, v_used) = if t == 1 && g > 1 {
            let qg = q_rot.reshape((b, nkv, g, hd))?;
            let s = (qg.matmul(&k_all.t()?)? * scale)?.reshape((b, nh, 1, tk))?;
            (s, None)
        } else {
            let k_rep = repeat_kv(&k_all, g)?.contiguous()?;
            ((q_rot.matmul(&k_rep.t()?)? * scale)?, Some(repeat_kv(&v_all, g)?.contiguous()?))
        };
        let scores = match mask {
            Some(m) => scores.broadcast_add(m)?,
            None => scores,
        };
        let scores = match bias {
            Some(bias) => scores.broadcast_add(&bias)?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let attn = match v_used {
            Some(v) => probs.matmul(&v)?,
            None => probs.reshape((b, nkv, g, tk))?.matmul(&v_all)?.reshape((b, nh, 1, hd))?,
        };
        mix(attn)
    }

    /// One inference step of many sequences at once (continuous batching): each appends its
    /// `ids` after what its own cache holds, with its own adapter and hooks. The frozen base
    /// runs batched — one matmul per projection for all decoding rows, which is what makes
    /// serving many users cheaper than serving them in turn: decode reads every weight once per
    /// step instead of once per user. Attention and the adapter's mix run per sequence (each has
    /// its own cache and memory). Returns each sequence's last-position logits `[n, vocab]` (f32),
    /// in the order given.
    ///
    /// A sequence gets exactly the arithmetic it gets alone: rows that would go through the
    /// quantized weights alone (fewer than `float_prefill_min_rows`) share one quantized matmul
    /// (row-independent), a prompt chunk gets its own float matmul, and an adapter's linear
    /// deltas run over at most [`SHARED_DELTA_ROWS`] rows of the sequences that share it.
    pub fn forward_batch(&self, seqs: &mut [SeqInput]) -> Result<Tensor> {
        if seqs.is_empty() || seqs.iter().any(|s| s.ids.is_empty()) {
            candle_core::bail!("a batch needs at least one sequence and one token per sequence");
        }
        let n = seqs.len();
        let float: Vec<bool> = seqs.iter().map(|s| s.ids.len() >= self.float_prefill_min_rows).collect();
        // Rows laid out with the quantized-path sequences first, grouped by adapter.
        let mut order: Vec<usize> = (0..n).collect();
        // Decoding rows first (one attention call for all, see `decode_attention`), then
        // short prompt chunks, both on the quantized path; prompt chunks on the float path last.
        order.sort_by_key(|&i| (float[i], seqs[i].ids.len() > 1, seqs[i].adapter_key));
        let decoding = if self.batched_decode_attention() {
            order.iter().take_while(|&&i| seqs[i].ids.len() == 1).count()
        } else {
            0
        };
        let mut spans = Vec::with_capacity(n);
        let mut rows = 0;
        for &i in &order {
            spans.push(rows..rows + seqs[i].ids.len());
            rows += seqs[i].ids.len();
        }
        let ids: Vec<u32> = order.iter().flat_map(|&i| seqs[i].ids.iter().copied()).collect();
        let mut x = self.embed(&Tensor::new(ids.as_slice(), &self.device)?.unsqueeze(0)?)?;
        // RoPE rows and masks of the sequences attended one by one (decoding rows take theirs in
        // `decode_attention`).
        let mut tables = Vec::with_capacity(n - decoding);
        for &i in &order[decoding..] {
            let (start, t) = (seqs[i].cache.len(), seqs[i].ids.len());
            let (cos, sin) = self.rope_slice(start, t)?;
            let mask = causal_mask(t, start, self.config.sliding_window, &self.device)?;
            tables.push((start, cos, sin, mask.map(|m| m.to_dtype(self.dtype)).transpose()?));
        }
        let plan = BatchPlan { order: &order, spans: &spans, float: &float };
        let step = self.decode_step(seqs, &order[..decoding])?;
        let eps = self.config.rms_norm_eps as f32;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = self.inference_norm(&x, &layer.attn_norm, eps)?;
            let mut qkv = self.batch_linears(li, layer, &[Projection::Q, Projection::K, Projection::V], &h, &plan, seqs)?;
            let (v, k, q) = (qkv.pop(), qkv.pop(), qkv.pop());
            let (Some(q), Some(k), Some(v)) = (q, k, v) else { candle_core::bail!("three projections asked, fewer made") };
            let mut parts = Vec::with_capacity(n);
            if decoding > 0 {
                parts.push(self.decode_attention(li, seqs, &order[..decoding], [&q, &k, &v], &step)?);
            }
            for (j, &i) in order.iter().enumerate().skip(decoding) {
                let r = &spans[j];
                let rows = |a: &Tensor| a.narrow(1, r.start, r.len());
                let (start, cos, sin, mask) = &tables[j - decoding];
                let causal_only = !window_cuts(self.config.sliding_window, start + r.len());
                let positions = Positions { cos, sin, mask: mask.as_ref(), causal_only };
                let s = &mut seqs[i];
                let qkv = [&rows(&q)?, &rows(&k)?, &rows(&v)?];
                parts.push(self.attend(li, s.adapter, *start, qkv, positions, Some(&mut *s.cache), &mut *s.hooks)?);
            }
            let attn = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 1)? };
            x = (x + self.batch_linear(li, layer, Projection::O, &attn, &plan, seqs)?)?;
            let h = self.inference_norm(&x, &layer.ffn_norm, eps)?;
            let mut gate_up = self.batch_linears(li, layer, &[Projection::Gate, Projection::Up], &h, &plan, seqs)?;
            let (Some(up), Some(gate)) = (gate_up.pop(), gate_up.pop()) else { candle_core::bail!("two projections asked, fewer made") };
            // The training path's fused SwiGLU (one pass, a vectorised exp), not candle's silu
            // then mul (a libm exp per element, two passes: 2.1 of 22.6 ms of a 16-row step).
            let act = super::ops::silu_mul(&gate, &up)?;
            x = (x + self.batch_linear(li, layer, Projection::Down, &act, &plan, seqs)?)?;
            for (j, &i) in order.iter().enumerate() {
                seqs[i].hooks.after_layer(li, &x.narrow(1, spans[j].start, spans[j].len())?)?;
            }
        }
        for s in seqs.iter_mut() {
            s.cache.commit(s.ids.len());
        }
        // Each sequence's last row, back in the caller's order.
        let mut last = vec![0u32; n];
        for (j, &i) in order.iter().enumerate() {
            last[i] = (spans[j].end - 1) as u32;
        }
        let x = x.squeeze(0)?.index_select(&Tensor::new(last.as_slice(), &self.device)?, 0)?;
        let x = self.inference_norm(&x, &self.norm, eps)?;
        let logits = if n >= self.float_batch_min_rows { self.lm_head.forward_float(&x, self.float_in_bf16())? } else { self.lm_head.forward(&x)? };
        logits.to_dtype(DType::F32)
    }

    /// RMSNorm of `forward`'s rows: `inference_norm`, or candle's with `reference_ops`.
    fn prompt_norm(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        if self.reference_ops {
            candle_nn::ops::rms_norm(x, weight, eps)
        } else {
            self.inference_norm(x, weight, eps)
        }
    }

    /// `silu(gate) ⊙ up`: fused (one pass, a vectorised exp), or candle's two ops with
    /// `reference_ops`.
    fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        if self.reference_ops {
            candle_nn::ops::silu(gate)? * up
        } else {
            ops::silu_mul(gate, up)
        }
    }

    /// RMSNorm of a batch step's rows: on the CPU the fused row loop of `ops::rms_norm`
    /// (vectorised sum of squares; on the calling thread for a decode step's few rows), where
    /// candle's sums each row serially (0.7 ms of a 22.6 ms 16-row step; 0.3 ms this way);
    /// elsewhere candle's kernel. Row by row either way, so a row's arithmetic does not depend
    /// on its batch.
    fn inference_norm(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        if self.device.is_cpu() {
            super::ops::rms_norm(x, weight, eps)
        } else {
            candle_nn::ops::rms_norm(x, weight, eps)
        }
    }

    /// Whether `forward_batch` attends its decoding rows all at once (`decode_attention`): on the
    /// CPU in f32, and on CUDA in bf16 where the kernel serves the model's head shape.
    fn batched_decode_attention(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() {
            let c = &self.config;
            return self.dtype == DType::BF16
                && c.sliding_window.is_none()
                && crate::kernels::cuda::decode_attention_fits(c.num_heads, c.num_kv_heads, c.head_dim);
        }
        self.device.is_cpu() && self.dtype == DType::F32
    }

    /// The RoPE rows (`[n, 1, d/2]` cos and sin) of the decoding rows, each at its own position.
    fn decode_rope_rows(&self, seqs: &[SeqInput], which: &[usize]) -> Result<(Tensor, Tensor)> {
        let n = which.len();
        let positions: Vec<u32> = which.iter().map(|&i| seqs[i].cache.len() as u32).collect();
        let positions = Tensor::new(positions.as_slice(), &self.device)?;
        let half = self.cos.dim(1)?;
        let cos = self.cos.index_select(&positions, 0)?.reshape((n, 1, half))?;
        let sin = self.sin.index_select(&positions, 0)?.reshape((n, 1, half))?;
        Ok((cos, sin))
    }

    /// The `n` decoding rows' heads (`[n, heads, 1, d]` each) and RoPE by `decode_rope_rows`.
    fn decode_rows(&self, n: usize, [q, k, v]: [&Tensor; 3], (cos, sin): (&Tensor, &Tensor)) -> Result<DecodeRows> {
        let cfg = &self.config;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let heads = |x: &Tensor, h: usize| -> Result<Tensor> {
            x.narrow(1, 0, n)?.reshape((n, 1, h, hd))?.transpose(1, 2)?.contiguous()
        };
        let (q, k, v) = (heads(q, nh)?, heads(k, nkv)?, heads(v, nkv)?);
        let rope = if self.rope_interleaved { candle_nn::rotary_emb::rope_i } else { candle_nn::rotary_emb::rope };
        let (q_rot, k_rot) = (rope(&q, cos, sin)?, rope(&k, cos, sin)?);
        Ok(DecodeRows { q, v, q_rot, k_rot })
    }

    /// Attention of the decoding sequences `which` (one row each, rows `0..which.len()` of the
    /// batch's projections `q`, `k`, `v` `[1, rows, _]`) on the CPU (on CUDA: `decode_attention_cuda`): RoPE for all at once, each
    /// key and value appended to its sequence's cache, then one `decode_attention` call over all
    /// caches, then each adapter's mix. Returns `[1, which.len(), heads·d]`.
    fn decode_attention(
        &self,
        li: usize,
        seqs: &mut [SeqInput],
        which: &[usize],
        [q, k, v]: [&Tensor; 3],
        step: &DecodeStep,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = &step.cuda {
            return self.decode_attention_cuda(li, seqs, which, [q, k, v], cuda);
        }
        let _ = step;
        let cfg = &self.config;
        let (nh, hd, n) = (cfg.num_heads, cfg.head_dim, which.len());
        let (cos, sin) = self.decode_rope_rows(seqs, which)?;
        let DecodeRows { q, v, q_rot, k_rot } = self.decode_rows(n, [q, k, v], (&cos, &sin))?;
        let (kr, vr) = (k_rot.flatten_all()?.to_vec1::<f32>()?, v.flatten_all()?.to_vec1::<f32>()?);
        let qv = q_rot.flatten_all()?.to_vec1::<f32>()?;
        let mut out = match self.cpu_kv_dtype {
            DType::F16 => decode_step::<f16>(li, cfg, seqs, which, &qv, &kr, &vr)?,
            _ => decode_step::<f32>(li, cfg, seqs, which, &qv, &kr, &vr)?,
        };
        // Each adapter's mix: frozen Gated Memory layers all in one parallel pass, anything
        // else through its own `mix_attention`.
        let mixes: Vec<DecodeMix> =
            which.iter().map(|&i| seqs[i].adapter.map_or(DecodeMix::Identity, |a| a.decode_mix(li))).collect();
        if mixes.iter().any(|m| !matches!(m, DecodeMix::Identity)) {
            let q_pre = q.flatten_all()?.to_vec1::<f32>()?;
            let rows: Vec<_> = mixes
                .iter()
                .enumerate()
                .filter_map(|(j, mix)| match mix {
                    DecodeMix::GatedMemory(weights) => Some((j, *weights)),
                    _ => None,
                })
                .collect();
            crate::kernels::gated_memory::mix_decode_rows(&q_pre, &mut out, &rows);
            let row = nh * hd;
            for (j, (&i, mix)) in which.iter().zip(&mixes).enumerate() {
                if let (DecodeMix::Opaque | DecodeMix::GatedMemoryPacked(..), Some(ad)) = (mix, seqs[i].adapter) {
                    let a = Tensor::from_slice(&out[j * row..(j + 1) * row], (1, nh, 1, hd), &self.device)?;
                    let mixed = ad.mix_attention(li, &q.narrow(0, j, 1)?, a)?;
                    out[j * row..(j + 1) * row].copy_from_slice(&mixed.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
                }
            }
        }
        Tensor::from_vec(out, (1, n, nh * hd), &self.device)
    }

    /// What the decode rows of a batch step share across layers (on CUDA; nothing elsewhere).
    fn decode_step(&self, seqs: &mut [SeqInput], which: &[usize]) -> Result<DecodeStep> {
        #[cfg(feature = "cuda")]
        if self.device.is_cuda() && !which.is_empty() {
            return Ok(DecodeStep { cuda: Some(self.cuda_decode_step(seqs, which)?) });
        }
        let _ = (seqs, which);
        Ok(DecodeStep::default())
    }

    /// The CUDA decode step's tables, made once for all layers (one host-to-device copy each
    /// instead of several per layer): RoPE rows, every layer's cache buffers (grown first, so
    /// that the kernel appends in place), keys and capacities, and the Gated Memory layers.
    #[cfg(feature = "cuda")]
    fn cuda_decode_step(&self, seqs: &mut [SeqInput], which: &[usize]) -> Result<CudaDecodeStep> {
        use crate::kernels::cuda::addresses;
        let cfg = &self.config;
        let (nkv, hd, n, layers) = (cfg.num_kv_heads, cfg.head_dim, which.len(), cfg.num_layers);
        let rope = self.decode_rope_rows(seqs, which)?;
        let like = Tensor::zeros((1, nkv, 1, hd), self.dtype, &self.device)?;
        let (mut kv, mut counts, mut buffers) = (vec![0i64; layers * 2 * n], vec![0u32; 2 * n], Vec::new());
        for (j, &i) in which.iter().enumerate() {
            let cache = &mut *seqs[i].cache;
            counts[j] = (cache.len() + 1) as u32;
            for li in 0..layers {
                let (ck, cv, capacity) = cache.device_slot(li, &like)?;
                if ck.dims4()? != (1, nkv, capacity, hd) || ck.dtype() != DType::BF16 || cv.dims() != ck.dims() {
                    candle_core::bail!("layer {li}'s cache {:?} {:?} is not bf16 [1, {nkv}, capacity, {hd}]", ck.dtype(), ck.dims());
                }
                let a = addresses(&[Some(&ck), Some(&cv)])?;
                (kv[(2 * li) * n + j], kv[(2 * li + 1) * n + j]) = (a[0], a[1]);
                counts[n + j] = capacity as u32;
                buffers.extend([ck, cv]);
            }
        }
        let mut gm_params = vec![0i64; layers * n];
        let mut gm = Vec::with_capacity(layers);
        for li in 0..layers {
            let mixes: Vec<DecodeMix> =
                which.iter().map(|&i| seqs[i].adapter.map_or(DecodeMix::Identity, |a| a.decode_mix(li))).collect();
            let dims = mixes.iter().find_map(|m| if let DecodeMix::GatedMemoryPacked(_, d) = m { Some(*d) } else { None });
            let params: Vec<Option<&Tensor>> = mixes
                .iter()
                .map(|m| match m {
                    DecodeMix::GatedMemoryPacked(p, d) if Some(*d) == dims => Some(*p),
                    _ => None,
                })
                .collect();
            // Rows whose mix only `mix_attention` can do.
            let own = mixes.iter().zip(&params).map(|(m, p)| p.is_none() && !matches!(m, DecodeMix::Identity)).collect();
            gm_params[li * n..(li + 1) * n].copy_from_slice(&addresses(&params)?);
            gm.push(LayerMix { dims, own });
        }
        Ok(CudaDecodeStep {
            rope,
            caches: Tensor::new(kv.as_slice(), &self.device)?.reshape((layers, 2, n))?,
            counts: Tensor::new(counts.as_slice(), &self.device)?.reshape((2, n))?,
            gm_params: Tensor::new(gm_params.as_slice(), &self.device)?.reshape((layers, n))?,
            gm,
            _buffers: buffers,
        })
    }

    /// `decode_attention` on CUDA: one kernel launch appends every row's key and value to its
    /// cache and attends (kernels/decode_attention.cu), one mixes every frozen Gated Memory;
    /// other mixes once per run of rows sharing an adapter.
    #[cfg(feature = "cuda")]
    fn decode_attention_cuda(
        &self,
        li: usize,
        seqs: &mut [SeqInput],
        which: &[usize],
        [q, k, v]: [&Tensor; 3],
        step: &CudaDecodeStep,
    ) -> Result<Tensor> {
        use crate::kernels::cuda::{addresses, decode_attention, gated_memory_fwd_rows};
        let cfg = &self.config;
        let (nh, nkv, hd, n) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, which.len());
        let DecodeRows { q, v, q_rot, k_rot } = self.decode_rows(n, [q, k, v], (&step.rope.0, &step.rope.1))?;
        let mut biases = Vec::with_capacity(n);
        for &i in which {
            let start = seqs[i].cache.len();
            biases.push(match seqs[i].hooks.attention_bias(li, start, 1, start + 1)? {
                Some(b) if b.elem_count() == start + 1 => Some(b.to_device(&self.device)?.to_dtype(DType::F32)?.flatten_all()?.contiguous()?),
                Some(b) => candle_core::bail!("a decode attention bias of shape {:?} for {} keys", b.dims(), start + 1),
                None => None,
            });
        }
        let bias_table = if biases.iter().any(Option::is_some) {
            let refs: Vec<Option<&Tensor>> = biases.iter().map(Option::as_ref).collect();
            Some(Tensor::new(addresses(&refs)?.as_slice(), &self.device)?)
        } else {
            None
        };
        let (q3, k3, v3) = (q_rot.reshape((n, nh, hd))?, k_rot.reshape((n, nkv, hd))?, v.reshape((n, nkv, hd))?);
        let mut attn = decode_attention(&q3, &k3, &v3, &step.caches.get(li)?, &step.counts, bias_table.as_ref())?.reshape((n, nh, 1, hd))?;
        let mix = &step.gm[li];
        if let Some(dims) = mix.dims {
            let (qf, af) = (q.to_dtype(DType::F32)?, attn.to_dtype(DType::F32)?);
            attn = gated_memory_fwd_rows(&qf, &af, &step.gm_params.get(li)?, dims)?.to_dtype(self.dtype)?;
        }
        // Any other mix through `mix_attention`, once per run of rows sharing an adapter (rows are
        // grouped by adapter: `forward_batch`'s order).
        let mut pieces = Vec::new();
        let mut j = 0;
        while j < n {
            let first = &seqs[which[j]];
            let (key, adapter, own) = (first.adapter_key, first.adapter, mix.own[j]);
            let mut e = j + 1;
            while e < n && seqs[which[e]].adapter_key == key && seqs[which[e]].adapter.is_some() == adapter.is_some() && mix.own[e] == own {
                e += 1;
            }
            let rows = attn.narrow(0, j, e - j)?;
            pieces.push(match adapter {
                Some(a) if own => a.mix_attention(li, &q.narrow(0, j, e - j)?, rows)?,
                _ => rows,
            });
            j = e;
        }
        let attn = if pieces.len() == 1 { pieces.remove(0) } else { Tensor::cat(&pieces, 0)? };
        attn.reshape((1, n, nh * hd))
    }

    /// Projection `p` of every row of a batch (`x` `[1, rows, in]`, laid out by `plan`): one
    /// quantized matmul for all quantized-path rows, one float matmul per prompt chunk; then the
    /// base adapter's and each sequence's adapter deltas, as `LayerCtx::linear` adds them alone.
    fn batch_linear(
        &self,
        li: usize,
        layer: &DecoderLayer,
        p: Projection,
        x: &Tensor,
        plan: &BatchPlan,
        seqs: &[SeqInput],
    ) -> Result<Tensor> {
        Ok(self.batch_linears(li, layer, &[p], x, plan, seqs)?.remove(0))
    }

    /// `batch_linear` of several projections of one input (q, k, v; gate, up): their
    /// quantized-path products in one pass of the int8 kernel (`weights::forward_group`).
    fn batch_linears(
        &self,
        li: usize,
        layer: &DecoderLayer,
        ps: &[Projection],
        x: &Tensor,
        plan: &BatchPlan,
        seqs: &[SeqInput],
    ) -> Result<Vec<Tensor>> {
        let quantized = plan.float.iter().filter(|f| !**f).count();
        let mut pieces: Vec<Vec<Tensor>> = ps.iter().map(|_| Vec::new()).collect();
        if quantized > 0 {
            let rows = plan.spans[quantized - 1].end;
            let xq = x.narrow(1, 0, rows)?;
            let float = rows >= self.float_batch_min_rows;
            let lins: Vec<&Linear> = ps.iter().map(|&p| layer.linear(p)).collect();
            let ys = if float {
                lins.iter().map(|l| l.forward_float(&xq, self.float_in_bf16())).collect::<Result<Vec<_>>>()?
            } else {
                super::weights::forward_group(&lins, &xq)?
            };
            // Runs of sequences sharing one adapter (the layout groups them), ≤ SHARED_DELTA_ROWS.
            let mut runs = Vec::new();
            let mut adapters = Vec::new();
            let mut j = 0;
            while j < quantized {
                let s = &seqs[plan.order[j]];
                let mut end = j + 1;
                while end < quantized
                    && seqs[plan.order[end]].adapter_key == s.adapter_key
                    && plan.spans[end].end - plan.spans[j].start <= SHARED_DELTA_ROWS
                {
                    end += 1;
                }
                runs.push(plan.spans[j].start..plan.spans[end - 1].end);
                adapters.push(s.adapter);
                j = end;
            }
            for ((&p, mut y), out) in ps.iter().zip(ys).zip(pieces.iter_mut()) {
                if let Some(base) = self.unmerged_base(float) {
                    let base_runs: Vec<_> =
                        (0..rows).step_by(SHARED_DELTA_ROWS).map(|r| r..(r + SHARED_DELTA_ROWS).min(rows)).collect();
                    y = add_run_deltas(&y, &xq, &base_runs, |_| Some(base), li, p)?;
                }
                out.push(add_run_deltas(&y, &xq, &runs, |k| adapters[k], li, p)?);
            }
        }
        for j in quantized..plan.order.len() {
            let r = &plan.spans[j];
            let s = &seqs[plan.order[j]];
            let ctx = LayerCtx { li, adapter: s.adapter, base: self.unmerged_base(true), float: true, bf16: self.float_in_bf16(), start: 0 };
            let xj = x.narrow(1, r.start, r.len())?;
            for (&p, out) in ps.iter().zip(pieces.iter_mut()) {
                out.push(ctx.linear(layer, p, &xj)?);
            }
        }
        pieces.into_iter().map(|mut v| if v.len() == 1 { Ok(v.remove(0)) } else { Tensor::cat(&v, 1) }).collect()
    }

    /// Trainable forward from embeddings `[b, t, hidden]` (positions `0..t`). Returns the final
    /// normalised hidden states `[b, t, hidden]`; apply `logits_train` at the positions that need
    /// them (the vocabulary projection of every position is the single largest activation).
    pub fn forward_train(
        &self,
        x: &Tensor,
        adapter: Option<&dyn Adapter>,
        hooks: &mut dyn ForwardHooks,
    ) -> Result<Tensor> {
        self.forward_train_packed(x, None, adapter, hooks)
    }

    /// `forward_train` over a row laid out by `packing` (positions and visibility per token;
    /// `None`: one sequence at positions `0..t`).
    pub fn forward_train_packed(
        &self,
        x: &Tensor,
        packing: Option<&Packing>,
        adapter: Option<&dyn Adapter>,
        hooks: &mut dyn ForwardHooks,
    ) -> Result<Tensor> {
        let hooked = hooks.first_trainable_layer().unwrap_or(usize::MAX).min(self.layers.len());
        let first = self.first_trainable_layer(x, adapter).min(hooked);
        let h = self.forward_frozen(x, first, packing, hooks)?;
        self.forward_train_from(&h, first, packing, adapter, hooks)
    }

    /// RoPE rows `[t, d/2]` of a training row of `t` tokens, and its additive mask `[t, t]`
    /// (causal, sliding window, packing) when one is needed. `causal_done`: the attention applies
    /// causality itself, so a plain row needs a mask only for a sliding window it exceeds.
    fn train_layout(
        &self,
        t: usize,
        packing: Option<&Packing>,
        causal_done: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let window = self.config.sliding_window;
        match packing {
            None => {
                let (cos, sin) = self.rope_slice(0, t)?;
                let needed = !causal_done || window.is_some_and(|w| t > w);
                let mask = if needed { causal_mask(t, 0, window, &self.device)? } else { None };
                Ok((cos, sin, mask))
            }
            Some(p) => {
                if p.len() != t {
                    candle_core::bail!("packing of {} tokens for a row of {t}", p.len());
                }
                let (cos, sin) = p.rope_tables(&self.cos, &self.sin)?;
                Ok((cos, sin, Some(p.mask(window, &self.device)?)))
            }
        }
    }

    /// The lowest layer that needs an autograd graph: layers below the adapter's first layer see
    /// no trainable input (unless the embeddings themselves are being differentiated).
    pub fn first_trainable_layer(&self, x: &Tensor, adapter: Option<&dyn Adapter>) -> usize {
        let first = if x.track_op() { 0 } else { adapter.map_or(usize::MAX, |a| a.first_layer()) };
        first.min(self.layers.len())
    }

    /// The frozen base model's layers `0..upto` over embeddings `[b, t, hidden]` on the fast
    /// inference kernels (no graph): the residual stream entering layer `upto`. Deterministic for
    /// given tokens, so trainers may cache it across epochs.
    pub fn forward_frozen(
        &self,
        x: &Tensor,
        upto: usize,
        packing: Option<&Packing>,
        hooks: &mut dyn ForwardHooks,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (_, t, _) = x.dims3()?;
        let mut x = x.to_dtype(self.dtype)?;
        if upto == 0 {
            return Ok(x);
        }
        let (cos, sin, mask) = self.train_layout(t, packing, false)?;
        let eps = cfg.rms_norm_eps as f32;
        let mask = mask.map(|m| m.to_dtype(self.dtype)).transpose()?;
        let causal_only = packing.is_none() && !window_cuts(cfg.sliding_window, t);
        for (li, layer) in self.layers.iter().enumerate().take(upto) {
            let ctx = LayerCtx { li, adapter: None, base: self.unmerged_base(true), float: true, bf16: self.float_in_bf16(), start: 0 };
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let positions = Positions { cos: &cos, sin: &sin, mask: mask.as_ref(), causal_only };
            let attn = self.attention_infer(&ctx, layer, &h, positions, None, hooks)?;
            x = (x + attn)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let gate = ctx.linear(layer, Projection::Gate, &h)?;
            let up = ctx.linear(layer, Projection::Up, &h)?;
            x = (&x + ctx.linear(layer, Projection::Down, &ops::silu_mul(&gate, &up)?)?)?;
            hooks.after_layer(li, &x)?;
        }
        Ok(x)
    }

    /// Trainable forward of layers `from..` from the residual stream `h` `[b, t, hidden]` entering
    /// layer `from` (positions `0..t`, or as `packing` lays them out); returns the final
    /// normalised hidden states.
    pub fn forward_train_from(
        &self,
        h: &Tensor,
        from: usize,
        packing: Option<&Packing>,
        adapter: Option<&dyn Adapter>,
        hooks: &mut dyn ForwardHooks,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (b, t, _) = h.dims3()?;
        // The attention op is causal itself: a mask only for a sliding window or packing.
        let (cos, sin, mask) = self.train_layout(t, packing, true)?;
        let eps = cfg.rms_norm_eps as f32;
        let row_mask = mask.map(|m| m.to_dtype(self.dtype)).transpose()?;
        let mut x = h.to_dtype(self.dtype)?;
        let adapters = [self.unmerged_base(true), adapter];
        let bf16 = self.float_in_bf16();
        for (li, layer) in self.layers.iter().enumerate().skip(from) {
            let h = ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let q = train_linear(adapters, li, layer, Projection::Q, &h, bf16)?;
            let k = train_linear(adapters, li, layer, Projection::K, &h, bf16)?;
            let v = train_linear(adapters, li, layer, Projection::V, &h, bf16)?;
            let q = q.reshape((b, t, cfg.num_heads, cfg.head_dim))?.transpose(1, 2)?.contiguous()?;
            let k = k.reshape((b, t, cfg.num_kv_heads, cfg.head_dim))?.transpose(1, 2)?.contiguous()?;
            let v = v.reshape((b, t, cfg.num_kv_heads, cfg.head_dim))?.transpose(1, 2)?.contiguous()?;
            let rope = if self.rope_interleaved { ops::rope_interleaved } else { ops::rope };
            let q_rot = rope(&q, &cos, &sin)?;
            let k_rot = rope(&k, &cos, &sin)?;
            let k_rep = repeat_kv(&k_rot, cfg.kv_groups())?;
            let v_rep = repeat_kv(&v, cfg.kv_groups())?;
            let bias = hooks.attention_bias(li, 0, t, t)?;
            let bias = bias.map(|b| b.to_dtype(self.dtype)).transpose()?;
            let bias = match (bias, &row_mask) {
                (Some(b), Some(w)) => Some(b.broadcast_add(w)?),
                (Some(b), None) => Some(b),
                (None, Some(w)) => Some(w.clone()),
                (None, None) => None,
            };
            let scale = 1.0 / (cfg.head_dim as f64).sqrt();
            let attn = ops::causal_attention(&q_rot, &k_rep, &v_rep, scale, bias.as_ref())?;
            let attn = match adapter {
                Some(a) => a.mix_attention(li, &q, attn)?,
                None => attn,
            };
            let attn = attn.transpose(1, 2)?.reshape((b, t, cfg.num_heads * cfg.head_dim))?;
            let o = train_linear(adapters, li, layer, Projection::O, &attn, bf16)?;
            x = (x + o)?;
            let h = ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let gate = train_linear(adapters, li, layer, Projection::Gate, &h, bf16)?;
            let up = train_linear(adapters, li, layer, Projection::Up, &h, bf16)?;
            let mlp = train_linear(adapters, li, layer, Projection::Down, &ops::silu_mul(&gate, &up)?, bf16)?;
            x = (x + mlp)?;
            hooks.after_layer(li, &x)?;
        }
        ops::rms_norm(&x, &self.norm, eps)
    }

    /// Puts `adapter` under every forward pass as the frozen base adapter. Its update of each
    /// projection (`delta(layer, projection)`, `[out, in]`) is merged into the float weights, so
    /// training and prefill pay nothing for it; on a quantized file decode still adds its deltas
    /// through the quantized weights.
    pub fn merge_base_adapter(
        &mut self,
        adapter: Arc<dyn Adapter>,
        delta: &dyn Fn(usize, Projection) -> Result<Option<Tensor>>,
    ) -> Result<()> {
        for (li, layer) in self.layers.iter_mut().enumerate() {
            for p in Projection::ALL {
                if let Some(d) = delta(li, p)? {
                    layer.linear_mut(p).merge_into_float(&d)?;
                }
            }
        }
        self.base_adapter = Some(adapter);
        self.base_merged = true;
        Ok(())
    }

    /// The base adapter where its deltas must still be added: everywhere when it is not merged,
    /// else only where inference reads quantized blocks (`float` false on a quantized file, off
    /// CUDA). On CUDA the quantized path runs through the merged float copy: adding the deltas
    /// there too applied the prepared base twice to every decoded token (answers cut short:
    /// "August 26, 1960" → "August 26").
    fn unmerged_base(&self, float: bool) -> Option<&dyn Adapter> {
        let quantized = self.layers.first().is_some_and(|l| l.q.infers_from_quantized());
        let needed = !self.base_merged || (!float && quantized);
        self.base_adapter.as_deref().filter(|_| needed)
    }

    /// Vocabulary logits (f32) for hidden states `[.., hidden]` on the trainable path.
    pub fn logits_train(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward_train(&hidden.to_dtype(self.dtype)?, self.float_in_bf16())?.to_dtype(DType::F32)
    }

    /// Dequantizes every weight now instead of at the first training step.
    pub fn prepare_float_weights(&self) -> Result<()> {
        self.lm_head.prepare_float()?;
        for l in &self.layers {
            for p in Projection::ALL {
                l.linear(p).prepare_float()?;
            }
        }
        Ok(())
    }
}

/// The CPU decode step of `which` (one row each): each sequence's new key and value rows
/// (`kr`, `vr` `[n, kv_heads, d]`, after RoPE) stored in its cache buffers of element type `T`,
/// its hooks' bias asked for, then one `decode_attention` over all caches for the queries `qv`
/// (`[n, heads, d]`). Returns `[n, heads, d]`.
fn decode_step<T: HostElem>(
    li: usize,
    cfg: &ModelConfig,
    seqs: &mut [SeqInput],
    which: &[usize],
    qv: &[f32],
    kr: &[f32],
    vr: &[f32],
) -> Result<Vec<f32>> {
    let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let row = nkv * hd;
    let mut biases = Vec::with_capacity(which.len());
    for (j, &i) in which.iter().enumerate() {
        let s = &mut seqs[i];
        let start = s.cache.len();
        s.cache.append_row::<T>(li, &kr[j * row..(j + 1) * row], &vr[j * row..(j + 1) * row], nkv, hd)?;
        let bias = s.hooks.attention_bias(li, start, 1, start + 1)?;
        biases.push(match bias {
            Some(b) if b.elem_count() == start + 1 => Some(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            Some(b) => candle_core::bail!("a decode attention bias of shape {:?} for {} keys", b.dims(), start + 1),
            None => None,
        });
    }
    let mut caches = Vec::with_capacity(which.len());
    for (j, &i) in which.iter().enumerate() {
        let (k, v, capacity) = seqs[i].cache.host_buffers::<T>(li)?;
        caches.push(DecodeCache { k, v, capacity, len: seqs[i].cache.len() + 1, bias: biases[j].as_deref() });
    }
    Ok(crate::kernels::decode_attention::decode_attention(qv, &caches, nh, nkv, hd, 1.0 / (hd as f32).sqrt()))
}

/// What the decoding rows of one `forward_batch` step share across its layers.
#[derive(Default)]
struct DecodeStep {
    #[cfg(feature = "cuda")]
    cuda: Option<CudaDecodeStep>,
}

/// The CUDA decode kernels' inputs for one step, all layers (`Decoder::cuda_decode_step`).
#[cfg(feature = "cuda")]
struct CudaDecodeStep {
    /// RoPE rows of the decoding rows (`[n, 1, d/2]` cos, sin).
    rope: (Tensor, Tensor),
    /// i64 `[layers, 2, n]`: addresses of each row's key and value buffers per layer.
    caches: Tensor,
    /// u32 `[2, n]`: each row's keys after this step's append, and its cache capacity.
    counts: Tensor,
    /// i64 `[layers, n]`: addresses of each row's frozen Gated Memory parameters (0: none).
    gm_params: Tensor,
    gm: Vec<LayerMix>,
    /// The buffers the address tables point into, kept alive for the step.
    _buffers: Vec<Tensor>,
}

/// The Gated Memory mix of one layer of a CUDA decode step.
#[cfg(feature = "cuda")]
struct LayerMix {
    /// Shapes of the layers mixed in one launch (`gm_params`); `None`: no such layer.
    dims: Option<crate::kernels::gated_memory::GmDims>,
    /// Rows whose adapter's mix only its `mix_attention` can do.
    own: Vec<bool>,
}

/// A decode step's rows as `Decoder::decode_rows` lays them out: query and value heads, and the
/// query and key heads after RoPE (`[n, heads, 1, d]`).
struct DecodeRows {
    q: Tensor,
    v: Tensor,
    q_rot: Tensor,
    k_rot: Tensor,
}

/// The positions an inference attention covers: their RoPE rows `[t, d/2]` and the additive mask
/// over its keys (none: nothing to mask).
#[derive(Clone, Copy)]
struct Positions<'a> {
    cos: &'a Tensor,
    sin: &'a Tensor,
    mask: Option<&'a Tensor>,
    /// `mask` hides nothing but the future (no sliding window cuts it, no packing): the fused
    /// prompt attention, causal by construction, then does without it.
    causal_only: bool,
}

/// What one layer's inference step needs to know.
struct LayerCtx<'a> {
    li: usize,
    adapter: Option<&'a dyn Adapter>,
    base: Option<&'a dyn Adapter>,
    float: bool,
    /// Float matmuls in bf16 (`Decoder::cpu_float_dtype`).
    bf16: bool,
    start: usize,
}

impl LayerCtx<'_> {
    fn linear(&self, layer: &DecoderLayer, p: Projection, x: &Tensor) -> Result<Tensor> {
        let lin = layer.linear(p);
        let y = if self.float { lin.forward_float(x, self.bf16)? } else { lin.forward(x)? };
        add_deltas(y, [self.base, self.adapter], self.li, p, x)
    }
}

/// `y` plus the linear deltas of the base adapter and the per-call adapter, where present.
fn add_deltas(
    mut y: Tensor,
    adapters: [Option<&dyn Adapter>; 2],
    li: usize,
    p: Projection,
    x: &Tensor,
) -> Result<Tensor> {
    for a in adapters.into_iter().flatten() {
        if let Some(d) = a.linear_delta(li, p, x)? {
            y = (y + d)?;
        }
    }
    Ok(y)
}

/// `y` with `adapter(k)`'s linear delta added to the rows `runs[k]` (`[1, rows, _]`); `y` itself
/// when no run has a delta.
fn add_run_deltas<'a>(
    y: &Tensor,
    x: &Tensor,
    runs: &[std::ops::Range<usize>],
    adapter: impl Fn(usize) -> Option<&'a dyn Adapter>,
    li: usize,
    p: Projection,
) -> Result<Tensor> {
    let mut deltas = Vec::with_capacity(runs.len());
    for (k, r) in runs.iter().enumerate() {
        let d = match adapter(k) {
            Some(a) => a.linear_delta(li, p, &x.narrow(1, r.start, r.len())?)?,
            None => None,
        };
        deltas.push(d);
    }
    if deltas.iter().all(Option::is_none) {
        return Ok(y.clone());
    }
    let pieces = runs
        .iter()
        .zip(deltas)
        .map(|(r, d)| {
            let yr = y.narrow(1, r.start, r.len())?;
            match d {
                Some(d) => yr + d,
                None => Ok(yr),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&pieces, 1)
}

/// BF16 where the CPU runs the bf16 kernel, unless `LIFT_CPU_FLOAT_DTYPE=f32`.
fn default_cpu_float_dtype() -> DType {
    let f32_asked = std::env::var("LIFT_CPU_FLOAT_DTYPE").is_ok_and(|v| v.eq_ignore_ascii_case("f32"));
    if crate::kernels::bf16_matmul::available() && !f32_asked {
        DType::BF16
    } else {
        DType::F32
    }
}

fn train_linear(
    adapters: [Option<&dyn Adapter>; 2],
    li: usize,
    layer: &DecoderLayer,
    p: Projection,
    x: &Tensor,
    bf16: bool,
) -> Result<Tensor> {
    add_deltas(layer.linear(p).forward_train(x, bf16)?, adapters, li, p, x)
}

/// Causal (and sliding-window) attention of a prompt chunk through flash-attn: `q`
/// `[b, heads, t, d]` after what the cache held, `k`/`v` `[b, kv_heads, tk, d]` (GQA is native).
/// Queries align to the last keys, as `causal_mask`; the window keeps `w` keys as it does.
#[cfg(feature = "flash-attn")]
fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, cfg: &ModelConfig) -> Result<Tensor> {
    let scale = 1.0 / (cfg.head_dim as f32).sqrt();
    let layout = |x: &Tensor| x.transpose(1, 2)?.contiguous();
    let left = cfg.sliding_window.map(|w| w.saturating_sub(1));
    candle_flash_attn::flash_attn_windowed(&layout(q)?, &layout(k)?, &layout(v)?, scale, left, Some(0))?.transpose(1, 2)
}

/// `[b, kv_heads, t, d]` → `[b, kv_heads * groups, t, d]`, query head `h` using KV head `h / groups`.
pub fn repeat_kv(x: &Tensor, groups: usize) -> Result<Tensor> {
    if groups == 1 {
        return Ok(x.clone());
    }
    let (b, h, t, d) = x.dims4()?;
    x.unsqueeze(2)?
        .expand((b, h, groups, t, d))?
        .reshape((b, h * groups, t, d))
}

/// Whether a sliding window of `window` positions hides some key from a query among the first
/// `len` positions (then the causal mask alone is not the whole mask).
fn window_cuts(window: Option<usize>, len: usize) -> bool {
    window.is_some_and(|w| len > w)
}

/// Additive causal mask `[t, start + t]` for queries at `start..start+t` (None when no key is hidden).
pub fn causal_mask(t: usize, start: usize, window: Option<usize>, device: &Device) -> Result<Option<Tensor>> {
    let tk = start + t;
    let hides = |i: usize, j: usize| {
        let qpos = start + i;
        j > qpos || window.is_some_and(|w| qpos >= w && j <= qpos - w)
    };
    let any = (0..t).any(|i| (0..tk).any(|j| hides(i, j)));
    if !any {
        return Ok(None);
    }
    let data: Vec<f32> = (0..t)
        .flat_map(|i| (0..tk).map(move |j| (i, j)))
        .map(|(i, j)| if hides(i, j) { f32::NEG_INFINITY } else { 0.0 })
        .collect();
    Tensor::from_vec(data, (t, tk), device).map(Some)
}

fn rope_tables(cfg: &ModelConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    let inv = cfg.rope_inv_freq();
    let scale = cfg.rope_position_scale();
    let n = cfg.max_position_embeddings.max(1);
    let half = inv.len();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for p in 0..n {
        // f32 throughout, as llama.cpp and candle compute the angles: the quantized matmuls round
        // activations to 8 bits, so an ulp of difference here can show up in the logits.
        let pos = p as f32 * scale;
        for f in &inv {
            let a = pos * *f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (n, half), device)?,
        Tensor::from_vec(sin, (n, half), device)?,
    ))
}
