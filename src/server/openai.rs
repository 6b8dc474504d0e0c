//! OpenAI-compatible `/v1/models` and `/v1/chat/completions`.

use super::api::{
    self, finish_reason, AnsweredBy, Body as BodyKind, ChatChoice, ChatLift, ChatChunk, ChatCompletion, ChatMessageOut, ChatRequest,
    ChatTarget, ChatUsage, ChunkChoice, Delta, List, ModelCard, ValidChat,
};
use super::error::{ApiError, ApiResult, Params};
use super::routes::read_body;
use super::{collections, signalled, AppState, Tenant};
use crate::service::collections::valid_collection_id;
use crate::service::{CollectionRead, Generated, PendingGeneration, Pieces};
use crate::model::tokenizer::TextTokenizer;
use crate::store::Status;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, description = "the base model, then the caller's ready documents and collections", body = List<ModelCard>)))]
pub async fn models(State(st): State<AppState>, Extension(tenant): Extension<Tenant>) -> ApiResult<Json<List<ModelCard>>> {
    let base = ModelCard {
        id: st.base_id.clone(),
        object: "model",
        created: st.started_at,
        owned_by: "lift-serve",
        parent: None,
        root: None,
        title: None,
    };
    let mut ready: Vec<_> =
        st.service.documents(tenant.0.as_deref()).await?.into_iter().filter(|d| d.status == Status::Ready).collect();
    ready.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    // A document or collection, over the base.
    let card = |id: String, created: u64, title: Option<String>| ModelCard {
        id,
        object: "model",
        created,
        owned_by: "lift-serve",
        parent: Some(st.base_id.clone()),
        root: Some(st.base_id.clone()),
        title: Some(title),
    };
    let documents = ready.into_iter().map(|d| card(d.id, d.ready_at.unwrap_or(d.created_at), d.title));
    // Collections answer as models too (routing to their documents' adapters).
    let collections = st.service.collections(tenant.0.as_deref()).await?;
    let collections = collections.into_iter().map(|c| card(c.id, c.created_at, c.title));
    Ok(Json(List::new(std::iter::once(base).chain(documents).chain(collections).collect())))
}

#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", request_body = ChatRequest,
    responses((status = 200, description = "a completion, or with `stream` a text/event-stream of chunks ending in \
        `data: [DONE]`", body = ChatCompletion), (status = "4XX", description = "refused (see the error codes)", body = super::error::ErrorBody)))]
