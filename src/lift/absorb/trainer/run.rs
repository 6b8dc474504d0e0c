//! The training loop: epochs of both stages drawn from the seeded stream, batches of rows with
//! their gradients accumulated, an optimizer step each, progress, early stopping, checkpoints
//! and resuming from one.

use super::checkpoint::{Cursor, LongRun, TrainCheckpoint};
use super::loss::{training_loss, FrozenCache, FROZEN_CACHE_BYTES};
use super::optim::Optimizers;
use super::rows;
use super::until_learned::{Focus, UntilLearnedRun};
use super::{gradients, FilterTraining, Patience, Probes, Progress, RunControl, Stage, TrainInputs, TrainOptions, TrainReport};
use crate::lift::absorb::plan::{Plan, PlanRng};
use crate::model::Model;
use anyhow::Result;
use candle_core::{Tensor, Var};
use rand::seq::SliceRandom;
use std::time::Instant;

/// [`train_with`](super::train_with), checkpointed and resumable through `long.checkpoints`, stopped at
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
        rng: Plan::rng(opts.seed),
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
                    return Err(crate::lift::absorb::cancelled::Cancelled("training").into());
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
    rng: PlanRng,
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
            let example = match (fx_of(is_qa, i), is_qa) {
                (Some((_, fx)), _) => fx.example.clone(),
                (None, true) => plan.qa[i].clone(),
                (None, false) => plan.segments_example(model, doc, &seg_members[i], &mut self.rng)?,
            };
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
            let (loss, _) = training_loss(model, adapter, example, fx_of(is_qa, i), cached)?;
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
