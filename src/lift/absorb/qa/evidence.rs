//! Checking a model's reply against the document: the evidence must occur verbatim in it (located in
//! the whole document, preferring the window; a reply that quotes some sentences verbatim and then
//! drifts keeps its longest verbatim run of adjacent sentences), every name and number in the
//! answer and most of its words must occur in the window, and the answer must not be given away by
//! the question.

use super::parse::{clean_question, parse_qa};
use super::words::{content_tokens, is_stopword, strip_final, tokens};
use super::{QaPair, QaSource};
use crate::lift::absorb::text::split_sentences;
use std::collections::HashSet;

const QUOTES: &[char] = &['"', '\'', '“', '”', '‘', '’', '`', '«', '»'];

/// All matches of `evidence` in `doc` (verbatim after trimming quotes/whitespace, tolerating only
/// differences in runs of whitespace), starting and ending on word boundaries.
fn find_all(doc: &str, evidence: &str, limit: usize) -> Vec<(usize, usize)> {
    let e = evidence.trim().trim_matches(|c: char| c.is_whitespace() || QUOTES.contains(&c));
    let words: Vec<&str> = e.split_whitespace().collect();
    let Some(first) = words.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let is_word = |c: char| c.is_alphanumeric();
    for (start, _) in doc.match_indices(first) {
        if out.len() >= limit {
            break;
        }
        if first.starts_with(is_word) && doc[..start].chars().next_back().is_some_and(is_word) {
            continue;
        }
        let mut pos = start + first.len();
        let mut ok = true;
        for w in &words[1..] {
            let rest = &doc[pos..];
            let trimmed = rest.trim_start();
            if trimmed.len() == rest.len() || !trimmed.starts_with(w) {
                ok = false;
                break;
            }
            pos += rest.len() - trimmed.len() + w.len();
        }
        if !ok {
            continue;
        }
        let last = words[words.len() - 1];
        if last.ends_with(is_word) && doc[pos..].chars().next().is_some_and(is_word) {
            continue;
        }
        out.push((start, pos));
    }
    out
}

/// Byte span of `evidence` in `doc`: verbatim (after trimming quotes/whitespace; only runs of
/// whitespace may differ), on word boundaries; `None` when it does not occur.
pub fn locate_evidence(doc: &str, evidence: &str) -> Option<(usize, usize)> {
    locate_evidence_near(doc, evidence, None)
}

/// Like [`locate_evidence`], preferring an occurrence inside `prefer` (a byte range), and
/// accepting the evidence without a final `.`/`!`/`?` the document lacks.
pub fn locate_evidence_near(doc: &str, evidence: &str, prefer: Option<(usize, usize)>) -> Option<(usize, usize)> {
    let pick = |hits: Vec<(usize, usize)>| -> Option<(usize, usize)> {
        prefer
            .and_then(|(ps, pe)| hits.iter().copied().find(|&(s, e)| s >= ps && e <= pe))
            .or_else(|| hits.first().copied())
    };
    if let Some(hit) = pick(find_all(doc, evidence, 64)) {
        return Some(hit);
    }
    let trimmed = evidence.trim().trim_end_matches(|c: char| c.is_whitespace() || QUOTES.contains(&c));
    let stripped = trimmed.trim_end_matches(['.', '!', '?']);
    if stripped.len() < trimmed.len() && !stripped.trim().is_empty() {
        return pick(find_all(doc, stripped, 64));
    }
    None
}

pub(super) enum Verdict {
    Valid(QaPair),
    Parse,
    Evidence,
    Answer,
}

/// Locates the evidence; when the whole is not verbatim, keeps the longest run of its sentences
/// that are verbatim and adjacent in the document (models often quote faithfully, then drift).
fn locate_evidence_sentences(doc: &str, evidence: &str, window: (usize, usize)) -> Option<(usize, usize)> {
    if let Some(hit) = locate_evidence_near(doc, evidence, Some(window)) {
        return Some(hit);
    }
    let spans = split_sentences(evidence);
    if spans.len() < 2 {
        return None;
    }
    let hits: Vec<Option<(usize, usize)>> =
        spans.iter().map(|s| locate_evidence_near(doc, s.text(evidence), Some(window))).collect();
    let mut best: Option<(usize, usize)> = None;
    let mut i = 0;
    while i < hits.len() {
        let Some(mut run) = hits[i] else {
            i += 1;
            continue;
        };
        let mut j = i + 1;
        while let Some(Some(next)) = hits.get(j) {
            if next.0 < run.1 || !doc[run.1..next.0].trim().is_empty() {
                break;
            }
            run.1 = next.1;
            j += 1;
        }
        if best.is_none_or(|b| run.1 - run.0 > b.1 - b.0) {
            best = Some(run);
        }
        i = j;
    }
    best
}

