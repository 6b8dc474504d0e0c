//! Adapters on disk: one directory per adapter holding
//!
//! ```text
//! <dir>/adapter.safetensors   every tensor of the bundle (adapter under `layers.…`, extras beside)
//! <dir>/manifest.json         what it is: kind, shapes, base model, document, options, figures
//! ```
//!
//! **Writing** ([`save`]). Two files cannot be renamed atomically as a pair, but a directory can:
//! `save` writes both files into a fresh staging directory beside `dir` (same parent, so the same
//! file system; named `.<name>.tmp-<pid>-<nanos>-<n>`), the manifest last, fsyncs the files and the
//! staging directory, and then publishes it:
//! - `dir` absent (or an empty directory): `rename(staging, dir)`, atomic;
//! - `dir` holds an adapter: on Linux `renameat2(RENAME_EXCHANGE)` swaps the two directories in one
//!   atomic step, and the old adapter (now at the staging path) is deleted. Where the exchange is
//!   not supported, `dir` is first renamed aside and the staging directory renamed into place: a
//!   reader can then find `dir` missing for a moment, never half-written;
//! - `dir` holds anything else: refused (a wrong path must not wipe a directory).
//!
//! Finally the parent directory is fsynced. After a crash, `dir` is either the old adapter or the
//! new one; staging leftovers are dot-directories that [`remove_stale_saves`] clears.
//!
//! **Reading** ([`load`]). A reader that opens `dir/manifest.json` before a swap and
//! `dir/adapter.safetensors` after it would pair an old manifest with a new file, so the manifest
//! records the file's SHA-256 (`adapter_sha256`, filled in by `save`) and `load` verifies it;
//! on a mismatch it reads both again (the writer's swap is already complete by then). A
//! mismatch that persists is corruption and an error. The hash costs about 0.1 s per 100 MB.
//!
//! `load` also refuses an adapter trained on another base model (fingerprint), an unknown
//! `format_version`, and tensors whose names or shapes differ from the manifest or the model.

use super::{AdapterBundle, AdapterKind, AnyAdapter, LoraConfig, ADAPTER_PREFIX};
use crate::model::{Architecture, Model};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The on-disk format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
pub const ADAPTER_FILE: &str = "adapter.safetensors";
pub const MANIFEST_FILE: &str = "manifest.json";
/// The absorbed document's text (the answering prompt shows its head and tail).
pub const DOCUMENT_FILE: &str = "document.txt";
/// The document's token ids in the base model's tokenizer, as absorbed (little-endian u32).
pub const TOKENS_FILE: &str = "document.tokens";
/// The auxiliary QA pairs the adapter was trained on (for inspection).
pub const QA_FILE: &str = "qa.json";
/// Files that may sit beside an adapter and travel with it in one atomic save.
pub const ATTACHMENTS: [&str; 3] = [DOCUMENT_FILE, TOKENS_FILE, QA_FILE];

/// The base model an adapter was trained on. `fingerprint` decides; the rest is for people and
/// for a clear error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseModelRef {
    pub id: String,
    pub fingerprint: String,
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    /// The prepared base the adapter was trained over (its hash is part of `fingerprint`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prepared_base: Option<String>,
}

impl BaseModelRef {
    pub fn of(model: &Model) -> Self {
        let c = model.config();
        Self {
            id: model.info.id.clone(),
            fingerprint: model.info.fingerprint.clone(),
            prepared_base: model.info.prepared_base.clone(),
            architecture: c.architecture,
            hidden_size: c.hidden_size,
            num_layers: c.num_layers,
            num_heads: c.num_heads,
            head_dim: c.head_dim,
        }
    }
}

/// The document an adapter absorbed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DocumentRef {
    /// SHA-256 (hex) of the document's UTF-8 text.
    pub sha256: String,
    /// Its length in tokens of the base model.
    pub tokens: usize,
    pub title: Option<String>,
    /// How the text was made from an uploaded file (format, extractor); absent for text given as is
    /// by a library caller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<crate::formats::Source>,
}

