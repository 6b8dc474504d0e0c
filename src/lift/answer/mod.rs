//! Answering questions about a document. The LIFT paper ("LIFT: Improving Long Context
//! Understanding of Large Language Models through Long Input Fine-Tuning", §4.1) shows the head
//! and tail of the document that fit the context budget; that truncation is kept as the
//! `head_tail` policy, for comparison. By default (`linked`) the prompt shows the passage most
//! relevant to the question and the passages its names link to ([`crate::retrieve`]: BM25 over
//! the FltLM layout's sentence-aligned chunks), in document order, within a budget of
//! [`DEFAULT_CONTEXT_TOKENS`]; `bm25` fills the budget with the best passages. Modes: `lift`
//! (adapter + context), `rag` (retrieved context, no adapter: the answer before any adapter
//! exists), `icl` (no adapter, head and tail: the paper's baseline), `memory` (adapter, no
//! document text). [`answer`] is the one answer function: the server, the CLI, the evaluations
//! and the benchmarks all answer through it.
//!
//! The chat prompt and its pieces, shared with training, are in [`prompt`]; FltLM's chunk layout
//! and the filter's loss in [`layout`].

pub mod gate;
pub mod layout;
pub mod prompt;

use layout::{ChunkScore, FilterHooks};
use prompt::{chat_after_turns, elision_tokens, head_tail, kept_ranges};
use crate::document::Document;
use crate::model::generate::{run_alone, Generation, SamplingParams, Sequence};
use crate::model::{Adapter, ChatMessage, KvCache, Model};
use anyhow::Result;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Lift,
    Rag,
    Icl,
    Memory,
}

impl Mode {
    pub fn uses_adapter(self) -> bool {
        matches!(self, Mode::Lift | Mode::Memory)
    }
    pub fn uses_context(self) -> bool {
        self != Mode::Memory
    }
    /// The context policy when the request names none: the best BM25 passage and the passages
    /// its names link to (`linked`), except `icl`, the paper's truncated baseline. On real prose
    /// the small reader answers one passage better than four (docs/real-text.md: `rag` 38 of 172
    /// eval questions against `bm25`'s 22, `lift` 40 against 37), and no worse on planted facts.
    /// `lift` and `rag` share one policy so that their answers differ by the adapter alone. Not
    /// the filter's re-rank (`retrieved`): it runs a forward pass of its own (a quarter to a third
    /// of a 4K answer on 2 cores) and has answered within two questions of BM25 alone in every
    /// paired comparison (docs/retrieval.md, "The default").
    pub fn default_context(self) -> ContextPolicy {
        match self {
            Mode::Icl => ContextPolicy::HeadTail,
            _ => ContextPolicy::Linked,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Mode::Lift => "lift",
            Mode::Rag => "rag",
            Mode::Icl => "icl",
            Mode::Memory => "memory",
        }
    }
}

/// Which of the document's text an answer shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ContextPolicy {
    /// BM25's candidates re-ranked by the prepared base's FltLM filter (BM25 alone without a
    /// filter), in document order, within the budget: a pass through the layers up to the
    /// filter's score layer before the answer.
    Retrieved,
    /// The passages BM25 (with its feedback step) ranks first for the question, in document
    /// order, within the budget; a collection's policy.
    Bm25,
    /// The passage BM25 ranks first, and only the passages that share a linking name with it
    /// (the second hop of a fact named through another), within the budget, nothing to fill it:
    /// the default; a small reader answers one passage better than four (docs/real-text.md).
    Linked,
    /// The document's head and tail within the budget (the LIFT paper's truncation).
    #[value(name = "head_tail")]
    HeadTail,
    /// As much of the document as the model's window holds (head and tail when it does not fit).
    Full,
}

impl ContextPolicy {
    pub fn name(self) -> &'static str {
        match self {
            ContextPolicy::Retrieved => "retrieved",
            ContextPolicy::Bm25 => "bm25",
            ContextPolicy::Linked => "linked",
            ContextPolicy::HeadTail => "head_tail",
            ContextPolicy::Full => "full",
        }
    }

    /// Whether the context is passages retrieved for the question.
    pub fn retrieves(self) -> bool {
        matches!(self, ContextPolicy::Retrieved | ContextPolicy::Bm25 | ContextPolicy::Linked)
    }

    pub fn parse(s: &str) -> Option<Self> {
        [ContextPolicy::Retrieved, ContextPolicy::Bm25, ContextPolicy::Linked, ContextPolicy::HeadTail, ContextPolicy::Full]
            .into_iter()
            .find(|p| p.name() == s)
    }
}

