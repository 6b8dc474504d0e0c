//! Documents, asking, health and metrics: each handler reads its typed request, validates it
//! (`api`), calls the service, and writes the typed response.

use super::api::{self, AbsorbEstimate, PostedDocument, AskRequest, AnsweredBy, AskResponse, AskToken, AskUsage, Body as BodyKind, Context, ContextChunk, Health, List, PostDocument, Timings};
use super::error::{ApiError, ApiResult, Params};
use super::{signalled, AppState, Inner, Tenant};
use crate::lift::answer::Mode;
use crate::service::{DocumentView, Generated, PendingGeneration, Submitted};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use std::time::Duration;

/// The whole body, within the size limit (413) and the body timeout (408); any other failure
/// (a malformed chunked encoding, a client gone mid-body) is the request's fault (400).
pub async fn read_body(st: &Inner, body: Body) -> ApiResult<Bytes> {
    let limit = st.cfg.max_body_bytes;
    let secs = st.cfg.body_timeout_secs;
    match tokio::time::timeout(Duration::from_secs_f64(secs), axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) if caused_by::<http_body_util::LengthLimitError>(&e) => {
            Err(ApiError::too_large("body_too_large", format!("the request body exceeds {limit} bytes")))
        }
        Ok(Err(e)) => Err(ApiError::bad_request("invalid_body", format!("the request body could not be read: {e}"))),
        Err(_) => Err(ApiError::request_timeout(format!("the request body did not arrive within {secs} s"))),
    }
}

/// Whether `e` or one of its sources is an `E`.
fn caused_by<E: std::error::Error + 'static>(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if c.is::<E>() {
            return true;
        }
        cur = c.source();
    }
    false
}

// ---------- documents ----------

#[utoipa::path(post, path = "/documents", tag = "documents",
    request_body(content = PostDocument, description = "JSON, or the text alone as text/plain"),
    responses((status = 202, description = "queued: the Document with its cost estimate and warnings", body = PostedDocument),
              (status = 200, description = "already known (same text, options and base model); with `dry_run`, an AbsorbEstimate", body = PostedDocument),
              (status = "4XX", description = "refused", body = super::error::ErrorBody)))]
pub async fn post_document(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let bytes = read_body(&st, body).await?;
    let cfg = st.service.model().config();
    let (layers, window) = (cfg.num_layers, cfg.max_position_embeddings);
    let defaults = st.default_options.clone();
    // Raw bodies are the document alone: no dry run there, no collection.
    let mut collection = None;
    let (doc, dry_run) = match api::media_type(&headers).as_deref() {
        Some("text/plain") => {
            let text = api::utf8(&bytes)?.to_string();
            let source = crate::formats::Source::as_sent(&text, "text/plain");
            (api::document(text, None, defaults, source)?, false)
        }
        Some("multipart/form-data") => api::multipart_document(&st.extractor, &headers, bytes, &defaults, layers, window).await?,
        Some(m) if api::is_document_media_type(m) => {
            let extracted = api::extract_file(&st.extractor, bytes, None, Some(m.to_string()), None).await?;
            (api::file_document(extracted, None, defaults)?, false)
        }
        _ => {
            let mut post = api::json_body::<PostDocument>(&headers, &bytes, BodyKind::Document)?;
            collection = post.collection.take();
            post.validate(&defaults, layers, window)?
        }
    };
    let params = Params { prompt: "text", document: "text" };
    // The collection is checked before anything is queued (and joined once the document is).
    let joining = Params { prompt: "text", document: "collection" };
    if let Some(col) = &collection {
        st.service.check_joinable(tenant.0.as_deref(), col).await.map_err(|e| ApiError::service(e, joining))?;
    }
    if dry_run {
        let cost = st.service.estimate(doc).await.map_err(|e| ApiError::service(e, params))?;
        let options = serde_json::to_value(&cost.options).map_err(ApiError::internal)?;
        let body = AbsorbEstimate { object: "absorb_estimate", tokens: cost.tokens, options, estimate: cost.estimate, warnings: cost.warnings };
        return Ok(Json(body).into_response());
    }
    let (submitted, cost) = st.service.submit(tenant.0.clone(), doc).await.map_err(|e| ApiError::service(e, params))?;
    let (status, document) = match submitted {
        Submitted::Queued(view) => (StatusCode::ACCEPTED, view),
        Submitted::Existing(view) => (StatusCode::OK, view),
    };
    if let Some(col) = &collection {
        st.service.join_collection(tenant.0.as_deref(), col, &document.id).await.map_err(|e| ApiError::service(e, joining))?;
    }
    Ok((status, Json(PostedDocument { document, estimate: cost.estimate, warnings: cost.warnings })).into_response())
}

#[utoipa::path(get, path = "/documents", tag = "documents",
    responses((status = 200, description = "the caller's documents in posting order", body = List<DocumentView>)))]