impl DocumentRef {
    pub fn new(text: &str, tokens: usize, title: Option<String>) -> Self {
        Self { sha256: hex::encode(Sha256::digest(text.as_bytes())), tokens, title, source: None }
    }
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub kind: AdapterKind,
    /// Elements of every tensor in `adapter.safetensors` (adapter + extras).
    pub parameters: usize,
    /// Bytes of that tensor data (adapter f32; extras in their dtype).
    pub bytes: usize,
    /// Every tensor in `adapter.safetensors` by name.
    pub shapes: BTreeMap<String, Vec<usize>>,
    /// Adapted layers, ascending.
    pub layers: Vec<usize>,
    /// The LoRA configuration (normalized); None for Gated Memory.
    pub lora: Option<LoraConfig>,
    pub base_model: BaseModelRef,
    pub document: DocumentRef,
    /// Training options as given by the caller.
    pub options: serde_json::Value,
    /// Training figures (steps, final loss, seconds, tokens/s, …).
    pub training: serde_json::Value,
    /// Unix seconds.
    pub created_at: u64,
    /// SHA-256 (hex) of `adapter.safetensors`; written by [`save`] (a value given to it is
    /// ignored) and verified by [`load`].
    #[serde(default)]
    pub adapter_sha256: String,
}

impl Manifest {
    /// A manifest describing `bundle` (kind, sizes, shapes, layers, LoRA configuration), created now.
    pub fn new(
        bundle: &AdapterBundle,
        base_model: BaseModelRef,
        document: DocumentRef,
        options: serde_json::Value,
        training: serde_json::Value,
    ) -> Self {
        let created_at = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Self {
            format_version: FORMAT_VERSION,
            kind: bundle.adapter.kind(),
            parameters: bundle.num_parameters(),
            bytes: bundle.bytes(),
            shapes: shapes_of(bundle),
            layers: bundle.adapter.layers(),
            lora: bundle.adapter.lora_config().cloned(),
            base_model,
            document,
            options,
            training,
            created_at,
            adapter_sha256: String::new(),
        }
    }

