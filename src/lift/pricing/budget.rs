//! Absorbs within a time budget (`budget_seconds`): the plan is fitted to the budget before the
//! absorb starts, at the rate the server measured on its finished absorbs, by giving up the least
//! useful training first; the choices are said. While it trains, the budget is also a deadline:
//! should the rate prove optimistic, training stops at the budget and keeps what it has learned.
//!
//! What is given up, in order (each on top of the ones before; the first plan within the budget
//! is taken): epochs over the segments alone, down to one; epochs over segments + QA, down to two;
//! the segments' overlap (stride = window: each token trained once per epoch, not 8/3 times);
//! the last QA epochs, down to one; the segment-only stage; then QA pairs, halved, down to the
//! options' floor. The QA stage is kept longest: questions about the document are what the answers
//! are measured on (docs/evaluation.md). A plan cut below the epochs the head-and-tail layout of
//! the questions needs ([`MIN_EPOCHS`]) trains them on their own passages instead: one epoch of
//! questions behind the head and tail made adapters that answer worse than the passages alone (15
//! against 22 of 45 validation questions at 1K tokens; 1 against 16 of 30 at 16K under a
//! 15-minute budget), one epoch on their passages did not (26 against 22; 14 against 16 of 30).

use super::estimate::{plan_counts, too_few_epochs, AbsorbRate, MIN_EPOCHS};
use crate::lift::absorb::plan::QaLayout;
use crate::lift::options::AbsorbOptions;

/// The options fitted to a budget, and what was given up for it.
#[derive(Clone, Debug)]
pub struct Fit {
    pub options: AbsorbOptions,
    /// What was changed, in words (`"segment-only epochs 3 → 1"`), in the order it was given up.
    pub dropped: Vec<String>,
    /// The estimate of the fitted plan, in seconds.
    pub seconds: f64,
    /// The estimate of the plan as asked, in seconds.
    pub asked_seconds: f64,
    /// Whether the fitted plan's estimate is within the budget (false: even the least plan is
    /// over it; training then stops at the budget).
    pub met: bool,
}

/// `opts` fitted to its own `budget_seconds` (unchanged without one) for a document of
/// `doc_tokens` tokens and `qa_pairs` QA pairs at most, at `rate`. `one_question_per_row`: the
/// prepared base's filter lays out QA rows one question each.
pub fn fit(opts: &AbsorbOptions, doc_tokens: usize, qa_pairs: usize, one_question_per_row: bool, rate: &AbsorbRate) -> Fit {
    let seconds_of = |o: &AbsorbOptions| {
        let counts = plan_counts(doc_tokens, qa_pairs.min(o.qa.max_pairs), o, one_question_per_row);
        rate.estimate(counts).seconds
    };
    let asked_seconds = seconds_of(opts);
    let mut fit = Fit { options: opts.clone(), dropped: Vec::new(), seconds: asked_seconds, asked_seconds, met: true };
    let Some(budget) = opts.budget_seconds else { return fit };
    let mut over = None;
    for step in ladder(opts, doc_tokens, qa_pairs) {
        if fit.seconds <= budget {
            break;
        }
        over = Some(std::mem::replace(&mut fit.options, step));
        fit.seconds = seconds_of(&fit.options);
    }
    // QA pairs are halved on the way down: take back as many as the budget holds (the last
    // rung over it differs from the one taken in the pairs alone).
    let only_pairs = |o: &AbsorbOptions| {
        o.train.epochs == fit.options.train.epochs && o.plan.stride == fit.options.plan.stride
    };
    if let Some(over) = over.filter(|o| fit.seconds <= budget && only_pairs(o)) {
        let (mut fits, mut too_many) = (fit.options.qa.max_pairs, over.qa.max_pairs.min(qa_pairs));
        while too_many > fits + 1 {
            let mid = (fits + too_many) / 2;
            let mut o = fit.options.clone();
            o.qa.max_pairs = mid;
            if seconds_of(&o) <= budget {
                fits = mid;
            } else {
                too_many = mid;
            }
        }
        fit.options.qa.max_pairs = fits;
        fit.seconds = seconds_of(&fit.options);
    }
    let cut = fit.options.train.epochs != opts.train.epochs;
    if cut && fit.options.plan.qa_layout == QaLayout::HeadTail && too_few_epochs(fit.options.train.epochs, QaLayout::HeadTail) {
        // Same rows, same tokens: only their context changes.
        fit.options.plan.qa_layout = QaLayout::Passages;
        fit.seconds = seconds_of(&fit.options);
    }
    fit.dropped = given_up(opts, &fit.options, qa_pairs);
    fit.met = fit.seconds <= budget;
    fit
}

