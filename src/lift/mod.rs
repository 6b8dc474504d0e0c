//! LIFT (seeds/001_18569741511b14ae.txt): absorb a long document into a per-document adapter.
//! document → tokens and sentences → auxiliary QA → plan (segments with contextualized training,
//! QA examples) → train → adapter bundle + manifest; and answering with it (`answer`).

pub mod answer;
pub mod cdt;
pub mod filter;
pub mod plan;
pub mod prompt;
pub mod qa;
pub mod text;
pub mod trainer;

use crate::adapters::manifest::{BaseModelRef, DocumentRef, Manifest};
use crate::adapters::{AdapterBundle, AdapterKind, AnyAdapter, GatedMemory, Lora, LoraConfig};
use crate::model::Model;
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
    /// seeds/003_f7f1ca5d1ccbd814.txt) absorbs in ~60% of the time because layers below the lowest
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
        }
    }
}

impl AbsorbOptions {
    /// The LIFT paper's recipe (seeds/001_18569741511b14ae.txt App. A.2; the authors' code),
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
}

pub struct Absorbed {
    pub bundle: AdapterBundle,
    pub manifest: Manifest,
    pub qa: Vec<QaPair>,
    pub report: TrainReport,
    pub doc_tokens: Vec<u32>,
}

/// Absorbs `text` into a new adapter. `cancel` is polled between steps.
pub fn absorb(
    model: &Model,
    text: &str,
    title: Option<&str>,
    opts: &AbsorbOptions,
    on_event: &mut dyn FnMut(AbsorbEvent),
    cancel: &dyn Fn() -> bool,
) -> Result<Absorbed> {
    let t0 = Instant::now();
    on_event(AbsorbEvent::Stage(AbsorbStage::Tokenizing));
    let doc = model.encode_document(text)?;
    anyhow::ensure!(!doc.is_empty(), "the document is empty");

    on_event(AbsorbEvent::Stage(AbsorbStage::GeneratingQa));
    let qa_start = Instant::now();
    let pairs = qa::generate_qa(model, text, &opts.qa, &mut |p| on_event(AbsorbEvent::Qa(p)), cancel)?;
    let qa_seconds = qa_start.elapsed().as_secs_f64();
    tracing::info!(pairs = pairs.len(), seconds = qa_seconds, "auxiliary QA ready");

    on_event(AbsorbEvent::Stage(AbsorbStage::Training));
    let cfg = model.config();
    let seed = opts.train.seed;
    let adapter = match opts.adapter {
        AdapterKind::GatedMemory => {
            let layers = opts.gated_memory_layers(cfg.num_layers);
            anyhow::ensure!(
                layers.iter().all(|&l| l < cfg.num_layers),
                "adapter layers must be below {}",
                cfg.num_layers
            );
            AnyAdapter::GatedMemory(GatedMemory::new(cfg, &layers, cfg.attention_bias, seed, model.device())?)
        }
        AdapterKind::Lora => AnyAdapter::Lora(Lora::new(cfg, &opts.lora, seed, model.device())?),
    };
    // The prepared base's FltLM filter lays out and softly masks the QA examples as it will when
    // answering (frozen: a detached copy, no filter loss). Its bookkeeping (chunks) is per row.
    let mut plan_opts = opts.plan.clone();
    if model.base_filter().is_some() {
        plan_opts.qa_pack = 1;
    }
    let plan = Plan::new(model, &doc, &pairs, &plan_opts)?;
    let train_opts = opts.effective_train();
    let filter_examples = match model.base_filter() {
        Some(f) => filter::qa_examples(model, text, &doc, &pairs, opts.plan.qa_context(), f)?,
        None => Vec::new(),
    };
    let base_filter = model.base_filter().map(|f| FilterTraining::frozen(f, &filter_examples));
    let inputs = TrainInputs { doc: &doc, plan: &plan, adapter: &adapter, vars: adapter.vars() };
    let control = RunControl { on_progress: &mut |p| on_event(AbsorbEvent::Train(p)), cancel };
    let report = trainer::train_with(model, inputs, &train_opts, base_filter.as_ref(), control)?;

    on_event(AbsorbEvent::Stage(AbsorbStage::Saving));
    let bundle = AdapterBundle::new(adapter.detached());
    let manifest = Manifest::new(
        &bundle,
        BaseModelRef::of(model),
        DocumentRef::new(text, doc.len(), title.map(str::to_string)),
        serde_json::to_value(opts)?,
        serde_json::json!({
            "steps": report.steps,
            "examples": report.examples,
            "tokens": report.tokens,
            "train_seconds": report.seconds,
            "tokens_per_s": report.tokens_per_s,
            "final_loss": report.final_loss,
            "epoch_losses": report.epoch_losses,
            "stopped_early": report.stopped_early,
            "qa_pairs": pairs.len(),
            "qa_seconds": qa_seconds,
            "segments": plan.segments.len(),
            "total_seconds": t0.elapsed().as_secs_f64(),
        }),
    );
    Ok(Absorbed { bundle, manifest, qa: pairs, report, doc_tokens: doc })
}
