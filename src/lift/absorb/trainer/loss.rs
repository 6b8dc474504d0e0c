//! The losses a run trains on: a training row prepared for the model, its weighted cross-entropy,
//! the FltLM filter's loss beside it, and the cache of the frozen layers' streams of the QA
//! examples. (CDT's two passes over the same losses belong to the prepared base: `base::cdt`.)

use super::FilterTraining;
use crate::lift::absorb::qa_examples::FilterExample;
use crate::lift::answer::layout::{filter_loss, FilterHooks, FromLayer};
use crate::lift::absorb::plan::Example;
use crate::model::{ops, Adapter, ForwardHooks, Model, NoHooks, Packing};
use anyhow::{bail, Result};
use candle_core::Tensor;

/// Memory for cached frozen-layer streams of QA examples (~400 KB per 180-token example here).
pub(super) const FROZEN_CACHE_BYTES: usize = 256 << 20;

/// The residual streams entering the first trainable layer of examples that are the same tokens
/// every epoch (the QA examples): the frozen layers below the adapter run once per example
/// instead of once per epoch. Bounded in bytes; past the budget examples are recomputed.
pub(crate) struct FrozenCache {
    entries: std::collections::HashMap<usize, Tensor>,
    pub(super) bytes: usize,
    budget: usize,
}

impl FrozenCache {
    pub(super) fn new(budget: usize) -> Self {
        Self { entries: Default::default(), bytes: 0, budget }
    }

    /// The stream entering layer `first` for example `key` with embeddings `emb`.
    pub(super) fn stream(
        &mut self,
        model: &Model,
        key: usize,
        emb: &Tensor,
        first: usize,
        packing: Option<&Packing>,
    ) -> Result<Tensor> {
        if let Some(h) = self.entries.get(&key) {
            return Ok(h.clone());
        }
        let h = model.decoder.forward_frozen(emb, first, packing, &mut NoHooks)?;
        let size = h.elem_count() * h.dtype().size_in_bytes();
        if first > 0 && self.bytes + size <= self.budget {
            self.bytes += size;
            self.entries.insert(key, h.clone());
        }
        Ok(h)
    }
}

/// Mean cross-entropy of `example` under the model with `adapter`; only target positions go
/// through the vocabulary projection.
pub fn example_loss(model: &Model, adapter: &dyn Adapter, example: &Example) -> Result<Tensor> {
    example_loss_with(model, adapter, example, &mut NoHooks)
}

/// [`example_loss`] with forward hooks (e.g. a filter's soft mask).
pub fn example_loss_with(
    model: &Model,
    adapter: &dyn Adapter,
    example: &Example,
    hooks: &mut dyn ForwardHooks,
) -> Result<Tensor> {
    let p = prepare(model, example)?;
    lm_loss(model, adapter, &model.decoder.embed(&p.input)?, hooks, &p)
}

/// A training row ready for the model: input ids `[1, n−1]` (laid out by `packing`), the
/// positions whose next token is a target, those targets and their loss weights.
pub(crate) struct Prepared {
    pub(crate) input: Tensor,
    packing: Option<Packing>,
    /// The target positions, on the host (`pos` on the device).
    pub(super) positions: Vec<u32>,
    pos: Tensor,
    tgt: Tensor,
    weights: Tensor,
}

pub(crate) fn prepare(model: &Model, example: &Example) -> Result<Prepared> {
    let dev = model.device();
    let n = example.tokens.len();
    if n < 2 {
        bail!("training example of {n} tokens");
    }
    let input = Tensor::new(&example.tokens[..n - 1], dev)?.unsqueeze(0)?;
    // Position i predicts token i + 1.
    let (pos, tgt): (Vec<u32>, Vec<u32>) =
        (0..n - 1).filter(|&i| example.target[i + 1]).map(|i| (i as u32, example.tokens[i + 1])).unzip();
    if pos.is_empty() {
        bail!("training example without target tokens");
    }
    // Each packed sequence's tokens weigh 1 / its target count: the mean of the sequences' means.
    let weights: Vec<f32> = match &example.packing {
        None => vec![1.0; pos.len()],
        Some(p) => {
            let seq = p.sequence();
            let mut count = vec![0usize; seq.iter().max().map_or(0, |&s| s as usize + 1)];
            pos.iter().for_each(|&i| count[seq[i as usize + 1] as usize] += 1);
            pos.iter().map(|&i| 1.0 / count[seq[i as usize + 1] as usize] as f32).collect()
        }
    };
    Ok(Prepared {
        input,
        packing: example.packing.as_ref().map(|p| p.truncated(n - 1)),
        pos: Tensor::new(pos.as_slice(), dev)?,
        positions: pos,
        tgt: Tensor::new(tgt.as_slice(), dev)?,
        weights: Tensor::new(weights.as_slice(), dev)?,
    })
}

