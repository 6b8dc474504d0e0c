//! LIFT ("LIFT: Improving Long Context Understanding of Large Language Models through Long Input
//! Fine-Tuning", Mao et al.): absorb a long document into a per-document adapter.
//! document (tokenized once: [`crate::document::Document`]) → auxiliary QA → plan (segments with
//! contextualized training, QA examples) → train → adapter bundle + manifest; and answering with
//! it ([`answer::answer`]).

pub mod answer;
pub mod budget;
pub mod cdt;
pub mod checkpoint;
pub mod estimate;
pub mod filter;
pub mod plan;
pub mod prompt;
pub mod qa;
pub mod text;
pub mod trainer;

use crate::adapters::manifest::{BaseModelRef, DocumentRef, Manifest};
use crate::adapters::{AdapterBundle, AdapterKind, AnyAdapter, GatedMemory, Lora, LoraConfig};
use crate::document::Document;
use crate::model::Model;
use crate::store::NewAdapter;
use anyhow::Result;
use plan::{Plan, PlanOptions};
use qa::{QaOptions, QaPair, QaProgress};
use serde::{Deserialize, Serialize};

/// Returned (inside `anyhow::Error`) when a `cancel` callback stopped long work (QA generation,
/// training); the field names the work.
#[derive(Debug, thiserror::Error)]
#[error("{0} cancelled")]
pub struct Cancelled(pub &'static str);
use std::time::Instant;
use trainer::{FilterTraining, Progress, RunControl, TrainInputs, TrainOptions, TrainReport};

/// Everything that shapes an adapter. Part of a document's content address: the same text with
/// the same options on the same base model is the same adapter. FltLM's filter and CDT are not
/// here: they are properties of the prepared base (`crate::base`), trained once and active under
/// every document's adapter, not per-document choices.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AbsorbOptions {
    pub adapter: AdapterKind,
    /// Layers with a Gated Memory adapter (default: all, as in the paper). The upper half
    /// (`15-29` on the 30-layer default model, where the retrieval heads sit:
    /// "(Long-) Context Modeling and Beyond", Tang, ICML 2025 tutorial) absorbs in ~60% of the time because layers below the lowest
    /// adapted one need no autograd graph, but recalled fewer out-of-window facts on the eval
    /// (README, "Absorb speed").
    pub layers: Option<Vec<usize>>,
    pub lora: LoraConfig,
    /// Learning rate; default per adapter kind (Gated Memory 1e-3 as in the paper's Table 9,
    /// LoRA 5e-5 as in the authors' later version).
    pub lr: Option<f64>,
    pub plan: PlanOptions,
    pub qa: QaOptions,
    pub train: TrainOptions,
    /// Seconds the whole absorb may take: the plan is fitted to it before the absorb starts
    /// ([`budget::fit`]) and training stops at it. None: the options as they are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_seconds: Option<f64>,
}

impl Default for AbsorbOptions {
    fn default() -> Self {
        Self {
            adapter: AdapterKind::GatedMemory,
            layers: None,
            lora: LoraConfig::default(),
            lr: None,
            plan: PlanOptions::default(),
            qa: QaOptions::default(),
            train: TrainOptions::default(),
            budget_seconds: None,
        }
    }
}

impl AbsorbOptions {
    /// The LIFT paper's recipe (App. A.2; the authors' code),
    /// scaled to a small model's context: Gated Memory on every layer, windows of 256 tokens with
    /// a 3/8 stride and 256 head+tail tokens of context, 3 epochs on segments then 5 on segments +
    /// QA, one example per optimizer step (no packing), QA pairs written by the model itself (the
    /// extractive generator fills up to the cap).
    /// The defaults keep its adapter and schedule but put 128 context tokens before segments and
    /// questions and use extractive QA only (the default 135M model writes almost no valid pairs).
    pub fn paper_faithful(num_layers: usize) -> Self {
        let mut o = Self { layers: Some((0..num_layers).collect()), ..Self::default() };
        o.plan.window = 256;
        o.plan.context_tokens = 256;
        o.plan.qa_pack = 1;
        o.plan.segment_pack = 1;
        o.qa.use_model = true;
        o.train.epochs = [3, 5];
        o
    }

    /// Adapted layers for a model of `num_layers` layers: `layers`, or all of them.
    pub fn gated_memory_layers(&self, num_layers: usize) -> Vec<usize> {
        self.layers.clone().unwrap_or_else(|| (0..num_layers).collect())
    }

