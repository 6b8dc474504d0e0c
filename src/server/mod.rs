//! The HTTP server (`lift-serve serve`): axum routes for documents, asking, the OpenAI-compatible
//! endpoints and operations (contract: `docs/API.md`). HTTP only: requests are read and
//! validated into typed values (`api`), the work is the service's (`crate::service`), and its
//! errors are mapped to the API's error shape once (`error`).

pub mod api;
pub mod collections;
mod config;
mod document_options;
pub mod error;
pub mod openai;
pub mod openapi;
pub mod routes;
pub mod web;

pub use config::ServeConfig;

use crate::lift::AbsorbOptions;
use crate::metrics::Metrics;
use crate::model::Model;
use crate::service::{Service, ServiceConfig};
use anyhow::{Context, Result};
use axum::extract::{MatchedPath, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use error::ApiError;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Inner {
    pub cfg: ServeConfig,
    pub service: Service,
    pub metrics: Arc<Metrics>,
    pub limits: api::GenerationLimits,
    /// API key → tenant id (hash of the key).
    pub keys: HashMap<String, String>,
    /// Requests being handled (the shutdown drains them).
    pub in_flight: AtomicUsize,
    /// Turns true when the shutdown begins: open event streams end, connections close.
    pub shutdown: tokio::sync::watch::Sender<bool>,
    pub default_options: AbsorbOptions,
    pub base_id: String,
    pub started_at: u64,
    /// Uploads' text, made in worker processes.
    pub extractor: crate::extraction::Extractor,
}

pub type AppState = Arc<Inner>;

/// The caller's tenant (None without keys).
#[derive(Clone, Debug)]
pub struct Tenant(pub Option<String>);

/// The tenant an API key stands for (a hash: keys are never stored).
pub fn tenant_of(key: &str) -> String {
    hex::encode(&Sha256::digest(key.as_bytes())[..8])
}

async fn auth(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    let key = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .map(String::from);
    if req.uri().path() == "/metrics" {
        if let Err(e) = metrics_access(&st, key.as_deref()) {
            return e.into_response();
        }
        req.extensions_mut().insert(Tenant(None));
        return next.run(req).await;
    }
    if st.keys.is_empty() || req.uri().path() == "/health" || web::is_page(req.uri().path()) {
        req.extensions_mut().insert(Tenant(None));
        return next.run(req).await;
    }
    match key.as_deref().and_then(|k| st.keys.get(k)) {
        Some(t) => {
            req.extensions_mut().insert(Tenant(Some(t.clone())));
            next.run(req).await
        }
        None => {
            let e = if key.is_none() {
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "missing_api_key",
                    "missing 'Authorization: Bearer <key>' header",
                )
            } else {
                ApiError::new(StatusCode::UNAUTHORIZED, "invalid_api_key", "invalid API key")
            };
            e.into_response()
        }
    }
}

/// The token of an `Authorization: Bearer <token>` value; the scheme's name is matched without
/// regard to case, as HTTP's auth schemes are.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

/// `/metrics` shows server-wide counts (every tenant's documents and jobs): with API keys or a
/// metrics key configured, only the metrics key may read it. Without any key (single-tenant)
/// it is open.
fn metrics_access(st: &Inner, key: Option<&str>) -> Result<(), ApiError> {
    let admin = st.cfg.metrics_key.as_deref().filter(|k| !k.is_empty());
    match (admin, key) {
        (None, _) if st.keys.is_empty() => Ok(()),
        (None, _) => Err(ApiError::not_found(
            "route_not_found",
            "/metrics is served only with a metrics key configured (--metrics-key)",
        )),
        (Some(a), Some(k)) if a == k => Ok(()),
        (Some(_), None) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing_api_key",
            "missing 'Authorization: Bearer <metrics key>' header",
        )),
        (Some(_), Some(_)) => Err(ApiError::new(StatusCode::FORBIDDEN, "forbidden", "/metrics needs the metrics key")),
    }
}

