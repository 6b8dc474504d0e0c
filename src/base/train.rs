//! `prepare-base`: trains a prepared base once per base model. The LoRA learns the answers with
//! CDT (Context Denoising Training: each example's non-critical document embeddings are moved
//! against their gradient before the training pass) and the FltLM filter learns eq. 7 (its chunk
//! scores against the examples' positive passages) at a higher learning rate, jointly with the LM
//! loss through the soft mask (eq. 10), as FltLM trains its LoRA and filter together.
//!
//! Deterministic for a seed: the LoRA's initialisation and each epoch's example order derive from
//! it. A checkpoint (weights, both optimizers' moments, the step) is written every
//! `checkpoint_seconds` and when cancelled; `resume` continues from it, refusing a checkpoint made
//! with other options or other data.

use super::data::{BaseExample, BuildOptions};
use super::{BaseShape, PreparedBase};
use super::cdt::{cdt_loss, CdtOptions, CdtStats, QaPositions};
use crate::lift::absorb::qa_examples::FilterExample;
use crate::lift::answer::layout::{self, FilterEval, FilterHooks, MaskCalibration};
use crate::lift::absorb::plan::{Example, ExampleKind, Plan};
use crate::lift::answer::prompt::end_of_turn;
use crate::lift::absorb::trainer::{self, AdamW, FilterTraining, RunControl, TrainOptions};
use crate::model::Model;
use crate::retrieve::PassageIndex;
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
#[cfg(test)]
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrepareOptions {
    pub shape: BaseShape,
    pub epochs: usize,
    /// The LoRA's learning rate (AdamW).
    pub lr: f64,
    /// The filter's learning rate relative to the LoRA's: FltLM trains the filter's parameters at
    /// a higher rate than the LoRA (they start at zero and must move far).
    pub filter_lr_scale: f64,
    pub cdt: CdtOptions,
    /// How the training and validation examples are built (`prepare` itself takes them built).
    pub data: BuildOptions,
    /// Reading examples from real prose beside the planted ones (`base::real`); none by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub real: Option<super::real::RealData>,
    pub seed: u64,
    /// Seconds between checkpoints (0: after every step).
    pub checkpoint_seconds: f64,
    /// A share of the training examples shown truncated, as the answer path shows a long document.
    pub truncate: TruncateOptions,
    /// How the shipped filter turns scores into its mask when it answers. Training runs FltLM's
    /// absolute mask (eq. 8) unless `train_with_calibration`; this is set on the trained filter
    /// before its held-out figures and saved with it (the shipped base answers under `relative:2`,
    /// which keeps the evidence open in the BM25 passages answers read, where the absolute
    /// threshold learned here closes it; docs/prepared-base.md).
    pub mask_calibration: MaskCalibration,
    /// Train under `mask_calibration` instead of FltLM's absolute mask, so the LoRA learns to read
    /// with the mask it will answer under (under the relative mask `b` gets no gradient: the
    /// threshold is the best chunk's score less the margin). Off: the paper's training, the
    /// shipped base.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub train_with_calibration: bool,
    /// The calibration documents' absorbs train their adapters under, when it is to differ from
    /// `mask_calibration`. The shipped base's absorbs train under FltLM's absolute mask: adapters
    /// trained under the relative one learn to read the open evidence instead of storing the
    /// facts, and answered fewer questions (docs/prepared-base.md). None: absorbs train under
    /// `mask_calibration`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub absorb_mask_calibration: Option<MaskCalibration>,
}

/// Training examples shown as LIFT's answer path shows a long document: a head and a tail around
/// the elision marker (`answer::build_prompt` with the default 128-token context). Without them
/// the base only ever sees whole documents, a layout it never answers from under an adapter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TruncateOptions {
    /// Share of the training examples shown truncated (0: every example whole).
    pub fraction: f64,
    /// Share of the truncated examples shown as the passages BM25 retrieves for their question
    /// ([`retrieved_view`]: the layout `lift` and `rag` answer in) instead of head and tail.
    pub retrieved: f64,
    /// The document budget in tokens (head budget/2, tail the rest), drawn per example.
    pub min_tokens: usize,
    pub max_tokens: usize,
}

