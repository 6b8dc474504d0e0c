//! The LIFT trainer: two stages (segments only, then segments + auxiliary QA), AdamW with the
//! LIFT paper's settings (Table 9), gradient accumulation over small batches, global grad-norm
//! clipping, seeded shuffling, cancellation, progress reports and optional early stopping. With a
//! prepared base, its frozen FltLM filter masks the QA examples while the adapter trains.

use super::cdt::{self, CdtStats};
use super::filter::{filter_loss, Filter, FilterExample, FilterHooks, FromLayer};
use super::plan::{Example, Plan};
use crate::model::{ops, Adapter, ForwardHooks, Model, NoHooks, Packing};
use anyhow::{bail, Result};
use candle_core::{Tensor, Var};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use std::time::Instant;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct TrainOptions {
    /// Epochs over the segments alone (stage 1) and over segments + QA (stage 2).
    pub epochs: [usize; 2],
    pub lr: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub max_grad_norm: f64,
    /// Examples per optimizer step. The paper steps once per epoch (all examples accumulated);
    /// measured on this model that leaves the segment loss at 3.4, while per-example steps reach
    /// 0.44, so small batches are the default.
    pub accumulation: usize,
    /// Linear warm-up of the learning rate over this many optimizer steps.
    pub warmup_steps: usize,
    /// Stop when the epoch's mean loss has not improved by `min_delta` for `patience` epochs.
    pub early_stop: Option<EarlyStop>,
    /// Absorb until learned: stop when held-aside probe questions stop improving (the fixed
    /// schedule, `epochs`, is then the ceiling). None: the paper's fixed schedule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until_learned: Option<UntilLearned>,
    pub seed: u64,
}

/// Absorb until learned. A sample of the auxiliary QA pairs is held aside, never trained on (one
/// wording of a fact whose other wordings train); every [`UntilLearned::probe_interval`] optimizer
/// steps (`probe_rounds` rounds spread over the step budget, at least `probe_every` apart) the mean
/// loss of their answer tokens under the adapter (the document's facts recalled through questions
/// never trained on) is measured. Per-example steps make that curve noisy, so the rule reads its
/// moving average (`smoothing`: the newest probe's weight). Once the average has not improved by
/// `min_delta` (relative) for `patience` probes in a row — in the last stage only, never before
/// `min_steps` — the learning rate cools down linearly to zero over `cooldown` × the steps run so
/// far, and training stops (an adapter left at the full learning rate is caught mid-update: the
/// answers of one run stopped at once were wrong even in the window).
///
/// The steps have a ceiling, `max_share` of the fixed schedule's: if the probes have not
/// plateaued by then, the cool-down starts early enough to end there (`CooldownCause::Budget`).
/// The probe curve keeps falling slowly for the whole fixed schedule at a constant learning rate
/// while recall is made in its first part; the cool-down is what turns a run's steps into recall
/// (validation: 2/6 → 5/6 out of the window at similar steps), so a budget with a cool-down spends
/// a share of the steps on what the constant rate spends all of them.
///
/// Steps also go where the document is not yet known: a QA pair or segment whose loss at its last
/// visit was below `learned_loss` is skipped in the next epochs and revisited every
/// `revisit_every` epochs (to catch forgetting) — example-level selection by current loss, in the
/// spirit of the "impactful tokens" of LongRecipe: Recipe for Efficient Long Context
/// Generalization in Large Language Models (§4.1). `learned_loss` 0 (the default: on the
/// out-of-window fact test 0.05 lost recall, see the README) trains every example. The
/// epochs stay the ceiling: skipping shortens them, so a run may end, with every example learned,
/// before `min_steps` (which bounds the probe rule only).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct UntilLearned {
    /// The fewest optimizer steps between two probe rounds.
    pub probe_every: usize,
    /// Probe rounds over the step budget (the ceiling): a long document is probed as often
    /// relative to its budget as a short one, at a cost that does not grow with it (a round is
    /// `max_probes` forward passes, ~0.3 of a training step each).
    pub probe_rounds: usize,
    pub min_steps: usize,
    pub patience: usize,
    pub min_delta: f64,
    /// Weight of the newest probe in the moving average the rule reads (1: the raw probe loss).
    pub smoothing: f64,
    /// Steps of the linear cool-down after the plateau, as a share of the steps run so far (0:
    /// stop at once).
    pub cooldown: f64,
    /// The ceiling: the most steps a run takes, cool-down included, as a share of the fixed
    /// schedule's (1: the fixed schedule). Never below `min_steps`.
    pub max_share: f64,
    /// A schedule planned for the budget: from the first step of the last stage the learning rate
    /// falls linearly to zero at the ceiling, where the run ends; a plateau of the probes before
    /// then cools it down (from the rate it has reached) over `cooldown` × the steps so far.
    /// false (the default): the constant rate until the plateau or until the budget forces the
    /// cool-down. Chosen on a validation essay (5/6 out of the window vs 3/6), the decay lost on
    /// the eval documents and the out-of-window fact test (README), so it stays an option.
    pub decay: bool,
    /// Share of the QA pairs held aside as probes: at least 2, at most `max_probes`, and only when
    /// at least as many pairs are left to train on.
    pub probe_share: f64,
    pub max_probes: usize,
    /// Mean loss per answer (or segment) token under which an example counts as learned.
    pub learned_loss: f64,
    /// A learned example is trained again every this many epochs.
    pub revisit_every: usize,
}

impl Default for UntilLearned {
    fn default() -> Self {
        Self {
            probe_every: 16,
            probe_rounds: 16,
            min_steps: 48,
            patience: 3,
            min_delta: 0.02,
            smoothing: 0.5,
            cooldown: 0.25,
            max_share: 0.4,
            decay: false,
            probe_share: 0.15,
            max_probes: 8,
            learned_loss: 0.0,
            revisit_every: 3,
        }
    }
}

