//! The LIFT trainer: two stages (segments only, then segments + auxiliary QA), AdamW with the
//! LIFT paper's settings (Table 9), gradient accumulation over small batches, global grad-norm
//! clipping, seeded shuffling, cancellation, progress reports and optional early stopping. With a
//! prepared base, its frozen FltLM filter masks the QA examples while the adapter trains.
//!
//! This file is the training loop (`train_with`) and the losses it trains on; the optimizers are in
//! `optim`, the until-learned rule (probes, plateau, cool-down) in `until_learned`.

mod optim;
mod rows;
mod until_learned;

use super::cdt::{self, CdtStats};
use super::distill::{soft_loss, DistillOptions, TeacherCache};
use super::filter::{filter_loss, Filter, FilterExample, FilterHooks, FromLayer};
use super::plan::{Example, Plan};
use crate::model::{ops, Adapter, ForwardHooks, Model, NoHooks, Packing};
use anyhow::{bail, Result};
use candle_core::{Tensor, Var};
use super::plan::PlanRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use std::time::Instant;

pub use optim::AdamW;
pub use until_learned::{CooldownCause, FocusState, Probes, UntilLearned, UntilLearnedState};
use optim::Optimizers;
use until_learned::{Focus, UntilLearnedRun};

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
    /// The rows of an optimizer step run as batched forwards/backwards (`rows`) when they can (no
    /// packing, no trainable filter), grouped by length so that each group's padding stays within
    /// this share of its tokens; None (the default): one by one. The same gradients either way.
    /// Off by default because the 2-core CPU gains nothing from it (its gemms are as efficient at
    /// one row as at four, docs/absorb-speed.md "Batched rows"); a GPU step is bound by launches.
    /// Left out of the JSON (and so of document ids) when off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_rows: Option<f64>,
    /// Linear warm-up of the learning rate over this many optimizer steps.
    pub warmup_steps: usize,
    /// Stop when the epoch's mean loss has not improved by `min_delta` for `patience` epochs.
    pub early_stop: Option<EarlyStop>,
    /// Absorb until learned: stop when held-aside probe questions stop improving (the fixed
    /// schedule, `epochs`, is then the ceiling). None: the paper's fixed schedule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until_learned: Option<UntilLearned>,
    /// Context distillation of the QA examples (`lift::distill`); None: their answer tokens alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distill: Option<DistillOptions>,
    pub seed: u64,
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
            batch_rows: None,
            warmup_steps: 0,
            early_stop: None,
            until_learned: None,
            distill: None,
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
    /// The step this run continued from, when it resumed a checkpoint.
    pub resumed_from: Option<usize>,
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
    /// Training stopped at the absorb's time budget, before its planned steps.
    #[serde(default)]
    pub out_of_time: bool,
    /// Context distillation's teacher passes and their tokens (also counted in `tokens`).
    #[serde(default)]
    pub teacher_passes: usize,
    #[serde(default)]
    pub teacher_tokens: usize,
    /// The step this run continued from, when it resumed a checkpoint: the steps before it were
    /// trained (and timed) by an earlier process.
    #[serde(default)]
    pub resumed_from: Option<usize>,
    /// The questions' selection (`plan.qa_select`): its passes and their tokens (also counted in
    /// `tokens` and its time in `seconds`).
    #[serde(default)]
    pub selection_passes: usize,
    #[serde(default)]
    pub selection_tokens: usize,
}

impl TrainReport {
    /// Counts the questions' selection, run before training, in the run's tokens and seconds.
    pub fn add_selection(&mut self, passes: usize, tokens: usize, seconds: f64) {
        self.selection_passes += passes;
        self.selection_tokens += tokens;
        self.tokens += tokens;
        self.seconds += seconds;
        self.tokens_per_s = self.tokens as f64 / self.seconds.max(1e-9);
    }

