//! The prepared base: a base-level LoRA (all projections, all layers) trained with CDT (Context
//! Denoising Training) and a FltLM context filter, trained once per base model and active under
//! every document's Gated Memory adapter (LIFT), while it trains and while it answers.
//!
//! On disk, one directory:
//!
//! ```text
//! <dir>/base.safetensors   the LoRA (`layers.…`, as adapters name it) and the filter (`filter.…`)
//! <dir>/manifest.json      the command that made it, seed, data hash, figures, base model, hash
//! ```
//!
//! Its hash (of `base.safetensors`) is folded into the model's fingerprint when it is installed
//! ([`PreparedBase::install`]), so document ids and adapters record which base they were trained
//! over, and an adapter refuses to load over another.

// Making and measuring a prepared base: research, not serving (the `research` feature).
#[cfg(feature = "research")]
pub mod cdt;
#[cfg(feature = "research")]
pub mod data;
#[cfg(feature = "research")]
pub mod eval;
#[cfg(feature = "research")]
pub mod real;
#[cfg(feature = "research")]
pub mod train;

use crate::adapters::manifest::BaseModelRef;
use crate::adapters::{AdapterKind, AnyAdapter, Lora, LoraConfig, ADAPTER_PREFIX};
use crate::lift::answer::layout::{Filter, FilterOptions};
use crate::model::{Model, Projection};
use anyhow::{bail, Context, Result};
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const WEIGHTS_FILE: &str = "base.safetensors";
pub const MANIFEST_FILE: &str = "manifest.json";
/// Where `serve`, `ask`, `absorb` and `eval` look for a prepared base by default.
pub const DEFAULT_DIR: &str = "base";
pub const FORMAT_VERSION: u32 = 1;

/// `manifest.json` of a prepared base.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BaseManifest {
    pub format_version: u32,
    /// The plain base model it was trained on (its own fingerprint, without any prepared base).
    pub base_model: BaseModelRef,
    pub lora: LoraConfig,
    /// The filter's score layer and chunk size.
    pub filter_layer: usize,
    pub chunk_tokens: usize,
    /// The command line that made it.
    pub command: String,
    pub seed: u64,
    /// Hash of the training examples.
    pub data_hash: String,
    /// Training figures (steps, losses, seconds, CDT's measured move and loss ratio).
    pub training: serde_json::Value,
    /// Evaluation figures (held-out loss, filter precision and recall at `s_i > 0`, …).
    pub eval: serde_json::Value,
    pub created_at: u64,
    /// SHA-256 (hex, first 16 bytes) of `base.safetensors`: the prepared base's identity. Written
    /// by [`PreparedBase::save`], verified by [`PreparedBase::load`].
    #[serde(default)]
    pub sha256: String,
}

/// A base-level LoRA and a FltLM filter, with their manifest.
pub struct PreparedBase {
    pub lora: Lora,
    pub filter: Filter,
    pub manifest: BaseManifest,
}

/// What [`PreparedBase::new`] needs besides the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BaseShape {
    /// LoRA rank (all seven projections of every layer), α = 2·rank as in the LIFT authors' LoRA.
    pub rank: usize,
    pub filter: FilterOptions,
}

impl Default for BaseShape {
    /// Rank 8: 2.4 M parameters (9.8 MB in f32) on the 135M default model, inside the ~20 MB
    /// the repository can ship.
    fn default() -> Self {
        Self { rank: 8, filter: FilterOptions { enabled: true, ..Default::default() } }
    }
}

impl BaseShape {
    pub fn lora(&self) -> LoraConfig {
        LoraConfig {
            rank: self.rank,
            alpha: 2.0 * self.rank as f64,
            targets: Projection::ALL.to_vec(),
            layers: Vec::new(),
        }
    }
}