/// Which examples an epoch trains when absorbing until learned (see [`UntilLearned`]): each
/// segment's and QA pair's loss at its last visit, and the epoch of that visit.
struct Focus {
    learned_loss: f64,
    revisit_every: usize,
    segments: Vec<Visit>,
    qa: Vec<Visit>,
}

#[derive(Clone, Copy, Default)]
struct Visit {
    loss: Option<f64>,
    epoch: usize,
}

impl Focus {
    fn new(rule: Option<&UntilLearned>, n_seg: usize, n_qa: usize) -> Self {
        let (learned_loss, revisit_every) = rule.map_or((0.0, 1), |r| (r.learned_loss, r.revisit_every.max(1)));
        Self { learned_loss, revisit_every, segments: vec![Visit::default(); n_seg], qa: vec![Visit::default(); n_qa] }
    }

    /// Whether epoch `epoch` trains example `i`: never seen, not yet learned, or due for a revisit.
    fn wants(&self, is_qa: bool, i: usize, epoch: usize) -> bool {
        let v = if is_qa { self.qa[i] } else { self.segments[i] };
        match v.loss {
            None => true,
            Some(loss) => loss >= self.learned_loss || epoch >= v.epoch + self.revisit_every,
        }
    }

    fn book(&mut self, is_qa: bool, i: usize, loss: f64, epoch: usize) {
        let v = if is_qa { &mut self.qa[i] } else { &mut self.segments[i] };
        *v = Visit { loss: Some(loss), epoch };
    }
}

impl UntilLearned {
    /// The most steps a run of a fixed schedule of `planned` steps takes.
    pub fn ceiling(&self, planned: usize) -> usize {
        ((self.max_share.clamp(0.0, 1.0) * planned as f64).round() as usize).max(self.min_steps).min(planned)
    }

    /// Optimizer steps between probe rounds in a run of a fixed schedule of `planned` steps.
    pub fn probe_interval(&self, planned: usize) -> usize {
        self.probe_every.max(self.ceiling(planned).div_ceil(self.probe_rounds.max(1))).max(1)
    }

    /// How many of `pairs` QA pairs to hold aside (0: too few to spare any).
    pub fn probe_count(&self, pairs: usize) -> usize {
        let n = ((pairs as f64 * self.probe_share).round() as usize).clamp(2, self.max_probes.max(2));
        if pairs >= 2 * n {
            n
        } else {
            0
        }
    }
}

/// Held-aside examples never trained on (`UntilLearned`), in the layout the QA examples train in:
/// under the prepared base's frozen filter when there is one.
pub struct Probes<'a> {
    pub examples: &'a [Example],
    pub filter: Option<FilterTraining<'a>>,
}

