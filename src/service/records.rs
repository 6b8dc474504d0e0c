//! The documents a service knows: each one's record (kept on disk beside its adapter), live
//! progress and a watch channel for event streams. The engine's absorb jobs report here
//! ([`JobEvents`]); every change to a record is written through to the store.
//!
//! [`Records`] is the default [`Registry`]: this process's memory and files.

use super::registry::{Registry, RegistryStats};
use super::{encode_answerable, Health, ServiceError, Submitted};
use crate::document::Document;
use crate::engine::{AbsorbJob, AbsorbOutcome, Engine, JobEvents, JobProgress, JobUpdate};
use crate::formats::Source;
use crate::lift::AbsorbOptions;
use crate::metrics::Metrics;
use crate::model::generate::Generation;
use crate::store::blobs::BlobRef;
use crate::store::{self, AdapterInfo, JobRecord, Status, Store};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
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
    /// While it is absorbed again because the server's base changed (it answers from its
    /// passages, and its training's snapshots, until then).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reabsorbing: Option<Reabsorbing>,
}

/// Why a document is absorbed again (`DocumentView.reabsorbing`).
#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Reabsorbing {
    /// The base its saved adapter was made over.
    pub previous_base: String,
    pub message: String,
}

impl Reabsorbing {
    fn of(r: &JobRecord) -> Option<Self> {
        let from = r.reabsorbing_from.as_ref().filter(|_| !r.status.is_terminal())?;
        Some(Self {
            previous_base: from.clone(),
            message: format!(
                "the server's base changed: this document is absorbed again over it (its adapter was made over {from}); \
                 until then it answers from its passages"
            ),
        })
    }
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
    /// The job's place in the training queue while it waits (given back when it is deleted).
    pub place: crate::engine::QueuePlace,
    pub watch: tokio::sync::watch::Sender<DocumentView>,
}

impl DocEntry {
    pub fn new(rec: JobRecord) -> Self {
        let view = view(&rec, None);
        let (watch, _) = tokio::sync::watch::channel(view);
        Self { rec, progress: None, cancel: Arc::new(AtomicBool::new(false)), place: Default::default(), watch }
    }

    pub fn view(&self) -> DocumentView {
        view(&self.rec, self.progress.as_ref())
    }

