//! Absorb until learned (see [`UntilLearned`]): the rule's options, the held-aside probes, which
//! examples an epoch trains (`Focus`), the cool-down, and the rule's state over one run
//! (`UntilLearnedRun`), which `train_with` consults after every optimizer step. A checkpoint keeps
//! both (`UntilLearnedState`), so an absorb until learned resumes as every other absorb does.

use super::{training_loss, EarlyStop, FilterTraining, Patience, TrainReport};
use crate::lift::absorb::plan::Example;
use crate::model::{Adapter, Model};
use anyhow::Result;
use serde::{Deserialize, Serialize};

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
#[derive(Clone)]
pub(super) struct Focus {
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
    pub(super) fn new(rule: Option<&UntilLearned>, n_seg: usize, n_qa: usize) -> Self {
        let (learned_loss, revisit_every) = rule.map_or((0.0, 1), |r| (r.learned_loss, r.revisit_every.max(1)));
        Self { learned_loss, revisit_every, segments: vec![Visit::default(); n_seg], qa: vec![Visit::default(); n_qa] }
    }

    /// Whether epoch `epoch` trains example `i`: never seen, not yet learned, or due for a revisit.
    pub(super) fn wants(&self, is_qa: bool, i: usize, epoch: usize) -> bool {
        let v = if is_qa { self.qa[i] } else { self.segments[i] };
        match v.loss {
            None => true,
            Some(loss) => loss >= self.learned_loss || epoch >= v.epoch + self.revisit_every,
        }
    }

    pub(super) fn book(&mut self, is_qa: bool, i: usize, loss: f64, epoch: usize) {
        let v = if is_qa { &mut self.qa[i] } else { &mut self.segments[i] };
        *v = Visit { loss: Some(loss), epoch };
    }

    /// The visits, for a checkpoint.
    pub(super) fn state(&self) -> FocusState {
        let visits = |v: &[Visit]| v.iter().map(|v| (v.loss, v.epoch)).collect();
        FocusState { segments: visits(&self.segments), qa: visits(&self.qa) }
    }

    /// Back to a checkpoint's visits: of the same plan, or refused.
    pub(super) fn restore(&mut self, s: &FocusState) -> Result<()> {
        anyhow::ensure!(
            s.segments.len() == self.segments.len() && s.qa.len() == self.qa.len(),
            "the checkpoint's until-learned visits are of {} segments and {} QA pairs, this plan's of {} and {}",
            s.segments.len(),
            s.qa.len(),
            self.segments.len(),
            self.qa.len()
        );
        let visits = |v: &[(Option<f64>, usize)]| v.iter().map(|&(loss, epoch)| Visit { loss, epoch }).collect();
        self.segments = visits(&s.segments);
        self.qa = visits(&s.qa);
        Ok(())
    }
}

/// [`Focus`]'s visits in a checkpoint: (loss at the last visit, its epoch) per segment and pair.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FocusState {
    segments: Vec<(Option<f64>, usize)>,
    qa: Vec<(Option<f64>, usize)>,
}

/// What a checkpoint keeps of an absorb until learned, beside the probe curve and cool-down its
/// report already holds: the rule's moving average and plateau count, the cool-down or decay
/// begun, and the examples' visits as the epoch in progress was drawn (its redraw needs them) and
/// now. Restored, a run probes, cools down and skips where an uninterrupted one does.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct UntilLearnedState {
    probe_best: Option<f64>,
    probes_since_best: usize,
    probe_loss: Option<f64>,
    probe_avg: Option<f64>,
    /// (first step, steps) of the cool-down and of the decay, where begun.
    cooldown: Option<(usize, usize)>,
    decay: Option<(usize, usize)>,
    pub(super) focus_at_draw: FocusState,
    pub(super) focus: FocusState,
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
        for (i, example) in self.examples.iter().enumerate() {
            let fx = self.filter.as_ref().map(|ft| (ft, &ft.examples[i]));
            let example = fx.map_or(example, |(_, fx)| &fx.example);
            let (loss, _) = training_loss(model, adapter, example, fx, None)?;
            sum += loss.to_scalar::<f32>()? as f64;
        }
        Ok(sum / self.examples.len().max(1) as f64)
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
#[derive(Clone, Copy, Debug, PartialEq)]
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

/// The until-learned rule over one `train_with` run: its probes, step budget and probe spacing,
/// the probe curve's moving average and plateau count, and the cool-down or decay once begun.
/// Without a rule (or without probes) it never probes, scales nothing and never stops a run.
pub(super) struct UntilLearnedRun<'a> {
    rule: Option<(&'a UntilLearned, &'a Probes<'a>)>,
    /// The rule's step budget and probe spacing, fixed by the planned schedule.
    ceiling: usize,
    probe_interval: usize,
    probed: Patience,
    /// The latest probe loss, and the moving average of the probe losses the rule reads.
    probe_loss: Option<f64>,
    probe_avg: Option<f64>,
    cooldown: Option<Cooldown>,
    /// `UntilLearned::decay`: the budget's planned fall of the learning rate, beside `cooldown`.
    decay: Option<Cooldown>,
}

