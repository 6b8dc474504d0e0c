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
//! adapters in a shared blob store ([`postgres`]): the same calls, answered for every replica. Both
//! implement one trait ([`registry`]), which the service holds.

mod collection_ask;
mod collection_files;
mod collection_pg;
pub mod collections;
mod error;
mod rebase;
pub mod records;
mod registry;
pub mod postgres;

pub use collection_ask::{index_passages, prompt_over, CollectionRead, IndexFigures, ReadPassage};
pub use collections::{CollectionChange, CollectionView};

pub use error::ServiceError;
pub use crate::engine::Generated;
pub use records::{DocumentView, ErrorMessage};

use crate::document::Document;
use crate::engine::{Engine, EngineError, GenerateJob, GenerateLimits, Prompt};
use crate::lift::answer::{ContextPolicy, Mode};
use crate::formats::Source;
use crate::lift::pricing::Cost;
use crate::lift::AbsorbOptions;
use crate::metrics::Metrics;
use crate::model::generate::SamplingParams;
use crate::model::{ChatMessage, Model};
use crate::store::blobs::BlobRef;
use crate::store::{self, JobRecord, Status, Store};
use anyhow::Result;
use records::{DocEntry, Records};
use registry::Registry;
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
    /// Most documents in one collection.
    pub max_collection_documents: usize,
    /// Cap on the training one document may plan (tokens through the model, all epochs).
    pub max_training_tokens: u64,
    /// In-context document budget when answering (None: `DEFAULT_CONTEXT_TOKENS`; with the
    /// `full` policy, what fits the window).
    pub context_tokens: Option<usize>,
    /// Self-gating of `lift` answers ([`crate::lift::answer::gate`]).
    pub self_gating: bool,
    /// Replicas sharing a database and an adapter store (None: this process's files).
    pub shared: Option<postgres::SharedConfig>,
    /// Time between an absorb's checkpoints.
    pub checkpoint_interval: std::time::Duration,
    /// Seconds per training token measured on this machine at start ([`crate::lift::pricing::calibrate`]):
    /// the estimates' rate until an absorb finishes (None: the documented prior).
    pub calibrated_rate: Option<f64>,
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
    /// Where the documents' records and the job queue live: this process's memory, written
    /// through to files beside the adapters ([`Records`], the default), or PostgreSQL, shared by
    /// replicas ([`postgres::Shared`]).
    registry: Arc<dyn Registry>,
    /// Where collections live: beside the registry's records (files or PostgreSQL).
    collections: Arc<dyn collections::CollectionRegistry>,
    /// The collections' retrieval indexes, built on first question and kept current.
    indexes: collection_ask::Indexes,
    cfg: ServiceConfig,
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
    /// Documents whose adapter was made over another base are absorbed again ([`rebase`]).
    pub fn open(model: Arc<Model>, cfg: ServiceConfig, metrics: Arc<Metrics>) -> Result<Self> {
        if let Some(shared_cfg) = cfg.shared.clone() {
            return Self::open_shared(model, cfg, shared_cfg, metrics);
        }
        let store = Arc::new(Store::open(&cfg.adapters_dir, cfg.cache_bytes)?.with_checkpoint_interval(cfg.checkpoint_interval));
        let mut docs = HashMap::new();
        let (mut requeue, mut rebase) = (Vec::new(), Vec::new());
        for r in store.recover(&model.info.fingerprint)? {
            match r.requeue_text {
                Some(text) if r.rec.reabsorbing_from.is_some() => rebase.push((r.rec.clone(), text)),
                Some(text) => requeue.push((r.rec.id.clone(), text)),
                None => {}
            }
            docs.insert(r.rec.id.clone(), DocEntry::new(r.rec));
        }
        tracing::info!(
            documents = docs.len(), requeued = requeue.len(), over_another_base = rebase.len(),
            dir = %cfg.adapters_dir.display(), "store opened"
        );
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
        engine.rate.set_calibrated(cfg.calibrated_rate);
        for (id, text) in requeue {
            records.requeue(&engine, &id, text);
        }
        rebase::feed(records.clone(), engine.clone(), rebase::order(rebase));
        let collections = Arc::new(collection_files::FileCollections::open(&cfg.adapters_dir)?);
        Ok(Self { engine, store, registry: records, collections, indexes: Default::default(), cfg })
    }

    /// A replica on a shared database and adapter store: `adapters_dir` is its local cache of
    /// the shared archives. The schema and the trainer loop start in the background (on the
    /// current tokio runtime), so a replica may start before the database is up.
    fn open_shared(model: Arc<Model>, cfg: ServiceConfig, shared_cfg: postgres::SharedConfig, metrics: Arc<Metrics>) -> Result<Self> {
        let blobs = Arc::new(store::blobs::Blobs::open(&shared_cfg.adapter_store)?);
        let store = Arc::new(
            Store::open(&cfg.adapters_dir, cfg.cache_bytes)?.with_blobs(blobs).with_checkpoint_interval(cfg.checkpoint_interval),
        );
        let shared = Arc::new(postgres::Shared::new(shared_cfg.clone(), store.clone(), metrics, &model)?);
        let engine = Arc::new(Engine::start(model.clone(), store.clone(), shared.clone(), cfg.train_queue, cfg.generate_limits(&model))?);
        tokio::spawn(shared.clone().run(engine.clone()));
        tracing::info!(
            replica = %shared_cfg.replica, role = ?shared_cfg.role, adapter_store = %shared_cfg.adapter_store,
            cache_dir = %cfg.adapters_dir.display(), "replica on a shared database"
        );
        Ok(Self { engine, store, registry: shared.clone(), collections: shared, indexes: Default::default(), cfg })
    }

    /// Whether this process answers questions (a training-only replica does not).
    fn check_serves(&self) -> Result<(), ServiceError> {
        if self.registry.answers() { Ok(()) } else { Err(ServiceError::NotServing) }
    }

    pub async fn health(&self) -> Health {
        if self.is_shutting_down() {
            return Health::ShuttingDown;
        }
        self.registry.health().await
    }

    pub fn model(&self) -> &Model {
        &self.engine.model
    }

    pub fn is_shutting_down(&self) -> bool {
        self.registry.is_shutting_down()
    }

    // ---------- documents ----------

    /// Tokenizes the document (once), checks it against the limits and queues its absorption; a
    /// document already queued, training or ready under the same id is answered as it is (a
    /// failed, cancelled or damaged one is queued again). A refused request (full queue, over a
    /// limit) writes nothing.
    pub async fn submit(&self, owner: Option<String>, doc: NewDocument) -> Result<(Submitted, Cost), ServiceError> {
        let NewDocument { text, title, options, source } = doc;
        let model = self.engine.model.clone();
        let document = tokio::task::spawn_blocking(move || encode_answerable(&model, text))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::Untokenizable(format!("{e:#}")))?;
        // With a time budget, what is queued is the plan fitted to it; the id is of what was
        // asked, so that the same post keeps its id whatever rate the plan was fitted to.
        let cost = self.cost(document.clone(), &options).await?;
        let submitted = self.queue(owner, title, &options, cost.options.clone(), source, document).await?;
        Ok((submitted, cost))
    }

    /// What absorbing `doc` would cost (planned steps, training tokens, time at the measured rate)
    /// and the options known to under-train it; refused as `submit` would refuse it (too large, too
    /// much training), with the options fitted to their time budget. Nothing is stored.
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

    /// The limits checked, then the cost (extractive QA generation counts the pairs: blocking),
    /// with the options fitted to their time budget (unchanged without one).
    async fn cost(&self, document: Arc<Document>, options: &AbsorbOptions) -> Result<Cost, ServiceError> {
        let (tokens, limit) = (document.len(), self.cfg.max_document_tokens);
        if tokens > limit {
            return Err(ServiceError::DocumentTooLarge { tokens, limit });
        }
        let (engine, o) = (self.engine.clone(), options.clone());
        let cost = tokio::task::spawn_blocking(move || {
            crate::lift::pricing::estimate(&engine.model, &document, &o, &engine.rate)
        })
        .await
        .map_err(ServiceError::internal)?;
        self.check_training_cost(&cost.options, tokens)?;
        Ok(cost)
    }

    /// Queues a tokenized document within the limits: its id made of the options `requested`,
    /// its job trained with the plan `options` fitted to them.
    async fn queue(
        &self,
        owner: Option<String>,
        title: Option<String>,
        requested: &AbsorbOptions,
        options: AbsorbOptions,
        source: Source,
        document: Arc<Document>,
    ) -> Result<Submitted, ServiceError> {
        let tokens = document.len();
        let options_json = serde_json::to_value(&options).map_err(ServiceError::internal)?;
        let requested_json = serde_json::to_value(requested).map_err(ServiceError::internal)?;
        let fingerprint = &self.engine.model.info.fingerprint;
        let id = store::document_id(fingerprint, owner.as_deref(), &document.text, &requested_json);
        // Documents posted before ids were made of what was asked keep theirs (the id of the
        // fitted plan, which differs only under a time budget): the same post finds them.
        let legacy = store::document_id(fingerprint, owner.as_deref(), &document.text, &options_json);
        if legacy != id {
            match self.registry.document(owner.as_deref(), &legacy).await {
                Ok((view, _)) if matches!(view.status, Status::Queued | Status::Training | Status::Ready) => {
                    return Ok(Submitted::Existing(view));
                }
                Ok(_) | Err(ServiceError::UnknownDocument(_)) => {}
                Err(e) => return Err(e),
            }
        }
        let rec = JobRecord {
            id,
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
            requested: Some(requested_json),
            source: Some(source),
            training: None,
            last_asked_at: None,
            reabsorbing_from: None,
        };
        self.registry.submit(&self.engine, rec, document, options, self.cfg.train_queue).await
    }

    /// The training the options plan for a document of `tokens` must stay within the cap (each
    /// option is bounded alone; this bounds their product).
    fn check_training_cost(&self, o: &AbsorbOptions, tokens: usize) -> Result<(), ServiceError> {
        let planned = crate::lift::pricing::most_training_tokens(tokens, o);
        let limit = self.cfg.max_training_tokens;
        if planned > limit {
            return Err(ServiceError::TrainingTooLarge { planned, tokens, limit });
        }
        Ok(())
    }

    /// The document `id` as `owner` sees it: unknown ids and other tenants' documents are both
    /// `UnknownDocument`.
    pub async fn document(&self, owner: Option<&str>, id: &str) -> Result<DocumentView, ServiceError> {
        Ok(self.lookup(owner, id).await?.0)
    }

    /// The document and, with shared blobs, the archive of its adapter.
    async fn lookup(&self, owner: Option<&str>, id: &str) -> Result<(DocumentView, Option<BlobRef>), ServiceError> {
        known_shape(id)?;
        self.registry.document(owner, id).await
    }

    /// `owner`'s documents in posting order.
    pub async fn documents(&self, owner: Option<&str>) -> Result<Vec<DocumentView>, ServiceError> {
        self.registry.documents(owner).await
    }

    /// Updates of the document's view, for event streams (closed when the document is deleted).
    pub async fn watch(&self, owner: Option<&str>, id: &str) -> Result<tokio::sync::watch::Receiver<DocumentView>, ServiceError> {
        known_shape(id)?;
        self.registry.clone().watch(owner, id).await
    }

    /// Stops the document's job if it runs and removes its adapter and record.
    pub async fn delete(&self, owner: Option<&str>, id: &str) -> Result<(), ServiceError> {
        known_shape(id)?;
        self.registry.delete(owner, id).await?;
        // Its collections' indexes drop it at their next question.
        if let Err(e) = self.collections.forget_document(id).await {
            tracing::error!(id, error = %e, "cannot take the deleted document out of its collections");
        }
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
        if view.status == Status::Damaged {
            return Err(ServiceError::AdapterDamaged(view.id));
        }
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
        let budget = ask.requested_budget().unwrap_or(usize::MAX);
        let context = if q.mode.uses_context() { view.tokens.min(budget) } else { 0 };
        let markers = model.base_filter().filter(|_| filtered).map_or(0, |f| context / f.chunk_tokens.max(1) + 1);
        // The conversation's turns, as far as the window holds them (the oldest are left out).
        let mut turns = 0;
        for t in &q.history {
            turns += model.tokenizer.encode_plain(&t.content).map_err(ServiceError::internal)?.len() + 4;
        }
        let kv_tokens = (context + markers + needed + turns + params.max_tokens).min(model.config().max_position_embeddings);
        // A gated `lift` answer runs a second sequence, the same prompt without the adapter.
        let gate = self.cfg.self_gating && q.mode == Mode::Lift;
        let kv_tokens = if gate { 2 * kv_tokens } else { kv_tokens };
        let prompt = Prompt::Document {
            id: q.document_id,
            question: q.question,
            history: q.history,
            mode: q.mode,
            context: q.context,
            context_tokens,
            blob,
            gate,
        };
        let mut pending = self.generate(prompt, params, kv_tokens, pieces)?;
        self.registry.asked(&view.id);
        pending.notice = view.reabsorbing.map(|r| r.message);
        pending.document = Some((view.id, self.registry.clone()));
        Ok(pending)
    }

    /// A document without a saved adapter must be in the store's live documents to be answered
    /// about: with replicas, one that another replica posted is read from the shared queue; a
    /// failed one, from its kept text.
    async fn ensure_live(&self, id: &str, view: &DocumentView) -> Result<(), ServiceError> {
        if self.store.live(id).is_some() {
            return Ok(());
        }
        let not_ready = || ServiceError::NotReady { id: id.to_string(), status: view.status };
        let text = self.registry.kept_text(id).await?.ok_or_else(not_ready)?;
        let model = self.engine.model.clone();
        let document = tokio::task::spawn_blocking(move || encode_answerable(&model, text))
            .await
            .map_err(ServiceError::internal)?
            .map_err(|e| ServiceError::Untokenizable(format!("{e:#}")))?;
        self.store.put_live(id, document);
        Ok(())
    }

    /// The text of one of `owner`'s documents, as it was absorbed (what answers read from; the
    /// page opens a passage in it).
    pub async fn document_text(&self, owner: Option<&str>, id: &str) -> Result<String, ServiceError> {
        let (view, blob) = self.lookup(owner, id).await?;
        Ok(self.readable_document(id, &view, blob).await?.text.clone())
    }

    /// A document's text and tokens without loading its adapter: a ready one's from its
    /// directory (or the cache; `blob`: its archive with shared blobs), another from the live
    /// documents (read back from its kept text when another replica posted it).
    pub(crate) async fn readable_document(
        &self,
        id: &str,
        view: &DocumentView,
        blob: Option<BlobRef>,
    ) -> Result<Arc<Document>, ServiceError> {
        if view.status == Status::Ready {
            let (store, id, model) = (self.store.clone(), id.to_string(), self.engine.model.clone());
            return tokio::task::spawn_blocking(move || store.read_document(&id, &model, blob.as_ref()))
                .await
                .map_err(ServiceError::internal)?
                .map_err(ServiceError::internal);
        }
        self.ensure_live(id, view).await?;
        let live = self.store.live(id).ok_or_else(|| ServiceError::NotReady { id: id.to_string(), status: view.status })?;
        Ok(live.document.clone())
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
        self.engine.queue_generation(job)?;
        Ok(PendingGeneration { result, _cancel: CancelOnDrop(cancel), document: None, notice: None })
    }

    // ---------- operations ----------

    /// Stops taking work: the running training job stops (recorded as queued, re-queued by the
    /// next start) and so do queued ones when their turn comes.
    pub fn begin_shutdown(&self) {
        self.registry.begin_shutdown()
    }

    /// Counts for `/metrics`. With a shared database the document counts are every replica's,
    /// the training queue's waiting jobs the shared queue's (empty when the database is away).
    pub async fn stats(&self) -> Stats {
        let mut train_queue = self.engine.train_queue();
        let registry::RegistryStats { documents, waiting, blob_puts, blob_fetches } = self.registry.stats().await;
        if let Some(waiting) = waiting {
            train_queue.0 = waiting;
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

/// Where a streaming generation sends its text pieces.
pub type Pieces = tokio::sync::mpsc::UnboundedSender<String>;

/// A queued generation: its result, and a guard that cancels it when dropped (the handler's
/// future or the response stream is dropped when the client goes away).
pub struct PendingGeneration {
    result: tokio::sync::oneshot::Receiver<Result<Generated, EngineError>>,
    _cancel: CancelOnDrop,
    /// The document asked about and where its record is (to mark it damaged when its adapter
    /// is found so).
    document: Option<(String, Arc<dyn Registry>)>,
    /// What the answer should say beside it (a document absorbed again over a new base answers
    /// from its passages until then).
    pub notice: Option<String>,
}

impl PendingGeneration {
    pub async fn wait(&mut self) -> Result<Generated, ServiceError> {
        match (&mut self.result).await {
            Ok(Err(EngineError::Damaged(detail))) => match &self.document {
                Some((id, registry)) => {
                    tracing::warn!(id, detail, "the document's adapter is damaged: marked damaged until it is posted again");
                    if let Err(e) = registry.mark_damaged(id).await {
                        tracing::error!(id, error = %e, "cannot mark the document damaged");
                    }
                    Err(ServiceError::AdapterDamaged(id.clone()))
                }
                None => Err(ServiceError::internal(detail)),
            },
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