/// The plans from `opts` down to the least, each cheaper than the one before.
fn ladder(opts: &AbsorbOptions, doc_tokens: usize, qa_pairs: usize) -> Vec<AbsorbOptions> {
    let mut out = Vec::new();
    let mut o = opts.clone();
    let [e0, e1] = o.train.epochs;
    let has_qa = e1 > 0;
    // Segment-only epochs down to one (the only stage, when there is no QA stage).
    for e in (1..e0).rev() {
        o.train.epochs[0] = e;
        out.push(o.clone());
    }
    for e in (2..e1).rev() {
        o.train.epochs[1] = e;
        out.push(o.clone());
    }
    if o.plan.stride() < o.plan.window && doc_tokens > o.plan.window {
        o.plan.stride = Some(o.plan.window);
        out.push(o.clone());
    }
    if o.train.epochs[1] > 1 {
        o.train.epochs[1] = 1;
        out.push(o.clone());
    }
    if has_qa && o.train.epochs[0] > 0 {
        o.train.epochs[0] = 0;
        out.push(o.clone());
    }
    let floor = o.qa.min_pairs.max(1);
    let mut cap = o.qa.max_pairs.min(qa_pairs);
    while has_qa && cap / 2 >= floor {
        cap /= 2;
        o.qa.max_pairs = cap;
        o.qa.min_pairs = o.qa.min_pairs.min(cap);
        out.push(o.clone());
    }
    out
}

/// What `fitted` gives up of `asked`, in words.
fn given_up(asked: &AbsorbOptions, fitted: &AbsorbOptions, qa_pairs: usize) -> Vec<String> {
    let mut out = Vec::new();
    if asked.train.epochs != fitted.train.epochs {
        out.push(format!("epochs {:?} → {:?}", asked.train.epochs, fitted.train.epochs));
    }
    if asked.plan.stride() != fitted.plan.stride() {
        out.push(format!("segment overlap dropped (stride {} → {} tokens)", asked.plan.stride(), fitted.plan.stride()));
    }
    let pairs = |o: &AbsorbOptions| o.qa.max_pairs.min(qa_pairs);
    if pairs(asked) != pairs(fitted) {
        out.push(format!("QA pairs {} → {}", pairs(asked), pairs(fitted)));
    }
    if asked.plan.qa_layout != fitted.plan.qa_layout {
        out.push(format!(
            "the questions trained on their own passages (behind the head and tail they need epochs {MIN_EPOCHS:?} or more)"
        ));
    }
    out
}

