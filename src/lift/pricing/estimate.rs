//! What an absorb will cost, said before it runs: the steps and training tokens its options plan
//! for a document, the time that takes at the server's measured rate, and the options known to
//! under-train (docs/API.md, `dry_run`; measurements behind the rules: docs/absorb-estimate.md).
//! [`estimate`] is the one price: the service, the server and the CLI ask it rather than adding
//! up steps, tokens or QA pairs themselves; the engine measures the rate against the same count.

use crate::lift::absorb::plan::planned_training_tokens;
use crate::lift::options::AbsorbOptions;
use crate::model::Model;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::{Mutex, OnceLock};
use utoipa::ToSchema;

/// Seconds per planned training token before this server has finished an absorb: the default
/// options' 4K absorb in docs/absorb-speed.md (1,373 s for ~396K planned tokens, 2-core AVX-512
/// CPU). The first finished absorb replaces it.
pub const PRIOR_SECONDS_PER_TOKEN: f64 = 1373.0 / 396_000.0;

/// Seconds an absorb costs whatever its length (QA generation, the adapter's setup, snapshots,
/// saving), before this server has measured its own: the line through docs/absorb-speed.md's
/// absorbs of 1K, 4K and 16K tokens (64.4, 189.0, 442.7 s) meets zero tokens at ~7 s.
pub const PRIOR_OVERHEAD_SECONDS: f64 = 10.0;

/// Finished absorbs the measured rate averages over (the newest; older hardware load fades out).
const RATE_WINDOW: usize = 16;

/// What the options plan for one document.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct Estimate {
    /// Training segments of the document.
    pub segments: usize,
    /// Auxiliary QA pairs trained on (extractive generation is counted exactly before training;
    /// with model-written pairs, the cap).
    pub qa_pairs: usize,
    /// Coverage: document tokens per QA pair (the pairs grow with the document; fewer than one
    /// per ~20 tokens under-trains). None without QA pairs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_qa_pair: Option<f64>,
    /// Optimizer steps (with `until_learned`, the budget's ceiling: a run may stop earlier).
    pub planned_steps: usize,
    /// Tokens through the model over all epochs (unpacked rows: an upper bound with packing).
    pub training_tokens: u64,
    /// Estimated wall time of the absorb (QA generation, training, saving), in seconds:
    /// `overhead_seconds + training_tokens × seconds_per_token`.
    pub seconds: f64,
    /// The rate used: seconds per training token.
    pub seconds_per_token: f64,
    /// The rate used: seconds per absorb whatever its length.
    pub overhead_seconds: f64,
    /// `measured` (the average of this server's finished absorbs); before any has finished,
    /// `calibrated` (a few steps timed on this machine when the server started) or `prior`.
    pub rate: &'static str,
    /// How many finished absorbs the measured rate averages.
    pub measured_absorbs: usize,
}

/// An option value known to under-train, with where that was measured.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct OptionWarning {
    pub code: &'static str,
    /// The request field it is about (`options.epochs`).
    pub param: &'static str,
    pub message: String,
}

/// The most training tokens `o` can plan for a document of `doc_tokens`: QA pairs at the cap for
/// that length (known before any pair is generated; what the server's training cap bounds).
pub fn most_training_tokens(doc_tokens: usize, o: &AbsorbOptions) -> u64 {
    let pairs = o.qa.for_document(doc_tokens).max_pairs;
    planned_training_tokens(doc_tokens, &o.plan, o.train.epochs, pairs)
}

/// Whether `model` trains one question per QA row: its prepared base's filter lays them out
/// unpacked.
pub(crate) fn one_question_per_row(model: &Model) -> bool {
    model.base_filter().is_some()
}

/// The plan's counts for a document of `doc_tokens` with `qa_pairs` generated QA pairs;
/// `one_question_per_row`: the prepared base's filter builds QA rows unpacked.
pub fn plan_counts(doc_tokens: usize, qa_pairs: usize, o: &AbsorbOptions, one_question_per_row: bool) -> (usize, usize, usize, u64) {
    let p = &o.plan;
    let window = p.window.max(1);
    let segments = if doc_tokens <= window { 1 } else { (doc_tokens - window).div_ceil(p.stride()) + 1 };
    let probes = o.train.until_learned.as_ref().map_or(0, |r| r.probe_count(qa_pairs));
    let trained = qa_pairs - probes.min(qa_pairs);
    let qa_rows = if one_question_per_row { trained } else { trained.div_ceil(p.qa_pack.max(1)) };
    let seg_rows = segments.div_ceil(p.segment_pack.max(1));
    let a = o.train.accumulation.max(1);
    let [e0, e1] = o.train.epochs;
    // As the trainer counts them (`EpochRows::steps_total`).
    let full = e0 * seg_rows.div_ceil(a) + e1 * (seg_rows + qa_rows).div_ceil(a);
    let steps = o.train.until_learned.as_ref().map_or(full, |r| r.ceiling(full));
    let tokens = planned_training_tokens(doc_tokens, p, o.train.epochs, trained);
    let tokens = if full == 0 { tokens } else { (tokens as f64 * steps as f64 / full as f64).round() as u64 };
    (segments, trained, steps, tokens)
}

