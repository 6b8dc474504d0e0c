//! Documents, asking, health and metrics; request parsing and validation shared by all routes.

use super::error::{ApiError, ApiResult};
use super::{signalled, AppState, DocEntry, Inner, Tenant};
use crate::adapters::AdapterKind;
use crate::lift::answer::Mode;
use crate::lift::{AbsorbEvent, AbsorbOptions};
use crate::model::generate::{FinishReason, SamplingParams};
use crate::model::{Adapter, KvCache, Model, NoHooks};
use crate::store::{self, AdapterInfo, JobRecord, Status};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{Map, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---------- request parsing ----------

/// The request's media type (lower case, without parameters); None when absent.
pub fn media_type(headers: &HeaderMap) -> Option<String> {
    headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("invalid").split(';').next().unwrap_or("").trim().to_ascii_lowercase())
}

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

pub fn utf8(bytes: &[u8]) -> ApiResult<&str> {
    std::str::from_utf8(bytes)
        .map_err(|e| ApiError::bad_request("invalid_utf8", format!("the body is not valid UTF-8: {e}")))
}

/// A JSON object body (`application/json`; a missing content type is taken as JSON).
pub fn json_object(headers: &HeaderMap, bytes: &[u8]) -> ApiResult<Map<String, Value>> {
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
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request("invalid_json", "the body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request("invalid_json", format!("malformed JSON: {e}"))),
    }
}

fn type_error(field: &str, want: &str) -> ApiError {
    ApiError::bad_request("invalid_type", format!("'{field}' must be {want}")).param(field)
}

/// An optional field; `null` counts as absent.
fn field<'a>(m: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    m.get(name).filter(|v| !v.is_null())
}

pub fn opt_str(m: &Map<String, Value>, name: &str) -> ApiResult<Option<String>> {
    match field(m, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(type_error(name, "a string")),
    }
}

pub fn req_str(m: &Map<String, Value>, name: &str) -> ApiResult<String> {
    opt_str(m, name)?.ok_or_else(|| ApiError::bad_request("missing_field", format!("'{name}' is required")).param(name))
}

pub fn opt_u64(m: &Map<String, Value>, name: &str) -> ApiResult<Option<u64>> {
    match field(m, name) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| type_error(name, "a non-negative integer")),
    }
}

pub fn opt_f64(m: &Map<String, Value>, name: &str) -> ApiResult<Option<f64>> {
    match field(m, name) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| type_error(name, "a number")),
    }
}

pub fn opt_bool(m: &Map<String, Value>, name: &str) -> ApiResult<Option<bool>> {
    match field(m, name) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| type_error(name, "a boolean")),
    }
}

/// `max_tokens` within 1..=limit (default from config).
pub fn max_tokens(st: &Inner, v: Option<u64>, param: &str) -> ApiResult<usize> {
    match v {
        None => Ok(st.cfg.default_max_tokens.min(st.cfg.max_tokens_limit)),
        Some(n) if n >= 1 && n <= st.cfg.max_tokens_limit as u64 => Ok(n as usize),
        Some(n) => Err(ApiError::bad_request(
            "invalid_max_tokens",
            format!("'{param}' must be between 1 and {} (got {n})", st.cfg.max_tokens_limit),
        )
        .param(param)),
    }
}

pub fn temperature(v: Option<f64>) -> ApiResult<f64> {
    match v {
        None => Ok(0.0),
        Some(t) if (0.0..=2.0).contains(&t) => Ok(t),
        Some(t) => {
            Err(ApiError::bad_request("invalid_temperature", format!("'temperature' must be in [0, 2] (got {t})"))
                .param("temperature"))
        }
    }
}

pub fn check_question(st: &Inner, q: &str, param: &str) -> ApiResult<()> {
    if q.trim().is_empty() {
        return Err(ApiError::unprocessable("empty_question", "the question is empty").param(param));
    }
    let n = q.chars().count();
    if n > st.cfg.max_question_chars {
        return Err(ApiError::bad_request(
            "question_too_long",
            format!("the question has {n} characters; the limit is {}", st.cfg.max_question_chars),
        )
        .param(param));
    }
    Ok(())
}