    /// Training options with the learning rate resolved for the adapter kind.
    pub fn effective_train(&self) -> TrainOptions {
        let mut t = self.train.clone();
        t.lr = self.lr.unwrap_or(match self.adapter {
            AdapterKind::GatedMemory => 1e-3,
            AdapterKind::Lora => 5e-5,
        });
        t
    }
}

/// The flat option names of a request's `options` (`POST /documents`), also accepted in options
/// files beside the nested ones.
pub const FLAT_OPTIONS: &[&str] = &["window", "stride", "epochs", "aux_qa", "until_learned", "budget_seconds"];

impl AbsorbOptions {
    /// Options given as JSON over `self`, in either spelling: nested as this struct is saved
    /// (`{"plan": {"window": 128}, "train": {"epochs": [1, 2]}}`) or flat as a request's
    /// `options` (`{"window": 128, "epochs": [1, 2], "aux_qa": 8}`), or both. An unknown name is
    /// refused with the names that exist.
    pub fn with_json(&self, v: &serde_json::Value) -> Result<AbsorbOptions> {
        let given = v.as_object().ok_or_else(|| anyhow::anyhow!("absorb options must be a JSON object"))?;
        let mut nested = serde_json::to_value(self)?;
        let mut aux_qa = None;
        for (key, value) in given {
            match key.as_str() {
                "window" => nested["plan"]["window"] = value.clone(),
                "stride" => nested["plan"]["stride"] = value.clone(),
                "epochs" => nested["train"]["epochs"] = value.clone(),
                "aux_qa" => aux_qa = Some(value.clone()),
                "budget_seconds" => {
                    nested.as_object_mut().map(|o| o.insert(key.clone(), value.clone()));
                }
                "until_learned" if value.is_boolean() => {
                    let on = value.as_bool() == Some(true);
                    if !on {
                        nested["train"]["until_learned"] = serde_json::Value::Null;
                    } else if nested["train"]["until_learned"].is_null() {
                        nested["train"]["until_learned"] = serde_json::json!({});
                    }
                }
                k if nested.get(k).is_some() => merge_json(&mut nested[k], value),
                k => {
                    let mut known: Vec<&str> = nested.as_object().map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
                    known.extend(FLAT_OPTIONS);
                    known.sort_unstable();
                    known.dedup();
                    anyhow::bail!("unknown option '{k}' (options: {})", known.join(", "));
                }
            }
        }
        if let Some(n) = aux_qa {
            // A count asked for is a fixed cap, in place of the length-scaled one.
            nested["qa"]["max_pairs"] = n.clone();
            nested["qa"]["pairs_per_1k_tokens"] = 0.into();
            let n = n.as_u64().ok_or_else(|| anyhow::anyhow!("'aux_qa' must be a count of QA pairs (got {n})"))?;
            let min = nested["qa"]["min_pairs"].as_u64().unwrap_or(0).min(n);
            nested["qa"]["min_pairs"] = min.into();
        }
        // The nested option structs accept unknown keys (records of older options must still
        // read): any key set here that no option reads is refused by name.
        let mut ignored = Vec::new();
        let o = serde_ignored::deserialize(nested, |path| ignored.push(path.to_string()))?;
        if let Some(path) = ignored.first() {
            // The names beside it: those of the same object in these options.
            let defaults = serde_json::to_value(self)?;
            let parent = path.rsplit_once('.').map(|(p, _)| p);
            let siblings = parent.and_then(|p| p.split('.').try_fold(&defaults, |v, k| v.get(k))).and_then(|v| v.as_object());
            let known: Vec<&str> = siblings.map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
            anyhow::bail!("unknown option '{path}' (options in '{}': {})", parent.unwrap_or(""), known.join(", "));
        }
        Ok(o)
    }

    /// Options read from a JSON file over the defaults (see [`AbsorbOptions::with_json`]).
    pub fn from_file(path: &std::path::Path) -> Result<AbsorbOptions> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: cannot read: {e}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Self::default().with_json(&v).map_err(|e| anyhow::anyhow!("{}: invalid absorb options: {e}", path.display()))
    }
}

