//! The engine owns the base model and runs all model work on two dedicated OS threads, each fed
//! by a bounded queue:
//! - the **training** thread runs absorption jobs one at a time (training a second document
//!   concurrently would only oversubscribe the cores);
//! - the **generation** thread runs `/ask` and chat requests one at a time.
//!
//! Both share one `Arc<Model>` (the decoder is immutable and `Sync`). A training step cannot be
//! interrupted part-way, so instead of interleaving generation between training steps on one
//! thread, generation has its own thread: it is never blocked behind a training job, at the cost
//! of sharing the cores with it while both run. A full queue is refused at once (HTTP 429).

use crate::model::Model;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

/// A unit of model work.
pub type Task = Box<dyn FnOnce(&Model) + Send + 'static>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// The queue is full: try again later (429).
    Full,
    /// The engine is shutting down (503).
    Closed,
}

struct Worker {
    tx: Mutex<Option<SyncSender<Task>>>,
    capacity: usize,
    /// Tasks waiting (not yet started), and places reserved for tasks about to be submitted.
    depth: Arc<AtomicUsize>,
    /// Tasks running (0 or 1).
    busy: Arc<AtomicUsize>,
    handle: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Worker {
    fn start(name: &str, model: Arc<Model>, capacity: usize) -> std::io::Result<Self> {
        let capacity = capacity.max(1);
        let (tx, rx) = sync_channel::<Task>(capacity);
        let depth = Arc::new(AtomicUsize::new(0));
        let busy = Arc::new(AtomicUsize::new(0));
        let (d, b) = (depth.clone(), busy.clone());
        let handle = std::thread::Builder::new().name(name.to_string()).spawn(move || {
            while let Ok(task) = rx.recv() {
                d.fetch_sub(1, Ordering::SeqCst);
                b.store(1, Ordering::SeqCst);
                // A panic in one task must not take the worker down.
                let model = &*model;
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(model))).is_err() {
                    tracing::error!("engine task panicked");
                }
                b.store(0, Ordering::SeqCst);
            }
        })?;
        Ok(Self { tx: Mutex::new(Some(tx)), capacity, depth, busy, handle: Mutex::new(Some(handle)) })
    }

    /// Takes a place in the queue, or says why there is none. `depth` never exceeds the channel's
    /// capacity, so a reserved place can always be filled.
    fn reserve(&self) -> Result<Reservation<'_>, SubmitError> {
        if self.tx.lock().map_err(|_| SubmitError::Closed)?.is_none() {
            return Err(SubmitError::Closed);
        }
        self.depth
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| (d < self.capacity).then_some(d + 1))
            .map_err(|_| SubmitError::Full)?;
        Ok(Reservation { worker: self, used: false })
    }

    fn submit(&self, task: Task) -> Result<(), SubmitError> {
        self.reserve()?.submit(task)
    }

    fn close(&self) -> Option<std::thread::JoinHandle<()>> {
        if let Ok(mut g) = self.tx.lock() {
            g.take();
        }
        self.handle.lock().ok().and_then(|mut h| h.take())
    }
}

/// A place held in a queue (see `Engine::reserve_train`); given back when dropped unused.
pub struct Reservation<'a> {
    worker: &'a Worker,
    used: bool,
}

impl Reservation<'_> {
    pub fn submit(mut self, task: Task) -> Result<(), SubmitError> {
        let guard = self.worker.tx.lock().map_err(|_| SubmitError::Closed)?;
        let tx = guard.as_ref().ok_or(SubmitError::Closed)?;
        match tx.try_send(task) {
            Ok(()) => {
                self.used = true;
                Ok(())
            }
            Err(TrySendError::Full(_)) => Err(SubmitError::Full),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::Closed),
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
    pub fn start(model: Arc<Model>, train_capacity: usize, gen_capacity: usize) -> std::io::Result<Self> {
        Ok(Self {
            train: Worker::start("lift-train", model.clone(), train_capacity)?,
            gen: Worker::start("lift-generate", model.clone(), gen_capacity)?,
            model,
        })
    }

    pub fn submit_train(&self, task: Task) -> Result<(), SubmitError> {
        self.train.submit(task)
    }

    /// Holds a place in the training queue, so that a request is refused (429) before it
    /// writes anything.
    pub fn reserve_train(&self) -> Result<Reservation<'_>, SubmitError> {
        self.train.reserve()
    }

    pub fn submit_generate(&self, task: Task) -> Result<(), SubmitError> {
        self.gen.submit(task)
    }

    /// (waiting, running) training jobs.
    pub fn train_queue(&self) -> (usize, usize) {
        (self.train.depth.load(Ordering::SeqCst), self.train.busy.load(Ordering::SeqCst))
    }

    /// (waiting, running) generation requests.
    pub fn generate_queue(&self) -> (usize, usize) {
        (self.gen.depth.load(Ordering::SeqCst), self.gen.busy.load(Ordering::SeqCst))
    }

    /// Stops accepting work; the workers finish what they hold and exit. Returns their handles.
    pub fn close(&self) -> Vec<std::thread::JoinHandle<()>> {
        [self.train.close(), self.gen.close()].into_iter().flatten().collect()
    }
}
