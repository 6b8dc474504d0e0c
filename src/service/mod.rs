//! The service: documents and jobs, independent of HTTP. It owns the engine (model work), the
//! store (adapters and records on disk) and the records of the documents it knows.
//!
//! A document's way through it: [`Service::submit`] tokenizes the text once, checks it against
//! the limits, keeps the text until its adapter is saved, records the job and queues an
//! [`AbsorbJob`] on the engine; the engine trains and saves it and reports progress and the outcome
//! to [`records::Records`], which writes the record through to disk. [`Service::ask`] and
//! [`Service::chat`] check a question against the model's window and queue a [`GenerateJob`],
//! which loads the document from the store and answers through [`crate::lift::answer::answer`].
//! On start, jobs a previous process left unfinished are settled or re-queued
//! ([`Service::open`]); [`Service::begin_shutdown`] stops training so that the job is re-queued at
//! the next start.
//!
//! That is the default registry: this process's memory and files. With a shared database
//! ([`ServiceConfig::shared`]) the records and the job queue live in PostgreSQL instead and the
//! adapters in a shared blob store ([`shared`]): the same calls, answered for every replica.

mod error;
pub mod records;
pub mod shared;

pub use error::ServiceError;
pub use crate::engine::Generated;
pub use records::{DocumentView, ErrorMessage};

use crate::document::Document;
use crate::engine::{AbsorbJob, Engine, EngineError, GenerateJob, GenerateLimits, Job, Lane, Prompt};
use crate::lift::answer::{ContextPolicy, Mode};
use crate::formats::Source;
use crate::lift::AbsorbOptions;
use crate::metrics::Metrics;
use crate::model::generate::SamplingParams;
use crate::model::{ChatMessage, Model};
use crate::store::blobs::BlobRef;
use crate::store::{self, JobRecord, Status, Store};
use anyhow::Result;
use records::{DocEntry, Records};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// What the service needs to know (the server's flags map onto it).
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    pub adapters_dir: PathBuf,
    /// Bytes of loaded adapters (with their documents) kept in memory.
    pub cache_bytes: u64,
    pub train_queue: usize,
    pub generate_queue: usize,
    /// Most requests generating side by side (continuous batching).
    pub max_batch: usize,
    /// Memory for the KV caches of the requests admitted (waiting and generating); a request
    /// whose cache would not fit is refused (429).
    pub kv_cache_bytes: u64,
    /// Largest document, in tokens of the base model.
    pub max_document_tokens: usize,
    /// Cap on the training one document may plan (tokens through the model, all epochs).
    pub max_training_tokens: u64,
    /// In-context document budget when answering (None: `DEFAULT_CONTEXT_TOKENS`; with the
    /// `full` policy, what fits the window).
    pub context_tokens: Option<usize>,
    /// Absorb options of a document that sets none.
    pub default_options: AbsorbOptions,
    /// Replicas sharing a database and an adapter store (None: this process's files).
    pub shared: Option<shared::SharedConfig>,
}

impl ServiceConfig {
    /// The engine's generation limits, the KV budget counted in tokens of `model`.
    fn generate_limits(&self, model: &Model) -> GenerateLimits {
        let per_token = model.kv_bytes_per_token().max(1) as u64;
        GenerateLimits {
            queue: self.generate_queue,
            max_batch: self.max_batch,
            kv_tokens: (self.kv_cache_bytes / per_token).min(usize::MAX as u64) as usize,
        }
    }
}

/// A document to absorb, its options already validated against their own bounds.
pub struct NewDocument {
    pub text: String,
    pub title: Option<String>,
    pub options: AbsorbOptions,
    /// How the text was made (format, file name, extractor).
    pub source: Source,
}

/// What absorbing a document will cost, said before it runs (`POST /documents`, also `dry_run`).
#[derive(Clone, Debug)]
pub struct Cost {
    pub tokens: usize,
    pub estimate: crate::lift::estimate::Estimate,
    pub warnings: Vec<crate::lift::estimate::OptionWarning>,
}

/// [`Service::submit`]'s answer: a new job, or the document already known under this id.
pub enum Submitted {
    Queued(DocumentView),
    Existing(DocumentView),
}

