//! OpenAI-compatible `/v1/models` and `/v1/chat/completions`.

use super::error::{ApiError, ApiResult};
use super::routes::{self, json_object, opt_bool, opt_f64, opt_u64, read_body, submit_generation, PromptSpec};
use super::{signalled, AppState, Tenant};
use crate::model::generate::{FinishReason, SamplingParams};
use crate::model::ChatMessage;
use crate::store::Status;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Map, Value};

pub async fn models(State(st): State<AppState>, Extension(tenant): Extension<Tenant>) -> ApiResult<Json<Value>> {
    let mut data =
        vec![json!({"id": st.base_id, "object": "model", "created": st.started_at, "owned_by": "lift-serve"})];
    let docs = st.docs.read().map_err(|_| ApiError::internal("state lock poisoned"))?;
    let mut ready: Vec<_> =
        docs.values().filter(|d| d.rec.owner == tenant.0 && d.rec.status == Status::Ready).collect();
    ready.sort_by(|a, b| (a.rec.created_at, &a.rec.id).cmp(&(b.rec.created_at, &b.rec.id)));
    for d in ready {
        data.push(json!({"id": d.rec.id, "object": "model", "created": d.rec.ready_at.unwrap_or(d.rec.created_at),
            "owned_by": "lift-serve", "parent": st.base_id, "root": st.base_id, "title": d.rec.title}));
    }
    Ok(Json(json!({"object": "list", "data": data})))
}

fn bad_messages(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request("invalid_messages", msg).param("messages")
}

/// Message content: a string or an array of `{"type": "text", "text": ...}` parts.
fn content_text(v: &Value) -> ApiResult<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    _ => return Err(bad_messages("only text content parts are supported")),
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        _ => Err(bad_messages("message content must be a string or an array of text parts")),
    }
}

fn parse_messages(m: &Map<String, Value>) -> ApiResult<Vec<ChatMessage>> {
    let arr = match m.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::bad_request("missing_field", "'messages' is required").param("messages"))
        }
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad_messages("'messages' must be an array")),
    };
    if arr.is_empty() {
        return Err(bad_messages("'messages' must not be empty"));
    }
    let mut out = Vec::new();
    for msg in arr {
        let role = msg
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad_messages("every message needs a string 'role'"))?;
        let role = match role {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            other => return Err(bad_messages(format!("unknown role '{other}'"))),
        };
        let content = content_text(msg.get("content").unwrap_or(&Value::Null))?;
        out.push(ChatMessage { role: role.to_string(), content });
    }
    Ok(out)
}

fn finish(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

pub async fn chat_completions(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let bytes = read_body(&st, body).await?;
    let m = json_object(&headers, &bytes)?;
    let model = routes::req_str(&m, "model")?;
    let messages = parse_messages(&m)?;
    let total: usize = messages.iter().map(|m| m.content.chars().count()).sum();
    if total > st.cfg.max_question_chars {
        return Err(ApiError::bad_request(
            "messages_too_long",
            format!("the messages have {total} characters; the limit is {}", st.cfg.max_question_chars),
        )
        .param("messages"));
    }
    let mt = match opt_u64(&m, "max_completion_tokens")? {
        Some(n) => routes::max_tokens(&st, Some(n), "max_completion_tokens")?,
        None => routes::max_tokens(&st, opt_u64(&m, "max_tokens")?, "max_tokens")?,
    };
    let temperature = routes::temperature(opt_f64(&m, "temperature")?)?;
    let top_p = match opt_f64(&m, "top_p")? {
        None => 1.0,
        Some(p) if p > 0.0 && p <= 1.0 => p,
        Some(_) => return Err(ApiError::bad_request("invalid_top_p", "'top_p' must be in (0, 1]").param("top_p")),
    };
    let stop = match m.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(Value::is_string) => {
            a.iter().filter_map(|s| s.as_str().map(String::from)).collect()
        }
        Some(_) => {
            return Err(
                ApiError::bad_request("invalid_stop", "'stop' must be a string or up to 4 strings").param("stop")
            )
        }
    };
    let seed = match m.get("seed") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_i64()
            .map(|s| s as u64)
            .ok_or_else(|| ApiError::bad_request("invalid_type", "'seed' must be an integer").param("seed"))?,
    };
    if let Some(n) = opt_u64(&m, "n")? {
        if n != 1 {
            return Err(ApiError::bad_request("unsupported_n", "only n = 1 is supported").param("n"));
        }
    }
    let stream = opt_bool(&m, "stream")?.unwrap_or(false);
    let include_usage =
        m.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);

    let spec = if model == st.base_id {
        let ids = st.engine.model.encode_chat(&messages).map_err(ApiError::internal)?;
        routes::check_fits(&st, ids.len(), mt, "messages")?;
        PromptSpec::Chat(ids)
    } else if routes::is_document(&st, &tenant, &model) {
        routes::require_ready(&st, &tenant, &model, "model")?;
        let question = messages
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(|m| m.content.clone())
            .ok_or_else(|| bad_messages("a document model needs a user message"))?;
        routes::check_question(&st, &question, "messages")?;
        let mode = routes::ask_mode(&m)?;
        routes::check_question_fits(&st, &question, routes::uses_filter(&st, &tenant, &model, mode), mt, "messages")?;
        PromptSpec::Document { id: model.clone(), question, mode }
    } else {
        return Err(
            ApiError::not_found("model_not_found", format!("the model '{model}' does not exist")).param("model")
        );
    };
    let params = SamplingParams { max_tokens: mt, temperature, top_p, seed, stop };
    let id = format!("chatcmpl-{}", crate::store::now_nanos_hex());
    let created = crate::store::now();

    if !stream {
        let r = submit_generation(&st, spec, params, None)?.wait().await?;
        return Ok(Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text}, "logprobs": null,
                         "finish_reason": finish(r.finish_reason)}],
            "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                      "total_tokens": r.prompt_tokens + r.completion_tokens},
        }))
        .into_response());
    }

    let (ptx, mut prx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut pending = submit_generation(&st, spec, params, Some(ptx))?;
    let mut shutdown = st.shutdown.subscribe();
    let chunk = move |delta: Value, finish_reason: Value| {
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}]})
    };
    let events = async_stream::stream! {
        yield Ok::<Event, std::convert::Infallible>(Event::default().data(chunk(json!({"role": "assistant", "content": ""}), Value::Null).to_string()));
        loop {
            tokio::select! {
                piece = prx.recv() => match piece {
                    Some(piece) => yield Ok(Event::default().data(chunk(json!({"content": piece}), Value::Null).to_string())),
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
                yield Ok(Event::default().data(chunk(json!({}), Value::from(finish(r.finish_reason))).to_string()));
                if include_usage {
                    let mut u = chunk(json!({}), Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = json!({"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                                        "total_tokens": r.prompt_tokens + r.completion_tokens});
                    yield Ok(Event::default().data(u.to_string()));
                }
            }
            Err(e) => yield Ok(Event::default().data(e.body().to_string())),
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}