/// `value` merged into `target`: objects key by key, anything else replaced.
fn merge_json(target: &mut serde_json::Value, value: &serde_json::Value) {
    match (target.as_object_mut(), value.as_object()) {
        (Some(t), Some(v)) => {
            for (k, x) in v {
                match t.get_mut(k) {
                    Some(slot) => merge_json(slot, x),
                    None => {
                        t.insert(k.clone(), x.clone());
                    }
                }
            }
        }
        _ => *target = value.clone(),
    }
}

/// Bounds on absorb options that every path checks (HTTP requests, CLI flags, options files).
/// Below `MIN_WINDOW` tokens a step costs more in template and context tokens than it trains.
pub const MIN_WINDOW: usize = 32;
pub const MAX_EPOCHS: usize = 100;
/// The most auxiliary QA pairs a document may ask for (a 64K-token document's prose yields ~3,500;
/// the training-token cap bounds what they cost).
pub const MAX_AUX_QA: usize = 20_000;
/// The longest budget: a week.
pub const MAX_BUDGET_SECONDS: f64 = 7.0 * 24.0 * 3600.0;

/// Absorb options out of their bounds; each names the option, the bound and the value given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptionError {
    #[error("'window' must be between {min} and {max} (got {value})")]
    Window { value: usize, min: usize, max: usize },
    #[error("'stride' must be at least 1")]
    StrideZero,
    #[error("'stride' ({stride}) must not exceed the window ({window}): the text between windows would be skipped")]
    StrideOverWindow { stride: usize, window: usize },
    #[error("'epochs' must be two integers [segment_only, with_qa], each at most {max}, not both 0 (got {value:?})")]
    Epochs { value: [usize; 2], max: usize },
    #[error("'aux_qa' must be at most {max} (got {value})")]
    AuxQa { value: usize, max: usize },
    #[error("adapter layers must be below {num_layers} (got {layer})")]
    Layer { layer: usize, num_layers: usize },
    #[error("'budget_seconds' must be a number of seconds above 0 and at most {max} (got {value})")]
    Budget { value: f64, max: f64 },
}

impl OptionError {
    /// The option's name as clients write it.
    pub fn option(&self) -> &'static str {
        match self {
            OptionError::Window { .. } => "window",
            OptionError::StrideZero | OptionError::StrideOverWindow { .. } => "stride",
            OptionError::Epochs { .. } => "epochs",
            OptionError::AuxQa { .. } => "aux_qa",
            OptionError::Layer { .. } => "layers",
            OptionError::Budget { .. } => "budget_seconds",
        }
    }
}

