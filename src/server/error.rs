//! Errors in the API's (OpenAI) shape:
//! `{"error": {"message", "type", "code", "param"}}`.

use crate::service::ServiceError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), param: None }
    }
    pub fn param(mut self, p: &str) -> Self {
        self.param = Some(p.to_string());
        self
    }
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
    pub fn unprocessable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
    }
    pub fn too_large(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, code, message)
    }
    /// A server-side failure: `detail` (which may hold file paths or a chain of causes) goes to
    /// the server log only; the client gets a reference to find it there.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        let reference = crate::store::now_nanos_hex();
        tracing::error!(reference, detail = %detail, "internal error");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            format!("internal error (reference {reference} in the server log)"),
        )
    }
    pub fn request_timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::REQUEST_TIMEOUT, "request_timeout", message)
    }
    pub fn queue_full() -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", "the server's queue is full; retry later")
    }
    pub fn shutting_down() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", "the server is shutting down")
    }
    pub fn unknown_document(id: &str) -> Self {
        Self::not_found("document_not_found", format!("no document '{id}'"))
    }

    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 | 403 => "authentication_error",
            404 => "not_found_error",
            409 => "conflict_error",
            429 => "rate_limit_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind(), "code": self.code, "param": self.param}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.code, self.message)
    }
}

/// Which request fields a service error points at (they differ between `/ask` and chat).
#[derive(Clone, Copy)]
pub struct Params {
    /// The field naming the document (`document_id`, `model`).
    pub document: &'static str,
    /// The field holding the prompt's text (`question`, `messages`).
    pub prompt: &'static str,
}

impl ApiError {
    /// The API's answer to a service error: the one mapping from the service's errors to HTTP.
    pub fn service(e: ServiceError, params: Params) -> Self {
        match e {
            ServiceError::UnknownDocument(id) => ApiError::unknown_document(&id).param(params.document),
            ServiceError::UnknownCollection(_) => ApiError::not_found("collection_not_found", e.to_string()).param(params.document),
            ServiceError::CollectionEmpty(_) => ApiError::new(StatusCode::CONFLICT, "collection_empty", e.to_string()).param(params.document),
            ServiceError::CollectionTooLarge { .. } => ApiError::too_large("collection_too_large", e.to_string()).param(params.document),
            ServiceError::NotInCollection { .. } => ApiError::not_found("document_not_found", e.to_string()).param("remove"),
            ServiceError::NotReady { .. } | ServiceError::NoAdapter(_) => {
                ApiError::new(StatusCode::CONFLICT, "document_not_ready", e.to_string()).param(params.document)
            }
            ServiceError::Untokenizable(_) => ApiError::unprocessable("untokenizable_document", e.to_string()).param("text"),
            ServiceError::DocumentTooLarge { .. } => ApiError::too_large("document_too_large", e.to_string()).param("text"),
            ServiceError::TrainingTooLarge { .. } => {
                ApiError::bad_request("training_too_large", e.to_string()).param("options")
            }
            ServiceError::ContextLength { .. } | ServiceError::PromptTooLong { .. } => {
                ApiError::bad_request("context_length_exceeded", e.to_string()).param(params.prompt)
            }
            ServiceError::WrongBase(_) => {
                ApiError::new(StatusCode::CONFLICT, "adapter_base_mismatch", e.to_string()).param(params.document)
            }
            ServiceError::AdapterDamaged(_) => {
                ApiError::new(StatusCode::CONFLICT, "adapter_damaged", e.to_string()).param(params.document)
            }
            ServiceError::QueueFull => ApiError::queue_full(),
            ServiceError::MemoryFull(msg) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, "memory_full", msg),
            ServiceError::ShuttingDown => ApiError::shutting_down(),
            ServiceError::Unavailable(msg) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "database_unavailable", msg),
            ServiceError::NotServing => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "not_serving", e.to_string()),
            ServiceError::Internal(detail) => ApiError::internal(detail),
        }
    }
}

/// Service errors of routes whose document is in the path (no body field to point at).
impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        let mut api = ApiError::service(e, Params { document: "", prompt: "" });
        api.param = api.param.filter(|p| !p.is_empty());
        api
    }
}

/// The error body: `{"error": {"message", "type", "code", "param"}}` (OpenAPI schema).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct ErrorBody {
    error: ErrorDetail,
}

#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct ErrorDetail {
    message: String,
    /// invalid_request_error, authentication_error, not_found_error, conflict_error,
    /// rate_limit_error, server_error.
    r#type: String,
    /// Machine-readable reason, e.g. `context_length_exceeded`.
    code: String,
    /// The request field at fault, when there is one.
    param: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(code = self.code, message = %self.message, "request failed");
        }
        (self.status, Json(self.body())).into_response()
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_errors_send_no_details() {
        let e = ApiError::internal("cannot read /srv/adapters/doc_ab/adapter.safetensors: No such file\n   0: backtrace");
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!e.message.contains("/srv") && !e.message.contains("backtrace"), "{}", e.message);
        assert!(e.message.contains("reference"), "{}", e.message);
        // A client error raised inside model work keeps its status.
        let gone = ServiceError::from(crate::engine::EngineError::UnknownDocument("doc_x".into()));
        assert_eq!(ApiError::from(gone).status, StatusCode::NOT_FOUND);
    }
}
