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
use crate::lift::cdt::{CdtOptions, CdtStats};
use crate::lift::filter::{self, FilterEval, FilterExample, FilterHooks};
use crate::lift::plan::{Example, ExampleKind, Plan};
use crate::lift::prompt::end_of_turn;
use crate::lift::trainer::{self, AdamW, FilterTraining, QaPositions, TrainOptions};
use crate::model::Model;
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
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
    pub seed: u64,
    /// Seconds between checkpoints (0: after every step).
    pub checkpoint_seconds: f64,
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
            seed: 0,
            checkpoint_seconds: 300.0,
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
}

/// One training example in the filter layout: every passage one chunk, labelled by `positive`.
pub fn filter_example(model: &Model, ex: &BaseExample, index: usize) -> Result<(FilterExample, QaPositions)> {
    anyhow::ensure!(!ex.passages.is_empty(), "an example without passages");
    anyhow::ensure!(
        !ex.positive.is_empty() && ex.positive.iter().all(|&i| i < ex.passages.len()),
        "an example's positive passages must be a non-empty set of its passage indices"
    );
    let passages = ex.passages.iter().map(|p| model.encode_document(p)).collect::<Result<Vec<_>>>()?;
    let p = filter::passages_prompt(model, &passages, &ex.question)?;
    let positive: Vec<bool> = (0..p.chunks.len()).map(|i| ex.positive.contains(&i)).collect();
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

#[allow(clippy::too_many_arguments)]
/// Trains a prepared base on `examples` (hash `data_hash`); checkpoints go under
/// `out/checkpoint/`. `cancel` is polled between steps: a cancelled run writes a checkpoint and
/// returns its partial base with `report.stopped`.
pub fn prepare(
    model: &Model,
    examples: &[BaseExample],
    data_hash: &str,
    opts: &PrepareOptions,
    out: &Path,
    resume: bool,
    on_progress: &mut dyn FnMut(&PrepareProgress),
    cancel: &dyn Fn() -> bool,
) -> Result<(PreparedBase, PrepareReport)> {
    anyhow::ensure!(!examples.is_empty(), "no training examples");
    let mut base = PreparedBase::new(model, &opts.shape, opts.seed)?;
    let prepared =
        examples.iter().enumerate().map(|(i, ex)| filter_example(model, ex, i)).collect::<Result<Vec<_>>>()?;
    let train_opts = opts.train_options();
    let mut lora_opt = AdamW::new(base.lora.vars().to_vec(), &train_opts)?;
    let mut filter_opt = AdamW::new(base.filter.vars().to_vec(), &train_opts)?;
    let mut report = PrepareReport::default();
    let mut step = 0;
    let ckpt = out.join(CHECKPOINT_DIR);
    if resume {
        let (state, restored, [l, f]) = read_checkpoint(&ckpt, model, &base)?;
        if state.options != *opts || state.data_hash != data_hash {
            bail!(
                "{}: the checkpoint was made with other options or other data; start afresh without --resume",
                ckpt.display()
            );
        }
        (base, lora_opt, filter_opt) = (restored, l, f);
        step = state.step;
        report = PrepareReport { steps_this_run: 0, ..state.report };
        tracing::info!(step, "resumed from checkpoint");
    }
    let n = prepared.len();
    let steps = opts.epochs * n;
    let ft = FilterTraining {
        filter: &base.filter,
        examples: &[],
        lambda: opts.shape.filter.lambda,
        margin: opts.shape.filter.margin,
        lr_scale: opts.filter_lr_scale,
    };
    let mut cdt_stats = report.cdt.clone().unwrap_or_default();
    let t0 = Instant::now();
    let mut last_ckpt = Instant::now();
    report.stopped = false;
    while step < steps {
        if cancel() {
            report.stopped = true;
            break;
        }
        let epoch = step / n;
        // Each epoch's order derives from the seed alone, so a resumed run takes the same path.
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut Plan::rng(opts.seed.wrapping_add(epoch as u64)));
        let (fx, qp) = &prepared[order[step % n]];
        let cdt = opts.cdt.enabled.then_some((opts.cdt.relative_move, qp));
        // Without the filter (an ablation arm) its parameters stay at zero: the mask is inert.
        let filter = opts.shape.filter.enabled.then_some((&ft, fx));
        let (loss, flt) = trainer::training_loss(model, &base.lora, &fx.example, filter, cdt, &mut cdt_stats, None)?;
        let vars: Vec<_> = base.lora.vars().iter().chain(base.filter.vars()).cloned().collect();
        let mut grads = trainer::gradients(&loss, &vars)?;
        let filter_grads = grads.split_off(base.lora.vars().len());
        lora_opt.step(&trainer::clip(grads, train_opts.max_grad_norm)?, opts.lr)?;
        filter_opt.step(&trainer::clip(filter_grads, train_opts.max_grad_norm)?, opts.lr * opts.filter_lr_scale)?;
        let loss = loss.to_scalar::<f32>()? as f64;
        let filter_loss = flt.map(|f| f.to_scalar::<f32>()).transpose()?.unwrap_or(0.0) as f64;
        report.step_losses.push(loss);
        report.filter_losses.push(filter_loss);
        step += 1;
        report.steps = step;
        report.steps_this_run += 1;
        if step % n == 0 {
            let from = report.step_losses.len() - n.min(report.step_losses.len());
            report.epoch_losses.push(report.step_losses[from..].iter().sum::<f64>() / n as f64);
            tracing::info!(epoch = epoch + 1, loss = report.epoch_losses.last(), "epoch done");
        }
        on_progress(&PrepareProgress { step, steps, epoch: epoch + 1, loss, filter_loss });
        if opts.cdt.enabled {
            report.cdt = Some(cdt_stats.clone());
        }
        if step < steps && last_ckpt.elapsed().as_secs_f64() >= opts.checkpoint_seconds {
            write_checkpoint(&ckpt, &base, &lora_opt, &filter_opt, opts, data_hash, step, &report)?;
            last_ckpt = Instant::now();
        }
    }
    report.seconds += t0.elapsed().as_secs_f64();
    if report.stopped {
        write_checkpoint(&ckpt, &base, &lora_opt, &filter_opt, opts, data_hash, step, &report)?;
    }
    if let Some(c) = &report.cdt {
        tracing::info!(
            relative_move = c.mean_relative_shift,
            loss_ratio = c.mean_loss_ratio,
            critical = c.critical,
            "cdt"
        );
    }
    base.manifest.seed = opts.seed;
    base.manifest.data_hash = data_hash.to_string();
    base.manifest.training = serde_json::to_value(&report)?;
    Ok((base, report))
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

#[allow(clippy::too_many_arguments)]
fn write_checkpoint(
    dir: &Path,
    base: &PreparedBase,
    lora_opt: &AdamW,
    filter_opt: &AdamW,
    options: &PrepareOptions,
    data_hash: &str,
    step: usize,
    report: &PrepareReport,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let mut tensors = base.named_tensors()?;
    for (name, opt) in [("lora", lora_opt), ("filter", filter_opt)] {
        let (m, v, t) = opt.state();
        for (i, (m, v)) in m.iter().zip(v).enumerate() {
            tensors.insert(format!("optimizer.{name}.{i}.m"), m.clone());
            tensors.insert(format!("optimizer.{name}.{i}.v"), v.clone());
        }
        tensors.insert(format!("optimizer.{name}.t"), Tensor::new(&[t as u32], base.filter.w.device())?);
    }
    let tmp = dir.join(format!(".{TENSORS_FILE}.tmp"));
    candle_core::safetensors::save(&tensors, &tmp)?;
    std::fs::rename(&tmp, dir.join(TENSORS_FILE))?;
    let state =
        CheckpointState { options: options.clone(), data_hash: data_hash.to_string(), step, report: report.clone() };
    super::write_json(&dir.join(STATE_FILE), &state)?;
    tracing::info!(step, dir = %dir.display(), "checkpoint written");
    Ok(())
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
    let mut moments = Vec::new();
    for name in ["lora", "filter"] {
        let mut take = |k: String| tensors.remove(&k).with_context(|| format!("checkpoint lacks {k}"));
        let t = take(format!("optimizer.{name}.t"))?.to_vec1::<u32>()?[0] as usize;
        let (mut m, mut v) = (Vec::new(), Vec::new());
        let mut i = 0;
        while let (Ok(a), Ok(b)) = (take(format!("optimizer.{name}.{i}.m")), take(format!("optimizer.{name}.{i}.v"))) {
            m.push(a);
            v.push(b);
            i += 1;
        }
        moments.push((m, v, t));
    }
    let (lora, filter) = PreparedBase::from_tensors(model, &base.manifest.lora, tensors, true)?;
    let train_opts = state.options.train_options();
    let mut opts = [AdamW::new(lora.vars().to_vec(), &train_opts)?, AdamW::new(filter.vars().to_vec(), &train_opts)?];
    for (opt, (m, v, t)) in opts.iter_mut().zip(moments) {
        opt.restore(m, v, t)?;
    }
    Ok((state, PreparedBase { lora, filter, manifest: base.manifest.clone() }, opts))
}