impl PreparedBase {
    /// A fresh, trainable prepared base: LoRA `B = 0` and filter `w = b = 0`, so it is exactly the
    /// plain model until trained.
    pub fn new(model: &Model, shape: &BaseShape, seed: u64) -> Result<Self> {
        anyhow::ensure!(
            model.info.prepared_base.is_none(),
            "train a prepared base on the plain model (--prepared-base none)"
        );
        let cfg = model.config();
        let lora = Lora::new(cfg, &shape.lora(), seed, model.device())?;
        let filter = Filter::new(cfg, &shape.filter, model.device())?;
        let manifest = BaseManifest {
            format_version: FORMAT_VERSION,
            base_model: BaseModelRef::of(model),
            lora: lora.config().clone(),
            filter_layer: filter.layer,
            chunk_tokens: filter.chunk_tokens,
            command: String::new(),
            seed,
            data_hash: String::new(),
            training: serde_json::Value::Null,
            eval: serde_json::Value::Null,
            created_at: 0,
            sha256: String::new(),
        };
        Ok(Self { lora, filter, manifest })
    }

    /// Trainable parameters: the LoRA's, then the filter's.
    pub fn vars(&self) -> (&[Var], &[Var]) {
        (self.lora.vars(), self.filter.vars())
    }

    /// Plain-tensor copy (no autograd graph).
    pub fn detached(&self) -> Self {
        Self { lora: self.lora.detached(), filter: self.filter.detached(), manifest: self.manifest.clone() }
    }

    /// Every tensor under its stored name.
    pub fn named_tensors(&self) -> Result<HashMap<String, Tensor>> {
        let mut out: HashMap<String, Tensor> =
            AnyAdapter::Lora(self.lora.detached()).named_tensors().into_iter().collect();
        out.extend(self.filter.to_extras()?);
        Ok(out)
    }

    /// The values of `tensors` (as [`Self::named_tensors`] names them) checked against the model.
    fn from_tensors(
        model: &Model,
        lora: &LoraConfig,
        tensors: HashMap<String, Tensor>,
        trainable: bool,
    ) -> Result<(Lora, Filter)> {
        let cfg = model.config();
        let (adapter, extras): (Vec<_>, Vec<_>) = tensors.into_iter().partition(|(k, _)| k.starts_with(ADAPTER_PREFIX));
        let AnyAdapter::Lora(lora) = AnyAdapter::from_named_tensors(AdapterKind::Lora, cfg, Some(lora), adapter)?
        else {
            unreachable!("asked for a LoRA")
        };
        let extras: BTreeMap<String, Tensor> = extras.into_iter().collect();
        let filter = Filter::from_extras(&extras, cfg)?.context("the prepared base has no filter")?;
        Ok(if trainable { (lora.trainable(cfg)?, filter.trainable()?) } else { (lora, filter) })
    }

    /// Writes `base.safetensors` then `manifest.json` into `dir` (created), each through a
    /// temporary file renamed into place; returns the manifest with its hash filled in.
    pub fn save(&mut self, dir: &Path) -> Result<&BaseManifest> {
        std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
        let weights = dir.join(WEIGHTS_FILE);
        let tmp = dir.join(format!(".{WEIGHTS_FILE}.tmp"));
        candle_core::safetensors::save(&self.named_tensors()?, &tmp)?;
        self.manifest.sha256 = file_hash(&std::fs::read(&tmp)?);
        self.manifest.created_at =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        std::fs::rename(&tmp, &weights)?;
        write_json(&dir.join(MANIFEST_FILE), &self.manifest)?;
        Ok(&self.manifest)
    }

    /// Reads a prepared base from `dir` for `model` (the plain model it was trained on), detached.
    pub fn load(dir: &Path, model: &Model) -> Result<Self> {
        Self::load_with(dir, read_manifest(dir)?, model)
    }

    /// [`load`](Self::load) with the manifest already read from `dir`.
    fn load_with(dir: &Path, manifest: BaseManifest, model: &Model) -> Result<Self> {
        if model.info.prepared_base.is_some() {
            bail!("the model already has a prepared base installed");
        }
        if manifest.base_model.fingerprint != model.info.fingerprint {
            bail!(
                "{}: prepared base was trained on base model '{}' (fingerprint {}), but the loaded model is '{}' \
                 (fingerprint {})",
                dir.display(),
                manifest.base_model.id,
                manifest.base_model.fingerprint,
                model.info.id,
                model.info.fingerprint
            );
        }
        let bytes =
            std::fs::read(dir.join(WEIGHTS_FILE)).with_context(|| format!("{}: no {WEIGHTS_FILE}", dir.display()))?;
        let hash = file_hash(&bytes);
        if hash != manifest.sha256 {
            bail!("{}: {WEIGHTS_FILE} has hash {hash}, the manifest says {}", dir.display(), manifest.sha256);
        }
        let tensors = candle_core::safetensors::load_buffer(&bytes, model.device())?;
        let (lora, filter) = Self::from_tensors(model, &manifest.lora, tensors, false)?;
        Ok(Self { lora, filter, manifest })
    }

