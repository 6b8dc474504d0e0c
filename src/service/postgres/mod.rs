//! Replicas that share one document registry, job queue and adapter store (`--database-url`):
//! PostgreSQL holds every document's record and the queue of absorb jobs with their leases; the
//! adapters are archives in a blob store ([`crate::store::blobs`]).
//!
//! A job's life across replicas:
//! - `POST /documents` on any replica inserts the document and its job in one transaction. The
//!   document id is the primary key, so two replicas posting the same document at once make one
//!   row and one job (the second insert waits on the first and finds it).
//! - Every replica that trains (`--role all|trainer`) polls the queue while its training lane is
//!   free and claims the oldest job nobody holds (`FOR UPDATE SKIP LOCKED`): it takes a lease of
//!   `--lease-secs`, renews it while it trains (publishing progress in the same write), and loses
//!   the job if it cannot (deleted, or taken over after the lease ran out).
//! - A replica that dies stops renewing: once the lease has run out another replica claims the job
//!   ("stolen") and trains it from the text kept in the job's row. A job claimed `max_attempts`
//!   times fails with the reason instead of killing replicas forever.
//! - The trained adapter is packed, written to the blob store under its hash, and published in one
//!   transaction that checks the lease is still this replica's, sets the document ready with the
//!   archive's hash and removes the job: exactly one adapter per document id.
//! - Answers load the adapter from the replica's cache, else fetch and verify the archive.
//!
//! While the database is away, reads and writes answer 503 (`database_unavailable`) and `/health`
//! says so; the pool reconnects by itself when it is back, nothing restarts.
//!
//! Here: the replica's settings, the connection pool and the database helpers; the schema's
//! migrations (`migrations.rs`); the documents' rows and the [`Registry`](super::registry::Registry)
//! over them (`registry.rs`); the job queue — claims, leases, the trainer loop, publishing
//! adapters (`queue.rs`); absorbing again the documents over another base (`rebase.rs`).

mod migrations;
mod queue;
mod rebase;
mod registry;

use super::ServiceError;
use crate::engine::JobProgress;
use crate::metrics::Metrics;
use crate::store::blobs::Blobs;
use crate::store::Store;
use anyhow::Context;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a replica does with the shared queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Trains queued documents and answers questions.
    All,
    /// Trains only (asking answers 503 `not_serving`).
    Trainer,
    /// Answers only (documents it receives are trained by the trainers).
    Server,
}

impl Role {
    pub fn trains(self) -> bool {
        matches!(self, Role::All | Role::Trainer)
    }
    pub fn answers(self) -> bool {
        matches!(self, Role::All | Role::Server)
    }
}

#[derive(Clone, Debug)]
pub struct SharedConfig {
    pub database_url: String,
    /// `file:///…`, `s3://…`, `gs://…`, `az://…`.
    pub adapter_store: String,
    pub role: Role,
    /// This replica's name in leases and logs.
    pub replica: String,
    /// How long a claimed job stays this replica's without a renewal.
    pub lease: Duration,
    /// How often a free trainer looks for a job.
    pub poll: Duration,
    /// Claims of one job before it is failed.
    pub max_attempts: i32,
}

/// Longest a single database call may take before it counts as the database being away.
const DB_TIMEOUT: Duration = Duration::from_secs(5);
/// A job this replica is training.
struct Running {
    attempt: i32,
    cancel: Arc<AtomicBool>,
    progress: Mutex<Option<JobProgress>>,
    /// Set when the lease was lost: the job is another replica's now.
    lost: AtomicBool,
}

/// The base a replica serves: its model's fingerprint (with its prepared base) and its name for
/// people.
pub(super) struct Base {
    pub(super) fingerprint: String,
    pub(super) name: String,
}

