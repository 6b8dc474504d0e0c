//! Reading examples from real prose for the prepared base, beside the planted ones of
//! [`super::data`].
//!
//! The planted examples teach the base to answer one entity from one templated sentence among
//! essay prose. Real documents are asked otherwise: questions in a reader's words whose answers
//! are phrases of manuals, policies and specifications ("the seen flag", "50 characters"). A base
//! trained on planted facts alone reads the evidence BM25 shows it in fewer than one answer of
//! five on real text (docs/real-text.md). These examples are windows of real documents around
//! one question's evidence, in the same shape as the planted ones (sentence-aligned passages of
//! the filter's chunk size, the evidence's passages positive), so the base's LoRA and its FltLM
//! filter ("FltLM: An Integrated Long-Context Large Language Model for Effective Context Filtering
//! and Understanding", §5.1) learn from both.
//!
//! Questions of two sources, both from the **train split** of a real-text set
//! (`data/real-text/questions.jsonl`; validation and eval documents never reach training):
//! - `real`: the questions written for the document, with their evidence;
//! - `real-qa`: the auxiliary QA generator's questions on the same documents
//!   ([`crate::lift::absorb::qa::extractive_qa`]), wh-questions only (no fill-in-the-blank), answers of at
//!   most [`MAX_ANSWER_WORDS`] words, so the base reads phrases, not one frequent term.

use super::data::{approx_tokens, BaseExample, BuildOptions};
use crate::lift::absorb::qa::{extractive_qa, QaOptions};
use crate::lift::absorb::text::{normalize_layout, split_sentences};
use anyhow::{ensure, Context, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Longest answer (in words) a generated question may have to be a reading example.
pub const MAX_ANSWER_WORDS: usize = 8;

/// Where real reading examples come from and how many (`prepare-base` options, `real`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RealData {
    /// A real-text set (one JSON line per document, with `split`); only `train` lines are read.
    pub jsonl: PathBuf,
    /// Real examples per planted one (1.0: as many as the planted examples).
    pub per_planted: f64,
    /// Share of the real examples drawn from the written questions; the rest from the
    /// generator's.
    pub written_share: f64,
}

impl Default for RealData {
    fn default() -> Self {
        Self { jsonl: PathBuf::from("data/real-text/questions.jsonl"), per_planted: 1.0, written_share: 0.5 }
    }
}

/// A question on a real document: its answer and the byte span of its evidence.
#[derive(Clone, Debug)]
pub struct RealQuestion {
    pub question: String,
    pub answer: String,
    pub evidence: (usize, usize),
    /// Written for the document (else the generator's).
    pub written: bool,
}

/// A train-split document of a real-text set with its questions.
#[derive(Clone, Debug)]
pub struct RealDocument {
    pub id: String,
    /// The text with its layout normalized (boxes and rules blanked, same byte offsets).
    pub text: String,
    pub questions: Vec<RealQuestion>,
}

/// The `train` documents of the real-text set at `path`, with their written questions and the
/// generator's wh-questions with short answers.
pub fn load_train_documents(path: &Path) -> Result<Vec<RealDocument>> {
    #[derive(Deserialize)]
    struct Line {
        id: Option<String>,
        split: Option<String>,
        document: String,
        questions: Vec<Q>,
    }
    #[derive(Deserialize)]
    struct Q {
        question: String,
        answers: Vec<String>,
        evidence: Option<String>,
    }
    let raw = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let mut docs = Vec::new();
    for (i, line) in raw.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let l: Line = serde_json::from_str(line).with_context(|| format!("{}:{}: bad line", path.display(), i + 1))?;
        ensure!(l.split.is_some(), "{}:{}: a line without `split`: a real-text set for training must say which lines are train", path.display(), i + 1);
        if l.split.as_deref() != Some("train") {
            continue;
        }
        let text = normalize_layout(&l.document);
        let mut questions = Vec::new();
        for q in &l.questions {
            let (Some(answer), Some(evidence)) = (q.answers.first(), q.evidence.as_deref()) else { continue };
            // The evidence occurs once (checked by scripts/real_text/build.py); its first occurrence.
            let Some(start) = l.document.find(evidence) else { continue };
            questions.push(RealQuestion {
                question: q.question.clone(),
                answer: answer.clone(),
                evidence: (start, start + evidence.len()),
                written: true,
            });
        }
        for p in extractive_qa(&l.document, &QaOptions::default()) {
            let short = p.answer.split_whitespace().count() <= MAX_ANSWER_WORDS;
            let in_evidence = p.evidence.contains(p.answer.as_str());
            if short && in_evidence && !crate::lift::absorb::qa::is_cloze(&p.question) {
                questions.push(RealQuestion { question: p.question, answer: p.answer, evidence: p.evidence_span, written: false });
            }
        }
        docs.push(RealDocument { id: l.id.unwrap_or_else(|| format!("line {}", i + 1)), text, questions });
    }
    ensure!(!docs.is_empty(), "{}: no train documents", path.display());
    Ok(docs)
}