/// A question about a document.
#[derive(Clone, Debug)]
pub struct Question {
    pub document_id: String,
    pub question: String,
    /// The conversation before the question, oldest first (see
    /// [`Ask::history`](crate::lift::answer::Ask::history)); empty for a question on its own.
    pub history: Vec<ChatMessage>,
    pub mode: Mode,
    /// The context policy (None: the mode's default).
    pub context: Option<ContextPolicy>,
    /// The in-context budget in tokens (None: the server's).
    pub context_tokens: Option<usize>,
}

/// Counts shown by `/metrics`.
pub struct Stats {
    pub blob_puts: u64,
    pub blob_fetches: u64,
    pub train_queue: (usize, usize),
    pub generate_queue: (usize, usize),
    /// (held, budget) KV cache tokens of admitted generations.
    pub kv_tokens: (usize, usize),
    pub documents: HashMap<Status, usize>,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub cache_evictions: u64,
    pub cache_resident_bytes: u64,
}

pub struct Service {
    pub engine: Arc<Engine>,
    store: Arc<Store>,
    registry: Registry,
    cfg: ServiceConfig,
}

/// Where the documents' records and the job queue live.
enum Registry {
    /// This process's memory, written through to files beside the adapters (the default).
    Files(Arc<Records>),
    /// PostgreSQL, shared by replicas.
    Shared(Arc<shared::Shared>),
}

/// What `/health` says.
pub enum Health {
    Ok,
    ShuttingDown,
    DatabaseUnavailable(String),
}

impl Service {
    /// Opens the store, starts the engine, and settles the jobs a previous process left
    /// unfinished: `ready` when their adapter was saved, re-queued (in posting order) when their
    /// text was kept and still hashes to their id, `failed` with the reason otherwise (blocking).
    pub fn open(model: Arc<Model>, cfg: ServiceConfig, metrics: Arc<Metrics>) -> Result<Self> {
        if let Some(shared_cfg) = cfg.shared.clone() {
            return Self::open_shared(model, cfg, shared_cfg, metrics);
        }
        let store = Arc::new(Store::open(&cfg.adapters_dir, cfg.cache_bytes)?);
        let mut docs = HashMap::new();
        let mut requeue = Vec::new();
        for r in store.recover()? {
            if let Some(text) = r.requeue_text {
                requeue.push((r.rec.id.clone(), text));
            }
            docs.insert(r.rec.id.clone(), DocEntry::new(r.rec));
        }
        tracing::info!(documents = docs.len(), requeued = requeue.len(), dir = %cfg.adapters_dir.display(), "store opened");
        for dir in store.unrecorded_adapters() {
            tracing::warn!(
                dir = %dir.display(),
                "an adapter directory without a record is not served: add it with `lift-serve import {} --adapters {}` \
                 (--api-key KEY for a tenant's), then restart",
                dir.display(),
                cfg.adapters_dir.display()
            );
        }
        let records = Arc::new(Records {
            docs: RwLock::new(docs),
            store: store.clone(),
            metrics,
            shutting_down: AtomicBool::new(false),
        });
        let engine = Arc::new(Engine::start(model.clone(), store.clone(), records.clone(), cfg.train_queue, cfg.generate_limits(&model))?);
        let service = Self { engine, store, registry: Registry::Files(records), cfg };
        for (id, text) in requeue {
            service.requeue(&id, text);
        }
        Ok(service)
    }

    /// A replica on a shared database and adapter store: `adapters_dir` is its local cache of
    /// the shared archives. The schema and the trainer loop start in the background (on the
    /// current tokio runtime), so a replica may start before the database is up.
    fn open_shared(model: Arc<Model>, cfg: ServiceConfig, shared_cfg: shared::SharedConfig, metrics: Arc<Metrics>) -> Result<Self> {
        let blobs = Arc::new(store::blobs::Blobs::open(&shared_cfg.adapter_store)?);
        let store = Arc::new(Store::open(&cfg.adapters_dir, cfg.cache_bytes)?.with_blobs(blobs));
        let shared = Arc::new(shared::Shared::new(shared_cfg.clone(), store.clone(), metrics)?);
        let engine = Arc::new(Engine::start(model.clone(), store.clone(), shared.clone(), cfg.train_queue, cfg.generate_limits(&model))?);
        tokio::spawn(shared.clone().run(engine.clone()));
        tracing::info!(
            replica = %shared_cfg.replica, role = ?shared_cfg.role, adapter_store = %shared_cfg.adapter_store,
            cache_dir = %cfg.adapters_dir.display(), "replica on a shared database"
        );
        Ok(Self { engine, store, registry: Registry::Shared(shared), cfg })
    }

