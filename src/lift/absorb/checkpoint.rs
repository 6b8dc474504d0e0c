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
//! is refused with the reason, and the absorb starts from step 0. So is a damaged one (cut short,
//! a byte changed): the header carries the SHA-256 of the checkpoint's content, checked on read.

use super::qa::QaPair;
use super::trainer::{Cursor, TrainCheckpoint};
use crate::lift::options::AbsorbOptions;
use crate::document::Document;
use crate::model::Model;
use anyhow::{Context, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::Duration;

/// The checkpoint header's key, and its layout's version (2: with [`HASH_KEY`]).
const META_KEY: &str = "lift_checkpoint";
const FORMAT: u32 = 2;
/// The header key of the checkpoint's content hash: SHA-256 of the header (`META_KEY`'s JSON)
/// and the tensors' bytes, as adapters carry theirs. A checkpoint cut short or with a byte
/// changed is refused, and its absorb starts over, rather than resumed from wrong numbers.
const HASH_KEY: &str = "lift_checkpoint_sha256";
/// Written in the hash's place first; the same length, so the hash replaces it in the bytes.
const HASH_PLACEHOLDER: &str = "0000000000000000000000000000000000000000000000000000000000000000";

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

/// A checkpoint whose bytes do not match the hash it was written with (cut short, a byte
/// changed): dropped with a warning, and its absorb starts over.
#[derive(Debug, thiserror::Error)]
#[error("the checkpoint is damaged: {0}")]
pub struct DamagedCheckpoint(pub String);

/// The tensors' bytes of a safetensors file: what follows its 8-byte length and JSON header.
fn data_section(bytes: &[u8]) -> Result<&[u8]> {
    let n = bytes.get(..8).context("not a checkpoint (shorter than a header)")?;
    let n = u64::from_le_bytes(n.try_into()?) as usize;
    bytes.get(8usize.saturating_add(n)..).ok_or_else(|| DamagedCheckpoint("cut short inside its header".into()).into())
}

/// SHA-256 of the header's JSON (length-prefixed) and the tensors' bytes.
fn content_sha256(header_json: &str, data: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update((header_json.len() as u64).to_le_bytes());
    h.update(header_json.as_bytes());
    h.update(data);
    hex::encode(h.finalize())
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
        let json = serde_json::to_string(&header)?;
        let meta = HashMap::from([(META_KEY.to_string(), json.clone()), (HASH_KEY.to_string(), HASH_PLACEHOLDER.to_string())]);
        let mut bytes = crate::adapters::manifest::safetensors_bytes(train.tensors, meta)?;
        let sha = content_sha256(&json, data_section(&bytes)?);
        // The key and its quoted value appear once: in the header's metadata (any text of the
        // checkpoint's own JSON is escaped inside a string).
        let needle = format!("\"{HASH_KEY}\":\"{HASH_PLACEHOLDER}\"");
        let header_end = bytes.len() - data_section(&bytes)?.len();
        let at = bytes[..header_end]
            .windows(needle.len())
            .position(|w| w == needle.as_bytes())
            .context("the checkpoint's hash has no place in its header")?;
        let value_at = at + needle.len() - HASH_PLACEHOLDER.len() - 1;
        bytes[value_at..value_at + HASH_PLACEHOLDER.len()].copy_from_slice(sha.as_bytes());
        Ok(bytes)
    }

    /// Reads [`Checkpoint::encode`]'s bytes, its tensors onto `device`, after checking them
    /// against their hash ([`DamagedCheckpoint`] otherwise).
    pub fn decode(bytes: &[u8], device: &candle_core::Device) -> Result<Self> {
        let damaged = |why: String| anyhow::Error::new(DamagedCheckpoint(why));
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| damaged(format!("unreadable header, or cut short ({e})")))?;
        let json = meta.metadata().as_ref().and_then(|m| m.get(META_KEY)).context("not an absorb checkpoint")?;
        let header: Header = serde_json::from_str(json).map_err(|e| damaged(format!("its header is invalid ({e})")))?;
        anyhow::ensure!(header.format == FORMAT, "checkpoint layout {} (this version reads {FORMAT})", header.format);
        let want = meta.metadata().as_ref().and_then(|m| m.get(HASH_KEY)).context("the checkpoint carries no content hash")?;
        let sha = content_sha256(json, data_section(bytes)?);
        if &sha != want {
            return Err(damaged(format!("its content (sha256 {sha}) does not match the hash it was written with ({want})")));
        }
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