    /// Puts this prepared base under every forward pass of `model` (its LoRA as the decoder's base
    /// adapter, its filter for answering) and folds its hash into the model's fingerprint.
    /// Returns the frozen copy now in the model (its tensors are the ones the decoder uses).
    pub fn install(self, model: &mut Model) -> Result<PreparedBase> {
        anyhow::ensure!(!self.manifest.sha256.is_empty(), "install a saved or loaded prepared base");
        anyhow::ensure!(model.info.prepared_base.is_none(), "the model already has a prepared base installed");
        let base = self.detached();
        let lora = base.lora.clone();
        model.decoder.merge_base_adapter(Arc::new(base.lora.clone()), &|li, p| lora.weight_delta(li, p))?;
        model.info.fingerprint = combined_fingerprint(&model.info.fingerprint, &base.manifest.sha256);
        model.info.prepared_base = Some(base.manifest.sha256.clone());
        tracing::info!(hash = %base.manifest.sha256, rank = base.lora.config().rank, filter_layer = base.filter.layer, "prepared base installed");
        model.base_filter = Some(base.filter.clone());
        Ok(base)
    }
}

/// The model's fingerprint with a prepared base of hash `base` over it.
pub fn combined_fingerprint(model: &str, base: &str) -> String {
    hex::encode(&Sha256::digest(format!("{model}+prepared-base:{base}").as_bytes())[..16])
}

fn file_hash(bytes: &[u8]) -> String {
    hex::encode(&Sha256::digest(bytes)[..16])
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(value)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// `--prepared-base PATH|none`: `none` is no prepared base; no value is [`DEFAULT_DIR`] in the
/// working directory if it holds one, else none.
pub fn resolve(arg: Option<&str>) -> Option<PathBuf> {
    match arg {
        Some("none") => None,
        Some(p) => Some(PathBuf::from(p)),
        None => Some(crate::fetch::project_dir(DEFAULT_DIR)).filter(|d| d.join(MANIFEST_FILE).is_file()),
    }
}

/// The manifest of the prepared base in `dir`, in a format this build reads.
fn read_manifest(dir: &Path) -> Result<BaseManifest> {
    let mpath = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&mpath)
        .with_context(|| format!("{}: not a prepared base (no {MANIFEST_FILE})", dir.display()))?;
    let manifest: BaseManifest =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid prepared-base manifest", mpath.display()))?;
    if manifest.format_version != FORMAT_VERSION {
        bail!("{}: prepared-base format {} (this build reads {FORMAT_VERSION})", dir.display(), manifest.format_version);
    }
    Ok(manifest)
}

/// Loads and installs the prepared base `arg` names ([`resolve`]) into `model`. A base found by
/// default (no `arg`) that was trained on another model is skipped with a warning (a user's own
/// model runs without it); one named explicitly must match.
pub fn install_from_arg(model: &mut Model, arg: Option<&str>) -> Result<()> {
    if let Some(dir) = resolve(arg) {
        install_dir(model, &dir, arg.is_some())?;
    }
    Ok(())
}

/// Installs the prepared base in `dir` into `model`; returns whether it did. When `explicit` is
/// false (the default directory, found rather than asked for), a base trained on another model
/// is not installed: a warning says so and the model runs plain. Every other failure (no
/// manifest, a bad hash, an explicit base of another model) is an error.
pub fn install_dir(model: &mut Model, dir: &Path, explicit: bool) -> Result<bool> {
    let manifest = read_manifest(dir)?;
    if !explicit && manifest.base_model.fingerprint != model.info.fingerprint {
        tracing::warn!(
            dir = %dir.display(),
            trained_on = %manifest.base_model.id,
            model = %model.info.id,
            "the default prepared base was trained on another model; running without a prepared base \
             (pass --prepared-base none to silence this, or a base prepared for this model)"
        );
        return Ok(false);
    }
    PreparedBase::load_with(dir, manifest, model)?.install(model)?;
    Ok(true)
}
