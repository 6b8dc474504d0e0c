//! The two kinds of model work and how each runs on its thread.

use crate::lift::pricing::AbsorbRate;
use crate::document::Document;
use super::batcher::{Batch, Entry};
use crate::lift::answer::gate::{self, AnswerSource};
use crate::lift::answer::{chunk_scores, prepare, Ask, AnswerHooks, ContextPolicy, Mode};
use crate::lift::answer::layout::ChunkScore;
use crate::lift::{AbsorbEvent, AbsorbOptions, AbsorbStage};
use super::EngineError;
use crate::model::generate::{FinishReason, Generation, SamplingParams, Sequence, TokenScores};
use crate::model::{Adapter, DecodeMix, KvCache, Model, Projection};
use crate::store::{AdapterInfo, Loaded, Store};
use candle_core::Tensor;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Train an adapter for a document and save it in the store under `id`.
pub struct AbsorbJob {
    pub id: String,
    /// Shared with the store's live documents: it answers while it trains.
    pub document: Arc<Document>,
    pub title: Option<String>,
    /// Where the text came from: recorded in the adapter's manifest.
    pub source: Option<crate::formats::Source>,
    pub options: AbsorbOptions,
    /// Set to stop the job (delete, shutdown); polled between training steps. Also tells the
    /// job apart from a later job of the same id.
    pub cancel: Arc<AtomicBool>,
    /// Its place in the training queue, given back at once when its document is deleted before
    /// it starts.
    pub place: super::QueuePlace,
}

/// Where an absorb job reports, and where generation figures go (the service's records and
/// metrics). Called on the engine's threads.
pub trait JobEvents: Send + Sync {
    fn absorb(&self, id: &str, cancel: &Arc<AtomicBool>, update: JobUpdate);
    fn generated(&self, generation: &Generation);
    /// A generation step is about to run `sequences` side by side.
    fn batch(&self, _sequences: usize) {}
}

#[derive(Clone, Debug)]
pub enum JobUpdate {
    Started,
    Progress(JobProgress),
    Finished(AbsorbOutcome),
}

/// An absorption's progress as the API shows it (`Document.progress`). Read back from JSON too
/// (replicas share it through the database): untagged, so the variant with the most fields
/// comes first.
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum JobProgress {
    Training {
        stage: AbsorbStage,
        epoch: usize,
        epochs: usize,
        step: usize,
        steps: usize,
        loss: f64,
        tokens_per_s: f64,
        /// Absorbing until learned: the latest loss of the held-aside probe questions.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        probe_loss: Option<f64>,
        /// The step this training continued from: it resumed the checkpoint of a run that
        /// stopped (a restart, a replica that died).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resumed_from_step: Option<usize>,
    },
    Qa {
        stage: AbsorbStage,
        step: usize,
        steps: usize,
    },
    Stage {
        stage: AbsorbStage,
    },
}

impl From<AbsorbEvent<'_>> for JobProgress {
    fn from(ev: AbsorbEvent<'_>) -> Self {
        match ev {
            AbsorbEvent::Stage(stage) => JobProgress::Stage { stage },
            // Snapshots go to the store (`absorb`), not to progress; a stray one reads as training.
            AbsorbEvent::Snapshot(_) => JobProgress::Stage { stage: AbsorbStage::Training },
            AbsorbEvent::Qa(p) => JobProgress::Qa { stage: AbsorbStage::GeneratingQa, step: p.done, steps: p.total },
            AbsorbEvent::Train(p) => JobProgress::Training {
                stage: AbsorbStage::Training,
                epoch: p.epoch,
                epochs: p.epochs,
                step: p.step,
                steps: p.steps,
                loss: p.loss,
                tokens_per_s: p.tokens_per_s,
                probe_loss: p.probe_loss,
                resumed_from_step: p.resumed_from,
            },
        }
    }
}

#[derive(Clone, Debug)]
pub enum AbsorbOutcome {
    /// Saved in the store.
    Ready { adapter: AdapterInfo, training: serde_json::Value, tokens_per_s: f64, seconds: f64 },
    /// Stopped through `cancel`: before it started, or part-way (nothing saved).
    Cancelled { started: bool },
    /// Failed; the message is for the document's record.
    Failed(String),
}