/// Refuses, before any model work, a question that cannot fit the model's window with
/// `max_tokens` of answer: counted in tokens of the base model, as the prompt will be. A
/// document's prompt holds the question and the template's own tokens (twice the question when
/// the document's FltLM filter lays out the context), then as much document as fits.
pub fn check_question_fits(
    st: &Inner,
    question: &str,
    filtered: bool,
    max_tokens: usize,
    param: &str,
) -> ApiResult<()> {
    let model = &st.engine.model;
    let q = model.tokenizer.encode(question, false).map_err(ApiError::internal)?.len();
    let needed = crate::lift::answer::min_prompt_tokens(q, filtered);
    check_fits(st, needed, max_tokens, param)
}

/// 400 `context_length_exceeded` unless `prompt_tokens + max_tokens` fit the model's window.
pub fn check_fits(st: &Inner, prompt_tokens: usize, max_tokens: usize, param: &str) -> ApiResult<()> {
    let window = st.engine.model.config().max_position_embeddings;
    if prompt_tokens + max_tokens > window {
        return Err(ApiError::context_length(prompt_tokens, max_tokens, window, param));
    }
    Ok(())
}

/// Whether the document's answers lay out the context through its FltLM filter (mode `lift`).
pub fn uses_filter(st: &Inner, tenant: &Tenant, id: &str, mode: Mode) -> bool {
    mode == Mode::Lift
        && with_doc(st, tenant, id, |d| d.rec.options.pointer("/filter/enabled") == Some(&Value::Bool(true)))
            .unwrap_or(false)
}

/// The document `id` as seen by `tenant`: 404 when unknown or another tenant's.
fn with_doc<T>(st: &Inner, tenant: &Tenant, id: &str, f: impl FnOnce(&DocEntry) -> T) -> ApiResult<T> {
    if !store::valid_id(id) {
        return Err(ApiError::unknown_document(id));
    }
    let docs = st.docs.read().map_err(|_| ApiError::internal("state lock poisoned"))?;
    match docs.get(id) {
        Some(d) if d.rec.owner == tenant.0 => Ok(f(d)),
        _ => Err(ApiError::unknown_document(id)),
    }
}

/// 409 unless the document is ready.
pub fn require_ready(st: &Inner, tenant: &Tenant, id: &str, param: &str) -> ApiResult<()> {
    let status = with_doc(st, tenant, id, |d| d.rec.status).map_err(|e| e.param(param))?;
    if status != Status::Ready {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "document_not_ready",
            format!("document {id} is {}, not ready", status.name()),
        )
        .param(param));
    }
    Ok(())
}

/// Whether `id` names a document visible to `tenant` (any status).
pub fn is_document(st: &Inner, tenant: &Tenant, id: &str) -> bool {
    with_doc(st, tenant, id, |_| ()).is_ok()
}

// ---------- documents ----------

