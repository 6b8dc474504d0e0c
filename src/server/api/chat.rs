//! OpenAI's surface: `POST /v1/chat/completions` (the request, its validation into a base-model or
//! a document target, the completion and its streamed chunks) and `/v1/models`' entries.

use super::{context_tokens, missing, temperature, AnsweredBy, Context, GenerationLimits};
use crate::server::error::{ApiError, ApiResult};
use crate::lift::answer::{ContextPolicy, Mode};
use crate::model::generate::{FinishReason, SamplingParams};
use crate::model::ChatMessage;
use crate::service::Question;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

// ---------- POST /v1/chat/completions ----------

/// OpenAI's chat completion request. Unlike `/ask` and `/documents`, unknown fields are ignored
/// (the API contract): OpenAI clients send fields of newer API versions that change nothing here.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// The base model's id, or a ready document's id (answered as `/ask` answers).
    pub model: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    #[schema(value_type = Option<Object>)]
    pub stop: Option<Stop>,
    pub seed: Option<i64>,
    pub n: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Each generated token's log-probability in `choices[].logprobs.content` (streamed: all
    /// of them in the finishing chunk).
    pub logprobs: Option<bool>,
    /// With `logprobs`: the most likely alternatives at each token, 0 to 20.
    pub top_logprobs: Option<u64>,
    /// lift-serve's extension: the answer mode for a document model (as in `/ask`).
    #[schema(value_type = Option<String>)]
    pub mode: Option<Mode>,
    /// lift-serve's extension: the context policy for a document model (as in `/ask`).
    #[schema(value_type = Option<String>)]
    pub context: Option<ContextPolicy>,
    /// lift-serve's extension: the in-context budget for a document model (as in `/ask`).
    pub context_tokens: Option<u64>,
    /// lift-serve's extension: true puts the passages read in `lift.context` (as `/ask`'s
    /// `include_context`; non-streamed completions of a document model).
    pub include_context: Option<bool>,
}

#[derive(Debug, Deserialize, ToSchema)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// A chat message; only the role and the text content are read.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatMessageIn {
    #[schema(value_type = String, example = "user")]
    pub role: Role,
    #[schema(value_type = Option<Object>)]
    pub content: Option<Content>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Read as `system`.
    Developer,
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Developer | Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// Message content: a string or an array of parts, of which only text parts are supported.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// Where a chat completion goes.
pub enum ChatTarget {
    /// The base model, on the whole conversation.
    Base(Vec<ChatMessage>),
    /// A document, on the last user message, with the user and assistant messages before it as
    /// the conversation it follows.
    Document(Question),
}

pub struct ValidChat {
    pub model: String,
    pub target: ChatTarget,
    pub params: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    pub include_context: bool,
    /// Report each token's log-probability (`logprobs`).
    pub logprobs: bool,
}

fn bad_messages(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request("invalid_messages", msg).param("messages")
}

impl ChatMessageIn {
    fn into_message(self) -> ApiResult<ChatMessage> {
        let content = match self.content {
            None => String::new(),
            Some(Content::Text(s)) => s,
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => out.push_str(&t),
                        _ => return Err(bad_messages("only text content parts are supported")),
                    }
                }
                out
            }
        };
        Ok(ChatMessage { role: self.role.name().to_string(), content })
    }
}

