//! What the prepared base's FltLM soft mask did to each answer's context: whether the chunk that
//! holds the question's evidence was left open, and how many of the other chunks shown (the
//! distractors) it closed. FltLM's mask exists to close distractors, not the evidence; these
//! counts say whether it does, per method, in `results.md`.

use super::{AnswerRecord, EvalQuestion, Results};
use crate::model::filter::{ChunkScore, UNMASKED_ABOVE};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// One answer's context as the mask saw it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MaskRecord {
    /// Chunks in context.
    pub chunks: usize,
    /// A chunk in context holds the evidence (some span of it; every span for a two-hop question).
    pub evidence_shown: bool,
    /// The evidence chunks' mask: the strongest mask over the chunks of a span, the best shown
    /// span (the worst, for a two-hop question); None when not shown.
    pub evidence_mask: Option<f32>,
    /// The evidence chunks' relevance as reported (same reduction as the mask).
    pub evidence_relevance: Option<f32>,
    /// Chunks holding no evidence, and how many of them are masked (intensity ≤ [`UNMASKED_ABOVE`]).
    pub distractors: usize,
    pub distractors_masked: usize,
    /// The planted look-alike fact's mask, when shown (it is one of the distractors).
    pub confusable_mask: Option<f32>,
}

impl MaskRecord {
    pub fn evidence_open(&self) -> Option<bool> {
        self.evidence_mask.map(|m| m > UNMASKED_ABOVE)
    }
}

fn overlaps(c: &ChunkScore, (a, b): (usize, usize)) -> bool {
    c.start < b && a < c.end
}

/// The record of `chunks` (an answer's scored context) for question `q`; None without chunks or
/// without evidence spans to look for.
pub fn measure(q: &EvalQuestion, chunks: &[ChunkScore]) -> Option<MaskRecord> {
    if chunks.is_empty() || q.evidence_tokens.is_empty() {
        return None;
    }
    // Per evidence span: (strongest mask, its relevance) over the chunks overlapping it.
    let spans: Vec<Option<(f32, f32)>> = q
        .evidence_tokens
        .iter()
        .map(|&span| {
            chunks.iter().filter(|c| overlaps(c, span)).map(|c| (c.mask, c.score)).reduce(|a, b| (a.0.min(b.0), a.1.min(b.1)))
        })
        .collect();
    let shown: Vec<(f32, f32)> = spans.iter().flatten().copied().collect();
    let evidence = if q.needs_all_evidence {
        (shown.len() == spans.len()).then(|| shown.iter().copied().reduce(|a, b| (a.0.min(b.0), a.1.min(b.1)))).flatten()
    } else {
        shown.iter().copied().reduce(|a, b| (a.0.max(b.0), a.1.max(b.1)))
    };
    let distractors: Vec<&ChunkScore> = chunks.iter().filter(|c| !q.evidence_tokens.iter().any(|&s| overlaps(c, s))).collect();
    let confusable_mask = q.distractor_tokens.and_then(|span| {
        distractors.iter().filter(|c| overlaps(c, span)).map(|c| c.mask).reduce(f32::min)
    });
    Some(MaskRecord {
        chunks: chunks.len(),
        evidence_shown: evidence.is_some(),
        evidence_mask: evidence.map(|e| e.0),
        evidence_relevance: evidence.map(|e| e.1),
        distractors: distractors.len(),
        distractors_masked: distractors.iter().filter(|c| c.mask <= UNMASKED_ABOVE).count(),
        confusable_mask,
    })
}

