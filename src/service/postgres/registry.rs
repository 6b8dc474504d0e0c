//! The documents' rows (insert with their job, read, watch, delete, count) and the
//! [`Registry`] of replicas over them.

use super::{db_error, json, timed, to_i64, Shared};
use crate::document::Document;
use crate::engine::{Engine, JobProgress};
use crate::lift::AbsorbOptions;
use crate::service::records::view;
use crate::service::registry::{Registry, RegistryStats};
use crate::service::{DocumentView, Health, ServiceError, Submitted};
use crate::store::blobs::BlobRef;
use crate::store::{self, JobRecord, Status};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Jobs nobody holds: never claimed, handed back, or with a lease that ran out.
const WAITING_JOBS: &str = "SELECT count(*) FROM jobs WHERE lease_until IS NULL OR lease_until < now()";

pub(super) const DOC_COLUMNS: &str =
    "id, owner, title, status, tokens, created_at, seq, ready_at, error, adapter, options, source, training, progress, blob_sha256, requested, \
     base, base_name, reabsorbing_from, last_asked_at";

/// A `documents` row as the record the rest of the service knows, with its live progress and
/// the archive of its adapter.
pub(super) struct Row {
    pub(super) rec: JobRecord,
    progress: Option<JobProgress>,
    blob: Option<BlobRef>,
}

impl Row {
    /// The row as a replica over the base with fingerprint `base` sees it: a ready document whose
    /// adapter was made over another base is `queued` with `reabsorbing_from` (it answers from
    /// its passages until a trainer over this base absorbs it again: `rebase.rs`).
    pub(super) fn read(r: &tokio_postgres::Row, base: &str) -> Result<Self, ServiceError> {
        let get_json = |i: usize| -> Option<serde_json::Value> { r.get::<_, Option<serde_json::Value>>(i) };
        let status: String = r.get(3);
        let status: Status = serde_json::from_value(serde_json::Value::String(status)).map_err(ServiceError::internal)?;
        let mut rec = JobRecord {
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
            last_asked_at: r.get::<_, Option<i64>>(19).map(|t| t.max(0) as u64),
            reabsorbing_from: r.get(18),
        };
        let made_over: Option<String> = r.get(16);
        if rec.status == Status::Ready && made_over.as_deref().is_some_and(|b| b != base) {
            rec.status = Status::Queued;
            rec.reabsorbing_from = r.get::<_, Option<String>>(17).or(made_over);
        }
        let progress = get_json(13).and_then(|v| serde_json::from_value(v).ok());
        let blob = r.get::<_, Option<String>>(14).map(|sha256| BlobRef { sha256 });
        Ok(Self { rec, progress, blob })
    }

    fn view(&self) -> DocumentView {
        view(&self.rec, self.progress.as_ref())
    }
}

impl Shared {
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
                return Ok(Some(Row::read(&row, &self.base.fingerprint)?.view()));
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
                return Ok(Some(Row::read(&row, &self.base.fingerprint)?.view()));
            }
            tx.execute("INSERT INTO jobs (id, text, seq, base) VALUES ($1, $2, $3, $4)", &[id, &text, &seq, &self.base.fingerprint])
                .await
                .map_err(db_error)?;
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
        row.as_ref().map(|r| Row::read(r, &self.base.fingerprint)).transpose()
    }

    /// The document and the archive of its adapter (when ready).
    pub async fn document(&self, owner: Option<&str>, id: &str) -> Result<(DocumentView, Option<BlobRef>), ServiceError> {
        let row = self.row(owner, id).await?.ok_or_else(|| ServiceError::UnknownDocument(id.to_string()))?;
        // Only a ready adapter is loaded; the archive of one over another base (being absorbed
        // again, or whose re-absorb failed) is read for its text alone (`kept_text`).
        let loads = matches!(row.rec.status, Status::Ready | Status::Damaged);
        Ok((row.view(), row.blob.filter(|_| loads)))
    }

    /// The text of a document without a ready adapter over this base, for answering from its
    /// passages: its job's (queued or training), else its published archive's (an adapter over
    /// another base, waiting to be absorbed again or whose re-absorb failed); None when neither
    /// exists (a failed first absorb).
    pub async fn job_text(&self, id: &str) -> Result<Option<String>, ServiceError> {
        let c = self.client().await?;
        let row = timed(async {
            c.query_opt(
                "SELECT j.text, d.blob_sha256 FROM documents d LEFT JOIN jobs j ON j.id = d.id WHERE d.id = $1",
                &[&id],
            )
            .await
            .map_err(db_error)
        })
        .await?;
        let Some(row) = row else { return Ok(None) };
        if let Some(text) = row.get::<_, Option<String>>(0) {
            return Ok(Some(text));
        }
        let Some(sha256) = row.get::<_, Option<String>>(1) else { return Ok(None) };
        let (store, id) = (self.store.clone(), id.to_string());
        let text = tokio::task::spawn_blocking(move || store.archived_text(&id, &BlobRef { sha256 }))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::internal(format!("cannot read the document from its adapter's archive: {e:#}")))?;
        Ok(Some(text))
    }

    pub async fn documents(&self, owner: Option<&str>) -> Result<Vec<DocumentView>, ServiceError> {
        let c = self.client().await?;
        let sql = format!("SELECT {DOC_COLUMNS} FROM documents WHERE owner IS NOT DISTINCT FROM $1 ORDER BY seq, id");
        let rows = timed(async { c.query(&sql, &[&owner]).await.map_err(db_error) }).await?;
        rows.iter().map(|r| Row::read(r, &self.base.fingerprint).map(|r| r.view())).collect()
    }

    pub async fn documents_among(&self, owner: Option<&str>, ids: &[String]) -> Result<Vec<DocumentView>, ServiceError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let c = self.client().await?;
        let sql = format!("SELECT {DOC_COLUMNS} FROM documents WHERE owner IS NOT DISTINCT FROM $1 AND id = ANY($2)");
        let rows = timed(async { c.query(&sql, &[&owner, &ids]).await.map_err(db_error) }).await?;
        rows.iter().map(|r| Row::read(r, &self.base.fingerprint).map(|r| r.view())).collect()
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
            self.forget_archive(id, sha256).await?;
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

    /// Deletes the archive `sha256` (once `id`'s) from the blob store unless another document
    /// still names it.
    pub(super) async fn forget_archive(&self, id: &str, sha256: String) -> Result<(), ServiceError> {
        let c = self.client().await?;
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

    fn documents_among<'a>(
        &'a self,
        owner: Option<&'a str>,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<DocumentView>, ServiceError>> {
        Shared::documents_among(self, owner, ids).boxed()
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

    /// Written at most once a minute for a document by each replica (the order of re-absorbs
    /// after a base upgrade needs minutes, not every question).
    fn asked(&self, id: &str) {
        let now = store::now();
        if let Ok(mut asked) = self.asked.lock() {
            if asked.get(id).is_some_and(|&t| now < t + 60) {
                return;
            }
            asked.insert(id.to_string(), now);
        }
        let (pool, id) = (self.pool.clone(), id.to_string());
        self.runtime.spawn(async move {
            let written = async {
                let c = pool.get().await.map_err(|e| e.to_string())?;
                c.execute("UPDATE documents SET last_asked_at = $2 WHERE id = $1", &[&id, &to_i64(now)]).await.map_err(|e| e.to_string())
            };
            if let Ok(Err(e)) | Err(e) = tokio::time::timeout(std::time::Duration::from_secs(5), written).await.map_err(|e| e.to_string()) {
                tracing::debug!(id, error = %e, "cannot record when the document was asked");
            }
        });
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