    /// The optimizer steps this process ran: all of them, less those a resumed checkpoint had.
    pub fn steps_this_run(&self) -> usize {
        self.steps - self.resumed_from.unwrap_or(0).min(self.steps)
    }
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
    /// The target positions, on the host (`pos` on the device).
    positions: Vec<u32>,
    pos: Tensor,
    tgt: Tensor,
    weights: Tensor,
    soft: Option<std::sync::Arc<super::plan::SoftTargets>>,
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
        positions: pos,
        tgt: Tensor::new(tgt.as_slice(), dev)?,
        weights: Tensor::new(weights.as_slice(), dev)?,
        soft: example.soft.clone(),
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
fn loss_of_logits(logits: &Tensor, p: &Prepared) -> Result<Tensor> {
    let hard = ops::cross_entropy_masked(logits, &p.tgt, &p.weights)?;
    match &p.soft {
        None => Ok(hard),
        Some(soft) => Ok(soft_loss(logits, &hard, soft, &p.weights)?),
    }
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

/// Where a run stands after an optimizer step: what, with the parameters and the optimizers'
/// moments, continues it exactly as if it had never stopped.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Cursor {
    /// Optimizer steps done.
    pub step: usize,
    /// The epoch in progress (1-based over both stages) and its batches done.
    pub epoch: usize,
    pub batch: usize,
    /// The seeded stream's position before this epoch's draw, and now (ChaCha word positions,
    /// as decimal strings: JSON numbers stop at 2⁵³).
    pub epoch_rng: String,
    pub rng: String,
    /// The epoch's loss sum so far and `report.examples` when it began.
    pub epoch_loss: f64,
    pub epoch_examples: usize,
    /// Early stopping's count (no best yet: None; JSON has no infinity).
    pub best_epoch_loss: Option<f64>,
    pub epochs_since_best: usize,
    /// The report so far (its `seconds`: training time before this point).
    pub report: TrainReport,
    /// Absorbing until learned: the rule's state and the examples' visits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_learned: Option<UntilLearnedState>,
}

/// A checkpoint of a run: its [`Cursor`] and named tensors (`param.{i}`: the trained parameters
/// in `TrainInputs::vars` order; `optimizer.*`: the moments and step counts).
pub struct TrainCheckpoint {
    pub cursor: Cursor,
    pub tensors: std::collections::HashMap<String, Tensor>,
}

/// A run's checkpoints: written every `interval` and when the segment stage ends (at a step
/// boundary; never part-way through a step), and the one it resumes from.
pub struct Checkpointing<'a> {
    pub interval: std::time::Duration,
    pub resume: Option<TrainCheckpoint>,
    pub save: &'a mut dyn FnMut(TrainCheckpoint) -> Result<()>,
}

/// What a long run adds to [`train_with`]: checkpoints, and a deadline at which it stops at the
/// next step boundary and keeps what it has trained (an absorb's time budget).
#[derive(Default)]
pub struct LongRun<'a> {
    pub checkpoints: Option<Checkpointing<'a>>,
    pub deadline: Option<Instant>,
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
    train_long(model, inputs, opts, filter, probes, control, LongRun::default())
}

