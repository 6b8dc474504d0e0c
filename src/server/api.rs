//! The HTTP API's types: request bodies as clients send them (typed, unknown fields refused, every
//! error naming the field), their validation — once, into what the service takes — and the
//! response bodies. The OpenAPI document (`openapi.rs`) is generated from these types.

use super::error::{ApiError, ApiResult};
pub use super::document_options::DocumentOptions;
use crate::lift::answer::{ContextPolicy, Mode};
use crate::lift::AbsorbOptions;
use crate::model::generate::{FinishReason, SamplingParams};
use crate::model::ChatMessage;
use crate::extraction::{Extractor, Failure};
use crate::formats::{Extracted, Source};
use crate::service::{NewDocument, Question};
use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

// ---------- reading a body ----------

/// Which request a body belongs to: decides the error code of a field that does not parse.
#[derive(Clone, Copy)]
pub enum Body {
    Document,
    Ask,
    Chat,
}

impl Body {
    /// The error code for a value of the wrong type or out of its set at `path`.
    fn code(self, path: &str) -> &'static str {
        match (self, path.split(['.', '[']).next().unwrap_or("")) {
            (Body::Document, "options") if path != "options" => "invalid_option",
            (Body::Ask | Body::Chat, "mode") => "invalid_mode",
            (Body::Ask, "history") => "invalid_history",
            (Body::Chat, "messages") => "invalid_messages",
            _ => "invalid_type",
        }
    }

    fn unknown_field_code(self, path: &str) -> &'static str {
        match self {
            Body::Document if path.starts_with("options.") => "unknown_option",
            Body::Chat if path.starts_with("messages") => "invalid_messages",
            Body::Ask if path.starts_with("history") => "invalid_history",
            _ => "unknown_field",
        }
    }
}

/// The request's media type (lower case, without parameters); None when absent.
pub fn media_type(headers: &HeaderMap) -> Option<String> {
    headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("invalid").split(';').next().unwrap_or("").trim().to_ascii_lowercase())
}

pub fn utf8(bytes: &[u8]) -> ApiResult<&str> {
    std::str::from_utf8(bytes)
        .map_err(|e| ApiError::bad_request("invalid_utf8", format!("the body is not valid UTF-8: {e}")))
}

/// A JSON body (`application/json`; a missing content type is taken as JSON) read into `T`.
/// A field that does not parse is named in the error (`param` and message), by its path.
pub fn json_body<T: DeserializeOwned>(headers: &HeaderMap, bytes: &[u8], body: Body) -> ApiResult<T> {
    match media_type(headers).as_deref() {
        None | Some("application/json") => {}
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("content type '{other}' is not supported here; send application/json"),
            ))
        }
    }
    let text = utf8(bytes)?;
    // Syntax first, so that a malformed body is never reported as a field's fault.
    let value = parse_unique(text).map_err(|e| match e {
        Ok(path) => duplicate(&path),
        Err(e) => ApiError::bad_request("invalid_json", format!("malformed JSON: {e}")),
    })?;
    if !value.is_object() {
        return Err(ApiError::bad_request("invalid_json", "the body must be a JSON object"));
    }
    serde_path_to_error::deserialize(value).map_err(|e| field_error(e, body))
}

fn duplicate(path: &str) -> ApiError {
    ApiError::bad_request("duplicate_field", format!("'{path}' is given twice")).param(path)
}

/// JSON text read into a value, refusing an object that names a key twice (a plain parse keeps
/// the last one silently, so that two readers of one body could disagree on what it says):
/// `Err(Ok(path))` for a duplicate at `path`, `Err(Err(e))` for malformed JSON.
pub fn parse_unique(text: &str) -> Result<serde_json::Value, Result<String, serde_json::Error>> {
    use serde::de::DeserializeSeed;
    let dup = std::cell::RefCell::new(None);
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = UniqueSeed { path: String::new(), dup: &dup }.deserialize(&mut de).and_then(|v| de.end().map(|_| v));
    match (parsed, dup.into_inner()) {
        (Ok(v), _) => Ok(v),
        (Err(_), Some(path)) => Err(Ok(path)),
        (Err(e), None) => Err(Err(e)),
    }
}

