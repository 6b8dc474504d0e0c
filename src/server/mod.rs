//! The HTTP server (`lift-serve serve`): axum routes for documents, asking, the OpenAI-compatible
//! endpoints and operations (contract: `shared/API.md`).

pub mod error;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod routes;

use crate::engine::Engine;
use crate::lift::AbsorbOptions;
use crate::model::Model;
use crate::store::{JobRecord, Status, Store};
use anyhow::{Context, Result};
use axum::extract::{MatchedPath, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use error::ApiError;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// Server configuration: flags and `LIFT_*` environment variables.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeConfig {
    #[arg(long, env = "LIFT_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "LIFT_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Model file (.gguf) or Hugging Face directory; default: the fetched default model.
    #[arg(long, env = "LIFT_MODEL")]
    pub model: Option<PathBuf>,
    /// Where adapters and job records live.
    #[arg(long, env = "LIFT_ADAPTERS_DIR", default_value = "adapters")]
    pub adapters_dir: PathBuf,
    /// API keys, comma-separated (no keys: single-tenant, no auth).
    #[arg(long, env = "LIFT_API_KEYS", value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// File with one API key per line (blank lines and `#` comments ignored).
    #[arg(long, env = "LIFT_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// JSON file with the default AbsorbOptions for documents.
    #[arg(long, env = "LIFT_ABSORB_OPTIONS")]
    pub absorb_options: Option<PathBuf>,
    /// Largest request body.
    #[arg(long, env = "LIFT_MAX_BODY_BYTES", default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Largest document, in tokens of the base model.
    #[arg(long, env = "LIFT_MAX_DOCUMENT_TOKENS", default_value_t = 200_000)]
    pub max_document_tokens: usize,
    /// Longest question / chat message, in characters.
    #[arg(long, env = "LIFT_MAX_QUESTION_CHARS", default_value_t = 8192)]
    pub max_question_chars: usize,
    /// Upper bound of `max_tokens`.
    #[arg(long, env = "LIFT_MAX_TOKENS_LIMIT", default_value_t = 2048)]
    pub max_tokens_limit: usize,
    /// Default `max_tokens`.
    #[arg(long, env = "LIFT_DEFAULT_MAX_TOKENS", default_value_t = 128)]
    pub default_max_tokens: usize,
    /// Training jobs that may wait in the queue.
    #[arg(long, env = "LIFT_TRAIN_QUEUE", default_value_t = 8)]
    pub train_queue: usize,
    /// Generation requests that may wait in the queue.
    #[arg(long, env = "LIFT_GENERATE_QUEUE", default_value_t = 32)]
    pub generate_queue: usize,
    /// Bytes of loaded adapters kept in memory.
    #[arg(long, env = "LIFT_CACHE_BYTES", default_value_t = 1 << 30)]
    pub cache_bytes: u64,
    /// In-context document budget when answering (default: what fits the model's window).
    #[arg(long, env = "LIFT_CONTEXT_TOKENS")]
    pub context_tokens: Option<usize>,
    /// Prepared base (directory) under every document adapter, or `none`; default: `base/` in
    /// the working directory if it holds one.
    #[arg(long, env = "LIFT_PREPARED_BASE")]
    pub prepared_base: Option<String>,
}

impl ServeConfig {
    /// Defaults for a model and adapters directory (tests, embedding).
    pub fn new(model: PathBuf, adapters_dir: PathBuf) -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 0,
            model: Some(model),
            adapters_dir,
            api_keys: Vec::new(),
            api_keys_file: None,
            absorb_options: None,
            max_body_bytes: 8 << 20,
            max_document_tokens: 200_000,
            max_question_chars: 8192,
            max_tokens_limit: 2048,
            default_max_tokens: 128,
            train_queue: 8,
            generate_queue: 32,
            cache_bytes: 1 << 30,
            context_tokens: None,
            // Explicit: a `base/` in the working directory belongs to the default model.
            prepared_base: Some("none".into()),
        }
    }

    /// All configured keys (flag/env and file).
    pub fn keys(&self) -> Result<Vec<String>> {
        let mut keys: Vec<String> = self.api_keys.iter().map(|k| k.trim().to_string()).filter(|k| !k.is_empty()).collect();
        if let Some(f) = &self.api_keys_file {
            let text = std::fs::read_to_string(f).with_context(|| format!("{}: cannot read API keys", f.display()))?;
            keys.extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from));
        }
        Ok(keys)
    }

    /// The configuration as printed at start, secrets masked.
    pub fn describe(&self, keys: usize) -> String {
        format!(
            "host={} port={} model={} adapters_dir={} api_keys={} absorb_options={} max_body_bytes={} \
             max_document_tokens={} max_question_chars={} max_tokens_limit={} default_max_tokens={} \
             train_queue={} generate_queue={} cache_bytes={} context_tokens={}",
            self.host,
            self.port,
            self.model.as_ref().map_or("(default)".into(), |p| p.display().to_string()),
            self.adapters_dir.display(),
            if keys == 0 { "(none: single-tenant)".to_string() } else { format!("{keys} key(s) ****") },
            self.absorb_options.as_ref().map_or("(built-in)".into(), |p| p.display().to_string()),
            self.max_body_bytes,
            self.max_document_tokens,
            self.max_question_chars,
            self.max_tokens_limit,
            self.default_max_tokens,
            self.train_queue,
            self.generate_queue,
            self.cache_bytes,
            self.context_tokens.map_or("(auto)".into(), |c| c.to_string()),
        )
    }
}