pub async fn chat_completions(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let bytes = read_body(&st, body).await?;
    let request: ChatRequest = api::json_body(&headers, &bytes, BodyKind::Chat)?;
    let owner = tenant.0.as_deref();
    // Whether `model` names one of the caller's documents (a database that is away is a 503,
    // not an unknown model).
    let is_document = match request.model.as_deref() {
        Some(m) if valid_collection_id(m) => match st.service.collection(owner, m).await {
            Ok(_) => true,
            Err(crate::service::ServiceError::UnknownCollection(_)) => false,
            Err(e) => return Err(ApiError::service(e, Params { document: "model", prompt: "messages" })),
        },
        Some(m) if m != st.base_id => match st.service.document(owner, m).await {
            Ok(_) => true,
            Err(crate::service::ServiceError::UnknownDocument(_)) => false,
            Err(e) => return Err(ApiError::service(e, Params { document: "model", prompt: "messages" })),
        },
        _ => false,
    };
    let chat = request.validate(&st.limits, &st.base_id, |_| is_document)?;
    let (ptx, prx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let (pending, read) = submit(&st, owner, &chat, chat.stream.then_some(ptx)).await?;
    let completion = Completion { id: format!("chatcmpl-{}", crate::store::now_nanos_hex()), created: crate::store::now(), model: chat.model.clone() };
    if chat.stream {
        Ok(stream(&st, completion, pending, prx, &chat))
    } else {
        let r = wait(pending).await?;
        Ok(Json(completion.whole(&r, &chat, read, &st.service.model().tokenizer)).into_response())
    }
}

/// The queued completion, and what it read when `model` is a collection.
async fn submit(
    st: &AppState,
    owner: Option<&str>,
    chat: &ValidChat,
    pieces: Option<Pieces>,
) -> ApiResult<(PendingGeneration, Option<CollectionRead>)> {
    let names = Params { document: "model", prompt: "messages" };
    let params = chat.params.clone();
    if let ChatTarget::Document(q) = &chat.target {
        if valid_collection_id(&q.document_id) {
            let (pending, read) = super::collections::chat(st, owner, q.clone(), params, pieces).await?;
            return Ok((pending, Some(read)));
        }
    }
    let pending = match &chat.target {
        ChatTarget::Base(messages) => st.service.chat(messages, params, pieces),
        ChatTarget::Document(q) => st.service.ask(owner, q.clone(), params, pieces).await,
    };
    Ok((pending.map_err(|e| ApiError::service(e, names))?, None))
}

async fn wait(mut pending: PendingGeneration) -> ApiResult<Generated> {
    pending.wait().await.map_err(|e| ApiError::service(e, Params { document: "model", prompt: "messages" }))
}

/// The parts every response of one completion shares.
struct Completion {
    id: String,
    created: u64,
    model: String,
}

impl Completion {
    fn whole(self, r: &Generated, chat: &ValidChat, read: Option<CollectionRead>, tokenizer: &TextTokenizer) -> ChatCompletion {
        let with_context = chat.include_context;
        ChatCompletion {
            id: self.id,
            object: "chat.completion",
            created: self.created,
            model: self.model,
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessageOut { role: "assistant", content: r.text.clone() },
                logprobs: chat.logprobs.then(|| api::logprobs_of(&r.tokens, tokenizer)),
                finish_reason: finish_reason(r.finish_reason),
            }],
            usage: ChatUsage::new(r.prompt_tokens, r.completion_tokens),
            lift: r.mode.map(|mode| match &read {
                Some(read) => ChatLift {
                    mode,
                    adapter: collections::answered_by(r, read),
                    answered_by: r.answered_by,
                    context: if with_context { collections::context(read) } else { None },
                    document_id: Some(read.document_id.clone()),
                    collection: Some(collections::answer(read)),
                },
                None => ChatLift {
                    mode,
                    adapter: r.adapter.map(|(step, planned_steps)| AnsweredBy { step, planned_steps, document_id: None }),
                    answered_by: r.answered_by,
                    context: if with_context { super::routes::context_of(r) } else { None },
                    document_id: None,
                    collection: None,
                },
            }),
        }
    }

    fn chunk(&self, delta: Delta, finish_reason: Option<&'static str>) -> ChatChunk {
        ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.model.clone(),
            choices: vec![ChunkChoice { index: 0, delta, logprobs: None, finish_reason }],
            usage: None,
        }
    }

    fn usage(&self, r: &Generated) -> ChatChunk {
        let mut u = self.chunk(Delta::default(), None);
        u.choices.clear();
        u.usage = Some(ChatUsage::new(r.prompt_tokens, r.completion_tokens));
        u
    }
}

fn data(chunk: &ChatChunk) -> Event {
    Event::default().data(serde_json::to_string(chunk).unwrap_or_default())
}

/// The completion as server-sent events: a role chunk, one chunk per text piece, the finish
/// chunk, usage if asked for, `[DONE]`. On shutdown the stream ends with an error chunk.
fn stream(
    st: &AppState,
    c: Completion,
    mut pending: PendingGeneration,
    mut pieces: tokio::sync::mpsc::UnboundedReceiver<String>,
    chat: &ValidChat,
) -> Response {
    let (include_usage, logprobs) = (chat.include_usage, chat.logprobs);
    let mut shutdown = st.shutdown.subscribe();
    let state = st.clone();
    let events = async_stream::stream! {
        yield Ok::<Event, std::convert::Infallible>(data(&c.chunk(Delta { role: Some("assistant"), content: Some(String::new()) }, None)));
        loop {
            tokio::select! {
                piece = pieces.recv() => match piece {
                    Some(piece) => yield Ok(data(&c.chunk(Delta { role: None, content: Some(piece) }, None))),
                    None => break,
                },
                _ = signalled(&mut shutdown) => {
                    // The server stops: end the stream (dropping `pending` stops the generation).
                    yield Ok(Event::default().data(ApiError::shutting_down().body().to_string()));
                    yield Ok(Event::default().data("[DONE]"));
                    return;
                }
            }
        }
        match pending.wait().await {
            Ok(r) => {
                // The tokens' log-probabilities come whole with the finishing chunk (the text
                // pieces are cut where characters and stop strings end, not at tokens).
                let mut last = c.chunk(Delta::default(), Some(finish_reason(r.finish_reason)));
                last.choices[0].logprobs = logprobs.then(|| api::logprobs_of(&r.tokens, &state.service.model().tokenizer));
                yield Ok(data(&last));
                if include_usage {
                    yield Ok(data(&c.usage(&r)));
                }
            }
            Err(e) => yield Ok(Event::default().data(ApiError::service(e, Params { document: "model", prompt: "messages" }).body().to_string())),
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}
