//! A new base under the shared store (an upgraded prepared base, another model): every trainer
//! over it absorbs again the documents whose published adapter was made over another base, as
//! one process does with its files (`service/rebase.rs`):
//!
//! - **behind what users post**: a trainer queues one only when no posted job waits for it, so a
//!   new document waits for at most the re-absorbs already training (one per trainer);
//! - **the most recently asked first** (`documents.last_asked_at`; never asked: posting order);
//! - **answering meanwhile**: a replica over the new base sees such a document `queued` with
//!   `reabsorbing` and answers from its passages, read from the old archive's text;
//! - **losing nothing**: the old archive stays until the new one is published, and the job is
//!   a job like any other (leases, take-over, checkpoints). Its `base` column keeps it from
//!   trainers over another base: a fleet part-way through an upgrade does not train it back.
//!
//! Which adapters count as another base's: those published before this replica started, so that
//! the replicas not yet upgraded leave alone what the upgraded ones publish.

use super::{db_error, timed, Shared};
use crate::service::ServiceError;
use crate::store::blobs::BlobRef;
use crate::store::{self};
use std::sync::atomic::Ordering;

impl Shared {
    /// Queues the next document whose adapter was made over another base than this replica's
    /// (its row `queued` with `reabsorbing_from`, its job holding the archive's text and this
    /// base). Returns whether one was queued.
    pub(super) async fn queue_next_reabsorb(&self) -> Result<bool, ServiceError> {
        if self.rebased.load(Ordering::SeqCst) {
            return Ok(false);
        }
        let c = self.client().await?;
        let started = super::to_i64(self.started_at);
        let rows = timed(async {
            c.query(
                "SELECT id, blob_sha256, base, base_name FROM documents d
                 WHERE status = 'ready' AND blob_sha256 IS NOT NULL AND base IS DISTINCT FROM $1 AND ready_at <= $2
                     AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = d.id)
                 ORDER BY last_asked_at DESC NULLS LAST, seq, id
                 LIMIT 16",
                &[&self.base.fingerprint, &started],
            )
            .await
            .map_err(db_error)
        })
        .await?;
        let (found, mut tried) = (rows.len(), 0);
        for r in rows {
            let (id, sha256): (String, String) = (r.get(0), r.get(1));
            if self.unreadable.lock().map_err(ServiceError::poisoned)?.contains(&id) {
                continue;
            }
            tried += 1;
            let blob = BlobRef { sha256 };
            let from = match (r.get::<_, Option<String>>(2), r.get::<_, Option<String>>(3)) {
                (Some(base), name) => name.unwrap_or(base),
                // Published before bases were recorded: read once from its manifest.
                (None, _) => match self.record_archived_base(&id, &blob).await? {
                    Some(name) => name,
                    None => continue,
                },
            };
            let (store, id2, blob2) = (self.store.clone(), id.clone(), blob.clone());
            let text = match tokio::task::spawn_blocking(move || store.archived_text(&id2, &blob2)).await.map_err(ServiceError::internal)? {
                Ok(text) => text,
                Err(e) => {
                    self.cannot_read(&id, &e);
                    continue;
                }
            };
            if self.insert_reabsorb(&id, &blob, &from, &text).await? {
                tracing::info!(id, previous_base = %from, base = %self.base.name, "absorbing again over this replica's base");
                return Ok(true);
            }
        }
        // Nothing left but archives it cannot read: done until this replica restarts.
        if tried == 0 && found < 16 {
            tracing::info!("no document over another base is left to absorb again");
            self.rebased.store(true, Ordering::SeqCst);
        }
        Ok(false)
    }

    /// Reads from the archive which base an adapter published before bases were recorded was
    /// made over and writes it in its row. Returns that base's name when it is another base
    /// than this replica's (None: this one's, or the archive cannot be read).
    async fn record_archived_base(&self, id: &str, blob: &BlobRef) -> Result<Option<String>, ServiceError> {
        let (store, id2, blob2) = (self.store.clone(), id.to_string(), blob.clone());
        let (fingerprint, name) = match tokio::task::spawn_blocking(move || store.archived_base(&id2, &blob2)).await.map_err(ServiceError::internal)? {
            Ok(base) => base,
            Err(e) => {
                self.cannot_read(id, &e);
                return Ok(None);
            }
        };
        let c = self.client().await?;
        timed(async {
            c.execute(
                "UPDATE documents SET base = $2, base_name = $3 WHERE id = $1 AND blob_sha256 = $4",
                &[&id, &fingerprint, &name, &blob.sha256],
            )
            .await
            .map_err(db_error)
        })
        .await?;
        Ok((fingerprint != self.base.fingerprint).then_some(name))
    }

    /// The row becomes `queued` and its job is inserted, in one transaction, if it is still the
    /// ready document of archive `blob` (another trainer may have taken it meanwhile).
    async fn insert_reabsorb(&self, id: &str, blob: &BlobRef, from: &str, text: &str) -> Result<bool, ServiceError> {
        let mut c = self.client().await?;
        let seq = super::to_i64(store::next_seq());
        timed(async {
            let tx = c.transaction().await.map_err(db_error)?;
            let n = tx
                .execute(
                    "UPDATE documents SET status = 'queued', reabsorbing_from = $2, progress = NULL, error = NULL, updated_at = now()
                     WHERE id = $1 AND status = 'ready' AND blob_sha256 = $3
                         AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = $1)",
                    &[&id, &from, &blob.sha256],
                )
                .await
                .map_err(db_error)?;
            if n != 1 {
                return Ok(false);
            }
            tx.execute("INSERT INTO jobs (id, text, seq, base) VALUES ($1, $2, $3, $4)", &[&id, &text, &seq, &self.base.fingerprint])
                .await
                .map_err(db_error)?;
            tx.commit().await.map_err(db_error)?;
            Ok(true)
        })
        .await
    }

    /// The archive a document's row names now (None: none, or no such document).
    pub(super) async fn archive_of(&self, id: &str) -> Result<Option<String>, ServiceError> {
        let c = self.client().await?;
        let row = timed(async { c.query_opt("SELECT blob_sha256 FROM documents WHERE id = $1", &[&id]).await.map_err(db_error) }).await?;
        Ok(row.and_then(|r| r.get(0)))
    }

    fn cannot_read(&self, id: &str, e: &anyhow::Error) {
        tracing::warn!(id, error = %format!("{e:#}"), "an adapter over another base whose archive cannot be read: not absorbed again");
        if let Ok(mut u) = self.unreadable.lock() {
            u.insert(id.to_string());
        }
    }
}
