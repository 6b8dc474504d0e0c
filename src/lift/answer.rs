//! Answering questions about an absorbed document (the LIFT paper, "LIFT: Improving Long Context
//! Understanding of Large Language Models through Long Input Fine-Tuning", §4.1): the prompt holds
//! as much of the document's head and tail as fits the context budget, then the question. Modes:
//! `lift` (adapter + context), `icl` (no adapter, same context: the baseline), `memory` (adapter,
//! no document text). [`answer`] is the one answer function: the server, the CLI, the
//! evaluations and the benchmarks all answer through it.

use super::filter::{self, ChunkScore, FilterHooks};
use crate::document::Document;
use super::prompt::{chat_with_context, elision_tokens, head_tail, kept_ranges};
use crate::model::generate::{run_alone, Generation, SamplingParams, Sequence};
use crate::model::{Adapter, KvCache, Model};
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
/// `build_prompt`). Servers check it against the window before queueing any model work.
pub fn min_prompt_tokens(question_tokens: usize, filtered: bool) -> usize {
    let question = if filtered { 2 * question_tokens + 8 } else { question_tokens };
    question + TEMPLATE_SLACK
}

/// One question about a document, as every path asks it.
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    pub question: &'a str,
    pub mode: Mode,
    /// In-context document budget in tokens; `None`: what fits the model's window.
    pub context_tokens: Option<usize>,
}

/// Builds the prompt for `ask` about `doc` leaving room for `max_tokens` of answer: the one
/// prompt every answer uses, and that evaluations label questions by. With a prepared base's FltLM
/// filter the context is laid out in its chunks, the question before and after them.
pub fn build_prompt(model: &Model, doc: &Document, ask: &Ask, max_tokens: usize) -> Result<AnswerPrompt> {
    let (question, context_tokens) = (ask.question, ask.context_tokens);
    let ids = doc.tokens();
    if !ask.mode.uses_context() {
        let tokens = chat_with_context(model, &[], question)?;
        return Ok(AnswerPrompt { tokens, head_end: 0, tail_start: ids.len(), context_tokens: 0, chunks: Vec::new() });
    }
    let q_tokens = model.tokenizer.encode(question, false)?.len();
    if let Some(filter) = model.base_filter() {
        // The question appears twice and each chunk adds a marker: leave room for both.
        let q_room = min_prompt_tokens(q_tokens, true) - TEMPLATE_SLACK;
        let budget = context_budget(model, q_room, max_tokens, context_tokens);
        let budget =
            if context_tokens.is_some() { budget } else { budget * filter.chunk_tokens / (filter.chunk_tokens + 1) };
        let ends = doc.sentence_ends(model)?;
        let p = filter::build_prompt(model, ids, ends, question, budget, filter.chunk_tokens)?;
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
    let ctx = head_tail(ids, budget, budget / 2, &elision);
    let (head_end, tail_start) = kept_ranges(ids.len(), budget, budget / 2, elision.len());
    let tokens = chat_with_context(model, &ctx, question)?;
    Ok(AnswerPrompt { tokens, head_end, tail_start, context_tokens: ctx.len(), chunks: Vec::new() })
}

/// An answer: the prompt it was given, what was generated, and each in-context chunk's FltLM
/// score and mask (empty when the base has no filter or the mode no context).
pub struct Answer {
    pub prompt: AnswerPrompt,
    pub generation: Generation,
    pub chunks: Vec<ChunkScore>,
}

/// The hooks an answer runs with: the prepared base's FltLM filter when the prompt has chunks.
pub type AnswerHooks<'m> = Option<FilterHooks<'m>>;

/// An answer ready to run, alone ([`answer`]) or in the server's batch: its prompt and its
/// sequence, with FltLM hooks when the prompt's context is laid out in chunks.
pub fn prepare<'m>(
    model: &'m Model,
    doc: &Document,
    ask: &Ask,
    params: &SamplingParams,
) -> Result<(AnswerPrompt, Sequence<'m, AnswerHooks<'m>>)> {
    let prompt = build_prompt(model, doc, ask, params.max_tokens)?;
    let layers = model.config().num_layers;
    let hooks = model.base_filter().filter(|_| !prompt.chunks.is_empty()).map(|f| FilterHooks::new(f, &prompt.chunks, layers));
    let cache = KvCache::with_capacity(layers, prompt.tokens.len() + params.max_tokens);
    let seq = Sequence::new(model, prompt.tokens.clone(), cache, params.clone(), hooks)?;
    Ok((prompt, seq))
}

/// Each in-context chunk's FltLM score and mask, once the answer's prompt has run.
pub fn chunk_scores(hooks: &AnswerHooks) -> Result<Vec<ChunkScore>> {
    hooks.as_ref().map_or(Ok(Vec::new()), |h| h.report())
}

/// Answers `ask` about `doc`; `adapter` (a detached, inference copy) is used in `lift` and
/// `memory` modes. With the prepared base's FltLM filter, in every mode with context, the context
/// is laid out in chunks with markers, scored and softly masked in the same pass. Streams text
/// through `on_text` (returning false stops the generation).
pub fn answer(
    model: &Model,
    doc: &Document,
    adapter: Option<&dyn Adapter>,
    ask: &Ask,
    params: &SamplingParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Answer> {
    let adapter = if ask.mode.uses_adapter() { adapter } else { None };
    let (prompt, seq) = prepare(model, doc, ask, params)?;
    let (generation, _, hooks) = run_alone(model, seq, adapter, on_text)?;
    let chunks = chunk_scores(&hooks)?;
    Ok(Answer { prompt, generation, chunks })
}