/// 503 for new work while shutting down; request metrics and a log line for every request.
async fn observe(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let t0 = Instant::now();
    let method = req.method().clone();
    let route = req.extensions().get::<MatchedPath>().map_or("(unmatched)".to_string(), |m| m.as_str().to_string());
    // While draining, every new request is refused in the API's shape (`/health` says so itself).
    if st.service.is_shutting_down() && req.uri().path() != "/health" {
        let r = closing(ApiError::shutting_down().into_response());
        st.metrics.request(method.as_str(), &route, 503, t0.elapsed().as_secs_f64());
        return r;
    }
    st.in_flight.fetch_add(1, Ordering::SeqCst);
    let resp = next.run(req).await;
    st.in_flight.fetch_sub(1, Ordering::SeqCst);
    // A keep-alive connection is closed after its first response once the shutdown began (idle
    // ones are not cut: a client may be sending on them; they get this 503 and the close).
    let resp = if st.service.is_shutting_down() { closing(resp) } else { resp };
    let status = resp.status().as_u16();
    let secs = t0.elapsed().as_secs_f64();
    st.metrics.request(method.as_str(), &route, status, secs);
    tracing::info!(method = %method, route = %route, status, ms = format!("{:.1}", secs * 1000.0), "request");
    resp
}

fn closing(mut resp: Response) -> Response {
    resp.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
    resp
}

async fn not_found() -> ApiError {
    ApiError::not_found("route_not_found", "no such route")
}

pub fn router(state: AppState) -> axum::Router {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/", get(web::index))
        .route("/ui/{file}", get(web::asset))
        .route("/documents", post(routes::post_document).get(routes::list_documents))
        .route("/documents/{id}", get(routes::get_document).delete(routes::delete_document))
        .route("/documents/{id}/events", get(routes::document_events))
        .route("/documents/{id}/text", get(routes::get_document_text))
        .route("/collections", post(collections::post_collection).get(collections::list_collections))
        .route(
            "/collections/{id}",
            get(collections::get_collection).patch(collections::patch_collection).delete(collections::delete_collection),
        )
        .route("/ask", post(routes::ask))
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .route("/openapi.json", get(openapi::serve))
        .fallback(not_found)
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "method not allowed on this route")
        })
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .layer(axum::middleware::from_fn_with_state(state.clone(), observe))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state)
}

/// `--checkpoint-secs` as a duration (zero: no checkpoints).
fn checkpoint_interval(secs: f64) -> Result<Duration> {
    anyhow::ensure!(secs.is_finite() && secs >= 0.0, "--checkpoint-secs must be 0 or more (got {secs})");
    Ok(Duration::from_secs_f64(secs))
}

