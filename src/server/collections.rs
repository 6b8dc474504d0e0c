//! `/collections` (create, list, read, change, delete) and asking a collection (`/ask` with
//! `collection_id`, chat completions whose `model` is a collection id): request bodies checked
//! here, the work in `crate::service::collections` and `collection_ask`.

use super::api::{self, AnsweredBy, AskRequest, AskResponse, AskUsage, Body as BodyKind, Context, ContextChunk, List, Timings};
use super::error::{ApiError, ApiResult, Params};
use super::routes::{ask_error, ask_stream, read_body};
use super::{AppState, Inner, Tenant};
use crate::lift::answer::{ContextPolicy, Mode};
use crate::service::{CollectionChange, CollectionRead, CollectionView, Generated, PendingGeneration, Pieces, Question};
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /collections`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PostCollection {
    pub title: Option<String>,
    /// The caller's documents (`doc_…`), in order; may be empty.
    pub document_ids: Option<Vec<String>>,
}

/// `PATCH /collections/{id}`: a new title, documents to add and to remove (removed first).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PatchCollection {
    pub title: Option<String>,
    pub add: Option<Vec<String>>,
    pub remove: Option<Vec<String>>,
}

/// What a collection's answer read (`AskResponse.collection`, the chat extension's).
#[derive(Debug, Serialize, ToSchema)]
pub struct CollectionAnswer {
    pub id: String,
    /// The documents read, in the order of their best passage.
    pub documents: Vec<ReadDocument>,
    /// The passages read, best first.
    pub passages: Vec<ReadPassageOut>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReadDocument {
    pub id: String,
    pub title: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReadPassageOut {
    pub document_id: String,
    /// Token range in its document.
    pub start: usize,
    pub end: usize,
    /// BM25 score in the collection's ranking.
    pub score: f32,
}

fn title(t: Option<String>) -> ApiResult<Option<String>> {
    match t.as_ref().map(|t| t.chars().count()) {
        Some(n) if n > api::MAX_TITLE_CHARS => Err(ApiError::bad_request(
            "invalid_title",
            format!("'title' has {n} characters; the limit is {}", api::MAX_TITLE_CHARS),
        )
        .param("title")),
        _ => Ok(t),
    }
}

/// A list of ids over the server's limit is refused before anything is looked up.
fn ids(v: Option<Vec<String>>, st: &Inner, param: &str) -> ApiResult<Vec<String>> {
    let v = v.unwrap_or_default();
    let limit = st.cfg.max_collection_documents;
    if v.len() > limit {
        let message = format!("'{param}' names {} documents; a collection holds at most {limit}", v.len());
        return Err(ApiError::too_large("collection_too_large", message).param(param));
    }
    Ok(v)
}

#[utoipa::path(post, path = "/collections", tag = "collections", request_body = PostCollection,
    responses((status = 201, description = "the Collection", body = CollectionView),
              (status = "4XX", description = "refused: an unknown document (404), too many (413)", body = super::error::ErrorBody)))]
pub async fn post_collection(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<(StatusCode, Json<CollectionView>)> {
    let bytes = read_body(&st, body).await?;
    let post: PostCollection = api::json_body(&headers, &bytes, BodyKind::Document)?;
    let (title, document_ids) = (title(post.title)?, ids(post.document_ids, &st, "document_ids")?);
    let names = Params { document: "document_ids", prompt: "" };
    let view = st.service.create_collection(tenant.0, title, document_ids).await.map_err(|e| ApiError::service(e, names))?;
    Ok((StatusCode::CREATED, Json(view)))
}

#[utoipa::path(get, path = "/collections", tag = "collections",
    responses((status = 200, description = "the caller's collections in the order they were made", body = List<CollectionView>)))]
pub async fn list_collections(State(st): State<AppState>, Extension(tenant): Extension<Tenant>) -> ApiResult<Json<List<CollectionView>>> {
    Ok(Json(List::new(st.service.collections(tenant.0.as_deref()).await?)))
}

#[utoipa::path(get, path = "/collections/{id}", tag = "collections", params(("id" = String, Path)),
    responses((status = 200, description = "the Collection", body = CollectionView),
              (status = 404, description = "unknown (or another tenant's)", body = super::error::ErrorBody)))]
pub async fn get_collection(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    api::PathParam(id): api::PathParam,
) -> ApiResult<Json<CollectionView>> {
    Ok(Json(st.service.collection(tenant.0.as_deref(), &id).await?))
}

#[utoipa::path(patch, path = "/collections/{id}", tag = "collections", params(("id" = String, Path)), request_body = PatchCollection,
    responses((status = 200, description = "the changed Collection", body = CollectionView),
              (status = "4XX", description = "refused, nothing changed: an unknown collection or document (404), too many (413)", body = super::error::ErrorBody)))]
pub async fn patch_collection(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    api::PathParam(id): api::PathParam,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<CollectionView>> {
    let bytes = read_body(&st, body).await?;
    let patch: PatchCollection = api::json_body(&headers, &bytes, BodyKind::Document)?;
    let change = CollectionChange { title: title(patch.title)?, add: ids(patch.add, &st, "add")?, remove: patch.remove.unwrap_or_default() };
    let names = Params { document: "add", prompt: "" };
    let view = st.service.change_collection(tenant.0.as_deref(), &id, change).await.map_err(|e| ApiError::service(e, names))?;
    Ok(Json(view))
}

#[utoipa::path(delete, path = "/collections/{id}", tag = "collections", params(("id" = String, Path)),
    responses((status = 204, description = "deleted (its documents stay)"), (status = 404, description = "unknown (or another tenant's)", body = super::error::ErrorBody)))]
pub async fn delete_collection(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    api::PathParam(id): api::PathParam,
) -> ApiResult<StatusCode> {
    st.service.delete_collection(tenant.0.as_deref(), &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---------- asking ----------

/// A collection answers in `lift` and `rag`, from BM25's passages: anything else is refused.
pub fn check_mode(q: &Question) -> ApiResult<()> {
    if !matches!(q.mode, Mode::Lift | Mode::Rag) {
        let message = format!("a collection answers in modes lift and rag (got {})", q.mode.name());
        return Err(ApiError::bad_request("unsupported_mode", message).param("mode"));
    }
    match q.context {
        Some(c) if c != ContextPolicy::Bm25 => {
            let message = format!("a collection's context is bm25, its passages ranked across its documents (got {})", c.name());
            Err(ApiError::bad_request("unsupported_context", message).param("context"))
        }
        _ => Ok(()),
    }
}

/// `/ask` with `collection_id`.
pub async fn ask(st: &AppState, owner: Option<&str>, mut request: AskRequest) -> ApiResult<Response> {
    if request.document_id.is_some() {
        let message = "give 'document_id' or 'collection_id', not both";
        return Err(ApiError::bad_request("conflicting_fields", message).param("collection_id"));
    }
    request.document_id = request.collection_id.take();
    let (question, params, stream, with_context) = request.validate(&st.limits)?;
    check_mode(&question)?;
    let (ptx, prx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let names = Params { document: "collection_id", prompt: "question" };
    let (pending, read) =
        st.service.ask_collection(owner, question, params, stream.then_some(ptx)).await.map_err(|e| ApiError::service(e, names))?;
    if stream {
        return Ok(ask_stream(st, pending, prx, Box::new(move |r| response(r, read, with_context))));
    }
    let mut pending = pending;
    let r = pending.wait().await.map_err(ask_error)?;
    Ok(Json(response(r, read, with_context)).into_response())
}

/// A chat completion whose `model` is a collection.
pub async fn chat(st: &AppState, owner: Option<&str>, q: Question, params: crate::model::generate::SamplingParams, pieces: Option<Pieces>) -> ApiResult<(PendingGeneration, CollectionRead)> {
    check_mode(&q)?;
    st.service.ask_collection(owner, q, params, pieces).await.map_err(|e| ApiError::service(e, Params { document: "model", prompt: "messages" }))
}

/// The adapter that answered, naming its document.
pub fn answered_by(r: &Generated, read: &CollectionRead) -> Option<AnsweredBy> {
    r.adapter.map(|(step, planned_steps)| AnsweredBy { step, planned_steps, document_id: read.answered_by.clone() })
}

/// The passages read, with their texts (`include_context`).
pub fn context(read: &CollectionRead) -> Option<Context> {
    let chunks: Vec<ContextChunk> = read
        .passages
        .iter()
        .map(|p| ContextChunk { start: p.start, end: p.end, score: p.score, mask: 0.0, text: p.text.clone(), document_id: Some(p.document_id.clone()) })
        .collect();
    (!chunks.is_empty()).then_some(Context { chunks })
}

/// What was read, always reported.
pub fn answer(read: &CollectionRead) -> CollectionAnswer {
    let mut documents: Vec<ReadDocument> = Vec::new();
    for p in &read.passages {
        if !documents.iter().any(|d| d.id == p.document_id) {
            documents.push(ReadDocument { id: p.document_id.clone(), title: p.title.clone() });
        }
    }
    let passages = read
        .passages
        .iter()
        .map(|p| ReadPassageOut { document_id: p.document_id.clone(), start: p.start, end: p.end, score: p.score })
        .collect();
    CollectionAnswer { id: read.collection_id.clone(), documents, passages }
}

fn response(r: Generated, read: CollectionRead, with_context: bool) -> AskResponse {
    AskResponse {
        adapter: answered_by(&r, &read),
        answered_by: r.answered_by,
        context: if with_context { context(&read) } else { None },
        collection: Some(answer(&read)),
        answer: r.text,
        document_id: read.document_id,
        mode: read.mode,
        usage: AskUsage { prompt_tokens: r.prompt_tokens, completion_tokens: r.completion_tokens },
        finish_reason: r.finish_reason,
        timings: Timings { queue_ms: r.queue_ms, prompt_ms: r.prompt_ms, generate_ms: r.generate_ms },
        notice: None,
    }
}
