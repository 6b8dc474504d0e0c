//! Where absorbs keep their checkpoints (what a checkpoint holds and how a run resumes from it:
//! `lift::absorb::checkpoint`): one file of the store's directory, or one blob of the shared store with
//! replicas, replaced whole by each new checkpoint.

use super::blobs::Blobs;
use super::{write_atomic, Store};
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::time::Duration;

/// Seconds between an absorb's checkpoints by default: a stop costs at most this much training.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(120);

/// Where one absorb's checkpoint is kept. `load` answers the last one saved (none: start afresh).
pub trait CheckpointStore {
    fn load(&self) -> Result<Option<Vec<u8>>>;
    fn save(&self, bytes: Vec<u8>) -> Result<()>;
}

/// A checkpoint kept as one file, replaced atomically (temporary file, then rename).
pub struct FileCheckpoint(pub PathBuf);

impl CheckpointStore for FileCheckpoint {
    fn load(&self) -> Result<Option<Vec<u8>>> {
        match std::fs::read(&self.0) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("{}: cannot read", self.0.display())),
        }
    }

    fn save(&self, bytes: Vec<u8>) -> Result<()> {
        write_atomic(&self.0, &bytes)
    }
}

/// A checkpoint in the shared blob store: any replica that takes the job over reads it.
struct BlobCheckpoint<'a>(&'a Blobs, String);

impl CheckpointStore for BlobCheckpoint<'_> {
    fn load(&self) -> Result<Option<Vec<u8>>> {
        Ok(self.0.block_on(self.0.get_checkpoint(&self.1))?.map(|bytes| bytes.to_vec()))
    }

    fn save(&self, bytes: Vec<u8>) -> Result<()> {
        self.0.block_on(self.0.put_checkpoint(&self.1, bytes.into()))
    }
}

impl Store {
    /// Absorbs write a checkpoint every `interval` (and where their segment stage ends; zero: no
    /// checkpoints).
    pub fn with_checkpoint_interval(mut self, interval: Duration) -> Self {
        self.checkpoint_interval = interval;
        self
    }

    pub fn checkpoint_interval(&self) -> Duration {
        self.checkpoint_interval
    }

    /// Where the absorb of `id` keeps its checkpoint (None: checkpoints are off): with a shared
    /// blob store, a blob beside the adapters; else `<id>.checkpoint.safetensors` in the store's
    /// directory. Called from the engine's threads (a blob is read and written blocking).
    pub fn checkpoint(&self, id: &str) -> Option<Box<dyn CheckpointStore + '_>> {
        if self.checkpoint_interval.is_zero() {
            return None;
        }
        Some(match &self.blobs {
            Some(b) => Box::new(BlobCheckpoint(b, id.to_string())),
            None => Box::new(FileCheckpoint(self.checkpoint_path(id))),
        })
    }

    pub(super) fn checkpoint_path(&self, id: &str) -> PathBuf {
        self.root.join(format!("{id}.checkpoint.safetensors"))
    }

    /// Removes the checkpoint of `id` (its adapter is saved, its job failed, or the document is
    /// deleted).
    pub fn drop_checkpoint(&self, id: &str) {
        let removed = match &self.blobs {
            Some(b) => b.block_on(b.delete_checkpoint(id)),
            None => match std::fs::remove_file(self.checkpoint_path(id)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
                _ => Ok(()),
            },
        };
        if let Err(e) = removed {
            tracing::warn!(id, error = %format!("{e:#}"), "cannot remove the absorb's checkpoint");
        }
    }
}
