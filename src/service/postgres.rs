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

use super::records::view;
use super::registry::{Registry, RegistryStats};
use super::{DocumentView, Health, ServiceError, Submitted};
use crate::document::Document;
use crate::engine::{AbsorbJob, AbsorbOutcome, Engine, JobEvents, JobProgress, JobUpdate};
use crate::lift::AbsorbOptions;
use crate::metrics::Metrics;
use crate::model::generate::Generation;
use crate::model::Model;
use crate::store::blobs::{self, BlobRef, Blobs};
use crate::store::{self, AdapterInfo, JobRecord, Status, Store};
use anyhow::Context;
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use std::collections::HashMap;
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

/// Versioned schema migrations, applied in order at start (under an advisory lock, so that
/// replicas starting together apply each once). Never edit one that shipped: add the next.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
    "CREATE TABLE documents (
        id text PRIMARY KEY,
        owner text,
        title text,
        status text NOT NULL,
        tokens bigint NOT NULL,
        created_at bigint NOT NULL,
        seq bigint NOT NULL,
        ready_at bigint,
        error text,
        adapter jsonb,
        options jsonb NOT NULL,
        source jsonb,
        training jsonb,
        progress jsonb,
        blob_sha256 text,
        updated_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE INDEX documents_by_owner ON documents (owner, seq, id);
    CREATE TABLE jobs (
        id text PRIMARY KEY REFERENCES documents (id) ON DELETE CASCADE,
        text text NOT NULL,
        seq bigint NOT NULL,
        replica text,
        lease_until timestamptz,
        attempts integer NOT NULL DEFAULT 0,
        claimed_at timestamptz
    );
    CREATE INDEX jobs_in_order ON jobs (seq, id);",
    ),
    // The options as asked, which ids are made of (`JobRecord::requested`); NULL in rows written
    // before: their id is of `options`.
    (2, "ALTER TABLE documents ADD COLUMN requested jsonb;"),
    // Collections (`collection_pg`): a member row goes with its document (ON DELETE CASCADE).
    (
        3,
        "CREATE TABLE collections (
        id text PRIMARY KEY,
        owner text,
        title text,
        created_at bigint NOT NULL,
        updated_at bigint NOT NULL
    );
    CREATE INDEX collections_by_owner ON collections (owner, created_at, id);
    CREATE TABLE collection_documents (
        collection_id text NOT NULL REFERENCES collections (id) ON DELETE CASCADE,
        document_id text NOT NULL REFERENCES documents (id) ON DELETE CASCADE,
        position bigint NOT NULL,
        PRIMARY KEY (collection_id, document_id)
    );
    CREATE INDEX collection_documents_by_document ON collection_documents (document_id);",
    ),
];

/// Jobs nobody holds: never claimed, handed back, or with a lease that ran out.
const WAITING_JOBS: &str = "SELECT count(*) FROM jobs WHERE lease_until IS NULL OR lease_until < now()";

const DOC_COLUMNS: &str =
    "id, owner, title, status, tokens, created_at, seq, ready_at, error, adapter, options, source, training, progress, blob_sha256, requested";

/// A job this replica is training.
struct Running {
    attempt: i32,
    cancel: Arc<AtomicBool>,
    progress: Mutex<Option<JobProgress>>,
    /// Set when the lease was lost: the job is another replica's now.
    lost: AtomicBool,
}

pub struct Shared {
    pool: deadpool_postgres::Pool,
    cfg: SharedConfig,
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

/// A `documents` row as the record the rest of the service knows, with its live progress and
/// the archive of its adapter.
struct Row {
    rec: JobRecord,
    progress: Option<JobProgress>,
    blob: Option<BlobRef>,
}

impl Row {
    fn read(r: &tokio_postgres::Row) -> Result<Self, ServiceError> {
        let get_json = |i: usize| -> Option<serde_json::Value> { r.get::<_, Option<serde_json::Value>>(i) };
        let status: String = r.get(3);
        let status: Status = serde_json::from_value(serde_json::Value::String(status)).map_err(ServiceError::internal)?;
        let rec = JobRecord {
            id: r.get(0),
            owner: r.get(1),
            title: r.get(2),
            status,
            tokens: r.get::<_, i64>(4).max(0) as usize,
            created_at: r.get::<_, i64>(5).max(0) as u64,
            seq: r.get::<_, i64>(6).max(0) as u64,
            ready_at: r.get::<_, Option<i64>>(7).map(|t| t.max(0) as u64),
            error: r.get(8),
            adapter: get_json(9).and_then(|v| serde_json::from_value(v).ok()),
            options: get_json(10).unwrap_or(serde_json::Value::Null),
            requested: get_json(15),
            source: get_json(11).and_then(|v| serde_json::from_value(v).ok()),
            training: get_json(12),
        };
        let progress = get_json(13).and_then(|v| serde_json::from_value(v).ok());
        let blob = r.get::<_, Option<String>>(14).map(|sha256| BlobRef { sha256 });
        Ok(Self { rec, progress, blob })
    }

