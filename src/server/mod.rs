//! The HTTP server (`lift-serve serve`): axum routes for documents, asking, the OpenAI-compatible
//! endpoints and operations (contract: `docs/API.md`). HTTP only: requests are read and
//! validated into typed values (`api`), the work is the service's (`crate::service`), and its
//! errors are mapped to the API's error shape once (`error`).

pub mod api;
pub mod collections;
mod document_options;
pub mod error;
pub mod openai;
pub mod openapi;
pub mod routes;
pub mod web;

use crate::lift::AbsorbOptions;
use crate::metrics::Metrics;
use crate::model::Model;
use crate::runtime::RuntimeConfig;
use crate::service::postgres::{Role, SharedConfig};
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
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// Most documents in one collection (a change past it is refused with 413).
    #[arg(long, env = "LIFT_MAX_COLLECTION_DOCUMENTS", default_value_t = 1000)]
    pub max_collection_documents: usize,
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
    /// Most requests generating side by side (continuous batching; 1: one at a time).
    #[arg(long, env = "LIFT_MAX_BATCH", default_value_t = 16)]
    pub max_batch: usize,
    /// Memory for the KV caches of admitted requests (prompt + max_tokens each, counted when a
    /// request is queued); a request that would not fit is refused with 429 `memory_full`.
    #[arg(long, env = "LIFT_KV_CACHE_BYTES", default_value_t = 4 << 30)]
    pub kv_cache_bytes: u64,
    /// Bytes of loaded adapters kept in memory.
    #[arg(long, env = "LIFT_CACHE_BYTES", default_value_t = 1 << 30)]
    pub cache_bytes: u64,
    /// In-context document budget when answering (default: 128 tokens of retrieved passages or
    /// head and tail; with the `full` context policy, what fits the model's window).
    #[arg(long, env = "LIFT_CONTEXT_TOKENS")]
    pub context_tokens: Option<usize>,
    /// Prepared base (directory) under every document adapter, or `none`; default: `base/` in
    /// the working directory if it holds one.
    #[arg(long, env = "LIFT_PREPARED_BASE")]
    pub prepared_base: Option<String>,
    /// Cap on the training one document may plan (tokens through the model, all epochs): the
    /// default options on a document of `max_document_tokens` plan about 18.6M (their QA pairs
    /// grow with the document).
    #[arg(long, env = "LIFT_MAX_TRAINING_TOKENS", default_value_t = 25_000_000)]
    pub max_training_tokens: u64,
    /// Key for `/metrics` (server-wide counts). With API keys configured, `/metrics` answers only
    /// to this key (404 when none is set).
    #[arg(long, env = "LIFT_METRICS_KEY")]
    pub metrics_key: Option<String>,
    /// Seconds a connection may take to send a request's headers; also how long an idle
    /// keep-alive connection is kept open waiting for its next request.
    #[arg(long, env = "LIFT_HEADER_TIMEOUT_SECS", default_value_t = 30.0)]
    pub header_timeout_secs: f64,
    /// Seconds a request's body may take to arrive (408 after).
    #[arg(long, env = "LIFT_BODY_TIMEOUT_SECS", default_value_t = 60.0)]
    pub body_timeout_secs: f64,
    /// Open connections at most; further clients wait in the listen backlog.
    #[arg(long, env = "LIFT_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds the shutdown waits for in-flight requests before the process exits.
    #[arg(long, env = "LIFT_DRAIN_SECS", default_value_t = 5.0)]
    pub drain_secs: f64,
    /// Replicas: the PostgreSQL database they share for documents and the job queue
    /// (`postgres://user:password@host:port/db`). Without it this process keeps its documents in
    /// files under --adapters-dir.
    #[arg(long, env = "LIFT_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Replicas: the blob store of the adapters (`file:///path`, `s3://bucket/prefix`,
    /// `gs://…`, `az://…`); --adapters-dir is then this replica's local cache.
    #[arg(long, env = "LIFT_ADAPTER_STORE")]
    pub adapter_store: Option<String>,
    /// Replicas: train and answer (`all`), only train, or only answer.
    #[arg(long, env = "LIFT_ROLE", value_enum, default_value = "all")]
    pub role: Role,
    /// Replicas: this replica's name in job leases (default: host name and process id).
    #[arg(long, env = "LIFT_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// Replicas: seconds a claimed job stays this replica's without a renewal (renewed every
    /// third of it while training); another replica takes over a job whose lease ran out.
    #[arg(long, env = "LIFT_LEASE_SECS", default_value_t = 30.0)]
    pub lease_secs: f64,
    /// Uploads (files) extracted at once, each in its own worker process.
    #[arg(long, env = "LIFT_EXTRACT_WORKERS", default_value_t = 2)]
    pub extract_workers: usize,
    /// Seconds one extraction may take (wall clock; its CPU time is limited to one more); also
    /// the longest wait for a free worker.
    #[arg(long, env = "LIFT_EXTRACT_TIMEOUT_SECS", default_value_t = 20.0)]
    pub extract_timeout_secs: f64,
    /// Address space of an extraction worker, in bytes.
    #[arg(long, env = "LIFT_EXTRACT_MEMORY_BYTES", default_value_t = 2 << 30)]
    pub extract_memory_bytes: u64,
    /// JSON file with extraction budgets (`max_input_bytes`, `max_depth`, `max_stream_bytes`,
    /// `max_inflated_bytes`, `max_objects`, `max_pages`, `max_output_chars`, `max_archive_entries`;
    /// missing ones default).
    #[arg(long, env = "LIFT_EXTRACT_LIMITS")]
    pub extract_limits: Option<PathBuf>,
    /// The lift-serve binary run as the extraction worker (default: this one).
    #[arg(long, env = "LIFT_EXTRACT_WORKER")]
    pub extract_worker: Option<PathBuf>,
    /// Resident memory above which `/health` says `degraded` (bytes; default: no budget).
    #[arg(long, env = "LIFT_MEMORY_BUDGET_BYTES")]
    pub memory_budget_bytes: Option<u64>,
    /// Seconds an absorb may take when its request sets no `budget_seconds` (the plan is fitted
    /// to it; default: the options as they are, however long they take).
    #[arg(long, env = "LIFT_ABSORB_BUDGET")]
    pub absorb_budget: Option<f64>,
    /// Seconds between an absorb's checkpoints (also written where its segment stage ends): a
    /// restart, a crash or a replica taken over continues the absorb from the last one (0: no
    /// checkpoints).
    #[arg(long, env = "LIFT_CHECKPOINT_SECS", default_value_t = crate::lift::checkpoint::DEFAULT_INTERVAL.as_secs_f64())]
    pub checkpoint_secs: f64,
    /// Time a few training steps at start (a few seconds on a CPU) so that cost estimates and
    /// time budgets use this machine's rate before its first absorb finishes; with
    /// `--no-absorb-calibration` (or `LIFT_NO_ABSORB_CALIBRATION=1`), the documented prior (one
    /// 2-core CPU's rate).
    // The flag's word ("turn it off") is read from the flag or the variable, inverted here.
    #[arg(long = "no-absorb-calibration", env = "LIFT_NO_ABSORB_CALIBRATION", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::TypedValueParser::map(clap::builder::BoolishValueParser::new(), |off: bool| !off))]
    pub absorb_calibration: bool,
    /// Dtypes and kernels the model is loaded with: the command line's global flags
    /// (`--cpu-qmatmul`, ...), which `main` puts here; the defaults elsewhere.
    #[arg(skip)]
    pub runtime: RuntimeConfig,
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
            max_collection_documents: 1000,
            max_question_chars: 8192,
            max_tokens_limit: 2048,
            default_max_tokens: 128,
            train_queue: 8,
            generate_queue: 32,
            max_batch: 16,
            kv_cache_bytes: 4 << 30,
            cache_bytes: 1 << 30,
            context_tokens: None,
            // Explicit: a `base/` in the working directory belongs to the default model.
            prepared_base: Some("none".into()),
            max_training_tokens: 25_000_000,
            metrics_key: None,
            header_timeout_secs: 30.0,
            body_timeout_secs: 60.0,
            max_connections: 1024,
            drain_secs: 5.0,
            database_url: None,
            adapter_store: None,
            role: Role::All,
            replica_id: None,
            lease_secs: 30.0,
            extract_workers: 2,
            extract_timeout_secs: 20.0,
            extract_memory_bytes: 2 << 30,
            extract_limits: None,
            extract_worker: None,
            memory_budget_bytes: None,
            checkpoint_secs: crate::lift::checkpoint::DEFAULT_INTERVAL.as_secs_f64(),
            absorb_budget: None,
            absorb_calibration: true,
            runtime: RuntimeConfig::default(),
        }
    }

    /// How uploads are extracted: the worker binary, its budgets and limits.
    pub fn extraction(&self) -> Result<crate::extraction::WorkerConfig> {
        let limits = match &self.extract_limits {
            Some(p) => serde_json::from_str(&std::fs::read_to_string(p).with_context(|| format!("{}: cannot read", p.display()))?)
                .with_context(|| format!("{}: invalid extraction limits", p.display()))?,
            None => crate::formats::Limits::default(),
        };
        if !(self.extract_timeout_secs.is_finite() && self.extract_timeout_secs > 0.0) {
            anyhow::bail!("--extract-timeout-secs must be positive (got {})", self.extract_timeout_secs);
        }
        Ok(crate::extraction::WorkerConfig {
            program: crate::extraction::worker_program(self.extract_worker.as_deref())?,
            limits,
            timeout: Duration::from_secs_f64(self.extract_timeout_secs),
            memory_bytes: self.extract_memory_bytes,
            concurrency: self.extract_workers.max(1),
        })
    }

    /// The replica settings, when a database is given (checked: a store URL goes with it, a
    /// role other than `all` needs it).
    pub fn shared(&self) -> Result<Option<SharedConfig>> {
        let Some(database_url) = self.database_url.clone() else {
            if self.role != Role::All {
                let role = clap::ValueEnum::to_possible_value(&self.role).map(|v| v.get_name().to_string()).unwrap_or_default();
                anyhow::bail!("--role {role} is for replicas sharing a database: give --database-url too (or leave --role out)");
            }
            if self.adapter_store.is_some() {
                anyhow::bail!("--adapter-store is for replicas sharing a database: give --database-url too");
            }
            return Ok(None);
        };
        let adapter_store = self.adapter_store.clone().context("--database-url needs --adapter-store (where the adapters are shared)")?;
        if !(self.lease_secs.is_finite() && self.lease_secs >= 1.0) {
            anyhow::bail!("--lease-secs must be at least 1 (got {})", self.lease_secs);
        }
        let replica = self.replica_id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
            format!("{}-{}", if host.is_empty() { "replica" } else { &host }, std::process::id())
        });
        Ok(Some(SharedConfig {
            database_url,
            adapter_store,
            role: self.role,
            replica,
            lease: Duration::from_secs_f64(self.lease_secs),
            poll: Duration::from_millis(500),
            max_attempts: 5,
        }))
    }

    /// All configured keys (flag/env and file).
    pub fn keys(&self) -> Result<Vec<String>> {
        let mut keys: Vec<String> =
            self.api_keys.iter().map(|k| k.trim().to_string()).filter(|k| !k.is_empty()).collect();
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
             max_document_tokens={} max_collection_documents={} max_question_chars={} max_tokens_limit={} default_max_tokens={} \
             train_queue={} generate_queue={} max_batch={} kv_cache_bytes={} cache_bytes={} context_tokens={} max_training_tokens={} metrics_key={} \
             header_timeout_secs={} body_timeout_secs={} max_connections={} drain_secs={} database_url={} \
             adapter_store={} role={:?} replica_id={} lease_secs={} extract_workers={} extract_timeout_secs={} \
             extract_memory_bytes={} extract_limits={} extract_worker={} memory_budget_bytes={} checkpoint_secs={} absorb_budget={} \
             absorb_calibration={} runtime={:?}",
            self.host,
            self.port,
            self.model.as_ref().map_or("(default)".into(), |p| p.display().to_string()),
            self.adapters_dir.display(),
            if keys == 0 { "(none: single-tenant)".to_string() } else { format!("{keys} key(s) ****") },
            self.absorb_options.as_ref().map_or("(built-in)".into(), |p| p.display().to_string()),
            self.max_body_bytes,
            self.max_document_tokens,
            self.max_collection_documents,
            self.max_question_chars,
            self.max_tokens_limit,
            self.default_max_tokens,
            self.train_queue,
            self.generate_queue,
            self.max_batch,
            self.kv_cache_bytes,
            self.cache_bytes,
            self.context_tokens.map_or(format!("(default {})", crate::lift::answer::DEFAULT_CONTEXT_TOKENS), |c| c.to_string()),
            self.max_training_tokens,
            if self.metrics_key.is_some() { "****" } else { "(none)" },
            self.header_timeout_secs,
            self.body_timeout_secs,
            self.max_connections,
            self.drain_secs,
            self.database_url.as_deref().map_or("(none: files)".to_string(), mask_password),
            self.adapter_store.as_deref().unwrap_or("(none)"),
            self.role,
            self.replica_id.as_deref().unwrap_or("(auto)"),
            self.lease_secs,
            self.extract_workers,
            self.extract_timeout_secs,
            self.extract_memory_bytes,
            self.extract_limits.as_ref().map_or("(built-in)".into(), |p| p.display().to_string()),
            self.extract_worker.as_ref().map_or("(this binary)".into(), |p| p.display().to_string()),
            self.memory_budget_bytes.map_or("(none)".into(), |b| b.to_string()),
            self.checkpoint_secs,
            self.absorb_budget.map_or("(none)".into(), |b| b.to_string()),
            self.absorb_calibration,
            self.runtime,
        )
    }
}