/// The in-context document budget when a request names none (`retrieved`, `bm25`, `linked` and
/// `head_tail`; `linked` may fill less of it), chosen on the validation split
/// (docs/retrieval.md): on the default model 128 retrieved tokens answered 48 of 60 planted-fact
/// questions, 64 / 192 / 256 / 512 tokens 43 / 44 / 43 / 40, the whole document as far as the
/// window holds 32.
pub const DEFAULT_CONTEXT_TOKENS: usize = 128;

/// Passage size for retrieval when the base has no FltLM filter (the filter's own chunk size
/// otherwise, so a passage is one of its chunks).
pub const DEFAULT_PASSAGE_TOKENS: usize = 32;

/// The passage size answers retrieve by on `model`: its base filter's chunk size.
pub fn passage_tokens(model: &Model) -> usize {
    model.base_filter().map_or(DEFAULT_PASSAGE_TOKENS, |f| f.chunk_tokens)
}

/// Tokens kept free for the chat template's own tokens around the document and question.
const TEMPLATE_SLACK: usize = 64;

/// A prompt and which document tokens it shows.
#[derive(Clone, Debug)]
pub struct AnswerPrompt {
    pub tokens: Vec<u32>,
    /// The document token ranges in the prompt, in document order (empty in `memory` mode).
    pub shown: Vec<(usize, usize)>,
    /// Document tokens in the prompt.
    pub context_tokens: usize,
    /// The context's chunks in the prepared base's FltLM layout (empty without a base filter or
    /// context): the answer scores and masks them.
    pub chunks: Vec<layout::Chunk>,
    /// How the context was chosen (None in `memory` mode).
    pub policy: Option<ContextPolicy>,
}

impl AnswerPrompt {
    /// Whether document tokens `a..b` are all in the prompt.
    pub fn shows(&self, (a, b): (usize, usize)) -> bool {
        self.shown.iter().any(|&(s, e)| s <= a && b <= e)
    }
}

/// The in-context document budget: `requested`, else the model's window minus the
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
    /// The conversation before the question (user and assistant turns, oldest first; other roles
    /// are left out): earlier questions help choose the passages ([`retrieval_query`]), and the
    /// turns go into the prompt as chat turns, the oldest left out first where the window is
    /// short ([`build_prompt`]). Empty: a question on its own.
    pub history: &'a [ChatMessage],
    pub mode: Mode,
    /// The context policy; `None`: the mode's default ([`Mode::default_context`]).
    pub context: Option<ContextPolicy>,
    /// In-context document budget in tokens; `None`: [`DEFAULT_CONTEXT_TOKENS`] (`full`: what
    /// fits the model's window).
    pub context_tokens: Option<usize>,
}

impl<'a> Ask<'a> {
    /// A question in `mode` with the mode's default context and budget.
    pub fn new(question: &'a str, mode: Mode) -> Self {
        Self { question, history: &[], mode, context: None, context_tokens: None }
    }

    pub fn policy(&self) -> ContextPolicy {
        self.context.unwrap_or(self.mode.default_context())
    }

    /// The in-context budget asked for, in document tokens: `None` means what fits the window.
    /// The one defaulting rule: the prompt builder and the servers' KV reservations both read it.
    pub fn requested_budget(&self) -> Option<usize> {
        match self.policy() {
            ContextPolicy::Full => self.context_tokens,
            _ => Some(self.context_tokens.unwrap_or(DEFAULT_CONTEXT_TOKENS)),
        }
    }
}

/// The weight of the user turn before the question in the retrieval query; each turn further
/// back counts half as much as the one after it. Under 1, so that the question's own words
/// outweigh a topic asked about before, and decaying, so that a conversation that moved on to
/// another topic leaves the old one behind.
pub const HISTORY_QUERY_WEIGHT: f32 = 0.5;

/// Earlier user turns read into a retrieval query (the ones before weigh under 1/32).
pub const HISTORY_QUERY_TURNS: usize = 4;