/// The budget's warning: what was given up, or that the budget cannot be met.
pub fn warning(fit: &Fit, budget: f64) -> Option<super::estimate::OptionWarning> {
    if fit.dropped.is_empty() && fit.met {
        return None;
    }
    let message = if fit.met {
        format!(
            "fitted to the budget of {budget:.0} s (the options asked for ~{:.0} s): {}; estimated {:.0} s",
            fit.asked_seconds,
            fit.dropped.join(", "),
            fit.seconds
        )
    } else {
        format!(
            "the budget of {budget:.0} s cannot be met: the least plan ({}) is estimated at {:.0} s; training stops at the \
             budget with what it has learned",
            fit.dropped.join(", "),
            fit.seconds
        )
    };
    Some(super::estimate::OptionWarning { code: "budget", param: "options.budget_seconds", message })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(budget: Option<f64>) -> AbsorbOptions {
        let mut o = AbsorbOptions::default();
        o.train.epochs = [3, 5];
        o.budget_seconds = budget;
        o
    }

    #[test]
    fn a_budget_gives_up_epochs_then_overlap_then_qa_and_says_so() {
        let rate = AbsorbRate::default();
        let (tokens, pairs) = (16_000, 256);
        let asked = fit(&options(None), tokens, pairs, true, &rate);
        assert!(asked.dropped.is_empty() && asked.met);
        // Every budget below the asked plan's estimate gets a plan within it, until the least plan.
        let least = fit(&options(Some(1.0)), tokens, pairs, true, &rate);
        assert!(!least.met && least.seconds > 1.0);
        assert_eq!(least.options.train.epochs, [0, 1]);
        assert_eq!(least.options.plan.stride, Some(least.options.plan.window));
        for frac in [0.9, 0.6, 0.4, 0.25, 0.1] {
            let budget = asked.seconds * frac;
            let f = fit(&options(Some(budget)), tokens, pairs, true, &rate);
            if budget >= least.seconds {
                assert!(f.met && f.seconds <= budget, "{frac}: {f:?}");
            }
            assert!(!f.dropped.is_empty(), "{frac}: something was given up");
            // Epochs go first: the segment-only ones.
            assert!(f.dropped[0].starts_with("epochs [3, 5] → ["), "{:?}", f.dropped);
            assert!(f.options.train.epochs[0] < 3, "{:?}", f.options.train.epochs);
            let w = warning(&f, budget).unwrap();
            assert_eq!(w.param, "options.budget_seconds");
        }
        // Cut below [2, 3], the questions leave the head-and-tail layout for their own passages,
        // at the same cost; a plan cut less keeps the layout.
        assert_eq!(least.options.plan.qa_layout, QaLayout::Passages);
        assert!(least.dropped.iter().any(|d| d.starts_with("the questions trained on their own passages")), "{:?}", least.dropped);
        let mut same_epochs = least.options.clone();
        same_epochs.plan.qa_layout = QaLayout::HeadTail;
        assert_eq!(rate.estimate(plan_counts(tokens, pairs.min(same_epochs.qa.max_pairs), &same_epochs, true)).seconds, least.seconds);
        let mild = fit(&options(Some(asked.seconds * 0.9)), tokens, pairs, true, &rate);
        assert!(!too_few_epochs(mild.options.train.epochs, QaLayout::HeadTail), "{:?}", mild.options.train.epochs);
        assert_eq!(mild.options.plan.qa_layout, QaLayout::HeadTail);
        // A plan asked with too few epochs is not the budget's to change.
        let mut short = options(Some(1.0));
        short.train.epochs = [0, 1];
        assert_eq!(fit(&short, tokens, pairs, true, &rate).options.plan.qa_layout, QaLayout::HeadTail);
        // A budget the asked plan fits changes nothing.
        let roomy = fit(&options(Some(asked.seconds * 1.01)), tokens, pairs, true, &rate);
        assert!(roomy.dropped.is_empty() && roomy.met);
        assert_eq!(roomy.options.train.epochs, [3, 5]);
        assert!(warning(&roomy, asked.seconds * 1.01).is_none());
    }

    #[test]
    fn pairs_given_up_are_taken_back_up_to_the_budget() {
        // A 64K-token document (4,199 pairs) in 30 minutes at the prior rate: the halving alone
        // left a third of the budget unused (1,049 pairs, ~1,195 s).
        let rate = AbsorbRate::default();
        let f = fit(&options(Some(1800.0)), 65_596, 4_199, true, &rate);
        assert!(f.met && f.seconds <= 1800.0 && f.seconds > 0.97 * 1800.0, "{f:?}");
        assert!(f.options.qa.max_pairs > 1_049 && f.options.qa.max_pairs < 4_199, "{}", f.options.qa.max_pairs);
        // One more pair is over the budget.
        let mut more = f.options.clone();
        more.qa.max_pairs += 1;
        assert!(rate.estimate(plan_counts(65_596, more.qa.max_pairs, &more, true)).seconds > 1800.0);
    }

    #[test]
    fn each_rung_costs_less_than_the_one_before() {
        let rate = AbsorbRate::default();
        let o = options(Some(1.0));
        let mut last = f64::INFINITY;
        let steps = ladder(&o, 16_000, 256);
        assert!(steps.len() >= 8, "{}", steps.len());
        for step in steps {
            let s = rate.estimate(plan_counts(16_000, 256.min(step.qa.max_pairs), &step, true)).seconds;
            assert!(s < last, "{:?}: {s} s is not below {last} s", given_up(&o, &step, 256));
            last = s;
        }
    }
}