/// Reads any JSON value, tracking its path, and fails at the first key an object repeats.
struct UniqueSeed<'a> {
    path: String,
    dup: &'a std::cell::RefCell<Option<String>>,
}

impl<'de> serde::de::DeserializeSeed<'de> for UniqueSeed<'_> {
    type Value = serde_json::Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueSeed<'_> {
    type Value = serde_json::Value;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(v.into())
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(UniqueSeed { path: format!("{}[{}]", self.path, out.len()), dup: self.dup })? {
            out.push(v);
        }
        Ok(serde_json::Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let path = if self.path.is_empty() { key.clone() } else { format!("{}.{key}", self.path) };
            if out.contains_key(&key) {
                *self.dup.borrow_mut() = Some(path.clone());
                return Err(serde::de::Error::custom(format!("duplicate field '{path}'")));
            }
            let v = map.next_value_seed(UniqueSeed { path, dup: self.dup })?;
            out.insert(key, v);
        }
        Ok(serde_json::Value::Object(out))
    }
}

fn field_error(e: serde_path_to_error::Error<serde_json::Error>, body: Body) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    let message = inner.to_string();
    // serde's `Error::unknown_field` is the one data error told apart by its (fixed) wording.
    let code = if message.starts_with("unknown field") {
        body.unknown_field_code(&path)
    } else {
        body.code(&path)
    };
    ApiError::bad_request(code, format!("'{path}': {message}")).param(&path)
}

// ---------- path parameters ----------

/// A path parameter (`/documents/{id}`, `/ui/{file}`): one that cannot be read (not UTF-8 once
/// percent-decoded) is refused in the API's error shape, like every other 4xx.
pub struct PathParam(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PathParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<String>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(p)) => Ok(PathParam(p)),
            Err(e) => Err(ApiError::new(e.status(), "invalid_path", format!("the request path cannot be read: {}", e.body_text()))),
        }
    }
}

// ---------- POST /documents ----------

/// `POST /documents` with a JSON body (a `text/plain` body is the text alone).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PostDocument {
    /// The document, UTF-8 text.
    pub text: Option<String>,
    pub title: Option<String>,
    pub options: Option<DocumentOptions>,
    /// A collection (`col_…`) the document joins once posted.
    pub collection: Option<String>,
    /// true: answer what absorbing would cost (planned steps, training tokens, estimated time)
    /// and the options' warnings, without storing or queueing anything.
    pub dry_run: Option<bool>,
}

/// Longest title, in characters.
pub const MAX_TITLE_CHARS: usize = 1000;

impl PostDocument {
    /// The document and whether this is a dry run.
    pub fn validate(self, defaults: &AbsorbOptions, num_layers: usize, max_window: usize) -> ApiResult<(NewDocument, bool)> {
        let text = self.text.ok_or_else(|| missing("text"))?;
        let options = self.options.unwrap_or_default().apply(defaults, num_layers, max_window)?;
        let source = Source::as_sent(&text, "application/json");
        Ok((document(text, self.title, options, source)?, self.dry_run.unwrap_or(false)))
    }
}

/// A document's text and title checked.
pub fn document(text: String, title: Option<String>, options: AbsorbOptions, source: Source) -> ApiResult<NewDocument> {
    if text.trim().is_empty() {
        return Err(ApiError::unprocessable("empty_document", "the document text is empty").param("text"));
    }
    if let Some(n) = title.as_ref().map(|t| t.chars().count()).filter(|&n| n > MAX_TITLE_CHARS) {
        return Err(ApiError::bad_request(
            "invalid_title",
            format!("'title' has {n} characters; the limit is {MAX_TITLE_CHARS}"),
        )
        .param("title"));
    }
    Ok(NewDocument { text, title, options, source })
}

// ---------- files: raw bodies in a document format, multipart uploads ----------

/// Media types `POST /documents` takes as the document itself (besides JSON and `text/plain`).
pub fn is_document_media_type(media_type: &str) -> bool {
    matches!(
        media_type,
        "text/markdown" | "text/x-markdown" | "text/html" | "application/xhtml+xml" | "application/pdf" | "application/x-pdf"
            | "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
            | "application/vnd.oasis.opendocument.text"
            | "application/epub+zip"
            | "application/octet-stream"
    )
}