/// [`train_with`], checkpointed and resumable through `long.checkpoints`, stopped at
/// `long.deadline`. A run that resumes takes the same path as one that never stopped: the same
/// draws, the same optimizer state, the same remaining steps, and absorbing until learned the same
/// probes, skips and cool-down.
pub fn train_long(
    model: &Model,
    inputs: TrainInputs,
    opts: &TrainOptions,
    filter: Option<&FilterTraining>,
    probes: Option<&Probes>,
    control: RunControl<Progress>,
    long: LongRun,
) -> Result<TrainReport> {
    let RunControl { on_progress, cancel } = control;
    let LongRun { mut checkpoints, deadline } = long;
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
        teacher: match (&opts.distill, inputs.plan.teacher.is_empty()) {
            (Some(d), false) => Some(TeacherCache::new(&inputs.plan.teacher, d.clone())),
            _ => None,
        },
        batch_rows: opts.batch_rows,
    };
    let rows = EpochRows::of(inputs.plan, opts);
    let (epochs_total, steps_total) = (opts.epochs[0] + opts.epochs[1], rows.steps_total(opts));
    let mut report = TrainReport { planned_steps: steps_total, ..Default::default() };
    let start = Instant::now();
    let mut patience = Patience { best: f64::INFINITY, since_best: 0 };
    let mut focus = Focus::new(opts.until_learned.as_ref(), rows.n_seg, rows.n_qa);
    let mut until_learned = UntilLearnedRun::new(opts.until_learned.as_ref(), probes, steps_total);
    // Where a resumed run picks up; its parameters and moments are restored here.
    let resume = match checkpoints.as_mut().and_then(|c| c.resume.take()) {
        None => None,
        Some(mut ckpt) => {
            let c = ckpt.cursor;
            anyhow::ensure!(
                c.report.planned_steps == steps_total && c.step <= steps_total,
                "the checkpoint plans {} steps, this run {steps_total}",
                c.report.planned_steps
            );
            for (i, var) in run.vars.iter().enumerate() {
                let t = ckpt.tensors.remove(&format!("param.{i}")).ok_or_else(|| anyhow::anyhow!("the checkpoint lacks param.{i}"))?;
                anyhow::ensure!(t.dims() == var.dims(), "the checkpoint's param.{i} is {:?}, the adapter's {:?}", t.dims(), var.dims());
                var.set(&t.to_device(var.device())?.to_dtype(var.dtype())?)?;
            }
            optimizers.restore_named(&mut ckpt.tensors)?;
            report = TrainReport { resumed_from: Some(c.step), ..c.report.clone() };
            patience = Patience { best: c.best_epoch_loss.unwrap_or(f64::INFINITY), since_best: c.epochs_since_best };
            match (&opts.until_learned, &c.until_learned) {
                (Some(_), Some(s)) => until_learned.restore(s),
                (None, None) => {}
                _ => anyhow::bail!("the checkpoint's run and this one differ in absorbing until learned"),
            }
            tracing::info!(step = c.step, planned = steps_total, "training resumes from a checkpoint");
            Some(c)
        }
    };
    let resumed_from = resume.as_ref().map(|c| c.step);
    let seconds_before = report.seconds;
    let mut last_checkpoint = Instant::now();
    let final_stage = if opts.epochs[1] > 0 { Stage::SegmentsAndQa } else { Stage::Segments };
    let mut epoch = 0;
    'stages: for (stage, epochs) in [(Stage::Segments, opts.epochs[0]), (Stage::SegmentsAndQa, opts.epochs[1])] {
        for _ in 0..epochs {
            epoch += 1;
            // A resumed run skips the epochs its checkpoint had finished, and redraws the one in
            // progress from the stream's position before its draw.
            let resuming = resume.as_ref().filter(|c| c.epoch >= epoch);
            if resuming.is_some_and(|c| c.epoch > epoch) {
                continue;
            }
            let resumed_rule = resuming.and_then(|c| c.until_learned.as_ref());
            if let Some(c) = resuming {
                run.rng.set_word_pos(word_pos(&c.epoch_rng)?);
            }
            // The draw skips what was learned as the epoch began, so a redraw needs those visits.
            if let Some(s) = resumed_rule {
                focus.restore(&s.focus_at_draw)?;
            }
            let epoch_rng = run.rng.get_word_pos();
            let focus_at_draw = opts.until_learned.as_ref().map(|_| focus.state());
            let (seg_members, order, skipped) = rows.draw(stage, &mut run.rng, |is_qa, i| focus.wants(is_qa, i, epoch));
            if let Some(s) = resumed_rule {
                focus.restore(&s.focus)?;
            }
            let mut epoch_loss = 0.0;
            let mut epoch_start = report.examples;
            let mut done_batches = 0;
            match resuming {
                Some(c) => {
                    run.rng.set_word_pos(word_pos(&c.rng)?);
                    (epoch_loss, epoch_start, done_batches) = (c.epoch_loss, c.epoch_examples, c.batch);
                }
                None => report.skipped_examples += skipped,
            }
            let batches = order.len().div_ceil(rows.accumulation.max(1));
            for (bi, batch) in order.chunks(rows.accumulation).enumerate().skip(done_batches) {
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
                optimizers.step(b.grads, opts, report.steps, until_learned.lr_scale(report.steps))?;
                report.steps += 1;
                report.examples += batch.len();
                report.tokens += b.tokens;
                report.step_losses.push(b.loss);
                epoch_loss += b.loss * batch.len() as f64;
                let secs = t0.elapsed().as_secs_f64();
                until_learned.after_step(model, inputs.adapter, stage == final_stage, epoch, b.loss, &mut report)?;
                let out_of_time = deadline.is_some_and(|d| Instant::now() >= d) && report.steps < steps_total;
                if out_of_time {
                    tracing::warn!(step = report.steps, planned = steps_total, "the absorb's time budget is spent: training stops here");
                    report.out_of_time = true;
                }
                let learned = until_learned.is_over(report.steps) || out_of_time;
                on_progress(&Progress {
                    stage,
                    epoch,
                    epochs: epochs_total,
                    step: report.steps,
                    steps: steps_total,
                    loss: b.loss,
                    tokens_per_s: b.tokens as f64 / secs.max(1e-9),
                    probe_loss: until_learned.probe_loss(),
                    epoch_end: bi + 1 == batches || learned,
                    resumed_from,
                });
                // Checkpoints: every interval, and where the segment stage ends.
                let stage_end = bi + 1 == batches && epoch == opts.epochs[0] && opts.epochs[1] > 0;
                if let Some(c) = checkpoints.as_mut().filter(|_| !learned && report.steps < steps_total) {
                    if stage_end || last_checkpoint.elapsed() >= c.interval {
                        let cursor = Cursor {
                            step: report.steps,
                            epoch,
                            batch: bi + 1,
                            epoch_rng: epoch_rng.to_string(),
                            rng: run.rng.get_word_pos().to_string(),
                            epoch_loss,
                            epoch_examples: epoch_start,
                            best_epoch_loss: patience.best.is_finite().then_some(patience.best),
                            epochs_since_best: patience.since_best,
                            report: TrainReport { seconds: seconds_before + start.elapsed().as_secs_f64(), ..report.clone() },
                            until_learned: focus_at_draw.clone().map(|at_draw| until_learned.state(at_draw, &focus)),
                        };
                        let mut tensors: std::collections::HashMap<String, Tensor> =
                            run.vars.iter().enumerate().map(|(i, v)| (format!("param.{i}"), v.as_tensor().detach())).collect();
                        tensors.extend(optimizers.named_state()?);
                        (c.save)(TrainCheckpoint { cursor, tensors })?;
                        last_checkpoint = Instant::now();
                    }
                }
                if learned {
                    if !report.out_of_time {
                        tracing::info!(step = report.steps, planned = steps_total, probe_loss = until_learned.probe_loss(), cause = ?report.cooldown_cause, "training stops: the cool-down is over");
                    }
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
            let mean = epoch_loss / (report.examples - epoch_start).max(1) as f64;
            report.epoch_losses.push(mean);
            tracing::debug!(epoch, ?stage, loss = mean, skipped, "epoch done");
            if patience.exhausted(opts.early_stop.as_ref(), mean) {
                report.stopped_early = true;
                break 'stages;
            }
        }
    }
    report.seconds = seconds_before + start.elapsed().as_secs_f64();
    if let Some(t) = &run.teacher {
        report.teacher_passes = t.passes;
        report.teacher_tokens = t.tokens;
    }
    report.tokens_per_s = report.tokens as f64 / report.seconds.max(1e-9);
    report.final_loss = report.epoch_losses.last().copied().unwrap_or(f64::NAN);
    Ok(report)
}