pub(super) fn absorb(model: &Model, store: &Store, events: &dyn JobEvents, rate: &AbsorbRate, job: AbsorbJob) {
    let AbsorbJob { id, document, title, source, options, cancel, place: _ } = job;
    let cancelled = || cancel.load(Ordering::SeqCst);
    if cancelled() {
        events.absorb(&id, &cancel, JobUpdate::Finished(AbsorbOutcome::Cancelled { started: false }));
        return;
    }
    events.absorb(&id, &cancel, JobUpdate::Started);
    let t0 = Instant::now();
    let on_event = &mut |ev: AbsorbEvent| match ev {
        AbsorbEvent::Snapshot(s) => store.publish_snapshot(
            &id,
            crate::store::Snapshot { adapter: s.adapter, step: s.step, planned_steps: s.planned_steps },
        ),
        ev => events.absorb(&id, &cancel, JobUpdate::Progress(ev.into())),
    };
    let interval = store.checkpoint_interval();
    let resumable = store.checkpoint(&id).map(|place| crate::lift::absorb::checkpoint::Resumable { store: place, interval });
    let result = crate::lift::absorb_resumable(model, &document, title.as_deref(), &options, on_event, &cancelled, resumable);
    if !matches!(result, Ok(_)) || cancelled() {
        // No adapter: the document answers from its passages alone.
        store.drop_snapshot(&id);
    }
    let outcome = match result {
        // Stopped by a shutdown (the checkpoint stays for the next start) or a delete (which
        // removes it).
        _ if cancelled() => AbsorbOutcome::Cancelled { started: true },
        Err(e) => {
            // A failed job is not resumed: posting it again trains it from the start.
            store.drop_checkpoint(&id);
            AbsorbOutcome::Failed(format!("{e:#}"))
        }
        Ok(mut absorbed) => {
            absorbed.manifest.document.source = source;
            let tokens_per_s = absorbed.report.tokens_per_s;
            let (doc_tokens, qa_pairs) = (document.len(), absorbed.qa.len());
            let steps_run = absorbed.report.steps_this_run();
            match absorbed.into_new_adapter(document).and_then(|a| store.save(&id, a)) {
                Ok(loaded) => {
                    // The adapter is saved: nothing is left to resume.
                    store.drop_checkpoint(&id);
                    let m = &loaded.manifest;
                    let adapter = AdapterInfo { kind: m.kind.to_string(), parameters: m.parameters, bytes: m.bytes };
                    let training = m.training.clone();
                    let seconds = t0.elapsed().as_secs_f64();
                    // The measured rate: this process's wall time against the share of the
                    // planned training tokens it ran.
                    rate.record_absorb(model, doc_tokens, qa_pairs, &options, steps_run, seconds);
                    AbsorbOutcome::Ready { adapter, training, tokens_per_s, seconds }
                }
                Err(e) => AbsorbOutcome::Failed(format!("{e:#}")),
            }
        }
    };
    release_memory(&id);
    events.absorb(&id, &cancel, JobUpdate::Finished(outcome));
}

/// The allocator never trims during training (`runtime::tune_allocator`): trim once per job.
fn release_memory(id: &str) {
    let held = crate::runtime::resident_bytes();
    crate::runtime::release_memory();
    tracing::info!(
        id,
        rss_before_mb = held.unwrap_or(0) >> 20,
        rss_after_mb = crate::runtime::resident_bytes().unwrap_or(0) >> 20,
        "heap trimmed after the job"
    );
}

