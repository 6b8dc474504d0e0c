//! The engine owns the base model and runs all model work on two dedicated OS threads, each fed
//! by a bounded queue of its own kind of job:
//! - the **training** thread absorbs one document at a time ([`AbsorbJob`]: train, save to the
//!   store) — training a second document concurrently would only oversubscribe the cores;
//! - the **generation** thread answers many requests at once ([`GenerateJob`]: a question about
//!   a stored document, or a plain chat prompt) by continuous batching ([`batcher`]): requests
//!   join and leave the running batch at any step, each with its own adapter. Admission is
//!   bounded twice: by the queue, and by a KV cache memory budget (a request whose cache would
//!   not fit is refused, 429, rather than slowing everyone down).
//!
//! Both share one `Arc<Model>` (the decoder is immutable and `Sync`). A training step cannot be
//! interrupted part-way, so instead of interleaving generation between training steps on one
//! thread, generation has its own thread: it is never blocked behind a training job, at the cost
//! of sharing the cores with it while both run. A full queue is refused at once (HTTP 429).
//!
//! The engine keeps no records: an absorb job reports its progress and outcome to the
//! [`JobEvents`] it was started with (the service's document records), a generation answers
//! through its own channels.

pub mod batcher;
mod jobs;

use crate::lift::pricing::AbsorbRate;
pub use jobs::{AbsorbJob, AbsorbOutcome, GenerateJob, Generated, JobEvents, JobProgress, JobUpdate, Prompt};

use crate::model::Model;
use crate::store::Store;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::collections::VecDeque;
use std::sync::mpsc::TryRecvError;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// What a lane's queue carries: that lane's kind of job (so a job cannot reach the wrong thread).
enum Queued<J> {
    Job(J),
    /// Test support (`Engine::hold_training` in `testing`): runs on the lane's thread between
    /// jobs, counted as a running job; tests hold a lane with it to fill its queue deterministically.
    #[cfg(any(test, feature = "testing"))]
    Call(Box<dyn FnOnce() + Send>),
}

impl<J> Queued<J> {
    /// The job, unless this is a test's call.
    fn job(&self) -> Option<&J> {
        match self {
            Queued::Job(job) => Some(job),
            #[cfg(any(test, feature = "testing"))]
            Queued::Call(_) => None,
        }
    }
}

/// What the engine refuses or fails with: queueing (`queue_absorb`, `queue_generation`) and
/// generating (a job's reply).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The queue is full: try again later (429).
    #[error("the queue is full")]
    QueueFull,
    /// The KV cache budget cannot hold the request now (429): try again later.
    #[error("the generation memory budget is full ({needed} KV tokens asked, {free} free of {budget})")]
    MemoryFull { needed: usize, free: usize, budget: usize },
    /// The engine is shutting down (503).
    #[error("the engine is shutting down")]
    Closed,
    /// The document was deleted while the request waited.
    #[error("no document '{0}'")]
    UnknownDocument(String),
    /// `memory` mode about a document that has no adapter yet (409).
    #[error("the document '{0}' has no adapter yet")]
    NoAdapter(String),
    #[error(transparent)]
    ContextLength(#[from] crate::model::generate::ContextLengthExceeded),
    /// The document's adapter was made over another base (`manifest::WrongBaseModel`).
    #[error("{0}")]
    WrongBase(String),
    /// The document's adapter files are damaged (`manifest::AdapterDamaged`; details for the log).
    #[error("{0}")]
    Damaged(String),
    /// Anything else: a server-side failure (details for the log).
    #[error("{0}")]
    Failed(String),
}

impl From<anyhow::Error> for EngineError {
    fn from(e: anyhow::Error) -> Self {
        if let Some(w) = e.downcast_ref::<crate::adapters::manifest::WrongBaseModel>() {
            return EngineError::WrongBase(w.0.clone());
        }
        if crate::store::is_damaged(&e) {
            return EngineError::Damaged(format!("{e:#}"));
        }
        match e.downcast::<crate::model::generate::ContextLengthExceeded>() {
            Ok(c) => EngineError::ContextLength(c),
            Err(e) => EngineError::Failed(format!("{e:#}")),
        }
    }
}

/// What every job runs with.
struct Context {
    model: Arc<Model>,
    store: Arc<Store>,
    events: Arc<dyn JobEvents>,
    /// Most sequences in the generation batch.
    max_batch: usize,
    /// This server's measured absorb rate (finished absorbs record into it).
    rate: Arc<AbsorbRate>,
}

/// A waiting job's place in the training queue, shared by the job and its document's record: a
/// document deleted before its job starts gives the place back at once, instead of when the
/// worker reaches the cancelled job (a client posting and deleting while a long absorb runs
/// would otherwise fill the queue with jobs that will never train, and be refused with 429).
#[derive(Clone, Default)]
pub struct QueuePlace(Arc<PlaceState>);

