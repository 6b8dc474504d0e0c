//! Answering questions about an absorbed document (seeds/001_18569741511b14ae.txt §4.1): the
//! prompt holds as much of the document's head and tail as fits the context budget, then the
//! question. Modes: `lift` (adapter + context), `icl` (no adapter, same context: the baseline),
//! `memory` (adapter, no document text).

use super::filter::{self, ChunkScore, FilterHooks};
use super::prompt::{chat_with_context, elision_tokens, head_tail, kept_ranges};
use crate::model::generate::{generate, Generation, SamplingParams};
use crate::model::{Adapter, KvCache, Model, NoHooks};
use anyhow::Result;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Lift,
    Icl,
    Memory,
}

impl Mode {
    pub fn uses_adapter(self) -> bool {
        self != Mode::Icl
    }
    pub fn uses_context(self) -> bool {
        self != Mode::Memory
    }
}

/// Tokens kept free for the chat template's own tokens around the document and question.
const TEMPLATE_SLACK: usize = 64;

/// A prompt and which document tokens it shows.
#[derive(Clone, Debug)]
pub struct AnswerPrompt {
    pub tokens: Vec<u32>,
    /// Document tokens `[0, head_end)` and `[tail_start, n)` are in the prompt; the rest only in
    /// the adapter. `(0, n)` in `memory` mode.
    pub head_end: usize,
    pub tail_start: usize,
    /// Document tokens in the prompt.
    pub context_tokens: usize,
    /// The context's chunks in the prepared base's FltLM layout (empty without a base filter or
    /// context): the answer scores and masks them.
    pub chunks: Vec<filter::Chunk>,
}

/// The in-context budget for the document: `requested`, else the model's window minus the
/// question, the answer budget and the template's overhead.
pub fn context_budget(model: &Model, question_tokens: usize, max_tokens: usize, requested: Option<usize>) -> usize {
    let window = model.config().max_position_embeddings;
    let fits = window.saturating_sub(question_tokens + max_tokens + TEMPLATE_SLACK);
    requested.map_or(fits, |r| r.min(fits))
}

/// The fewest prompt tokens a question of `question_tokens` takes before any document text: the
/// template's own tokens, and the question twice when a FltLM filter lays out the context (see
/// `answer_filtered`). Servers check it against the window before queueing any model work.
pub fn min_prompt_tokens(question_tokens: usize, filtered: bool) -> usize {
    let question = if filtered { 2 * question_tokens + 8 } else { question_tokens };
    question + TEMPLATE_SLACK
}

/// Builds the prompt for `question` about `doc` (token ids) in `mode`: the one prompt every
/// answer uses, and that evaluations label questions by. With a prepared base's FltLM filter the
/// context is laid out in its chunks, the question before and after them.
pub fn build_prompt(
    model: &Model,
    doc: &[u32],
    question: &str,
    mode: Mode,
    context_tokens: Option<usize>,
    max_tokens: usize,
) -> Result<AnswerPrompt> {
    if !mode.uses_context() {
        let tokens = chat_with_context(model, &[], question)?;
        return Ok(AnswerPrompt { tokens, head_end: 0, tail_start: doc.len(), context_tokens: 0, chunks: Vec::new() });
    }
    let q_tokens = model.tokenizer.encode(question, false)?.len();
    if let Some(filter) = model.base_filter() {
        // The question appears twice and each chunk adds a marker: leave room for both.
        let q_room = min_prompt_tokens(q_tokens, true) - TEMPLATE_SLACK;
        let budget = context_budget(model, q_room, max_tokens, context_tokens);
        let budget =
            if context_tokens.is_some() { budget } else { budget * filter.chunk_tokens / (filter.chunk_tokens + 1) };
        let ends = filter::sentence_ends(model, doc)?;
        let p = filter::build_prompt(model, doc, &ends, question, budget, filter.chunk_tokens)?;
        let context_tokens = p.chunks.iter().map(|c| c.end - c.start).sum();
        return Ok(AnswerPrompt {
            tokens: p.tokens,
            head_end: p.head_end,
            tail_start: p.tail_start,
            context_tokens,
            chunks: p.chunks,
        });
    }
    let budget = context_budget(model, q_tokens, max_tokens, context_tokens);
    let elision = elision_tokens(model)?;
    let ctx = head_tail(doc, budget, budget / 2, &elision);
    let (head_end, tail_start) = kept_ranges(doc.len(), budget, budget / 2, elision.len());
    let tokens = chat_with_context(model, &ctx, question)?;
    Ok(AnswerPrompt { tokens, head_end, tail_start, context_tokens: ctx.len(), chunks: Vec::new() })
}

/// Answers `question`; `adapter` is used in `lift` and `memory` modes (it must be a detached,
/// inference copy). Streams text through `on_text`.
#[allow(clippy::too_many_arguments)]
pub fn answer(
    model: &Model,
    doc: &[u32],
    adapter: Option<&dyn Adapter>,
    question: &str,
    mode: Mode,
    context_tokens: Option<usize>,
    params: &SamplingParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<(AnswerPrompt, Generation)> {
    let (prompt, out, _) = answer_filtered(model, doc, adapter, question, mode, context_tokens, params, on_text)?;
    Ok((prompt, out))
}

/// `answer` with the prepared base's FltLM filter, in every mode with context: the context is laid
/// out in chunks with markers, scored and softly masked in the same pass. Also returns each
/// chunk's score and mask (empty when the base has no filter or the mode no context).
#[allow(clippy::too_many_arguments)]
pub fn answer_filtered(
    model: &Model,
    doc: &[u32],
    adapter: Option<&dyn Adapter>,
    question: &str,
    mode: Mode,
    context_tokens: Option<usize>,
    params: &SamplingParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<(AnswerPrompt, Generation, Vec<ChunkScore>)> {
    let adapter = if mode.uses_adapter() { adapter } else { None };
    let prompt = build_prompt(model, doc, question, mode, context_tokens, params.max_tokens)?;
    let mut cache = KvCache::new(model.config().num_layers);
    let Some(filter) = model.base_filter().filter(|_| !prompt.chunks.is_empty()) else {
        let out = generate(model, &prompt.tokens, &mut cache, adapter, &mut NoHooks, params, on_text)?;
        return Ok((prompt, out, Vec::new()));
    };
    let mut hooks = FilterHooks::new(filter, &prompt.chunks, model.config().num_layers);
    let out = generate(model, &prompt.tokens, &mut cache, adapter, &mut hooks, params, on_text)?;
    let scores = hooks.report()?;
    Ok((prompt, out, scores))
}