/// One document known to the server.
pub struct DocEntry {
    pub rec: JobRecord,
    pub progress: Option<serde_json::Value>,
    pub cancel: Arc<AtomicBool>,
    pub watch: tokio::sync::watch::Sender<serde_json::Value>,
}

impl DocEntry {
    pub fn new(rec: JobRecord) -> Self {
        let (watch, _) = tokio::sync::watch::channel(serde_json::Value::Null);
        let e = Self { rec, progress: None, cancel: Arc::new(AtomicBool::new(false)), watch };
        e.notify();
        e
    }

    /// The API's Document object.
    pub fn json(&self) -> serde_json::Value {
        let r = &self.rec;
        let mut v = serde_json::json!({
            "id": r.id, "object": "document", "status": r.status.name(), "title": r.title,
            "tokens": r.tokens, "created_at": r.created_at, "ready_at": r.ready_at,
            "progress": self.progress, "adapter": r.adapter,
            "error": r.error.as_ref().map(|m| serde_json::json!({"message": m})),
            "options": r.options,
        });
        if r.status == Status::Ready {
            v["progress"] = serde_json::Value::Null;
        }
        v
    }

    pub fn notify(&self) {
        self.watch.send_replace(self.json());
    }
}

pub struct Inner {
    pub cfg: ServeConfig,
    pub engine: Engine,
    pub store: Store,
    pub docs: RwLock<HashMap<String, DocEntry>>,
    pub metrics: metrics::Metrics,
    /// API key → tenant id (hash of the key).
    pub keys: HashMap<String, String>,
    pub shutting_down: AtomicBool,
    pub default_options: AbsorbOptions,
    pub base_id: String,
    pub started_at: u64,
}

pub type AppState = Arc<Inner>;

impl Inner {
    pub fn model(&self) -> &Model {
        &self.engine.model
    }
}

/// The caller's tenant (None without keys).
#[derive(Clone, Debug)]
pub struct Tenant(pub Option<String>);

fn tenant_of(key: &str) -> String {
    hex::encode(&Sha256::digest(key.as_bytes())[..8])
}

async fn auth(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    if st.keys.is_empty() || req.uri().path() == "/health" {
        req.extensions_mut().insert(Tenant(None));
        return next.run(req).await;
    }
    let key = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match key.and_then(|k| st.keys.get(k)) {
        Some(t) => {
            req.extensions_mut().insert(Tenant(Some(t.clone())));
            next.run(req).await
        }
        None => {
            let e = if key.is_none() {
                ApiError::new(StatusCode::UNAUTHORIZED, "missing_api_key", "missing 'Authorization: Bearer <key>' header")
            } else {
                ApiError::new(StatusCode::UNAUTHORIZED, "invalid_api_key", "invalid API key")
            };
            e.into_response()
        }
    }
}

/// 503 for new work while shutting down; request metrics and a log line for every request.
async fn observe(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let t0 = Instant::now();
    let method = req.method().clone();
    let route = req.extensions().get::<MatchedPath>().map_or("(unmatched)".to_string(), |m| m.as_str().to_string());
    if st.shutting_down.load(Ordering::SeqCst) && (method == Method::POST || method == Method::DELETE) {
        let r = ApiError::shutting_down().into_response();
        st.metrics.request(method.as_str(), &route, 503, t0.elapsed().as_secs_f64());
        return r;
    }
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let secs = t0.elapsed().as_secs_f64();
    st.metrics.request(method.as_str(), &route, status, secs);
    tracing::info!(method = %method, route = %route, status, ms = format!("{:.1}", secs * 1000.0), "request");
    resp
}

async fn not_found() -> ApiError {
    ApiError::not_found("route_not_found", "no such route")
}

pub fn router(state: AppState) -> axum::Router {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/documents", post(routes::post_document).get(routes::list_documents))
        .route("/documents/{id}", get(routes::get_document).delete(routes::delete_document))
        .route("/documents/{id}/events", get(routes::document_events))
        .route("/ask", post(routes::ask))
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .route("/openapi.json", get(openapi::openapi))
        .fallback(not_found)
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "method not allowed on this route")
        })
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .layer(axum::middleware::from_fn_with_state(state.clone(), observe))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state)
}