impl Default for TruncateOptions {
    fn default() -> Self {
        Self { fraction: 0.0, retrieved: 0.0, min_tokens: 128, max_tokens: 384 }
    }
}

impl Default for PrepareOptions {
    fn default() -> Self {
        Self {
            shape: BaseShape::default(),
            epochs: 1,
            lr: 1e-4,
            filter_lr_scale: 100.0,
            cdt: CdtOptions { enabled: true, ..Default::default() },
            data: BuildOptions::default(),
            real: None,
            seed: 0,
            checkpoint_seconds: 300.0,
            truncate: TruncateOptions::default(),
            mask_calibration: MaskCalibration::Absolute,
            train_with_calibration: false,
            absorb_mask_calibration: None,
        }
    }
}

impl PrepareOptions {
    fn train_options(&self) -> TrainOptions {
        TrainOptions { lr: self.lr, seed: self.seed, ..Default::default() }
    }
}

/// Progress of `prepare`, once per optimizer step.
#[derive(Clone, Debug, Serialize)]
pub struct PrepareProgress {
    pub step: usize,
    pub steps: usize,
    pub epoch: usize,
    pub loss: f64,
    pub filter_loss: f64,
}

/// What a run reports (also the manifest's `training`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PrepareReport {
    pub steps: usize,
    /// Steps run by this process (the rest came from a checkpoint).
    pub steps_this_run: usize,
    pub seconds: f64,
    /// Mean training loss (L_lm + λ·L_flt) per epoch; an epoch split by a resume counts its
    /// steps from both runs.
    pub epoch_losses: Vec<f64>,
    pub step_losses: Vec<f64>,
    pub filter_losses: Vec<f64>,
    pub cdt: Option<CdtStats>,
    pub stopped: bool,
    /// Training examples shown truncated ([`TruncateOptions`]).
    #[serde(default)]
    pub truncated_examples: usize,
    /// The options the base was trained with (the manifest's record of how it was made).
    #[serde(default)]
    pub options: Option<PrepareOptions>,
}

/// One training example in the filter layout: every passage one chunk, labelled by `positive`.
pub fn filter_example(model: &Model, ex: &BaseExample, index: usize) -> Result<(FilterExample, QaPositions)> {
    let passages = encode_passages(model, ex)?;
    example_in_view(model, ex, &passages, None, index)
}

fn encode_passages(model: &Model, ex: &BaseExample) -> Result<Vec<Vec<u32>>> {
    ex.passages.iter().map(|p| model.encode_document(p)).collect()
}

/// Which passages of an example a training prompt shows, in order, and where the elision marker
/// goes (before `passages[elide_before]`; none between retrieved passages, as answers show them).
#[derive(Clone, Debug, PartialEq)]
pub struct View {
    pub passages: Vec<usize>,
    pub elide_before: Option<usize>,
}

/// The view `lift` and `rag` answer from: the passages BM25 ranks first for the question, as
/// many as fit `budget` tokens, in document order ([`PassageIndex::select`], as answers select
/// them), with the supporting passages always among them: the evidence among the distractors
/// retrieval finds for it, the layout FltLM's filter must score at answer time. `None` when the
/// whole example fits, or its supporting passages alone do not.
pub fn retrieved_view(ex: &BaseExample, lens: &[usize], budget: usize) -> Option<View> {
    if lens.iter().sum::<usize>() <= budget || ex.positive.iter().map(|&i| lens[i]).sum::<usize>() > budget {
        return None;
    }
    let mut at = 0;
    let ranges: Vec<(usize, usize)> = lens
        .iter()
        .map(|&l| {
            at += l;
            (at - l, at)
        })
        .collect();
    let index = PassageIndex::from_texts(ranges, &ex.passages);
    let ranked: Vec<usize> = ex.positive.iter().copied().chain(index.search(&ex.question).into_iter().map(|h| h.passage)).collect();
    Some(View { passages: index.select(&ranked, budget), elide_before: None })
}