impl ChatRequest {
    /// Checks the request; `is_document` tells a document id from an unknown model.
    pub fn validate(
        self,
        limits: &GenerationLimits,
        base_id: &str,
        is_document: impl Fn(&str) -> bool,
    ) -> ApiResult<ValidChat> {
        let model = self.model.ok_or_else(|| missing("model"))?;
        let messages = self.messages.ok_or_else(|| missing("messages"))?;
        if messages.is_empty() {
            return Err(bad_messages("'messages' must not be empty"));
        }
        let messages: Vec<ChatMessage> = messages.into_iter().map(ChatMessageIn::into_message).collect::<ApiResult<_>>()?;
        let (chars, limit) = (messages.iter().map(|m| m.content.chars().count()).sum::<usize>(), limits.max_question_chars);
        if chars > limit {
            return Err(ApiError::bad_request(
                "messages_too_long",
                format!("the messages have {chars} characters; the limit is {limit}"),
            )
            .param("messages"));
        }
        let max_tokens = match self.max_completion_tokens {
            Some(n) => limits.max_tokens(Some(n), "max_completion_tokens")?,
            None => limits.max_tokens(self.max_tokens, "max_tokens")?,
        };
        let logprobs = self.logprobs.unwrap_or(false);
        let params = SamplingParams {
            max_tokens,
            temperature: temperature(self.temperature)?,
            top_p: top_p(self.top_p)?,
            seed: self.seed.unwrap_or(0) as u64,
            stop: stop(self.stop)?,
            top_logprobs: top_logprobs(self.top_logprobs, logprobs)?,
        };
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::bad_request("unsupported_n", format!("only n = 1 is supported (got {n})")).param("n"));
        }
        let target = if model == base_id {
            ChatTarget::Base(messages)
        } else if is_document(&model) {
            // The last user message is the question; the user and assistant messages before it
            // are the conversation it follows (system messages give way to the answer's own, and
            // what comes after the question is not part of it).
            let last = messages
                .iter()
                .rposition(|m| m.role == "user")
                .ok_or_else(|| bad_messages("a document model needs a user message"))?;
            let mut messages = messages;
            messages.truncate(last + 1);
            let question = messages.pop().map(|m| m.content).unwrap_or_default();
            limits.question(&question, "messages")?;
            let history = messages.into_iter().filter(|m| m.role == "user" || m.role == "assistant").collect();
            let (mode, context) = (self.mode.unwrap_or_default(), self.context);
            let context_tokens = context_tokens(self.context_tokens, mode, context)?;
            ChatTarget::Document(Question { document_id: model.clone(), question, history, mode, context, context_tokens })
        } else {
            return Err(
                ApiError::not_found("model_not_found", format!("the model '{model}' does not exist")).param("model")
            );
        };
        let include_usage = self.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        let include_context = self.include_context.unwrap_or(false);
        let stream = self.stream.unwrap_or(false);
        Ok(ValidChat { model, target, params, stream, include_usage, include_context, logprobs })
    }
}

/// Most alternatives per token (OpenAI's bound).
const MAX_TOP_LOGPROBS: u64 = 20;

fn top_logprobs(v: Option<u64>, logprobs: bool) -> ApiResult<usize> {
    let bad = |msg: String| Err(ApiError::bad_request("invalid_top_logprobs", msg).param("top_logprobs"));
    match v {
        None | Some(0) => Ok(0),
        Some(_) if !logprobs => bad("'top_logprobs' needs 'logprobs': true".into()),
        Some(n) if n <= MAX_TOP_LOGPROBS => Ok(n as usize),
        Some(n) => bad(format!("'top_logprobs' must be 0 to {MAX_TOP_LOGPROBS} (got {n})")),
    }
}

/// OpenAI's `logprobs` of a choice: every generated token, with its alternatives.
pub fn logprobs_of(tokens: &crate::model::generate::TokenScores, tokenizer: &crate::model::tokenizer::TextTokenizer) -> serde_json::Value {
    serde_json::json!({ "content": tokens.spell(tokenizer), "refusal": null })
}

fn top_p(v: Option<f64>) -> ApiResult<f64> {
    match v {
        None => Ok(1.0),
        Some(p) if p > 0.0 && p <= 1.0 => Ok(p),
        Some(p) => Err(ApiError::bad_request("invalid_top_p", format!("'top_p' must be in (0, 1] (got {p})")).param("top_p")),
    }
}

/// Most stop strings.
const MAX_STOP: usize = 4;

fn stop(v: Option<Stop>) -> ApiResult<Vec<String>> {
    match v {
        None => Ok(Vec::new()),
        Some(Stop::One(s)) => Ok(vec![s]),
        Some(Stop::Many(v)) if v.len() <= MAX_STOP => Ok(v),
        Some(Stop::Many(v)) => Err(ApiError::bad_request(
            "invalid_stop",
            format!("'stop' must be a string or up to {MAX_STOP} strings (got {})", v.len()),
        )
        .param("stop")),
    }
}

/// OpenAI's `finish_reason`.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    /// "chat.completion".
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: ChatUsage,
    /// lift-serve's extension, for a document model: the mode it was answered in and the
    /// adapter that answered (as in `/ask`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lift: Option<ChatLift>,
}

/// How a document model's chat completion was answered.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatLift {
    #[schema(value_type = String)]
    pub mode: Mode,
    pub adapter: Option<AnsweredBy>,
    /// As `/ask`'s `answered_by`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub answered_by: Option<crate::lift::answer::gate::AnswerSource>,
    /// The passages read (with `include_context`), as `/ask`'s `context`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<Context>,
    /// A collection model: the document whose passage ranked first, and what was read (as
    /// `/ask`'s `document_id` and `collection`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collection: Option<crate::server::collections::CollectionAnswer>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChatMessageOut {
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct ChatUsage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl ChatUsage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

/// One event of a streamed completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatChunk {
    pub id: String,
    /// "chat.completion.chunk".
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<ChatUsage>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize, ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// An entry of `/v1/models`: the base model, or a ready document.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    /// "model".
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// A document's title (documents only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub title: Option<Option<String>>,
}