/// Answer a question or continue a chat, streaming text pieces as they are decoded.
pub struct GenerateJob {
    pub prompt: Prompt,
    pub params: SamplingParams,
    /// Set when the client goes away: a queued job never runs, a running one stops.
    pub cancel: Arc<AtomicBool>,
    pub pieces: Option<tokio::sync::mpsc::UnboundedSender<String>>,
    pub reply: tokio::sync::oneshot::Sender<Result<Generated, EngineError>>,
    pub queued_at: Instant,
    /// KV cache tokens the request may need (prompt + answer, an upper bound): the engine
    /// refuses it when its memory budget cannot hold them.
    pub kv_tokens: usize,
    /// The part of the budget held for it (set by the engine; freed when the job is dropped).
    pub kv_hold: Option<super::KvHold>,
}

pub enum Prompt {
    /// A question about a stored document, answered by [`crate::lift::answer::answer`].
    /// `blob`: with replicas sharing an adapter store, the archive the document's adapter is in.
    /// Before the document's adapter is saved, `lift` answers with its latest snapshot, or as
    /// `rag` when there is none.
    Document {
        id: String,
        question: String,
        /// The conversation before the question, oldest first.
        history: Vec<crate::model::ChatMessage>,
        mode: Mode,
        context: Option<ContextPolicy>,
        context_tokens: Option<usize>,
        blob: Option<crate::store::blobs::BlobRef>,
        /// Self-gating ([`gate`]): in `lift` with an adapter, the same prompt also runs without
        /// it, and the likelier answer is kept.
        gate: bool,
    },
    /// The token ids of a chat prompt for the base model (encoded and checked against the window
    /// before queueing).
    Chat(Vec<u32>),
    /// A question to a collection, its prompt built by the service from the collection's
    /// passages (`service::collection_ask`); `adapter`: the routed document's saved adapter (and
    /// its archive with shared blobs), None in `rag`.
    Collection {
        tokens: Vec<u32>,
        adapter: Option<(String, Option<crate::store::blobs::BlobRef>)>,
        mode: Mode,
        /// Self-gating, as for a document's question.
        gate: bool,
    },
}

#[derive(Clone, Debug)]
pub struct Generated {
    pub text: String,
    /// FltLM chunk scores of the in-context document, with each chunk's text.
    pub chunks: Vec<(ChunkScore, String)>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Each generated token with its log-probability (and its alternatives when the request's
    /// `top_logprobs` asked for them).
    pub tokens: TokenScores,
    pub finish_reason: FinishReason,
    pub queue_ms: f64,
    pub prompt_ms: f64,
    pub generate_ms: f64,
    /// The mode it was answered in (a document without an adapter yet answers `lift` as `rag`).
    pub mode: Option<Mode>,
    /// The adapter it ran with: (steps trained, steps planned); None without one.
    pub adapter: Option<(usize, usize)>,
    /// Whose answer this is when an adapter ran: the adapter's, or (self-gating) the passages'.
    pub answered_by: Option<AnswerSource>,
}

/// A request in the batch: where its text and reply go, and what its report needs.
pub(super) struct Running {
    to: Answerer,
    queue_ms: f64,
    /// The document it reads (chunk texts for the report).
    document: Option<Arc<Document>>,
    /// The mode it runs in and its adapter's (steps, planned steps).
    mode: Option<Mode>,
    adapter: Option<(usize, usize)>,
}

/// Where a finished sequence's answer goes.
enum Answerer {
    /// Straight to its request.
    Alone(GenerateJob),
    /// To the gate of a self-gated `lift` answer, as the adapter's answer or the passages'.
    Gated(Arc<Gate>, AnswerSource),
}

/// A self-gated `lift` answer: the adapter's sequence and its twin without the adapter (the
/// same prompt) both end here; the last to finish replies with the answer [`gate::choose`]
/// keeps. Its text is streamed once chosen.
struct Gate {
    cancel: Arc<AtomicBool>,
    /// The request (taken by the reply) and the first answer to finish.
    state: Mutex<(Option<GenerateJob>, Option<(AnswerSource, Result<Generated, EngineError>)>)>,
}

impl Running {
    /// Sends a piece of text to the client; false when it is gone. A gated answer sends nothing
    /// until it is chosen.
    fn send(&self, piece: &str) -> bool {
        match &self.to {
            Answerer::Alone(job) => !self.gone() && job.pieces.as_ref().is_none_or(|p| p.send(piece.to_string()).is_ok()),
            Answerer::Gated(..) => !self.gone(),
        }
    }