/// The truncated view of `ex` (passage lengths `lens` in tokens) for a document budget of `budget`
/// tokens: the passages that fit a head of budget/2 tokens and a tail of the rest, as
/// `prompt::kept_ranges` cuts a document at answer time. Elided supporting passages, and each
/// elided distractor with probability ½, move into kept slots that hold no fact, so the answer is
/// always in the context and confusable facts stay in it. `None` when the whole example fits, or
/// its supporting passages do not fit the kept slots.
pub fn truncated_view(ex: &BaseExample, lens: &[usize], budget: usize, rng: &mut impl rand::Rng) -> Option<View> {
    let n = lens.len();
    // How many passages, taken in `order`, fit `room` tokens (at least one).
    let fit = |order: &mut dyn Iterator<Item = usize>, room: usize| {
        let mut used = 0;
        order.take_while(|&i| {
            used += lens[i];
            used <= room
        })
        .count()
        .max(1)
    };
    let head = fit(&mut (0..n), budget / 2);
    let tail = fit(&mut (0..n).rev(), budget - budget / 2);
    if head + tail >= n {
        return None;
    }
    let mut shown: Vec<usize> = (0..head).chain(n - tail..n).collect();
    let is_fact = |i: &usize| ex.positive.contains(i) || ex.distractors.contains(i);
    let mut free: Vec<usize> = (0..shown.len()).filter(|&k| !is_fact(&shown[k])).collect();
    free.shuffle(rng);
    let elided = |i: &usize| (head..n - tail).contains(i);
    for &p in ex.positive.iter().filter(|i| elided(i)) {
        shown[free.pop()?] = p;
    }
    for &d in ex.distractors.iter().filter(|i| elided(i)) {
        if rng.random_bool(0.5) {
            let Some(slot) = free.pop() else { break };
            shown[slot] = d;
        }
    }
    Some(View { passages: shown, elide_before: Some(head) })
}

/// The prepared training set: every example in the filter layout, a seeded share of them
/// truncated ([`TruncateOptions`]). Returns the examples and how many are truncated.
pub fn training_examples(
    model: &Model,
    examples: &[BaseExample],
    opts: &PrepareOptions,
) -> Result<(Vec<(FilterExample, QaPositions)>, usize)> {
    let t = &opts.truncate;
    anyhow::ensure!(
        (0.0..=1.0).contains(&t.fraction) && (0.0..=1.0).contains(&t.retrieved) && 0 < t.min_tokens && t.min_tokens <= t.max_tokens,
        "bad truncate options: {t:?}"
    );
    let mut truncated = 0;
    let mut out = Vec::with_capacity(examples.len());
    for (i, ex) in examples.iter().enumerate() {
        let passages = encode_passages(model, ex)?;
        // One stream per example, apart from the epoch-order streams (`seed + epoch`).
        let mut rng = Plan::rng(opts.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(i as u64) ^ 0x0074_7275_6e63);
        let view = if t.fraction > 0.0 && rng.random_bool(t.fraction) {
            let budget = rng.random_range(t.min_tokens..=t.max_tokens);
            let lens: Vec<usize> = passages.iter().map(Vec::len).collect();
            // No draw when no example is retrieved: the head-and-tail stream stays as it was.
            if t.retrieved > 0.0 && rng.random_bool(t.retrieved) {
                retrieved_view(ex, &lens, budget)
            } else {
                truncated_view(ex, &lens, budget, &mut rng)
            }
        } else {
            None
        };
        truncated += usize::from(view.is_some());
        out.push(example_in_view(model, ex, &passages, view.as_ref(), i)?);
    }
    Ok((out, truncated))
}

