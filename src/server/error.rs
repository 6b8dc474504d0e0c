//! Errors in the API's (OpenAI) shape:
//! `{"error": {"message", "type", "code", "param"}}`.

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
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
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

impl From<crate::engine::SubmitError> for ApiError {
    fn from(e: crate::engine::SubmitError) -> Self {
        match e {
            crate::engine::SubmitError::Full => ApiError::queue_full(),
            crate::engine::SubmitError::Closed => ApiError::shutting_down(),
        }
    }
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
