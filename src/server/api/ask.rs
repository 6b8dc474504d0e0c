//! `POST /ask`: the question with its history and sampling bounds (`GenerationLimits`, shared with
//! the chat completions), and the answer's shape (usage, timings, the adapter, the context read).

use super::missing;
use crate::server::error::{ApiError, ApiResult};
use crate::lift::answer::{ContextPolicy, Mode};
use crate::model::generate::{FinishReason, SamplingParams};
use crate::model::ChatMessage;
use crate::service::Question;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

// ---------- POST /ask ----------

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AskRequest {
    pub document_id: Option<String>,
    /// A collection to ask instead of one document (`col_…`; modes `lift` and `rag`).
    pub collection_id: Option<String>,
    pub question: Option<String>,
    /// `lift` (default): adapter + the document's passages; `rag`: the passages, no adapter;
    /// `icl`: no adapter, head and tail of the document; `memory`: adapter, no document text.
    /// Before a document's adapter exists, `lift` answers as `rag` (or with the latest snapshot).
    #[schema(value_type = Option<String>, example = "lift")]
    pub mode: Option<Mode>,
    /// Which document text is shown: `bm25` (the passages BM25 ranks first for the question;
    /// the default except in `icl`), `retrieved` (BM25's candidates re-ranked by the prepared
    /// base's FltLM filter), `linked` (the best passage and only the passages its names link it
    /// to: reads real prose best), `head_tail` (the LIFT paper's truncation; `icl`'s default),
    /// `full` (what fits the model's window).
    #[schema(value_type = Option<String>, example = "bm25")]
    pub context: Option<ContextPolicy>,
    /// In-context document budget in tokens (default: the server's `--context-tokens`, 128).
    pub context_tokens: Option<u64>,
    pub max_tokens: Option<u64>,
    /// 0 (default): greedy.
    pub temperature: Option<f64>,
    /// Answer as a `text/event-stream`: `token` events as the text is generated, then one
    /// `answer` event with the whole answer (or `error`).
    pub stream: Option<bool>,
    /// true: the answer carries `context`, the passages it read (default false).
    pub include_context: Option<bool>,
    /// The conversation before `question`, oldest first: `{"role": "user" | "assistant",
    /// "content": "..."}` turns. The earlier questions help choose the passages (a follow-up such
    /// as "When did it open?" finds the passages of the topic asked about before), and the turns
    /// precede the question in the prompt as chat turns, the oldest left out first where the
    /// model's window is short. At most 64 turns; their characters count with the question's
    /// against the question limit.
    pub history: Option<Vec<Turn>>,
}

/// A turn of the conversation before a question (`AskRequest.history`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    #[schema(value_type = String, example = "user")]
    pub role: TurnRole,
    pub content: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TurnRole {
    User,
    Assistant,
}

/// Most turns in `/ask`'s `history`.
pub const MAX_HISTORY_TURNS: usize = 64;

/// `history` checked against its bounds (`question_chars`: the question's characters, counted
/// with the turns' against the question limit), as chat messages.
fn history(turns: Option<Vec<Turn>>, question_chars: usize, limits: &GenerationLimits) -> ApiResult<Vec<ChatMessage>> {
    let turns = turns.unwrap_or_default();
    if turns.len() > MAX_HISTORY_TURNS {
        return Err(ApiError::bad_request(
            "invalid_history",
            format!("'history' has {} turns; the limit is {MAX_HISTORY_TURNS}", turns.len()),
        )
        .param("history"));
    }
    let chars = question_chars + turns.iter().map(|t| t.content.chars().count()).sum::<usize>();
    let limit = limits.max_question_chars;
    if chars > limit {
        return Err(ApiError::bad_request(
            "history_too_long",
            format!("the question and its history have {chars} characters; the limit is {limit}"),
        )
        .param("history"));
    }
    let role = |r: TurnRole| if r == TurnRole::User { "user" } else { "assistant" };
    Ok(turns.into_iter().map(|t| ChatMessage::new(role(t.role), t.content)).collect())
}

/// The server's bounds on generation requests.
#[derive(Clone, Copy, Debug)]
pub struct GenerationLimits {
    pub max_question_chars: usize,
    pub max_tokens_limit: usize,
    pub default_max_tokens: usize,
}

impl GenerationLimits {
    /// `max_tokens` within 1..=limit (the default when absent).
    pub(super) fn max_tokens(&self, v: Option<u64>, param: &str) -> ApiResult<usize> {
        let limit = self.max_tokens_limit;
        match v {
            None => Ok(self.default_max_tokens.min(limit)),
            Some(n) if n >= 1 && n <= limit as u64 => Ok(n as usize),
            Some(n) => Err(ApiError::bad_request(
                "invalid_max_tokens",
                format!("'{param}' must be between 1 and {limit} (got {n})"),
            )
            .param(param)),
        }
    }

