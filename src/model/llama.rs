//! The Llama-family decoder (Llama 1–3, Qwen2, Mistral; SmolLM2 is Llama) with two forward paths
//! over one set of frozen weights:
//! - `forward`: inference with a KV cache, candle's fused kernels and quantized matmuls;
//! - `forward_train`: differentiable ops only (our fused ops with hand-written backward), float
//!   weights that never receive gradients, so `backward()` reaches adapter parameters only.
//! Both call the same adapter and forward hooks at the same places.
//!
//! This file holds the model, its loading and the inference forward; beside it stand the KV cache
//! (`kv_cache`), and, each an `impl Decoder` of its own, continuous batching with its decode steps
//! (`batch`) and the trainable path (`train_path`).

use super::config::ModelConfig;
use super::hooks::{Adapter, ForwardHooks, Projection};
use super::kv_cache::KvCache;
use super::ops;
use super::weights::Linear;
use crate::runtime::RuntimeConfig;
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
    pub(super) fn linear(&self, p: Projection) -> &Linear {
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
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    pub(super) device: Device,
    /// Dtype of the float weights and activations: f32 on the CPU, bf16 on CUDA
    /// (`RuntimeConfig::base_dtype`).
    /// Adapters stay f32: their inputs are cast at the hook, their outputs cast back; logits are
    /// returned as f32.
    pub(super) dtype: DType,
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
    /// `RuntimeConfig::cpu_float_dtype` sets it at load). Activations, adapters, the adapter's
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

impl Decoder {
    pub fn new(
        config: ModelConfig,
        embed: Tensor,
        layers: Vec<DecoderLayer>,
        norm: Tensor,
        lm_head: Linear,
        device: &Device,
        runtime: &RuntimeConfig,
    ) -> Result<Self> {
        let dtype = runtime.base_dtype(device);
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
            float_prefill_min_rows: runtime.float_prefill_min_rows,
            float_batch_min_rows: if packed { usize::MAX } else { 6 },
            base_adapter: None,
            base_merged: false,
            reference_ops: false,
            cpu_kv_dtype: DType::F16,
            cpu_float_dtype: runtime.cpu_float_matmul_dtype(),
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

    pub(super) fn rope_slice(&self, start: usize, len: usize) -> Result<(Tensor, Tensor)> {
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

    /// Runs one prompt of the float-prefill size through the inference path, so that what a
    /// first prompt makes on first use (the float and bf16 copies of the weights: 0.6 s on 2 cores
    /// for the default model) is made when the server starts, not inside its first answer.
    pub fn warm_up(&self) -> Result<()> {
        let ids = Tensor::zeros((1, self.float_prefill_min_rows.max(1)), DType::U32, self.cos.device())?;
        let mut cache = KvCache::new(self.layers.len());
        self.forward(&ids, &mut cache, None, &mut super::hooks::NoHooks, Logits::Last).map(|_| ())
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

    pub(super) fn attention_infer(
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
    pub(super) fn attend(
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
    pub(super) fn inference_norm(&self, x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
        if self.device.is_cpu() {
            super::ops::rms_norm(x, weight, eps)
        } else {
            candle_nn::ops::rms_norm(x, weight, eps)
        }
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
    pub(super) fn unmerged_base(&self, float: bool) -> Option<&dyn Adapter> {
        let quantized = self.layers.first().is_some_and(|l| l.q.infers_from_quantized());
        let needed = !self.base_merged || (!float && quantized);
        self.base_adapter.as_deref().filter(|_| needed)
    }
}

/// The positions an inference attention covers: their RoPE rows `[t, d/2]` and the additive mask
/// over its keys (none: nothing to mask).
#[derive(Clone, Copy)]
pub(super) struct Positions<'a> {
    pub(super) cos: &'a Tensor,
    pub(super) sin: &'a Tensor,
    pub(super) mask: Option<&'a Tensor>,
    /// `mask` hides nothing but the future (no sliding window cuts it, no packing): the fused
    /// prompt attention, causal by construction, then does without it.
    pub(super) causal_only: bool,
}

/// What one layer's inference step needs to know.
pub(super) struct LayerCtx<'a> {
    pub(super) li: usize,
    pub(super) adapter: Option<&'a dyn Adapter>,
    pub(super) base: Option<&'a dyn Adapter>,
    pub(super) float: bool,
    /// Float matmuls in bf16 (`Decoder::cpu_float_dtype`).
    pub(super) bf16: bool,
    pub(super) start: usize,
}

impl LayerCtx<'_> {
    pub(super) fn linear(&self, layer: &DecoderLayer, p: Projection, x: &Tensor) -> Result<Tensor> {
        let lin = layer.linear(p);
        let y = if self.float { lin.forward_float(x, self.bf16)? } else { lin.forward(x)? };
        add_deltas(y, [self.base, self.adapter], self.li, p, x)
    }
}

/// `y` plus the linear deltas of the base adapter and the per-call adapter, where present.
pub(super) fn add_deltas(
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
pub(super) fn window_cuts(window: Option<usize>, len: usize) -> bool {
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