    /// Reads `dir/manifest.json` alone (cheap; for listing). Checks `format_version` first, so a
    /// manifest from a newer build gives that error rather than a parse error.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let bytes = std::fs::read(&path).with_context(|| format!("{}: cannot read adapter manifest", path.display()))?;
        Self::parse(&bytes, &path)
    }

    fn parse(bytes: &[u8], path: &Path) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_slice(bytes)
            .with_context(|| format!("{}: not valid JSON (corrupt or truncated manifest)", path.display()))?;
        match value.get("format_version").and_then(|v| v.as_u64()) {
            Some(v) if v == FORMAT_VERSION as u64 => {}
            Some(v) => bail!(
                "{}: unsupported adapter format_version {v} (this build reads version {FORMAT_VERSION})",
                path.display()
            ),
            None => bail!("{}: not an adapter manifest (no numeric format_version)", path.display()),
        }
        serde_json::from_value(value).with_context(|| format!("{}: invalid adapter manifest", path.display()))
    }

    /// Fails with [`WrongBaseModel`] unless `model` is the base model this adapter was trained on.
    pub fn check_base_model(&self, model: &Model) -> Result<()> {
        let want = &self.base_model;
        let have = BaseModelRef::of(model);
        if want.fingerprint != have.fingerprint && want.prepared_base != have.prepared_base {
            let name = |b: &Option<String>| b.as_deref().map_or("none".to_string(), |h| format!("'{h}'"));
            bail!(WrongBaseModel(format!(
                "adapter was trained over prepared base {}, but the loaded model has prepared base {} \
                 (--prepared-base); an adapter only works over the base it was trained over",
                name(&want.prepared_base),
                name(&have.prepared_base)
            )));
        }
        if want.fingerprint != have.fingerprint {
            bail!(WrongBaseModel(format!(
                "adapter was trained on base model '{}' (fingerprint {}), but the loaded base model is '{}' \
                 (fingerprint {}); an adapter only works on the model it was trained on",
                want.id,
                want.fingerprint,
                have.id,
                have.fingerprint
            )));
        }
        let shape = |b: &BaseModelRef| (b.architecture, b.hidden_size, b.num_layers, b.num_heads, b.head_dim);
        if shape(want) != shape(&have) {
            bail!(WrongBaseModel(format!(
                "adapter's base model '{}' has shape {:?}, the loaded model '{}' {:?} (architecture, hidden, layers, \
                 heads, head_dim)",
                want.id,
                shape(want),
                have.id,
                shape(&have)
            )));
        }
        Ok(())
    }

    /// Fails unless this manifest describes `bundle` (what `Manifest::new` guarantees).
    pub fn check_describes(&self, bundle: &AdapterBundle) -> Result<()> {
        if self.format_version != FORMAT_VERSION {
            bail!("manifest format_version {} (this build writes {FORMAT_VERSION})", self.format_version);
        }
        if self.kind != bundle.adapter.kind() {
            bail!("manifest kind {} but the adapter is {}", self.kind, bundle.adapter.kind());
        }
        if self.shapes != shapes_of(bundle) {
            bail!("manifest shapes do not match the bundle's tensors (build it with Manifest::new)");
        }
        if self.layers != bundle.adapter.layers() {
            bail!("manifest layers {:?} but the adapter has {:?}", self.layers, bundle.adapter.layers());
        }
        if self.lora.as_ref() != bundle.adapter.lora_config() {
            bail!("manifest LoRA configuration {:?} but the adapter has {:?}", self.lora, bundle.adapter.lora_config());
        }
        if (self.parameters, self.bytes) != (bundle.num_parameters(), bundle.bytes()) {
            bail!(
                "manifest says {} parameters / {} bytes, the bundle has {} / {}",
                self.parameters,
                self.bytes,
                bundle.num_parameters(),
                bundle.bytes()
            );
        }
        Ok(())
    }
}

fn shapes_of(bundle: &AdapterBundle) -> BTreeMap<String, Vec<usize>> {
    bundle.named_tensors().into_iter().map(|(n, t)| (n, t.dims().to_vec())).collect()
}

/// Writes `bundle` and `manifest` to `dir` atomically (see the module documentation): a reader
/// sees the old adapter or the new one, complete. `manifest` must describe `bundle`
/// ([`Manifest::new`]); its `adapter_sha256` is filled in here. `attachments` (names from
/// [`ATTACHMENTS`]) are written in the same atomic step.
pub fn save(dir: &Path, bundle: &AdapterBundle, manifest: &Manifest, attachments: &[(&str, &[u8])]) -> Result<()> {
    for (name, _) in attachments {
        if !ATTACHMENTS.contains(name) {
            bail!("{}: '{name}' is not a known adapter attachment", dir.display());
        }
    }
    bundle.validate()?;
    manifest
        .check_describes(bundle)
        .with_context(|| format!("{}: manifest does not describe the adapter being saved", dir.display()))?;
    let data = serialize(bundle, manifest.kind).with_context(|| format!("{}: cannot serialize adapter", dir.display()))?;
    let mut manifest = manifest.clone();
    manifest.adapter_sha256 = hex::encode(Sha256::digest(&data));
    let json = serde_json::to_vec_pretty(&manifest)?;

    let name = dir
        .file_name()
        .with_context(|| format!("{}: an adapter directory needs a name", dir.display()))?
        .to_string_lossy()
        .to_string();
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).with_context(|| format!("{}: cannot create directory", parent.display()))?;
    let staging = parent.join(format!(".{name}.tmp-{}", unique()));
    std::fs::create_dir(&staging).with_context(|| format!("{}: cannot create staging directory", staging.display()))?;
    let result = (|| -> Result<()> {
        write_synced(&staging.join(ADAPTER_FILE), &data)?;
        for (name, bytes) in attachments {
            write_synced(&staging.join(name), bytes)?;
        }
        write_synced(&staging.join(MANIFEST_FILE), &json)?;
        sync_dir(&staging)?;
        publish(&staging, dir, &parent, &name)?;
        sync_dir(&parent)
    })();
    if result.is_err() && staging.exists() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}