    fn records(&self) -> Option<&Arc<Records>> {
        match &self.registry {
            Registry::Files(r) => Some(r),
            Registry::Shared(_) => None,
        }
    }

    /// Whether this process answers questions (a training-only replica does not).
    fn check_serves(&self) -> Result<(), ServiceError> {
        match &self.registry {
            Registry::Shared(s) if !s.role().answers() => Err(ServiceError::NotServing),
            _ => Ok(()),
        }
    }

    pub async fn health(&self) -> Health {
        if self.is_shutting_down() {
            return Health::ShuttingDown;
        }
        match &self.registry {
            Registry::Files(_) => Health::Ok,
            Registry::Shared(s) => match s.healthy().await {
                Ok(()) => Health::Ok,
                Err(e) => Health::DatabaseUnavailable(e.to_string()),
            },
        }
    }

    pub fn model(&self) -> &Model {
        &self.engine.model
    }

    pub fn is_shutting_down(&self) -> bool {
        match &self.registry {
            Registry::Files(r) => r.shutting_down.load(Ordering::SeqCst),
            Registry::Shared(s) => s.is_shutting_down(),
        }
    }

    // ---------- documents ----------

    /// Tokenizes the document (once), checks it against the limits and queues its absorption; a
    /// document already queued, training or ready under the same id is answered as it is. A
    /// refused request (full queue, over a limit) writes nothing.
    pub async fn submit(&self, owner: Option<String>, doc: NewDocument) -> Result<(Submitted, Cost), ServiceError> {
        let NewDocument { text, title, options, source } = doc;
        let model = self.engine.model.clone();
        let document = tokio::task::spawn_blocking(move || encode_answerable(&model, text))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::Untokenizable(format!("{e:#}")))?;
        let cost = self.cost(document.clone(), &options).await?;
        let submitted = self.queue(owner, title, options, source, document).await?;
        Ok((submitted, cost))
    }

    /// What absorbing `doc` would cost (planned steps, training tokens, time at the measured rate)
    /// and the options known to under-train it; refused as `submit` would refuse it (too large, too
    /// much training). Nothing is stored.
    pub async fn estimate(&self, doc: NewDocument) -> Result<Cost, ServiceError> {
        let NewDocument { text, options, .. } = doc;
        let model = self.engine.model.clone();
        // Tokens only: the passages an answer needs are not built for a dry run.
        let document = tokio::task::spawn_blocking(move || Document::encode(&model, text))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::Untokenizable(format!("{e:#}")))?;
        self.cost(Arc::new(document), &options).await
    }

    /// The limits checked, then the cost (extractive QA generation counts the pairs: blocking).
    async fn cost(&self, document: Arc<Document>, options: &AbsorbOptions) -> Result<Cost, ServiceError> {
        let (tokens, limit) = (document.len(), self.cfg.max_document_tokens);
        if tokens > limit {
            return Err(ServiceError::DocumentTooLarge { tokens, limit });
        }
        self.check_training_cost(options, tokens)?;
        let (engine, o) = (self.engine.clone(), options.clone());
        tokio::task::spawn_blocking(move || {
            let o = &o;
            let pairs = if o.qa.use_model {
                // Model-written pairs are only known once written: the cap bounds them.
                o.qa.max_pairs
            } else {
                let text = &document.text;
                crate::lift::qa::extractive_qa(text, &crate::lift::text::split_sentences(text), &o.qa).len()
            };
            let one_per_row = engine.model.base_filter().is_some();
            let counts = crate::lift::estimate::plan_counts(tokens, pairs, o, one_per_row);
            Cost { tokens, estimate: engine.rate.estimate(counts), warnings: crate::lift::estimate::warnings(tokens, o) }
        })
        .await
        .map_err(ServiceError::internal)
    }

    /// Queues a tokenized document within the limits.
    async fn queue(
        &self,
        owner: Option<String>,
        title: Option<String>,
        options: AbsorbOptions,
        source: Source,
        document: Arc<Document>,
    ) -> Result<Submitted, ServiceError> {
        let tokens = document.len();
        let options_json = serde_json::to_value(&options).map_err(ServiceError::internal)?;
        let fingerprint = &self.engine.model.info.fingerprint;
        let id = store::document_id(fingerprint, owner.as_deref(), &document.text, &options_json);
        let rec = JobRecord {
            id: id.clone(),
            owner,
            title,
            status: Status::Queued,
            tokens,
            created_at: store::now(),
            seq: store::next_seq(),
            ready_at: None,
            error: None,
            adapter: None,
            options: options_json,
            source: Some(source),
            training: None,
        };
        let records = match &self.registry {
            Registry::Files(r) => r,
            Registry::Shared(s) => {
                let submitted = s.submit(rec, &document.text, self.cfg.train_queue).await?;
                if let Submitted::Queued(_) = submitted {
                    self.store.put_live(&id, document);
                    tracing::info!(id, tokens, "document queued (shared queue)");
                }
                return Ok(submitted);
            }
        };
        if let Some(view) = existing_view(&*records.docs.read().map_err(ServiceError::poisoned)?, &id) {
            return Ok(Submitted::Existing(view));
        }
        // A place in the queue first: a refused request (429) writes nothing.
        let slot = self.engine.reserve(Lane::Train)?;
        // The text is kept until the adapter is saved, so that a restart can train it again.
        let (store, id2) = (self.store.clone(), id.clone());
        let document = tokio::task::spawn_blocking(move || store.write_pending_text(&id2, &document.text).map(|()| document))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::internal(format!("cannot keep the document text: {e:#}")))?;

        let mut docs = records.docs.write().map_err(ServiceError::poisoned)?;
        if let Some(view) = existing_view(&docs, &id) {
            // The same document was queued meanwhile: its job keeps the text it wrote.
            return Ok(Submitted::Existing(view));
        }
        let entry = DocEntry::new(rec);
        // Answerable from now on, from its passages.
        self.store.put_live(&id, document.clone());
        let job = AbsorbJob {
            id: id.clone(),
            document,
            title: entry.rec.title.clone(),
            source: entry.rec.source.clone(),
            options,
            cancel: entry.cancel.clone(),
        };
        slot.submit(Job::Absorb(job))?;
        self.store.write_record(&entry.rec).map_err(|e| ServiceError::internal(format!("cannot write the job record: {e}")))?;
        let view = entry.view();
        docs.insert(id.clone(), entry);
        tracing::info!(id, tokens, "document queued");
        Ok(Submitted::Queued(view))
    }

    /// The training the options plan for a document of `tokens` must stay within the cap (each
    /// option is bounded alone; this bounds their product).
    fn check_training_cost(&self, o: &AbsorbOptions, tokens: usize) -> Result<(), ServiceError> {
        let planned = crate::lift::plan::planned_training_tokens(tokens, &o.plan, o.train.epochs, o.qa.max_pairs);
        let limit = self.cfg.max_training_tokens;
        if planned > limit {
            return Err(ServiceError::TrainingTooLarge { planned, tokens, limit });
        }
        Ok(())
    }

    /// Queues again a job interrupted by the previous process (its text was kept), or records why
    /// it cannot be: its id no longer matches the text, options and base model, or the queue is
    /// full.
    fn requeue(&self, id: &str, text: String) {
        let Some(records) = self.records() else { return };
        let Ok(mut docs) = records.docs.write() else { return };
        let Some(entry) = docs.get_mut(id) else { return };
        match self.requeue_job(entry, text) {
            Ok(()) => tracing::info!(id, "re-queued a job interrupted by the previous process"),
            Err(why) => {
                entry.rec.status = Status::Failed;
                entry.rec.error = Some(format!(
                    "interrupted: the server stopped during the job and could not re-queue it: {why}; POST the document again to retry"
                ));
                self.store.remove_pending_text(id);
                if let Err(e) = self.store.write_record(&entry.rec) {
                    tracing::error!(id, error = %e, "cannot write job record");
                }
                tracing::warn!(id, why, "interrupted job not re-queued");
            }
        }
    }

    fn requeue_job(&self, entry: &DocEntry, text: String) -> Result<(), String> {
        let r = &entry.rec;
        let options = serde_json::from_value::<AbsorbOptions>(r.options.clone())
            .map_err(|e| format!("its options no longer parse ({e})"))?;
        let model = &self.engine.model;
        if store::document_id(&model.info.fingerprint, r.owner.as_deref(), &text, &r.options) != r.id {
            return Err("its text, options or the base model changed".to_string());
        }
        let document = encode_answerable(model, text).map_err(|e| format!("its text cannot be tokenized ({e:#})"))?;
        self.store.put_live(&r.id, document.clone());
        let job = AbsorbJob {
            id: r.id.clone(),
            document,
            title: r.title.clone(),
            source: r.source.clone(),
            options,
            cancel: entry.cancel.clone(),
        };
        self.engine.submit(Job::Absorb(job)).map_err(|e| format!("the training queue refused it ({e})"))
    }

    /// The document `id` as `owner` sees it: unknown ids and other tenants' documents are both
    /// `UnknownDocument`.
    pub async fn document(&self, owner: Option<&str>, id: &str) -> Result<DocumentView, ServiceError> {
        Ok(self.lookup(owner, id).await?.0)
    }

    /// The document and, with shared blobs, the archive of its adapter.
    async fn lookup(&self, owner: Option<&str>, id: &str) -> Result<(DocumentView, Option<BlobRef>), ServiceError> {
        known_shape(id)?;
        match &self.registry {
            Registry::Files(r) => Ok((with_doc(r, owner, id, DocEntry::view)?, None)),
            Registry::Shared(s) => s.document(owner, id).await,
        }
    }

    /// `owner`'s documents in posting order.
    pub async fn documents(&self, owner: Option<&str>) -> Result<Vec<DocumentView>, ServiceError> {
        let records = match &self.registry {
            Registry::Files(r) => r,
            Registry::Shared(s) => return s.documents(owner).await,
        };
        let docs = records.docs.read().map_err(ServiceError::poisoned)?;
        let mut list: Vec<&DocEntry> = docs.values().filter(|d| d.rec.owner.as_deref() == owner).collect();
        list.sort_by(|a, b| a.rec.posting_order().cmp(&b.rec.posting_order()));
        Ok(list.into_iter().map(DocEntry::view).collect())
    }

    /// Updates of the document's view, for event streams (closed when the document is deleted).
    pub async fn watch(&self, owner: Option<&str>, id: &str) -> Result<tokio::sync::watch::Receiver<DocumentView>, ServiceError> {
        known_shape(id)?;
        match &self.registry {
            Registry::Files(r) => with_doc(r, owner, id, |d| d.watch.subscribe()),
            Registry::Shared(s) => s.watch(owner, id).await,
        }
    }

    /// Stops the document's job if it runs and removes its adapter and record.
    pub async fn delete(&self, owner: Option<&str>, id: &str) -> Result<(), ServiceError> {
        known_shape(id)?;
        let records = match &self.registry {
            Registry::Files(r) => r,
            Registry::Shared(s) => {
                s.delete(owner, id).await?;
                tracing::info!(id, "document deleted");
                return Ok(());
            }
        };
        with_doc(records, owner, id, |_| ())?;
        let entry = records.docs.write().map_err(ServiceError::poisoned)?.remove(id);
        if let Some(e) = entry {
            e.cancel.store(true, Ordering::SeqCst);
        }
        let (store, id2) = (self.store.clone(), id.to_string());
        tokio::task::spawn_blocking(move || store.delete(&id2))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::internal(format!("cannot delete: {e:#}")))?;
        tracing::info!(id, "document deleted");
        Ok(())
    }

    // ---------- generation ----------

    /// Queues an answer to `q` about a document, after checking, in tokens of the base model,
    /// that the question and `max_tokens` of answer fit the window. A document without its
    /// adapter yet (queued, training, failed, cancelled) answers from its passages, with the
    /// latest snapshot of its training when one exists (`memory` mode needs an adapter: 409).
    pub async fn ask(
        &self,
        owner: Option<&str>,
        q: Question,
        params: SamplingParams,
        pieces: Option<Pieces>,
    ) -> Result<PendingGeneration, ServiceError> {
        self.check_serves()?;
        let (view, blob) = self.lookup(owner, &q.document_id).await?;
        if view.status != Status::Ready {
            self.ensure_live(&q.document_id, &view).await?;
        }
        let model = &self.engine.model;
        let question_tokens = model.tokenizer.encode(&q.question, false).map_err(ServiceError::internal)?.len();
        // A FltLM filter lays the context out with the question twice.
        let filtered = model.base_filter().is_some() && q.mode.uses_context();
        let needed = crate::lift::answer::min_prompt_tokens(question_tokens, filtered);
        self.check_fits(needed, params.max_tokens)?;
        let context_tokens = q.context_tokens.or(self.cfg.context_tokens);
        let ask = crate::lift::answer::Ask {
            question: &q.question,
            history: &q.history,
            mode: q.mode,
            context: q.context,
            context_tokens,
        };
        // The KV tokens it may take: its in-context share of the document (with a FltLM
        // layout's markers), the template and question, the answer; never past the window.
        let budget = match ask.policy() {
            ContextPolicy::Full => context_tokens.unwrap_or(usize::MAX),
            _ => context_tokens.unwrap_or(crate::lift::answer::DEFAULT_CONTEXT_TOKENS),
        };
        let context = if q.mode.uses_context() { view.tokens.min(budget) } else { 0 };
        let markers = model.base_filter().filter(|_| filtered).map_or(0, |f| context / f.chunk_tokens.max(1) + 1);
        // The conversation's turns, as far as the window holds them (the oldest are left out).
        let mut turns = 0;
        for t in &q.history {
            turns += model.tokenizer.encode_plain(&t.content).map_err(ServiceError::internal)?.len() + 4;
        }
        let kv_tokens = (context + markers + needed + turns + params.max_tokens).min(model.config().max_position_embeddings);
        let prompt = Prompt::Document {
            id: q.document_id,
            question: q.question,
            history: q.history,
            mode: q.mode,
            context: q.context,
            context_tokens,
            blob,
        };
        self.generate(prompt, params, kv_tokens, pieces)
    }

    /// A document without a saved adapter must be in the store's live documents to be answered
    /// about: with replicas, one that another replica posted is read from the shared queue; a
    /// failed one, from its kept text.
    async fn ensure_live(&self, id: &str, view: &DocumentView) -> Result<(), ServiceError> {
        if self.store.live(id).is_some() {
            return Ok(());
        }
        let not_ready = || ServiceError::NotReady { id: id.to_string(), status: view.status };
        let text = match &self.registry {
            Registry::Shared(s) => s.job_text(id).await?.ok_or_else(not_ready)?,
            // A document that failed (in this process or an earlier one) answers from its kept text.
            Registry::Files(_) => {
                let store = self.store.clone();
                let id = id.to_string();
                tokio::task::spawn_blocking(move || store.read_pending_text(&id)).await.map_err(ServiceError::internal)?.ok_or_else(not_ready)?
            }
        };
        let model = self.engine.model.clone();
        let document = tokio::task::spawn_blocking(move || encode_answerable(&model, text))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::Untokenizable(format!("{e:#}")))?;
        self.store.put_live(id, document);
        Ok(())
    }

    /// Queues a chat completion on the base model.
    pub fn chat(
        &self,
        messages: &[ChatMessage],
        params: SamplingParams,
        pieces: Option<Pieces>,
    ) -> Result<PendingGeneration, ServiceError> {
        self.check_serves()?;
        let ids = self.engine.model.encode_chat(messages).map_err(ServiceError::internal)?;
        self.check_fits(ids.len(), params.max_tokens)?;
        let kv_tokens = ids.len() + params.max_tokens;
        self.generate(Prompt::Chat(ids), params, kv_tokens, pieces)
    }

    /// `prompt_tokens + max_tokens` must fit the model's window.
    fn check_fits(&self, prompt_tokens: usize, max_tokens: usize) -> Result<(), ServiceError> {
        let window = self.engine.model.config().max_position_embeddings;
        if prompt_tokens + max_tokens > window {
            return Err(ServiceError::ContextLength { prompt_tokens, max_tokens, window });
        }
        Ok(())
    }

    fn generate(
        &self,
        prompt: Prompt,
        params: SamplingParams,
        kv_tokens: usize,
        pieces: Option<Pieces>,
    ) -> Result<PendingGeneration, ServiceError> {
        let (reply, result) = tokio::sync::oneshot::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let queued_at = Instant::now();
        let job = GenerateJob { prompt, params, cancel: cancel.clone(), pieces, reply, queued_at, kv_tokens, kv_hold: None };
        self.engine.submit(Job::Generate(job))?;
        Ok(PendingGeneration { result, _cancel: CancelOnDrop(cancel) })
    }

    // ---------- operations ----------

    /// Stops taking work: the running training job stops (recorded as queued, re-queued by the
    /// next start) and so do queued ones when their turn comes.
    pub fn begin_shutdown(&self) {
        let records = match &self.registry {
            Registry::Files(r) => r,
            Registry::Shared(s) => return s.begin_shutdown(),
        };
        records.shutting_down.store(true, Ordering::SeqCst);
        if let Ok(docs) = records.docs.read() {
            for d in docs.values().filter(|d| !d.rec.status.is_terminal()) {
                d.cancel.store(true, Ordering::SeqCst);
            }
        }
    }

    /// Counts for `/metrics`. With a shared database the document counts are every replica's,
    /// the training queue's waiting jobs the shared queue's (empty when the database is away).
    pub async fn stats(&self) -> Stats {
        let mut documents = HashMap::new();
        let mut train_queue = self.engine.train_queue();
        let (mut blob_puts, mut blob_fetches) = (0, 0);
        match &self.registry {
            Registry::Files(r) => {
                if let Ok(docs) = r.docs.read() {
                    for d in docs.values() {
                        *documents.entry(d.rec.status).or_insert(0) += 1;
                    }
                }
            }
            Registry::Shared(s) => {
                if let Ok((counts, waiting)) = s.counts().await {
                    documents = counts;
                    train_queue.0 = waiting;
                }
                blob_puts = s.blobs().stats.puts.load(Ordering::Relaxed);
                blob_fetches = s.blobs().stats.fetches.load(Ordering::Relaxed);
            }
        }
        let s = &self.store.stats;
        Stats {
            blob_puts,
            blob_fetches,
            train_queue,
            generate_queue: self.engine.generate_queue(),
            kv_tokens: self.engine.kv_tokens(),
            documents,
            cache_hits: s.hits.load(Ordering::Relaxed),
            cache_misses: s.misses.load(Ordering::Relaxed),
            cache_evictions: s.evictions.load(Ordering::Relaxed),
            cache_resident_bytes: self.store.resident_bytes(),
        }
    }
}