    fn view(&self) -> DocumentView {
        view(&self.rec, self.progress.as_ref())
    }
}

/// A job this replica claimed.
struct Claimed {
    id: String,
    text: String,
    attempt: i32,
    stolen: bool,
}

impl Shared {
    /// Connects lazily: nothing is asked of the database until [`Shared::run`] starts.
    pub fn new(cfg: SharedConfig, store: Arc<Store>, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
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
        Ok(Self {
            pool,
            cfg,
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

    /// Applies the migrations this database lacks.
    async fn migrate(&self) -> Result<(), ServiceError> {
        let mut c = self.client().await?;
        timed(async {
            let tx = c.transaction().await.map_err(db_error)?;
            // One replica at a time (released at commit); the key is arbitrary but fixed.
            tx.execute("SELECT pg_advisory_xact_lock(7150432117)", &[]).await.map_err(db_error)?;
            tx.batch_execute("CREATE TABLE IF NOT EXISTS lift_schema (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
                .await
                .map_err(db_error)?;
            let row = tx.query_one("SELECT coalesce(max(version), 0) FROM lift_schema", &[]).await.map_err(db_error)?;
            let have: i32 = row.get(0);
            for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > have) {
                tx.batch_execute(sql).await.map_err(db_error)?;
                tx.execute("INSERT INTO lift_schema (version) VALUES ($1)", &[version]).await.map_err(db_error)?;
                tracing::info!(version, "database migration applied");
            }
            tx.commit().await.map_err(db_error)
        })
        .await?;
        self.migrated.store(true, Ordering::SeqCst);
        Ok(())
    }

    // ---------- documents ----------

    /// Inserts the document and its job, or finds the document already queued, training or
    /// ready under this id (a failed, cancelled or damaged one is queued again). `max_waiting` bounds the jobs nobody trains yet, across replicas.
    pub async fn submit(&self, rec: JobRecord, text: &str, max_waiting: usize) -> Result<Submitted, ServiceError> {
        let mut c = self.client().await?;
        let (owner, title, id) = (&rec.owner, &rec.title, &rec.id);
        let (tokens, created, seq) = (to_i64(rec.tokens as u64), to_i64(rec.created_at), to_i64(rec.seq));
        let (options, source) = (&rec.options, json(&rec.source)?);
        let inserted = timed(async {
            let tx = c.transaction().await.map_err(db_error)?;
            let existing = tx.query_opt(&format!("SELECT {DOC_COLUMNS} FROM documents WHERE id = $1 AND status IN ('queued', 'training', 'ready')"), &[id]).await.map_err(db_error)?;
            if let Some(row) = existing {
                return Ok(Some(Row::read(&row)?.view()));
            }
            let waiting: i64 = tx
                .query_one(WAITING_JOBS, &[])
                .await
                .map_err(db_error)?
                .get(0);
            if waiting >= to_i64(max_waiting as u64) {
                return Err(ServiceError::QueueFull);
            }
            let row = tx
                .query_opt(
                    "INSERT INTO documents (id, owner, title, status, tokens, created_at, seq, options, source, requested)
                     VALUES ($1, $2, $3, 'queued', $4, $5, $6, $7, $8, $9)
                     ON CONFLICT (id) DO UPDATE SET title = EXCLUDED.title, status = 'queued', created_at = EXCLUDED.created_at,
                         seq = EXCLUDED.seq, ready_at = NULL, error = NULL, adapter = NULL, training = NULL, progress = NULL,
                         source = EXCLUDED.source, blob_sha256 = NULL, options = EXCLUDED.options,
                         requested = EXCLUDED.requested, updated_at = now()
                     WHERE documents.status IN ('failed', 'cancelled', 'damaged')
                     RETURNING id",
                    &[id, owner, title, &tokens, &created, &seq, options, &source, &rec.requested],
                )
                .await
                .map_err(db_error)?;
            if row.is_none() {
                // Another replica inserted it meanwhile (this insert waited for its commit).
                let row = tx.query_one(&format!("SELECT {DOC_COLUMNS} FROM documents WHERE id = $1"), &[id]).await.map_err(db_error)?;
                return Ok(Some(Row::read(&row)?.view()));
            }
            tx.execute("INSERT INTO jobs (id, text, seq) VALUES ($1, $2, $3)", &[id, &text, &seq]).await.map_err(db_error)?;
            tx.commit().await.map_err(db_error)?;
            Ok(None)
        })
        .await?;
        match inserted {
            Some(view) => Ok(Submitted::Existing(view)),
            None => {
                self.wake.notify_one();
                Ok(Submitted::Queued(view(&rec, None)))
            }
        }
    }

    async fn row(&self, owner: Option<&str>, id: &str) -> Result<Option<Row>, ServiceError> {
        let c = self.client().await?;
        let sql = format!("SELECT {DOC_COLUMNS} FROM documents WHERE id = $1 AND owner IS NOT DISTINCT FROM $2");
        let row = timed(async { c.query_opt(&sql, &[&id, &owner]).await.map_err(db_error) }).await?;
        row.as_ref().map(Row::read).transpose()
    }

    /// The document and the archive of its adapter (when ready).
    pub async fn document(&self, owner: Option<&str>, id: &str) -> Result<(DocumentView, Option<BlobRef>), ServiceError> {
        let row = self.row(owner, id).await?.ok_or_else(|| ServiceError::UnknownDocument(id.to_string()))?;
        Ok((row.view(), row.blob))
    }

    /// The text of a document whose job has not ended (its row in the queue), for answering
    /// from its passages before its adapter is published; None once the job has ended.
    pub async fn job_text(&self, id: &str) -> Result<Option<String>, ServiceError> {
        let c = self.client().await?;
        let row = timed(async { c.query_opt("SELECT text FROM jobs WHERE id = $1", &[&id]).await.map_err(db_error) }).await?;
        Ok(row.map(|r| r.get(0)))
    }

    pub async fn documents(&self, owner: Option<&str>) -> Result<Vec<DocumentView>, ServiceError> {
        let c = self.client().await?;
        let sql = format!("SELECT {DOC_COLUMNS} FROM documents WHERE owner IS NOT DISTINCT FROM $1 ORDER BY seq, id");
        let rows = timed(async { c.query(&sql, &[&owner]).await.map_err(db_error) }).await?;
        rows.iter().map(|r| Row::read(r).map(|r| r.view())).collect()
    }

    /// Updates of the document's view for event streams, read from its row every `poll` (the
    /// job may train on another replica). The channel closes when the document is deleted.
    pub async fn watch(
        self: &Arc<Self>,
        owner: Option<&str>,
        id: &str,
    ) -> Result<tokio::sync::watch::Receiver<DocumentView>, ServiceError> {
        let (first, _) = self.document(owner, id).await?;
        let (tx, rx) = tokio::sync::watch::channel(first);
        let (me, owner, id) = (self.clone(), owner.map(str::to_string), id.to_string());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(me.cfg.poll) => {}
                }
                match me.row(owner.as_deref(), &id).await {
                    Ok(Some(row)) => {
                        let v = row.view();
                        tx.send_if_modified(|old| (*old != v).then(|| *old = v).is_some());
                        if row.rec.status.is_terminal() {
                            // Terminal: the stream ends after this view; keep the sender until
                            // the reader is done with it.
                            tx.closed().await;
                            return;
                        }
                    }
                    Ok(None) => return, // deleted: dropping the sender ends the stream
                    Err(e) => tracing::debug!(id, error = %e, "event stream: the database is away; retrying"),
                }
            }
        });
        Ok(rx)
    }

