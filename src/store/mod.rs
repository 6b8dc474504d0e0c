//! Content-addressed adapter store on disk with a bounded in-memory cache.
//!
//! Layout under the root directory (default `adapters/`):
//! ```text
//! <root>/<id>/              adapter.safetensors, manifest.json, document.txt, document.tokens,
//!                           qa.json (manifest::save, atomic; see `save_dir`)
//! <root>/<id>.job.json      the document's record: owner, title, status, error (temp file + rename)
//! <root>/<id>.pending.txt   the document's text while it has no adapter: queued, training or
//!                           failed (a failed document answers from its passages; atomic)
//! ```
//! The record is kept beside the adapter directory, not in it, because `manifest::save` publishes
//! a whole directory atomically and refuses to replace one that is not an adapter. On start,
//! records left `queued` or `training` (by a process that died, or one that shut down mid-job)
//! become `ready` when the adapter was saved, are re-queued when their pending text is there, and
//! are marked `failed` with the reason otherwise: never silently lost.

pub mod blobs;
pub mod checkpoints;

use crate::adapters::{manifest, AdapterBundle, Manifest};
use blobs::{BlobRef, Blobs};
use crate::document::{tokens_from_bytes, Document};
use crate::model::Model;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Queued,
    Training,
    Ready,
    Failed,
    Cancelled,
    /// The saved adapter no longer matches the hash it was saved with (cut short, a byte
    /// changed): it is not served; posting the same text and options absorbs it again.
    Damaged,
}

impl Status {
    pub fn is_terminal(self) -> bool {
        matches!(self, Status::Ready | Status::Failed | Status::Cancelled | Status::Damaged)
    }
    pub fn name(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Training => "training",
            Status::Ready => "ready",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
            Status::Damaged => "damaged",
        }
    }
}

/// Adapter facts shown in the Document object.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AdapterInfo {
    pub kind: String,
    pub parameters: usize,
    pub bytes: usize,
}

/// `<id>.job.json`: everything about a document except the adapter itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: String,
    /// Tenant (hash of the API key); None when the server runs without keys.
    pub owner: Option<String>,
    pub title: Option<String>,
    pub status: Status,
    pub tokens: usize,
    pub created_at: u64,
    /// Posting order: nanoseconds since the epoch, unique and increasing within a process (see
    /// `next_seq`). 0 in records written before it existed; those sort by `created_at`.
    #[serde(default)]
    pub seq: u64,
    pub ready_at: Option<u64>,
    pub error: Option<String>,
    pub adapter: Option<AdapterInfo>,
    /// Effective absorb options: with a time budget, the plan fitted to the rate measured when
    /// the document was posted. The job trains with them and a resume reuses them.
    pub options: serde_json::Value,
    /// The absorb options as asked (budget included, before any fitting): what the id is made
    /// of, so that the same text and options keep one id at any measured rate. None in records
    /// written before ids were made from them: their id is of `options` ([`JobRecord::id_options`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested: Option<serde_json::Value>,
    /// How the text was made from what was uploaded (records before it existed have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<crate::formats::Source>,
    /// Once ready: the training figures of the adapter's manifest (steps, QA pairs, seconds, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training: Option<serde_json::Value>,
    /// When a question last named it (seconds; written at most once a minute): after a base
    /// upgrade, the documents asked most recently are absorbed again first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_asked_at: Option<u64>,
    /// While it is absorbed again over the server's new base: the base its saved adapter was
    /// made over (model and prepared base). Cleared when the new adapter is saved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reabsorbing_from: Option<String>,
}

impl JobRecord {
    /// The options the record's id was made of.
    pub fn id_options(&self) -> &serde_json::Value {
        self.requested.as_ref().unwrap_or(&self.options)
    }

    /// Sort key in posting order (`created_at` has whole seconds only).
    pub fn posting_order(&self) -> (u64, &str) {
        let seq = if self.seq > 0 { self.seq } else { self.created_at.saturating_mul(1_000_000_000) };
        (seq, &self.id)
    }
}

/// A posting sequence number: the time in nanoseconds, bumped past the last one handed out so
/// that two posts in the same clock tick keep their order.
pub fn next_seq() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let next = |last: u64| now.max(last + 1);
    let last = LAST.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| Some(next(l))).unwrap_or_else(|l| l);
    next(last)
}