/// Loads the model, opens the service (store, engine, recovered jobs) and builds the shared
/// state (blocking; within a tokio runtime's context: a replica starts its background work).
pub fn build_state(cfg: ServeConfig, device: &candle_core::Device) -> Result<AppState> {
    let keys = cfg.keys()?;
    tracing::info!(config = %cfg.describe(keys.len()), "lift-serve starting");
    // Settings that cannot work are refused before the model loads and the rate is measured
    // (seconds), not after.
    let shared = cfg.shared()?;
    let checkpoint_interval = checkpoint_interval(cfg.checkpoint_secs)?;
    let extraction = cfg.extraction()?;
    let file_options = read_default_options(&cfg)?;
    let model_path = crate::fetch::resolve_model(cfg.model.as_deref())?;
    let mut model = Model::load_with(&model_path, device, &cfg.runtime)?;
    crate::base::install_from_arg(&mut model, cfg.prepared_base.as_deref())?;
    let warm = std::time::Instant::now();
    model.decoder.warm_up()?;
    tracing::info!(seconds = warm.elapsed().as_secs_f64(), "inference path warmed up (float weights made)");
    let model = Arc::new(model);
    let default_options = default_options(&cfg, file_options, &model)?;
    let calibrated_rate = cfg.absorb_calibration.then(|| crate::lift::pricing::calibrated_rate(&model, &default_options)).flatten();
    let metrics = Arc::new(Metrics::default());
    let service_cfg = ServiceConfig {
        adapters_dir: cfg.adapters_dir.clone(),
        cache_bytes: cfg.cache_bytes,
        train_queue: cfg.train_queue,
        generate_queue: cfg.generate_queue,
        max_batch: cfg.max_batch,
        kv_cache_bytes: cfg.kv_cache_bytes,
        max_document_tokens: cfg.max_document_tokens,
        max_collection_documents: cfg.max_collection_documents,
        max_training_tokens: cfg.max_training_tokens,
        context_tokens: cfg.context_tokens,
        self_gating: cfg.self_gating,
        shared,
        checkpoint_interval,
        calibrated_rate,
    };
    // Before the service opens (a replica starts its background work there): a missing worker
    // binary fails the start at once.
    let extractor = crate::extraction::Extractor::new(extraction, metrics.clone());
    let service = Service::open(model.clone(), service_cfg, metrics.clone())?;
    let limits = api::GenerationLimits {
        max_question_chars: cfg.max_question_chars,
        max_tokens_limit: cfg.max_tokens_limit,
        default_max_tokens: cfg.default_max_tokens,
    };
    Ok(Arc::new(Inner {
        base_id: model.info.id.clone(),
        keys: keys.iter().map(|k| (k.clone(), tenant_of(k))).collect(),
        cfg,
        service,
        metrics,
        limits,
        in_flight: AtomicUsize::new(0),
        shutdown: tokio::sync::watch::Sender::new(false),
        default_options,
        started_at: crate::store::now(),
        extractor,
    }))
}

/// `--absorb-options` read (before the model loads: a file that cannot be read or parsed stops
/// the start at once), else the built-in options.
fn read_default_options(cfg: &ServeConfig) -> Result<AbsorbOptions> {
    match &cfg.absorb_options {
        Some(p) => AbsorbOptions::from_file(p),
        None => Ok(AbsorbOptions::default()),
    }
}

/// The absorb options of documents that set none (`read_default_options`), checked against
/// their bounds for `model` like a request's.
fn default_options(cfg: &ServeConfig, mut o: AbsorbOptions, model: &Model) -> Result<AbsorbOptions> {
    if cfg.absorb_budget.is_some() {
        o.budget_seconds = cfg.absorb_budget;
    }
    let c = model.config();
    o.validate(c.num_layers, c.max_position_embeddings).context("invalid default absorb options")?;
    let planned = crate::lift::pricing::most_training_tokens(cfg.max_document_tokens, &o);
    if planned > cfg.max_training_tokens {
        tracing::warn!(
            planned,
            cap = cfg.max_training_tokens,
            "the default absorb options on a document of max_document_tokens plan more training than max_training_tokens: such documents will be refused"
        );
    }
    Ok(o)
}