    fn gone(&self) -> bool {
        match &self.to {
            Answerer::Alone(job) => job.cancel.load(Ordering::SeqCst),
            Answerer::Gated(gate, _) => gate.cancel.load(Ordering::SeqCst),
        }
    }

    /// Replies to the request; a gated answer waits for its twin, and the second replies.
    fn reply(self, result: Result<Generated, EngineError>) {
        match self.to {
            Answerer::Alone(job) => {
                let _ = job.reply.send(result);
            }
            Answerer::Gated(gate, role) => {
                let Ok(mut state) = gate.state.lock() else { return };
                let Some((other_role, other)) = state.1.take() else {
                    state.1 = Some((role, result));
                    return;
                };
                let Some(job) = state.0.take() else { return };
                let (adapter, passages) = if role == AnswerSource::Adapter { (result, other) } else { (other, result) };
                debug_assert_ne!(role, other_role);
                let chosen = match (adapter, passages) {
                    (Ok(a), Ok(p)) => match gate::choose(a.tokens.mean_logprob(), p.tokens.mean_logprob()) {
                        AnswerSource::Adapter => Ok(Generated { answered_by: Some(AnswerSource::Adapter), ..a }),
                        AnswerSource::Passages => Ok(Generated { answered_by: Some(AnswerSource::Passages), ..p }),
                    },
                    (Err(e), _) | (_, Err(e)) => Err(e),
                };
                if let (Ok(g), Some(pieces)) = (&chosen, &job.pieces) {
                    if !g.text.is_empty() {
                        let _ = pieces.send(g.text.clone());
                    }
                }
                let _ = job.reply.send(chosen);
            }
        }
    }
}

/// The store's adapter (or a training snapshot) as the batch holds it (kept alive with its
/// document).
enum HeldAdapter {
    Stored(Arc<Loaded>),
    Snapshot(Arc<crate::store::Snapshot>),
}

impl HeldAdapter {
    fn inner(&self) -> &crate::adapters::AnyAdapter {
        match self {
            HeldAdapter::Stored(l) => &l.bundle.adapter,
            HeldAdapter::Snapshot(s) => &s.adapter,
        }
    }

    /// How far its training went: (steps run, steps planned).
    fn steps(&self) -> (usize, usize) {
        match self {
            HeldAdapter::Stored(l) => l.steps(),
            HeldAdapter::Snapshot(s) => (s.step, s.planned_steps),
        }
    }

    /// Which adapter this is, for the batch: requests on one document's adapter share it.
    fn key(&self) -> usize {
        match self {
            HeldAdapter::Stored(l) => Arc::as_ptr(l) as usize,
            HeldAdapter::Snapshot(s) => Arc::as_ptr(s) as usize,
        }
    }
}

impl Adapter for HeldAdapter {
    fn linear_delta(&self, layer: usize, proj: Projection, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.inner().linear_delta(layer, proj, x)
    }

    fn mix_attention(&self, layer: usize, q: &Tensor, attn: Tensor) -> candle_core::Result<Tensor> {
        self.inner().mix_attention(layer, q, attn)
    }

    fn first_layer(&self) -> usize {
        self.inner().first_layer()
    }

    fn decode_mix(&self, layer: usize) -> DecodeMix<'_> {
        self.inner().decode_mix(layer)
    }
}

pub(super) type GenerationBatch<'m> = Batch<'m, AnswerHooks<'m>, Running>;