fn absorb_options(st: &Inner, v: Option<&Value>) -> ApiResult<AbsorbOptions> {
    let mut o = st.default_options.clone();
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(o) };
    let m = v.as_object().ok_or_else(|| type_error("options", "an object"))?;
    let bad = |name: &str, msg: String| ApiError::bad_request("invalid_option", msg).param(&format!("options.{name}"));
    let uint = |name: &str, v: &Value| {
        v.as_u64().ok_or_else(|| bad(name, format!("'options.{name}' must be a non-negative integer")))
    };
    let max_window = st.engine.model.config().max_position_embeddings as u64;
    for (k, v) in m {
        match k.as_str() {
            "adapter" => {
                o.adapter = match v.as_str() {
                    Some("gated_memory") => AdapterKind::GatedMemory,
                    Some("lora") => AdapterKind::Lora,
                    _ => return Err(bad(k, "'options.adapter' must be \"gated_memory\" or \"lora\"".into())),
                }
            }
            "window" => {
                let w = uint(k, v)?;
                if w < MIN_WINDOW || w > max_window {
                    return Err(bad(k, format!("'options.window' must be between {MIN_WINDOW} and {max_window}")));
                }
                o.plan.window = w as usize;
            }
            "stride" => {
                let s = uint(k, v)?;
                if s == 0 {
                    return Err(bad(k, "'options.stride' must be at least 1".into()));
                }
                o.plan.stride = Some(s as usize);
            }
            "epochs" => {
                let e: Option<Vec<u64>> = v.as_array().map(|a| a.iter().filter_map(Value::as_u64).collect());
                match e {
                    Some(e) if e.len() == 2 && v.as_array().map_or(0, Vec::len) == 2 && e[0] + e[1] >= 1 && e[0] <= MAX_EPOCHS && e[1] <= MAX_EPOCHS => {
                        o.train.epochs = [e[0] as usize, e[1] as usize];
                    }
                    _ => {
                        return Err(bad(
                            k,
                            format!("'options.epochs' must be two integers [segment_only, with_qa], each at most {MAX_EPOCHS}, not both 0"),
                        ))
                    }
                }
            }
            "aux_qa" => {
                let n = uint(k, v)?;
                if n > MAX_AUX_QA {
                    return Err(bad(k, format!("'options.aux_qa' must be at most {MAX_AUX_QA}")));
                }
                o.qa.max_pairs = n as usize;
                o.qa.min_pairs = o.qa.min_pairs.min(n as usize);
            }
            // One pipeline: FltLM's filter and CDT are the prepared base's, trained once and active
            // under every document's adapter (docs/API.md).
            "filter" | "cdt" => {
                return Err(ApiError::bad_request(
                    "removed_option",
                    format!(
                        "'options.{k}' is no longer a per-document option: FltLM's filter and CDT are part of the \
                         server's prepared base, active for every document (the server's --prepared-base chooses it)"
                    ),
                )
                .param(&format!("options.{k}")))
            }
            other => {
                return Err(ApiError::bad_request("unknown_option", format!("unknown option '{other}'"))
                    .param(&format!("options.{other}")))
            }
        }
    }
    // Windows that skip text between them would silently leave part of the document out.
    if o.plan.stride() > o.plan.window {
        return Err(bad(
            "stride",
            format!(
                "'options.stride' ({}) must not exceed the window ({}): the text between windows would be skipped",
                o.plan.stride(),
                o.plan.window
            ),
        ));
    }
    Ok(o)
}

/// Smallest training window a request may ask for: below it each step costs more in template
/// and context tokens than it trains.
const MIN_WINDOW: u64 = 32;
const MAX_EPOCHS: u64 = 100;
const MAX_AUX_QA: u64 = 1000;

/// 400 unless the training the options plan for a document of `tokens` stays within the
/// server's cap (each option is bounded alone; this bounds their product).
fn check_training_cost(st: &Inner, opts: &AbsorbOptions, tokens: usize) -> ApiResult<()> {
    let planned = crate::lift::plan::planned_training_tokens(tokens, &opts.plan, opts.train.epochs, opts.qa.max_pairs);
    let cap = st.cfg.max_training_tokens;
    if planned > cap {
        return Err(ApiError::bad_request(
            "training_too_large",
            format!(
                "these options plan about {planned} training tokens for this document of {tokens} tokens; the server's limit is {cap} \
                 (fewer epochs or aux_qa, or a larger stride, plan less)"
            ),
        )
        .param("options"));
    }
    Ok(())
}