/// The text of an uploaded file (`param` names it in errors), made by an extraction worker
/// process under the server's budgets (`crate::extraction`).
pub async fn extract_file(
    extractor: &Extractor,
    bytes: Bytes,
    filename: Option<String>,
    media_type: Option<String>,
    param: Option<&str>,
) -> ApiResult<Extracted> {
    match extractor.extract(bytes, filename, media_type).await {
        Ok(e) => Ok(e),
        Err(Failure::Refused { status, code, message }) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::UNPROCESSABLE_ENTITY);
            let err = ApiError::new(status, code, message);
            Err(match param {
                Some(p) if status != StatusCode::TOO_MANY_REQUESTS => err.param(p),
                _ => err,
            })
        }
        Err(Failure::Internal(detail)) => Err(ApiError::internal(detail)),
    }
}

/// A document from an extracted file: the title given, else the file's own (HTML `<title>`, PDF
/// metadata), else its name.
pub fn file_document(e: Extracted, title: Option<String>, options: AbsorbOptions) -> ApiResult<NewDocument> {
    let title = title.or(e.title).or_else(|| e.source.filename.clone());
    document(e.text, title, options, e.source)
}

/// `options` sent as a JSON text (a multipart field): read like the `options` of a JSON body, so
/// errors name `options.<field>`.
fn options_field(text: &str) -> ApiResult<DocumentOptions> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Wrapped {
        options: DocumentOptions,
    }
    let value = parse_unique(text).map_err(|e| match e {
        Ok(path) => duplicate(&format!("options.{path}")),
        Err(e) => ApiError::bad_request("invalid_json", format!("the 'options' field is not valid JSON: {e}")).param("options"),
    })?;
    if !value.is_object() {
        return Err(ApiError::bad_request("invalid_type", "the 'options' field must be a JSON object").param("options"));
    }
    let wrapped = serde_json::json!({ "options": value });
    serde_path_to_error::deserialize::<_, Wrapped>(wrapped).map(|w| w.options).map_err(|e| field_error(e, Body::Document))
}

/// A `multipart/form-data` upload: one `file` part (its name and type guide the extraction),
/// optional `title`, `options` (JSON) and `dry_run` (`true`/`false`) parts; any other part is
/// refused. Returns the document and whether this is a dry run.
pub async fn multipart_document(
    extractor: &Extractor,
    headers: &HeaderMap,
    bytes: Bytes,
    defaults: &AbsorbOptions,
    num_layers: usize,
    max_window: usize,
) -> ApiResult<(NewDocument, bool)> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let boundary = multer::parse_boundary(content_type)
        .map_err(|e| ApiError::bad_request("invalid_multipart", format!("multipart/form-data needs a boundary: {e}")))?;
    let body = futures_util::stream::once(async move { Ok::<_, std::convert::Infallible>(bytes) });
    let mut form = multer::Multipart::new(body, boundary);
    let malformed = |e: multer::Error| ApiError::bad_request("invalid_multipart", format!("malformed multipart body: {e}"));
    let (mut file, mut title, mut options, mut dry_run) = (None, None, None, None);
    while let Some(field) = form.next_field().await.map_err(malformed)? {
        let name = field.name().unwrap_or("").to_string();
        let seen = match name.as_str() {
            "file" => file.is_some(),
            "title" => title.is_some(),
            "options" => options.is_some(),
            "dry_run" => dry_run.is_some(),
            _ => {
                return Err(ApiError::bad_request(
                    "unknown_field",
                    format!("unknown form field '{name}'; expected 'file', 'title', 'options' or 'dry_run'"),
                )
                .param(&name))
            }
        };
        if seen {
            return Err(ApiError::bad_request("duplicate_field", format!("the form field '{name}' is given twice")).param(&name));
        }
        let filename = field.file_name().map(str::to_string);
        let media_type = field.content_type().map(|m| m.essence_str().to_ascii_lowercase());
        let data = field.bytes().await.map_err(malformed)?;
        match name.as_str() {
            "file" => file = Some((data, filename, media_type)),
            "title" => title = Some(utf8(&data)?.to_string()),
            "dry_run" => dry_run = Some(bool_field("dry_run", utf8(&data)?)?),
            _ => options = Some(options_field(utf8(&data)?)?),
        }
    }
    let (data, filename, media_type) = file.ok_or_else(|| missing("file"))?;
    let options = options.unwrap_or_default().apply(defaults, num_layers, max_window)?;
    // Browsers label files they do not know as octet-stream: the name and the bytes decide then.
    let extracted = extract_file(extractor, data, filename, media_type, Some("file")).await?;
    Ok((file_document(extracted, title.filter(|t| !t.trim().is_empty()), options)?, dry_run.unwrap_or(false)))
}