    /// Deletes the document (its job goes with it; a replica training it loses its lease at the
    /// next renewal, this one stops at once), its local copy and its archive.
    pub async fn delete(&self, owner: Option<&str>, id: &str) -> Result<(), ServiceError> {
        let c = self.client().await?;
        let row = timed(async {
            c.query_opt("DELETE FROM documents WHERE id = $1 AND owner IS NOT DISTINCT FROM $2 RETURNING blob_sha256", &[&id, &owner])
                .await
                .map_err(db_error)
        })
        .await?
        .ok_or_else(|| ServiceError::UnknownDocument(id.to_string()))?;
        if let Some(r) = self.running.lock().map_err(ServiceError::poisoned)?.get(id) {
            r.cancel.store(true, Ordering::SeqCst);
        }
        if let Some(sha256) = row.get::<_, Option<String>>(0) {
            let still_used = timed(async {
                c.query_opt("SELECT 1 FROM documents WHERE blob_sha256 = $1 LIMIT 1", &[&sha256]).await.map_err(db_error)
            })
            .await?
            .is_some();
            if !still_used {
                if let Err(e) = self.blobs.delete(&BlobRef { sha256 }).await {
                    tracing::warn!(id, error = %e, "cannot delete the adapter archive; it stays in the store");
                }
            }
        }
        if let Err(e) = self.blobs.delete_checkpoint(id).await {
            tracing::warn!(id, error = %e, "cannot delete the absorb's checkpoint; it stays in the store");
        }
        let (store, id2) = (self.store.clone(), id.to_string());
        tokio::task::spawn_blocking(move || store.delete(&id2))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::internal(format!("cannot delete the local copy: {e:#}")))?;
        Ok(())
    }

    /// Documents by status, and jobs waiting for a trainer (all replicas).
    pub async fn counts(&self) -> Result<(HashMap<Status, usize>, usize), ServiceError> {
        let c = self.client().await?;
        let rows = timed(async { c.query("SELECT status, count(*) FROM documents GROUP BY status", &[]).await.map_err(db_error) }).await?;
        let mut by_status = HashMap::new();
        for r in rows {
            let status: String = r.get(0);
            if let Ok(s) = serde_json::from_value::<Status>(serde_json::Value::String(status)) {
                by_status.insert(s, r.get::<_, i64>(1).max(0) as usize);
            }
        }
        let waiting: i64 = timed(async {
            c.query_one(WAITING_JOBS, &[]).await.map_err(db_error)
        })
        .await?
        .get(0);
        Ok((by_status, waiting.max(0) as usize))
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

    // ---------- the queue ----------

    /// Runs in the background for the replica's life: puts the schema in place (retrying while
    /// the database is away), then, on a replica that trains, claims jobs whenever its training
    /// lane is free.
    pub async fn run(self: Arc<Self>, engine: Arc<Engine>) {
        let mut backoff = Duration::from_millis(200);
        while let Err(e) = self.migrate().await {
            if self.shutting_down.load(Ordering::SeqCst) {
                return;
            }
            tracing::warn!(error = %e, retry_ms = backoff.as_millis() as u64, "cannot reach the database yet");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
        if !self.cfg.role.trains() {
            return;
        }
        tracing::info!(replica = %self.cfg.replica, lease_s = self.cfg.lease.as_secs_f64(), "trainer ready: claiming jobs");
        while !self.shutting_down.load(Ordering::SeqCst) {
            let busy = engine.train_queue() != (0, 0) || self.running.lock().map_or(true, |r| !r.is_empty());
            let pause = if busy {
                self.cfg.poll
            } else {
                match self.claim().await {
                    Ok(Some(job)) => {
                        self.start(job, &engine).await;
                        continue;
                    }
                    Ok(None) => self.cfg.poll,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot claim a job");
                        self.cfg.poll.max(Duration::from_secs(1))
                    }
                }
            };
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Claims the oldest job whose lease is free or has run out.
    async fn claim(&self) -> Result<Option<Claimed>, ServiceError> {
        let c = self.client().await?;
        let lease = self.cfg.lease.as_secs_f64();
        let row = timed(async {
            c.query_opt(
                "WITH next AS (
                     SELECT id, replica AS previous FROM jobs
                     WHERE lease_until IS NULL OR lease_until < now()
                     ORDER BY seq, id
                     LIMIT 1
                     FOR UPDATE SKIP LOCKED
                 )
                 UPDATE jobs j SET replica = $1, lease_until = now() + make_interval(secs => $2),
                     attempts = j.attempts + 1, claimed_at = now()
                 FROM next WHERE j.id = next.id
                 RETURNING j.id, j.text, j.attempts, next.previous",
                &[&self.cfg.replica, &lease],
            )
            .await
            .map_err(db_error)
        })
        .await?;
        Ok(row.map(|r| Claimed { id: r.get(0), text: r.get(1), attempt: r.get(2), stolen: r.get::<_, Option<String>>(3).is_some() }))
    }

    /// Starts a claimed job on the training lane, with its lease renewer.
    async fn start(self: &Arc<Self>, job: Claimed, engine: &Arc<Engine>) {
        let Claimed { id, text, attempt, stolen } = job;
        self.metrics.job_claimed(stolen);
        tracing::info!(id, attempt, stolen, replica = %self.cfg.replica, "job claimed");
        let running = Arc::new(Running {
            attempt,
            cancel: Arc::new(AtomicBool::new(false)),
            progress: Mutex::new(None),
            lost: AtomicBool::new(false),
        });
        if attempt > self.cfg.max_attempts {
            let why = format!(
                "gave up after {} attempts: every replica that trained it stopped before the end (killed or crashed)",
                attempt - 1
            );
            self.end_with_retries(&id, &running, Ending::Failed(why)).await;
            return;
        }
        let job = match self.prepare(&id, text, engine.model.clone(), &running).await {
            Ok(job) => job,
            Err(why) => {
                self.end_with_retries(&id, &running, Ending::Failed(why)).await;
                return;
            }
        };
        if let Ok(mut r) = self.running.lock() {
            r.insert(id.clone(), running.clone());
        }
        if let Err(e) = engine.queue_absorb(job) {
            tracing::warn!(id, error = %e, "the training lane refused a claimed job; releasing it");
            if let Ok(mut r) = self.running.lock() {
                r.remove(&id);
            }
            self.end_with_retries(&id, &running, Ending::Release).await;
            return;
        }
        tokio::spawn(self.clone().renew_lease(id, running));
    }

    /// The absorb job of a claimed row: its record from the database, the text checked against
    /// the id (same text, options, owner and base model), tokenized.
    async fn prepare(&self, id: &str, text: String, model: Arc<Model>, running: &Running) -> Result<AbsorbJob, String> {
        let c = self.client().await.map_err(|e| e.to_string())?;
        let sql = format!("SELECT {DOC_COLUMNS} FROM documents WHERE id = $1");
        let row = timed(async { c.query_opt(&sql, &[&id]).await.map_err(db_error) }).await.map_err(|e| e.to_string())?;
        let rec = Row::read(&row.ok_or("the document was deleted")?).map_err(|e| e.to_string())?.rec;
        let options = serde_json::from_value::<AbsorbOptions>(rec.options.clone()).map_err(|e| format!("its options no longer parse ({e})"))?;
        if store::document_id(&model.info.fingerprint, rec.owner.as_deref(), &text, rec.id_options()) != rec.id {
            return Err("its text, options or base model do not match its id (a replica with another base model?)".into());
        }
        let document = tokio::task::spawn_blocking(move || super::encode_answerable(&model, text))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("its text cannot be tokenized ({e:#})"))?;
        self.store.put_live(&rec.id, document.clone());
        Ok(AbsorbJob {
            id: rec.id,
            document,
            title: rec.title,
            source: rec.source,
            options,
            cancel: running.cancel.clone(),
            // The shared queue is the database's: a job reaches this lane only to run.
            place: Default::default(),
        })
    }

    /// Renews the lease of a running job and publishes its progress, every third of the lease
    /// (at most a second apart, so that event streams on other replicas move). Stops the job when
    /// the lease is lost.
    async fn renew_lease(self: Arc<Self>, id: String, running: Arc<Running>) {
        let tick = (self.cfg.lease / 3).min(Duration::from_secs(1));
        loop {
            tokio::time::sleep(tick).await;
            let still_here = self.running.lock().is_ok_and(|r| r.get(&id).is_some_and(|x| Arc::ptr_eq(x, &running)));
            if !still_here {
                return;
            }
            let progress = running.progress.lock().ok().and_then(|p| p.clone());
            match self.renew(&id, running.attempt, progress.as_ref()).await {
                Ok(true) => self.metrics.lease_renewed(),
                Ok(false) => {
                    tracing::warn!(id, attempt = running.attempt, "lease lost (deleted, or taken over): stopping the job");
                    running.lost.store(true, Ordering::SeqCst);
                    running.cancel.store(true, Ordering::SeqCst);
                    self.metrics.lease_lost();
                    return;
                }
                Err(e) => tracing::warn!(id, error = %e, "cannot renew the lease; training on and retrying"),
            }
        }
    }

    async fn renew(&self, id: &str, attempt: i32, progress: Option<&JobProgress>) -> Result<bool, ServiceError> {
        let c = self.client().await?;
        let lease = self.cfg.lease.as_secs_f64();
        let progress = progress.map(json).transpose()?;
        timed(async {
            let n = c
                .execute(
                    "UPDATE jobs SET lease_until = now() + make_interval(secs => $3) WHERE id = $1 AND attempts = $2 AND replica = $4",
                    &[&id, &attempt, &lease, &self.cfg.replica],
                )
                .await
                .map_err(db_error)?;
            if n == 1 && progress.is_some() {
                c.execute("UPDATE documents SET progress = $2, updated_at = now() WHERE id = $1", &[&id, &progress])
                    .await
                    .map_err(db_error)?;
            }
            Ok(n == 1)
        })
        .await
    }

    /// Ends a job this replica holds: publishes its adapter, fails it, or hands it back. Returns
    /// false when the job is no longer this replica's (nothing was written).
    async fn end(&self, id: &str, attempt: i32, ending: &Ending) -> Result<bool, ServiceError> {
        let mut c = self.client().await?;
        timed(async {
            let tx = c.transaction().await.map_err(db_error)?;
            let held = tx
                .query_opt("SELECT 1 FROM jobs WHERE id = $1 AND attempts = $2 AND replica = $3 FOR UPDATE", &[&id, &attempt, &self.cfg.replica])
                .await
                .map_err(db_error)?;
            if held.is_none() {
                return Ok(false);
            }
            match ending {
                Ending::Ready { blob, adapter, training } => {
                    tx.execute(
                        "UPDATE documents SET status = 'ready', ready_at = $2, adapter = $3, training = $4, blob_sha256 = $5,
                             progress = NULL, error = NULL, updated_at = now() WHERE id = $1",
                        &[&id, &to_i64(store::now()), &json(adapter)?, training, &blob.sha256],
                    )
                    .await
                    .map_err(db_error)?;
                    tx.execute("DELETE FROM jobs WHERE id = $1", &[&id]).await.map_err(db_error)?;
                }
                Ending::Failed(why) => {
                    tx.execute(
                        "UPDATE documents SET status = 'failed', error = $2, progress = NULL, updated_at = now() WHERE id = $1",
                        &[&id, why],
                    )
                    .await
                    .map_err(db_error)?;
                    tx.execute("DELETE FROM jobs WHERE id = $1", &[&id]).await.map_err(db_error)?;
                }
                Ending::Release => {
                    // Not a failed attempt (a shutdown, a full lane): the next claim is not counted.
                    tx.execute(
                        "UPDATE jobs SET replica = NULL, lease_until = NULL, attempts = attempts - 1 WHERE id = $1",
                        &[&id],
                    )
                    .await
                    .map_err(db_error)?;
                    tx.execute("UPDATE documents SET status = 'queued', progress = NULL, updated_at = now() WHERE id = $1", &[&id])
                        .await
                        .map_err(db_error)?;
                }
            }
            tx.commit().await.map_err(db_error)?;
            Ok(true)
        })
        .await
    }

    /// [`Shared::end`], retried while the database is away (the work is done; losing it for a
    /// restart of PostgreSQL would be a waste). Gives up when the replica shuts down: the lease
    /// then runs out and another replica trains the document again.
    async fn end_with_retries(&self, id: &str, running: &Running, ending: Ending) -> bool {
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.end(id, running.attempt, &ending).await {
                Ok(done) => return done,
                Err(ServiceError::Unavailable(e)) if !self.shutting_down.load(Ordering::SeqCst) => {
                    tracing::warn!(id, error = %e, retry_ms = backoff.as_millis() as u64, "cannot end the job yet; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    tracing::error!(id, error = %e, "cannot end the job; its lease will run out and another replica retrains it");
                    return false;
                }
            }
        }
    }

    /// A finished absorb (on the engine's training thread): publish, fail or hand back.
    fn finished(&self, id: &str, running: &Running, outcome: AbsorbOutcome) {
        let lost = || running.lost.load(Ordering::SeqCst);
        match outcome {
            AbsorbOutcome::Ready { adapter, training, tokens_per_s, seconds } if !lost() => {
                let published = self.publish(id, running, adapter, training);
                match published {
                    Ok(true) => {
                        self.metrics.job("ready", Some(tokens_per_s));
                        tracing::info!(id, seconds, "document ready (published to the shared store)");
                    }
                    Ok(false) => self.drop_local(id, "the job was taken over or deleted before it was published"),
                    Err(e) => {
                        tracing::error!(id, error = %e, "cannot publish the adapter");
                        self.drop_local(id, "not published");
                    }
                }
            }
            AbsorbOutcome::Ready { .. } => self.drop_local(id, "the lease was lost"),
            AbsorbOutcome::Failed(msg) if !lost() => {
                tracing::warn!(id, error = %msg, "training failed");
                self.runtime.block_on(self.end_with_retries(id, running, Ending::Failed(msg)));
                self.metrics.job("failed", None);
            }
            AbsorbOutcome::Cancelled { .. } if self.shutting_down.load(Ordering::SeqCst) && !lost() => {
                tracing::warn!(id, "training interrupted by the shutdown; the job goes back to the shared queue");
                self.runtime.block_on(self.end_with_retries(id, running, Ending::Release));
                self.metrics.job("interrupted", None);
            }
            _ => self.metrics.job("cancelled", None),
        }
    }

    /// Packs the saved adapter, writes its archive and publishes it in the database.
    fn publish(&self, id: &str, running: &Running, adapter: AdapterInfo, training: serde_json::Value) -> anyhow::Result<bool> {
        let archive = blobs::pack(&self.store.adapter_dir(id))?;
        let blob = self.runtime.block_on(self.blobs.put(archive.into()))?;
        let done = self.runtime.block_on(self.end_with_retries(id, running, Ending::Ready { blob: blob.clone(), adapter, training }));
        if done {
            self.store.note_blob(id, &blob)?;
        }
        Ok(done)
    }

    /// Removes this replica's copy of an adapter it trained but did not publish.
    fn drop_local(&self, id: &str, why: &str) {
        tracing::warn!(id, why, "adapter not published; local copy removed");
        if let Err(e) = self.store.delete(id) {
            tracing::warn!(id, error = %e, "cannot remove the local copy");
        }
        self.metrics.job("cancelled", None);
    }

    fn running(&self, id: &str, cancel: &Arc<AtomicBool>) -> Option<Arc<Running>> {
        self.running.lock().ok()?.get(id).filter(|r| Arc::ptr_eq(&r.cancel, cancel)).cloned()
    }
}