/// `ex` laid out over its encoded `passages`, whole or in `view`.
fn example_in_view(
    model: &Model,
    ex: &BaseExample,
    passages: &[Vec<u32>],
    view: Option<&View>,
    index: usize,
) -> Result<(FilterExample, QaPositions)> {
    anyhow::ensure!(!ex.passages.is_empty(), "an example without passages");
    anyhow::ensure!(
        !ex.positive.is_empty() && ex.positive.iter().all(|&i| i < ex.passages.len()),
        "an example's positive passages must be a non-empty set of its passage indices"
    );
    let shown: Vec<usize> = view.map_or_else(|| (0..passages.len()).collect(), |v| v.passages.clone());
    let shown_tokens: Vec<Vec<u32>> = shown.iter().map(|&i| passages[i].clone()).collect();
    let p = layout::passages_prompt(model, &shown_tokens, &ex.question, view.and_then(|v| v.elide_before))?;
    let positive: Vec<bool> = shown.iter().map(|i| ex.positive.contains(i)).collect();
    anyhow::ensure!(positive.iter().any(|&b| b), "a training view without its supporting passage");
    let mut answer = model.tokenizer.encode(ex.answer.trim(), false)?;
    answer.extend_from_slice(&end_of_turn(model));
    let mut target = vec![false; p.tokens.len()];
    target.extend(std::iter::repeat_n(true, answer.len()));
    let mut tokens = p.tokens;
    tokens.extend_from_slice(&answer);
    let positions = |keep: &dyn Fn(usize) -> bool| -> Vec<usize> {
        p.chunks.iter().enumerate().filter(|&(i, _)| keep(i)).flat_map(|(_, c)| c.start..c.end).collect()
    };
    let qp = QaPositions { context: positions(&|_| true), evidence: positions(&|i| positive[i]) };
    let example = Example { kind: ExampleKind::Qa(index), tokens, target, packing: None };
    Ok((FilterExample { example, chunks: p.chunks, positive, evidence: qp.evidence.clone() }, qp))
}

const CHECKPOINT_DIR: &str = "checkpoint";
const STATE_FILE: &str = "state.json";
const TENSORS_FILE: &str = "state.safetensors";

#[derive(Serialize, Deserialize)]
struct CheckpointState {
    options: PrepareOptions,
    data_hash: String,
    step: usize,
    report: PrepareReport,
}

/// The training examples and their hash (a checkpoint records it and refuses other data).
#[derive(Clone, Copy)]
pub struct TrainingSet<'a> {
    pub examples: &'a [BaseExample],
    pub hash: &'a str,
}

/// Trains a prepared base on `data`; checkpoints go under `out/checkpoint/` (`resume`: continue
/// from the one there). `control.cancel` is polled between steps: a cancelled run writes a
/// checkpoint and returns its partial base with `report.stopped`.
pub fn prepare(
    model: &Model,
    data: TrainingSet,
    opts: &PrepareOptions,
    out: &Path,
    resume: bool,
    control: RunControl<PrepareProgress>,
) -> Result<(PreparedBase, PrepareReport)> {
    let RunControl { on_progress, cancel } = control;
    anyhow::ensure!(!data.examples.is_empty(), "no training examples");
    let base = PreparedBase::new(model, &opts.shape, opts.seed)?;
    let (prepared, truncated) = training_examples(model, data.examples, opts)?;
    if truncated > 0 {
        tracing::info!(truncated, examples = prepared.len(), "training examples shown truncated");
    }
    let mut run = BaseRun::start(model, base, opts, data.hash, out.join(CHECKPOINT_DIR), resume)?;
    let steps = opts.epochs * prepared.len();
    let t0 = Instant::now();
    let mut last_ckpt = Instant::now();
    run.report.stopped = false;
    run.report.truncated_examples = truncated;
    run.report.options = Some(opts.clone());
    while run.step < steps {
        if cancel() {
            run.report.stopped = true;
            break;
        }
        on_progress(&run.train_step(model, &prepared)?);
        if run.step < steps && last_ckpt.elapsed().as_secs_f64() >= opts.checkpoint_seconds {
            run.write_checkpoint()?;
            last_ckpt = Instant::now();
        }
    }
    run.report.seconds += t0.elapsed().as_secs_f64();
    if run.report.stopped {
        run.write_checkpoint()?;
    }
    if let Some(c) = &run.report.cdt {
        tracing::info!(
            relative_move = c.mean_relative_shift,
            loss_ratio = c.mean_loss_ratio,
            critical = c.critical,
            "cdt"
        );
    }
    run.finish()
}

/// A `prepare` run: the base in training, both optimizers, the step, the report and CDT's
/// running figures, and what a checkpoint records beside them.
struct BaseRun<'a> {
    base: PreparedBase,
    lora_opt: AdamW,
    filter_opt: AdamW,
    step: usize,
    report: PrepareReport,
    cdt_stats: CdtStats,
    train_opts: TrainOptions,
    opts: &'a PrepareOptions,
    data_hash: &'a str,
    checkpoint_dir: PathBuf,
}