/// Checks one model output against the document and the window it was shown.
pub(super) fn validate_model_output(doc: &str, window: (usize, usize), output: &str) -> Verdict {
    let Some((q, a, e)) = parse_qa(output) else {
        return Verdict::Parse;
    };
    let q = clean_question(&q);
    let q_words = q.split_whitespace().count();
    if !(3..=60).contains(&q_words) || !q.chars().any(char::is_alphabetic) {
        return Verdict::Parse;
    }
    let Some((s, t)) = locate_evidence_sentences(doc, &e, window) else {
        return Verdict::Evidence;
    };
    let evidence = &doc[s..t];
    if evidence.split_whitespace().count() < 3 {
        return Verdict::Evidence;
    }
    // The answer must be short enough, grounded in the window/evidence (every name and number
    // in it, and most other words), and not given away by the question.
    let a_content = content_tokens(&a);
    if a.split_whitespace().count() > 40 || a_content.is_empty() {
        return Verdict::Answer;
    }
    let window_tokens: HashSet<String> = tokens(&doc[window.0..window.1]).into_iter().chain(tokens(evidence)).collect();
    let ev_tokens: HashSet<String> = tokens(evidence).into_iter().collect();
    let grounded = a_content.iter().filter(|t| window_tokens.contains(*t)).count();
    let names_grounded = a
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.chars().next().is_some_and(|c| c.is_uppercase() || c.is_ascii_digit()) && !is_stopword(w))
        .all(|w| window_tokens.contains(&w.to_lowercase()));
    if grounded * 4 < a_content.len() * 3 || !names_grounded || !a_content.iter().any(|t| ev_tokens.contains(t)) {
        return Verdict::Answer;
    }
    let q_tokens: HashSet<String> = tokens(&q).into_iter().collect();
    if a_content.iter().all(|t| q_tokens.contains(t)) {
        return Verdict::Answer;
    }
    let question = if q.ends_with('?') { q } else { format!("{}?", strip_final(&q)) };
    Verdict::Valid(QaPair {
        question,
        answer: a,
        evidence: evidence.to_string(),
        evidence_span: (s, t),
        source: QaSource::Model,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lift::absorb::qa::tests::PARAGRAPH;

    #[test]
    fn evidence_must_be_verbatim() {
        let doc = "The museum opened in 1987.  It was founded by\nElena Marsh. The museum opened again.";
        assert_eq!(locate_evidence(doc, "The museum opened in 1987."), Some((0, 26)));
        // Whitespace runs may differ; quotes and surrounding whitespace are trimmed.
        let (s, e) = locate_evidence(doc, " \"It was founded by Elena Marsh.\" ").unwrap();
        assert_eq!(&doc[s..e], "It was founded by\nElena Marsh.");
        // A missing final period is accepted (the rest is verbatim).
        let (s, e) = locate_evidence(doc, "The museum opened in 1987").unwrap();
        assert_eq!(&doc[s..e], "The museum opened in 1987");
        // Anything else is rejected.
        assert_eq!(locate_evidence(doc, "The museum opened in 1988."), None);
        assert_eq!(locate_evidence(doc, "the museum opened in 1987."), None);
        assert_eq!(locate_evidence(doc, "The museum was founded by Elena Marsh."), None);
        assert_eq!(locate_evidence(doc, "useum opened"), None, "must start on a word boundary");
        assert_eq!(locate_evidence(doc, "   "), None);
        // Prefers an occurrence inside the window.
        let first = locate_evidence(doc, "The museum opened").unwrap();
        let near = locate_evidence_near(doc, "The museum opened", Some((40, doc.len()))).unwrap();
        assert_eq!(first.0, 0);
        assert!(near.0 > 40 && &doc[near.0..near.1] == "The museum opened");
    }

    #[test]
    fn model_outputs_are_validated_against_the_document() {
        let doc = PARAGRAPH;
        let window = (0, doc.len());
        let ok = "Question: Who founded the museum?\nAnswer: Elena Marsh\nEvidence: The museum was founded by Elena Marsh, a retired sea captain.\n";
        match validate_model_output(doc, window, ok) {
            Verdict::Valid(p) => {
                assert_eq!(p.source, QaSource::Model);
                assert_eq!(&doc[p.evidence_span.0..p.evidence_span.1], p.evidence);
            }
            _ => panic!("valid pair rejected"),
        }
        let invented = "Question: Who founded the museum?\nAnswer: Elena Marsh\nEvidence: Elena Marsh founded the museum in 1850.\n";
        assert!(matches!(validate_model_output(doc, window, invented), Verdict::Evidence));
        let ungrounded = "Question: Who founded the museum?\nAnswer: Napoleon Bonaparte\nEvidence: The museum was founded by Elena Marsh, a retired sea captain.\n";
        assert!(matches!(validate_model_output(doc, window, ungrounded), Verdict::Answer));
        let given_away = "Question: What did Elena Marsh do?\nAnswer: Elena Marsh\nEvidence: The museum was founded by Elena Marsh, a retired sea captain.\n";
        assert!(matches!(validate_model_output(doc, window, given_away), Verdict::Answer));
        assert!(matches!(validate_model_output(doc, window, "I cannot do that."), Verdict::Parse));
        // Evidence that drifts after verbatim sentences keeps the verbatim, adjacent run; a meta
        // preamble before the question is dropped.
        let drift = "Question: What is the answer to the question: Who was the first director?\nAnswer: Tomas Berg\n\
                     Evidence: The museum was founded by Elena Marsh, a retired sea captain. Its first director was Tomas Berg. It had 900 rooms.";
        match validate_model_output(doc, window, drift) {
            Verdict::Valid(p) => {
                assert_eq!(p.question, "Who was the first director?");
                assert_eq!(
                    p.evidence,
                    "The museum was founded by Elena Marsh, a retired sea captain. Its first director was Tomas Berg."
                );
                assert_eq!(&doc[p.evidence_span.0..p.evidence_span.1], p.evidence);
            }
            _ => panic!("drifting evidence rejected"),
        }
    }
}