pub async fn post_document(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let bytes = read_body(&st, body).await?;
    let (text, title, options) = match media_type(&headers).as_deref() {
        Some("text/plain") => (utf8(&bytes)?.to_string(), None, None),
        _ => {
            let m = json_object(&headers, &bytes)?;
            let text = req_str(&m, "text")?;
            let title = opt_str(&m, "title")?;
            (text, title, m.get("options").cloned())
        }
    };
    if text.trim().is_empty() {
        return Err(ApiError::unprocessable("empty_document", "the document text is empty").param("text"));
    }
    if title.as_ref().is_some_and(|t| t.chars().count() > 1000) {
        return Err(ApiError::bad_request("invalid_title", "'title' is longer than 1000 characters").param("title"));
    }
    let opts = absorb_options(&st, options.as_ref())?;
    let opts_json = serde_json::to_value(&opts).map_err(|e| ApiError::internal(e.to_string()))?;
    let model = st.engine.model.clone();
    let limit = st.cfg.max_document_tokens;
    let (text, tokens) = tokio::task::spawn_blocking(move || {
        let n = model.encode_document(&text).map(|t| t.len());
        (text, n)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?;
    let tokens = tokens.map_err(|e| ApiError::unprocessable("untokenizable_document", e.to_string()).param("text"))?;
    if tokens > limit {
        return Err(ApiError::too_large(
            "document_too_large",
            format!("the document has {tokens} tokens; the limit is {limit}"),
        )
        .param("text"));
    }
    check_training_cost(&st, &opts, tokens)?;
    let id = store::document_id(&st.engine.model.info.fingerprint, tenant.0.as_deref(), &text, &opts_json);
    let existing = |docs: &HashMap<String, DocEntry>| {
        docs.get(&id)
            .filter(|d| matches!(d.rec.status, Status::Queued | Status::Training | Status::Ready))
            .map(|d| d.json())
    };
    if let Some(json) = existing(&*st.docs.read().map_err(|_| ApiError::internal("state lock poisoned"))?) {
        return Ok((StatusCode::OK, Json(json)).into_response());
    }
    // A place in the queue first: a refused request (429) writes nothing.
    let slot = st.engine.reserve_train()?;
    // The text is kept until the adapter is saved, so that a restart can train it again.
    let (st2, id2) = (st.clone(), id.clone());
    let text = tokio::task::spawn_blocking(move || st2.store.write_pending_text(&id2, &text).map(|()| text))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::internal(format!("cannot keep the document text: {e:#}")))?;

    let mut docs = st.docs.write().map_err(|_| ApiError::internal("state lock poisoned"))?;
    if let Some(json) = existing(&docs) {
        // The same document was queued meanwhile: its job keeps the text it wrote.
        return Ok((StatusCode::OK, Json(json)).into_response());
    }
    let rec = JobRecord {
        id: id.clone(),
        owner: tenant.0.clone(),
        title,
        status: Status::Queued,
        tokens,
        created_at: store::now(),
        seq: store::next_seq(),
        ready_at: None,
        error: None,
        adapter: None,
        options: opts_json,
    };
    let entry = DocEntry::new(rec.clone());
    submit_job(&st, slot, &entry, text, opts)?;
    st.store.write_record(&rec).map_err(|e| ApiError::internal(format!("cannot write the job record: {e}")))?;
    let json = entry.json();
    docs.insert(id.clone(), entry);
    tracing::info!(id, tokens, "document queued");
    Ok((StatusCode::ACCEPTED, Json(json)).into_response())
}

/// Queues the training job of `entry` (a new or re-queued document) on the engine.
pub fn submit_job(
    st: &AppState,
    slot: crate::engine::Reservation<'_>,
    entry: &DocEntry,
    text: String,
    opts: AbsorbOptions,
) -> Result<(), crate::engine::SubmitError> {
    let (st2, cancel) = (st.clone(), entry.cancel.clone());
    let (id, title) = (entry.rec.id.clone(), entry.rec.title.clone());
    slot.submit(Box::new(move |model: &Model| run_job(&st2, model, &id, &text, title.as_deref(), &opts, &cancel)))
}

/// Applies `f` to the entry of `id` if it is still the one this job belongs to.
fn update(st: &Inner, id: &str, cancel: &Arc<std::sync::atomic::AtomicBool>, f: impl FnOnce(&mut DocEntry)) {
    if let Ok(mut docs) = st.docs.write() {
        if let Some(d) = docs.get_mut(id) {
            if Arc::ptr_eq(&d.cancel, cancel) {
                f(d);
                d.notify();
            }
        }
    }
}

/// Writes the record of `id` to disk. The state lock is held while writing so that a concurrent
/// delete (which takes it to remove the entry, then removes the files) cannot be undone by a
/// write that read the entry before it was removed.
fn persist(st: &Inner, id: &str) {
    let Ok(docs) = st.docs.read() else { return };
    if let Some(d) = docs.get(id) {
        if let Err(e) = st.store.write_record(&d.rec) {
            tracing::error!(id, error = %e, "cannot write job record");
        }
    }
}

/// A training job, on the engine's training thread.
fn run_job(
    st: &AppState,
    model: &Model,
    id: &str,
    text: &str,
    title: Option<&str>,
    opts: &AbsorbOptions,
    cancel: &Arc<std::sync::atomic::AtomicBool>,
) {
    if cancel.load(Ordering::SeqCst) {
        if !st.shutting_down.load(Ordering::SeqCst) {
            return; // deleted while queued
        }
    } else {
        update(st, id, cancel, |d| d.rec.status = Status::Training);
        persist(st, id);
    }
    let t0 = Instant::now();
    let result = if cancel.load(Ordering::SeqCst) {
        Err(anyhow::anyhow!("cancelled before start"))
    } else {
        crate::lift::absorb(
            model,
            text,
            title,
            opts,
            &mut |ev| {
                let p = match ev {
                    AbsorbEvent::Stage(s) => serde_json::json!({"stage": s}),
                    AbsorbEvent::Qa(p) => {
                        serde_json::json!({"stage": "generating_qa", "step": p.done, "steps": p.total})
                    }
                    AbsorbEvent::Train(p) => {
                        serde_json::json!({"stage": "training", "epoch": p.epoch, "epochs": p.epochs,
                        "step": p.step, "steps": p.steps, "loss": p.loss, "tokens_per_s": p.tokens_per_s})
                    }
                };
                update(st, id, cancel, |d| d.progress = Some(p));
            },
            &|| cancel.load(Ordering::SeqCst),
        )
        .and_then(|absorbed| {
            let tps = absorbed.report.tokens_per_s;
            if cancel.load(Ordering::SeqCst) {
                anyhow::bail!("cancelled");
            }
            let loaded = st.store.save(id, absorbed, text)?;
            Ok((loaded, tps))
        })
    };
    let deleted = cancel.load(Ordering::SeqCst) && !st.shutting_down.load(Ordering::SeqCst);
    let held = crate::runtime::resident_bytes();
    crate::runtime::release_memory();
    tracing::info!(
        id,
        rss_before_mb = held.unwrap_or(0) >> 20,
        rss_after_mb = crate::runtime::resident_bytes().unwrap_or(0) >> 20,
        "heap trimmed after the job"
    );
    match result {
        Ok((loaded, tps)) => {
            if deleted {
                let _ = st.store.delete(id);
                st.metrics.job("cancelled", None);
                return;
            }
            let m = &loaded.manifest;
            let info = AdapterInfo { kind: m.kind.to_string(), parameters: m.parameters, bytes: m.bytes };
            update(st, id, cancel, |d| {
                d.rec.status = Status::Ready;
                d.rec.ready_at = Some(store::now());
                d.rec.adapter = Some(info);
                d.progress = None;
            });
            persist(st, id);
            st.metrics.job("ready", Some(tps));
            tracing::info!(id, seconds = t0.elapsed().as_secs_f64(), "document ready");
        }
        Err(_) if deleted => st.metrics.job("cancelled", None),
        Err(_) if st.shutting_down.load(Ordering::SeqCst) => {
            // Recorded as queued with its text kept: the next start trains it again.
            tracing::warn!(id, "training interrupted by the shutdown; the job is re-queued at the next start");
            update(st, id, cancel, |d| {
                d.rec.status = Status::Queued;
                d.progress = None;
            });
            persist(st, id);
            st.metrics.job("interrupted", None);
        }
        Err(e) => {
            let msg = format!("{e:#}");
            tracing::warn!(id, error = %msg, "training failed");
            update(st, id, cancel, |d| {
                d.rec.status = Status::Failed;
                d.rec.error = Some(msg);
            });
            persist(st, id);
            st.store.remove_pending_text(id);
            st.metrics.job("failed", None);
        }
    }
}

pub async fn list_documents(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
) -> ApiResult<Json<Value>> {
    let docs = st.docs.read().map_err(|_| ApiError::internal("state lock poisoned"))?;
    let mut list: Vec<&DocEntry> = docs.values().filter(|d| d.rec.owner == tenant.0).collect();
    list.sort_by(|a, b| a.rec.posting_order().cmp(&b.rec.posting_order()));
    Ok(Json(serde_json::json!({"object": "list", "data": list.iter().map(|d| d.json()).collect::<Vec<_>>()})))
}

pub async fn get_document(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    with_doc(&st, &tenant, &id, |d| Json(d.json()))
}

pub async fn delete_document(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    with_doc(&st, &tenant, &id, |_| ())?;
    let entry = st.docs.write().map_err(|_| ApiError::internal("state lock poisoned"))?.remove(&id);
    if let Some(e) = entry {
        e.cancel.store(true, Ordering::SeqCst);
    }
    let st2 = st.clone();
    let id2 = id.clone();
    tokio::task::spawn_blocking(move || st2.store.delete(&id2))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::internal(format!("cannot delete: {e:#}")))?;
    tracing::info!(id, "document deleted");
    Ok(StatusCode::NO_CONTENT)
}