impl<'a> BaseRun<'a> {
    /// A fresh run on `base`, or with `resume` the checkpoint's base, optimizers, step and report.
    fn start(
        model: &Model,
        base: PreparedBase,
        opts: &'a PrepareOptions,
        data_hash: &'a str,
        checkpoint_dir: PathBuf,
        resume: bool,
    ) -> Result<Self> {
        let train_opts = opts.train_options();
        let lora_opt = AdamW::new(base.lora.vars().to_vec(), &train_opts)?;
        let filter_opt = AdamW::new(base.filter.vars().to_vec(), &train_opts)?;
        let mut run = Self {
            base,
            lora_opt,
            filter_opt,
            step: 0,
            report: PrepareReport::default(),
            cdt_stats: CdtStats::default(),
            train_opts,
            opts,
            data_hash,
            checkpoint_dir,
        };
        if resume {
            let (state, restored, [l, f]) = read_checkpoint(&run.checkpoint_dir, model, &run.base)?;
            if state.options != *opts || state.data_hash != data_hash {
                bail!(
                    "{}: the checkpoint was made with other options or other data; start afresh without --resume",
                    run.checkpoint_dir.display()
                );
            }
            (run.base, run.lora_opt, run.filter_opt) = (restored, l, f);
            run.step = state.step;
            run.report = PrepareReport { steps_this_run: 0, ..state.report };
            tracing::info!(step = run.step, "resumed from checkpoint");
        }
        run.cdt_stats = run.report.cdt.clone().unwrap_or_default();
        if opts.train_with_calibration {
            run.base.filter.calibration = opts.mask_calibration;
        }
        Ok(run)
    }

    /// One optimizer step on the next example of the epoch's seeded order: the loss (with CDT and
    /// the filter as configured), both optimizers, the losses recorded. Returns the progress.
    fn train_step(&mut self, model: &Model, prepared: &[(FilterExample, QaPositions)]) -> Result<PrepareProgress> {
        let opts = self.opts;
        let n = prepared.len();
        let epoch = self.step / n;
        // Each epoch's order derives from the seed alone, so a resumed run takes the same path.
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut Plan::rng(opts.seed.wrapping_add(epoch as u64)));
        let (fx, qp) = &prepared[order[self.step % n]];
        let base = &self.base;
        let ft = FilterTraining {
            filter: &base.filter,
            examples: &[],
            lambda: opts.shape.filter.lambda,
            margin: opts.shape.filter.margin,
            lr_scale: opts.filter_lr_scale,
        };
        // Without the filter (an ablation arm) its parameters stay at zero: the mask is inert.
        let filter = opts.shape.filter.enabled.then_some((&ft, fx));
        let (loss, flt) = match opts.cdt.enabled {
            true => cdt_loss(model, &base.lora, &fx.example, filter, opts.cdt.relative_move, qp, &mut self.cdt_stats)?,
            false => trainer::training_loss(model, &base.lora, &fx.example, filter, None)?,
        };
        let vars: Vec<_> = base.lora.vars().iter().chain(base.filter.vars()).cloned().collect();
        let mut grads = trainer::gradients(&loss, &vars)?;
        let filter_grads = grads.split_off(base.lora.vars().len());
        let max_norm = self.train_opts.max_grad_norm;
        self.lora_opt.clip_and_step(grads, max_norm, opts.lr)?;
        self.filter_opt.clip_and_step(filter_grads, max_norm, opts.lr * opts.filter_lr_scale)?;
        let loss = loss.to_scalar::<f32>()? as f64;
        let filter_loss = flt.map(|f| f.to_scalar::<f32>()).transpose()?.unwrap_or(0.0) as f64;
        self.record(loss, filter_loss, n, epoch);
        Ok(PrepareProgress { step: self.step, steps: opts.epochs * n, epoch: epoch + 1, loss, filter_loss })
    }

    /// Books one step's losses (and the epoch's mean when the step ends an epoch of `n`).
    fn record(&mut self, loss: f64, filter_loss: f64, n: usize, epoch: usize) {
        let report = &mut self.report;
        report.step_losses.push(loss);
        report.filter_losses.push(filter_loss);
        self.step += 1;
        report.steps = self.step;
        report.steps_this_run += 1;
        if self.step % n == 0 {
            let from = report.step_losses.len() - n.min(report.step_losses.len());
            report.epoch_losses.push(report.step_losses[from..].iter().sum::<f64>() / n as f64);
            tracing::info!(epoch = epoch + 1, loss = report.epoch_losses.last(), "epoch done");
        }
        if self.opts.cdt.enabled {
            report.cdt = Some(self.cdt_stats.clone());
        }
    }

    /// The trained base with its manifest's record of the run, and the report.
    fn finish(self) -> Result<(PreparedBase, PrepareReport)> {
        let mut base = self.base;
        base.manifest.seed = self.opts.seed;
        base.manifest.data_hash = self.data_hash.to_string();
        base.manifest.training = serde_json::to_value(&self.report)?;
        Ok((base, self.report))
    }

    /// Writes the weights, both optimizers' moments and the state (options, data hash, step,
    /// report) under the checkpoint directory.
    fn write_checkpoint(&self) -> Result<()> {
        let dir = &self.checkpoint_dir;
        std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        let mut tensors = self.base.named_tensors()?;
        for (name, opt) in [("lora", &self.lora_opt), ("filter", &self.filter_opt)] {
            tensors.extend(opt.named_state(&format!("optimizer.{name}"))?);
        }
        let tmp = dir.join(format!(".{TENSORS_FILE}.tmp"));
        candle_core::safetensors::save(&tensors, &tmp)?;
        std::fs::rename(&tmp, dir.join(TENSORS_FILE))?;
        let state = CheckpointState {
            options: self.opts.clone(),
            data_hash: self.data_hash.to_string(),
            step: self.step,
            report: self.report.clone(),
        };
        super::write_json(&dir.join(STATE_FILE), &state)?;
        tracing::info!(step = self.step, dir = %dir.display(), "checkpoint written");
        Ok(())
    }
}