/// A running server.
pub struct Running {
    pub addr: SocketAddr,
    pub state: AppState,
    stop_accepting: tokio::sync::watch::Sender<bool>,
    /// Connections being served.
    open: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Graceful shutdown: refuse new requests (503, the listener stays open while draining), stop
    /// training (the job is re-queued at the next start), end open event streams with a final
    /// event, let in-flight requests finish for up to `drain_secs`, close the connections, stop
    /// the engine. Returns within `drain_secs` and half a second whatever is running: a training
    /// step or generation still running then (a step is not interruptible; the job's cancel flag
    /// is read between steps) is abandoned, and said so in the log; its job is re-queued by the
    /// next start.
    pub async fn shutdown(mut self) {
        begin_shutdown(&self.state);
        let cfg = &self.state.cfg;
        let deadline = Instant::now() + Duration::from_secs_f64(cfg.drain_secs.max(0.0));
        let hard_end = deadline + Duration::from_millis(500);
        while self.state.in_flight.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Then every connection closes once its response is written (event streams have ended).
        self.stop_accepting.send_replace(true);
        let _ = (&mut self.task).await;
        let closed = (Instant::now() + Duration::from_secs(1)).min(hard_end);
        while self.open.load(Ordering::SeqCst) > 0 && Instant::now() < closed {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let handles = self.state.service.engine.close();
        // A training step or generation still running past the drain is not waited for: the
        // process is ending.
        let join = tokio::task::spawn_blocking(move || {
            for h in handles {
                let _ = h.join();
            }
        });
        let left = hard_end.saturating_duration_since(Instant::now());
        if tokio::time::timeout(left, join).await.is_err() {
            tracing::warn!(
                drain_secs = cfg.drain_secs,
                "a training step or generation was still running at the end of the drain: abandoned (its job is \
                 re-queued at the next start)"
            );
        }
    }
}

/// Resolves once `rx` holds `true` (or its sender is gone).
pub async fn signalled(rx: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Refuses new requests from now on, ends open event streams and stops training.
pub fn begin_shutdown(st: &Inner) {
    st.service.begin_shutdown();
    st.shutdown.send_replace(true);
}

/// Binds and serves in the background (on the current tokio runtime).
pub async fn start(state: AppState) -> Result<Running> {
    let (host, port) = (state.cfg.host.as_str(), state.cfg.port);
    let listener = tokio::net::TcpListener::bind((host, port)).await.map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => format!(": another program listens on port {port} (pick another with --port)"),
            std::io::ErrorKind::PermissionDenied => format!(": port {port} needs privileges (use a port above 1023)"),
            _ => String::new(),
        };
        anyhow::anyhow!("cannot listen on {host}:{port}: {e}{hint}")
    })?;
    let addr = listener.local_addr()?;
    let open = Arc::new(AtomicUsize::new(0));
    let (stop_accepting, stop) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(accept_loop(listener, router(state.clone()), state.clone(), open.clone(), stop));
    tracing::info!(%addr, "listening");
    Ok(Running { addr, state, stop_accepting, open, task })
}

/// Accepts connections while fewer than `max_connections` are open (the others wait in the
/// listen backlog), each with the header timeout; a failed accept (out of file descriptors, most
/// often) is retried after a growing pause instead of ending the server or spinning.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    st: AppState,
    open: Arc<AtomicUsize>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let connections = Arc::new(tokio::sync::Semaphore::new(st.cfg.max_connections.max(1)));
    const MIN_BACKOFF: Duration = Duration::from_millis(5);
    let mut backoff = MIN_BACKOFF;
    loop {
        let permit = tokio::select! {
            p = connections.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
            _ = signalled(&mut stop) => return,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    backoff = MIN_BACKOFF;
                    stream
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_ms = backoff.as_millis() as u64, "accept failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
            _ = signalled(&mut stop) => return,
        };
        let held = OpenConnection::new(&open, permit);
        tokio::spawn(serve_connection(stream, app.clone(), st.clone(), stop.clone(), held));
    }
}

/// A connection's place under the cap, counted as open until dropped.
struct OpenConnection {
    open: Arc<AtomicUsize>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl OpenConnection {
    fn new(open: &Arc<AtomicUsize>, permit: tokio::sync::OwnedSemaphorePermit) -> Self {
        open.fetch_add(1, Ordering::SeqCst);
        Self { open: open.clone(), _permit: permit }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One HTTP/1 connection. During the drain every response says `Connection: close`; when the
/// drain ends, the connection closes once its current response is written.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    app: axum::Router,
    st: AppState,
    mut stop: tokio::sync::watch::Receiver<bool>,
    _held: OpenConnection,
) {
    let draining = st.service.is_shutting_down();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs_f64(st.cfg.header_timeout_secs))
        .keep_alive(!draining);
    let service = hyper_util::service::TowerToHyperService::new(app);
    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    tokio::pin!(conn);
    let mut closing = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = signalled(&mut stop), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// `lift-serve serve`: runs until SIGTERM or Ctrl-C, then shuts down gracefully.
pub fn serve(cfg: ServeConfig, device: &candle_core::Device) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let state = {
        let _context = rt.enter();
        build_state(cfg, device)?
    };
    let result = rt.block_on(async move {
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
    });
    // Tasks still running (a generation or training step past the drain) are not waited for.
    rt.shutdown_background();
    result
}