/// The retrieval query of `ask`: its question at weight 1, then the user turns before it, newest
/// first, at [`HISTORY_QUERY_WEIGHT`] halving each turn back. A follow-up that does not name its
/// topic ("When did it open?" after "Tell me about the museum") finds the topic's passages
/// through the earlier question ([`PassageIndex::search_weighted`]).
///
/// [`PassageIndex::search_weighted`]: crate::retrieve::PassageIndex::search_weighted
pub fn retrieval_query<'a>(ask: &Ask<'a>) -> Vec<(&'a str, f32)> {
    let mut query = vec![(ask.question, 1.0)];
    let earlier = ask.history.iter().rev().filter(|t| t.role == "user").take(HISTORY_QUERY_TURNS);
    let mut weight = HISTORY_QUERY_WEIGHT;
    for turn in earlier {
        query.push((turn.content.as_str(), weight));
        weight /= 2.0;
    }
    query
}

/// The turns of `history` a prompt carries: user and assistant messages, from the first user
/// message on (a template may expect the conversation to open with the user).
fn conversation(history: &[ChatMessage]) -> Vec<ChatMessage> {
    let turns = history.iter().filter(|t| t.role == "user" || t.role == "assistant");
    turns.skip_while(|t| t.role != "user").cloned().collect()
}

/// Template tokens a turn takes besides its text, at least (ChatML's `<|im_start|>role\n` and
/// `<|im_end|>\n`): how turns are counted before their prompt is rendered.
const TURN_TOKENS: usize = 4;

/// The prompt `build` makes with the most recent of `history`'s turns that leave `max_tokens` of
/// answer in the model's window: the oldest turns are left out first (a question with the answer
/// that followed it), never what `build` shows without turns (the document's text, the question).
fn with_turns<T>(
    model: &Model,
    history: &[ChatMessage],
    max_tokens: usize,
    len: impl Fn(&T) -> usize,
    build: impl Fn(&[ChatMessage]) -> Result<T>,
) -> Result<T> {
    let turns = conversation(history);
    if turns.is_empty() {
        return build(&[]);
    }
    let window = model.config().max_position_embeddings;
    let room = window.saturating_sub(len(&build(&[])?) + max_tokens);
    // Each turn's tokens, at least: the newest turns whose count fits are tried first.
    let costs = turns
        .iter()
        .map(|t| Ok(model.tokenizer.encode_plain(&t.content)?.len() + TURN_TOKENS))
        .collect::<Result<Vec<usize>>>()?;
    let mut from = turns.len();
    let mut used = 0;
    while from > 0 && used + costs[from - 1] <= room {
        from -= 1;
        used += costs[from];
    }
    loop {
        from = skip_to_user(&turns, from);
        let p = build(&turns[from..])?;
        let over = (len(&p) + max_tokens).saturating_sub(window);
        if over == 0 || from == turns.len() {
            return Ok(p);
        }
        // Leave out the oldest turns that (counted at least) make up the excess, one at least.
        let mut dropped = 0;
        while from < turns.len() && (dropped < over || dropped == 0) {
            dropped += costs[from];
            from += 1;
        }
    }
}

/// The first user turn of `turns` at or after `from` (`turns.len()` when there is none).
fn skip_to_user(turns: &[ChatMessage], from: usize) -> usize {
    (from..turns.len()).find(|&i| turns[i].role == "user").unwrap_or(turns.len())
}