pub async fn document_events(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let mut rx = with_doc(&st, &tenant, &id, |d| d.watch.subscribe())?;
    let mut shutdown = st.shutdown.subscribe();
    let stream = async_stream::stream! {
        loop {
            let v = rx.borrow_and_update().clone();
            let terminal = v.get("status").and_then(Value::as_str).is_some_and(|s| matches!(s, "ready" | "failed" | "cancelled"));
            yield Ok::<Event, std::convert::Infallible>(Event::default().event("progress").data(v.to_string()));
            if terminal {
                yield Ok(Event::default().event("done").data(v.to_string()));
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
                let mut v = v;
                v["status"] = Value::from("cancelled");
                yield Ok(Event::default().event("done").data(v.to_string()));
                break;
            }
        }
    };
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}

// ---------- generation ----------

/// What to generate from.
pub enum PromptSpec {
    Document {
        id: String,
        question: String,
        mode: Mode,
    },
    /// The token ids of a chat prompt (encoded, and checked against the window, by the handler).
    Chat(Vec<u32>),
}

pub struct GenResult {
    pub text: String,
    /// FltLM chunk scores of the in-context document (mode `lift` with a filter), with each
    /// chunk's text.
    pub chunks: Vec<(crate::lift::filter::ChunkScore, String)>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish_reason: FinishReason,
    pub queue_ms: f64,
    pub prompt_ms: f64,
    pub generate_ms: f64,
}

