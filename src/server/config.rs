//! The server's configuration (`ServeConfig`): its flags and `LIFT_*` environment variables, the
//! defaults for embedding and tests, and the settings derived and checked from it (keys,
//! extraction, replicas), with the description printed at start (secrets masked).

use crate::runtime::RuntimeConfig;
use crate::service::postgres::{Role, SharedConfig};
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::time::Duration;

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
    /// Self-gating of `lift` answers: the answer the same prompt gets without the adapter is
    /// generated in the same batch, and the likelier of the two is kept (`answered_by`); with
    /// `--no-self-gating` (or `LIFT_NO_SELF_GATING=1`), always the adapter's, at half the work.
    #[arg(long = "no-self-gating", env = "LIFT_NO_SELF_GATING", action = clap::ArgAction::SetTrue,
          value_parser = clap::builder::TypedValueParser::map(clap::builder::BoolishValueParser::new(), |off: bool| !off))]
    pub self_gating: bool,
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
    #[arg(long, env = "LIFT_CHECKPOINT_SECS", default_value_t = crate::lift::absorb::checkpoint::DEFAULT_INTERVAL.as_secs_f64())]
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
            self_gating: true,
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
            checkpoint_secs: crate::lift::absorb::checkpoint::DEFAULT_INTERVAL.as_secs_f64(),
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
             train_queue={} generate_queue={} max_batch={} kv_cache_bytes={} cache_bytes={} context_tokens={} self_gating={} max_training_tokens={} metrics_key={} \
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
            self.self_gating,
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

    #[test]
    fn self_gating_is_on_unless_turned_off() {
        let parse = |args: &[&str]| Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied())).unwrap().serve;
        assert!(parse(&[]).self_gating && ServeConfig::new("m".into(), "a".into()).self_gating);
        assert!(!parse(&["--no-self-gating"]).self_gating);
    }
}
