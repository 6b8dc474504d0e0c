//! Self-gating: a `lift` answer (the adapter over the passages) is compared with the answer the
//! same prompt gets without the adapter (the passages alone, `rag`), and the likelier one is
//! kept: the passages' when the mean log-probability of its tokens beats the adapter's by more
//! than [`GATE_MARGIN`]. Where the adapter learned a wrong association (a frequent term of the
//! document, a heading) the passages' answer is usually the surer one; where it recalls a fact
//! the passages do not show, its own. The server runs both in one batch, the CLI one after the
//! other; the evaluation tables every margin offline (`eval::gating`) with this rule.

use super::{answer, Answer, Ask, Mode};
use crate::document::Document;
use crate::model::generate::SamplingParams;
use crate::model::{Adapter, Model};
use anyhow::Result;
use serde::Serialize;

/// The margin of the rule, chosen on both validation splits under the default `linked` context
/// (docs/real-text.md, "Self-gating over the linked passages"): margins −0.5 / −0.25 / 0 / +0.25 /
/// +0.5 answered 67 / 67 / **70** / 68 / 69 of the 145 real and planted validation questions,
/// always the adapter 66.
pub const GATE_MARGIN: f64 = 0.0;

/// Which answer a gated `lift` answer kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum AnswerSource {
    /// The adapter over the passages.
    Adapter,
    /// The passages alone (the answer `rag` gives).
    Passages,
}

/// Whether the rule at `margin` keeps the passages' answer, of mean token log-probability
/// `passages_mean`, over the adapter's (`adapter_mean`). −∞: always the passages; +∞: always
/// the adapter.
pub fn keeps_passages(adapter_mean: f64, passages_mean: f64, margin: f64) -> bool {
    margin == f64::NEG_INFINITY || (margin != f64::INFINITY && passages_mean > adapter_mean + margin)
}

/// The shipped rule on two answers' mean token log-probabilities (None: no token, an empty
/// answer, which never wins over one with tokens; two empty answers keep the adapter's).
pub fn choose(adapter_mean: Option<f64>, passages_mean: Option<f64>) -> AnswerSource {
    match (adapter_mean, passages_mean) {
        (Some(a), Some(p)) if keeps_passages(a, p, GATE_MARGIN) => AnswerSource::Passages,
        (None, Some(_)) => AnswerSource::Passages,
        _ => AnswerSource::Adapter,
    }
}

/// Answers `ask` in `lift` with `adapter` and without it, one after the other, and keeps the one
/// the rule chooses (how the CLI answers; the server runs the two in one batch). Any other mode,
/// or no adapter, answers once ([`answer`]) and says who answered: the adapter when it was used.
pub fn answer_gated(
    model: &Model,
    doc: &Document,
    adapter: Option<&dyn Adapter>,
    ask: &Ask,
    params: &SamplingParams,
) -> Result<(Answer, Option<AnswerSource>)> {
    let Some(adapter) = adapter.filter(|_| ask.mode == Mode::Lift) else {
        let used = adapter.is_some() && ask.mode.uses_adapter();
        return Ok((answer(model, doc, adapter, ask, params, &mut |_| true)?, used.then_some(AnswerSource::Adapter)));
    };
    let with = answer(model, doc, Some(adapter), ask, params, &mut |_| true)?;
    let passages_ask = Ask { mode: Mode::Rag, ..*ask };
    let without = answer(model, doc, None, &passages_ask, params, &mut |_| true)?;
    Ok(match choose(with.generation.mean_logprob(), without.generation.mean_logprob()) {
        AnswerSource::Adapter => (with, Some(AnswerSource::Adapter)),
        AnswerSource::Passages => (without, Some(AnswerSource::Passages)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_decides_between_the_answers() {
        assert!(keeps_passages(-1.0, -0.2, 0.5));
        assert!(!keeps_passages(-1.0, -0.6, 0.5));
        assert!(keeps_passages(0.0, -9.0, f64::NEG_INFINITY));
        assert!(!keeps_passages(-9.0, 0.0, f64::INFINITY));
    }

    #[test]
    fn the_surer_answer_is_kept_and_a_tie_keeps_the_adapters() {
        assert_eq!(choose(Some(-0.9), Some(-0.3)), AnswerSource::Passages);
        assert_eq!(choose(Some(-0.3), Some(-0.9)), AnswerSource::Adapter);
        assert_eq!(choose(Some(-0.5), Some(-0.5)), AnswerSource::Adapter);
        assert_eq!(choose(None, Some(-2.0)), AnswerSource::Passages);
        assert_eq!(choose(Some(-2.0), None), AnswerSource::Adapter);
        assert_eq!(choose(None, None), AnswerSource::Adapter);
    }
}