/// A queued generation: its result, and a guard that cancels it when dropped (the handler's
/// future or the response stream is dropped when the client goes away).
pub struct PendingGeneration {
    pub result: tokio::sync::oneshot::Receiver<anyhow::Result<GenResult>>,
    _cancel: CancelOnDrop,
}

impl PendingGeneration {
    pub async fn wait(&mut self) -> ApiResult<GenResult> {
        (&mut self.result).await.map_err(|_| ApiError::internal("generation was dropped"))?.map_err(gen_error)
    }
}

struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Queues a generation; text pieces go to `pieces` as they are decoded. The generation stops
/// (or never starts, if still queued) once the returned handle is dropped.
pub fn submit_generation(
    st: &AppState,
    spec: PromptSpec,
    params: SamplingParams,
    pieces: Option<tokio::sync::mpsc::UnboundedSender<String>>,
) -> ApiResult<PendingGeneration> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let st2 = st.clone();
    let queued = Instant::now();
    let cancelled = cancel.clone();
    st.engine.submit_generate(Box::new(move |model: &Model| {
        if cancelled.load(Ordering::SeqCst) {
            return; // the client left while the request waited
        }
        let queue_ms = queued.elapsed().as_secs_f64() * 1000.0;
        let mut on_text = |piece: &str| {
            !cancelled.load(Ordering::SeqCst)
                && match &pieces {
                    Some(p) => p.send(piece.to_string()).is_ok(),
                    None => true,
                }
        };
        let result = (|| -> anyhow::Result<GenResult> {
            let mut chunks = Vec::new();
            let out = match &spec {
                PromptSpec::Document { id, question, mode } => {
                    // Deleted while the request waited: the document is gone, not a server fault.
                    let gone = || st2.docs.read().is_ok_and(|d| !d.contains_key(id));
                    if gone() {
                        return Err(ApiError::unknown_document(id).into());
                    }
                    let loaded = st2.store.get(id, model).map_err(|e| {
                        if gone() {
                            ApiError::unknown_document(id).into()
                        } else {
                            e
                        }
                    })?;
                    let adapter: &dyn Adapter = &loaded.bundle.adapter;
                    let doc = &loaded.doc_tokens;
                    let (_, out, scores) = crate::lift::answer::answer_filtered(
                        model,
                        doc,
                        Some(adapter),
                        question,
                        *mode,
                        st2.cfg.context_tokens,
                        &params,
                        &mut on_text,
                    )?;
                    for c in scores {
                        chunks.push((c, model.tokenizer.decode(&doc[c.start..c.end])?));
                    }
                    out
                }
                PromptSpec::Chat(ids) => {
                    let mut cache = KvCache::new(model.config().num_layers);
                    crate::model::generate::generate(model, ids, &mut cache, None, &mut NoHooks, &params, &mut on_text)?
                }
            };
            st2.metrics.generation(out.prompt_ms / 1000.0, out.tokens.len(), out.generate_ms / 1000.0);
            Ok(GenResult {
                chunks,
                completion_tokens: out.tokens.len(),
                prompt_tokens: out.prompt_tokens,
                finish_reason: out.finish_reason,
                queue_ms,
                prompt_ms: out.prompt_ms,
                generate_ms: out.generate_ms,
                text: out.text,
            })
        })();
        let _ = tx.send(result);
    }))?;
    Ok(PendingGeneration { result: rx, _cancel: CancelOnDrop(cancel) })
}