/// An adapter made over another base model or prepared base than the one loaded. Its own type
/// so that the server can tell it from a failure: the document is fine, but it must be absorbed
/// again (or served over the base it was absorbed over) — a 409, not a 500.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct WrongBaseModel(pub String);

/// An adapter file that does not match the hash its manifest recorded (cut short, or a byte
/// changed on disk). Its own type so that the server can name it (409 `adapter_damaged`) and
/// offer the way back, absorbing the document again, instead of a 500. The message holds paths:
/// it is for the log.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AdapterDamaged(pub String);

/// Loads the adapter in `dir` for `model`: detached (inference) tensors on the model's device,
/// after checking the base model, the format version, the file's integrity and every shape.
/// Use `bundle.adapter.trainable(..)` to resume training.
pub fn load(dir: &Path, model: &Model) -> Result<(AdapterBundle, Manifest)> {
    let mpath = dir.join(MANIFEST_FILE);
    let apath = dir.join(ADAPTER_FILE);
    const ATTEMPTS: usize = 4;
    let mut last_manifest: Option<Vec<u8>> = None;
    for attempt in 1..=ATTEMPTS {
        let mbytes = std::fs::read(&mpath).with_context(|| format!("{}: cannot read adapter manifest", mpath.display()))?;
        let manifest = Manifest::parse(&mbytes, &mpath)?;
        manifest.check_base_model(model).with_context(|| format!("{}: wrong base model", dir.display()))?;
        if manifest.adapter_sha256.is_empty() {
            bail!("{}: no adapter_sha256 (not written by lift-serve's save)", mpath.display());
        }
        let data = match std::fs::read(&apath) {
            Ok(d) => d,
            // Between the two renames of the non-Linux publish path: read again.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && attempt < ATTEMPTS => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("{}: cannot read adapter", apath.display())),
        };
        let sha = hex::encode(Sha256::digest(&data));
        if sha != manifest.adapter_sha256 {
            // Torn read of a concurrent replacement: the manifest has changed since. Read again.
            let changed = last_manifest.as_ref().is_some_and(|m| *m != mbytes)
                || std::fs::read(&mpath).map(|m| m != mbytes).unwrap_or(true);
            let first_retry = last_manifest.is_none();
            last_manifest = Some(mbytes);
            if attempt < ATTEMPTS && (changed || first_retry) {
                if !changed {
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            if let Err(e) = safetensors::SafeTensors::deserialize(&data) {
                bail!(AdapterDamaged(format!("{}: corrupt or truncated adapter file ({e})", apath.display())));
            }
            bail!(AdapterDamaged(format!(
                "{}: content (sha256 {sha}) does not match {} (sha256 {}): the file was modified or replaced \
                 without its manifest",
                apath.display(),
                mpath.display(),
                manifest.adapter_sha256
            )));
        }
        let bundle = parse_bundle(&data, &manifest, model.config(), model.device(), &apath)?;
        return Ok((bundle, manifest));
    }
    bail!("{}: the adapter kept changing while being read", dir.display())
}

/// A check cheap enough for every adapter at start-up (no hashing): the manifest reads and the
/// adapter file is as long as its own safetensors header says. A file cut short is
/// [`AdapterDamaged`]; a changed byte is found by [`load`]'s hash when the adapter is first used.
pub fn check_complete(dir: &Path) -> Result<()> {
    let mpath = dir.join(MANIFEST_FILE);
    let apath = dir.join(ADAPTER_FILE);
    let manifest = Manifest::read(dir)?;
    if manifest.adapter_sha256.is_empty() {
        bail!("{}: no adapter_sha256 (not written by lift-serve's save)", mpath.display());
    }
    let mut f = std::fs::File::open(&apath).with_context(|| format!("{}: cannot read adapter", apath.display()))?;
    let len = f.metadata()?.len();
    let damaged = |why: String| AdapterDamaged(format!("{}: {why}", apath.display()));
    let mut n = [0u8; 8];
    std::io::Read::read_exact(&mut f, &mut n).map_err(|_| damaged(format!("{len} bytes: shorter than a safetensors header")))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > len.saturating_sub(8) {
        bail!(damaged(format!("{len} bytes: cut short inside its header ({header_len} bytes)")));
    }
    let mut header = vec![0u8; header_len as usize];
    std::io::Read::read_exact(&mut f, &mut header).map_err(|e| damaged(format!("cannot read its header ({e})")))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| damaged(format!("unreadable header ({e})")))?;
    // The data ends where the last tensor's `data_offsets` end.
    let data_len = header
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(_, v)| v["data_offsets"][1].as_u64())
        .max()
        .unwrap_or(0);
    let want = 8 + header_len + data_len;
    if len != want {
        bail!(damaged(format!("{len} bytes where its header describes {want}")));
    }
    Ok(())
}