/// Builds the prompt for `ask` about `doc` leaving room for `max_tokens` of answer: the one
/// prompt every answer uses, and that evaluations label questions by. With a prepared base's FltLM
/// filter the context is laid out in its chunks, the question before and after them. The
/// conversation before the question (`ask.history`) comes before as chat turns, in what the
/// window has left once the context and the question are in: the context's budget is the same
/// with or without it.
pub fn build_prompt(model: &Model, doc: &Document, ask: &Ask, max_tokens: usize) -> Result<AnswerPrompt> {
    let question = ask.question;
    let ids = doc.tokens();
    let history = ask.history;
    let tokens_of = |p: &AnswerPrompt| p.tokens.len();
    if !ask.mode.uses_context() {
        return with_turns(model, history, max_tokens, tokens_of, |turns| {
            let tokens = chat_after_turns(model, turns, &[], question)?.0;
            Ok(AnswerPrompt { tokens, shown: Vec::new(), context_tokens: 0, chunks: Vec::new(), policy: None })
        });
    }
    let policy = ask.policy();
    let requested = ask.requested_budget();
    let q_tokens = model.tokenizer.encode(question, false)?.len();
    let filter = model.base_filter();
    let q_room = min_prompt_tokens(q_tokens, filter.is_some()) - TEMPLATE_SLACK;
    // What the window holds; the filter's layout adds a marker per chunk: leave room for them.
    let fits = context_budget(model, q_room, max_tokens, None);
    let fits = filter.map_or(fits, |f| fits * f.chunk_tokens / (f.chunk_tokens + 1));
    let budget = requested.map_or(fits, |r| r.min(fits));
    if policy.retrieves() {
        let (index, ranked) = ranked_passages(model, doc, ask, budget, fits)?;
        // The chosen passages' markers and elisions are not in the budget: when a prompt over
        // what the window holds comes out, the budget shrinks by the excess and they are chosen
        // again (once or twice at most).
        let window = model.config().max_position_embeddings;
        let mut budget = budget;
        loop {
            let shown: Vec<(usize, usize)> = select(&index, &ranked, budget, policy).into_iter().map(|p| index.passages[p]).collect();
            let p = passages_prompt(model, &[], ids, &shown, question, filter.is_some(), policy)?;
            let over = (p.tokens.len() + max_tokens).saturating_sub(window);
            if over == 0 || shown.is_empty() {
                if conversation(history).is_empty() {
                    return Ok(p);
                }
                return with_turns(model, history, max_tokens, tokens_of, |turns| {
                    passages_prompt(model, turns, ids, &shown, question, filter.is_some(), policy)
                });
            }
            budget = budget.saturating_sub(over);
        }
    }
    if let Some(filter) = filter {
        let breaks = doc.breaks(model)?;
        let build = |turns: &[ChatMessage]| {
            let p = layout::build_prompt_after(model, turns, ids, breaks, question, budget, filter.chunk_tokens)?;
            let context_tokens = p.chunks.iter().map(|c| c.end - c.start).sum();
            let shown = head_and_tail(p.head_end, p.tail_start, ids.len());
            Ok(AnswerPrompt { tokens: p.tokens, shown, context_tokens, chunks: p.chunks, policy: Some(policy) })
        };
        return with_turns(model, history, max_tokens, tokens_of, build);
    }
    let elision = elision_tokens(model)?;
    let ctx = head_tail(ids, budget, budget / 2, &elision);
    let (head_end, tail_start) = kept_ranges(ids.len(), budget, budget / 2, elision.len());
    let shown = head_and_tail(head_end, tail_start, ids.len());
    with_turns(model, history, max_tokens, tokens_of, |turns| {
        let tokens = chat_after_turns(model, turns, &ctx, question)?.0;
        Ok(AnswerPrompt { tokens, shown: shown.clone(), context_tokens: ctx.len(), chunks: Vec::new(), policy: Some(policy) })
    })
}

/// BM25's candidates the filter re-ranks: as many as fill this many times the budget.
pub const RERANK_FACTOR: usize = 2;

/// The second stage of retrieval: the first of `ranked` that fill `candidate_tokens` laid out as
/// the answer lays out its context (the question, then each passage and its marker, in document
/// order), run through the layers up to the prepared base's filter layer only; they are ranked by
/// the filter's chunk scores (FltLM eq. 3, the relevance it was trained to score), best first,
/// the rest of `ranked` after them. The filter reads the question alone, as it was trained: in a
/// conversation the earlier questions have already brought their topic's passages among the
/// candidates (BM25 over [`retrieval_query`]), and with the earlier turns in its prompt the
/// shipped filter put an earlier topic before the one the question itself names.
fn rerank(
    model: &Model,
    f: &layout::Filter,
    ids: &[u32],
    index: &crate::retrieve::PassageIndex,
    question: &str,
    ranked: &[usize],
    candidate_tokens: usize,
) -> Result<Vec<usize>> {
    let mut candidates = Vec::new();
    let mut used = 0;
    for &p in ranked {
        let (a, b) = index.passages[p];
        if used + (b - a) > candidate_tokens {
            break;
        }
        used += b - a;
        candidates.push(p);
    }
    if candidates.len() < 2 {
        return Ok(ranked.to_vec());
    }
    candidates.sort_unstable();
    let ranges: Vec<(usize, usize)> = candidates.iter().map(|&p| index.passages[p]).collect();
    let (tokens, chunks) = layout::ranges_prompt(model, ids, &ranges, question)?;
    let mut hooks = FilterHooks::new(f, &chunks, model.config().num_layers);
    let input = candle_core::Tensor::new(tokens.as_slice(), model.device())?.unsqueeze(0)?;
    model.decoder.run_through_layer(&input, f.layer, &mut hooks)?;
    let scores = hooks.report()?;
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&x, &y| scores[y].score.total_cmp(&scores[x].score).then(x.cmp(&y)));
    let mut out: Vec<usize> = order.into_iter().map(|i| candidates[i]).collect();
    out.extend(ranked.iter().filter(|p| !candidates.contains(p)));
    Ok(out)
}