/// `count` reading examples from `docs`, deterministic for `seed`: example `i` draws a source
/// (written or generated, by `written_share`), a question of it, a length between the options'
/// bounds, and a window of the question's document around its evidence of that length, cut into
/// sentence-aligned passages of at most `passage_tokens` approximate tokens (a longer sentence is
/// cut between words). The passages that overlap the evidence are the positives.
pub fn real_examples(docs: &[RealDocument], count: usize, written_share: f64, seed: u64, opts: &BuildOptions) -> Result<Vec<BaseExample>> {
    let pool = |written: bool| -> Vec<(usize, usize)> {
        docs.iter()
            .enumerate()
            .flat_map(|(d, doc)| doc.questions.iter().enumerate().filter(move |(_, q)| q.written == written).map(move |(k, _)| (d, k)))
            .collect()
    };
    let (written, generated) = (pool(true), pool(false));
    ensure!(!written.is_empty() || !generated.is_empty(), "the real-text documents have no usable questions");
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x7265_616c_0000_0000 ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let from_written = generated.is_empty() || (!written.is_empty() && rng.random::<f64>() < written_share);
        let pool = if from_written { &written } else { &generated };
        let (d, k) = pool[rng.random_range(0..pool.len())];
        let target = rng.random_range(opts.min_tokens..=opts.max_tokens);
        out.push(window_example(&docs[d], &docs[d].questions[k], target, opts.passage_tokens, &mut rng));
    }
    Ok(out)
}

/// `planted` with the real examples `real` asks for appended (`per_planted` × as many, from its
/// set's train documents). Training shuffles the examples each epoch, so their order is moot.
pub fn with_real_examples(mut planted: Vec<BaseExample>, real: &RealData, seed: u64, opts: &BuildOptions) -> Result<Vec<BaseExample>> {
    let docs = load_train_documents(&real.jsonl)?;
    let n = (planted.len() as f64 * real.per_planted).round() as usize;
    let examples = real_examples(&docs, n, real.written_share, seed, opts)?;
    let written = examples.iter().filter(|e| e.kind == "real").count();
    tracing::info!(planted = planted.len(), real = n, written, documents = docs.len(), "real reading examples added");
    planted.extend(examples);
    Ok(planted)
}

