//! The Llama-family decoder (Llama 1–3, Qwen2, Mistral; SmolLM2 is Llama) with two forward paths
//! over one set of frozen weights:
//! - `forward`: inference with a KV cache, candle's fused kernels and quantized matmuls;
//! - `forward_train`: differentiable ops only (our fused ops with hand-written backward), float
//!   weights that never receive gradients, so `backward()` reaches adapter parameters only.
//! Both call the same adapter and forward hooks at the same places.

use super::config::ModelConfig;
use super::hooks::{Adapter, ForwardHooks, Projection};
use super::ops;
use super::packing::Packing;
use super::weights::{base_dtype, Linear};
use candle_core::{DType, Device, IndexOp, Result, Tensor};
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
    pub float_prefill_min_rows: usize,
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

/// Per-sequence-batch key/value cache for the inference path; grows by doubling.
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self { layers: (0..num_layers).map(|_| None).collect(), len: 0, capacity: 0 }
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
        self.layers
            .iter()
            .flatten()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }

    /// A deep copy (so a shared prompt prefix can be extended by several requests).
    pub fn fork(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                Some((k, v)) => Ok(Some((k.copy()?, v.copy()?))),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers, len: self.len, capacity: self.capacity })
    }

    /// Forgets everything after the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Appends `k`, `v` (`[b, kv_heads, t, d]`) for `layer` and returns views of the whole cache.
    /// `self.len` is advanced by `commit` once every layer has appended.
    fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let t = k.dim(2)?;
        let needed = self.len + t;
        if layer == 0 && needed > self.capacity {
            let new_cap = needed.max(self.capacity * 2).max(64);
            for entry in self.layers.iter_mut() {
                if let Some((ok, ov)) = entry.take() {
                    let (b, h, _, d) = ok.dims4()?;
                    let nk = Tensor::zeros((b, h, new_cap, d), ok.dtype(), ok.device())?;
                    let nv = Tensor::zeros((b, h, new_cap, d), ov.dtype(), ov.device())?;
                    if self.len > 0 {
                        nk.slice_set(&ok.narrow(2, 0, self.len)?, 2, 0)?;
                        nv.slice_set(&ov.narrow(2, 0, self.len)?, 2, 0)?;
                    }
                    *entry = Some((nk, nv));
                }
            }
            self.capacity = new_cap;
        }
        let entry = &mut self.layers[layer];
        if entry.is_none() {
            let (b, h, _, d) = k.dims4()?;
            let nk = Tensor::zeros((b, h, self.capacity, d), k.dtype(), k.device())?;
            let nv = Tensor::zeros((b, h, self.capacity, d), v.dtype(), v.device())?;
            *entry = Some((nk, nv));
        }
        let (ck, cv) = entry.as_ref().expect("cache entry initialised above");
        ck.slice_set(&k.contiguous()?, 2, self.len)?;
        cv.slice_set(&v.contiguous()?, 2, self.len)?;
        Ok((ck.narrow(2, 0, needed)?, cv.narrow(2, 0, needed)?))
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
            float_prefill_min_rows: 16,
            base_adapter: None,
            base_merged: false,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Dtype of the float weights and activations (f32 on the CPU, bf16 on CUDA).
    pub fn dtype(&self) -> DType {
        self.dtype
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
        let start = cache.len();
        let (cos, sin) = self.rope_slice(start, t)?;
        let float = b * t >= float_min_rows;
        let mask = causal_mask(t, start, self.config.sliding_window, &self.device)?;
        let mask = mask.map(|m| m.to_dtype(self.dtype)).transpose()?;
        let mut x = x.to_dtype(self.dtype)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let ctx = LayerCtx { li, adapter, base: self.unmerged_base(float), float, start };
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, self.config.rms_norm_eps as f32)?;
            let positions = Positions { cos: &cos, sin: &sin, mask: mask.as_ref() };
            let attn = self.attention_infer(&ctx, layer, &h, positions, Some(&mut *cache), hooks)?;
            x = (x + attn)?;
            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, self.config.rms_norm_eps as f32)?;
            let gate = ctx.linear(layer, Projection::Gate, &h)?;
            let up = ctx.linear(layer, Projection::Up, &h)?;
            let mlp = ctx.linear(layer, Projection::Down, &(candle_nn::ops::silu(&gate)? * up)?)?;
            x = (x + mlp)?;
            hooks.after_layer(li, &x)?;
        }
        cache.commit(t);
        let x = match which {
            Logits::Last => x.i((.., t - 1..t, ..))?,
            Logits::All => x,
        };
        let x = candle_nn::ops::rms_norm(&x, &self.norm, self.config.rms_norm_eps as f32)?;
        let logits = if float && which == Logits::All {
            self.lm_head.forward_float(&x)?
        } else {
            self.lm_head.forward(&x)?
        };
        let logits = logits.to_dtype(DType::F32)?;
        match which {
            Logits::Last => logits.squeeze(1),
            Logits::All => Ok(logits),
        }
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
        let Positions { cos, sin, mask } = positions;
        let cfg = &self.config;
        let (b, t, _) = h.dims3()?;
        let (nh, nkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let q = ctx.linear(layer, Projection::Q, h)?;
        let k = ctx.linear(layer, Projection::K, h)?;
        let v = ctx.linear(layer, Projection::V, h)?;
        let q = q.reshape((b, t, nh, hd))?.transpose(1, 2)?.contiguous()?;
        let k = k.reshape((b, t, nkv, hd))?.transpose(1, 2)?.contiguous()?;
        let v = v.reshape((b, t, nkv, hd))?.transpose(1, 2)?;
        let rope = if self.rope_interleaved { candle_nn::rotary_emb::rope_i } else { candle_nn::rotary_emb::rope };
        let q_rot = rope(&q, cos, sin)?;
        let k_rot = rope(&k, cos, sin)?;
        let (k_all, v_all) = match cache {
            Some(cache) => cache.append(ctx.li, &k_rot, &v)?,
            None => (k_rot, v),
        };
        let tk = k_all.dim(2)?;
        let bias = hooks.attention_bias(ctx.li, ctx.start, t, tk)?;
        let bias = bias.map(|b| b.to_dtype(q_rot.dtype())).transpose()?;
        #[cfg(feature = "flash-attn")]
        if t > 1 && bias.is_none() && q_rot.device().is_cuda() {
            let attn = flash_attention(&q_rot, &k_all, &v_all, cfg)?;
            return self.finish_attention(ctx, layer, &q, attn);
        }

        let g = cfg.kv_groups();
        let scale = 1.0 / (hd as f64).sqrt();
        // Decode (one query row): the `g` query heads sharing a KV head are stacked so the cache
        // is read as is, never copied. Prompts: KV heads repeated, the same matmul shapes as
        // llama.cpp/candle (see `rope_interleaved` for why the arithmetic should match).
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
        self.finish_attention(ctx, layer, &q, attn)
    }

    /// Adapter mix and output projection of the inference attention (`attn` `[b, heads, t, d]`).
    fn finish_attention(&self, ctx: &LayerCtx, layer: &DecoderLayer, q: &Tensor, attn: Tensor) -> Result<Tensor> {
        let (b, nh, t, hd) = attn.dims4()?;
        let attn = match ctx.adapter {
            Some(a) => a.mix_attention(ctx.li, q, attn)?,
            None => attn,
        };
        let attn = attn.transpose(1, 2)?.reshape((b, t, nh * hd))?;
        ctx.linear(layer, Projection::O, &attn)
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
        for (li, layer) in self.layers.iter().enumerate().take(upto) {
            let ctx = LayerCtx { li, adapter: None, base: self.unmerged_base(true), float: true, start: 0 };
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let positions = Positions { cos: &cos, sin: &sin, mask: mask.as_ref() };
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
        for (li, layer) in self.layers.iter().enumerate().skip(from) {
            let h = ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let q = train_linear(adapters, li, layer, Projection::Q, &h)?;
            let k = train_linear(adapters, li, layer, Projection::K, &h)?;
            let v = train_linear(adapters, li, layer, Projection::V, &h)?;
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
            let o = train_linear(adapters, li, layer, Projection::O, &attn)?;
            x = (x + o)?;
            let h = ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let gate = train_linear(adapters, li, layer, Projection::Gate, &h)?;
            let up = train_linear(adapters, li, layer, Projection::Up, &h)?;
            let mlp = train_linear(adapters, li, layer, Projection::Down, &ops::silu_mul(&gate, &up)?)?;
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
    /// else only on the quantized inference path (`float` false) of a quantized file.
    fn unmerged_base(&self, float: bool) -> Option<&dyn Adapter> {
        let quantized = self.layers.first().is_some_and(|l| l.q.is_quantized());
        let needed = !self.base_merged || (!float && quantized);
        self.base_adapter.as_deref().filter(|_| needed)
    }

    /// Vocabulary logits (f32) for hidden states `[.., hidden]` on the trainable path.
    pub fn logits_train(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward_train(&hidden.to_dtype(self.dtype)?)?.to_dtype(DType::F32)
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

/// The positions an inference attention covers: their RoPE rows `[t, d/2]` and the additive mask
/// over its keys (none: nothing to mask).
#[derive(Clone, Copy)]
struct Positions<'a> {
    cos: &'a Tensor,
    sin: &'a Tensor,
    mask: Option<&'a Tensor>,
}

/// What one layer's inference step needs to know.
struct LayerCtx<'a> {
    li: usize,
    adapter: Option<&'a dyn Adapter>,
    base: Option<&'a dyn Adapter>,
    float: bool,
    start: usize,
}

impl LayerCtx<'_> {
    fn linear(&self, layer: &DecoderLayer, p: Projection, x: &Tensor) -> Result<Tensor> {
        let lin = layer.linear(p);
        let y = if self.float { lin.forward_float(x)? } else { lin.forward(x)? };
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

fn train_linear(
    adapters: [Option<&dyn Adapter>; 2],
    li: usize,
    layer: &DecoderLayer,
    p: Projection,
    x: &Tensor,
) -> Result<Tensor> {
    add_deltas(layer.linear(p).forward_train(x)?, adapters, li, p, x)
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