enum Ending {
    Ready { blob: BlobRef, adapter: AdapterInfo, training: serde_json::Value },
    Failed(String),
    Release,
}

/// The registry of replicas: every call asks the database (503 while it is away).
impl Registry for Shared {
    fn answers(&self) -> bool {
        self.role().answers()
    }

    fn health(&self) -> BoxFuture<'_, Health> {
        async move {
            match self.healthy().await {
                Ok(()) => Health::Ok,
                Err(e) => Health::DatabaseUnavailable(e.to_string()),
            }
        }
        .boxed()
    }

    fn is_shutting_down(&self) -> bool {
        Shared::is_shutting_down(self)
    }

    fn begin_shutdown(&self) {
        Shared::begin_shutdown(self)
    }

    /// Inserts the document and its job in the shared queue (a trainer replica claims it).
    fn submit<'a>(
        &'a self,
        _engine: &'a Engine,
        rec: JobRecord,
        document: Arc<Document>,
        _options: AbsorbOptions,
        max_waiting: usize,
    ) -> BoxFuture<'a, Result<Submitted, ServiceError>> {
        async move {
            let (id, tokens) = (rec.id.clone(), rec.tokens);
            let submitted = Shared::submit(self, rec, &document.text, max_waiting).await?;
            if let Submitted::Queued(_) = submitted {
                // A damaged adapter's local copy goes: until the new one is published the
                // document answers from its passages.
                let (store, id2) = (self.store.clone(), id.clone());
                tokio::task::spawn_blocking(move || store.discard_adapter(&id2))
                    .await
                    .map_err(ServiceError::internal)?
                    .map_err(|e| ServiceError::internal(format!("cannot remove the damaged adapter: {e:#}")))?;
                self.store.put_live(&id, document);
                tracing::info!(id, tokens, "document queued (shared queue)");
            }
            Ok(submitted)
        }
        .boxed()
    }

    fn document<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<(DocumentView, Option<BlobRef>), ServiceError>> {
        Shared::document(self, owner, id).boxed()
    }

    fn documents<'a>(&'a self, owner: Option<&'a str>) -> BoxFuture<'a, Result<Vec<DocumentView>, ServiceError>> {
        Shared::documents(self, owner).boxed()
    }

    fn watch<'a>(
        self: Arc<Self>,
        owner: Option<&'a str>,
        id: &'a str,
    ) -> BoxFuture<'a, Result<tokio::sync::watch::Receiver<DocumentView>, ServiceError>> {
        async move { Shared::watch(&self, owner, id).await }.boxed()
    }

    fn delete<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>> {
        Shared::delete(self, owner, id).boxed()
    }

    /// The text kept in the document's job row, until its job ends.
    fn kept_text<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<String>, ServiceError>> {
        self.job_text(id).boxed()
    }

    /// The archive itself failed its hash (a local copy that did is fetched again first:
    /// `Store::get`): every replica sees the document damaged.
    fn mark_damaged<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>> {
        async move {
            let c = self.client().await?;
            let message = store::damaged_message(id);
            timed(async {
                c.execute(
                    "UPDATE documents SET status = 'damaged', error = $2, updated_at = now() WHERE id = $1 AND status = 'ready'",
                    &[&id, &message],
                )
                .await
                .map_err(db_error)
            })
            .await?;
            Ok(())
        }
        .boxed()
    }

    /// Every replica's documents; the shared queue's waiting jobs (unknown while the database
    /// is away); the blob store's traffic.
    fn stats(&self) -> BoxFuture<'_, RegistryStats> {
        async move {
            let mut stats = RegistryStats::default();
            if let Ok((counts, waiting)) = self.counts().await {
                stats.documents = counts;
                stats.waiting = Some(waiting);
            }
            stats.blob_puts = self.blobs().stats.puts.load(Ordering::Relaxed);
            stats.blob_fetches = self.blobs().stats.fetches.load(Ordering::Relaxed);
            stats
        }
        .boxed()
    }
}

