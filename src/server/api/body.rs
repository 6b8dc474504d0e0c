//! Reading a request: JSON bodies (typed, unknown fields refused, a key given twice refused, every
//! error naming the field by its path), path parameters, and files — raw bodies in a document
//! format and `multipart/form-data` uploads — made into documents.

use super::{document, DocumentOptions};
use crate::server::error::{ApiError, ApiResult};
use crate::extraction::{Extractor, Failure};
use crate::formats::Extracted;
use crate::lift::AbsorbOptions;
use crate::service::NewDocument;
use axum::body::Bytes;
use axum::http::{header, HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use serde::Deserialize;

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

pub(super) fn missing(field: &str) -> ApiError {
    ApiError::bad_request("missing_field", format!("'{field}' is required")).param(field)
}
