//! The documents a service knows: each one's record (kept on disk beside its adapter), live
//! progress and a watch channel for event streams. The engine's absorb jobs report here
//! ([`JobEvents`]); every change to a record is written through to the store.

use crate::engine::{AbsorbOutcome, JobEvents, JobProgress, JobUpdate};
use crate::metrics::Metrics;
use crate::model::generate::Generation;
use crate::store::{self, AdapterInfo, JobRecord, Status, Store};
use crate::formats::Source;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

/// The API's Document object.
#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct DocumentView {
    pub id: String,
    /// Always "document".
    pub object: &'static str,
    pub status: Status,
    pub title: Option<String>,
    /// Length in tokens of the base model.
    pub tokens: usize,
    pub created_at: u64,
    pub ready_at: Option<u64>,
    /// While queued or training: the stage and, when training, steps and loss.
    pub progress: Option<JobProgress>,
    pub adapter: Option<AdapterInfo>,
    pub error: Option<ErrorMessage>,
    /// The effective absorb options.
    #[schema(value_type = Object)]
    pub options: serde_json::Value,
    /// How the text was made from what was uploaded: format, file name, pages, extractor.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<Source>,
    /// Once ready: figures of the training that made the adapter (steps, QA pairs, seconds, loss).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub training: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct ErrorMessage {
    pub message: String,
}

/// One document known to the service.
pub struct DocEntry {
    pub rec: JobRecord,
    pub progress: Option<JobProgress>,
    /// The running job's stop flag (a re-posted document gets a new job and a new flag).
    pub cancel: Arc<AtomicBool>,
    pub watch: tokio::sync::watch::Sender<DocumentView>,
}

impl DocEntry {
    pub fn new(rec: JobRecord) -> Self {
        let view = view(&rec, None);
        let (watch, _) = tokio::sync::watch::channel(view);
        Self { rec, progress: None, cancel: Arc::new(AtomicBool::new(false)), watch }
    }

    pub fn view(&self) -> DocumentView {
        view(&self.rec, self.progress.as_ref())
    }

    fn notify(&self) {
        self.watch.send_replace(self.view());
    }
}

pub(super) fn view(r: &JobRecord, progress: Option<&JobProgress>) -> DocumentView {
    DocumentView {
        id: r.id.clone(),
        object: "document",
        status: r.status,
        title: r.title.clone(),
        tokens: r.tokens,
        created_at: r.created_at,
        ready_at: r.ready_at,
        progress: if r.status == Status::Ready { None } else { progress.cloned() },
        adapter: r.adapter.clone(),
        error: r.error.as_ref().map(|m| ErrorMessage { message: m.clone() }),
        options: r.options.clone(),
        source: r.source.clone(),
        training: r.training.clone(),
    }
}

pub struct Records {
    pub docs: RwLock<HashMap<String, DocEntry>>,
    pub store: Arc<Store>,
    pub metrics: Arc<Metrics>,
    /// Set when the shutdown begins: a job stopped then is re-queued at the next start.
    pub shutting_down: AtomicBool,
}

impl Records {
    /// Applies `f` to the entry of `id` if it still belongs to the job with this `cancel` flag,
    /// tells its watchers, and (`persist`) writes its record. The lock is held while writing so
    /// that a concurrent delete (which takes it to remove the entry, then removes the files)
    /// cannot be undone by a write that read the entry before it was removed.
    pub fn update(&self, id: &str, cancel: &Arc<AtomicBool>, persist: bool, f: impl FnOnce(&mut DocEntry)) -> bool {
        let Ok(mut docs) = self.docs.write() else { return false };
        let Some(d) = docs.get_mut(id).filter(|d| Arc::ptr_eq(&d.cancel, cancel)) else { return false };
        f(d);
        d.notify();
        if persist {
            if let Err(e) = self.store.write_record(&d.rec) {
                tracing::error!(id, error = %e, "cannot write job record");
            }
        }
        true
    }

    fn finished(&self, id: &str, cancel: &Arc<AtomicBool>, outcome: AbsorbOutcome) {
        let stopping = self.shutting_down.load(Ordering::SeqCst);
        match outcome {
            AbsorbOutcome::Ready { adapter, training, tokens_per_s, seconds } => {
                let ready = |d: &mut DocEntry| {
                    d.rec.status = Status::Ready;
                    d.rec.ready_at = Some(store::now());
                    d.rec.adapter = Some(adapter);
                    d.rec.training = Some(training);
                    d.progress = None;
                };
                if self.update(id, cancel, true, ready) {
                    self.metrics.job("ready", Some(tokens_per_s));
                    tracing::info!(id, seconds, "document ready");
                } else {
                    // Deleted while it saved: the files go too.
                    let _ = self.store.delete(id);
                    self.metrics.job("cancelled", None);
                }
            }
            // Deleted while it waited: nothing ran, nothing to record.
            AbsorbOutcome::Cancelled { started: false } if !stopping => {}
            AbsorbOutcome::Cancelled { .. } if stopping => {
                // Recorded as queued with its text kept: the next start trains it again.
                tracing::warn!(id, "training interrupted by the shutdown; the job is re-queued at the next start");
                self.update(id, cancel, true, |d| {
                    d.rec.status = Status::Queued;
                    d.progress = None;
                });
                self.metrics.job("interrupted", None);
            }
            AbsorbOutcome::Cancelled { .. } => self.metrics.job("cancelled", None),
            AbsorbOutcome::Failed(msg) => {
                tracing::warn!(id, error = %msg, "training failed");
                self.update(id, cancel, true, |d| {
                    d.rec.status = Status::Failed;
                    d.rec.error = Some(msg);
                });
                // Its text is kept: a failed document still answers from its passages (`rag`),
                // after a restart too; DELETE removes it.
                self.metrics.job("failed", None);
            }
        }
    }
}

impl JobEvents for Records {
    fn absorb(&self, id: &str, cancel: &Arc<AtomicBool>, update: JobUpdate) {
        match update {
            JobUpdate::Started => {
                self.update(id, cancel, true, |d| d.rec.status = Status::Training);
            }
            JobUpdate::Progress(p) => {
                self.update(id, cancel, false, |d| d.progress = Some(p));
            }
            JobUpdate::Finished(outcome) => self.finished(id, cancel, outcome),
        }
    }

    fn generated(&self, g: &Generation) {
        self.metrics.generation(g.finish_reason.name(), g.prompt_ms / 1000.0, g.tokens.len(), g.generate_ms / 1000.0);
    }

    fn batch(&self, sequences: usize) {
        self.metrics.batch_step(sequences);
    }
}