/// A connection string with its password masked, for logs.
fn mask_password(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("****"));
            u.to_string()
        }
        Ok(u) => u.to_string(),
        Err(_) => "(not a URL)".to_string(),
    }
}

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
    let calibrated_rate = cfg.absorb_calibration.then(|| crate::lift::calibrate::rate(&model, &default_options)).flatten();
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
    let planned = crate::lift::estimate::most_training_tokens(cfg.max_document_tokens, &o);
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeConfig,
    }

    /// `--no-absorb-calibration` and `LIFT_NO_ABSORB_CALIBRATION` turn the calibration off; the
    /// flag wins over the variable, as every flag does.
    #[test]
    fn absorb_calibration_has_a_flag_and_an_environment_variable() {
        let parse = |args: &[&str]| Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).unwrap().serve;
        const VAR: &str = "LIFT_NO_ABSORB_CALIBRATION";
        std::env::remove_var(VAR);
        assert!(parse(&[]).absorb_calibration, "on by default");
        assert!(!parse(&["--no-absorb-calibration"]).absorb_calibration);
        for (value, on) in [("1", false), ("true", false), ("0", true), ("false", true)] {
            std::env::set_var(VAR, value);
            assert_eq!(parse(&[]).absorb_calibration, on, "{VAR}={value}");
        }
        std::env::set_var(VAR, "0");
        assert!(!parse(&["--no-absorb-calibration"]).absorb_calibration, "the flag over the variable");
        std::env::remove_var(VAR);
    }
}