pub struct Shared {
    pool: deadpool_postgres::Pool,
    cfg: SharedConfig,
    base: Base,
    /// When this replica started (seconds): it absorbs again only adapters published before.
    started_at: u64,
    /// When this replica last wrote a document's `last_asked_at`.
    asked: Mutex<HashMap<String, u64>>,
    /// Documents over another base whose archive this replica could not read (not tried again).
    unreadable: Mutex<HashSet<String>>,
    /// No document over another base is left for this replica to absorb again: the set it takes
    /// (published before it started) only shrinks, so it stops looking.
    rebased: AtomicBool,
    store: Arc<Store>,
    blobs: Arc<Blobs>,
    metrics: Arc<Metrics>,
    runtime: tokio::runtime::Handle,
    /// The schema is in place (set by the first successful migration run).
    migrated: AtomicBool,
    shutting_down: AtomicBool,
    running: Mutex<HashMap<String, Arc<Running>>>,
    /// Wakes the trainer loop (a job was posted here, or the training lane became free).
    wake: tokio::sync::Notify,
}

fn unavailable(e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Unavailable(format!("the database is unavailable: {e}"))
}

pub(super) fn db_error(e: tokio_postgres::Error) -> ServiceError {
    // An error the server sent back is a bug or a constraint; anything else is the connection.
    match e.as_db_error() {
        Some(db) => ServiceError::internal(format!("database: {db}")),
        None => unavailable(e),
    }
}

/// Runs one database call with the timeout.
pub(super) async fn timed<T>(f: impl std::future::Future<Output = Result<T, ServiceError>>) -> Result<T, ServiceError> {
    tokio::time::timeout(DB_TIMEOUT, f).await.map_err(|_| unavailable("no answer within 5 s"))?
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn json<T: serde::Serialize>(v: &T) -> Result<serde_json::Value, ServiceError> {
    serde_json::to_value(v).map_err(ServiceError::internal)
}
impl Shared {
    /// Connects lazily: nothing is asked of the database until [`Shared::run`] starts.
    pub fn new(cfg: SharedConfig, store: Arc<Store>, metrics: Arc<Metrics>, model: &crate::model::Model) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Handle::try_current().context("replicas need a tokio runtime")?;
        let blobs = store.blobs().cloned().context("replicas need a shared adapter store (--adapter-store)")?;
        let mut pg: tokio_postgres::Config =
            cfg.database_url.parse().context("--database-url: not a PostgreSQL connection string")?;
        pg.connect_timeout(Duration::from_secs(3));
        pg.application_name(&format!("lift-serve {}", cfg.replica));
        let manager = deadpool_postgres::Manager::from_config(
            pg,
            tokio_postgres::NoTls,
            deadpool_postgres::ManagerConfig { recycling_method: deadpool_postgres::RecyclingMethod::Fast },
        );
        let pool = deadpool_postgres::Pool::builder(manager)
            .max_size(8)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(3)))
            .create_timeout(Some(Duration::from_secs(3)))
            .recycle_timeout(Some(Duration::from_secs(3)))
            .build()
            .context("cannot build the database pool")?;
        let base = Base {
            fingerprint: model.info.fingerprint.clone(),
            name: crate::store::base_name(&crate::adapters::BaseModelRef::of(model)),
        };
        Ok(Self {
            pool,
            cfg,
            base,
            started_at: crate::store::now(),
            asked: Mutex::new(HashMap::new()),
            unreadable: Mutex::new(HashSet::new()),
            rebased: AtomicBool::new(false),
            store,
            blobs,
            metrics,
            runtime,
            migrated: AtomicBool::new(false),
            shutting_down: AtomicBool::new(false),
            running: Mutex::new(HashMap::new()),
            wake: tokio::sync::Notify::new(),
        })
    }

    pub fn role(&self) -> Role {
        self.cfg.role
    }

    pub fn blobs(&self) -> &Blobs {
        &self.blobs
    }

    pub(super) async fn client(&self) -> Result<deadpool_postgres::Object, ServiceError> {
        timed(async { self.pool.get().await.map_err(unavailable) }).await
    }

    /// The database answers and the schema is in place.
    pub async fn healthy(&self) -> Result<(), ServiceError> {
        if !self.migrated.load(Ordering::SeqCst) {
            return Err(unavailable("the schema is not in place yet"));
        }
        let c = self.client().await?;
        timed(async { c.simple_query("SELECT 1").await.map_err(db_error) }).await.map(drop)
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        if let Ok(running) = self.running.lock() {
            for r in running.values() {
                r.cancel.store(true, Ordering::SeqCst);
            }
        }
        self.wake.notify_one();
    }
}