/// A boolean form field: `true` or `false`.
fn bool_field(name: &str, text: &str) -> ApiResult<bool> {
    match text.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        other => Err(ApiError::bad_request("invalid_type", format!("'{name}' must be true or false (got '{other}')")).param(name)),
    }
}

/// `POST /documents` with `dry_run`: what absorbing would cost; nothing is stored.
#[derive(Debug, Serialize, ToSchema)]
pub struct AbsorbEstimate {
    /// Always "absorb_estimate".
    pub object: &'static str,
    /// The document's tokens.
    pub tokens: usize,
    /// The effective absorb options.
    #[schema(value_type = Object)]
    pub options: serde_json::Value,
    pub estimate: crate::lift::estimate::Estimate,
    pub warnings: Vec<crate::lift::estimate::OptionWarning>,
}

/// `POST /documents`' answer: the Document, with what its absorb is estimated to cost and the
/// options' warnings.
#[derive(Debug, Serialize, ToSchema)]
pub struct PostedDocument {
    #[serde(flatten)]
    pub document: crate::service::DocumentView,
    pub estimate: crate::lift::estimate::Estimate,
    pub warnings: Vec<crate::lift::estimate::OptionWarning>,
}

fn missing(field: &str) -> ApiError {
    ApiError::bad_request("missing_field", format!("'{field}' is required")).param(field)
}

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
    /// base's FltLM filter), `head_tail` (the LIFT paper's truncation; `icl`'s default), `full`
    /// (what fits the model's window).
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
    fn max_tokens(&self, v: Option<u64>, param: &str) -> ApiResult<usize> {
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

    fn question(&self, q: &str, param: &str) -> ApiResult<()> {
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
fn context_tokens(v: Option<u64>, mode: Mode, context: Option<ContextPolicy>) -> ApiResult<Option<usize>> {
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

fn temperature(v: Option<f64>) -> ApiResult<f64> {
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
    /// The passages the answer read, with what the prepared base's filter did to them (only
    /// with `include_context`; modes with context).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<Context>,
    /// Asking a collection: the documents and passages read (`document_id` is then the document
    /// whose passage ranked first).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collection: Option<super::collections::CollectionAnswer>,
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

// ---------- lists ----------

#[derive(Debug, Serialize, ToSchema)]
pub struct List<T: ToSchema> {
    /// Always "list".
    pub object: &'static str,
    pub data: Vec<T>,
}

impl<T: ToSchema> List<T> {
    pub fn new(data: Vec<T>) -> Self {
        Self { object: "list", data }
    }
}

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
        let params = SamplingParams {
            max_tokens,
            temperature: temperature(self.temperature)?,
            top_p: top_p(self.top_p)?,
            seed: self.seed.unwrap_or(0) as u64,
            stop: stop(self.stop)?,
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
        Ok(ValidChat { model, target, params, stream: self.stream.unwrap_or(false), include_usage, include_context })
    }
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
    /// The passages read (with `include_context`), as `/ask`'s `context`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<Context>,
    /// A collection model: the document whose passage ranked first, and what was read (as
    /// `/ask`'s `document_id` and `collection`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub collection: Option<super::collections::CollectionAnswer>,
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

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// "ok"; "degraded" (still 200) while the process's resident memory is above the configured
    /// budget (`--memory-budget-bytes`); with 503 "shutting_down" or (replicas)
    /// "database_unavailable".
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Why the replica is unavailable, or why it is degraded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request bodies' fuzz target (`fuzz/fuzz_targets/request_bodies.rs`) needs the whole
    /// crate built with instrumentation, too long for CI; this runs its reader on 20,000 seeded
    /// mutations of real bodies instead (byte flips, cuts, splices, repeats, deep nesting): every
    /// one ends in a typed request or a 4xx in the API's shape, never a panic.
    #[test]
    fn mutated_request_bodies_end_in_a_request_or_a_4xx() {
        let seeds: Vec<Vec<u8>> = [
            r#"{"text": "The harbor was built in 1843.", "title": "Velmora", "options": {"window": 128, "epochs": [1, 2], "aux_qa": 8}, "dry_run": true}"#,
            r#"{"document_id": "doc_0123456789abcdef0123456789abcdef", "question": "Who built it?", "mode": "rag", "context": "bm25", "context_tokens": 64, "max_tokens": 8, "stream": true, "include_context": true}"#,
            r#"{"document_id": "doc_0123456789abcdef0123456789abcdef", "question": "When did it open?", "history": [{"role": "user", "content": "Tell me about the museum."}, {"role": "assistant", "content": "It shows tools."}]}"#,
            r#"{"model": "doc_0123456789abcdef0123456789abcdef", "messages": [{"role": "user", "content": "Hi"}], "stream": false, "temperature": 0.5, "mode": "lift"}"#,
            r#"{"text": "a", "text": "b"}"#,
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
        let mut rng = crate::testing::Rng::new(7);
        let mut pick = |n: usize| ((rng.next_f32() + 1.0) / 2.0 * n as f32) as usize % n.max(1);
        let headers = HeaderMap::new();
        let mut refused = 0;
        for i in 0..20_000 {
            let mut b = seeds[i % seeds.len()].clone();
            for _ in 0..1 + pick(4) {
                let at = pick(b.len() + 1);
                match pick(6) {
                    0 if !b.is_empty() => {
                        let (i, bit) = (at.min(b.len() - 1), pick(8));
                        b[i] ^= 1 << bit;
                    }
                    1 => b.truncate(at),
                    2 => b.insert(at, [b'{', b'}', b'[', b']', b'"', b':', b',', b'0', b'e', b'-', b'\\', b'u', 0xff, b' ', b'n', b't'][pick(16)]),
                    3 => {
                        let other = &seeds[pick(seeds.len())];
                        let from = pick(other.len());
                        let _ = b.splice(at..at, other[from..].iter().copied().take(pick(40)));
                    }
                    4 => drop(b.splice(at..at, std::iter::repeat_n(b'[', 200 + pick(5000)))),
                    _ if at < b.len() => {
                        let piece = b[at..(at + pick(30)).min(b.len())].to_vec();
                        let _ = b.splice(at..at, piece.repeat(1 + pick(4)));
                    }
                    _ => {}
                }
            }
            let results = [
                json_body::<PostDocument>(&headers, &b, Body::Document).err(),
                json_body::<AskRequest>(&headers, &b, Body::Ask).err(),
                json_body::<ChatRequest>(&headers, &b, Body::Chat).err(),
            ];
            for e in results.into_iter().flatten() {
                assert!(e.status.is_client_error() && !e.code.is_empty(), "{e} for {:?}", String::from_utf8_lossy(&b));
                refused += 1;
            }
            if let Ok(text) = std::str::from_utf8(&b) {
                let _ = parse_unique(text);
            }
        }
        assert!(refused > 20_000, "the mutations were mostly refused ({refused})");
    }

    fn parse<T: DeserializeOwned>(body: serde_json::Value, kind: Body) -> ApiError {
        json_body::<T>(&HeaderMap::new(), body.to_string().as_bytes(), kind).err().expect("refused")
    }

    #[test]
    fn field_errors_name_the_field_by_its_path() {
        let e = parse::<PostDocument>(serde_json::json!({"text": "x", "options": {"colour": "red"}}), Body::Document);
        assert_eq!((e.code, e.param.as_deref()), ("unknown_option", Some("options.colour")), "{e}");
        let e = parse::<PostDocument>(serde_json::json!({"text": "x", "options": {"window": "big"}}), Body::Document);
        assert_eq!((e.code, e.param.as_deref()), ("invalid_option", Some("options.window")), "{e}");
        assert!(e.message.contains("'options.window'") && e.message.contains("invalid type"), "{e}");
        let e = parse::<PostDocument>(serde_json::json!({"text": 5}), Body::Document);
        assert_eq!((e.code, e.param.as_deref()), ("invalid_type", Some("text")), "{e}");
        let e = parse::<AskRequest>(serde_json::json!({"document_id": "d", "question": "q", "colour": 1}), Body::Ask);
        assert_eq!((e.code, e.param.as_deref()), ("unknown_field", Some("colour")), "{e}");
        let e = parse::<AskRequest>(serde_json::json!({"question": "q", "mode": "psychic"}), Body::Ask);
        assert_eq!((e.code, e.param.as_deref()), ("invalid_mode", Some("mode")), "{e}");
        let body = serde_json::json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]});
        let e = parse::<ChatRequest>(body, Body::Chat);
        assert_eq!((e.code, e.param.as_deref()), ("invalid_messages", Some("messages[0].role")), "{e}");
    }

    #[test]
    fn history_is_checked_turn_by_turn() {
        let ask = |history: serde_json::Value| serde_json::json!({"document_id": "d", "question": "When did it open?", "history": history});
        for (history, param) in [
            (serde_json::json!("Tell me about the museum"), "history"),
            (serde_json::json!([{"role": "system", "content": "x"}]), "history[0].role"),
            (serde_json::json!([{"role": "user", "content": 5}]), "history[0].content"),
            (serde_json::json!([{"role": "user", "content": "x", "name": "n"}]), "history[0].name"),
            (serde_json::json!([{"role": "user", "content": "x"}, {"content": "x"}]), "history[1]"),
        ] {
            let e = parse::<AskRequest>(ask(history.clone()), Body::Ask);
            assert_eq!((e.code, e.param.as_deref()), ("invalid_history", Some(param)), "{history}: {e}");
        }
        let limits = GenerationLimits { max_question_chars: 60, max_tokens_limit: 8, default_max_tokens: 8 };
        let valid = |history: serde_json::Value| {
            json_body::<AskRequest>(&HeaderMap::new(), ask(history).to_string().as_bytes(), Body::Ask).unwrap().validate(&limits)
        };
        let turns = serde_json::json!([{"role": "user", "content": "Tell me about the museum."}, {"role": "assistant", "content": "Tools."}]);
        let (q, ..) = valid(turns).unwrap();
        let got: Vec<(&str, &str)> = q.history.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        assert_eq!(got, [("user", "Tell me about the museum."), ("assistant", "Tools.")]);
        // The question (17 characters) and the turns share the question limit (60).
        let e = valid(serde_json::json!([{"role": "user", "content": "x".repeat(44)}])).err().unwrap();
        assert_eq!((e.status.as_u16(), e.code, e.param.as_deref()), (400, "history_too_long", Some("history")), "{e}");
        assert!(valid(serde_json::json!([{"role": "user", "content": "x".repeat(43)}])).is_ok());
        let many: Vec<_> = (0..=MAX_HISTORY_TURNS).map(|_| serde_json::json!({"role": "user", "content": ""})).collect();
        let e = valid(serde_json::json!(many)).err().unwrap();
        assert_eq!((e.code, e.param.as_deref()), ("invalid_history", Some("history")), "{e}");
        // Without a history the question is on its own, as before.
        assert!(valid(serde_json::Value::Null).unwrap().0.history.is_empty());
    }

    #[test]
    fn option_bounds_name_the_limit_and_the_value() {
        let o = DocumentOptions { window: Some(8), ..Default::default() };
        let e = o.apply(&AbsorbOptions::default(), 30, 2048).err().expect("refused");
        assert_eq!((e.code, e.param.as_deref()), ("invalid_option", Some("options.window")));
        assert!(e.message.contains("32") && e.message.contains("2048") && e.message.contains("got 8"), "{e}");
        let o = DocumentOptions { epochs: Some([0, 0]), ..Default::default() };
        let e = o.apply(&AbsorbOptions::default(), 30, 2048).err().expect("refused");
        assert_eq!(e.param.as_deref(), Some("options.epochs"));
        let o = DocumentOptions { aux_qa: Some(5), window: Some(64), stride: Some(64), ..Default::default() };
        let a = o.apply(&AbsorbOptions::default(), 30, 2048).unwrap();
        assert_eq!((a.qa.max_pairs, a.plan.window, a.plan.stride()), (5, 64, 64));
    }
}
