//! The engine owns the base model and runs all model work on two dedicated OS threads, each fed
//! by a bounded queue of typed [`Job`]s:
//! - the **training** thread absorbs one document at a time ([`AbsorbJob`]: train, save to the
//!   store) — training a second document concurrently would only oversubscribe the cores;
//! - the **generation** thread answers one request at a time ([`GenerateJob`]: a question about a
//!   stored document through [`crate::lift::answer::answer`], or a plain chat prompt).
//!
//! Both share one `Arc<Model>` (the decoder is immutable and `Sync`). A training step cannot be
//! interrupted part-way, so instead of interleaving generation between training steps on one
//! thread, generation has its own thread: it is never blocked behind a training job, at the cost
//! of sharing the cores with it while both run. A full queue is refused at once (HTTP 429).
//!
//! The engine keeps no records: an absorb job reports its progress and outcome to the
//! [`JobEvents`] it was started with (the service's document records), a generation answers
//! through its own channels.

mod jobs;

pub use jobs::{AbsorbJob, AbsorbOutcome, GenerateJob, Generated, JobEvents, JobProgress, JobUpdate, Prompt};

use crate::model::Model;
use crate::store::Store;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

/// Model work the engine runs.
pub enum Job {
    Absorb(AbsorbJob),
    Generate(GenerateJob),
    /// Holds its thread until the paired sender is dropped: pauses a lane with the model idle
    /// (maintenance; tests use it to fill a queue deterministically).
    Hold { lane: Lane, until: std::sync::mpsc::Receiver<()> },
}

/// Which thread (and queue) a job runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    Train,
    Generate,
}

impl Job {
    pub fn lane(&self) -> Lane {
        match self {
            Job::Absorb(_) => Lane::Train,
            Job::Generate(_) => Lane::Generate,
            Job::Hold { lane, .. } => *lane,
        }
    }
}

/// What the engine refuses or fails with: queueing (`submit`) and generating (a job's reply).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The queue is full: try again later (429).
    #[error("the queue is full")]
    QueueFull,
    /// The engine is shutting down (503).
    #[error("the engine is shutting down")]
    Closed,
    /// A job was given to the reservation of the other lane (a bug).
    #[error("the job belongs to the other queue")]
    WrongLane,
    /// The document was deleted while the request waited.
    #[error("no document '{0}'")]
    UnknownDocument(String),
    #[error(transparent)]
    ContextLength(#[from] crate::model::generate::ContextLengthExceeded),
    /// Anything else: a server-side failure (details for the log).
    #[error("{0}")]
    Failed(String),
}

impl From<anyhow::Error> for EngineError {
    fn from(e: anyhow::Error) -> Self {
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
}

struct Worker {
    lane: Lane,
    tx: Mutex<Option<SyncSender<Job>>>,
    capacity: usize,
    /// Jobs waiting (not yet started), and places reserved for jobs about to be submitted.
    depth: Arc<AtomicUsize>,
    /// Jobs running (0 or 1).
    busy: Arc<AtomicUsize>,
    handle: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Worker {
    fn start(lane: Lane, ctx: Arc<Context>, capacity: usize) -> std::io::Result<Self> {
        let capacity = capacity.max(1);
        let (tx, rx) = sync_channel::<Job>(capacity);
        let depth = Arc::new(AtomicUsize::new(0));
        let busy = Arc::new(AtomicUsize::new(0));
        let (d, b) = (depth.clone(), busy.clone());
        let name = match lane {
            Lane::Train => "lift-train",
            Lane::Generate => "lift-generate",
        };
        let handle = std::thread::Builder::new().name(name.to_string()).spawn(move || {
            while let Ok(job) = rx.recv() {
                d.fetch_sub(1, Ordering::SeqCst);
                b.store(1, Ordering::SeqCst);
                // A panic in one job must not take the worker down.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&ctx, job))).is_err() {
                    tracing::error!(thread = name, "engine job panicked");
                }
                b.store(0, Ordering::SeqCst);
            }
        })?;
        Ok(Self { lane, tx: Mutex::new(Some(tx)), capacity, depth, busy, handle: Mutex::new(Some(handle)) })
    }