/// The tensor an earlier version saved a per-document FltLM filter's head under (a name in old
/// files, so spelled here rather than taken from `lift::answer::layout`, which may rename its own).
const PER_DOCUMENT_FILTER_HEAD: &str = "filter.head.weight";

fn parse_bundle(
    data: &[u8],
    manifest: &Manifest,
    cfg: &crate::model::ModelConfig,
    device: &Device,
    apath: &Path,
) -> Result<AdapterBundle> {
    let tensors = candle_core::safetensors::load_buffer(data, device)
        .map_err(|e| anyhow::anyhow!("{}: corrupt or truncated adapter file ({e})", apath.display()))?;
    let file_shapes: BTreeMap<String, Vec<usize>> = tensors.iter().map(|(n, t)| (n.clone(), t.dims().to_vec())).collect();
    if file_shapes != manifest.shapes {
        let mut diffs = Vec::new();
        for (n, s) in &manifest.shapes {
            match file_shapes.get(n) {
                None => diffs.push(format!("'{n}' missing")),
                Some(fs) if fs != s => diffs.push(format!("'{n}' has shape {fs:?}, manifest says {s:?}")),
                _ => {}
            }
        }
        for n in file_shapes.keys().filter(|n| !manifest.shapes.contains_key(*n)) {
            diffs.push(format!("'{n}' not in the manifest"));
        }
        bail!("{}: tensors do not match {MANIFEST_FILE}: {}", apath.display(), diffs.join("; "));
    }
    type Named = Vec<(String, Tensor)>;
    let (adapter, extras): (Named, Named) = tensors.into_iter().partition(|(n, _)| n.starts_with(ADAPTER_PREFIX));
    let adapter = AnyAdapter::from_named_tensors(manifest.kind, cfg, manifest.lora.as_ref(), adapter)
        .with_context(|| format!("{}: not a valid {} adapter for this base model", apath.display(), manifest.kind))?;
    let bundle = AdapterBundle { adapter, extras: extras.into_iter().collect() };
    // Earlier versions could train a FltLM filter per document; it is now part of the prepared
    // base, and answering without the filter the adapter was trained under would be another model.
    anyhow::ensure!(
        !bundle.extras.contains_key(PER_DOCUMENT_FILTER_HEAD),
        "{}: absorbed with a per-document FltLM filter, which this version no longer trains or applies \
         (the filter is part of the prepared base): absorb the document again",
        apath.display()
    );
    manifest
        .check_describes(&bundle)
        .with_context(|| format!("{}: does not describe {}", apath.with_file_name(MANIFEST_FILE).display(), apath.display()))?;
    Ok(bundle)
}