/// A [`Cursor`]'s stream position.
fn word_pos(s: &str) -> Result<u128> {
    s.parse().map_err(|_| anyhow::anyhow!("the checkpoint's stream position '{s}' is not a number"))
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
        rng: &mut PlanRng,
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
    rng: PlanRng,
    /// Context distillation's teacher targets of the QA examples.
    teacher: Option<TeacherCache<'a>>,
    /// `TrainOptions::batch_rows`.
    batch_rows: Option<f64>,
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
        let filter = self.filter;
        let fx_of = |is_qa: bool, i: usize| filter.filter(|_| is_qa).map(|ft| (ft, &ft.examples[i]));
        // The rows in order (segments draw their contexts from the seeded stream as they come).
        let mut examples = Vec::with_capacity(batch.len());
        let mut batch_tokens = 0;
        for &(is_qa, i) in batch {
            let mut example = match (fx_of(is_qa, i), is_qa) {
                (Some((_, fx)), _) => fx.example.clone(),
                (None, true) => plan.qa[i].clone(),
                (None, false) => plan.segments_example(model, doc, &seg_members[i], &mut self.rng)?,
            };
            if let (Some(teacher), true) = (self.teacher.as_mut(), is_qa) {
                let before = teacher.tokens;
                let soft = teacher.targets(model, i)?;
                anyhow::ensure!(
                    soft.indices.dim(0)? == example.target_count(),
                    "QA example {i}: the teacher's row has {} answer positions, the student's {}",
                    soft.indices.dim(0)?,
                    example.target_count()
                );
                example.soft = Some(soft);
                batch_tokens += teacher.tokens - before;
            }
            batch_tokens += example.tokens.len();
            examples.push(example);
        }
        let scale = 1.0 / batch.len() as f64;
        let batched = self.batch_rows.is_some() && batch.len() > 1 && examples.iter().all(|e| rows::batchable(e, filter));
        if batched {
            let rows: Vec<rows::Row> = batch
                .iter()
                .zip(&examples)
                .map(|(&(is_qa, i), example)| rows::Row {
                    example,
                    filter: fx_of(is_qa, i).map(|(_, fx)| fx),
                    // QA examples are the same tokens every epoch; segments get a new context each time.
                    cache_key: is_qa.then_some(i),
                })
                .collect();
            let lens: Vec<usize> = examples.iter().map(|e| e.tokens.len()).collect();
            let mut grads: Option<Vec<Tensor>> = None;
            let mut losses = vec![0.0; batch.len()];
            for group in rows::groups(&lens, self.batch_rows.unwrap_or(0.0)) {
                let members: Vec<&rows::Row> = group.iter().map(|&j| &rows[j]).collect();
                let l = rows::row_losses(model, adapter, &members, filter.map(|ft| ft.filter), &mut self.frozen)?;
                let l = Tensor::stack(&l, 0)?;
                let g = gradients(&(l.sum_all()? * scale)?, &self.vars)?;
                grads = Some(add_gradients(grads, g)?);
                for (&j, v) in group.iter().zip(l.to_vec1::<f32>()?) {
                    losses[j] = f64::from(v);
                }
            }
            let loss = losses.iter().sum::<f64>() * scale;
            return Ok(Batch { grads: grads.unwrap_or_default(), loss, losses, tokens: batch_tokens });
        }
        let mut sum: Option<Vec<Tensor>> = None;
        let mut batch_loss = 0.0;
        let mut losses = Vec::with_capacity(batch.len());
        for (&(is_qa, i), example) in batch.iter().zip(&examples) {
            let cached = is_qa.then_some((&mut self.frozen, i));
            let (loss, _) = training_loss(model, adapter, example, fx_of(is_qa, i), None, &mut self.no_cdt, cached)?;
            let g = gradients(&(loss.clone() * scale)?, &self.vars)?;
            sum = Some(add_gradients(sum, g)?);
            let loss = loss.to_scalar::<f32>()? as f64;
            losses.push(loss);
            batch_loss += loss * scale;
        }
        Ok(Batch { grads: sum.unwrap_or_default(), loss: batch_loss, losses, tokens: batch_tokens })
    }
}

