//! Extension points of the decoder, used by adapters (Gated Memory, LoRA), the FltLM soft mask and
//! anything that needs intermediate hidden states. The decoder calls them identically on the
//! inference and the trainable path, so an adapter is implemented once.

use candle_core::{Result, Tensor};

/// The linear projections of one decoder layer, the targets of LoRA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Projection {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Projection {
    pub const ALL: [Projection; 7] = [
        Projection::Q,
        Projection::K,
        Projection::V,
        Projection::O,
        Projection::Gate,
        Projection::Up,
        Projection::Down,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Projection::Q => "q_proj",
            Projection::K => "k_proj",
            Projection::V => "v_proj",
            Projection::O => "o_proj",
            Projection::Gate => "gate_proj",
            Projection::Up => "up_proj",
            Projection::Down => "down_proj",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s || p.name().trim_end_matches("_proj") == s)
    }
}

/// A per-document adapter over the frozen decoder. Implementations hold their own parameters;
/// on the inference path they must use detached copies (no autograd graph in the KV cache).
pub trait Adapter: Send + Sync {
    /// Extra output added to projection `proj` of `layer` for input `x` (LoRA). `None`: unchanged.
    fn linear_delta(&self, _layer: usize, _proj: Projection, _x: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// Mixes each head's attention output with the adapter's own output before `o_proj`
    /// (Gated Memory). `q_pre_rope` and `attn` are `[batch, heads, seq, head_dim]`.
    fn mix_attention(&self, _layer: usize, _q_pre_rope: &Tensor, attn: Tensor) -> Result<Tensor> {
        Ok(attn)
    }

    /// The lowest layer this adapter touches; layers below it need no autograd graph.
    fn first_layer(&self) -> usize {
        0
    }

    /// What `mix_attention` does at `layer`, for the CPU batch decode step, which runs the
    /// mixes of all its sequences in one parallel pass instead of one call per sequence.
    fn decode_mix(&self, _layer: usize) -> DecodeMix<'_> {
        DecodeMix::Opaque
    }
}