    /// The absorb job of this entry's document.
    fn job(&self, document: Arc<Document>, options: AbsorbOptions) -> AbsorbJob {
        AbsorbJob {
            id: self.rec.id.clone(),
            document,
            title: self.rec.title.clone(),
            source: self.rec.source.clone(),
            options,
            cancel: self.cancel.clone(),
            place: self.place.clone(),
        }
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
        reabsorbing: Reabsorbing::of(r),
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
                    d.rec.reabsorbing_from = None;
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

impl Records {
    /// Queues again a job interrupted by the previous process (its text was kept), or a document
    /// to absorb again over a new base, or records why it cannot be: its id no longer matches the
    /// text, options and base model, or the queue is full. The text is tokenized before the
    /// records are locked.
    pub(super) fn requeue(&self, engine: &Engine, id: &str, text: String) {
        let Some(rec) = self.docs.read().ok().and_then(|d| d.get(id).map(|e| e.rec.clone())) else { return };
        let document = prepare_requeue(engine, &rec, text);
        let Ok(mut docs) = self.docs.write() else { return };
        let Some(entry) = docs.get_mut(id) else { return };
        let queued = document.and_then(|(document, options)| {
            self.store.put_live(id, document.clone());
            engine.queue_absorb(entry.job(document, options)).map_err(|e| format!("the training queue refused it ({e})"))
        });
        match (queued, entry.rec.reabsorbing_from.clone()) {
            (Ok(()), Some(from)) => tracing::info!(id, was_over = from, "queued to absorb again over the new base"),
            (Ok(()), None) => tracing::info!(id, "re-queued a job interrupted by the previous process"),
            (Err(why), Some(from)) => {
                // Its text stays: it still answers from its passages.
                entry.rec.status = Status::Failed;
                entry.rec.error = Some(format!(
                    "its adapter was made over {from} and it could not be absorbed again over the server's base: {why}; \
                     it answers from its passages until it is posted again"
                ));
                self.write_and_notify(entry);
                tracing::warn!(id, why, "a document over another base not absorbed again");
            }
            (Err(why), None) => {
                entry.rec.status = Status::Failed;
                entry.rec.error = Some(format!(
                    "interrupted: the server stopped during the job and could not re-queue it: {why}; POST the document again to retry"
                ));
                self.store.remove_pending_text(id);
                self.write_and_notify(entry);
                tracing::warn!(id, why, "interrupted job not re-queued");
            }
        }
    }

    fn write_and_notify(&self, entry: &DocEntry) {
        entry.notify();
        if let Err(e) = self.store.write_record(&entry.rec) {
            tracing::error!(id = entry.rec.id, error = %e, "cannot write job record");
        }
    }

    /// Queues a tokenized document within the limits (the engine's training queue bounds the
    /// waiting jobs).
    async fn queue(&self, engine: &Engine, rec: JobRecord, document: Arc<Document>, options: AbsorbOptions) -> Result<Submitted, ServiceError> {
        let (id, tokens) = (rec.id.clone(), rec.tokens);
        let damaged = {
            let docs = self.docs.read().map_err(ServiceError::poisoned)?;
            if let Some(view) = existing_view(&docs, &id) {
                return Ok(Submitted::Existing(view));
            }
            docs.get(&id).is_some_and(|d| d.rec.status == Status::Damaged)
        };
        // A place in the queue first: a refused request (429) writes nothing.
        let slot = engine.reserve_absorb()?;
        // The text is kept until the adapter is saved, so that a restart can train it again; a
        // damaged adapter goes (the new absorb replaces it).
        let (store, id2) = (self.store.clone(), id.clone());
        let document = tokio::task::spawn_blocking(move || {
            if damaged {
                store.discard_adapter(&id2)?;
            }
            store.write_pending_text(&id2, &document.text).map(|()| document)
        })
        .await
        .map_err(ServiceError::internal)?
        .map_err(|e| ServiceError::internal(format!("cannot keep the document text: {e:#}")))?;

        let mut docs = self.docs.write().map_err(ServiceError::poisoned)?;
        if let Some(view) = existing_view(&docs, &id) {
            // The same document was queued meanwhile: its job keeps the text it wrote.
            return Ok(Submitted::Existing(view));
        }
        let entry = DocEntry::new(rec);
        // Answerable from now on, from its passages.
        self.store.put_live(&id, document.clone());
        slot.submit(entry.job(document, options))?;
        self.store.write_record(&entry.rec).map_err(|e| ServiceError::internal(format!("cannot write the job record: {e}")))?;
        let view = entry.view();
        docs.insert(id.clone(), entry);
        tracing::info!(id, tokens, "document queued");
        Ok(Submitted::Queued(view))
    }

    async fn remove(&self, owner: Option<&str>, id: &str) -> Result<(), ServiceError> {
        with_doc(self, owner, id, |_| ())?;
        let entry = self.docs.write().map_err(ServiceError::poisoned)?.remove(id);
        if let Some(e) = entry {
            e.cancel.store(true, Ordering::SeqCst);
            e.place.release();
        }
        let (store, id2) = (self.store.clone(), id.to_string());
        tokio::task::spawn_blocking(move || store.delete(&id2))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::internal(format!("cannot delete: {e:#}")))?;
        Ok(())
    }
}

impl Registry for Records {
    fn answers(&self) -> bool {
        true
    }

    fn health(&self) -> BoxFuture<'_, Health> {
        futures_util::future::ready(Health::Ok).boxed()
    }

    fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        if let Ok(docs) = self.docs.read() {
            for d in docs.values().filter(|d| !d.rec.status.is_terminal()) {
                d.cancel.store(true, Ordering::SeqCst);
            }
        }
    }

    fn submit<'a>(
        &'a self,
        engine: &'a Engine,
        rec: JobRecord,
        document: Arc<Document>,
        options: AbsorbOptions,
        _max_waiting: usize,
    ) -> BoxFuture<'a, Result<Submitted, ServiceError>> {
        self.queue(engine, rec, document, options).boxed()
    }

    fn document<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<(DocumentView, Option<BlobRef>), ServiceError>> {
        async move { Ok((with_doc(self, owner, id, DocEntry::view)?, None)) }.boxed()
    }

    fn documents<'a>(&'a self, owner: Option<&'a str>) -> BoxFuture<'a, Result<Vec<DocumentView>, ServiceError>> {
        async move {
            let docs = self.docs.read().map_err(ServiceError::poisoned)?;
            let mut list: Vec<&DocEntry> = docs.values().filter(|d| d.rec.owner.as_deref() == owner).collect();
            list.sort_by(|a, b| a.rec.posting_order().cmp(&b.rec.posting_order()));
            Ok(list.into_iter().map(DocEntry::view).collect())
        }
        .boxed()
    }

    fn documents_among<'a>(
        &'a self,
        owner: Option<&'a str>,
        ids: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<DocumentView>, ServiceError>> {
        async move {
            let docs = self.docs.read().map_err(ServiceError::poisoned)?;
            let mine = |id: &String| docs.get(id).filter(|d| d.rec.owner.as_deref() == owner);
            Ok(ids.iter().filter_map(mine).map(DocEntry::view).collect())
        }
        .boxed()
    }

    fn watch<'a>(
        self: Arc<Self>,
        owner: Option<&'a str>,
        id: &'a str,
    ) -> BoxFuture<'a, Result<tokio::sync::watch::Receiver<DocumentView>, ServiceError>> {
        async move { with_doc(&self, owner, id, |d| d.watch.subscribe()) }.boxed()
    }

    fn delete<'a>(&'a self, owner: Option<&'a str>, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>> {
        self.remove(owner, id).boxed()
    }

    /// A document that failed (in this process or an earlier one) answers from its kept text.
    fn kept_text<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<String>, ServiceError>> {
        let (store, id) = (self.store.clone(), id.to_string());
        async move { tokio::task::spawn_blocking(move || store.read_pending_text(&id)).await.map_err(ServiceError::internal) }.boxed()
    }

    /// Recorded to the minute: one write a minute at most for a document asked all the time.
    fn asked(&self, id: &str) {
        const RESOLUTION_S: u64 = 60;
        let now = store::now();
        if self.docs.read().ok().and_then(|d| d.get(id)?.rec.last_asked_at).is_some_and(|t| now < t + RESOLUTION_S) {
            return;
        }
        let Ok(mut docs) = self.docs.write() else { return };
        let Some(d) = docs.get_mut(id) else { return };
        d.rec.last_asked_at = Some(now);
        if let Err(e) = self.store.write_record(&d.rec) {
            tracing::warn!(id, error = %e, "cannot write when the document was last asked");
        }
    }

    fn mark_damaged<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), ServiceError>> {
        async move {
            let mut docs = self.docs.write().map_err(ServiceError::poisoned)?;
            let Some(d) = docs.get_mut(id).filter(|d| d.rec.status == Status::Ready) else { return Ok(()) };
            d.rec.status = Status::Damaged;
            d.rec.error = Some(store::damaged_message(id));
            d.notify();
            self.store.write_record(&d.rec).map_err(|e| ServiceError::internal(format!("cannot write the job record: {e:#}")))
        }
        .boxed()
    }

    fn stats(&self) -> BoxFuture<'_, RegistryStats> {
        let mut documents = HashMap::new();
        if let Ok(docs) = self.docs.read() {
            for d in docs.values() {
                *documents.entry(d.rec.status).or_insert(0) += 1;
            }
        }
        futures_util::future::ready(RegistryStats { documents, ..RegistryStats::default() }).boxed()
    }
}

fn with_doc<T>(records: &Records, owner: Option<&str>, id: &str, f: impl FnOnce(&DocEntry) -> T) -> Result<T, ServiceError> {
    let docs = records.docs.read().map_err(ServiceError::poisoned)?;
    match docs.get(id) {
        Some(d) if d.rec.owner.as_deref() == owner => Ok(f(d)),
        _ => Err(ServiceError::UnknownDocument(id.to_string())),
    }
}

/// A kept text checked against its record and tokenized, with the options it trains with.
fn prepare_requeue(engine: &Engine, r: &JobRecord, text: String) -> Result<(Arc<Document>, AbsorbOptions), String> {
    let options =
        serde_json::from_value::<AbsorbOptions>(r.options.clone()).map_err(|e| format!("its options no longer parse ({e})"))?;
    let model = &engine.model;
    // A document absorbed again over a new base keeps the id it was posted under (its text is
    // the one its adapter was saved with).
    let same = r.reabsorbing_from.is_some()
        || store::document_id(&model.info.fingerprint, r.owner.as_deref(), &text, r.id_options()) == r.id;
    if !same {
        return Err("its text, options or the base model changed".to_string());
    }
    let document = encode_answerable(model, text).map_err(|e| format!("its text cannot be tokenized ({e:#})"))?;
    Ok((document, options))
}

fn existing_view(docs: &HashMap<String, DocEntry>, id: &str) -> Option<DocumentView> {
    docs.get(id).filter(|d| matches!(d.rec.status, Status::Queued | Status::Training | Status::Ready)).map(DocEntry::view)
}