#[derive(Default)]
struct PlaceState {
    /// WAITING, STARTED or RELEASED.
    state: AtomicU8,
    /// The lane's count of waiting jobs, once the job is in a queue.
    depth: OnceLock<Arc<AtomicUsize>>,
}

impl QueuePlace {
    const WAITING: u8 = 0;
    const STARTED: u8 = 1;
    const RELEASED: u8 = 2;

    /// Gives the place back if the job is still waiting in a queue; the worker then skips it.
    pub fn release(&self) {
        let Some(depth) = self.0.depth.get() else { return };
        let released = self.0.state.compare_exchange(Self::WAITING, Self::RELEASED, Ordering::SeqCst, Ordering::SeqCst).is_ok();
        if released {
            depth.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Whether the place was given back: the job is dropped, never run.
    fn given_back(&self) -> bool {
        self.0.state.load(Ordering::SeqCst) == Self::RELEASED
    }

    /// The worker takes the job: false when its place was given back (the job is dropped).
    fn start(&self) -> bool {
        self.0.state.compare_exchange(Self::WAITING, Self::STARTED, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }
}

/// A job that may have been given back while it waited (a deleted document's absorb).
pub trait GivenBack {
    fn given_back(&self) -> bool {
        false
    }
}

impl GivenBack for AbsorbJob {
    fn given_back(&self) -> bool {
        self.place.given_back()
    }
}

impl GivenBack for GenerateJob {}

impl<J: GivenBack> Queued<J> {
    fn given_back(&self) -> bool {
        match self {
            Queued::Job(j) => j.given_back(),
            #[cfg(any(test, feature = "testing"))]
            Queued::Call(_) => false,
        }
    }
}

/// A lane's queue: its jobs in order. Jobs given back while they wait are dropped when the next
/// job is pushed, so they hold neither a place nor memory.
pub(crate) struct Lane<J> {
    state: Mutex<(VecDeque<Queued<J>>, bool)>,
    ready: Condvar,
}

impl<J: GivenBack> Lane<J> {
    fn new() -> Self {
        Self { state: Mutex::new((VecDeque::new(), false)), ready: Condvar::new() }
    }

    fn push(&self, job: Queued<J>) -> Result<(), EngineError> {
        let mut s = self.state.lock().map_err(|_| EngineError::Closed)?;
        if s.1 {
            return Err(EngineError::Closed);
        }
        s.0.retain(|q| !q.given_back());
        s.0.push_back(job);
        self.ready.notify_one();
        Ok(())
    }

    /// The next job, waiting for one; None once the lane is closed and empty.
    fn recv(&self) -> Option<Queued<J>> {
        let mut s = self.state.lock().ok()?;
        loop {
            if let Some(job) = s.0.pop_front() {
                return Some(job);
            }
            if s.1 {
                return None;
            }
            s = self.ready.wait(s).ok()?;
        }
    }

    /// The next job if one is waiting.
    fn try_recv(&self) -> Result<Queued<J>, TryRecvError> {
        let mut s = self.state.lock().map_err(|_| TryRecvError::Disconnected)?;
        match s.0.pop_front() {
            Some(job) => Ok(job),
            None if s.1 => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }

    fn is_closed(&self) -> bool {
        self.state.lock().map_or(true, |s| s.1)
    }

    /// No job is taken from now on; the worker finishes those waiting, then stops.
    fn close(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.1 = true;
        }
        self.ready.notify_all();
    }
}

/// One lane: its thread and the bounded queue of its jobs (`J`).
pub(crate) struct Worker<J> {
    lane: Arc<Lane<J>>,
    capacity: usize,
    /// Jobs waiting (not yet started, not given back), and places reserved for jobs about to be
    /// submitted: at most `capacity`.
    depth: Arc<AtomicUsize>,
    /// Jobs running (training: 0 or 1; generation: the batch).
    busy: Arc<AtomicUsize>,
    handle: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl<J: GivenBack + Send + 'static> Worker<J> {
    /// Starts the thread `name`, which runs `run` over the queue until it closes.
    fn start(
        name: &str,
        capacity: usize,
        run: impl FnOnce(&Lane<J>, &Counters) + Send + 'static,
    ) -> std::io::Result<Self> {
        let capacity = capacity.max(1);
        let lane = Arc::new(Lane::new());
        let depth = Arc::new(AtomicUsize::new(0));
        let busy = Arc::new(AtomicUsize::new(0));
        let counters = Counters { depth: depth.clone(), busy: busy.clone() };
        let worker_lane = lane.clone();
        let handle = std::thread::Builder::new().name(name.to_string()).spawn(move || run(&worker_lane, &counters))?;
        Ok(Self { lane, capacity, depth, busy, handle: Mutex::new(Some(handle)) })
    }
}

impl<J: GivenBack> Worker<J> {
    /// Takes a place in the queue, or says why there is none.
    fn reserve(&self) -> Result<Reservation<'_, J>, EngineError> {
        if self.lane.is_closed() {
            return Err(EngineError::Closed);
        }
        self.depth
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| (d < self.capacity).then_some(d + 1))
            .map_err(|_| EngineError::QueueFull)?;
        Ok(Reservation { worker: self, used: false })
    }

    /// Test support: queues `call` to run on this lane's thread (see [`Queued::Call`]).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn call(&self, call: impl FnOnce() + Send + 'static) -> Result<(), EngineError> {
        self.reserve()?.send(Queued::Call(Box::new(call)))
    }