/// An adapter's attention mix at one layer as the batch decode step can run it.
pub enum DecodeMix<'a> {
    /// `mix_attention` returns the attention unchanged.
    Identity,
    /// A frozen Gated Memory layer: its weights as the decode mix reads them.
    GatedMemory(&'a crate::kernels::gated_memory::DecodeWeights),
    /// A frozen Gated Memory layer on a GPU: its packed parameters (the fused kernel's layout,
    /// f32) and shapes, so that the CUDA decode step mixes every sequence's rows in one launch.
    GatedMemoryPacked(&'a candle_core::Tensor, crate::kernels::gated_memory::GmDims),
    /// Only `mix_attention` can say.
    Opaque,
}

/// Per-forward-pass hooks: additive attention bias and a look at hidden states between layers.
/// FltLM computes chunk scores from layer N's output (`after_layer`) and then masks the attention
/// of the layers above it (`attention_bias`), all in one pass.
pub trait ForwardHooks {
    /// Called with the residual stream `[batch, seq, hidden]` after `layer` has run.
    fn after_layer(&mut self, _layer: usize, _hidden: &Tensor) -> Result<()> {
        Ok(())
    }

    /// Additive bias on the attention logits of `layer`, broadcastable to
    /// `[batch, heads, q_len, k_len]`, for queries at absolute positions `q_start..q_start+q_len`
    /// and keys `0..k_len`. `None`: no bias.
    fn attention_bias(&self, _layer: usize, _q_start: usize, _q_len: usize, _k_len: usize) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// The lowest layer whose computation the hooks' own trainable parameters reach (a trainable
    /// FltLM filter: the layers its bias masks), so that training runs it in the autograd graph.
    /// `None`: the hooks train nothing.
    fn first_trainable_layer(&self) -> Option<usize> {
        None
    }
}

/// Hooks that do nothing.
pub struct NoHooks;
impl ForwardHooks for NoHooks {}

/// Borrowed hooks are hooks (so a caller can lend its hooks to a [`super::generate::Sequence`]).
impl<H: ForwardHooks + ?Sized> ForwardHooks for &mut H {
    fn after_layer(&mut self, layer: usize, hidden: &Tensor) -> Result<()> {
        (**self).after_layer(layer, hidden)
    }

    fn attention_bias(&self, layer: usize, q_start: usize, q_len: usize, k_len: usize) -> Result<Option<Tensor>> {
        (**self).attention_bias(layer, q_start, q_len, k_len)
    }

    fn first_trainable_layer(&self) -> Option<usize> {
        (**self).first_trainable_layer()
    }
}

/// Optional hooks: `None` does nothing (a batch whose sequences differ in having hooks).
impl<H: ForwardHooks> ForwardHooks for Option<H> {
    fn after_layer(&mut self, layer: usize, hidden: &Tensor) -> Result<()> {
        self.as_mut().map_or(Ok(()), |h| h.after_layer(layer, hidden))
    }

    fn attention_bias(&self, layer: usize, q_start: usize, q_len: usize, k_len: usize) -> Result<Option<Tensor>> {
        self.as_ref().map_or(Ok(None), |h| h.attention_bias(layer, q_start, q_len, k_len))
    }

    fn first_trainable_layer(&self) -> Option<usize> {
        self.as_ref().and_then(|h| h.first_trainable_layer())
    }
}

/// The hooks of a batched forward over rows `[b, t, hidden]`, one set per row (a trainer's rows
/// of one optimizer step, each with its own filter layout): row `i`'s hooks see row `i`'s
/// stream `[1, t, hidden]`, and the rows' biases are stacked to `[b, heads, q_len, k_len]` (a row
/// without a bias gets zeros; no row with one: no bias at all).
pub struct RowHooks<H: ForwardHooks> {
    pub rows: Vec<H>,
}

impl<H: ForwardHooks> ForwardHooks for RowHooks<H> {
    fn after_layer(&mut self, layer: usize, hidden: &Tensor) -> Result<()> {
        if hidden.dim(0)? != self.rows.len() {
            candle_core::bail!("{} rows of hooks for a batch of {}", self.rows.len(), hidden.dim(0)?);
        }
        for (i, h) in self.rows.iter_mut().enumerate() {
            h.after_layer(layer, &hidden.narrow(0, i, 1)?)?;
        }
        Ok(())
    }

    fn attention_bias(&self, layer: usize, q_start: usize, q_len: usize, k_len: usize) -> Result<Option<Tensor>> {
        let biases: Vec<Option<Tensor>> =
            self.rows.iter().map(|h| h.attention_bias(layer, q_start, q_len, k_len)).collect::<Result<_>>()?;
        let Some(first) = biases.iter().flatten().next() else { return Ok(None) };
        // Each row's bias as [1, heads, q_len, k_len] (heads: the most any row has, 1 or all).
        let as4 = |b: &Tensor| -> Result<Tensor> {
            match b.rank() {
                2 => b.unsqueeze(0)?.unsqueeze(0),
                3 => b.unsqueeze(0),
                4 if b.dim(0)? == 1 => Ok(b.clone()),
                _ => candle_core::bail!("a row's attention bias of shape {:?}", b.shape()),
            }
        };
        let heads = biases.iter().flatten().map(|b| as4(b).and_then(|b| b.dim(1))).collect::<Result<Vec<_>>>()?;
        let heads = heads.into_iter().max().unwrap_or(1);
        let zero = Tensor::zeros((1, heads, q_len, k_len), first.dtype(), first.device())?;
        let rows: Vec<Tensor> = biases
            .iter()
            .map(|b| match b {
                Some(b) => as4(b)?.broadcast_as((1, heads, q_len, k_len))?.contiguous(),
                None => Ok(zero.clone()),
            })
            .collect::<Result<_>>()?;
        Tensor::cat(&rows, 0).map(Some)
    }

    fn first_trainable_layer(&self) -> Option<usize> {
        self.rows.iter().filter_map(|h| h.first_trainable_layer()).min()
    }
}