impl Probes<'_> {
    /// Mean loss of the probes' answer tokens under `adapter` (forward only).
    fn loss(&self, model: &Model, adapter: &dyn Adapter) -> Result<f64> {
        let mut sum = 0.0;
        let mut stats = CdtStats::default();
        for (i, example) in self.examples.iter().enumerate() {
            let fx = self.filter.as_ref().map(|ft| (ft, &ft.examples[i]));
            let example = fx.map_or(example, |(_, fx)| &fx.example);
            let (loss, _) = training_loss(model, adapter, example, fx, None, &mut stats, None)?;
            sum += loss.to_scalar::<f32>()? as f64;
        }
        Ok(sum / self.examples.len().max(1) as f64)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EarlyStop {
    pub patience: usize,
    pub min_delta: f64,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            epochs: [3, 5],
            lr: 1e-3,
            weight_decay: 1e-4,
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-8,
            max_grad_norm: 1.0,
            accumulation: 1,
            warmup_steps: 0,
            early_stop: None,
            until_learned: None,
            seed: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Segments,
    SegmentsAndQa,
}

#[derive(Clone, Debug, Serialize)]
pub struct Progress {
    pub stage: Stage,
    /// 1-based epoch over both stages, of `epochs` in all.
    pub epoch: usize,
    pub epochs: usize,
    /// Optimizer steps done, of `steps` planned in all.
    pub step: usize,
    pub steps: usize,
    /// Mean loss of the last optimizer step.
    pub loss: f64,
    /// Training tokens (forward + backward) per second over the last step.
    pub tokens_per_s: f64,
    /// The latest probe loss (absorb until learned).
    pub probe_loss: Option<f64>,
    /// This step ended its epoch (the adapter is as the epoch left it: a snapshot point).
    pub epoch_end: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TrainReport {
    pub steps: usize,
    pub examples: usize,
    pub tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// Mean loss per epoch.
    pub epoch_losses: Vec<f64>,
    /// Loss of every optimizer step (for plots).
    pub step_losses: Vec<f64>,
    pub final_loss: f64,
    pub stopped_early: bool,
    /// Steps the fixed schedule plans (the ceiling when absorbing until learned).
    pub planned_steps: usize,
    /// `(step, probe loss)` at every probe (absorb until learned).
    pub probe_curve: Vec<(usize, f64)>,
    /// The step at which the probes plateaued and the learning rate began to cool down (absorb
    /// until learned).
    #[serde(default)]
    pub cooldown_from: Option<usize>,
    /// Why the cool-down began: the probes plateaued, or the step budget was reached.
    #[serde(default)]
    pub cooldown_cause: Option<CooldownCause>,
    /// Examples (segments and QA pairs) skipped as learned, summed over epochs (absorb until
    /// learned).
    pub skipped_examples: usize,
}

/// A FltLM filter in training: the filter, the QA examples in its layout (they replace
/// `plan.qa`), the loss weight λ and margin m. Trainable when the filter has `Var`s (the prepared
/// base's training); [`FilterTraining::frozen`] only lays out and masks (a document's absorb over
/// the prepared base).
pub struct FilterTraining<'a> {
    pub filter: &'a Filter,
    pub examples: &'a [FilterExample],
    pub lambda: f64,
    pub margin: f64,
    /// The filter's learning rate relative to the adapter's.
    pub lr_scale: f64,
}

impl<'a> FilterTraining<'a> {
    /// The prepared base's filter (a detached copy) over `examples`: masks, learns nothing, adds
    /// no loss.
    pub fn frozen(filter: &'a Filter, examples: &'a [FilterExample]) -> Self {
        Self { filter, examples, lambda: 0.0, margin: 0.0, lr_scale: 0.0 }
    }

    /// Masks only: no parameters to train and no loss.
    pub fn is_frozen(&self) -> bool {
        self.filter.vars().is_empty() && self.lambda == 0.0
    }
}

#[derive(Clone, Debug, Default)]
pub struct QaPositions {
    pub context: Vec<usize>,
    pub evidence: Vec<usize>,
}

/// Memory for cached frozen-layer streams of QA examples (~400 KB per 180-token example here).
const FROZEN_CACHE_BYTES: usize = 256 << 20;

/// The residual streams entering the first trainable layer of examples that are the same tokens
/// every epoch (the QA examples): the frozen layers below the adapter run once per example
/// instead of once per epoch. Bounded in bytes; past the budget examples are recomputed.
pub(crate) struct FrozenCache {
    entries: std::collections::HashMap<usize, Tensor>,
    bytes: usize,
    budget: usize,
}

impl FrozenCache {
    fn new(budget: usize) -> Self {
        Self { entries: Default::default(), bytes: 0, budget }
    }

    /// The stream entering layer `first` for example `key` with embeddings `emb`.
    fn stream(
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

/// AdamW on f32 `Var`s (decoupled weight decay, bias-corrected moments).
pub struct AdamW {
    vars: Vec<Var>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    t: usize,
    opts: TrainOptions,
}

impl AdamW {
    pub fn new(vars: Vec<Var>, opts: &TrainOptions) -> Result<Self> {
        let m = vars.iter().map(|v| v.zeros_like()).collect::<candle_core::Result<Vec<_>>>()?;
        let v = vars.iter().map(|v| v.zeros_like()).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { vars, m, v, t: 0, opts: opts.clone() })
    }

    /// The moments and the step count, to checkpoint.
    pub fn state(&self) -> (&[Tensor], &[Tensor], usize) {
        (&self.m, &self.v, self.t)
    }

    /// Restores [`Self::state`] (same variables, same order).
    pub fn restore(&mut self, m: Vec<Tensor>, v: Vec<Tensor>, t: usize) -> Result<()> {
        anyhow::ensure!(m.len() == self.vars.len() && v.len() == self.vars.len(), "optimizer state of another shape");
        for (i, var) in self.vars.iter().enumerate() {
            anyhow::ensure!(m[i].dims() == var.dims() && v[i].dims() == var.dims(), "optimizer state of another shape");
        }
        (self.m, self.v, self.t) = (m, v, t);
        Ok(())
    }

    /// [`clip`] the gradients to global norm `max_norm` (≤ 0: no clipping), then [`Self::step`].
    /// On CUDA both in two kernel launches (kernels/adamw.cu) where the variables are f32.
    pub fn clip_and_step(&mut self, grads: Vec<Tensor>, max_norm: f64, lr: f64) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.vars.first().is_some_and(|v| v.device().is_cuda()) && self.vars.iter().all(|v| v.dtype() == candle_core::DType::F32) {
            return self.cuda_step(&grads, max_norm, lr);
        }
        self.step(&clip(grads, max_norm)?, lr)
    }

    #[cfg(feature = "cuda")]
    fn cuda_step(&mut self, grads: &[Tensor], max_norm: f64, lr: f64) -> Result<()> {
        self.t += 1;
        let o = &self.opts;
        let scalars = crate::kernels::cuda::AdamWScalars {
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            eps: o.eps as f32,
            lr: lr as f32,
            decay: (1.0 - lr * o.weight_decay) as f32,
            bc1: (1.0 - o.beta1.powi(self.t as i32)) as f32,
            bc2: (1.0 - o.beta2.powi(self.t as i32)) as f32,
            max_norm: max_norm as f32,
        };
        let grads = grads.iter().map(|g| g.detach().contiguous()).collect::<candle_core::Result<Vec<_>>>()?;
        let params: Vec<&Tensor> = self.vars.iter().map(|v| v.as_tensor()).collect();
        crate::kernels::cuda::adamw_step(&params, &grads, &self.m, &self.v, scalars, max_norm > 0.0)?;
        Ok(())
    }

    /// One update with `grads[i]` for `vars[i]` at learning rate `lr`.
    pub fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        self.t += 1;
        let o = &self.opts;
        let bc1 = 1.0 - o.beta1.powi(self.t as i32);
        let bc2 = 1.0 - o.beta2.powi(self.t as i32);
        for i in 0..self.vars.len() {
            // Gradients of a product with a `Var` carry an autograd graph back to that step's
            // activations; optimizer state built from them would chain every step's graph.
            let g = &grads[i].detach();
            let m = ((&self.m[i] * o.beta1)? + (g * (1.0 - o.beta1))?)?;
            let v = ((&self.v[i] * o.beta2)? + (g.sqr()? * (1.0 - o.beta2))?)?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + o.eps)?)?;
            let var = &self.vars[i];
            let decayed = (var.as_tensor().detach() * (1.0 - lr * o.weight_decay))?;
            var.set(&(decayed - (update * lr)?)?)?;
            self.m[i] = m.detach();
            self.v[i] = v.detach();
        }
        Ok(())
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
struct Prepared {
    input: Tensor,
    packing: Option<Packing>,
    pos: Tensor,
    tgt: Tensor,
    weights: Tensor,
}

