//! The one cost function: what absorbing a document will cost, said before it runs. It asks the
//! estimate (plan counts at the measured rate) and the budget (the options fitted to a time
//! budget); the service, the engine, the server and the CLI ask it, and nothing outside `lift`
//! counts steps, training tokens or QA pairs.

use super::budget;
use super::estimate::{one_question_per_row, plan_counts, qa_pairs_planned, warnings, AbsorbRate, Estimate, OptionWarning};
use crate::lift::options::AbsorbOptions;
use crate::document::Document;
use crate::model::Model;

/// What absorbing a document will cost, said before it runs (`POST /documents`, also `dry_run`).
#[derive(Clone, Debug)]
pub struct Cost {
    /// Document tokens.
    pub tokens: usize,
    /// What the options below plan, at the rate given.
    pub estimate: Estimate,
    /// The options known to under-train; with a time budget, also what it gave up.
    pub warnings: Vec<OptionWarning>,
    /// The options to absorb with: fitted to their `budget_seconds` (as asked without one).
    pub options: AbsorbOptions,
}

/// The cost of absorbing `document` with `o` on `model` at `rate`: the QA pairs counted (the
/// extractive generator runs: blocking), the options fitted to their time budget, and what the
/// fitted plan costs, with its warnings.
pub fn estimate(model: &Model, document: &Document, o: &AbsorbOptions, rate: &AbsorbRate) -> Cost {
    let tokens = document.len();
    let pairs = qa_pairs_planned(&document.text, tokens, o);
    let one_per_row = one_question_per_row(model);
    let fit = budget::fit(o, tokens, pairs, one_per_row, rate);
    let fitted = &fit.options;
    let counts = plan_counts(tokens, pairs.min(fitted.qa.max_pairs), fitted, one_per_row);
    let mut said = warnings(tokens, fitted);
    said.extend(o.budget_seconds.and_then(|b| budget::warning(&fit, b)));
    let mut estimate = rate.estimate(counts);
    estimate.tokens_per_qa_pair = (counts.1 > 0).then(|| tokens as f64 / counts.1 as f64);
    Cost { tokens, estimate, warnings: said, options: fit.options }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lift::pricing::most_training_tokens;

    #[test]
    fn the_one_price_is_the_fitted_plan_and_the_rate_measures_against_it() {
        use crate::testing::{write_hf, TinySpec};
        let dir = tempfile::tempdir().unwrap();
        let model = Model::load(&write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap(), &candle_core::Device::Cpu)
            .unwrap();
        let text = "The harbor was built in 1820 by Ada Lund. The lighthouse was painted red in 1901. ".repeat(30);
        let document = Document::encode(&model, text).unwrap();
        let tokens = document.len();
        let mut o = AbsorbOptions::default();
        o.qa.use_model = false;
        o.budget_seconds = Some(1.0);
        let rate = AbsorbRate::default();
        let cost = estimate(&model, &document, &o, &rate);
        // The parts, added up by hand: the fitted options' counts at the prior rate.
        let pairs = qa_pairs_planned(&document.text, tokens, &o);
        let fit = budget::fit(&o, tokens, pairs, false, &rate);
        assert_eq!(cost.options.train.epochs, fit.options.train.epochs);
        let counts = plan_counts(tokens, pairs.min(fit.options.qa.max_pairs), &fit.options, false);
        assert_eq!((cost.tokens, cost.estimate.planned_steps, cost.estimate.training_tokens), (tokens, counts.2, counts.3));
        assert!((cost.estimate.seconds - fit.seconds).abs() < 1e-9);
        assert!(cost.warnings.iter().any(|w| w.code == "budget"), "{:?}", cost.warnings);
        assert!(most_training_tokens(tokens, &cost.options) >= cost.estimate.training_tokens);
        // A finished absorb of that plan is measured against the tokens the estimate counted.
        rate.record_absorb(&model, tokens, counts.1, &cost.options, counts.2, 2.0 * cost.estimate.seconds);
        let (per_token, overhead, n) = rate.rate();
        assert_eq!(n, 1);
        assert!((overhead + per_token * counts.3 as f64 - 2.0 * cost.estimate.seconds).abs() < 1e-6);
        // An absorb that ran half its planned steps (stopped by its budget, or resumed half-way)
        // in those seconds says the whole plan takes twice as long, not as long.
        let half = AbsorbRate::default();
        let ran = counts.2 / 2;
        assert!(ran > 0, "a plan of {} steps", counts.2);
        let secs = 2.0 * cost.estimate.seconds;
        half.record_absorb(&model, tokens, counts.1, &cost.options, ran, secs);
        let (per_token, overhead, _) = half.rate();
        let whole = overhead + per_token * counts.3 as f64;
        let expected = overhead + (secs - overhead) * counts.2 as f64 / ran as f64;
        assert!((whole - expected).abs() < 1e-3 * expected, "the whole plan: {whole} s, expected {expected} s");
    }
}