/// The prompt showing the document ranges `shown` (whole passages, in document order): one
/// filter chunk each in the FltLM layout, else joined by the elision marker where they do not
/// follow each other.
fn passages_prompt(
    model: &Model,
    turns: &[ChatMessage],
    ids: &[u32],
    shown: &[(usize, usize)],
    question: &str,
    filtered: bool,
    policy: ContextPolicy,
) -> Result<AnswerPrompt> {
    let context_tokens = shown.iter().map(|(a, b)| b - a).sum();
    if filtered {
        let (tokens, chunks) = layout::ranges_prompt_after(model, turns, ids, shown, question)?;
        return Ok(AnswerPrompt { tokens, shown: merged(shown), context_tokens, chunks, policy: Some(policy) });
    }
    let elision = elision_tokens(model)?;
    let mut ctx = Vec::with_capacity(context_tokens + elision.len() * shown.len());
    for (i, &(a, b)) in shown.iter().enumerate() {
        if i > 0 && shown[i - 1].1 != a {
            ctx.extend_from_slice(&elision);
        }
        ctx.extend_from_slice(&ids[a..b]);
    }
    let tokens = chat_after_turns(model, turns, &ctx, question)?.0;
    Ok(AnswerPrompt { tokens, shown: merged(shown), context_tokens, chunks: Vec::new(), policy: Some(policy) })
}

/// The document's passages (its retrieval index) and those `ask` retrieves, best first: BM25
/// with its feedback step, re-ranked by the prepared base's filter under the `retrieved` policy
/// when more was found than `budget` holds (its candidates' layout within `fits` tokens).
fn ranked_passages<'d>(
    model: &Model,
    doc: &'d Document,
    ask: &Ask,
    budget: usize,
    fits: usize,
) -> Result<(std::borrow::Cow<'d, crate::retrieve::PassageIndex>, Vec<usize>)> {
    let index = doc.passages(model, passage_tokens(model))?;
    let query = retrieval_query(ask);
    let hits = if ask.policy() == ContextPolicy::Linked { index.search_linked(&query) } else { index.search_with_feedback(&query) };
    let mut ranked: Vec<usize> = hits.iter().map(|h| h.passage).collect();
    // When every passage BM25 found fits the budget, all are shown whatever their order (unless
    // the window forces the budget down below): the re-rank would change nothing; skipped.
    let found: usize = ranked.iter().map(|&p| index.passages[p].1 - index.passages[p].0).sum();
    if let Some(f) = model.base_filter().filter(|_| ask.policy() == ContextPolicy::Retrieved && found > budget) {
        // The candidates' layout must fit the window too.
        ranked = rerank(model, f, doc.tokens(), &index, ask.question, &ranked, (RERANK_FACTOR * budget).min(fits))?;
    }
    Ok((index, ranked))
}

/// The passages of `ranked` shown within `budget`, in document order: under `linked` those alone
/// (the document's first passages when nothing was found), else topped up with them.
fn select(index: &crate::retrieve::PassageIndex, ranked: &[usize], budget: usize, policy: ContextPolicy) -> Vec<usize> {
    if policy == ContextPolicy::Linked { index.select_ranked(ranked, budget) } else { index.select(ranked, budget) }
}