/// The row's mean cross-entropy from input embeddings `[1, t, hidden]`.
fn lm_loss(
    model: &Model,
    adapter: &dyn Adapter,
    emb: &Tensor,
    hooks: &mut dyn ForwardHooks,
    p: &Prepared,
) -> Result<Tensor> {
    let hidden = model.decoder.forward_train_packed(emb, p.packing.as_ref(), Some(adapter), hooks)?;
    cross_entropy_at(model, &hidden, p)
}

/// The row's mean cross-entropy from final hidden states `[1, t, hidden]`.
fn cross_entropy_at(model: &Model, hidden: &Tensor, p: &Prepared) -> Result<Tensor> {
    loss_of_logits(&model.decoder.logits_train(&hidden.squeeze(0)?.index_select(&p.pos, 0)?)?, p)
}

/// The row's loss from the vocabulary logits `[targets, vocab]` at its target positions.
pub(super) fn loss_of_logits(logits: &Tensor, p: &Prepared) -> Result<Tensor> {
    Ok(ops::cross_entropy_masked(logits, &p.tgt, &p.weights)?)
}

/// `(L_lm + λ·L_flt, L_lm, L_flt)` of one example from embeddings `emb`; without a filter
/// example, `(L_lm, L_lm, None)`.
pub(crate) fn total_loss(
    model: &Model,
    adapter: &dyn Adapter,
    emb: &Tensor,
    p: &Prepared,
    filter: Option<(&FilterTraining, &FilterExample)>,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let Some((ft, fx)) = filter else {
        let lm = lm_loss(model, adapter, emb, &mut NoHooks, p)?;
        return Ok((lm.clone(), lm, None));
    };
    // Keep the layers the soft mask acts on differentiable even if the adapter starts higher.
    let adapter = FromLayer { inner: adapter, first: ft.filter.layer + 1 };
    let mut hooks = FilterHooks::new(ft.filter, &fx.chunks, model.config().num_layers);
    let lm = lm_loss(model, &adapter, emb, &mut hooks, p)?;
    if fx.chunks.is_empty() || ft.lambda == 0.0 {
        return Ok((lm.clone(), lm, None));
    }
    let flt = filter_loss(&hooks.scores()?, &fx.positive, ft.margin, &ft.filter.log_tau)?;
    Ok(((&lm + (&flt * ft.lambda)?)?, lm, Some(flt)))
}

/// The loss of one training example, `(L_lm + λ·L_flt, L_flt)`; `frozen`: the cache of the
/// frozen layers' streams and the example's key in it.
pub(crate) fn training_loss(
    model: &Model,
    adapter: &dyn Adapter,
    example: &Example,
    filter: Option<(&FilterTraining, &FilterExample)>,
    frozen: Option<(&mut FrozenCache, usize)>,
) -> Result<(Tensor, Option<Tensor>)> {
    let p = prepare(model, example)?;
    let emb = model.decoder.embed(&p.input)?;
    // A frozen filter (the prepared base's, under a document's adapter) neither learns nor adds a
    // loss: the layers below both the adapter and the filter's score layer are the same every
    // epoch, so their stream is cached as without a filter; the hooks run from there.
    let cacheable = filter.is_none_or(|(ft, _)| ft.is_frozen());
    if let (Some((frozen, key)), true) = (frozen, cacheable) {
        let packing = p.packing.as_ref();
        let mut first = model.decoder.first_trainable_layer(&emb, Some(adapter));
        let mut filter_hooks = None;
        if let Some((ft, fx)) = filter {
            first = first.min(ft.filter.layer);
            filter_hooks = Some(FilterHooks::new(ft.filter, &fx.chunks, model.config().num_layers));
        }
        let h = frozen.stream(model, key, &emb, first, packing)?;
        let hooks: &mut dyn ForwardHooks = match filter_hooks.as_mut() {
            Some(h) => h,
            None => &mut NoHooks,
        };
        let hidden = model.decoder.forward_train_from(&h, first, packing, Some(adapter), hooks)?;
        return Ok((cross_entropy_at(model, &hidden, &p)?, None));
    }
    let (total, _, flt) = total_loss(model, adapter, &emb, &p, filter)?;
    Ok((total, flt))
}