/// Starts `job` in `batch`, or answers it at once (cancelled while it waited, or failing).
pub(super) fn admit<'m>(model: &'m Model, store: &Store, batch: &mut GenerationBatch<'m>, mut job: GenerateJob) {
    if job.cancel.load(Ordering::SeqCst) {
        return; // the client left while the request waited
    }
    let queue_ms = job.queued_at.elapsed().as_secs_f64() * 1000.0;
    match start(model, store, &job) {
        Ok(s) => {
            // The budget held what the request could take; keep what its sequences need.
            let needed = s.seq.cache_tokens() + s.twin.as_ref().map_or(0, Sequence::cache_tokens);
            if let Some(hold) = job.kv_hold.as_mut() {
                hold.shrink_to(needed);
            }
            let running = |to| Running { to, queue_ms, document: s.document.clone(), mode: s.mode, adapter: s.steps };
            let Some(twin) = s.twin else {
                let data = running(Answerer::Alone(job));
                batch.join(Entry { seq: s.seq, adapter: s.adapter, adapter_key: s.adapter_key, data });
                return;
            };
            let gate = Arc::new(Gate { cancel: job.cancel.clone(), state: Mutex::new((Some(job), None)) });
            let data = running(Answerer::Gated(gate.clone(), AnswerSource::Adapter));
            batch.join(Entry { seq: s.seq, adapter: s.adapter, adapter_key: s.adapter_key, data });
            let data = running(Answerer::Gated(gate, AnswerSource::Passages));
            batch.join(Entry { seq: twin, adapter: None, adapter_key: 0, data });
        }
        Err(e) => {
            let _ = job.reply.send(Err(e));
        }
    }
}

/// A request ready to join the batch: its sequence, the document it reads, the adapter that
/// answers (with its training steps) and the mode it runs in.
struct Started<'m> {
    seq: Sequence<'m, AnswerHooks<'m>>,
    /// Self-gating: the same prompt without the adapter.
    twin: Option<Sequence<'m, AnswerHooks<'m>>>,
    document: Option<Arc<Document>>,
    adapter: Option<Arc<dyn Adapter>>,
    /// The batch's key of `adapter` (0: none).
    adapter_key: usize,
    steps: Option<(usize, usize)>,
    mode: Option<Mode>,
}

/// The sequence of a request, the document it reads and the adapter that answers: the saved
/// adapter; before it exists (or while one made over another base is replaced), the latest
/// training snapshot (`lift`, `memory`) or none (`lift` then answers as `rag`).
fn start<'m>(model: &'m Model, store: &Store, job: &GenerateJob) -> Result<Started<'m>, EngineError> {
    match &job.prompt {
        Prompt::Document { id, question, history, mode, context, context_tokens, blob, gate } => {
            let (document, held) = match store.live(id) {
                // A saved adapter made over another base is being replaced: not it.
                Some(live) if blob.is_none() && (live.replaces_saved || !store.adapter_dir(id).exists()) => {
                    (live.document.clone(), live.snapshot().map(HeldAdapter::Snapshot))
                }
                _ => {
                    let loaded = load_stored(model, store, id, blob.as_ref())?;
                    (loaded.document.clone(), Some(HeldAdapter::Stored(loaded)))
                }
            };
            let mode = match (*mode, &held) {
                (Mode::Lift, None) => Mode::Rag,
                (Mode::Memory, None) => return Err(EngineError::NoAdapter(id.clone())),
                (m, _) => m,
            };
            let held = held.filter(|_| mode.uses_adapter());
            let steps = held.as_ref().map(HeldAdapter::steps);
            let ask = Ask { question, history, mode, context: *context, context_tokens: *context_tokens };
            let (_, seq) = prepare(model, &document, &ask, &job.params)?;
            let twin = match (*gate && mode == Mode::Lift && held.is_some()).then(|| Ask { mode: Mode::Rag, ..ask }) {
                Some(passages) => Some(prepare(model, &document, &passages, &job.params)?.1),
                None => None,
            };
            let adapter_key = held.as_ref().map_or(0, HeldAdapter::key);
            let adapter = held.map(|h| Arc::new(h) as Arc<dyn Adapter>);
            Ok(Started { seq, twin, document: Some(document), adapter, adapter_key, steps, mode: Some(mode) })
        }
        Prompt::Chat(ids) => {
            let cache = KvCache::with_capacity(model.config().num_layers, ids.len() + job.params.max_tokens);
            let seq = Sequence::new(model, ids.clone(), cache, job.params.clone(), None)?;
            Ok(Started { seq, twin: None, document: None, adapter: None, adapter_key: 0, steps: None, mode: None })
        }
        Prompt::Collection { tokens, adapter, mode, gate } => {
            // Only the routed document's adapter is loaded (through the cache).
            let held = match adapter {
                Some((id, blob)) => Some(HeldAdapter::Stored(load_stored(model, store, id, blob.as_ref())?)),
                None => None,
            };
            let steps = held.as_ref().map(HeldAdapter::steps);
            let cache = KvCache::with_capacity(model.config().num_layers, tokens.len() + job.params.max_tokens);
            let seq = Sequence::new(model, tokens.clone(), cache, job.params.clone(), None)?;
            let twin = if *gate && *mode == Mode::Lift && held.is_some() {
                let cache = KvCache::with_capacity(model.config().num_layers, tokens.len() + job.params.max_tokens);
                Some(Sequence::new(model, tokens.clone(), cache, job.params.clone(), None)?)
            } else {
                None
            };
            let adapter_key = held.as_ref().map_or(0, HeldAdapter::key);
            let adapter = held.map(|h| Arc::new(h) as Arc<dyn Adapter>);
            Ok(Started { seq, twin, document: None, adapter, adapter_key, steps, mode: Some(*mode) })
        }
    }
}