/// The QA pairs an absorb with `o` will train on for `text`: counted by running the extractive
/// generator (deterministic, fast); model-written pairs are only known once written, so with them
/// the cap.
pub fn qa_pairs_planned(text: &str, doc_tokens: usize, o: &AbsorbOptions) -> usize {
    let qa = o.qa.for_document(doc_tokens);
    if qa.use_model {
        qa.max_pairs
    } else {
        crate::lift::absorb::qa::extractive_qa(text, &qa).len()
    }
}

/// Seconds per training token and per absorb measured on this server, over its last
/// [`RATE_WINDOW`] finished absorbs (whole absorbs: QA generation and saving included, so that the
/// estimate is of the wait a user sees): `seconds = overhead + tokens × rate`, fitted by least
/// squares once the absorbs span different lengths; until then the overhead is the prior's and
/// the rate the token-weighted average of what is left of each absorb after it.
#[derive(Default)]
pub struct AbsorbRate {
    done: Mutex<VecDeque<(u64, f64)>>,
    /// Seconds per token measured by a few steps on this machine ([`super::calibrate`]): the rate
    /// before any absorb has finished, in place of the prior. Set once.
    calibrated: OnceLock<f64>,
}

impl AbsorbRate {
    /// Before any absorb has finished, estimates use `seconds_per_token` (a calibration's; None,
    /// or a rate that is not positive: the prior stays).
    pub fn set_calibrated(&self, seconds_per_token: Option<f64>) {
        if let Some(r) = seconds_per_token.filter(|r| r.is_finite() && *r > 0.0) {
            let _ = self.calibrated.set(r);
        }
    }

    /// The rate before any absorb has finished: the calibration's, else the prior.
    fn before_any(&self) -> (f64, f64, usize) {
        (self.calibrated.get().copied().unwrap_or(PRIOR_SECONDS_PER_TOKEN), PRIOR_OVERHEAD_SECONDS, 0)
    }

    /// A finished absorb of `tokens` planned training tokens that took `seconds`.
    pub fn record(&self, tokens: u64, seconds: f64) {
        if tokens == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let Ok(mut d) = self.done.lock() else { return };
        if d.len() == RATE_WINDOW {
            d.pop_front();
        }
        d.push_back((tokens, seconds));
    }

    /// A finished absorb by `model` of `doc_tokens` with `o`, which trained on `qa_pairs` QA pairs,
    /// ran `steps_run` optimizer steps in this process and took `seconds`: measured against the
    /// training tokens its plan counts (as [`estimate`] counts them before the absorb, so that the
    /// two agree), in the share of the planned steps it ran. An absorb stopped by its time budget
    /// or by a plateau, or resumed from another process's checkpoint, ran part of its plan in
    /// those seconds; measured against the whole plan it would make the rate look faster than it is.
    pub fn record_absorb(&self, model: &Model, doc_tokens: usize, qa_pairs: usize, o: &AbsorbOptions, steps_run: usize, seconds: f64) {
        let (_, _, planned_steps, planned_tokens) = plan_counts(doc_tokens, qa_pairs, o, one_question_per_row(model));
        let share = if planned_steps == 0 { 1.0 } else { (steps_run as f64 / planned_steps as f64).min(1.0) };
        self.record((planned_tokens as f64 * share).round() as u64, seconds);
    }