impl JobEvents for Shared {
    fn absorb(&self, id: &str, cancel: &Arc<AtomicBool>, update: JobUpdate) {
        let Some(running) = self.running(id, cancel) else { return };
        match update {
            JobUpdate::Started => {
                let attempt = running.attempt;
                let r = self.runtime.block_on(async {
                    let c = self.client().await?;
                    timed(async {
                        c.execute(
                            "UPDATE documents SET status = 'training', progress = NULL, updated_at = now()
                             WHERE id = $1 AND EXISTS (SELECT 1 FROM jobs WHERE id = $1 AND attempts = $2)",
                            &[&id, &attempt],
                        )
                        .await
                        .map_err(db_error)
                    })
                    .await
                });
                if let Err(e) = r {
                    tracing::warn!(id, error = %e, "cannot mark the document training");
                }
            }
            JobUpdate::Progress(p) => {
                if let Ok(mut slot) = running.progress.lock() {
                    *slot = Some(p);
                }
            }
            JobUpdate::Finished(outcome) => {
                self.finished(id, &running, outcome);
                if let Ok(mut r) = self.running.lock() {
                    r.remove(id);
                }
                self.wake.notify_one();
            }
        }
    }

    fn generated(&self, g: &Generation) {
        self.metrics.generation(g.finish_reason.name(), g.prompt_ms / 1000.0, g.tokens.len(), g.generate_ms / 1000.0);
    }

    fn batch(&self, sequences: usize) {
        self.metrics.batch_step(sequences);
    }
}