/// `g` added to the gradients summed so far (`sum`, in the same `vars` order).
fn add_gradients(sum: Option<Vec<Tensor>>, g: Vec<Tensor>) -> Result<Vec<Tensor>> {
    Ok(match sum {
        None => g,
        Some(acc) => acc.iter().zip(&g).map(|(a, b)| a + b).collect::<candle_core::Result<_>>()?,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    use crate::adapters::GatedMemory;
    use crate::lift::filter::{qa_examples, FilterOptions};
    use crate::lift::qa::{QaPair, QaSource};

    const TEXT: &str = "The ferry leaves at dawn. The keeper is Anselm Varga. Tickets cost eleven coins. \
                        The captain is Ilse Moreau. Gulls nest on the island all summer long.";

    fn pair(question: &str, answer: &str, evidence: &str) -> QaPair {
        let at = TEXT.find(evidence).unwrap();
        QaPair {
            question: question.into(),
            answer: answer.into(),
            evidence: evidence.into(),
            evidence_span: (at, at + evidence.len()),
            source: QaSource::Extractive,
        }
    }

    /// The tiny model (4 layers, f32 float matmuls) over a prepared base whose filter scores at
    /// layer 1 and masks (its head scores every chunk about 4.5, its bias −3).
    fn tiny_with_filter() -> (tempfile::TempDir, Model) {
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
        (dir, model)
    }

    #[test]
    fn a_frozen_filter_gives_the_same_loss_and_gradients_over_cached_frozen_layers() {
        let (_dir, model) = tiny_with_filter();
        let pair = pair("Who is the keeper?", "Anselm Varga", "The keeper is Anselm Varga.");
        let document = crate::document::Document::encode(&model, TEXT).unwrap();
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

    /// The largest absolute difference between `a` and `b`, against `b`'s largest magnitude.
    fn max_diff(a: &Tensor, b: &Tensor) -> (f32, f32) {
        let max = |t: Tensor| t.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        (max((a - b).unwrap()), max(b.clone()))
    }

    #[test]
    fn batched_rows_give_each_row_its_own_loss_and_the_step_the_rows_mean_gradients() {
        let (_dir, model) = tiny_with_filter();
        let pairs = [
            pair("Who is the keeper?", "Anselm Varga", "The keeper is Anselm Varga."),
            pair("What do tickets cost?", "eleven coins", "Tickets cost eleven coins."),
            pair("Who captains the ferry that leaves at dawn?", "Ilse Moreau", "The captain is Ilse Moreau."),
        ];
        let document = crate::document::Document::encode(&model, TEXT).unwrap();
        let filter = model.base_filter().unwrap();
        let mut examples = qa_examples(&model, &document, &pairs, 1000, filter).unwrap();
        // One row learns from a teacher's distribution as well (context distillation).
        let k = 3;
        let n = examples[1].example.target_count();
        let vocab = model.config().vocab_size as u32;
        let idx: Vec<u32> = (0..n * k).map(|i| (i as u32 * 7919) % vocab).collect();
        let probs: Vec<f32> = (0..n).flat_map(|_| [0.6f32, 0.3, 0.1]).collect();
        examples[1].example.soft = Some(std::sync::Arc::new(crate::lift::plan::SoftTargets {
            indices: Tensor::from_vec(idx, (n, k), &Device::Cpu).unwrap(),
            probs: Tensor::from_vec(probs, (n, k), &Device::Cpu).unwrap(),
            weight: 0.5,
        }));
        // And one is a plain row of another length without the filter: the whole text recited.
        let doc = document.tokens().to_vec();
        let plain = Example {
            kind: crate::lift::plan::ExampleKind::Segment(0),
            target: (0..doc.len()).map(|i| i > 0).collect(),
            tokens: doc,
            packing: None,
            soft: None,
        };
        let lens: Vec<usize> = examples.iter().map(|e| e.example.tokens.len()).chain([plain.tokens.len()]).collect();
        assert!(lens.iter().min() < lens.iter().max(), "rows of different lengths are padded: {lens:?}");
        let rows: Vec<rows::Row> = examples
            .iter()
            .enumerate()
            .map(|(i, fx)| rows::Row { example: &fx.example, filter: Some(fx), cache_key: Some(i) })
            .chain([rows::Row { example: &plain, filter: None, cache_key: None }])
            .collect();
        let ft = FilterTraining::frozen(filter, &examples);
        assert!(rows.iter().all(|r| rows::batchable(r.example, Some(&ft))));
        // The adapter on every layer (the whole stack on the graph), and above the filter's score
        // layer (the layers below it frozen and cached).
        for layers in [vec![0, 1, 2, 3], vec![2, 3]] {
            let gm = GatedMemory::new(model.config(), &layers, false, 1, &Device::Cpu).unwrap();
            let mut stats = CdtStats::default();
            let alone: Vec<Tensor> = rows
                .iter()
                .map(|r| {
                    let fx = r.filter.map(|fx| (&ft, fx));
                    training_loss(&model, &gm, r.example, fx, None, &mut stats, None).unwrap().0
                })
                .collect();
            let mean = (Tensor::stack(&alone, 0).unwrap().sum_all().unwrap() / rows.len() as f64).unwrap();
            let want = gradients(&mean, gm.vars()).unwrap();
            let mut cache = FrozenCache::new(1 << 30);
            // Round 0 fills the frozen-layer cache of the QA rows, round 1 reads it.
            for round in 0..2 {
                let batched = rows::row_losses(&model, &gm, &rows.iter().collect::<Vec<_>>(), Some(filter), &mut cache).unwrap();
                for (i, (a, b)) in batched.iter().zip(&alone).enumerate() {
                    let (a, b) = (a.to_scalar::<f32>().unwrap(), b.to_scalar::<f32>().unwrap());
                    assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{layers:?} round {round}: row {i}'s loss {a} alone {b}");
                }
                let mean = (Tensor::stack(&batched, 0).unwrap().sum_all().unwrap() / rows.len() as f64).unwrap();
                for (g, w) in gradients(&mean, gm.vars()).unwrap().iter().zip(&want) {
                    let (diff, scale) = max_diff(g, w);
                    assert!(scale > 0.0, "{layers:?}: a parameter got no gradient");
                    assert!(diff <= 1e-4 * scale, "{layers:?} round {round}: gradient differs by {diff} (scale {scale})");
                }
            }
            assert_eq!(cache.bytes > 0, layers[0] > 0, "{layers:?}: the QA rows' frozen layers are cached");
        }
    }
}