/// A record read back at start; `requeue_text` is the kept text of an interrupted job, or of a
/// document whose adapter was made over another base (`rec.reabsorbing_from` set: it is absorbed
/// again).
pub struct Recovered {
    pub rec: JobRecord,
    pub requeue_text: Option<String>,
}

/// Everything an answer needs about one absorbed document: its adapter, manifest and document
/// (text and token ids as absorbed).
pub struct Loaded {
    pub bundle: AdapterBundle,
    pub manifest: Manifest,
    pub document: Arc<Document>,
}

impl Loaded {
    /// How far the adapter's training went: (steps run, steps planned), from its manifest.
    pub fn steps(&self) -> (usize, usize) {
        let t = &self.manifest.training;
        let steps = t["steps"].as_u64().unwrap_or(0) as usize;
        (steps, t["planned_steps"].as_u64().map_or(steps, |n| n as usize))
    }
}

/// A document that has no saved adapter yet (queued, training, failed or cancelled), or whose
/// saved adapter was made over another base: it answers from its passages, and with the latest
/// adapter snapshot its training published.
pub struct LiveDocument {
    pub document: Arc<Document>,
    snapshot: std::sync::RwLock<Option<Arc<Snapshot>>>,
    /// A saved adapter was in the store when the document went live: one made over another base,
    /// being replaced (answers read the live document, not it).
    pub replaces_saved: bool,
}

/// An adapter part-way through training, as answers use it.
pub struct Snapshot {
    pub adapter: crate::adapters::AnyAdapter,
    pub step: usize,
    pub planned_steps: usize,
}

impl LiveDocument {
    pub fn snapshot(&self) -> Option<Arc<Snapshot>> {
        self.snapshot.read().ok().and_then(|s| s.clone())
    }
}

/// An adapter to save: the absorbed adapter, its manifest, its document and the auxiliary QA
/// pairs it was trained on (JSON, kept for inspection).
pub struct NewAdapter {
    pub bundle: AdapterBundle,
    pub manifest: Manifest,
    pub document: Arc<Document>,
    pub qa_json: Vec<u8>,
}

/// Writes an adapter directory atomically (`manifest::save`): the adapter, its manifest, the
/// document's text and token ids, and the QA pairs. Used by the store and by `lift-serve absorb`.
pub fn save_dir(dir: &Path, a: NewAdapter) -> Result<Loaded> {
    let tokens = a.document.tokens_to_bytes();
    manifest::save(
        dir,
        &a.bundle,
        &a.manifest,
        &[
            (manifest::DOCUMENT_FILE, a.document.text.as_bytes()),
            (manifest::TOKENS_FILE, &tokens),
            (manifest::QA_FILE, &a.qa_json),
        ],
    )?;
    Ok(Loaded { bundle: a.bundle, manifest: a.manifest, document: a.document })
}

/// Reads an adapter directory for `model` (blocking): the checked adapter and manifest
/// (`manifest::load`) and the document with the token ids saved beside it. Adapters saved before
/// ids were stored have their text tokenized again.
pub fn load_dir(dir: &Path, model: &Model) -> Result<Loaded> {
    let (bundle, manifest) = manifest::load(dir, model)?;
    let text = std::fs::read_to_string(dir.join(manifest::DOCUMENT_FILE))
        .with_context(|| format!("{}: cannot read the document", dir.display()))?;
    let document = match std::fs::read(dir.join(manifest::TOKENS_FILE)) {
        Ok(bytes) => {
            let tokens = tokens_from_bytes(&bytes, manifest.document.tokens)
                .with_context(|| format!("{}: {}", dir.display(), manifest::TOKENS_FILE))?;
            Document::from_tokens(text, tokens)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Document::encode(model, text)?,
        Err(e) => return Err(e).with_context(|| format!("{}: cannot read the token ids", dir.display())),
    };
    Ok(Loaded { bundle, manifest, document: Arc::new(document) })
}

#[derive(Default)]
pub struct CacheStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
}

/// The adapters of one process: its directory and the loaded ones held in memory. With `blobs`
/// (replicas sharing an adapter store) the directory is this replica's local cache of the shared
/// archives: an adapter is fetched (and verified) on first use, and `<id>.blob` beside its
/// directory names the archive it was unpacked from, so that a stale copy is never served.
pub struct Store {
    root: PathBuf,
    /// Keyed by document id, or `id@sha256` with shared blobs.
    cache: moka::sync::Cache<String, Arc<Loaded>>,
    pub stats: Arc<CacheStats>,
    blobs: Option<Arc<Blobs>>,
    /// Documents without a saved adapter that this process can answer about.
    live: std::sync::RwLock<std::collections::HashMap<String, Arc<LiveDocument>>>,
    /// Seconds between an absorb's checkpoints.
    checkpoint_interval: std::time::Duration,
}

pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A base as people read it: the model and its prepared base.
pub fn base_name(b: &manifest::BaseModelRef) -> String {
    match &b.prepared_base {
        Some(p) => format!("model '{}' with prepared base '{p}'", b.id),
        None => format!("model '{}' without a prepared base", b.id),
    }
}

/// `doc_<hex>`: SHA-256 of the base model's fingerprint, the owner, the text and the canonical
/// JSON of the options as asked (serde_json maps are sorted, so `to_string` is canonical). Records
/// written before then hashed the options fitted to a time budget (the same without one).
pub fn document_id(fingerprint: &str, owner: Option<&str>, text: &str, options: &serde_json::Value) -> String {
    let mut h = Sha256::new();
    for part in [fingerprint.as_bytes(), owner.unwrap_or("").as_bytes(), text.as_bytes(), options.to_string().as_bytes()] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    format!("doc_{}", hex::encode(&h.finalize()[..16]))
}

/// What a client is told about a damaged adapter (the API's `adapter_damaged` and the document's
/// `error`): which document, and the way back. No paths: those go to the log.
pub fn damaged_message(id: &str) -> String {
    format!(
        "the adapter of document {id} is damaged (its file no longer matches the hash it was saved with); \
         POST the document's text again with the same options to absorb it again under the same id"
    )
}

/// Whether `e` says an adapter's files are damaged ([`manifest::AdapterDamaged`]).
pub fn is_damaged(e: &anyhow::Error) -> bool {
    e.downcast_ref::<manifest::AdapterDamaged>().is_some()
}

/// A well-formed document id (also keeps ids from naming paths outside the store).
pub fn valid_id(id: &str) -> bool {
    id.len() == 36 && id.starts_with("doc_") && id[4..].bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// Writes `bytes` to `path` atomically: temp file in the same directory, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let dir = path.parent().context("no parent directory")?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error).with_context(|| format!("{}: cannot write", path.display()))?;
    Ok(())
}

impl Store {
    /// Opens (creating) the store; `cache_bytes` bounds the loaded adapters held in memory.
    pub fn open(root: &Path, cache_bytes: u64) -> Result<Self> {
        std::fs::create_dir_all(root).with_context(|| format!("{}: cannot create adapters directory", root.display()))?;
        let _ = manifest::remove_stale_saves(root, std::time::Duration::from_secs(0));
        let stats = Arc::new(CacheStats::default());
        let s2 = stats.clone();
        let cache = moka::sync::Cache::builder()
            .max_capacity(cache_bytes)
            .support_invalidation_closures()
            .weigher(|_k: &String, v: &Arc<Loaded>| {
                u32::try_from((v.manifest.bytes + v.document.bytes()).max(1)).unwrap_or(u32::MAX)
            })
            .eviction_listener(move |_k, _v, cause| {
                if cause == moka::notification::RemovalCause::Size {
                    s2.evictions.fetch_add(1, Ordering::Relaxed);
                }
            })
            .build();
        let checkpoint_interval = checkpoints::DEFAULT_INTERVAL;
        Ok(Self { root: root.to_path_buf(), cache, stats, blobs: None, live: Default::default(), checkpoint_interval })
    }

    /// Serves adapters from a shared blob store (this directory becomes its local cache).
    pub fn with_blobs(mut self, blobs: Arc<Blobs>) -> Self {
        self.blobs = Some(blobs);
        self
    }

    pub fn blobs(&self) -> Option<&Arc<Blobs>> {
        self.blobs.as_ref()
    }

    fn blob_note_path(&self, id: &str) -> PathBuf {
        self.root.join(format!("{id}.blob"))
    }

    /// Records that the local directory of `id` holds the archive `blob` (written after a fetch,
    /// and by the replica that trained and published it).
    pub fn note_blob(&self, id: &str, blob: &BlobRef) -> Result<()> {
        write_atomic(&self.blob_note_path(id), blob.sha256.as_bytes())
    }

