//! The two kinds of model work and how each runs on its thread.

use crate::document::Document;
use crate::lift::answer::{answer, Ask, Mode};
use crate::lift::filter::ChunkScore;
use crate::lift::{AbsorbEvent, AbsorbOptions, AbsorbStage};
use super::EngineError;
use crate::model::generate::{generate as generate_tokens, FinishReason, Generation, SamplingParams};
use crate::model::{KvCache, Model, NoHooks};
use crate::store::{AdapterInfo, Store};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Train an adapter for a document and save it in the store under `id`.
pub struct AbsorbJob {
    pub id: String,
    pub document: Document,
    pub title: Option<String>,
    /// Where the text came from: recorded in the adapter's manifest.
    pub source: Option<crate::formats::Source>,
    pub options: AbsorbOptions,
    /// Set to stop the job (delete, shutdown); polled between training steps. Also tells the
    /// job apart from a later job of the same id.
    pub cancel: Arc<AtomicBool>,
}

/// Where an absorb job reports, and where generation figures go (the service's records and
/// metrics). Called on the engine's threads.
pub trait JobEvents: Send + Sync {
    fn absorb(&self, id: &str, cancel: &Arc<AtomicBool>, update: JobUpdate);
    fn generated(&self, generation: &Generation);
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

pub(super) fn absorb(model: &Model, store: &Store, events: &dyn JobEvents, job: AbsorbJob) {
    let AbsorbJob { id, document, title, source, options, cancel } = job;
    let cancelled = || cancel.load(Ordering::SeqCst);
    if cancelled() {
        events.absorb(&id, &cancel, JobUpdate::Finished(AbsorbOutcome::Cancelled { started: false }));
        return;
    }
    events.absorb(&id, &cancel, JobUpdate::Started);
    let t0 = Instant::now();
    let on_event = &mut |ev: AbsorbEvent| events.absorb(&id, &cancel, JobUpdate::Progress(ev.into()));
    let result = crate::lift::absorb(model, &document, title.as_deref(), &options, on_event, &cancelled);
    let outcome = match result {
        _ if cancelled() => AbsorbOutcome::Cancelled { started: true },
        Err(e) => AbsorbOutcome::Failed(format!("{e:#}")),
        Ok(mut absorbed) => {
            absorbed.manifest.document.source = source;
            let tokens_per_s = absorbed.report.tokens_per_s;
            match absorbed.into_new_adapter(document).and_then(|a| store.save(&id, a)) {
                Ok(loaded) => {
                    let m = &loaded.manifest;
                    let adapter = AdapterInfo { kind: m.kind.to_string(), parameters: m.parameters, bytes: m.bytes };
                    let training = m.training.clone();
                    AbsorbOutcome::Ready { adapter, training, tokens_per_s, seconds: t0.elapsed().as_secs_f64() }
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
}

pub enum Prompt {
    /// A question about a stored document, answered by [`crate::lift::answer::answer`].
    /// `blob`: with replicas sharing an adapter store, the archive the document's adapter is in.
    Document { id: String, question: String, mode: Mode, context_tokens: Option<usize>, blob: Option<crate::store::blobs::BlobRef> },
    /// The token ids of a chat prompt for the base model (encoded and checked against the window
    /// before queueing).
    Chat(Vec<u32>),
}

#[derive(Clone, Debug)]
pub struct Generated {
    pub text: String,
    /// FltLM chunk scores of the in-context document, with each chunk's text.
    pub chunks: Vec<(ChunkScore, String)>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub finish_reason: FinishReason,
    pub queue_ms: f64,
    pub prompt_ms: f64,
    pub generate_ms: f64,
}

pub(super) fn generate(model: &Model, store: &Store, events: &dyn JobEvents, job: GenerateJob) {
    if job.cancel.load(Ordering::SeqCst) {
        return; // the client left while the request waited
    }
    let queue_ms = job.queued_at.elapsed().as_secs_f64() * 1000.0;
    let (cancel, pieces) = (&job.cancel, &job.pieces);
    let mut on_text = |piece: &str| {
        !cancel.load(Ordering::SeqCst) && pieces.as_ref().is_none_or(|p| p.send(piece.to_string()).is_ok())
    };
    let result = run_prompt(model, store, &job.prompt, &job.params, &mut on_text).map(|(out, chunks)| {
        events.generated(&out);
        Generated {
            chunks,
            completion_tokens: out.tokens.len(),
            prompt_tokens: out.prompt_tokens,
            finish_reason: out.finish_reason,
            queue_ms,
            prompt_ms: out.prompt_ms,
            generate_ms: out.generate_ms,
            text: out.text,
        }
    });
    let _ = job.reply.send(result);
}

type ChunkTexts = Vec<(ChunkScore, String)>;

fn run_prompt(
    model: &Model,
    store: &Store,
    prompt: &Prompt,
    params: &SamplingParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<(Generation, ChunkTexts), EngineError> {
    match prompt {
        Prompt::Document { id, question, mode, context_tokens, blob } => {
            let loaded = store.get(id, model, blob.as_ref()).map_err(|e| {
                // Deleted while the request waited: the document is gone, not a server fault.
                if store.adapter_dir(id).exists() { EngineError::from(e) } else { EngineError::UnknownDocument(id.clone()) }
            })?;
            let ask = Ask { question, mode: *mode, context_tokens: *context_tokens };
            let a = answer(model, &loaded.document, Some(&loaded.bundle.adapter), &ask, params, on_text)?;
            let doc = loaded.document.tokens();
            let chunks = a
                .chunks
                .into_iter()
                .map(|c| Ok((c, model.tokenizer.decode(&doc[c.start..c.end])?)))
                .collect::<anyhow::Result<_>>()?;
            Ok((a.generation, chunks))
        }
        Prompt::Chat(ids) => {
            let mut cache = KvCache::new(model.config().num_layers);
            Ok((generate_tokens(model, ids, &mut cache, None, &mut NoHooks, params, on_text)?, Vec::new()))
        }
    }
}
