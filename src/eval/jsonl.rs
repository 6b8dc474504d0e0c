//! A user's evaluation set as JSONL (`eval --jsonl`): one document and its questions per line.

use super::{needles, EvalDocument, EvalQuestion};
use crate::model::Model;
use anyhow::{Context, Result};
use serde::Deserialize;
use std::path::Path;

/// Loads a user's evaluation set: one JSON object per line,
/// `{"document": "...", "questions": [{"question": "...", "answers": ["..."], "evidence": "optional",
/// "kind": "optional form"}], "id": "optional", "split": "optional train|validation|eval"}`.
/// A question's evidence spans are the occurrences of its `evidence` text, else of its answers.
/// With `split`, only the lines of that split are kept (a set without split fields is refused:
/// asking for a split of a set that has none would silently report on all of it).
pub fn load_jsonl(model: &Model, path: &Path, split: Option<&str>) -> Result<Vec<EvalDocument>> {
    #[derive(Deserialize)]
    struct Line {
        document: String,
        questions: Vec<Q>,
        #[serde(default)]
        id: Option<String>,
        #[serde(default)]
        split: Option<String>,
    }
    #[derive(Deserialize)]
    struct Q {
        question: String,
        answers: Vec<String>,
        #[serde(default)]
        evidence: Option<String>,
        #[serde(default)]
        kind: Option<String>,
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let mut docs = Vec::new();
    let mut splits_seen = false;
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let l: Line = serde_json::from_str(line).with_context(|| format!("{}:{}: bad line", path.display(), i + 1))?;
        splits_seen |= l.split.is_some();
        if split.is_some_and(|want| l.split.as_deref() != Some(want)) {
            continue;
        }
        anyhow::ensure!(!l.document.trim().is_empty(), "{}:{}: empty document", path.display(), i + 1);
        let offsets = needles::token_offsets(model, &l.document)?;
        let questions = l
            .questions
            .into_iter()
            .enumerate()
            .map(|(k, q)| {
                anyhow::ensure!(!q.answers.is_empty(), "{}:{}: question {k} has no answers", path.display(), i + 1);
                let needles: Vec<&str> = match &q.evidence {
                    Some(e) => vec![e.as_str()],
                    None => q.answers.iter().map(String::as_str).collect(),
                };
                let evidence: Vec<(usize, usize)> = needles
                    .iter()
                    .filter(|n| !n.is_empty())
                    .flat_map(|n| l.document.match_indices(n).map(|(s, m)| (s, s + m.len())).collect::<Vec<_>>())
                    .collect();
                let evidence_tokens: Vec<(usize, usize)> =
                    evidence.iter().map(|&(s, e)| needles::token_span(&offsets, s, e)).collect();
                Ok(EvalQuestion {
                    id: format!("q{k}"),
                    question: q.question,
                    answers: q.answers,
                    form: q.kind,
                    actual_depth: evidence_tokens
                        .iter()
                        .map(|t: &(usize, usize)| t.0)
                        .min()
                        .map(|t| t as f64 / offsets.len() as f64),
                    evidence,
                    evidence_tokens,
                    ..Default::default()
                })
            })
            .collect::<Result<Vec<_>>>()?;
        docs.push(EvalDocument {
            id: l.id.unwrap_or_else(|| format!("line{}", i + 1)),
            source: format!("{}:{}", path.display(), i + 1),
            target_tokens: None,
            tokens: offsets.len(),
            text: l.document,
            questions,
        });
    }
    if let Some(want) = split {
        anyhow::ensure!(splits_seen, "{}: --split {want}: the set's lines have no `split` field", path.display());
    }
    anyhow::ensure!(!docs.is_empty(), "{}: no documents{}", path.display(), split.map_or(String::new(), |s| format!(" in split {s}")));
    Ok(docs)
}
