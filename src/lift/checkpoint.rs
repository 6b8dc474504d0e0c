//! Resumable absorbs. A long absorb writes a checkpoint (the adapter's parameters, AdamW's
//! moments and step count, the trainer's [`Cursor`]: step, epoch, the seeded stream's position,
//! the report so far; and the auxiliary QA pairs, so a resume never generates them again) every
//! `interval` and when the segment stage ends. A stopped absorb (restart, SIGTERM, `kill -9`, a
//! replica's lost lease) continues from its last checkpoint and ends with the adapter an
//! uninterrupted run makes.
//!
//! A checkpoint is one safetensors file: the tensors, and in its header what the run was
//! (the [`Identity`]) and where it stood. Where it is kept is the caller's
//! ([`CheckpointStore`]): the adapter store's file or shared blob, the CLI's output directory.
//! A checkpoint of another run (another base model, options, document, plan or program version)
//! is refused with the reason, and the absorb starts from step 0.

use super::qa::QaPair;
use super::trainer::{Cursor, TrainCheckpoint};
use super::AbsorbOptions;
use crate::document::Document;
use crate::model::Model;
use anyhow::{Context, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::Duration;

/// The checkpoint header's key, and its layout's version.
const META_KEY: &str = "lift_checkpoint";
const FORMAT: u32 = 1;

pub use crate::store::checkpoints::{CheckpointStore, FileCheckpoint, DEFAULT_INTERVAL};

/// An absorb's checkpoints: where they go and how often.
pub struct Resumable<'a> {
    pub store: Box<dyn CheckpointStore + 'a>,
    pub interval: Duration,
}

/// What a checkpoint was made by; a run resumes only its own.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Identity {
    /// The program's version: a newer one may plan or train otherwise.
    pub version: String,
    /// The base model's fingerprint and its prepared base.
    pub base_model: String,
    pub prepared_base: Option<String>,
    /// The document's text hash and token count.
    pub document_sha256: String,
    pub document_tokens: usize,
    /// The absorb options as the manifest records them.
    pub options: serde_json::Value,
}

impl Identity {
    pub fn of(model: &Model, document: &Document, opts: &AbsorbOptions) -> Result<Self> {
        let r = crate::adapters::manifest::DocumentRef::new(&document.text, document.len(), None);
        Ok(Self {
            version: env!("CARGO_PKG_VERSION").to_string(),
            base_model: model.info.fingerprint.clone(),
            prepared_base: model.info.prepared_base.clone(),
            document_sha256: r.sha256,
            document_tokens: r.tokens,
            options: serde_json::to_value(opts)?,
        })
    }

    /// Why a checkpoint made by `other` cannot continue this run (None: it can).
    pub fn mismatch(&self, other: &Identity) -> Option<String> {
        let what = if self.version != other.version {
            format!("lift-serve {} (this is {})", other.version, self.version)
        } else if self.base_model != other.base_model || self.prepared_base != other.prepared_base {
            "another base model or prepared base".to_string()
        } else if self.document_sha256 != other.document_sha256 || self.document_tokens != other.document_tokens {
            "another document".to_string()
        } else if self.options != other.options {
            "other absorb options".to_string()
        } else {
            return None;
        };
        Some(format!("the checkpoint was made by {what}"))
    }
}

/// The checkpoint's header.
#[derive(Serialize, Deserialize)]
struct Header {
    format: u32,
    identity: Identity,
    /// The auxiliary QA pairs (all of them, probes included) and the seconds they took.
    qa: Vec<QaPair>,
    qa_seconds: f64,
    cursor: Cursor,
}

/// A checkpoint read back: the run it belongs to, its QA pairs and the trainer's state.
pub struct Checkpoint {
    pub identity: Identity,
    pub qa: Vec<QaPair>,
    pub qa_seconds: f64,
    pub train: TrainCheckpoint,
}

impl Checkpoint {
    /// The checkpoint's bytes: one safetensors file, its header holding the rest.
    pub fn encode(identity: &Identity, qa: &[QaPair], qa_seconds: f64, train: TrainCheckpoint) -> Result<Vec<u8>> {
        let header = Header { format: FORMAT, identity: identity.clone(), qa: qa.to_vec(), qa_seconds, cursor: train.cursor };
        let meta = HashMap::from([(META_KEY.to_string(), serde_json::to_string(&header)?)]);
        crate::adapters::manifest::safetensors_bytes(train.tensors, meta)
    }

    /// Reads [`Checkpoint::encode`]'s bytes, its tensors onto `device`.
    pub fn decode(bytes: &[u8], device: &candle_core::Device) -> Result<Self> {
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).context("not a checkpoint (unreadable header)")?;
        let json = meta.metadata().as_ref().and_then(|m| m.get(META_KEY)).context("not an absorb checkpoint")?;
        let header: Header = serde_json::from_str(json).context("the checkpoint's header is invalid")?;
        anyhow::ensure!(header.format == FORMAT, "checkpoint layout {} (this version reads {FORMAT})", header.format);
        let tensors: HashMap<String, Tensor> = candle_core::safetensors::load_buffer(bytes, device)?;
        let train = TrainCheckpoint { cursor: header.cursor, tensors };
        Ok(Self { identity: header.identity, qa: header.qa, qa_seconds: header.qa_seconds, train })
    }

    /// The checkpoint `store` holds for the run `identity`, if it has one that run can continue;
    /// a checkpoint of another run, or one that cannot be read, is refused with the reason
    /// (`Err`), and the run starts afresh.
    pub fn find(store: &dyn CheckpointStore, identity: &Identity, device: &candle_core::Device) -> Result<Option<Checkpoint>, String> {
        let bytes = match store.load() {
            Ok(None) => return Ok(None),
            Ok(Some(b)) => b,
            Err(e) => return Err(format!("the checkpoint cannot be read: {e:#}")),
        };
        let ckpt = Checkpoint::decode(&bytes, device).map_err(|e| format!("{e:#}"))?;
        match identity.mismatch(&ckpt.identity) {
            Some(why) => Err(why),
            None => Ok(Some(ckpt)),
        }
    }
}