    pub(super) fn question(&self, q: &str, param: &str) -> ApiResult<()> {
        if q.trim().is_empty() {
            return Err(ApiError::unprocessable("empty_question", "the question is empty").param(param));
        }
        let (n, limit) = (q.chars().count(), self.max_question_chars);
        if n > limit {
            return Err(ApiError::bad_request(
                "question_too_long",
                format!("the question has {n} characters; the limit is {limit}"),
            )
            .param(param));
        }
        Ok(())
    }
}

/// Most in-context document tokens a request may ask for (the model's window bounds it too).
pub const MAX_CONTEXT_TOKENS: u64 = 1 << 20;

/// `context_tokens` within 1..=MAX_CONTEXT_TOKENS, for a mode that shows context.
pub(super) fn context_tokens(v: Option<u64>, mode: Mode, context: Option<ContextPolicy>) -> ApiResult<Option<usize>> {
    if !mode.uses_context() && (v.is_some() || context.is_some()) {
        let param = if context.is_some() { "context" } else { "context_tokens" };
        return Err(ApiError::bad_request("invalid_context", "mode 'memory' shows no document text: leave out 'context' and 'context_tokens'")
            .param(param));
    }
    match v {
        None => Ok(None),
        Some(n) if (1..=MAX_CONTEXT_TOKENS).contains(&n) => Ok(Some(n as usize)),
        Some(n) => Err(ApiError::bad_request(
            "invalid_context_tokens",
            format!("'context_tokens' must be between 1 and {MAX_CONTEXT_TOKENS} (got {n})"),
        )
        .param("context_tokens")),
    }
}

pub(super) fn temperature(v: Option<f64>) -> ApiResult<f64> {
    match v {
        None => Ok(0.0),
        Some(t) if (0.0..=2.0).contains(&t) => Ok(t),
        Some(t) => {
            Err(ApiError::bad_request("invalid_temperature", format!("'temperature' must be in [0, 2] (got {t})"))
                .param("temperature"))
        }
    }
}

impl AskRequest {
    /// The question, its sampling parameters and whether to stream.
    /// (Also whether the answer carries its context: `include_context`.)
    pub fn validate(self, limits: &GenerationLimits) -> ApiResult<(Question, SamplingParams, bool, bool)> {
        let document_id = self.document_id.ok_or_else(|| missing("document_id"))?;
        let question = self.question.ok_or_else(|| missing("question"))?;
        limits.question(&question, "question")?;
        let max_tokens = limits.max_tokens(self.max_tokens, "max_tokens")?;
        let temperature = temperature(self.temperature)?;
        let params = SamplingParams { max_tokens, temperature, ..Default::default() };
        let (mode, context) = (self.mode.unwrap_or_default(), self.context);
        let context_tokens = context_tokens(self.context_tokens, mode, context)?;
        let history = history(self.history, question.chars().count(), limits)?;
        let question = Question { document_id, question, history, mode, context, context_tokens };
        Ok((question, params, self.stream.unwrap_or(false), self.include_context.unwrap_or(false)))
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AskResponse {
    pub answer: String,
    pub document_id: String,
    #[schema(value_type = String)]
    pub mode: Mode,
    pub usage: AskUsage,
    #[schema(value_type = String)]
    pub finish_reason: FinishReason,
    pub timings: Timings,
    /// The adapter that answered: the final one (`step` = `planned_steps` unless training
    /// stopped early) or a snapshot part-way through training; null when none did (modes
    /// `rag` and `icl`, or a document whose adapter does not exist yet).
    pub adapter: Option<AnsweredBy>,
    /// Whose answer this is when an adapter ran: `adapter`, or `passages` when self-gating kept
    /// the answer the same prompt gets without the adapter (it was the surer of the two).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub answered_by: Option<crate::lift::answer::gate::AnswerSource>,
    /// The passages the answer read, with what the prepared base's filter did to them (only
    /// with `include_context`; modes with context).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<Context>,
    /// Asking a collection: the documents and passages read (`document_id` is then the document
    /// whose passage ranked first).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collection: Option<crate::server::collections::CollectionAnswer>,
    /// Said beside the answer: the document is being absorbed again over the server's new base,
    /// and answers from its passages until then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notice: Option<String>,
}

/// Which adapter answered (`AskResponse.adapter`).
#[derive(Debug, Serialize, ToSchema)]
pub struct AnsweredBy {
    pub step: usize,
    pub planned_steps: usize,
    /// Asking a collection: the document whose adapter it is (routing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document_id: Option<String>,
}

/// A piece of a streamed answer (`event: token`).
#[derive(Debug, Serialize, ToSchema)]
pub struct AskToken {
    pub text: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AskUsage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Timings {
    pub queue_ms: f64,
    pub prompt_ms: f64,
    pub generate_ms: f64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Context {
    pub chunks: Vec<ContextChunk>,
}

/// One chunk of the in-context document: document token offsets, FltLM's relevance score and the
/// attention bias `min(0, w·s + b)` its keys got.
#[derive(Debug, Serialize, ToSchema)]
pub struct ContextChunk {
    pub start: usize,
    pub end: usize,
    pub score: f32,
    pub mask: f32,
    pub text: String,
    /// Asking a collection: the chunk's document (`score` is then its BM25 score, `mask` 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document_id: Option<String>,
}