/// Removes staging directories (`.<name>.tmp-…`, `.<name>.old-…`) under `parent` older than
/// `older_than`, left by saves that crashed. Call at start-up (a save in progress has one too).
/// Returns how many were removed.
pub fn remove_stale_saves(parent: &Path, older_than: Duration) -> Result<usize> {
    let mut n = 0;
    let entries = match std::fs::read_dir(parent) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot list", parent.display())),
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if !(name.starts_with('.') && (name.contains(".tmp-") || name.contains(".old-"))) {
            continue;
        }
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= older_than);
        if old && entry.path().is_dir() && std::fs::remove_dir_all(entry.path()).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

fn unique() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{}-{nanos}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
}

fn write_synced(path: &Path, data: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path).with_context(|| format!("{}: cannot create", path.display()))?;
    f.write_all(data).with_context(|| format!("{}: cannot write", path.display()))?;
    f.sync_all().with_context(|| format!("{}: cannot fsync", path.display()))
}

fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("{}: cannot fsync directory", dir.display()))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Moves the complete `staging` directory to `dir`, replacing an existing adapter there.
fn publish(staging: &Path, dir: &Path, parent: &Path, name: &str) -> Result<()> {
    // Absent or empty `dir`: one atomic rename.
    if std::fs::rename(staging, dir).is_ok() {
        return Ok(());
    }
    check_replaceable(dir)?;
    if exchange(staging, dir)? {
        // `staging` now holds the old adapter.
        if let Err(e) = std::fs::remove_dir_all(staging) {
            tracing::warn!(path = %staging.display(), error = %e, "cannot remove the replaced adapter");
        }
        return Ok(());
    }
    // No atomic exchange here: move the old one aside, then the new one in.
    let aside = parent.join(format!(".{name}.old-{}", unique()));
    std::fs::rename(dir, &aside).with_context(|| format!("{}: cannot move the old adapter aside", dir.display()))?;
    if let Err(e) = std::fs::rename(staging, dir) {
        let _ = std::fs::rename(&aside, dir);
        return Err(e).with_context(|| format!("{}: cannot move the new adapter into place", dir.display()));
    }
    if let Err(e) = std::fs::remove_dir_all(&aside) {
        tracing::warn!(path = %aside.display(), error = %e, "cannot remove the replaced adapter");
    }
    Ok(())
}

/// Only a directory holding nothing but an adapter's files may be replaced.
fn check_replaceable(dir: &Path) -> Result<()> {
    let meta = std::fs::symlink_metadata(dir).with_context(|| format!("{}: cannot replace", dir.display()))?;
    if !meta.is_dir() {
        bail!("{}: exists and is not a directory; refusing to replace it with an adapter", dir.display());
    }
    for entry in std::fs::read_dir(dir).with_context(|| format!("{}: cannot list", dir.display()))? {
        let entry = entry?;
        let n = entry.file_name();
        let known = n == ADAPTER_FILE || n == MANIFEST_FILE || ATTACHMENTS.iter().any(|a| n == *a);
        if !known {
            bail!(
                "{}: exists and holds '{}', which is not part of an adapter; refusing to replace it",
                dir.display(),
                n.to_string_lossy()
            );
        }
    }
    Ok(())
}

/// Atomically swaps two directories. `Ok(false)`: not supported here (fall back).
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes())?;
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: both paths are valid NUL-terminated strings that outlive the call.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, ca.as_ptr(), libc::AT_FDCWD, cb.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => Ok(false),
        _ => Err(err).with_context(|| format!("{}: cannot swap in the new adapter", b.display())),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, _b: &Path) -> Result<bool> {
    Ok(false)
}

/// `adapter.safetensors` bytes: every tensor of the bundle, on the CPU, little-endian.
fn serialize(bundle: &AdapterBundle, kind: AdapterKind) -> Result<Vec<u8>> {
    let meta: HashMap<String, String> = [
        ("format".to_string(), "lift-serve-adapter".to_string()),
        ("format_version".to_string(), FORMAT_VERSION.to_string()),
        ("kind".to_string(), kind.name().to_string()),
    ]
    .into_iter()
    .collect();
    safetensors_bytes(bundle.named_tensors(), meta)
}