pub async fn list_documents(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
) -> ApiResult<Json<List<DocumentView>>> {
    Ok(Json(List::new(st.service.documents(tenant.0.as_deref()).await.map_err(ApiError::from)?)))
}

#[utoipa::path(get, path = "/documents/{id}", tag = "documents", params(("id" = String, Path)),
    responses((status = 200, description = "the Document", body = DocumentView), (status = 404, description = "unknown (or another tenant's)", body = super::error::ErrorBody)))]
pub async fn get_document(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    api::PathParam(id): api::PathParam,
) -> ApiResult<Json<DocumentView>> {
    Ok(Json(st.service.document(tenant.0.as_deref(), &id).await?))
}

#[utoipa::path(get, path = "/documents/{id}/text", tag = "documents", params(("id" = String, Path)),
    responses((status = 200, description = "the document's text as it was absorbed (the extracted text of a file); \
        a passage's `text` is found in it", body = String, content_type = "text/plain"),
        (status = 404, description = "unknown (or another tenant's)", body = super::error::ErrorBody)))]
pub async fn get_document_text(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    api::PathParam(id): api::PathParam,
) -> ApiResult<Response> {
    let text = st.service.document_text(tenant.0.as_deref(), &id).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

#[utoipa::path(delete, path = "/documents/{id}", tag = "documents", params(("id" = String, Path)),
    responses((status = 204, description = "deleted (a running job is stopped)"), (status = 404, description = "unknown (or another tenant's)", body = super::error::ErrorBody)))]
pub async fn delete_document(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    api::PathParam(id): api::PathParam,
) -> ApiResult<StatusCode> {
    st.service.delete(tenant.0.as_deref(), &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/documents/{id}/events", tag = "documents", params(("id" = String, Path)),
    responses((status = 200, description = "text/event-stream: `progress` events (Document objects), then `done`; \
        `error` when the server shuts down", body = DocumentView, content_type = "text/event-stream")))]
pub async fn document_events(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    api::PathParam(id): api::PathParam,
) -> ApiResult<Response> {
    let mut rx = st.service.watch(tenant.0.as_deref(), &id).await?;
    let mut shutdown = st.shutdown.subscribe();
    let stream = async_stream::stream! {
        loop {
            let view = rx.borrow_and_update().clone();
            let data = to_json(&view);
            yield Ok::<Event, std::convert::Infallible>(Event::default().event("progress").data(&data));
            if view.status.is_terminal() {
                yield Ok(Event::default().event("done").data(data));
                break;
            }
            let changed = tokio::select! {
                r = rx.changed() => r.is_ok(),
                _ = signalled(&mut shutdown) => {
                    // The server stops: a last word so that the client knows to reconnect later.
                    yield Ok(Event::default().event("error").data(ApiError::shutting_down().body().to_string()));
                    break;
                }
            };
            if !changed {
                // The document was deleted.
                let mut v = serde_json::to_value(&view).unwrap_or_default();
                v["status"] = "cancelled".into();
                yield Ok(Event::default().event("done").data(v.to_string()));
                break;
            }
        }
    };
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}

// ---------- asking ----------

#[utoipa::path(post, path = "/ask", tag = "asking", request_body = AskRequest,
    responses((status = 200, description = "the answer; with `stream` a text/event-stream of `token` events \
        (AskToken) and one `answer` (AskResponse) or `error` event", body = AskResponse), (status = "4XX", description = "refused (see the error codes)", body = super::error::ErrorBody)))]