fn prepare(model: &Model, example: &Example) -> Result<Prepared> {
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
    let logits = model.decoder.logits_train(&hidden.squeeze(0)?.index_select(&p.pos, 0)?)?;
    Ok(ops::cross_entropy_masked(&logits, &p.tgt, &p.weights)?)
}

/// `(L_lm + λ·L_flt, L_lm, L_flt)` of one example from embeddings `emb`; without a filter
/// example, `(L_lm, L_lm, None)`.
fn total_loss(
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

/// The loss of one training example: with CDT (`cdt`: the target relative move and the prompt
/// positions of the document), pass 1 (embedding gradients of the LM loss), critical tokens,
/// denoised document embeddings, then the loss on them (pass 2).
pub(crate) fn training_loss(
    model: &Model,
    adapter: &dyn Adapter,
    example: &Example,
    filter: Option<(&FilterTraining, &FilterExample)>,
    cdt: Option<(f64, &QaPositions)>,
    stats: &mut CdtStats,
    frozen: Option<(&mut FrozenCache, usize)>,
) -> Result<(Tensor, Option<Tensor>)> {
    let p = prepare(model, example)?;
    let emb = model.decoder.embed(&p.input)?;
    // A frozen filter (the prepared base's, under a document's adapter) neither learns nor adds a
    // loss: the layers below both the adapter and the filter's score layer are the same every
    // epoch, so their stream is cached as without a filter; the hooks run from there.
    let cacheable = cdt.is_none() && filter.is_none_or(|(ft, _)| ft.is_frozen());
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
    let Some((target, positions)) = cdt else {
        let (total, _, flt) = total_loss(model, adapter, &emb, &p, filter)?;
        return Ok((total, flt));
    };
    let v = Var::from_tensor(&emb)?;
    let (_, pass1, _) = total_loss(model, adapter, v.as_tensor(), &p, filter)?;
    let grads = pass1.backward()?;
    let e = emb.squeeze(0)?;
    let g = match grads.get(v.as_tensor()) {
        Some(g) => g.detach().squeeze(0)?,
        None => e.zeros_like()?,
    };
    let d = cdt::denoise_document(&e, &g, &positions.context, target)?;
    let (total, pass2, flt) = total_loss(model, adapter, &d.emb.unsqueeze(0)?, &p, filter)?;
    stats.add(&d, Some(positions), pass1.to_scalar::<f32>()? as f64, pass2.to_scalar::<f32>()? as f64);
    Ok((total, flt))
}

/// What a LIFT run trains: `adapter` (its parameters `vars`) on the document `doc` as `plan` lays
/// it out.
#[derive(Clone, Copy)]
pub struct TrainInputs<'a> {
    pub doc: &'a [u32],
    pub plan: &'a Plan,
    pub adapter: &'a dyn Adapter,
    pub vars: &'a [Var],
}

/// How a caller follows and stops a training run: `on_progress` after every optimizer step,
/// `cancel` polled before each.
pub struct RunControl<'a, P> {
    pub on_progress: &'a mut dyn FnMut(&P),
    pub cancel: &'a dyn Fn() -> bool,
}

/// Trains `inputs.vars` (the parameters behind `inputs.adapter`) on `inputs.plan`: plain LIFT.
pub fn train(
    model: &Model,
    inputs: TrainInputs,
    opts: &TrainOptions,
    control: RunControl<Progress>,
) -> Result<TrainReport> {
    train_with(model, inputs, opts, None, None, control)
}