impl AbsorbOptions {
    /// Checks the options against their bounds for a model of `num_layers` layers and a window
    /// of `max_window` tokens.
    pub fn validate(&self, num_layers: usize, max_window: usize) -> Result<(), OptionError> {
        let window = self.plan.window;
        if !(MIN_WINDOW..=max_window).contains(&window) {
            return Err(OptionError::Window { value: window, min: MIN_WINDOW, max: max_window });
        }
        match self.plan.stride {
            Some(0) => return Err(OptionError::StrideZero),
            // Windows that skip text between them would silently leave part of the document out.
            _ if self.plan.stride() > window => {
                return Err(OptionError::StrideOverWindow { stride: self.plan.stride(), window })
            }
            _ => {}
        }
        let e = self.train.epochs;
        if e[0] + e[1] == 0 || e[0] > MAX_EPOCHS || e[1] > MAX_EPOCHS {
            return Err(OptionError::Epochs { value: e, max: MAX_EPOCHS });
        }
        if self.qa.max_pairs > MAX_AUX_QA {
            return Err(OptionError::AuxQa { value: self.qa.max_pairs, max: MAX_AUX_QA });
        }
        if let Some(&layer) = self.layers.iter().flatten().find(|&&l| l >= num_layers) {
            return Err(OptionError::Layer { layer, num_layers });
        }
        if let Some(b) = self.budget_seconds.filter(|b| !(b.is_finite() && *b > 0.0 && *b <= MAX_BUDGET_SECONDS)) {
            return Err(OptionError::Budget { value: b, max: MAX_BUDGET_SECONDS });
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AbsorbStage {
    Tokenizing,
    GeneratingQa,
    Training,
    Saving,
}

/// Progress of an absorption, for progress bars and the API's event stream.
pub enum AbsorbEvent<'a> {
    Stage(AbsorbStage),
    Qa(&'a QaProgress),
    Train(&'a Progress),
    /// The adapter as training left it at the end of the segment stage and of each QA epoch:
    /// answers can use it before the run ends.
    Snapshot(AdapterSnapshot),
}

/// A detached copy of an adapter part-way through its training.
pub struct AdapterSnapshot {
    pub adapter: AnyAdapter,
    /// Optimizer steps done, of `planned_steps`.
    pub step: usize,
    pub planned_steps: usize,
}

pub struct Absorbed {
    pub bundle: AdapterBundle,
    pub manifest: Manifest,
    pub qa: Vec<QaPair>,
    pub report: TrainReport,
}

impl Absorbed {
    /// What the store saves: the adapter with its document and QA pairs.
    pub fn into_new_adapter(self, document: std::sync::Arc<Document>) -> Result<NewAdapter> {
        let qa_json = serde_json::to_vec_pretty(&self.qa)?;
        Ok(NewAdapter { bundle: self.bundle, manifest: self.manifest, document, qa_json })
    }
}

/// Seconds of a time budget kept for saving the adapter after training.
const SAVE_RESERVE_SECONDS: f64 = 2.0;

/// Absorbs `document` into a new adapter. `cancel` is polled between steps.
pub fn absorb(
    model: &Model,
    document: &Document,
    title: Option<&str>,
    opts: &AbsorbOptions,
    on_event: &mut dyn FnMut(AbsorbEvent),
    cancel: &dyn Fn() -> bool,
) -> Result<Absorbed> {
    absorb_resumable(model, document, title, opts, on_event, cancel, None)
}

/// [`absorb`], checkpointed into `resumable` and continuing from the checkpoint it holds for the
/// same run (see [`checkpoint`]). The caller deletes the checkpoint once the adapter is saved.
pub fn absorb_resumable(
    model: &Model,
    document: &Document,
    title: Option<&str>,
    opts: &AbsorbOptions,
    on_event: &mut dyn FnMut(AbsorbEvent),
    cancel: &dyn Fn() -> bool,
    resumable: Option<checkpoint::Resumable>,
) -> Result<Absorbed> {
    let t0 = Instant::now();
    on_event(AbsorbEvent::Stage(AbsorbStage::Tokenizing));
    let (text, doc) = (document.text.as_str(), document.tokens());
    anyhow::ensure!(!doc.is_empty(), "the document is empty");

    let identity = resumable.as_ref().map(|_| checkpoint::Identity::of(model, document, opts)).transpose()?;
    let mut resume_refused = None;
    let found = match (&resumable, &identity) {
        (Some(r), Some(identity)) => match checkpoint::Checkpoint::find(&*r.store, identity, model.device()) {
            Ok(found) => found,
            Err(why) => {
                tracing::warn!(%why, "the absorb's checkpoint is not resumed: training starts from step 0");
                resume_refused = Some(why);
                None
            }
        },
        _ => None,
    };
    let (pairs, qa_seconds, resume) = match found {
        // The pairs the checkpointed run trained on, not generated again.
        Some(c) => (c.qa, c.qa_seconds, Some(c.train)),
        None => {
            on_event(AbsorbEvent::Stage(AbsorbStage::GeneratingQa));
            let qa_start = Instant::now();
            let qa_opts = opts.qa.for_document(doc.len());
            let pairs = qa::generate_qa(model, text, &qa_opts, &mut |p| on_event(AbsorbEvent::Qa(p)), cancel)?;
            (pairs, qa_start.elapsed().as_secs_f64(), None)
        }
    };
    tracing::info!(pairs = pairs.len(), seconds = qa_seconds, "auxiliary QA ready");
    let resumed_from_step = resume.as_ref().map(|t| t.cursor.step);
    // The budget counts the whole absorb, across stops: QA, training before a resume, this run,
    // and the save after it.
    let deadline = opts.budget_seconds.map(|budget| {
        let before = qa_seconds + resume.as_ref().map_or(0.0, |t| t.cursor.report.seconds);
        let left = (budget - before - t0.elapsed().as_secs_f64() - SAVE_RESERVE_SECONDS).max(0.0);
        Instant::now() + std::time::Duration::from_secs_f64(left)
    });

    on_event(AbsorbEvent::Stage(AbsorbStage::Training));
    let adapter = new_adapter(model, opts)?;
    let (trained, held) = hold_aside(&pairs, opts);
    let (plan, filter_examples) = plan(model, document, &trained, opts)?;
    let train_opts = opts.effective_train();
    let base_filter = model.base_filter().map(|f| FilterTraining::frozen(f, &filter_examples));
    // Probes in the layout the QA examples train in, one question per row.
    let mut probe_opts = opts.clone();
    probe_opts.plan.qa_pack = 1;
    let probe_plan = match held.is_empty() {
        true => None,
        false => Some(self::plan(model, document, &held, &probe_opts)?),
    };
    let probes = probe_plan.as_ref().map(|(p, fx)| trainer::Probes {
        examples: &p.qa,
        filter: model.base_filter().map(|f| FilterTraining::frozen(f, fx)),
    });
    let inputs = TrainInputs { doc, plan: &plan, adapter: &adapter, vars: adapter.vars() };
    // Snapshots when the segment stage ends and after each QA epoch (not after the last step:
    // the final adapter follows at once).
    let segment_epochs = train_opts.epochs[0];
    let on_progress = &mut |p: &Progress| {
        on_event(AbsorbEvent::Train(p));
        let stage_point = p.epoch >= segment_epochs;
        if p.epoch_end && stage_point && p.step < p.steps {
            let snapshot = AdapterSnapshot { adapter: adapter.detached(), step: p.step, planned_steps: p.steps };
            on_event(AbsorbEvent::Snapshot(snapshot));
        }
    };
    let control = RunControl { on_progress, cancel };
    // A checkpoint that cannot be written is logged; training goes on without it.
    let save = &mut |t: trainer::TrainCheckpoint| {
        if let (Some(r), Some(identity)) = (&resumable, &identity) {
            let step = t.cursor.step;
            match checkpoint::Checkpoint::encode(identity, &pairs, qa_seconds, t).and_then(|b| r.store.save(b)) {
                Ok(()) => tracing::info!(step, "absorb checkpoint written"),
                Err(e) => tracing::warn!(step, error = %format!("{e:#}"), "cannot write the absorb's checkpoint"),
            }
        }
        Ok(())
    };
    let checkpoints = resumable.as_ref().map(|r| trainer::Checkpointing { interval: r.interval, resume, save });
    let long = trainer::LongRun { checkpoints, deadline };
    let report = trainer::train_long(model, inputs, &train_opts, base_filter.as_ref(), probes.as_ref(), control, long)?;

    on_event(AbsorbEvent::Stage(AbsorbStage::Saving));
    let bundle = AdapterBundle::new(adapter.detached());
    let mut figures = training_figures(&report, pairs.len(), qa_seconds, plan.segments.len(), t0);
    figures["probe_pairs"] = held.len().into();
    if let Some(step) = resumed_from_step {
        figures["resumed_from_step"] = step.into();
    }
    if let Some(why) = resume_refused {
        figures["resume_refused"] = why.into();
    }
    // What the frozen base's matmuls computed in while training (bf16 on CUDA and on CPUs with
    // AVX-512 BF16, f32 elsewhere): part of how the adapter was made.
    let matmul = if model.decoder.float_in_bf16() || !model.device().is_cpu() { "bf16" } else { "f32" };
    figures["train_matmul"] = matmul.into();
    let document_ref = DocumentRef::new(text, doc.len(), title.map(str::to_string));
    let manifest = Manifest::new(&bundle, BaseModelRef::of(model), document_ref, serde_json::to_value(opts)?, figures);
    Ok(Absorbed { bundle, manifest, qa: pairs, report })
}

/// A fresh adapter of the kind the options ask for.
fn new_adapter(model: &Model, opts: &AbsorbOptions) -> Result<AnyAdapter> {
    let cfg = model.config();
    let seed = opts.train.seed;
    Ok(match opts.adapter {
        AdapterKind::GatedMemory => {
            let layers = opts.gated_memory_layers(cfg.num_layers);
            anyhow::ensure!(
                layers.iter().all(|&l| l < cfg.num_layers),
                "adapter layers must be below {}",
                cfg.num_layers
            );
            let gm = GatedMemory::new(cfg, &layers, cfg.attention_bias, seed, model.device())?;
            // Qwen2's biased queries are large in its first layer (per-head RMS 3–16 against 1–3
            // above it, Qwen2.5-Coder-0.5B): a kaiming-initialised memory there saturates some
            // heads' gates and outweighs the attention (next-token loss on prose 4.02 → 10.61 with
            // a fresh adapter on every layer, and answers of one repeated word after training).
            // Its output layers start at zero there (4.02 → 4.02). Models without attention
            // biases (Llama, SmolLM2: 3.81 → 3.93 with the kaiming start) keep the authors' init.
            if cfg.attention_bias {
                gm.zero_outputs()?;
            }
            AnyAdapter::GatedMemory(gm)
        }
        AdapterKind::Lora => AnyAdapter::Lora(Lora::new(cfg, &opts.lora, seed, model.device())?),
    })
}

/// The training plan. With the prepared base's FltLM filter the QA examples are built once, in
/// its layout (one question per row: its bookkeeping of chunks is per row), as the answer lays
/// out the context; the filter then masks them, frozen (a detached copy, no filter loss).
fn plan(
    model: &Model,
    document: &Document,
    pairs: &[QaPair],
    opts: &AbsorbOptions,
) -> Result<(Plan, Vec<filter::FilterExample>)> {
    let Some(f) = model.base_filter() else {
        return Ok((Plan::new(model, document.tokens(), pairs, &opts.plan)?, Vec::new()));
    };
    if opts.plan.qa_pack > 1 {
        // Each question's filter masks the context its own way; a packed row shares one context.
        tracing::warn!(qa_pack = opts.plan.qa_pack, "qa_pack has no effect under the prepared base's filter: one question per row");
    }
    let examples = filter::qa_examples(model, document, pairs, opts.plan.qa_context(), f)?;
    let qa = examples.iter().map(|e| e.example.clone()).collect();
    Ok((Plan::with_qa(model, document.tokens(), qa, &opts.plan)?, examples))
}

/// The QA pairs to train on and those held aside as probes (absorb until learned; none
/// otherwise, or when there are too few pairs to spare: the fixed schedule then runs to its end).
///
/// Probes are *rewordings*: one wording of a fact whose other wordings stay in training (the
/// extractive wordings of one fact share its evidence span), so a probe measures whether a fact
/// the adapter was taught is recalled through a question it never saw — what a user's question
/// does — not whether a trained question is copied, nor whether an untaught fact can be guessed.
/// Facts with a single wording are held aside whole only when too few facts have two.
fn hold_aside(pairs: &[QaPair], opts: &AbsorbOptions) -> (Vec<QaPair>, Vec<QaPair>) {
    let Some(rule) = &opts.train.until_learned else { return (pairs.to_vec(), Vec::new()) };
    let n = rule.probe_count(pairs.len());
    if n == 0 {
        tracing::warn!(pairs = pairs.len(), "too few QA pairs to hold any aside as probes: the fixed schedule runs to its end");
        return (pairs.to_vec(), Vec::new());
    }
    let held = probe_indices(pairs, n, opts.train.seed);
    let (mut trained, mut probes) = (Vec::new(), Vec::new());
    for (i, p) in pairs.iter().enumerate() {
        if held.contains(&i) { probes.push(p.clone()) } else { trained.push(p.clone()) }
    }
    (trained, probes)
}

/// Which `n` of `pairs` (in document order) to hold aside: one wording each of `n` facts with
/// several, spread evenly over the document (seeded choice of the wording); single-wording facts,
/// spread likewise, only to make up the count.
fn probe_indices(pairs: &[QaPair], n: usize, seed: u64) -> std::collections::BTreeSet<usize> {
    let mut facts: std::collections::BTreeMap<(usize, usize), Vec<usize>> = Default::default();
    for (i, p) in pairs.iter().enumerate() {
        facts.entry(p.evidence_span).or_default().push(i);
    }
    let (multi, single): (Vec<Vec<usize>>, Vec<Vec<usize>>) = facts.into_values().partition(|w| w.len() >= 2);
    // `k` of `items`, evenly spaced from a seeded offset.
    let spread = |items: &[Vec<usize>], k: usize| -> Vec<Vec<usize>> {
        let k = k.min(items.len());
        let step = items.len() as f64 / k.max(1) as f64;
        let offset = (seed as f64 * 0.618_033_988_7).fract() * step;
        (0..k).map(|i| items[((offset + i as f64 * step) as usize).min(items.len() - 1)].clone()).collect()
    };
    let mut held: std::collections::BTreeSet<usize> = spread(&multi, n)
        .into_iter()
        .enumerate()
        .map(|(k, wordings)| wordings[(seed as usize + k) % wordings.len()])
        .collect();
    let missing = n - held.len();
    held.extend(spread(&single, missing).into_iter().map(|w| w[0]));
    held
}

/// The manifest's `training` figures.
fn training_figures(r: &TrainReport, qa_pairs: usize, qa_seconds: f64, segments: usize, t0: Instant) -> serde_json::Value {
    serde_json::json!({
        "steps": r.steps,
        "examples": r.examples,
        "tokens": r.tokens,
        "train_seconds": r.seconds,
        "tokens_per_s": r.tokens_per_s,
        "final_loss": r.final_loss,
        "epoch_losses": r.epoch_losses,
        // Every step's loss (a few KB at most): the whole curve, which progress events may thin.
        "step_losses": r.step_losses,
        "stopped_early": r.stopped_early,
        "planned_steps": r.planned_steps,
        "probe_curve": r.probe_curve,
        "cooldown_from": r.cooldown_from,
        "cooldown_cause": r.cooldown_cause,
        "skipped_examples": r.skipped_examples,
        "out_of_time": r.out_of_time,
        "qa_pairs": qa_pairs,
        "qa_seconds": qa_seconds,
        "segments": segments,
        "total_seconds": t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_files_take_either_spelling_and_name_the_known_options() {
        let d = AbsorbOptions::default();
        let flat = d.with_json(&serde_json::json!({"window": 64, "stride": 24, "epochs": [1, 2], "aux_qa": 3, "until_learned": true})).unwrap();
        let nested = d
            .with_json(&serde_json::json!({"plan": {"window": 64, "stride": 24}, "train": {"epochs": [1, 2], "until_learned": {}},
                                           "qa": {"max_pairs": 3, "min_pairs": 3, "pairs_per_1k_tokens": 0}}))
            .unwrap();
        assert_eq!(serde_json::to_value(&flat).unwrap(), serde_json::to_value(&nested).unwrap());
        assert_eq!((flat.plan.window, flat.plan.stride, flat.train.epochs, flat.qa.max_pairs), (64, Some(24), [1, 2], 3));
        assert!(flat.qa.min_pairs <= 3 && flat.train.until_learned.is_some());
        // Nested keys keep the defaults they do not name.
        let one = d.with_json(&serde_json::json!({"plan": {"window": 96}})).unwrap();
        assert_eq!((one.plan.window, one.plan.context_tokens), (96, d.plan.context_tokens));
        let e = d.with_json(&serde_json::json!({"windw": 64})).unwrap_err().to_string();
        assert!(e.contains("'windw'") && e.contains("window") && e.contains("plan") && !e.contains("windw,"), "{e}");
        let e = d.with_json(&serde_json::json!({"plan": {"windw": 64}})).unwrap_err().to_string();
        assert!(e.contains("windw") && e.contains("window"), "{e}");
    }
    use qa::QaSource;

    fn pair(q: &str, span: (usize, usize)) -> QaPair {
        QaPair { question: q.into(), answer: "a".into(), evidence: "e".into(), evidence_span: span, source: QaSource::Extractive }
    }

    #[test]
    fn probes_are_rewordings_of_facts_that_stay_in_training() {
        // Ten facts: the even ones with three wordings, the odd ones with one.
        let mut pairs = Vec::new();
        for f in 0..10 {
            let wordings = if f % 2 == 0 { 3 } else { 1 };
            pairs.extend((0..wordings).map(|w| pair(&format!("q{f}.{w}"), (10 * f, 10 * f + 5))));
        }
        for seed in 0..4 {
            let held = probe_indices(&pairs, 4, seed);
            assert_eq!(held.len(), 4);
            for &i in &held {
                let span = pairs[i].evidence_span;
                assert!(
                    (0..pairs.len()).any(|j| !held.contains(&j) && pairs[j].evidence_span == span),
                    "seed {seed}: probe {} has no trained wording",
                    pairs[i].question
                );
            }
            // Four of the five multi-wording facts, at most one wording each.
            let facts: std::collections::BTreeSet<_> = held.iter().map(|&i| pairs[i].evidence_span).collect();
            assert_eq!(facts.len(), 4);
        }
        // More probes than multi-wording facts: single-wording facts make up the count.
        let held = probe_indices(&pairs, 7, 0);
        assert_eq!(held.len(), 7);
        assert_eq!(held.iter().filter(|&&i| pairs[i].evidence_span.0 % 20 == 10).count(), 2);
    }
}
