//! The decoder's trainable path: [`Decoder::forward_train`] and its parts (the frozen layers
//! below the adapter on the inference kernels, the differentiable layers from it on), and the
//! vocabulary logits of the training loss.

use super::hooks::{Adapter, ForwardHooks, Projection};
use super::llama::{add_deltas, causal_mask, repeat_kv, window_cuts, Decoder, DecoderLayer, LayerCtx, Positions};
use super::ops;
use super::packing::Packing;
use candle_core::{DType, Result, Tensor};

impl Decoder {
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