/// Trains `inputs.vars` (the parameters behind `inputs.adapter`) on `inputs.plan`, the QA examples
/// in `filter`'s layout and under its mask when there is one. A trainable filter's parameters are
/// trained beside the adapter's with their own optimizer, learning rate (× `lr_scale`) and
/// clipping (their gradients would otherwise dominate the global norm and shrink the adapter's
/// updates). With `opts.until_learned` and `probes`, the run stops once the probes are learned.
pub fn train_with(
    model: &Model,
    inputs: TrainInputs,
    opts: &TrainOptions,
    filter: Option<&FilterTraining>,
    probes: Option<&Probes>,
    control: RunControl<Progress>,
) -> Result<TrainReport> {
    let RunControl { on_progress, cancel } = control;
    if let Some(ft) = filter {
        anyhow::ensure!(ft.examples.len() == inputs.plan.qa.len(), "one filter example per QA example");
    }
    let filter_vars: &[Var] = filter.map_or(&[], |f| f.filter.vars());
    let mut optimizers = Optimizers::new(inputs.vars, filter_vars, filter.map_or(1.0, |f| f.lr_scale), opts)?;
    let mut run = LiftRun {
        model,
        inputs,
        filter,
        vars: inputs.vars.iter().chain(filter_vars).cloned().collect(),
        frozen: FrozenCache::new(FROZEN_CACHE_BYTES),
        no_cdt: CdtStats::default(),
        rng: Plan::rng(opts.seed),
    };
    let rows = EpochRows::of(inputs.plan, opts);
    let (epochs_total, steps_total) = (opts.epochs[0] + opts.epochs[1], rows.steps_total(opts));
    let mut report = TrainReport { planned_steps: steps_total, ..Default::default() };
    let start = Instant::now();
    let mut patience = Patience { best: f64::INFINITY, since_best: 0 };
    let until_learned = opts.until_learned.as_ref().zip(probes.filter(|p| !p.examples.is_empty()));
    // The rule's step budget and probe spacing, fixed by the planned schedule.
    let (ceiling, probe_interval) =
        until_learned.map_or((steps_total, 1), |(r, _)| (r.ceiling(steps_total), r.probe_interval(steps_total)));
    let mut focus = Focus::new(opts.until_learned.as_ref(), rows.n_seg, rows.n_qa);
    let mut probed = Patience { best: f64::INFINITY, since_best: 0 };
    let mut probe_loss = None;
    let (mut probe_avg, mut cooldown): (Option<f64>, Option<Cooldown>) = (None, None);
    // `UntilLearned::decay`: the budget's planned fall of the learning rate, beside `cooldown`.
    let mut decay: Option<Cooldown> = None;
    let final_stage = if opts.epochs[1] > 0 { Stage::SegmentsAndQa } else { Stage::Segments };
    let mut epoch = 0;
    'stages: for (stage, epochs) in [(Stage::Segments, opts.epochs[0]), (Stage::SegmentsAndQa, opts.epochs[1])] {
        for _ in 0..epochs {
            epoch += 1;
            let (seg_members, order, skipped) = rows.draw(stage, &mut run.rng, |is_qa, i| focus.wants(is_qa, i, epoch));
            report.skipped_examples += skipped;
            let mut epoch_loss = 0.0;
            let epoch_start = report.examples;
            let batches = order.len().div_ceil(rows.accumulation.max(1));
            for (bi, batch) in order.chunks(rows.accumulation).enumerate() {
                if cancel() {
                    return Err(super::Cancelled("training").into());
                }
                let t0 = Instant::now();
                let b = run.batch(batch, &seg_members)?;
                for (&(is_qa, i), &loss) in batch.iter().zip(&b.losses) {
                    let members = if is_qa { std::slice::from_ref(&i) } else { &seg_members[i][..] };
                    for &m in members {
                        focus.book(is_qa, m, loss, epoch);
                    }
                }
                let lr_scale = [cooldown, decay].iter().flatten().map(|c| c.lr_scale(report.steps)).product();
                optimizers.step(b.grads, opts, report.steps, lr_scale)?;
                report.steps += 1;
                report.examples += batch.len();
                report.tokens += b.tokens;
                report.step_losses.push(b.loss);
                epoch_loss += b.loss * batch.len() as f64;
                let secs = t0.elapsed().as_secs_f64();
                let mut plateau = false;
                if let Some((rule, probes)) = until_learned.filter(|_| report.steps % probe_interval == 0) {
                    let loss = probes.loss(model, inputs.adapter)?;
                    report.probe_curve.push((report.steps, loss));
                    let avg = probe_avg.map_or(loss, |a| a + rule.smoothing.clamp(0.0, 1.0) * (loss - a));
                    probe_avg = Some(avg);
                    tracing::info!(
                        step = report.steps,
                        planned = steps_total,
                        epoch,
                        probe_loss = loss,
                        probe_avg = avg,
                        train_loss = b.loss,
                        "probe"
                    );
                    probe_loss = Some(loss);
                    let rule_as_patience =
                        EarlyStop { patience: rule.patience, min_delta: rule.min_delta * probed.best.min(avg) };
                    // Only in the last stage, and counted from its start: the probes are
                    // questions, which the QA stage teaches to answer; a plateau over segments
                    // alone says nothing about that (counted through the first stage, a long one
                    // stopped a 2K document at the QA stage's first probe).
                    plateau = stage == final_stage
                        && probed.exhausted(Some(&rule_as_patience), avg)
                        && report.steps >= rule.min_steps;
                }
                // The budget too only in the last stage: a run cut inside the first would never
                // see a question.
                if let Some((rule, _)) = until_learned.filter(|_| stage == final_stage) {
                    if rule.decay && decay.is_none() {
                        let d = Cooldown { start: report.steps, steps: ceiling.saturating_sub(report.steps) };
                        tracing::info!(
                            step = report.steps,
                            decay_steps = d.steps,
                            ceiling,
                            "the learning rate decays to the budget"
                        );
                        decay = Some(d);
                        report.cooldown_from = Some(report.steps);
                        report.cooldown_cause = Some(CooldownCause::Budget);
                    }
                    let begun =
                        cooldown.is_none().then(|| Cooldown::begin(rule, report.steps, plateau, ceiling)).flatten();
                    // With the decay the budget is already planned: only a plateau begins a cool-down.
                    if let Some((c, cause)) = begun.filter(|(_, cause)| !rule.decay || *cause == CooldownCause::Plateau)
                    {
                        tracing::info!(step = report.steps, cooldown_steps = c.steps, ?cause, ceiling, "cooling down");
                        cooldown = Some(c);
                        report.cooldown_from = Some(report.steps);
                        report.cooldown_cause = Some(cause);
                    }
                }
                let learned = [cooldown, decay].iter().flatten().any(|c| report.steps >= c.start + c.steps);
                on_progress(&Progress {
                    stage,
                    epoch,
                    epochs: epochs_total,
                    step: report.steps,
                    steps: steps_total,
                    loss: b.loss,
                    tokens_per_s: b.tokens as f64 / secs.max(1e-9),
                    probe_loss,
                    epoch_end: bi + 1 == batches || learned,
                });
                if learned {
                    tracing::info!(step = report.steps, planned = steps_total, probe_loss, cause = ?report.cooldown_cause, "training stops: the cool-down is over");
                    report.epoch_losses.push(epoch_loss / (report.examples - epoch_start).max(1) as f64);
                    report.stopped_early = true;
                    break 'stages;
                }
            }
            if order.is_empty() {
                // Every example was learned and none is due for a revisit: nothing trained, no loss.
                tracing::debug!(epoch, ?stage, "epoch skipped: every example is learned");
                continue;
            }
            let mean = epoch_loss / order.len() as f64;
            report.epoch_losses.push(mean);
            tracing::debug!(epoch, ?stage, loss = mean, skipped, "epoch done");
            if patience.exhausted(opts.early_stop.as_ref(), mean) {
                report.stopped_early = true;
                break 'stages;
            }
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    report.tokens_per_s = report.tokens as f64 / report.seconds.max(1e-9);
    report.final_loss = report.epoch_losses.last().copied().unwrap_or(f64::NAN);
    Ok(report)
}

/// How a run's epochs are laid out: segments packed `segment_pack` to a CT row, QA examples
/// one each, `accumulation` rows per optimizer step.
struct EpochRows {
    n_seg: usize,
    segment_pack: usize,
    seg_rows: usize,
    n_qa: usize,
    accumulation: usize,
}

impl EpochRows {
    fn of(plan: &Plan, opts: &TrainOptions) -> Self {
        let n_seg = plan.segments.len();
        let segment_pack = plan.options().segment_pack.max(1);
        let seg_rows = n_seg.div_ceil(segment_pack);
        Self { n_seg, segment_pack, seg_rows, n_qa: plan.qa.len(), accumulation: opts.accumulation.max(1) }
    }

    /// Optimizer steps over both stages.
    fn steps_total(&self, opts: &TrainOptions) -> usize {
        let a = self.accumulation;
        opts.epochs[0] * self.seg_rows.div_ceil(a) + opts.epochs[1] * (self.seg_rows + self.n_qa).div_ceil(a)
    }

    /// One epoch's draw of the examples `wants(is_qa, index)` keeps: which segments share each CT
    /// row, the shuffled order of the rows (`(false, row)`) and, in stage 2, the QA examples
    /// (`(true, i)`), and how many examples were left out. Keeping all draws what the fixed
    /// schedule always drew (same rows, same order).
    fn draw(
        &self,
        stage: Stage,
        rng: &mut StdRng,
        wants: impl Fn(bool, usize) -> bool,
    ) -> (Vec<Vec<usize>>, Vec<(bool, usize)>, usize) {
        let live: Vec<usize> = (0..self.n_seg).filter(|&i| wants(false, i)).collect();
        let mut skipped = self.n_seg - live.len();
        let seg_members: Vec<Vec<usize>> = if self.segment_pack == 1 {
            live.into_iter().map(|i| vec![i]).collect()
        } else {
            let mut perm = live;
            perm.shuffle(rng);
            perm.chunks(self.segment_pack).map(<[usize]>::to_vec).collect()
        };
        let mut order: Vec<(bool, usize)> = (0..seg_members.len()).map(|i| (false, i)).collect();
        if stage == Stage::SegmentsAndQa {
            let qa: Vec<(bool, usize)> = (0..self.n_qa).filter(|&i| wants(true, i)).map(|i| (true, i)).collect();
            skipped += self.n_qa - qa.len();
            order.extend(qa);
        }
        order.shuffle(rng);
        (seg_members, order, skipped)
    }
}

/// What a `train_with` run's batches draw on: the model and inputs, every trained parameter
/// (the adapter's, then a trainable filter's), the frozen-layer cache and the seeded stream.
struct LiftRun<'a> {
    model: &'a Model,
    inputs: TrainInputs<'a>,
    filter: Option<&'a FilterTraining<'a>>,
    vars: Vec<Var>,
    frozen: FrozenCache,
    no_cdt: CdtStats,
    rng: StdRng,
}