/// A document's saved adapter from the store; one deleted while the request waited is gone, not
/// a server fault (a damaged archive leaves no local copy either, but is named).
fn load_stored(model: &Model, store: &Store, id: &str, blob: Option<&crate::store::blobs::BlobRef>) -> Result<Arc<Loaded>, EngineError> {
    store.get(id, model, blob).map_err(|e| {
        if store.adapter_dir(id).exists() || crate::store::is_damaged(&e) {
            EngineError::from(e)
        } else {
            EngineError::UnknownDocument(id.to_string())
        }
    })
}

/// One step of the batch; finished requests get their reply, and every request fails with the
/// error if the step does.
pub(super) fn step(model: &Model, events: &dyn JobEvents, batch: &mut GenerationBatch) {
    batch.cancel_where(Running::gone);
    match batch.step(model, &mut |r: &mut Running, piece: &str| r.send(piece)) {
        Ok(done) => {
            for e in done {
                finish(model, events, e);
            }
        }
        Err(e) => {
            let msg = format!("{e:#}");
            tracing::error!(error = %msg, sequences = batch.len(), "generation step failed");
            for e in batch.drain() {
                e.data.reply(Err(EngineError::Failed(msg.clone())));
            }
        }
    }
}

fn finish(model: &Model, events: &dyn JobEvents, e: Entry<'_, AnswerHooks<'_>, Running>) {
    let Entry { seq, data, .. } = e;
    let (mut out, _, hooks) = seq.into_parts();
    if data.gone() {
        // Nobody to answer; dropping the entry frees its cache and budget.
        out.finish_reason = FinishReason::Cancelled;
        events.generated(&out);
        return;
    }
    events.generated(&out);
    let chunks = match (chunk_scores(&hooks), &data.document) {
        (Ok(scores), Some(document)) => {
            let doc = document.tokens();
            scores
                .into_iter()
                .map(|c| Ok((c, model.tokenizer.decode(&doc[c.start..c.end])?)))
                .collect::<anyhow::Result<Vec<_>>>()
                .map_err(EngineError::from)
        }
        (Ok(_), None) => Ok(Vec::new()),
        (Err(e), _) => Err(EngineError::from(e)),
    };
    let tokens = out.take_scores();
    let result = chunks.map(|chunks| Generated {
        chunks,
        completion_tokens: out.tokens.len(),
        tokens,
        prompt_tokens: out.prompt_tokens,
        finish_reason: out.finish_reason,
        queue_ms: data.queue_ms,
        prompt_ms: out.prompt_ms,
        generate_ms: out.generate_ms,
        text: out.text,
        mode: data.mode,
        adapter: data.adapter,
        answered_by: data.adapter.map(|_| AnswerSource::Adapter),
    });
    data.reply(result);
}