/// An id that is not a well-formed document id names no document (and never a path).
/// A posted document tokenized with its passage index made (answers retrieve from it at once).
pub fn encode_answerable(model: &Model, text: String) -> anyhow::Result<Arc<Document>> {
    let document = Document::encode(model, text)?;
    document.passages(model, crate::lift::answer::passage_tokens(model))?;
    Ok(Arc::new(document))
}

fn known_shape(id: &str) -> Result<(), ServiceError> {
    if store::valid_id(id) { Ok(()) } else { Err(ServiceError::UnknownDocument(id.to_string())) }
}

fn with_doc<T>(records: &Records, owner: Option<&str>, id: &str, f: impl FnOnce(&DocEntry) -> T) -> Result<T, ServiceError> {
    let docs = records.docs.read().map_err(ServiceError::poisoned)?;
    match docs.get(id) {
        Some(d) if d.rec.owner.as_deref() == owner => Ok(f(d)),
        _ => Err(ServiceError::UnknownDocument(id.to_string())),
    }
}

fn existing_view(docs: &HashMap<String, DocEntry>, id: &str) -> Option<DocumentView> {
    docs.get(id).filter(|d| matches!(d.rec.status, Status::Queued | Status::Training | Status::Ready)).map(DocEntry::view)
}

/// Where a streaming generation sends its text pieces.
pub type Pieces = tokio::sync::mpsc::UnboundedSender<String>;

/// A queued generation: its result, and a guard that cancels it when dropped (the handler's
/// future or the response stream is dropped when the client goes away).
pub struct PendingGeneration {
    result: tokio::sync::oneshot::Receiver<Result<Generated, EngineError>>,
    _cancel: CancelOnDrop,
}

impl PendingGeneration {
    pub async fn wait(&mut self) -> Result<Generated, ServiceError> {
        match (&mut self.result).await {
            Ok(r) => r.map_err(ServiceError::from),
            Err(_) => Err(ServiceError::internal("the generation was dropped")),
        }
    }
}

struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}