/// The trained base's held-out figures on `examples`: mean LM loss and the filter's precision and
/// recall at `s_i > 0`. `base` is applied as the call's adapter, on the plain model.
pub fn evaluate(model: &Model, base: &PreparedBase, examples: &[BaseExample]) -> Result<serde_json::Value> {
    let mut lm = 0.0;
    let mut fe = FilterEval::default();
    for (i, ex) in examples.iter().enumerate() {
        let (fx, _) = filter_example(model, ex, i)?;
        let mut hooks = FilterHooks::new(&base.filter, &fx.chunks, model.config().num_layers);
        lm += trainer::example_loss_with(model, &base.lora, &fx.example, &mut hooks)?.to_scalar::<f32>()? as f64;
        fe.add(&hooks.report()?, &fx.positive);
    }
    let (precision, recall) = fe.precision_recall();
    Ok(serde_json::json!({
        "examples": examples.len(),
        "lm_loss": lm / examples.len().max(1) as f64,
        "filter_precision": precision,
        "filter_recall": recall,
        "filter": fe,
    }))
}

/// Reads a checkpoint: its state, the trainable LoRA and filter, and both optimizers on them.
fn read_checkpoint(
    dir: &Path,
    model: &Model,
    base: &PreparedBase,
) -> Result<(CheckpointState, PreparedBase, [AdamW; 2])> {
    let path = dir.join(STATE_FILE);
    let state: CheckpointState = serde_json::from_slice(
        &std::fs::read(&path).with_context(|| format!("{}: no checkpoint to resume from", path.display()))?,
    )
    .with_context(|| format!("{}: invalid checkpoint", path.display()))?;
    let mut tensors: HashMap<String, Tensor> = candle_core::safetensors::load(dir.join(TENSORS_FILE), model.device())?;
    // The optimizers' entries out first: the rest are the base's weights.
    let optimizer: HashMap<String, Tensor> = tensors.extract_if(|k, _| k.starts_with("optimizer.")).collect();
    let (lora, filter) = PreparedBase::from_tensors(model, &base.manifest.lora, tensors, true)?;
    let train_opts = state.options.train_options();
    let mut opts = [AdamW::new(lora.vars().to_vec(), &train_opts)?, AdamW::new(filter.vars().to_vec(), &train_opts)?];
    let mut optimizer = optimizer;
    for (opt, name) in opts.iter_mut().zip(["lora", "filter"]) {
        opt.restore_named(&format!("optimizer.{name}"), &mut optimizer)?;
    }
    Ok((state, PreparedBase { lora, filter, manifest: base.manifest.clone() }, opts))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn example(n: usize, positive: Vec<usize>, distractors: Vec<usize>) -> BaseExample {
        BaseExample {
            passages: (0..n).map(|i| format!("p{i}")).collect(),
            positive,
            question: "q?".into(),
            answer: "a".into(),
            kind: "single".into(),
            distractors,
        }
    }

    #[test]
    fn a_truncated_view_keeps_head_and_tail_with_the_supporting_passages() {
        // 40 passages of 30 tokens, budget 200: 3 head passages (90 ≤ 100), 3 tail passages.
        let lens = vec![30; 40];
        for seed in 0..50 {
            let ex = example(40, vec![17, 25], vec![5, 30, 38]);
            let v = truncated_view(&ex, &lens, 200, &mut StdRng::seed_from_u64(seed)).unwrap();
            assert_eq!(v.passages.len(), 6);
            assert_eq!(v.elide_before, Some(3));
            for p in [17, 25, 38] {
                assert!(v.passages.contains(&p), "{p} missing from {v:?}");
            }
            // Kept prose outside the moved facts is the head and the tail, in order.
            for (k, &p) in v.passages.iter().enumerate() {
                let at = if k < 3 { k } else { 34 + k };
                assert!(p == at || [17, 25, 5, 30].contains(&p), "slot {k} holds {p}");
            }
            let mut u = v.passages.clone();
            u.sort_unstable();
            u.dedup();
            assert_eq!(u.len(), 6, "a passage shown twice: {v:?}");
        }
    }

    #[test]
    fn a_truncated_view_moves_elided_distractors_in_about_half_the_time_and_is_seeded() {
        let lens = vec![30; 40];
        let ex = example(40, vec![20], vec![10]);
        let shown = (0..200)
            .filter(|&s| truncated_view(&ex, &lens, 200, &mut StdRng::seed_from_u64(s)).unwrap().passages.contains(&10))
            .count();
        assert!((60..=140).contains(&shown), "distractor moved in {shown} of 200");
        let a = truncated_view(&ex, &lens, 200, &mut StdRng::seed_from_u64(7));
        assert_eq!(a, truncated_view(&ex, &lens, 200, &mut StdRng::seed_from_u64(7)));
    }

    #[test]
    fn a_retrieved_view_shows_what_bm25_finds_for_the_question_and_the_evidence() {
        let mut ex = example(12, vec![9], vec![]);
        ex.passages = (0..12).map(|i| format!("The essay goes on about topic {i} for a while.")).collect();
        ex.passages[3] = "The lighthouse keeper of Varn counts gulls at dawn.".into();
        ex.passages[9] = "Mirela Vasquez keeps the lighthouse of Varn.".into();
        ex.question = "Who keeps the lighthouse of Varn?".into();
        let v = retrieved_view(&ex, &[20; 12], 60).unwrap();
        // The evidence, BM25's look-alike, then the best of the rest; in document order, no marker.
        assert_eq!(v.passages.len(), 3);
        assert!(v.passages.contains(&9) && v.passages.contains(&3), "{v:?}");
        assert!(v.passages.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(v.elide_before, None);
        // The evidence is shown even when BM25 ranks it low (a paraphrased question).
        ex.question = "Who counts gulls at dawn in Varn, and who tends its light?".into();
        assert!(retrieved_view(&ex, &[20; 12], 60).unwrap().passages.contains(&9));
        assert_eq!(retrieved_view(&ex, &[20; 12], 240), None, "the whole example fits");
        assert_eq!(retrieved_view(&ex, &[20; 12], 10), None, "the evidence alone does not fit");
    }

    #[test]
    fn no_truncated_view_when_the_example_fits_or_its_facts_do_not() {
        let mut rng = StdRng::seed_from_u64(0);
        assert_eq!(truncated_view(&example(6, vec![3], vec![]), &[30; 6], 200, &mut rng), None);
        // One head and one tail slot, three supporting passages in the middle.
        assert_eq!(truncated_view(&example(10, vec![3, 4, 5], vec![]), &[100; 10], 200, &mut rng), None);
    }
}

