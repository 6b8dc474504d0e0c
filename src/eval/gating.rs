//! Self-gating, measured offline: where a `lift` method (the adapter) and the `rag` method of the
//! same context (the passages alone: `lift:bm25` beside `rag:bm25`, so that only the adapter
//! differs) answered the same question in one run, which of the two answers a rule on their token
//! log-probabilities would keep, and how often it is right. The rule keeps the passages' answer
//! when its mean log-probability beats the adapter's by more than a margin; margins from
//! "always the passages" to "always the adapter" are tabled so that one is chosen on the
//! validation split and reported on eval. "Either" is the ceiling no rule passes.

use super::{AnswerRecord, Results};
use crate::corpus::scoring::mcnemar_exact;
use crate::lift::answer::gate::keeps_passages;
use std::fmt::Write;

/// The margins tabled: the passages' answer is kept when its mean log-probability exceeds the
/// adapter's by more than the margin (−∞: always the passages; +∞: always the adapter).
const MARGINS: [f64; 9] = [f64::NEG_INFINITY, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, f64::INFINITY];

/// The mean log-probability of an answer's tokens (None without them: a backend that gives none).
fn mean_logprob(a: &AnswerRecord) -> Option<f64> {
    crate::model::generate::mean_logprob(&a.logprobs)
}


/// The `rag` method that reads what `lift_method` reads: the same context suffix.
fn passages_method(lift_method: &str) -> Option<String> {
    lift_method.strip_prefix("lift").map(|context| format!("rag{context}"))
}

/// The self-gating table for every `lift…` method beside its `rag…` twin (nothing when the run
/// has no such pair or its answers carry no log-probabilities).
pub fn table(s: &mut String, results: &Results) {
    let mut lifts: Vec<&str> = results.answers.iter().map(|a| a.method.as_str()).filter(|m| m.starts_with("lift")).collect();
    lifts.sort_unstable();
    lifts.dedup();
    for m in lifts {
        let Some(r_m) = passages_method(m) else { continue };
        let rag: Vec<&AnswerRecord> = results.answers.iter().filter(|a| a.method == r_m).collect();
        // (adapter right, passages right, adapter mean, passages mean) per question.
        let pairs: Vec<(bool, bool, f64, f64)> = results
            .answers
            .iter()
            .filter(|a| a.method == m)
            .filter_map(|a| {
                let r = rag.iter().find(|r| r.document == a.document && r.question == a.question)?;
                Some((a.scores.contains > 0.0, r.scores.contains > 0.0, mean_logprob(a)?, mean_logprob(r)?))
            })
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let n = pairs.len();
        let _ = writeln!(
            s,
            "\nSelf-gating of `{m}` against `{r_m}` ({n} questions both answered): the passages' answer is kept when its \
             mean token log-probability beats the adapter's by more than the margin. Paired counts: right only with \
             the gate / only without it (McNemar p).\n"
        );
        let _ = writeln!(s, "| margin | passages kept | right | vs `{m}` | vs `{r_m}` |");
        let _ = writeln!(s, "|---|---|---|---|---|");
        for margin in MARGINS {
            let (mut kept, mut right, mut vs_lift, mut vs_rag) = (0, 0, (0, 0), (0, 0));
            for &(lift_right, rag_right, lift_mean, rag_mean) in &pairs {
                let passages = keeps_passages(lift_mean, rag_mean, margin);
                let gated = if passages { rag_right } else { lift_right };
                kept += usize::from(passages);
                right += usize::from(gated);
                tally(&mut vs_lift, gated, lift_right);
                tally(&mut vs_rag, gated, rag_right);
            }
            let name = match margin {
                f64::NEG_INFINITY => "always the passages".to_string(),
                f64::INFINITY => "always the adapter".to_string(),
                m => format!("{m:+}"),
            };
            let paired = |(b, c): (usize, usize)| format!("{b} / {c} (p = {:.2})", mcnemar_exact(b, c));
            let _ = writeln!(s, "| {name} | {kept} | {right} ({:.0}%) | {} | {} |", 100.0 * right as f64 / n as f64, paired(vs_lift), paired(vs_rag));
        }
        let either = pairs.iter().filter(|p| p.0 || p.1).count();
        let _ = writeln!(s, "| either (the ceiling) | – | {either} ({:.0}%) | – | – |", 100.0 * either as f64 / n as f64);
    }
}

/// Books one question into (right only with the gate, right only without it).
fn tally(counts: &mut (usize, usize), gated: bool, other: bool) {
    match (gated, other) {
        (true, false) => counts.0 += 1,
        (false, true) => counts.1 += 1,
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_adapter_is_gated_against_the_passages_it_reads() {
        assert_eq!(passages_method("lift").as_deref(), Some("rag"));
        assert_eq!(passages_method("lift:bm25:64").as_deref(), Some("rag:bm25:64"));
        assert_eq!(passages_method("rag"), None);
    }
}