/// The API error for a failed generation: a client error raised inside the model work keeps
/// its status; anything else is internal (details in the server log only).
pub fn gen_error(e: anyhow::Error) -> ApiError {
    if let Some(api) = e.downcast_ref::<ApiError>() {
        return api.clone();
    }
    if let Some(c) = e.downcast_ref::<crate::model::generate::ContextLengthExceeded>() {
        return ApiError::bad_request("context_length_exceeded", c.to_string());
    }
    ApiError::internal(format!("{e:#}"))
}

/// The `mode` field of `/ask` (and of a chat completion whose model is a document): `lift` by default.
pub fn ask_mode(m: &Map<String, Value>) -> ApiResult<Mode> {
    match opt_str(m, "mode")?.as_deref() {
        None | Some("lift") => Ok(Mode::Lift),
        Some("icl") => Ok(Mode::Icl),
        Some("memory") => Ok(Mode::Memory),
        Some(o) => {
            Err(ApiError::bad_request("invalid_mode", format!("'mode' must be lift, icl or memory (got '{o}')"))
                .param("mode"))
        }
    }
}

pub async fn ask(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<Value>> {
    let bytes = read_body(&st, body).await?;
    let m = json_object(&headers, &bytes)?;
    let id = req_str(&m, "document_id")?;
    let question = req_str(&m, "question")?;
    check_question(&st, &question, "question")?;
    let mode = ask_mode(&m)?;
    let max_tokens = max_tokens(&st, opt_u64(&m, "max_tokens")?, "max_tokens")?;
    let temperature = temperature(opt_f64(&m, "temperature")?)?;
    require_ready(&st, &tenant, &id, "document_id")?;
    check_question_fits(&st, &question, uses_filter(&st, &tenant, &id, mode), max_tokens, "question")?;
    let params = SamplingParams { max_tokens, temperature, ..Default::default() };
    let r =
        submit_generation(&st, PromptSpec::Document { id: id.clone(), question, mode }, params, None)?.wait().await?;
    let mut body = serde_json::json!({
        "answer": r.text, "document_id": id, "mode": mode,
        "usage": {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens},
        "finish_reason": r.finish_reason,
        "timings": {"queue_ms": r.queue_ms, "prompt_ms": r.prompt_ms, "generate_ms": r.generate_ms},
    });
    if !r.chunks.is_empty() {
        let chunks: Vec<Value> = r
            .chunks
            .iter()
            .map(|(c, text)| serde_json::json!({"start": c.start, "end": c.end, "score": c.score, "mask": c.mask, "text": text}))
            .collect();
        body["context"] = serde_json::json!({ "chunks": chunks });
    }
    Ok(Json(body))
}

// ---------- operations ----------

pub async fn health(State(st): State<AppState>) -> Response {
    if st.shutting_down.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "shutting_down"}))).into_response();
    }
    Json(serde_json::json!({"status": "ok", "model": st.base_id})).into_response()
}

