//! Test support (unit tests and the `testing` feature): a tiny randomly-initialised model written
//! to disk in Hugging Face and GGUF form (`tiny_model.rs`), real PDFs (`pdf.rs`), office packages
//! (`packages`), hostile uploads (`hostile`), throwaway PostgreSQL clusters (`pg_cluster.rs`);
//! here, an in-memory absorb checkpoint, holds on the engine's lanes and adapter comparison.

pub mod hostile;
pub mod packages;
mod pdf;
mod pg_cluster;
mod tiny_model;

pub use crate::adapters::init::Rng;
pub use pdf::*;
pub use pg_cluster::*;
pub use tiny_model::*;
use anyhow::Result;

/// An absorb checkpoint kept in memory (tests of resumable absorbs); clones share it.
#[derive(Clone, Default)]
pub struct MemoryCheckpoint(pub std::rc::Rc<std::cell::RefCell<Option<Vec<u8>>>>);

impl crate::lift::absorb::checkpoint::CheckpointStore for MemoryCheckpoint {
    fn load(&self) -> Result<Option<Vec<u8>>> {
        Ok(self.0.borrow().clone())
    }
    fn save(&self, bytes: Vec<u8>) -> Result<()> {
        *self.0.borrow_mut() = Some(bytes);
        Ok(())
    }
}

/// Holding an engine thread with the model idle: what a test posts meanwhile stays queued, so a
/// queue fills (or a document stays unstarted) deterministically. The hold takes a place in the
/// lane's queue like a job, then counts as the lane's running job until `until`'s sender is dropped.
impl crate::engine::Engine {
    pub fn hold_training(&self, until: std::sync::mpsc::Receiver<()>) -> Result<(), crate::engine::EngineError> {
        self.train.call(move || while until.recv().is_ok() {})
    }

    pub fn hold_generation(&self, until: std::sync::mpsc::Receiver<()>) -> Result<(), crate::engine::EngineError> {
        self.gen.call(move || while until.recv().is_ok() {})
    }
}

/// The largest absolute difference between two adapters' tensors (the same names in the same
/// order).
pub fn max_adapter_diff(a: &crate::adapters::AdapterBundle, b: &crate::adapters::AdapterBundle) -> f32 {
    let (ta, tb) = (a.named_tensors(), b.named_tensors());
    assert_eq!(ta.len(), tb.len());
    ta.iter()
        .zip(&tb)
        .map(|((na, x), (nb, y))| {
            assert_eq!(na, nb);
            (x - y).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
        })
        .fold(0.0, f32::max)
}