/// Loads the model, opens the store and builds the shared state (blocking).
pub fn build_state(cfg: ServeConfig, device: &candle_core::Device) -> Result<AppState> {
    let keys = cfg.keys()?;
    tracing::info!(config = %cfg.describe(keys.len()), "lift-serve starting");
    let model_path = crate::fetch::resolve_model(cfg.model.as_deref())?;
    let mut model = Model::load(&model_path, device)?;
    crate::base::install_from_arg(&mut model, cfg.prepared_base.as_deref())?;
    let model = Arc::new(model);
    let default_options: AbsorbOptions = match &cfg.absorb_options {
        Some(p) => serde_json::from_str(&std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?)
            .with_context(|| format!("{}: invalid absorb options", p.display()))?,
        None => AbsorbOptions::default(),
    };
    let store = Store::open(&cfg.adapters_dir, cfg.cache_bytes)?;
    let mut docs = HashMap::new();
    let mut requeue = Vec::new();
    for r in store.recover()? {
        if let Some(text) = r.requeue_text {
            requeue.push((r.rec.id.clone(), text));
        }
        docs.insert(r.rec.id.clone(), DocEntry::new(r.rec));
    }
    tracing::info!(documents = docs.len(), requeued = requeue.len(), dir = %cfg.adapters_dir.display(), "store opened");
    let engine = Engine::start(model.clone(), cfg.train_queue, cfg.generate_queue)?;
    let state = Arc::new(Inner {
        base_id: model.info.id.clone(),
        keys: keys.iter().map(|k| (k.clone(), tenant_of(k))).collect(),
        cfg,
        engine,
        store,
        docs: RwLock::new(docs),
        metrics: metrics::Metrics::default(),
        shutting_down: AtomicBool::new(false),
        default_options,
        started_at: crate::store::now(),
    });
    for (id, text) in requeue {
        requeue_job(&state, &id, text);
    }
    Ok(state)
}

/// Queues again a job interrupted by the previous process (its text was kept), or records why it
/// cannot be: its id no longer matches the text, options and base model, or the queue is full.
fn requeue_job(st: &AppState, id: &str, text: String) {
    let Ok(mut docs) = st.docs.write() else { return };
    let Some(entry) = docs.get_mut(id) else { return };
    let r = &entry.rec;
    let opts = serde_json::from_value::<AbsorbOptions>(r.options.clone()).map_err(|e| format!("its options no longer parse ({e})"));
    let same = crate::store::document_id(&st.engine.model.info.fingerprint, r.owner.as_deref(), &text, &r.options) == r.id;
    let result = opts.and_then(|opts| {
        if !same {
            return Err("its text, options or the base model changed".to_string());
        }
        routes::submit_job(st, entry, text, opts).map_err(|e| format!("the training queue refused it ({e:?})"))
    });
    match result {
        Ok(()) => tracing::info!(id, "re-queued a job interrupted by the previous process"),
        Err(why) => {
            entry.rec.status = Status::Failed;
            entry.rec.error = Some(format!("interrupted: the server stopped during the job and could not re-queue it: {why}; POST the document again to retry"));
            entry.notify();
            st.store.remove_pending_text(id);
            if let Err(e) = st.store.write_record(&entry.rec) {
                tracing::error!(id, error = %e, "cannot write job record");
            }
            tracing::warn!(id, why, "interrupted job not re-queued");
        }
    }
}

/// A running server.
pub struct Running {
    pub addr: SocketAddr,
    pub state: AppState,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Graceful shutdown: refuse new work (503), stop training (the job is recorded as failed
    /// with the reason), let in-flight requests finish, stop the engine.
    pub async fn shutdown(mut self) {
        begin_shutdown(&self.state);
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let _ = (&mut self.task).await;
        let handles = self.state.engine.close();
        let _ = tokio::task::spawn_blocking(move || {
            for h in handles {
                let _ = h.join();
            }
        })
        .await;
    }
}

pub fn begin_shutdown(st: &Inner) {
    st.shutting_down.store(true, Ordering::SeqCst);
    if let Ok(docs) = st.docs.read() {
        for d in docs.values() {
            if !d.rec.status.is_terminal() {
                d.cancel.store(true, Ordering::SeqCst);
            }
        }
    }
}

/// Binds and serves in the background (on the current tokio runtime).
pub async fn start(state: AppState) -> Result<Running> {
    let listener = tokio::net::TcpListener::bind((state.cfg.host.as_str(), state.cfg.port)).await?;
    let addr = listener.local_addr()?;
    let app = router(state.clone());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "server error");
        }
    });
    tracing::info!(%addr, "listening");
    Ok(Running { addr, state, shutdown: Some(tx), task })
}

/// `lift-serve serve`: runs until SIGTERM or Ctrl-C, then shuts down gracefully.
pub fn serve(cfg: ServeConfig, device: &candle_core::Device) -> Result<()> {
    let state = build_state(cfg, device)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let running = start(state).await?;
        let ctrl_c = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        #[cfg(unix)]
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let term = std::future::pending::<()>();
        tokio::select! { _ = ctrl_c => {}, _ = term => {} }
        tracing::info!("shutting down: refusing new work, stopping training, finishing requests");
        running.shutdown().await;
        tracing::info!("stopped");
        Ok(())
    })
}