/// One batch: its gradients summed (in `LiftRun::vars` order), mean loss, each example's loss
/// and the tokens.
struct Batch {
    grads: Vec<Tensor>,
    loss: f64,
    losses: Vec<f64>,
    tokens: usize,
}

impl LiftRun<'_> {
    /// The losses and gradients of the examples of `batch` (`(is_qa, index)`; segment rows made
    /// of `seg_members[index]`), each weighted 1 / batch size.
    fn batch(&mut self, batch: &[(bool, usize)], seg_members: &[Vec<usize>]) -> Result<Batch> {
        let TrainInputs { doc, plan, adapter, .. } = self.inputs;
        let model = self.model;
        let mut sum: Option<Vec<Tensor>> = None;
        let mut batch_loss = 0.0;
        let mut losses = Vec::with_capacity(batch.len());
        let mut batch_tokens = 0;
        for &(is_qa, i) in batch {
            let fx = self.filter.filter(|_| is_qa).map(|ft| (ft, &ft.examples[i]));
            let example = match (fx, is_qa) {
                (Some((_, fx)), _) => fx.example.clone(),
                (None, true) => plan.qa[i].clone(),
                (None, false) => plan.segments_example(model, doc, &seg_members[i], &mut self.rng)?,
            };
            // QA examples are the same tokens every epoch; segments get a new context each time.
            let cached = is_qa.then_some((&mut self.frozen, i));
            let (loss, _) = training_loss(model, adapter, &example, fx, None, &mut self.no_cdt, cached)?;
            let g = gradients(&(loss.clone() / batch.len() as f64)?, &self.vars)?;
            sum = Some(match sum {
                None => g,
                Some(acc) => acc.iter().zip(&g).map(|(a, b)| a + b).collect::<candle_core::Result<_>>()?,
            });
            let loss = loss.to_scalar::<f32>()? as f64;
            losses.push(loss);
            batch_loss += loss / batch.len() as f64;
            batch_tokens += example.tokens.len();
        }
        Ok(Batch { grads: sum.unwrap_or_default(), loss: batch_loss, losses, tokens: batch_tokens })
    }
}

/// The adapter's optimizer and a trainable filter's, each clipped on its own.
struct Optimizers {
    adapter: AdamW,
    filter: AdamW,
    n_adapter_vars: usize,
    filter_lr_scale: f64,
}

impl Optimizers {
    fn new(adapter_vars: &[Var], filter_vars: &[Var], filter_lr_scale: f64, opts: &TrainOptions) -> Result<Self> {
        Ok(Self {
            adapter: AdamW::new(adapter_vars.to_vec(), opts)?,
            filter: AdamW::new(filter_vars.to_vec(), opts)?,
            n_adapter_vars: adapter_vars.len(),
            filter_lr_scale,
        })
    }