    fn local_copy_is(&self, id: &str, blob: &BlobRef) -> bool {
        std::fs::read_to_string(self.blob_note_path(id)).is_ok_and(|s| s.trim() == blob.sha256)
            && self.adapter_dir(id).join(manifest::MANIFEST_FILE).exists()
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn adapter_dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    fn record_path(&self, id: &str) -> PathBuf {
        self.root.join(format!("{id}.job.json"))
    }

    pub fn write_record(&self, rec: &JobRecord) -> Result<()> {
        write_atomic(&self.record_path(&rec.id), &serde_json::to_vec_pretty(rec)?)
    }

    fn pending_path(&self, id: &str) -> PathBuf {
        self.root.join(format!("{id}.pending.txt"))
    }

    /// Keeps a queued document's text until its adapter is saved, so that a restart can train
    /// it again (blocking).
    pub fn write_pending_text(&self, id: &str, text: &str) -> Result<()> {
        write_atomic(&self.pending_path(id), text.as_bytes())
    }

    /// The kept text of a document without an adapter (queued, training or failed), if any.
    pub fn read_pending_text(&self, id: &str) -> Option<String> {
        std::fs::read_to_string(self.pending_path(id)).ok()
    }

    /// Drops the kept text (the job ended; a saved adapter has its own copy).
    pub fn remove_pending_text(&self, id: &str) {
        let p = self.pending_path(id);
        if let Err(e) = std::fs::remove_file(&p) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove the pending text");
            }
        }
    }

    /// Every record on disk. Interrupted jobs (queued/training) are settled here: `ready` when
    /// the adapter was saved; `queued` with `requeue_text` when the text was kept (the caller
    /// re-queues it or fails it with a reason); else `failed` with the reason. A ready document
    /// whose adapter was made over another base than `base` (the fingerprint of the model served)
    /// becomes `queued` with its text and `reabsorbing_from`: its adapter stays until the new one
    /// replaces it.
    /// Settled records are rewritten; kept texts of ended jobs are removed.
    pub fn recover(&self, base: &str) -> Result<Vec<Recovered>> {
        let mut out = Vec::new();
        let (mut pending, mut checkpoints) = (Vec::new(), Vec::new());
        for entry in std::fs::read_dir(&self.root)? {
            let path = entry?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
            if let Some(id) = name.strip_suffix(".pending.txt") {
                pending.push(id.to_string());
                continue;
            }
            if let Some(id) = name.strip_suffix(".checkpoint.safetensors") {
                checkpoints.push(id.to_string());
                continue;
            }
            let Some(id) = name.strip_suffix(".job.json") else { continue };
            if !valid_id(id) {
                continue;
            }
            let mut rec: JobRecord = match std::fs::read(&path).map_err(anyhow::Error::from).and_then(|b| Ok(serde_json::from_slice(&b)?)) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable job record skipped");
                    continue;
                }
            };
            let mut requeue_text = None;
            if !rec.status.is_terminal() {
                let was = rec.status.name();
                if let Ok(m) = Manifest::read(&self.adapter_dir(id)) {
                    rec.status = Status::Ready;
                    // Set again below while the adapter is still over another base.
                    rec.reabsorbing_from = None;
                    rec.ready_at = Some(m.created_at);
                    rec.adapter = Some(AdapterInfo { kind: m.kind.to_string(), parameters: m.parameters, bytes: m.bytes });
                } else {
                    match std::fs::read_to_string(self.pending_path(id)) {
                        Ok(text) => {
                            rec.status = Status::Queued;
                            requeue_text = Some(text);
                        }
                        Err(e) => {
                            rec.status = Status::Failed;
                            rec.error = Some(format!(
                                "interrupted: the server stopped while the job was {was} and its text could not be read back ({e}); \
                                 POST the document again to retry"
                            ));
                        }
                    }
                }
                self.write_record(&rec)?;
                tracing::warn!(id, status = rec.status.name(), "settled an interrupted job");
            } else if rec.status == Status::Ready && !self.adapter_dir(id).join(manifest::MANIFEST_FILE).exists() {
                rec.status = Status::Failed;
                rec.error = Some("the adapter files are missing from the store".into());
                self.write_record(&rec)?;
            } else if rec.status == Status::Ready && self.blobs.is_none() {
                // A file cut short is seen here (no hashing at start); a changed byte when the
                // adapter is first loaded.
                if let Err(e) = manifest::check_complete(&self.adapter_dir(id)) {
                    if is_damaged(&e) {
                        tracing::warn!(id, error = %format!("{e:#}"), "damaged adapter found at start: the document is marked damaged");
                        rec.status = Status::Damaged;
                        rec.error = Some(damaged_message(id));
                        self.write_record(&rec)?;
                    }
                }
            }
            if rec.status == Status::Ready {
                if let Some(from) = self.made_over_another_base(id, base) {
                    // Kept as a pending text: a restart before the new adapter is saved trains it
                    // again, and a failed absorb still answers from its passages.
                    let text = std::fs::read_to_string(self.adapter_dir(id).join(manifest::DOCUMENT_FILE))
                        .map_err(anyhow::Error::from)
                        .and_then(|t| self.write_pending_text(id, &t).map(|_| t));
                    match text {
                        Ok(text) => {
                            rec.status = Status::Queued;
                            rec.reabsorbing_from = Some(from);
                            requeue_text = Some(text);
                            self.write_record(&rec)?;
                        }
                        Err(e) => tracing::warn!(id, error = %format!("{e:#}"), "an adapter over another base whose text cannot be read: not absorbed again"),
                    }
                }
            }
            out.push(Recovered { rec, requeue_text });
        }
        for id in checkpoints {
            // Only a job that trains again resumes its checkpoint.
            if !out.iter().any(|r| r.rec.id == id && r.requeue_text.is_some()) {
                let _ = std::fs::remove_file(self.checkpoint_path(&id));
            }
        }
        for id in pending {
            // Kept for the jobs to re-queue and for failed documents, which still answer from
            // their passages.
            let keep = |r: &Recovered| r.rec.id == id && (r.requeue_text.is_some() || r.rec.status == Status::Failed);
            if !out.iter().any(keep) {
                self.remove_pending_text(&id);
            }
        }
        out.sort_by(|a, b| a.rec.posting_order().cmp(&b.rec.posting_order()));
        Ok(out)
    }

    /// The base (model and prepared base) that `id`'s saved adapter was made over, when it is
    /// not the one with fingerprint `base`.
    fn made_over_another_base(&self, id: &str, base: &str) -> Option<String> {
        let b = Manifest::read(&self.adapter_dir(id)).ok()?.base_model;
        (b.fingerprint != base).then(|| base_name(&b))
    }

    /// The base an archived adapter was made over, as (fingerprint, name for people), read from
    /// its manifest (fetched into the local directory of `id` first when it is not there).
    pub fn archived_base(&self, id: &str, blob: &BlobRef) -> Result<(String, String)> {
        self.ensure_local_copy(id, blob)?;
        let b = Manifest::read(&self.adapter_dir(id))?.base_model;
        Ok((b.fingerprint.clone(), base_name(&b)))
    }

    /// The text an archived adapter was absorbed from (fetched as `archived_base`): what a
    /// replica absorbs again over a new base, and answers from meanwhile.
    pub fn archived_text(&self, id: &str, blob: &BlobRef) -> Result<String> {
        self.ensure_local_copy(id, blob)?;
        let path = self.adapter_dir(id).join(manifest::DOCUMENT_FILE);
        std::fs::read_to_string(&path).with_context(|| format!("{}: cannot read the document", path.display()))
    }

    fn ensure_local_copy(&self, id: &str, blob: &BlobRef) -> Result<()> {
        match &self.blobs {
            Some(blobs) if !self.local_copy_is(id, blob) => self.fetch(id, blob, blobs),
            _ => Ok(()),
        }
    }

    /// Adapter directories in the store that no record names (made by `lift-serve absorb --out`
    /// and copied here, say): the server does not serve them; `lift-serve import` adds one.
    pub fn unrecorded_adapters(&self) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(&self.root) else { return Vec::new() };
        let mut out: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join(manifest::MANIFEST_FILE).is_file())
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| !self.record_path(n).exists() && !self.blob_note_path(n).exists()))
            .collect();
        out.sort();
        out
    }

    /// Adds the adapter directory `src` (written by `lift-serve absorb --out`) to the store as a
    /// ready document of `owner`: checked against `model` as a load is, copied in under the id
    /// the server would give its text and options, with a record. Importing it again returns
    /// the record already there. `src` itself is left as it is.
    pub fn import(&self, src: &Path, model: &Model, owner: Option<String>, title: Option<String>) -> Result<JobRecord> {
        let loaded = load_dir(src, model).with_context(|| format!("{}: not an adapter directory for this model", src.display()))?;
        let options = loaded.manifest.options.clone();
        let id = document_id(&model.info.fingerprint, owner.as_deref(), &loaded.document.text, &options);
        if let Ok(bytes) = std::fs::read(self.record_path(&id)) {
            return Ok(serde_json::from_slice(&bytes)?);
        }
        let qa_json = match std::fs::read(src.join(manifest::QA_FILE)) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => b"[]".to_vec(),
            Err(e) => return Err(e).with_context(|| format!("{}: cannot read {}", src.display(), manifest::QA_FILE)),
        };
        let m = loaded.manifest.clone();
        let title = title.or_else(|| src.file_name().map(|n| n.to_string_lossy().into_owned()));
        let tokens = loaded.document.len();
        save_dir(&self.adapter_dir(&id), NewAdapter { bundle: loaded.bundle, manifest: loaded.manifest, document: loaded.document, qa_json })?;
        let rec = JobRecord {
            id,
            owner,
            title,
            status: Status::Ready,
            tokens,
            created_at: now(),
            seq: next_seq(),
            ready_at: Some(now()),
            error: None,
            adapter: Some(AdapterInfo { kind: m.kind.to_string(), parameters: m.parameters, bytes: m.bytes }),
            options,
            // An adapter directory knows the options it trained with, not those asked.
            requested: None,
            source: None,
            training: Some(m.training),
            last_asked_at: None,
            reabsorbing_from: None,
        };
        self.write_record(&rec)?;
        Ok(rec)
    }

    /// Saves an absorbed adapter with its document and QA pairs (atomic) and caches it (with
    /// shared blobs it is cached once published, under its archive's hash).
    pub fn save(&self, id: &str, adapter: NewAdapter) -> Result<Arc<Loaded>> {
        let loaded = Arc::new(save_dir(&self.adapter_dir(id), adapter)?);
        self.remove_pending_text(id);
        // The final adapter replaces the snapshots.
        self.drop_live(id);
        if self.blobs.is_none() {
            self.cache.insert(id.to_string(), loaded.clone());
        }
        Ok(loaded)
    }

    /// Everything an answer about `id` needs: from the cache, else from disk; with shared blobs
    /// (`blob` given) the archive is fetched, verified and unpacked first unless the local copy
    /// is that archive (blocking).
    pub fn get(&self, id: &str, model: &Model, blob: Option<&BlobRef>) -> Result<Arc<Loaded>> {
        let key = match blob {
            Some(b) => format!("{id}@{}", b.sha256),
            None => id.to_string(),
        };
        if let Some(l) = self.cache.get(&key) {
            self.stats.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(l);
        }
        self.stats.misses.fetch_add(1, Ordering::Relaxed);
        let mut fetched = false;
        if let (Some(blob), Some(blobs)) = (blob, &self.blobs) {
            if !self.local_copy_is(id, blob) {
                self.fetch(id, blob, blobs)?;
                fetched = true;
            }
        }
        let loaded = match load_dir(&self.adapter_dir(id), model) {
            // Only this replica's copy may be damaged: the archive is verified as it is fetched.
            Err(e) if is_damaged(&e) && !fetched && blob.is_some() => {
                tracing::warn!(id, error = %format!("{e:#}"), "the local copy of the adapter is damaged: fetching it again");
                let (Some(blob), Some(blobs)) = (blob, &self.blobs) else { return Err(e) };
                self.fetch(id, blob, blobs)?;
                load_dir(&self.adapter_dir(id), model)?
            }
            r => r?,
        };
        let loaded = Arc::new(loaded);
        self.cache.insert(key, loaded.clone());
        Ok(loaded)
    }

    /// The document of a saved adapter without loading the adapter (a collection's index reads
    /// every member's passages; only the routed adapter is loaded): from the cache when loaded,
    /// else its text and token ids from its directory, fetched first with shared blobs (blocking).
    pub fn read_document(&self, id: &str, model: &Model, blob: Option<&BlobRef>) -> Result<Arc<Document>> {
        let key = blob.map_or_else(|| id.to_string(), |b| format!("{id}@{}", b.sha256));
        if let Some(l) = self.cache.get(&key) {
            return Ok(l.document.clone());
        }
        if let Some(blob) = blob {
            self.ensure_local_copy(id, blob)?;
        }
        let dir = self.adapter_dir(id);
        let text = std::fs::read_to_string(dir.join(manifest::DOCUMENT_FILE))
            .with_context(|| format!("{}: cannot read the document", dir.display()))?;
        let document = match std::fs::read(dir.join(manifest::TOKENS_FILE)) {
            Ok(bytes) if bytes.len() % 4 == 0 => tokens_from_bytes(&bytes, bytes.len() / 4).map(|t| Document::from_tokens(text, t))?,
            _ => Document::encode(model, text)?,
        };
        Ok(Arc::new(document))
    }

    /// Fetches the archive `blob` (verified against its hash) into the local directory of `id`.
    fn fetch(&self, id: &str, blob: &BlobRef, blobs: &Blobs) -> Result<()> {
        let archive = blobs.block_on(blobs.get(blob))?;
        blobs::unpack(&archive, &self.adapter_dir(id))?;
        self.note_blob(id, blob)?;
        tracing::info!(id, sha256 = %blob.sha256, bytes = archive.len(), "adapter fetched from the shared store");
        Ok(())
    }

    /// Removes a damaged adapter before its document is absorbed again: until the new one is
    /// saved the document answers as one without an adapter (its passages, its snapshots).
    pub fn discard_adapter(&self, id: &str) -> Result<()> {
        self.cache.invalidate(id);
        let prefix = format!("{id}@");
        let _ = self.cache.invalidate_entries_if(move |k, _| k.starts_with(&prefix));
        let note = self.blob_note_path(id);
        if note.exists() {
            std::fs::remove_file(&note)?;
        }
        let dir = self.adapter_dir(id);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).with_context(|| format!("{}: cannot remove", dir.display()))?;
        }
        Ok(())
    }

    /// Makes `document` answerable before its adapter is saved (from when it is posted; kept
    /// after a failed or cancelled job).
    pub fn put_live(&self, id: &str, document: Arc<Document>) {
        let replaces_saved = self.adapter_dir(id).join(manifest::MANIFEST_FILE).exists();
        if let Ok(mut live) = self.live.write() {
            live.entry(id.to_string())
                .or_insert_with(|| Arc::new(LiveDocument { document, snapshot: Default::default(), replaces_saved }));
        }
    }

    /// The document `id` when it has no saved adapter but can be answered about.
    pub fn live(&self, id: &str) -> Option<Arc<LiveDocument>> {
        self.live.read().ok().and_then(|l| l.get(id).cloned())
    }

    /// The latest snapshot of `id`'s training replaces the one before.
    pub fn publish_snapshot(&self, id: &str, snapshot: Snapshot) {
        if let Some(live) = self.live(id) {
            tracing::info!(id, step = snapshot.step, planned_steps = snapshot.planned_steps, "adapter snapshot published");
            if let Ok(mut s) = live.snapshot.write() {
                *s = Some(Arc::new(snapshot));
            }
        }
    }

    /// The job of `id` ended without an adapter: its document still answers from its passages.
    pub fn drop_snapshot(&self, id: &str) {
        if let Some(live) = self.live(id) {
            if let Ok(mut s) = live.snapshot.write() {
                *s = None;
            }
        }
    }

    fn drop_live(&self, id: &str) {
        if let Ok(mut live) = self.live.write() {
            live.remove(id);
        }
    }

    /// Removes a document's adapter and record from memory and disk.
    pub fn delete(&self, id: &str) -> Result<()> {
        self.drop_live(id);
        self.discard_adapter(id)?;
        let rec = self.record_path(id);
        if rec.exists() {
            std::fs::remove_file(&rec)?;
        }
        self.remove_pending_text(id);
        if self.blobs.is_none() {
            self.drop_checkpoint(id);
        }
        Ok(())
    }

    /// Bytes of the adapters held in memory.
    pub fn resident_bytes(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.weighted_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_content_addressed_and_valid() {
        let o = serde_json::json!({"a": 1});
        let a = document_id("fp", None, "text", &o);
        assert_eq!(a, document_id("fp", None, "text", &o));
        assert_ne!(a, document_id("fp2", None, "text", &o));
        assert_ne!(a, document_id("fp", Some("k"), "text", &o));
        assert_ne!(a, document_id("fp", None, "text", &serde_json::json!({"a": 2})));
        assert!(valid_id(&a));
        assert!(!valid_id("doc_../../etc"));
    }
}

/// Nanoseconds since the epoch in hex (unique enough for response ids).
pub fn now_nanos_hex() -> String {
    let n = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{n:x}")
}