pub async fn metrics(State(st): State<AppState>) -> Response {
    let (tw, tr) = st.engine.train_queue();
    let (gw, gr) = st.engine.generate_queue();
    let s = &st.store.stats;
    let mut by_status = [0usize; 5];
    if let Ok(docs) = st.docs.read() {
        for d in docs.values() {
            by_status[d.rec.status as usize] += 1;
        }
    }
    let resident = st.store.resident_bytes() as f64;
    let gauges = [
        ("lift_training_queue_depth", "Training jobs waiting.", tw as f64),
        ("lift_training_running", "Training jobs running.", tr as f64),
        ("lift_generation_queue_depth", "Generation requests waiting.", gw as f64),
        ("lift_generation_running", "Generation requests running.", gr as f64),
        ("lift_adapter_cache_hits", "Adapter cache hits (total).", s.hits.load(Ordering::Relaxed) as f64),
        ("lift_adapter_cache_misses", "Adapter cache misses (total).", s.misses.load(Ordering::Relaxed) as f64),
        (
            "lift_adapter_cache_evictions",
            "Adapters evicted for size (total).",
            s.evictions.load(Ordering::Relaxed) as f64,
        ),
        ("lift_adapter_cache_resident_bytes", "Bytes of adapters in memory.", resident),
        ("lift_documents_queued", "Documents queued.", by_status[0] as f64),
        ("lift_documents_training", "Documents training.", by_status[1] as f64),
        ("lift_documents_ready", "Documents ready.", by_status[2] as f64),
        ("lift_documents_failed", "Documents failed.", by_status[3] as f64),
        (
            "process_resident_memory_bytes",
            "Resident memory of the server process.",
            crate::runtime::resident_bytes().unwrap_or(0) as f64,
        ),
    ];
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], st.metrics.render(&gauges)).into_response()
}