/// One example: the document's sentences around `q`'s evidence, grown on a random side until
/// `target` approximate tokens (or the document) are taken.
fn window_example(doc: &RealDocument, q: &RealQuestion, target: usize, passage_tokens: usize, rng: &mut StdRng) -> BaseExample {
    let sentences = split_sentences(&doc.text);
    let overlaps = |s: &crate::lift::absorb::text::Span| s.start < q.evidence.1 && q.evidence.0 < s.end;
    let first = sentences.iter().position(overlaps).unwrap_or(0);
    let last = sentences.iter().rposition(overlaps).unwrap_or(first);
    let (mut a, mut b) = (first, last + 1);
    let len = |a: usize, b: usize| sentences[a..b].iter().map(|s| approx_tokens(s.text(&doc.text))).sum::<usize>();
    while len(a, b) < target && (a > 0 || b < sentences.len()) {
        if b == sentences.len() || (a > 0 && rng.random::<bool>()) {
            a -= 1;
        } else {
            b += 1;
        }
    }
    // Pieces of at most `passage_tokens`: whole sentences packed greedily, a longer sentence cut
    // between words. Each piece: (its words, whether it overlaps the evidence).
    let mut pieces: Vec<(Vec<&str>, bool)> = Vec::new();
    let mut current: (Vec<&str>, bool) = (Vec::new(), false);
    for s in &sentences[a..b] {
        let words: Vec<&str> = s.text(&doc.text).split_whitespace().collect();
        let evidence = overlaps(s);
        let fits = approx_tokens(&[current.0.join(" "), words.join(" ")].join(" ")) <= passage_tokens;
        if !current.0.is_empty() && !fits {
            pieces.push(std::mem::take(&mut current));
        }
        if approx_tokens(&words.join(" ")) <= passage_tokens {
            current.0.extend(words);
            current.1 |= evidence;
            continue;
        }
        // A long sentence: cut between words into pieces of the size; only the pieces holding
        // the evidence's bytes are positive (found by the words' offsets in the text).
        let per_piece = (passage_tokens * 4 / 5).max(1);
        let mut at = s.start;
        for chunk in words.chunks(per_piece) {
            let start = doc.text[at..].find(chunk[0]).map_or(at, |o| at + o);
            let last_word = chunk[chunk.len() - 1];
            let end = doc.text[start..].find(last_word).map_or(s.end, |o| start + o + last_word.len()).min(s.end);
            at = end;
            pieces.push((chunk.to_vec(), start < q.evidence.1 && q.evidence.0 < end));
        }
    }
    if !current.0.is_empty() {
        pieces.push(current);
    }
    let passages: Vec<String> = pieces.iter().map(|(w, _)| w.join(" ")).collect();
    let positive: Vec<usize> = pieces.iter().enumerate().filter(|(_, p)| p.1).map(|(i, _)| i).collect();
    let question = q.question.split_whitespace().collect::<Vec<_>>().join(" ");
    let answer = q.answer.split_whitespace().collect::<Vec<_>>().join(" ");
    let kind = if q.written { "real" } else { "real-qa" };
    BaseExample { passages, positive, question, answer, kind: kind.into(), distractors: Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let prose = "The committee meets every second Tuesday in the library. Its chair is elected for two years \
            by the members present. Minutes are kept by the secretary, who sends them to every member within five days. \
            A member who misses three meetings in a row loses the right to vote until the next election. The budget is \
            approved each March, after the treasurer has presented the accounts of the previous year to the members. ";
        let doc = prose.repeat(6);
        let lines = [
            serde_json::json!({"id": "a", "split": "train", "document": doc, "questions": [
                {"question": "Within how many days are the minutes sent?", "answers": ["five days"], "evidence": "sends them to every member within five days"}]}),
            serde_json::json!({"id": "b", "split": "eval", "document": "Never trained on. The secret is kept here.", "questions": [
                {"question": "What is kept?", "answers": ["The secret"], "evidence": "The secret is kept here."}]}),
        ];
        let path = dir.path().join("set.jsonl");
        std::fs::write(&path, lines.iter().map(|l| l.to_string()).collect::<Vec<_>>().join("\n")).unwrap();
        (dir, path)
    }

    #[test]
    fn train_lines_only_with_written_and_generated_wh_questions() {
        let (_dir, path) = set();
        let docs = load_train_documents(&path).unwrap();
        assert_eq!(docs.len(), 1, "the eval line is never read");
        let d = &docs[0];
        assert!(d.questions.iter().any(|q| q.written && q.answer == "five days"));
        let generated: Vec<_> = d.questions.iter().filter(|q| !q.written).collect();
        assert!(!generated.is_empty(), "the generator finds questions in this prose");
        for q in &generated {
            assert!(q.answer.split_whitespace().count() <= MAX_ANSWER_WORDS, "{q:?}");
            assert!(!crate::lift::absorb::qa::is_cloze(&q.question), "{q:?}");
            assert!(d.text[q.evidence.0..q.evidence.1].contains(&q.answer) || !q.written, "{q:?}");
        }
    }

    #[test]
    fn examples_hold_their_evidence_in_positive_passages_of_the_chunk_size() {
        let (_dir, path) = set();
        let docs = load_train_documents(&path).unwrap();
        let opts = BuildOptions { min_tokens: 100, max_tokens: 200, ..Default::default() };
        let examples = real_examples(&docs, 40, 0.5, 7, &opts).unwrap();
        assert_eq!(examples, real_examples(&docs, 40, 0.5, 7, &opts).unwrap(), "deterministic for a seed");
        assert!(examples.iter().any(|e| e.kind == "real") && examples.iter().any(|e| e.kind == "real-qa"));
        for e in &examples {
            assert!(!e.positive.is_empty(), "{e:?}");
            let positives = e.positive.iter().map(|&p| e.passages[p].as_str()).collect::<Vec<_>>().join(" ");
            let answer_words: Vec<&str> = e.answer.split_whitespace().collect();
            assert!(positives.contains(&answer_words.join(" ")) || e.positive.len() > 1, "answer outside its positives: {e:?}");
            for p in &e.passages {
                assert!(approx_tokens(p) <= opts.passage_tokens, "passage over the chunk size: {p}");
            }
            let total = approx_tokens(&e.document());
            assert!(total >= opts.min_tokens.min(approx_tokens(&docs[0].text)) * 9 / 10, "{total}");
        }
    }
}