    /// Takes a place in the queue, or says why there is none. `depth` never exceeds the channel's
    /// capacity, so a reserved place can always be filled.
    fn reserve(&self) -> Result<Reservation<'_>, EngineError> {
        if self.tx.lock().map_err(|_| EngineError::Closed)?.is_none() {
            return Err(EngineError::Closed);
        }
        self.depth
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| (d < self.capacity).then_some(d + 1))
            .map_err(|_| EngineError::QueueFull)?;
        Ok(Reservation { worker: self, used: false })
    }

    fn queue(&self) -> (usize, usize) {
        (self.depth.load(Ordering::SeqCst), self.busy.load(Ordering::SeqCst))
    }

    fn close(&self) -> Option<std::thread::JoinHandle<()>> {
        if let Ok(mut g) = self.tx.lock() {
            g.take();
        }
        self.handle.lock().ok().and_then(|mut h| h.take())
    }
}

fn run(ctx: &Context, job: Job) {
    match job {
        Job::Absorb(job) => jobs::absorb(&ctx.model, &ctx.store, &*ctx.events, job),
        Job::Generate(job) => jobs::generate(&ctx.model, &ctx.store, &*ctx.events, job),
        Job::Hold { until, .. } => while until.recv().is_ok() {},
    }
}

/// A place held in a queue (see [`Engine::reserve`]); given back when dropped unused.
pub struct Reservation<'a> {
    worker: &'a Worker,
    used: bool,
}

impl Reservation<'_> {
    pub fn submit(mut self, job: Job) -> Result<(), EngineError> {
        if job.lane() != self.worker.lane {
            return Err(EngineError::WrongLane);
        }
        let guard = self.worker.tx.lock().map_err(|_| EngineError::Closed)?;
        let tx = guard.as_ref().ok_or(EngineError::Closed)?;
        match tx.try_send(job) {
            Ok(()) => {
                self.used = true;
                Ok(())
            }
            Err(TrySendError::Full(_)) => Err(EngineError::QueueFull),
            Err(TrySendError::Disconnected(_)) => Err(EngineError::Closed),
        }
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.used {
            self.worker.depth.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

pub struct Engine {
    pub model: Arc<Model>,
    train: Worker,
    gen: Worker,
}

impl Engine {
    /// Starts both threads. Absorb jobs save into `store` and report to `events`; generations
    /// read their documents from `store`.
    pub fn start(
        model: Arc<Model>,
        store: Arc<Store>,
        events: Arc<dyn JobEvents>,
        train_capacity: usize,
        gen_capacity: usize,
    ) -> std::io::Result<Self> {
        let ctx = Arc::new(Context { model: model.clone(), store, events });
        Ok(Self {
            train: Worker::start(Lane::Train, ctx.clone(), train_capacity)?,
            gen: Worker::start(Lane::Generate, ctx, gen_capacity)?,
            model,
        })
    }

    fn worker(&self, lane: Lane) -> &Worker {
        match lane {
            Lane::Train => &self.train,
            Lane::Generate => &self.gen,
        }
    }

    /// Queues `job` on its lane.
    pub fn submit(&self, job: Job) -> Result<(), EngineError> {
        self.worker(job.lane()).reserve()?.submit(job)
    }

    /// Holds a place in a queue, so that a request is refused (429) before it writes anything.
    pub fn reserve(&self, lane: Lane) -> Result<Reservation<'_>, EngineError> {
        self.worker(lane).reserve()
    }

    /// (waiting, running) training jobs.
    pub fn train_queue(&self) -> (usize, usize) {
        self.train.queue()
    }

    /// (waiting, running) generation requests.
    pub fn generate_queue(&self) -> (usize, usize) {
        self.gen.queue()
    }

    /// Stops accepting work; the workers finish what they hold and exit. Returns their handles.
    pub fn close(&self) -> Vec<std::thread::JoinHandle<()>> {
        [self.train.close(), self.gen.close()].into_iter().flatten().collect()
    }
}