    fn queue(&self) -> (usize, usize) {
        (self.depth.load(Ordering::SeqCst), self.busy.load(Ordering::SeqCst))
    }

    fn close(&self) -> Option<std::thread::JoinHandle<()>> {
        self.lane.close();
        self.handle.lock().ok().and_then(|mut h| h.take())
    }
}

/// A lane's queue figures, as its thread updates them.
struct Counters {
    /// Jobs waiting in the queue (and places reserved for jobs about to be submitted).
    depth: Arc<AtomicUsize>,
    /// Jobs running.
    busy: Arc<AtomicUsize>,
}

/// The training lane: one job at a time.
fn run_one_at_a_time(ctx: &Context, lane: &Lane<AbsorbJob>, counters: &Counters) {
    while let Some(queued) = lane.recv() {
        // A job whose document was deleted while it waited gave its place back already.
        if let Some(job) = queued.job() {
            if !job.place.start() {
                tracing::debug!(id = job.id, "a deleted document's job is dropped from the queue");
                continue;
            }
        }
        counters.depth.fetch_sub(1, Ordering::SeqCst);
        counters.busy.store(1, Ordering::SeqCst);
        // A panic in one job must not take the worker down.
        let run = || match queued {
            Queued::Job(job) => jobs::absorb(&ctx.model, &ctx.store, &*ctx.events, &ctx.rate, job),
            #[cfg(any(test, feature = "testing"))]
            Queued::Call(call) => call(),
        };
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).is_err() {
            tracing::error!("training job panicked");
        }
        counters.busy.store(0, Ordering::SeqCst);
    }
}

/// The generation lane: continuous batching. Waits for work when idle; otherwise takes what has
/// arrived (up to the batch's room) before each step.
fn run_batched(ctx: &Context, lane: &Lane<GenerateJob>, counters: &Counters) {
    let model = &*ctx.model;
    let mut batch = jobs::GenerationBatch::new(ctx.max_batch, crate::model::generate::PREFILL_CHUNK);
    let mut open = true;
    loop {
        while open && batch.has_room() {
            let job = if batch.is_empty() {
                lane.recv()
            } else {
                match lane.try_recv() {
                    Ok(job) => Some(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => None,
                }
            };
            let Some(job) = job else {
                open = false;
                break;
            };
            counters.depth.fetch_sub(1, Ordering::SeqCst);
            match job {
                Queued::Job(job) => {
                    let admitted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        jobs::admit(model, &ctx.store, &mut batch, job)
                    }));
                    if admitted.is_err() {
                        tracing::error!("starting a generation panicked");
                    }
                }
                #[cfg(any(test, feature = "testing"))]
                Queued::Call(call) => {
                    counters.busy.store(batch.len() + 1, Ordering::SeqCst);
                    call();
                }
            }
            counters.busy.store(batch.len(), Ordering::SeqCst);
        }
        if batch.is_empty() {
            if open {
                continue;
            }
            return;
        }
        ctx.events.batch(batch.len());
        let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| jobs::step(model, &*ctx.events, &mut batch)));
        if stepped.is_err() {
            tracing::error!(sequences = batch.len(), "a generation step panicked; its requests are dropped");
            batch.drain();
        }
        counters.busy.store(batch.len(), Ordering::SeqCst);
    }
}

/// KV cache tokens held for one generation out of the engine's budget; given back when dropped.
pub struct KvHold {
    reserved: Arc<AtomicUsize>,
    tokens: usize,
}

impl KvHold {
    /// Keeps only `tokens` (never grows the hold).
    pub fn shrink_to(&mut self, tokens: usize) {
        if tokens < self.tokens {
            self.reserved.fetch_sub(self.tokens - tokens, Ordering::SeqCst);
            self.tokens = tokens;
        }
    }
}

impl Drop for KvHold {
    fn drop(&mut self) {
        self.reserved.fetch_sub(self.tokens, Ordering::SeqCst);
    }
}

/// A place held in a lane's queue for a job `J` (see [`Engine::reserve_absorb`]); given back
/// when dropped unused.
pub struct Reservation<'a, J> {
    worker: &'a Worker<J>,
    used: bool,
}

