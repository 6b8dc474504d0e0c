//! The job queue: the trainer loop that claims the oldest free job, the lease renewed while it
//! trains (with its progress), and the end of a job — its adapter published, failed or handed back.

use super::registry::{Row, DOC_COLUMNS};
use super::{db_error, json, timed, to_i64, Running, Shared};
use crate::engine::{AbsorbJob, AbsorbOutcome, Engine, JobEvents, JobProgress, JobUpdate};
use crate::lift::AbsorbOptions;
use crate::model::generate::Generation;
use crate::model::Model;
use crate::service::ServiceError;
use crate::store::blobs::{self, BlobRef};
use crate::store::{self, AdapterInfo};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A job this replica claimed.
struct Claimed {
    id: String,
    text: String,
    attempt: i32,
    stolen: bool,
}

impl Shared {
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
                    // Nothing posted waits: the next document over another base, if any.
                    Ok(None) => match self.queue_next_reabsorb().await {
                        Ok(true) => continue,
                        Ok(false) => self.cfg.poll,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot look for documents over another base");
                            self.cfg.poll.max(Duration::from_secs(1))
                        }
                    },
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

    /// Claims the oldest job whose lease is free or has run out, among those this replica's base
    /// may train.
    async fn claim(&self) -> Result<Option<Claimed>, ServiceError> {
        let c = self.client().await?;
        let lease = self.cfg.lease.as_secs_f64();
        let row = timed(async {
            c.query_opt(
                "WITH next AS (
                     SELECT id, replica AS previous FROM jobs
                     WHERE (lease_until IS NULL OR lease_until < now()) AND (base IS NULL OR base = $3)
                     ORDER BY seq, id
                     LIMIT 1
                     FOR UPDATE SKIP LOCKED
                 )
                 UPDATE jobs j SET replica = $1, lease_until = now() + make_interval(secs => $2),
                     attempts = j.attempts + 1, claimed_at = now()
                 FROM next WHERE j.id = next.id
                 RETURNING j.id, j.text, j.attempts, next.previous",
                &[&self.cfg.replica, &lease, &self.base.fingerprint],
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
        let rec = Row::read(&row.ok_or("the document was deleted")?, &self.base.fingerprint).map_err(|e| e.to_string())?.rec;
        let options = serde_json::from_value::<AbsorbOptions>(rec.options.clone()).map_err(|e| format!("its options no longer parse ({e})"))?;
        // A document absorbed again over a new base keeps the id it was posted under.
        let same_id = rec.reabsorbing_from.is_some()
            || store::document_id(&model.info.fingerprint, rec.owner.as_deref(), &text, rec.id_options()) == rec.id;
        if !same_id {
            return Err("its text, options or base model do not match its id (a replica with another base model?)".into());
        }
        let document = tokio::task::spawn_blocking(move || crate::service::encode_answerable(&model, text))
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
                             progress = NULL, error = NULL, base = $6, base_name = $7, reabsorbing_from = NULL,
                             updated_at = now() WHERE id = $1",
                        &[&id, &to_i64(store::now()), &json(adapter)?, training, &blob.sha256, &self.base.fingerprint, &self.base.name],
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

    /// Packs the saved adapter, writes its archive and publishes it in the database. The archive
    /// it replaces (one made over another base) goes from the store once nothing names it.
    fn publish(&self, id: &str, running: &Running, adapter: AdapterInfo, training: serde_json::Value) -> anyhow::Result<bool> {
        let archive = blobs::pack(&self.store.adapter_dir(id))?;
        let blob = self.runtime.block_on(self.blobs.put(archive.into()))?;
        let replaced = self.runtime.block_on(self.archive_of(id)).unwrap_or_default().filter(|old| *old != blob.sha256);
        let done = self.runtime.block_on(self.end_with_retries(id, running, Ending::Ready { blob: blob.clone(), adapter, training }));
        if done {
            self.store.note_blob(id, &blob)?;
            if let Some(old) = replaced {
                self.runtime.block_on(self.forget_archive(id, old))?;
            }
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