    /// Optimizer step `step` with `grads` (the adapter's, then the filter's), the learning rate
    /// scaled by `lr_scale`.
    fn step(&mut self, mut grads: Vec<Tensor>, opts: &TrainOptions, step: usize, lr_scale: f64) -> Result<()> {
        let filter_grads = grads.split_off(self.n_adapter_vars.min(grads.len()));
        let lr = current_lr(opts, step) * lr_scale;
        self.adapter.clip_and_step(grads, opts.max_grad_norm, lr)?;
        if !filter_grads.is_empty() {
            self.filter.clip_and_step(filter_grads, opts.max_grad_norm, lr * self.filter_lr_scale)?;
        }
        Ok(())
    }
}

/// Why an absorb until learned began its cool-down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CooldownCause {
    /// The probes' moving average stopped improving.
    Plateau,
    /// The step budget (`max_share` of the fixed schedule) would otherwise be passed.
    Budget,
}

/// The cool-down after the probes plateaued: `steps` optimizer steps from step `start`.
#[derive(Clone, Copy)]
struct Cooldown {
    start: usize,
    steps: usize,
}

impl Cooldown {
    /// The cool-down to begin after `step` optimizer steps, if one begins: on a plateau, over
    /// `rule.cooldown` × the steps so far; without one, once that cool-down would end past the
    /// ceiling. Either ends by the ceiling.
    fn begin(rule: &UntilLearned, step: usize, plateau: bool, ceiling: usize) -> Option<(Self, CooldownCause)> {
        let wanted = (step as f64 * rule.cooldown.max(0.0)).round() as usize;
        let left = ceiling.saturating_sub(step);
        let cause = if plateau {
            CooldownCause::Plateau
        } else if step + wanted >= ceiling {
            CooldownCause::Budget
        } else {
            return None;
        };
        Some((Self { start: step, steps: wanted.min(left) }, cause))
    }

    /// The learning rate's factor at 0-based optimizer step `step`: linear from just below 1 to
    /// just above 0 over the cool-down.
    fn lr_scale(self, step: usize) -> f64 {
        let left = (self.start + self.steps).saturating_sub(step);
        left as f64 / (self.steps + 1) as f64
    }
}

/// Early stopping's count: the best epoch mean so far and the epochs since it.
struct Patience {
    best: f64,
    since_best: usize,
}

impl Patience {
    /// Books an epoch of mean loss `mean`; true when `early_stop` (if any) says to stop.
    fn exhausted(&mut self, early_stop: Option<&EarlyStop>, mean: f64) -> bool {
        let Some(es) = early_stop else { return false };
        if mean < self.best - es.min_delta {
            self.best = mean;
            self.since_best = 0;
            false
        } else {
            self.since_best += 1;
            self.since_best >= es.patience
        }
    }
}

/// The gradient of `loss` for each of `vars` (zeros where it does not depend on one), detached.
pub(crate) fn gradients(loss: &Tensor, vars: &[Var]) -> Result<Vec<Tensor>> {
    let grads = loss.backward()?;
    Ok(vars
        .iter()
        .map(|v| match grads.get(v.as_tensor()) {
            Some(g) => Ok(g.detach()),
            None => v.zeros_like(),
        })
        .collect::<candle_core::Result<_>>()?)
}

/// The learning rate of optimizer step `step` (linear warm-up, then constant).
fn current_lr(opts: &TrainOptions, step: usize) -> f64 {
    if opts.warmup_steps > 0 && step < opts.warmup_steps {
        opts.lr * (step + 1) as f64 / opts.warmup_steps as f64
    } else {
        opts.lr
    }
}