/// The mask table of `results.md`: per method whose answers were scored by a filter, the answers
/// showing the evidence, in how many of them it was left open, the distractors closed, and
/// accuracy when the evidence was open against closed.
pub fn table(s: &mut String, results: &Results) {
    let scored = |m: &str| -> Vec<(&AnswerRecord, &MaskRecord)> {
        results.answers.iter().filter(|a| a.method == m).filter_map(|a| a.mask.as_ref().map(|r| (a, r))).collect()
    };
    let ms: Vec<String> = results.config.methods.iter().filter(|m| !scored(m).is_empty()).cloned().collect();
    if ms.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\nThe prepared base's FltLM mask on each answer's context (open: intensity above {UNMASKED_ABOVE}; a \
         look-alike is the planted confusable fact):\n"
    );
    let _ = writeln!(s, "| method | answers with chunks | evidence shown | evidence open | distractors masked | look-alike masked | acc, evidence open / closed |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    let frac = |k: usize, n: usize| if n == 0 { "–".to_string() } else { format!("{k}/{n} ({:.0}%)", 100.0 * k as f64 / n as f64) };
    for m in ms {
        let rows = scored(&m);
        let shown: Vec<_> = rows.iter().filter(|(_, r)| r.evidence_shown).collect();
        let open: Vec<_> = shown.iter().filter(|(_, r)| r.evidence_open() == Some(true)).collect();
        let right = |v: &[&&(&AnswerRecord, &MaskRecord)]| v.iter().filter(|(a, _)| a.scores.contains > 0.0).count();
        let closed: Vec<_> = shown.iter().filter(|(_, r)| r.evidence_open() == Some(false)).collect();
        let (d, dm) = rows.iter().fold((0, 0), |(d, dm), (_, r)| (d + r.distractors, dm + r.distractors_masked));
        let looks: Vec<f32> = rows.iter().filter_map(|(_, r)| r.confusable_mask).collect();
        let _ = writeln!(
            s,
            "| {m} | {} | {} | {} | {} | {} | {} / {} |",
            rows.len(),
            shown.len(),
            frac(open.len(), shown.len()),
            frac(dm, d),
            frac(looks.iter().filter(|&&x| x <= UNMASKED_ABOVE).count(), looks.len()),
            frac(right(&open), open.len()),
            frac(right(&closed), closed.len()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(start: usize, end: usize, mask: f32) -> ChunkScore {
        ChunkScore { start, end, score: -mask, mask }
    }

    fn question(evidence: Vec<(usize, usize)>, needs_all: bool, distractor: Option<(usize, usize)>) -> EvalQuestion {
        EvalQuestion {
            id: "q".into(),
            question: "?".into(),
            answers: vec!["a".into()],
            kind: None,
            depth: None,
            actual_depth: None,
            planted: None,
            distractor: None,
            needs_all_evidence: needs_all,
            evidence: evidence.clone(),
            evidence_tokens: evidence,
            distractor_tokens: distractor,
            form: None,
        }
    }

    #[test]
    fn the_evidence_chunk_and_the_distractors_are_told_apart() {
        // Evidence at tokens 40..50 straddles chunks 32..48 and 48..64: its mask is the stronger one.
        let chunks = [chunk(0, 32, -2.0), chunk(32, 48, -0.05), chunk(48, 64, -0.5), chunk(64, 96, 0.0), chunk(96, 128, -3.0)];
        let r = measure(&question(vec![(40, 50)], false, Some((100, 110))), &chunks).unwrap();
        assert!(r.evidence_shown);
        assert_eq!(r.evidence_mask, Some(-0.5));
        assert_eq!(r.evidence_open(), Some(false));
        assert_eq!((r.distractors, r.distractors_masked), (3, 2));
        assert_eq!(r.confusable_mask, Some(-3.0));
        // Any one span of a one-hop question: the best shown one; a two-hop question needs all.
        let two = question(vec![(0, 10), (200, 210)], false, None);
        assert_eq!(measure(&two, &chunks).unwrap().evidence_mask, Some(-2.0));
        let hop = question(vec![(0, 10), (200, 210)], true, None);
        let r = measure(&hop, &chunks).unwrap();
        assert!(!r.evidence_shown && r.evidence_mask.is_none());
        assert!(measure(&hop, &[]).is_none());
    }
}