/// The shown ranges of a head-and-tail context.
fn head_and_tail(head_end: usize, tail_start: usize, n: usize) -> Vec<(usize, usize)> {
    merged(&[(0, head_end), (tail_start.max(head_end), n)])
}

/// Ranges in order with touching ones joined and empty ones dropped.
fn merged(ranges: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &(a, b) in ranges.iter().filter(|(a, b)| a < b) {
        match out.last_mut() {
            Some(last) if last.1 == a => last.1 = b,
            _ => out.push((a, b)),
        }
    }
    out
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
    let seq = sequence(model, &prompt, params)?;
    Ok((prompt, seq))
}

/// The sequence that answers `prompt`, with FltLM hooks when its context is laid out in chunks.
fn sequence<'m>(model: &'m Model, prompt: &AnswerPrompt, params: &SamplingParams) -> Result<Sequence<'m, AnswerHooks<'m>>> {
    let layers = model.config().num_layers;
    let hooks = model.base_filter().filter(|_| !prompt.chunks.is_empty()).map(|f| FilterHooks::new(f, &prompt.chunks, layers));
    let cache = KvCache::with_capacity(layers, prompt.tokens.len() + params.max_tokens);
    Ok(Sequence::new(model, prompt.tokens.clone(), cache, params.clone(), hooks)?)
}

/// Each in-context chunk's FltLM score and mask, once the answer's prompt has run.
pub fn chunk_scores(hooks: &AnswerHooks) -> Result<Vec<ChunkScore>> {
    hooks.as_ref().map_or(Ok(Vec::new()), |h| h.report())
}

/// Answers `ask` by reading each passage its budget would show on its own, and keeps the
/// answer whose tokens are likeliest (the highest mean log-probability): the small reader
/// answers half of what it is shown in one passage and one in five in four (docs/real-text.md).
/// One generation per passage. Falls back to [`answer`] when the policy does not retrieve or
/// nothing was found; the returned prompt is the kept answer's.
pub fn answer_each_passage(
    model: &Model,
    doc: &Document,
    adapter: Option<&dyn Adapter>,
    ask: &Ask,
    params: &SamplingParams,
) -> Result<Answer> {
    let policy = ask.policy();
    if !policy.retrieves() {
        return answer(model, doc, adapter, ask, params, &mut |_| true);
    }
    let adapter = if ask.mode.uses_adapter() { adapter } else { None };
    let budget = ask.requested_budget().unwrap_or(DEFAULT_CONTEXT_TOKENS);
    let (index, ranked) = ranked_passages(model, doc, ask, budget, budget)?;
    let filtered = model.base_filter().is_some();
    let mut best: Option<(f32, Answer)> = None;
    for p in select(&index, &ranked, budget, policy) {
        let prompt = passages_prompt(model, &[], doc.tokens(), &[index.passages[p]], ask.question, filtered, policy)?;
        let seq = sequence(model, &prompt, params)?;
        let (generation, _, hooks) = run_alone(model, seq, adapter, &mut |_| true)?;
        let chunks = chunk_scores(&hooks)?;
        let n = generation.logprobs.len();
        let score = if n == 0 { f32::NEG_INFINITY } else { generation.logprobs.iter().sum::<f32>() / n as f32 };
        if best.as_ref().is_none_or(|(s, _)| score > *s) {
            best = Some((score, Answer { prompt, generation, chunks }));
        }
    }
    match best {
        Some((_, a)) => Ok(a),
        None => answer(model, doc, adapter, ask, params, &mut |_| true),
    }
}

/// Answers `question` reading exactly the document token ranges `shown` (in document order),
/// with the frozen model and its prepared base, no adapter: how the auxiliary QA is checked
/// against its own evidence ([`crate::lift::absorb::answerable`]).
pub fn answer_reading(
    model: &Model,
    doc: &Document,
    shown: &[(usize, usize)],
    question: &str,
    params: &SamplingParams,
) -> Result<Answer> {
    let filtered = model.base_filter().is_some();
    let prompt = passages_prompt(model, &[], doc.tokens(), shown, question, filtered, ContextPolicy::Bm25)?;
    let seq = sequence(model, &prompt, params)?;
    let (generation, _, hooks) = run_alone(model, seq, None, &mut |_| true)?;
    let chunks = chunk_scores(&hooks)?;
    Ok(Answer { prompt, generation, chunks })
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
