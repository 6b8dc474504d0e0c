//! The QA examples of the FltLM layout ([`crate::lift::answer::layout`]): each auxiliary QA pair
//! laid out as an answer would show its context, with the chunk labels its evidence gives the
//! filter's loss; and the filter's evidence recall over QA pairs ([`evaluate`]).

use super::plan::{Example, ExampleKind};
use super::qa::QaPair;
use crate::document::Document;
use crate::lift::answer::layout::{build_prompt, score_prompt, FilterEval, FilterPrompt};
use crate::lift::answer::prompt::end_of_turn;
use crate::model::filter::{Chunk, Filter};
use crate::model::{Adapter, Model};
use anyhow::Result;

/// Document token span of a QA pair's evidence (byte offsets → tokens of the prefix).
pub fn evidence_tokens(model: &Model, text: &str, pair: &QaPair) -> Result<(usize, usize)> {
    crate::document::token_span(model, text, pair.evidence_span)
}

/// Each pair's evidence as document tokens. A fact's wordings share their evidence, and finding
/// a span's tokens tokenizes the text up to it (twice): once per evidence, not per pair.
pub fn evidence_spans(model: &Model, text: &str, pairs: &[QaPair]) -> Result<Vec<(usize, usize)>> {
    let mut spans: std::collections::HashMap<(usize, usize), (usize, usize)> = Default::default();
    pairs
        .iter()
        .map(|pair| match spans.get(&pair.evidence_span) {
            Some(&s) => Ok(s),
            None => Ok(*spans.entry(pair.evidence_span).or_insert(evidence_tokens(model, text, pair)?)),
        })
        .collect()
}

/// A QA training example in the filter layout with its chunk labels.
#[derive(Clone, Debug)]
pub struct FilterExample {
    pub example: Example,
    pub chunks: Vec<Chunk>,
    pub positive: Vec<bool>,
    /// Prompt positions of the evidence tokens that are in the window.
    pub evidence: Vec<usize>,
}

/// The QA examples of `pairs` in the filter layout (same context budget as the plain ones).
pub fn qa_examples(
    model: &Model,
    document: &Document,
    pairs: &[QaPair],
    budget: usize,
    filter: &Filter,
) -> Result<Vec<FilterExample>> {
    let (doc, breaks) = (document.tokens(), document.breaks(model)?);
    qa_examples_laid_out(model, document, pairs, &|_, pair, _| {
        build_prompt(model, doc, breaks, &pair.question, budget, filter.chunk_tokens)
    })
}

/// The QA examples of `pairs`, each question's context laid out by `prompt_of(index, pair,
/// evidence tokens)` (the head and tail of [`qa_examples`], or the passages an answer would show), with
/// their chunk labels.
pub fn qa_examples_laid_out(
    model: &Model,
    document: &Document,
    pairs: &[QaPair],
    prompt_of: &dyn Fn(usize, &QaPair, (usize, usize)) -> Result<FilterPrompt>,
) -> Result<Vec<FilterExample>> {
    let text = document.text.as_str();
    let eot = end_of_turn(model);
    let spans = evidence_spans(model, text, pairs)?;
    pairs
        .iter()
        .zip(spans)
        .enumerate()
        .map(|(i, (pair, span))| {
            let p = prompt_of(i, pair, span)?;
            let evidence = (span.0..span.1).filter_map(|d| p.position_of(d)).collect();
            let mut answer = model.tokenizer.encode(pair.answer.trim(), false)?;
            answer.extend_from_slice(&eot);
            let mut target = vec![false; p.tokens.len()];
            target.extend(std::iter::repeat_n(true, answer.len()));
            let mut tokens = p.tokens.clone();
            tokens.extend_from_slice(&answer);
            let positive = p.labels(span);
            Ok(FilterExample { example: Example { kind: ExampleKind::Qa(i), tokens, target, packing: None }, chunks: p.chunks, positive, evidence })
        })
        .collect()
}

/// Runs the filter (prompt forward only) on `pairs` and counts evidence chunks kept.
pub fn evaluate(
    model: &Model,
    adapter: Option<&dyn Adapter>,
    filter: &Filter,
    document: &Document,
    pairs: &[QaPair],
    budget: usize,
) -> Result<FilterEval> {
    let (text, doc) = (document.text.as_str(), document.tokens());
    let breaks = document.breaks(model)?;
    let mut e = FilterEval::default();
    for pair in pairs {
        let p = build_prompt(model, doc, breaks, &pair.question, budget, filter.chunk_tokens)?;
        let labels = p.labels(evidence_tokens(model, text, pair)?);
        if !labels.iter().any(|&l| l) {
            continue;
        }
        e.add(&score_prompt(model, adapter, filter, &p)?, &labels);
    }
    Ok(e)
}