impl<'a> UntilLearnedRun<'a> {
    /// `rule` over a run of a fixed schedule of `planned` optimizer steps, probed on `probes`.
    pub(super) fn new(rule: Option<&'a UntilLearned>, probes: Option<&'a Probes<'a>>, planned: usize) -> Self {
        let rule = rule.zip(probes.filter(|p| !p.examples.is_empty()));
        let (ceiling, probe_interval) =
            rule.map_or((planned, 1), |(r, _)| (r.ceiling(planned), r.probe_interval(planned)));
        Self {
            rule,
            ceiling,
            probe_interval,
            probed: Patience { best: f64::INFINITY, since_best: 0 },
            probe_loss: None,
            probe_avg: None,
            cooldown: None,
            decay: None,
        }
    }

    /// The latest probe loss.
    pub(super) fn probe_loss(&self) -> Option<f64> {
        self.probe_loss
    }

    /// The learning rate's factor at 0-based optimizer step `step`: the cool-down's and the
    /// decay's, where begun.
    pub(super) fn lr_scale(&self, step: usize) -> f64 {
        [self.cooldown, self.decay].iter().flatten().map(|c| c.lr_scale(step)).product()
    }

    /// After optimizer step `report.steps` (its mean loss `train_loss`, in epoch `epoch`): the
    /// probes when a round is due, then, in the last stage (`last_stage`), the budget's decay or a
    /// cool-down when one begins. Books the probe curve and the cool-down in `report`.
    pub(super) fn after_step(
        &mut self,
        model: &Model,
        adapter: &dyn Adapter,
        last_stage: bool,
        epoch: usize,
        train_loss: f64,
        report: &mut TrainReport,
    ) -> Result<()> {
        let Some((rule, probes)) = self.rule else { return Ok(()) };
        let mut plateau = false;
        if report.steps % self.probe_interval == 0 {
            let loss = probes.loss(model, adapter)?;
            report.probe_curve.push((report.steps, loss));
            let avg = self.probe_avg.map_or(loss, |a| a + rule.smoothing.clamp(0.0, 1.0) * (loss - a));
            self.probe_avg = Some(avg);
            tracing::info!(
                step = report.steps,
                planned = report.planned_steps,
                epoch,
                probe_loss = loss,
                probe_avg = avg,
                train_loss,
                "probe"
            );
            self.probe_loss = Some(loss);
            let rule_as_patience =
                EarlyStop { patience: rule.patience, min_delta: rule.min_delta * self.probed.best.min(avg) };
            // Only in the last stage, and counted from its start: the probes are
            // questions, which the QA stage teaches to answer; a plateau over segments
            // alone says nothing about that (counted through the first stage, a long one
            // stopped a 2K document at the QA stage's first probe).
            plateau = last_stage
                && self.probed.exhausted(Some(&rule_as_patience), avg)
                && report.steps >= rule.min_steps;
        }
        // The budget too only in the last stage: a run cut inside the first would never
        // see a question.
        if last_stage {
            let ceiling = self.ceiling;
            if rule.decay && self.decay.is_none() {
                let d = Cooldown { start: report.steps, steps: ceiling.saturating_sub(report.steps) };
                tracing::info!(
                    step = report.steps,
                    decay_steps = d.steps,
                    ceiling,
                    "the learning rate decays to the budget"
                );
                self.decay = Some(d);
                report.cooldown_from = Some(report.steps);
                report.cooldown_cause = Some(CooldownCause::Budget);
            }
            let begun =
                self.cooldown.is_none().then(|| Cooldown::begin(rule, report.steps, plateau, ceiling)).flatten();
            // With the decay the budget is already planned: only a plateau begins a cool-down.
            if let Some((c, cause)) = begun.filter(|(_, cause)| !rule.decay || *cause == CooldownCause::Plateau) {
                tracing::info!(step = report.steps, cooldown_steps = c.steps, ?cause, ceiling, "cooling down");
                self.cooldown = Some(c);
                report.cooldown_from = Some(report.steps);
                report.cooldown_cause = Some(cause);
            }
        }
        Ok(())
    }

    /// The rule's state for a checkpoint, with the visits `focus_at_draw` (as the epoch in progress
    /// was drawn) and `focus` (now).
    pub(super) fn state(&self, focus_at_draw: FocusState, focus: &Focus) -> UntilLearnedState {
        let pair = |c: Option<Cooldown>| c.map(|c| (c.start, c.steps));
        UntilLearnedState {
            probe_best: self.probed.best.is_finite().then_some(self.probed.best),
            probes_since_best: self.probed.since_best,
            probe_loss: self.probe_loss,
            probe_avg: self.probe_avg,
            cooldown: pair(self.cooldown),
            decay: pair(self.decay),
            focus_at_draw,
            focus: focus.state(),
        }
    }

    /// Back to a checkpoint's state (the visits are restored by the epoch that resumes).
    pub(super) fn restore(&mut self, s: &UntilLearnedState) {
        let cooldown = |c: Option<(usize, usize)>| c.map(|(start, steps)| Cooldown { start, steps });
        self.probed = Patience { best: s.probe_best.unwrap_or(f64::INFINITY), since_best: s.probes_since_best };
        self.probe_loss = s.probe_loss;
        self.probe_avg = s.probe_avg;
        self.cooldown = cooldown(s.cooldown);
        self.decay = cooldown(s.decay);
    }

    /// Whether the cool-down (or the decay) is over after `step` optimizer steps: the run stops.
    pub(super) fn is_over(&self, step: usize) -> bool {
        [self.cooldown, self.decay].iter().flatten().any(|c| step >= c.start + c.steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