pub async fn ask(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let bytes = read_body(&st, body).await?;
    let request = api::json_body::<AskRequest>(&headers, &bytes, BodyKind::Ask)?;
    if request.collection_id.is_some() {
        return super::collections::ask(&st, tenant.0.as_deref(), request).await;
    }
    let (question, params, stream, with_context) = request.validate(&st.limits)?;
    let (id, mode) = (question.document_id.clone(), question.mode);
    let (ptx, prx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let pending = st.service.ask(tenant.0.as_deref(), question, params, stream.then_some(ptx)).await.map_err(ask_error)?;
    let notice = pending.notice.clone();
    let respond = move |r| AskResponse { notice, ..ask_response(r, id, mode, with_context) };
    if stream {
        return Ok(ask_stream(&st, pending, prx, Box::new(respond)));
    }
    let mut pending = pending;
    let r = pending.wait().await.map_err(ask_error)?;
    Ok(Json(respond(r)).into_response())
}

pub(super) fn to_json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

pub(super) fn ask_error(e: crate::service::ServiceError) -> ApiError {
    ApiError::service(e, Params { document: "document_id", prompt: "question" })
}

/// The passages an answer read (None when it read none).
pub(super) fn context_of(r: &Generated) -> Option<Context> {
    let chunks: Vec<ContextChunk> = r
        .chunks
        .iter()
        .map(|(c, text)| ContextChunk { start: c.start, end: c.end, score: c.score, mask: c.mask, text: text.clone(), document_id: None })
        .collect();
    (!chunks.is_empty()).then_some(Context { chunks })
}

/// The answer; its context only when asked for (the passages can be the whole document).
pub(super) fn ask_response(r: Generated, document_id: String, mode: Mode, with_context: bool) -> AskResponse {
    let context = if with_context { context_of(&r) } else { None };
    AskResponse {
        answer: r.text,
        document_id,
        mode: r.mode.unwrap_or(mode),
        adapter: r.adapter.map(|(step, planned_steps)| AnsweredBy { step, planned_steps, document_id: None }),
        answered_by: r.answered_by,
        usage: AskUsage { prompt_tokens: r.prompt_tokens, completion_tokens: r.completion_tokens },
        finish_reason: r.finish_reason,
        timings: Timings { queue_ms: r.queue_ms, prompt_ms: r.prompt_ms, generate_ms: r.generate_ms },
        context,
        collection: None,
        notice: None,
    }
}

/// A streamed answer: `token` events (`{"text": …}`) as pieces are generated, then `answer` (the
/// whole AskResponse) or `error` (the error object). A client that goes away cancels the
/// generation (dropping `pending`); on shutdown the stream ends with `error` `shutting_down`.
pub(super) fn ask_stream(
    st: &AppState,
    mut pending: PendingGeneration,
    mut pieces: tokio::sync::mpsc::UnboundedReceiver<String>,
    respond: Box<dyn FnOnce(Generated) -> AskResponse + Send>,
) -> Response {
    let mut shutdown = st.shutdown.subscribe();
    let events = async_stream::stream! {
        loop {
            tokio::select! {
                piece = pieces.recv() => match piece {
                    Some(text) => yield Ok::<Event, std::convert::Infallible>(Event::default().event("token").data(to_json(&AskToken { text }))),
                    None => break,
                },
                _ = signalled(&mut shutdown) => {
                    yield Ok(Event::default().event("error").data(ApiError::shutting_down().body().to_string()));
                    return;
                }
            }
        }
        match pending.wait().await {
            Ok(r) => yield Ok(Event::default().event("answer").data(to_json(&respond(r)))),
            Err(e) => yield Ok(Event::default().event("error").data(ask_error(e).body().to_string())),
        }
    };
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

// ---------- operations ----------

#[utoipa::path(get, path = "/health", tag = "operations",
    responses((status = 200, description = "the model is loaded", body = Health), (status = 503, description = "shutting down", body = Health)))]
pub async fn health(State(st): State<AppState>) -> Response {
    use crate::service::Health as H;
    let unavailable = |status, error| (StatusCode::SERVICE_UNAVAILABLE, Json(Health { status, model: None, error })).into_response();
    match st.service.health().await {
        H::Ok => {
            let model = Some(st.base_id.clone());
            let rss = crate::runtime::resident_bytes();
            match (st.cfg.memory_budget_bytes, rss) {
                (Some(budget), Some(rss)) if rss > budget => {
                    let error = Some(format!("resident memory {rss} bytes is above the budget of {budget} bytes"));
                    Json(Health { status: "degraded", model, error }).into_response()
                }
                _ => Json(Health { status: "ok", model, error: None }).into_response(),
            }
        }
        H::ShuttingDown => unavailable("shutting_down", None),
        H::DatabaseUnavailable(why) => unavailable("database_unavailable", Some(why)),
    }
}

#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus (OpenMetrics) text", content_type = "application/openmetrics-text")))]
pub async fn metrics(State(st): State<AppState>) -> Response {
    let s = st.service.stats().await;
    let docs = |status| s.documents.get(&status).copied().unwrap_or(0);
    use crate::store::Status;
    let snapshot = crate::metrics::Snapshot {
        training_waiting: s.train_queue.0,
        training_running: s.train_queue.1,
        generation_waiting: s.generate_queue.0,
        generation_running: s.generate_queue.1,
        cache_hits: s.cache_hits,
        cache_misses: s.cache_misses,
        cache_evictions: s.cache_evictions,
        cache_resident_bytes: s.cache_resident_bytes,
        documents_queued: docs(Status::Queued),
        documents_training: docs(Status::Training),
        documents_ready: docs(Status::Ready),
        documents_failed: docs(Status::Failed),
        resident_memory_bytes: crate::runtime::resident_bytes().unwrap_or(0),
        blob_puts: s.blob_puts,
        blob_fetches: s.blob_fetches,
        kv_tokens_held: s.kv_tokens.0,
        kv_tokens_budget: s.kv_tokens.1,
    };
    ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], st.metrics.render(&snapshot)).into_response()
}