/// Safetensors bytes of `tensors` (copied to the CPU, little-endian) with `meta` in the header.
pub fn safetensors_bytes(tensors: impl IntoIterator<Item = (String, Tensor)>, meta: HashMap<String, String>) -> Result<Vec<u8>> {
    let mut views = Vec::new();
    for (name, t) in tensors {
        views.push((name, RawView::of(&t)?));
    }
    canonical_header(safetensors::serialize(views, Some(meta))?)
}

/// The same safetensors bytes with the header's keys in sorted order: the library writes the
/// metadata map in a per-process random order, and the same adapter must be the same bytes.
/// Offsets are relative to the data, and the header keeps its length (the same JSON, reordered).
fn canonical_header(mut bytes: Vec<u8>) -> Result<Vec<u8>> {
    let n = u64::from_le_bytes(bytes.get(..8).context("safetensors without a header")?.try_into()?) as usize;
    let header = bytes.get(8..8 + n).context("safetensors header past the end")?;
    let parsed: std::collections::BTreeMap<String, serde_json::Value> = serde_json::from_slice(header)?;
    let mut sorted = serde_json::to_vec(&sorted_keys(serde_json::to_value(parsed)?))?;
    anyhow::ensure!(sorted.len() <= n, "the sorted safetensors header is longer than the original");
    sorted.resize(n, b' ');
    bytes[8..8 + n].copy_from_slice(&sorted);
    Ok(bytes)
}

/// `v` with every object's keys sorted.
fn sorted_keys(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let sorted: std::collections::BTreeMap<String, serde_json::Value> = m.into_iter().map(|(k, x)| (k, sorted_keys(x))).collect();
            serde_json::Value::Object(sorted.into_iter().collect())
        }
        other => other,
    }
}

struct RawView {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl RawView {
    fn of(t: &Tensor) -> Result<Self> {
        let shape = t.dims().to_vec();
        let t = t.to_device(&Device::Cpu)?.flatten_all()?;
        let (dtype, data): (safetensors::Dtype, Vec<u8>) = match t.dtype() {
            DType::F32 => (safetensors::Dtype::F32, t.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            DType::F64 => (safetensors::Dtype::F64, t.to_vec1::<f64>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            DType::F16 => {
                (safetensors::Dtype::F16, t.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            DType::BF16 => {
                (safetensors::Dtype::BF16, t.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            DType::U8 => (safetensors::Dtype::U8, t.to_vec1::<u8>()?),
            DType::U32 => (safetensors::Dtype::U32, t.to_vec1::<u32>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            DType::I64 => (safetensors::Dtype::I64, t.to_vec1::<i64>()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            other => bail!("cannot store a {other:?} tensor"),
        };
        Ok(Self { dtype, shape, data })
    }
}

impl safetensors::View for RawView {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn the_same_tensors_and_metadata_are_the_same_bytes() {
        let tensors = || {
            vec![
                ("b.weight".to_string(), Tensor::arange(0f32, 6.0, &Device::Cpu).unwrap().reshape((2, 3)).unwrap()),
                ("a.weight".to_string(), Tensor::ones(4, candle_core::DType::F32, &Device::Cpu).unwrap()),
            ]
        };
        // Each map iterates in its own random order.
        let meta = || -> HashMap<String, String> { (0..8).map(|i| (format!("key{i}"), format!("value{i}"))).collect() };
        let first = safetensors_bytes(tensors(), meta()).unwrap();
        for _ in 0..20 {
            assert_eq!(safetensors_bytes(tensors(), meta()).unwrap(), first);
        }
        let read = safetensors::SafeTensors::deserialize(&first).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&first).unwrap();
        assert_eq!(header.metadata().as_ref().unwrap(), &meta());
        let a = read.tensor("a.weight").unwrap();
        assert_eq!((a.shape(), a.data().len()), (&[4usize][..], 16));
        assert_eq!(read.tensor("b.weight").unwrap().data()[4..8], 1f32.to_le_bytes());
    }
}