impl Reservation<'_, AbsorbJob> {
    /// Queues `job`; its [`QueuePlace`] can give the place back from now on.
    pub fn submit(self, job: AbsorbJob) -> Result<(), EngineError> {
        let _ = job.place.0.depth.set(self.worker.depth.clone());
        self.send(Queued::Job(job))
    }
}

impl Reservation<'_, GenerateJob> {
    pub fn submit(self, job: GenerateJob) -> Result<(), EngineError> {
        self.send(Queued::Job(job))
    }
}

impl<J: GivenBack> Reservation<'_, J> {
    fn send(mut self, queued: Queued<J>) -> Result<(), EngineError> {
        self.worker.lane.push(queued)?;
        self.used = true;
        Ok(())
    }
}

impl<J> Drop for Reservation<'_, J> {
    fn drop(&mut self) {
        if !self.used {
            self.worker.depth.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// How much generation the engine takes on at once.
#[derive(Clone, Copy, Debug)]
pub struct GenerateLimits {
    /// Requests waiting for a place in the batch.
    pub queue: usize,
    /// Most sequences in the running batch.
    pub max_batch: usize,
    /// KV cache tokens all admitted requests may hold together (prompt + answer each).
    pub kv_tokens: usize,
}

pub struct Engine {
    pub model: Arc<Model>,
    pub(crate) train: Worker<AbsorbJob>,
    pub(crate) gen: Worker<GenerateJob>,
    limits: GenerateLimits,
    /// KV cache tokens held by admitted generations (waiting or running).
    kv_reserved: Arc<AtomicUsize>,
    /// Seconds per training token of this server's finished absorbs (the cost estimates).
    pub rate: Arc<AbsorbRate>,
}

impl Engine {
    /// Starts both threads. Absorb jobs save into `store` and report to `events`; generations
    /// read their documents from `store`.
    pub fn start(
        model: Arc<Model>,
        store: Arc<Store>,
        events: Arc<dyn JobEvents>,
        train_capacity: usize,
        limits: GenerateLimits,
    ) -> std::io::Result<Self> {
        let rate = Arc::new(AbsorbRate::default());
        let ctx = Arc::new(Context { model: model.clone(), store, events, max_batch: limits.max_batch, rate: rate.clone() });
        let train_ctx = ctx.clone();
        Ok(Self {
            train: Worker::start("lift-train", train_capacity, move |rx, c| run_one_at_a_time(&train_ctx, rx, c))?,
            gen: Worker::start("lift-generate", limits.queue, move |rx, c| run_batched(&ctx, rx, c))?,
            model,
            limits,
            kv_reserved: Arc::new(AtomicUsize::new(0)),
            rate,
        })
    }

    /// Queues an absorb on the training lane.
    pub fn queue_absorb(&self, job: AbsorbJob) -> Result<(), EngineError> {
        self.train.reserve()?.submit(job)
    }

    /// Queues a generation on the generation lane, once it has taken its KV tokens from the budget.
    pub fn queue_generation(&self, mut job: GenerateJob) -> Result<(), EngineError> {
        let place = self.gen.reserve()?;
        job.kv_hold = Some(self.hold_kv(job.kv_tokens)?);
        place.submit(job)
    }

    /// Takes `tokens` from the KV budget, or says how full it is.
    fn hold_kv(&self, tokens: usize) -> Result<KvHold, EngineError> {
        let budget = self.limits.kv_tokens;
        self.kv_reserved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |r| (r + tokens <= budget).then_some(r + tokens))
            .map_err(|held| EngineError::MemoryFull { needed: tokens, free: budget.saturating_sub(held), budget })?;
        Ok(KvHold { reserved: self.kv_reserved.clone(), tokens })
    }

    /// Holds a place in the training queue, so that a request is refused (429) before it writes
    /// anything.
    pub fn reserve_absorb(&self) -> Result<Reservation<'_, AbsorbJob>, EngineError> {
        self.train.reserve()
    }

    /// (waiting, running) training jobs.
    pub fn train_queue(&self) -> (usize, usize) {
        self.train.queue()
    }

    /// (waiting, running) generation requests.
    pub fn generate_queue(&self) -> (usize, usize) {
        self.gen.queue()
    }

    /// (held, budget) KV cache tokens of the generations admitted.
    pub fn kv_tokens(&self) -> (usize, usize) {
        (self.kv_reserved.load(Ordering::SeqCst), self.limits.kv_tokens)
    }

    pub fn limits(&self) -> GenerateLimits {
        self.limits
    }

    /// Stops accepting work; the workers finish what they hold and exit. Returns their handles.
    pub fn close(&self) -> Vec<std::thread::JoinHandle<()>> {
        [self.train.close(), self.gen.close()].into_iter().flatten().collect()
    }
}
