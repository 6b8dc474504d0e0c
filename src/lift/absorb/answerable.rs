//! Auxiliary QA pairs checked against their own evidence: the frozen model with its prepared base
//! reads a pair's evidence sentence alone and answers its question; a pair it cannot answer there
//! is more often ill-formed (a question cut from a heading, a boxed disclaimer, a list) than hard,
//! and training on it teaches the adapter a wrong association. The rule keeps a pair only when the
//! base, reading its evidence, answers it (`pairs`), or keeps a fact's every wording when the base
//! answers at least one of them (`facts`: a fact's wordings share their evidence span, and the
//! adapter needs several wordings of a fact to recall it through a new one; docs/recipe-search.md).
//! Off by default; measured in docs/real-text.md.

use super::qa::{KeepAnswerable, QaPair};
use super::qa_examples::evidence_spans;
use crate::corpus::scoring;
use crate::document::Document;
use crate::lift::answer::answer_reading;
use crate::lift::absorb::cancelled::Cancelled;
use crate::model::generate::SamplingParams;
use crate::model::Model;
use anyhow::Result;
use serde::Serialize;
use std::collections::BTreeSet;
use std::time::Instant;

/// Tokens the base may write for an auxiliary answer (a few words; a longer reply is cut, and
/// still counts when the answer is in it).
const CHECK_ANSWER_TOKENS: usize = 16;

/// What the check did, for logs and the manifest.
#[derive(Clone, Debug, Default, Serialize)]
pub struct AnswerableStats {
    pub checked: usize,
    /// Pairs the base answered from their evidence.
    pub answered: usize,
    pub kept: usize,
    pub seconds: f64,
}

/// Whether `reply` answers with `answer`: the answer in the reply, or most of their words shared
/// (SQuAD's F1 over 0.5: "seen flag" for "the seen flag is set", not "Mirela Ruiz" for
/// "Mirela Vasquez"). Numbers written as words read as digits ("five" and "5"): the reader writes either.
fn answers(reply: &str, answer: &str) -> bool {
    let (reply, answer) = (digits(reply), digits(answer));
    scoring::contains(&reply, &answer) >= 1.0 || scoring::f1(&reply, &answer) > 0.5
}

/// `text` with the number words zero to twenty as digits.
fn digits(text: &str) -> String {
    const WORDS: [&str; 21] = [
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
    ];
    text.split_whitespace()
        .map(|w| match WORDS.iter().position(|n| w.eq_ignore_ascii_case(n)) {
            Some(i) => i.to_string(),
            None => w.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The pairs of `pairs` that `rule` keeps, in their order, and what the check did. Every pair is
/// read once (greedy, its evidence sentence as the only context); `cancel` is polled between
/// pairs.
pub fn keep_answerable(
    model: &Model,
    document: &Document,
    pairs: &[QaPair],
    rule: KeepAnswerable,
    cancel: &dyn Fn() -> bool,
) -> Result<(Vec<QaPair>, AnswerableStats)> {
    if rule.is_off() {
        let n = pairs.len();
        return Ok((pairs.to_vec(), AnswerableStats { checked: 0, answered: n, kept: n, seconds: 0.0 }));
    }
    let t0 = Instant::now();
    let params = SamplingParams { max_tokens: CHECK_ANSWER_TOKENS, ..Default::default() };
    let spans = evidence_spans(model, &document.text, pairs)?;
    let mut answered = Vec::with_capacity(pairs.len());
    for (pair, span) in pairs.iter().zip(spans) {
        if cancel() {
            return Err(Cancelled("QA evidence check").into());
        }
        let ok = span.1 > span.0 && {
            let a = answer_reading(model, document, &[span], &pair.question, &params)?;
            let ok = answers(&a.generation.text, &pair.answer);
            tracing::debug!(question = %pair.question, answer = %pair.answer, reply = %a.generation.text, ok, "evidence check");
            ok
        };
        answered.push(ok);
    }
    // The facts (evidence spans) with at least one wording answered.
    let facts: BTreeSet<(usize, usize)> =
        pairs.iter().zip(&answered).filter(|(_, &ok)| ok).map(|(p, _)| p.evidence_span).collect();
    let kept: Vec<QaPair> = pairs
        .iter()
        .zip(&answered)
        .filter(|(p, &ok)| match rule {
            KeepAnswerable::Off => true,
            KeepAnswerable::Pairs => ok,
            KeepAnswerable::Facts => facts.contains(&p.evidence_span),
        })
        .map(|(p, _)| p.clone())
        .collect();
    let stats = AnswerableStats {
        checked: pairs.len(),
        answered: answered.iter().filter(|&&ok| ok).count(),
        kept: kept.len(),
        seconds: t0.elapsed().as_secs_f64(),
    };
    tracing::info!(
        checked = stats.checked,
        answered = stats.answered,
        kept = stats.kept,
        seconds = stats.seconds,
        "auxiliary QA checked against its evidence"
    );
    Ok((kept, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_answers_when_it_holds_the_answer_or_most_of_its_words() {
        assert!(answers("The seen flag", "seen flag"));
        assert!(answers("seen flag", "the seen flag is set"));
        assert!(!answers("user", "the user who owns the crontab"));
        assert!(!answers("five minutes", "once every minute") && !answers("Mirela Ruiz", "Mirela Vasquez"));
        assert!(answers("5", "five") && answers("Two", "2") && !answers("2", "twelve"));
    }
}