/// Scales gradients so their global L2 norm is at most `max_norm`.
pub(crate) fn clip(grads: Vec<Tensor>, max_norm: f64) -> Result<Vec<Tensor>> {
    if max_norm <= 0.0 || grads.is_empty() {
        return Ok(grads);
    }
    let mut sq = 0f64;
    for g in &grads {
        sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    let norm = sq.sqrt();
    if norm <= max_norm || !norm.is_finite() {
        return Ok(grads);
    }
    let s = max_norm / (norm + 1e-6);
    Ok(grads.iter().map(|g| g * s).collect::<candle_core::Result<_>>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adamw_matches_hand_computed_update() {
        // One step on f(x) = x² from x = 1: grad 2, m̂ = 2, v̂ = 4, update = 1 (bias-corrected).
        let x = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        let opts = TrainOptions { weight_decay: 0.1, ..Default::default() };
        let mut opt = AdamW::new(vec![x.clone()], &opts).unwrap();
        let g = Tensor::new(&[2.0f32], &Device::Cpu).unwrap();
        opt.step(&[g], 0.01).unwrap();
        let got = x.as_tensor().to_vec1::<f32>().unwrap()[0];
        let want = 1.0 * (1.0 - 0.01 * 0.1) - 0.01 * 2.0 / (4f32.sqrt() + 1e-8);
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }

    #[test]
    fn a_frozen_filter_gives_the_same_loss_and_gradients_over_cached_frozen_layers() {
        use crate::adapters::GatedMemory;
        use crate::lift::filter::{qa_examples, FilterOptions};
        use crate::lift::qa::{QaPair, QaSource};
        let dir = tempfile::tempdir().unwrap();
        let spec = crate::testing::TinySpec { layers: 4, ..Default::default() };
        let path = crate::testing::write_hf(&dir.path().join("tiny"), &spec).unwrap();
        let mut model = Model::load(&path, &Device::Cpu).unwrap();
        // The cached layers run the f32 inference kernels: compare with the f32 trainable path.
        model.decoder.cpu_float_dtype = candle_core::DType::F32;
        let opts = FilterOptions { enabled: true, layer: Some(1), chunk_tokens: 24, ..Default::default() };
        let shape = crate::base::BaseShape { rank: 2, filter: opts };
        let mut base = crate::base::PreparedBase::new(&model, &shape, 3).unwrap();
        // A scoring head and a mask that acts (this head scores every chunk about 4.5).
        let mut f = base.filter.detached();
        let h = model.config().hidden_size;
        f.head_w = Tensor::from_vec(crate::testing::Rng::new(5).vec(h, 1.0), h, &Device::Cpu).unwrap();
        f.b = Tensor::new(&[-3.0f32], &Device::Cpu).unwrap();
        base.filter = f;
        base.save(&dir.path().join("base")).unwrap();
        base.install(&mut model).unwrap();
        let text = "The ferry leaves at dawn. The keeper is Anselm Varga. Tickets cost eleven coins. \
                    The captain is Ilse Moreau. Gulls nest on the island all summer long.";
        let evidence = "The keeper is Anselm Varga.";
        let at = text.find(evidence).unwrap();
        let pair = QaPair {
            question: "Who is the keeper?".into(),
            answer: "Anselm Varga".into(),
            evidence: evidence.into(),
            evidence_span: (at, at + evidence.len()),
            source: QaSource::Extractive,
        };
        let document = crate::document::Document::encode(&model, text).unwrap();
        let filter = model.base_filter().unwrap();
        let examples = qa_examples(&model, &document, &[pair], 1000, filter).unwrap();
        assert!(examples[0].chunks.len() >= 2);
        let ft = FilterTraining::frozen(filter, &examples);
        let gm = GatedMemory::new(model.config(), &[2, 3], false, 1, &Device::Cpu).unwrap();
        let ex = &examples[0].example;
        let mut stats = CdtStats::default();
        let (plain, _) = training_loss(&model, &gm, ex, Some((&ft, &examples[0])), None, &mut stats, None).unwrap();
        let g_plain = gradients(&plain, gm.vars()).unwrap();
        let mut cache = FrozenCache::new(1 << 30);
        for round in 0..2 {
            // Round 0 fills the cache (the stream entering layer 1, the score layer), round 1 reads it.
            let key = Some((&mut cache, 0));
            let (cached, _) = training_loss(&model, &gm, ex, Some((&ft, &examples[0])), None, &mut stats, key).unwrap();
            let d = (cached.to_scalar::<f32>().unwrap() - plain.to_scalar::<f32>().unwrap()).abs();
            assert!(d < 1e-4, "round {round}: loss differs by {d}");
            for (a, b) in gradients(&cached, gm.vars()).unwrap().iter().zip(&g_plain) {
                let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(d < 1e-4, "round {round}: gradient differs by {d}");
            }
        }
        assert!(cache.bytes > 0, "the stream below the filter was cached");
        // The mask acts: without the filter the same tokens have another loss.
        let (unmasked, _) = training_loss(&model, &gm, ex, None, None, &mut stats, None).unwrap();
        let d = (unmasked.to_scalar::<f32>().unwrap() - plain.to_scalar::<f32>().unwrap()).abs();
        assert!(d > 1e-4, "the soft mask changed nothing ({d})");
    }

    #[test]
    fn the_cooldown_takes_the_learning_rate_linearly_towards_zero() {
        let c = Cooldown { start: 100, steps: 3 };
        let scales: Vec<f64> = (100..104).map(|s| c.lr_scale(s)).collect();
        assert_eq!(scales, vec![0.75, 0.5, 0.25, 0.0]);
    }

    #[test]
    fn the_budget_bounds_the_run_and_spreads_the_probe_rounds() {
        let rule = UntilLearned::default();
        // 40% of 1,000 planned steps; the floor wins over a small budget, the plan over the floor.
        assert_eq!(rule.ceiling(1000), 400);
        assert_eq!(rule.ceiling(100), rule.min_steps);
        assert_eq!(rule.ceiling(30), 30);
        // 16 rounds over the budget, never closer than `probe_every`.
        assert_eq!(rule.probe_interval(1000), 25);
        assert_eq!(rule.probe_interval(300), rule.probe_every);
        // Without a plateau the cool-down (25% of the steps so far) begins when it would end at
        // the ceiling: at 320 of 400 (320 + 80), not at 319 (319 + 80 < 400); a plateau at 100
        // cools down over 25 steps; one at 390 has 10 left.
        assert!(Cooldown::begin(&rule, 319, false, 400).is_none());
        let (c, cause) = Cooldown::begin(&rule, 320, false, 400).unwrap();
        assert_eq!((c.start, c.steps, cause), (320, 80, CooldownCause::Budget));
        let (c, cause) = Cooldown::begin(&rule, 100, true, 400).unwrap();
        assert_eq!((c.start, c.steps, cause), (100, 25, CooldownCause::Plateau));
        let (c, _) = Cooldown::begin(&rule, 390, true, 400).unwrap();
        assert_eq!(c.start + c.steps, 400);
    }

    #[test]
    fn clipping_bounds_the_global_norm() {
        let a = Tensor::new(&[3.0f32, 0.0], &Device::Cpu).unwrap();
        let b = Tensor::new(&[4.0f32], &Device::Cpu).unwrap();
        let c = clip(vec![a, b], 1.0).unwrap();
        let n: f32 = c.iter().map(|t| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap()).sum();
        assert!((n.sqrt() - 1.0).abs() < 1e-4);
        let small = clip(vec![Tensor::new(&[0.1f32], &Device::Cpu).unwrap()], 1.0).unwrap();
        assert_eq!(small[0].to_vec1::<f32>().unwrap(), vec![0.1]);
    }
}