    /// (seconds per token, seconds per absorb, finished absorbs measured; 0: the calibration or
    /// the prior).
    pub fn rate(&self) -> (f64, f64, usize) {
        let Ok(d) = self.done.lock() else { return self.before_any() };
        if d.is_empty() {
            return self.before_any();
        }
        let n = d.len() as f64;
        let (mt, ms) = (d.iter().map(|p| p.0 as f64).sum::<f64>() / n, d.iter().map(|p| p.1).sum::<f64>() / n);
        let var: f64 = d.iter().map(|p| (p.0 as f64 - mt).powi(2)).sum();
        let (lo, hi) = d.iter().fold((u64::MAX, 0), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
        // Lengths at least 1.5× apart say how the time grows; a fit that makes no physical sense
        // (time falling with length, a negative overhead) falls back to the prior's overhead.
        if hi as f64 >= 1.5 * lo as f64 {
            let slope = d.iter().map(|p| (p.0 as f64 - mt) * (p.1 - ms)).sum::<f64>() / var;
            let overhead = ms - slope * mt;
            if slope > 0.0 && overhead >= 0.0 {
                return (slope, overhead, d.len());
            }
        }
        let overhead = PRIOR_OVERHEAD_SECONDS.min(0.5 * d.iter().map(|p| p.1).fold(f64::INFINITY, f64::min));
        let (t, s) = d.iter().fold((0u64, 0.0), |(t, s), &(ti, si)| (t + ti, s + (si - overhead)));
        (s / t as f64, overhead, d.len())
    }

    /// The estimate of an absorb planning these counts.
    pub fn estimate(&self, counts: (usize, usize, usize, u64)) -> Estimate {
        let (segments, qa_pairs, planned_steps, training_tokens) = counts;
        let (rate, overhead, n) = self.rate();
        Estimate {
            segments,
            qa_pairs,
            tokens_per_qa_pair: None,
            planned_steps,
            training_tokens,
            seconds: overhead + training_tokens as f64 * rate,
            seconds_per_token: rate,
            overhead_seconds: overhead,
            rate: match (n, self.calibrated.get().is_some()) {
                (0, true) => "calibrated",
                (0, false) => "prior",
                _ => "measured",
            },
            measured_absorbs: n,
        }
    }
}

/// The least schedule measured to recall facts out of the answer's window: epochs [2, 3] recalled
/// 5/5 on the out-of-window fact test, [1, 2] 2/5 and 0/2 in the window (docs/evaluation.md).
pub const MIN_EPOCHS: [usize; 2] = [2, 3];
/// Whether `epochs` are below the least measured to recall facts with the questions laid out as
/// `layout`: [`MIN_EPOCHS`] behind the head and tail, [1, 2] on their own passages.
pub fn too_few_epochs(epochs: [usize; 2], layout: crate::lift::absorb::plan::QaLayout) -> bool {
    let [e0, e1] = epochs;
    let fewest = if layout == crate::lift::absorb::plan::QaLayout::HeadTail { MIN_EPOCHS } else { [1, 2] };
    e0 + e1 < fewest[0] + fewest[1] || e1 < fewest[1]
}

/// Document tokens per QA pair at the lowest density measured: the fact test trained 80 pairs
/// on 1,453 tokens (one per 18), the default options' 4K absorb 229 on 4,098 (one per 18).
pub const TOKENS_PER_QA_PAIR: usize = 20;

/// The options' values known to under-train a document of `doc_tokens`: an adapter trained so
/// can answer worse than the passages alone (mode `rag`).
pub fn warnings(doc_tokens: usize, o: &AbsorbOptions) -> Vec<OptionWarning> {
    let mut out = Vec::new();
    let [e0, e1] = o.train.epochs;
    // Questions trained on their own passages were measured at [1, 2] above the passages alone
    // (docs/recipe-search.md, the `lean` recipe); the minimum is the head-and-tail layout's.
    let head_tail = o.plan.qa_layout == crate::lift::absorb::plan::QaLayout::HeadTail;
    if too_few_epochs(o.train.epochs, o.plan.qa_layout) {
        out.push(OptionWarning {
            code: "few_epochs",
            param: "options.epochs",
            message: if head_tail {
                format!(
                    "epochs [{e0}, {e1}] train less than [2, 3], the least measured to recall facts (out-of-window fact test: \
                     [2, 3] 5/5, [1, 2] 2/5): the adapter may answer worse than the passages alone"
                )
            } else {
                format!("epochs [{e0}, {e1}] train less than [1, 2], the least measured with questions on their own passages")
            },
        });
    }
    let wanted = doc_tokens.div_ceil(TOKENS_PER_QA_PAIR);
    let cap = o.qa.for_document(doc_tokens).max_pairs;
    if cap < wanted {
        out.push(OptionWarning {
            code: "few_qa_pairs",
            param: "options.aux_qa",
            message: format!(
                "{cap} QA pairs for {doc_tokens} tokens is fewer than one per {TOKENS_PER_QA_PAIR} tokens ({wanted}), below the \
                 densities measured to recall facts (one per 18 tokens): the adapter may answer worse than the passages alone"
            ),
        });
    }
    if o.train.until_learned.is_some() {
        out.push(OptionWarning {
            code: "until_learned",
            param: "options.until_learned",
            message: "absorbing until learned stops at about 40% of the fixed schedule's steps; measured, it recalled fewer \
                      facts (in the answer's window 4/12 against 7/12, docs/until-learned.md)"
                .to_string(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_follow_the_trainer_and_the_rate_replaces_the_calibration_and_the_prior() {
        let mut o = AbsorbOptions::default();
        o.train.epochs = [3, 5];
        o.train.accumulation = 1;
        o.train.until_learned = None;
        // One segment, 69 pairs: 3 × 1 + 5 × (1 + 69) = 353 steps (a 154-word document).
        let (segments, qa, steps, tokens) = plan_counts(200, 69, &o, true);
        assert_eq!((segments, qa, steps), (1, 69, 353));
        assert!(tokens > 0);
        let rate = AbsorbRate::default();
        let e = rate.estimate((segments, qa, steps, tokens));
        assert_eq!((e.rate, e.measured_absorbs), ("prior", 0));
        assert!((e.seconds - PRIOR_OVERHEAD_SECONDS - tokens as f64 * PRIOR_SECONDS_PER_TOKEN).abs() < 1e-9);
        // A calibration replaces the prior's rate (not its overhead) until an absorb finishes.
        rate.set_calibrated(Some(0.0));
        assert_eq!(rate.estimate((segments, qa, steps, tokens)).rate, "prior", "no rate is not a calibration");
        rate.set_calibrated(Some(1e-3));
        let e = rate.estimate((segments, qa, steps, tokens));
        assert_eq!((e.rate, e.measured_absorbs), ("calibrated", 0));
        assert!((e.seconds - PRIOR_OVERHEAD_SECONDS - tokens as f64 * 1e-3).abs() < 1e-9, "{e:?}");
        // One length: the prior's overhead (at most half the shortest absorb), the rest per token.
        rate.record(1000, 30.0);
        let e = rate.estimate((segments, qa, steps, 2000));
        assert_eq!((e.rate, e.measured_absorbs), ("measured", 1));
        assert!((e.seconds - (10.0 + 2000.0 * 0.02)).abs() < 1e-9, "{e:?}");
        // Lengths apart: the line through them (10 s + 5 ms a token).
        rate.record(3000, 25.0);
        rate.record(5000, 35.0);
        let (r, o, n) = rate.rate();
        assert_eq!(n, 3);
        assert!(r > 0.0 && o >= 0.0, "{r} {o}");
        let fresh = AbsorbRate::default();
        fresh.record(1000, 15.0);
        fresh.record(3000, 25.0);
        let e = fresh.estimate((segments, qa, steps, 10_000));
        assert!((e.seconds - 60.0).abs() < 1e-6 && (e.overhead_seconds - 10.0).abs() < 1e-6, "{e:?}");
    }

    #[test]
    fn short_schedules_and_thin_qa_are_flagged() {
        let mut o = AbsorbOptions::default();
        o.train.until_learned = None;
        o.train.epochs = [3, 5];
        assert!(warnings(1000, &o).is_empty(), "the defaults are not flagged");
        o.train.epochs = [1, 1];
        o.qa.max_pairs = 4;
        let codes: Vec<_> = warnings(200, &o).iter().map(|w| w.code).collect();
        assert_eq!(codes, ["few_epochs", "few_qa_pairs"]);
        o.train.epochs = [2, 3];
        o.qa.max_pairs = 10;
        assert!(warnings(200, &o).is_empty(), "[2, 3] and one pair per 20 tokens pass");
        // The lean recipe's [1, 2] on the questions' own passages passes; [0, 1] does not.
        let mut lean = o.clone();
        crate::lift::options::Recipe::Lean.set(&mut lean);
        lean.qa.max_pairs = 10;
        assert!(warnings(200, &lean).is_empty(), "{:?}", warnings(200, &lean));
        lean.train.epochs = [0, 1];
        assert_eq!(warnings(200, &lean).iter().map(|w| w.code).collect::<Vec<_>>(), ["few_epochs"]);
    }
}
