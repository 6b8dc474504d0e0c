//! Absorb options: one schema ([`AbsorbOptions`], saved nested in every manifest and part of a
//! document's id), one overlay of the settings users name ([`OptionOverlay`]: the same flat names
//! in a request, on the CLI and in an options file), and the bounds every path checks.

use super::absorb::plan::{PlanOptions, QaLayout};
use super::absorb::qa::{KeepAnswerable, QaOptions, MAX_AUX_QA};
use super::absorb::trainer::TrainOptions;
use crate::adapters::{AdapterKind, LoraConfig};
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::ffi::OsStr;

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
    /// (docs/absorb-speed.md).
    pub layers: Option<Vec<usize>>,
    pub lora: LoraConfig,
    /// Learning rate; default per adapter kind (Gated Memory 1e-3 as in the paper's Table 9,
    /// LoRA 5e-5 as in the authors' later version).
    pub lr: Option<f64>,
    pub plan: PlanOptions,
    pub qa: QaOptions,
    pub train: TrainOptions,
    /// Seconds the whole absorb may take: the plan is fitted to it before the absorb starts
    /// ([`crate::lift::pricing`]) and training stops at it. None: the options as they are.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_seconds: Option<f64>,
}

impl Default for AbsorbOptions {
    /// The default recipe ([`Recipe::Paper`]) over the parts' defaults.
    fn default() -> Self {
        let mut o = Self {
            adapter: AdapterKind::GatedMemory,
            layers: None,
            lora: LoraConfig::default(),
            lr: None,
            plan: PlanOptions::default(),
            qa: QaOptions::default(),
            train: TrainOptions::default(),
            budget_seconds: None,
        };
        Recipe::default().set(&mut o);
        o
    }
}

/// A named training recipe (flat name `recipe`): the settings that decide what an absorb trains
/// on and for how long, measured together on the validation split (docs/recipe-search.md). Laid
/// over the options before any other setting given with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Recipe {
    /// The default: the LIFT paper's schedule (3 epochs on the segments, then 5 on segments +
    /// questions, the questions behind the document's head and tail), a short document's every
    /// fact in four wordings. On 45 validation questions the adapter answered 32 against the
    /// passages' 22, paraphrased questions included (5 of 9).
    #[default]
    Paper,
    /// About a seventh of the paper's training: one epoch on the segments, then two on segments +
    /// questions, 64 questions per 1,000 tokens, each trained on the passages its answer reads. On
    /// the same questions 27: it reads the passages better, but recalls no paraphrased fact.
    Lean,
}

impl Recipe {
    /// Sets the recipe's settings in `o`; everything else is kept.
    pub fn set(self, o: &mut AbsorbOptions) {
        let qa = QaOptions::default();
        match self {
            Recipe::Paper => {
                o.train.epochs = [3, 5];
                o.plan.qa_layout = QaLayout::HeadTail;
                o.qa.cap_floor = qa.cap_floor;
            }
            Recipe::Lean => {
                o.train.epochs = [1, 2];
                o.plan.qa_layout = QaLayout::Passages;
                o.qa.cap_floor = 0;
            }
        }
        o.qa.pairs_per_1k_tokens = qa.pairs_per_1k_tokens;
    }

    pub fn name(self) -> &'static str {
        match self {
            Recipe::Paper => "paper",
            Recipe::Lean => "lean",
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
    /// An evaluation baseline (`eval --methods lift-paper`), not an option a user sets.
    #[cfg(feature = "research")]
    pub fn paper_faithful(num_layers: usize) -> Self {
        let mut o = Self { layers: Some((0..num_layers).collect()), ..Self::default() };
        Recipe::Paper.set(&mut o);
        o.plan.window = 256;
        o.plan.training_context_tokens = 256;
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

/// Who may set a flat option: `Http`, a request's `options` as well as the CLI and options files;
/// `Operator`, only the CLI and options files (the server's `--absorb-options`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exposure {
    Http,
    Operator,
}

/// The one declaration of the flat absorb options. From each line it makes:
/// - a field of [`OptionOverlay`]: the options-file key, the CLI flag (`--aux-qa` for `aux_qa`,
///   with the `#[arg]` given) and its help, all by the same name;
/// - for `Http` lines, a field of [`DocumentOptions`], the `options` of `POST /documents` (with
///   its OpenAPI schema), beside the removed options a request is told about;
/// - an entry of [`OptionOverlay::NAMES`].
///
/// What each one sets is [`OptionOverlay::apply`]'s.
macro_rules! absorb_options {
    ($( $(#[doc = $doc:literal])* #[arg($($arg:tt)*)] $expose:ident $name:ident: $ty:ty; )*) => {
        /// The settings a user sets by name, each with one name wherever it is set: a request's
        /// `options` (`POST /documents`, the `Http` ones), the CLI's flags and an options file's
        /// flat keys. Laid over defaults by [`OptionOverlay::apply`], the only place an overlay
        /// happens; `None` keeps the default.
        #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, clap::Args)]
        #[serde(deny_unknown_fields)]
        pub struct OptionOverlay {
            $( $(#[doc = $doc])* #[arg($($arg)*)] pub $name: Option<$ty>, )*
        }

        impl OptionOverlay {
            /// Every flat name, in declaration order, and who may set it.
            pub const NAMES: &'static [(&'static str, Exposure)] = &[$((stringify!($name), Exposure::$expose)),*];
        }

        http_options!([] [] $( $expose [$($doc)*] $name [$ty]; )*);
    };
}

/// [`DocumentOptions`] from the `Http` lines of [`absorb_options!`] (and `From` for the overlay).
macro_rules! http_options {
    ([$($field:tt)*] [$($name:ident)*]) => {
        /// The absorb options a request may set (`POST /documents`' `options`); the others are the
        /// server's `--absorb-options`.
        #[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
        #[serde(deny_unknown_fields)]
        pub struct DocumentOptions {
            $($field)*
            /// Removed: FltLM's filter belongs to the server's prepared base (400 `removed_option`).
            #[schema(value_type = Option<Object>)]
            pub filter: Option<serde_json::Value>,
            /// Removed: CDT belongs to the server's prepared base (400 `removed_option`).
            #[schema(value_type = Option<Object>)]
            pub cdt: Option<serde_json::Value>,
            /// Removed: context distillation was measured and rejected (400 `removed_option`).
            #[schema(value_type = Option<Object>)]
            pub distill: Option<serde_json::Value>,
            /// Removed: training on a selected share of the questions was measured and rejected
            /// (400 `removed_option`).
            #[schema(value_type = Option<Object>)]
            pub qa_select: Option<serde_json::Value>,
        }

        impl DocumentOptions {
            /// The settings given, by the names every path uses.
            pub fn overlay(&self) -> OptionOverlay {
                OptionOverlay { $($name: self.$name.clone(),)* ..Default::default() }
            }

        }
    };
    ([$($field:tt)*] [$($names:ident)*] Http [$($doc:literal)*] $name:ident [$ty:ty]; $($rest:tt)*) => {
        http_options!([$($field)* $(#[doc = $doc])* pub $name: Option<$ty>,] [$($names)* $name] $($rest)*);
    };
    ([$($field:tt)*] [$($names:ident)*] Operator [$($doc:literal)*] $name:ident [$ty:ty]; $($rest:tt)*) => {
        http_options!([$($field)*] [$($names)*] $($rest)*);
    };
}

absorb_options! {
    /// A named recipe laid over the defaults before the settings below: `paper` (the default: 3 +
    /// 5 epochs, the questions behind the document's head and tail) or `lean` (about a seventh of
    /// its training: 1 + 2 epochs, the questions on their own passages).
    #[arg(long, value_enum)]
    Http recipe: Recipe;
    /// The adapter: `gated_memory` (the default) or `lora`.
    #[arg(long, value_enum)]
    Http adapter: AdapterKind;
    /// Layers with a Gated Memory adapter: `all` (the default), `15-29` or `3,5,7` (in a file, a
    /// list of layer indices or one of those strings).
    #[arg(long)]
    Operator layers: LayerSpec;
    /// Tokens per training segment.
    #[arg(long)]
    Http window: usize;
    /// Tokens between segment starts (at most `window`; default 3/8 of it).
    #[arg(long)]
    Http stride: usize;
    /// Head+tail document tokens before each training segment and question (training only; the
    /// answering budget is `context_tokens` of `/ask`, `ask` and `eval`).
    #[arg(long)]
    Operator training_context_tokens: usize;
    /// Head+tail document tokens before each auxiliary question (default:
    /// `training_context_tokens`; 0: the questions trained closed-book).
    #[arg(long)]
    Operator qa_context_tokens: usize;
    /// [segment-only epochs, segment + QA epochs] (on the CLI `A,B`, e.g. `3,5`).
    #[arg(long, value_parser = parse_epochs)]
    Http epochs: [usize; 2];
    /// AdamW learning rate (default: 1e-3 for Gated Memory, 5e-5 for LoRA).
    #[arg(long)]
    Operator lr: f64;
    /// Examples per optimizer step.
    #[arg(long)]
    Operator accumulation: usize;
    /// Run the rows of an optimizer step as batched forwards and backwards, grouped by length so
    /// that each group's padding stays within this share of its tokens (the same gradients; off
    /// by default: the 2-core CPU gains nothing from it).
    #[arg(long)]
    Operator batch_rows: f64;
    /// Optimizer steps of linear learning-rate warm-up.
    #[arg(long)]
    Operator warmup_steps: usize;
    /// Auxiliary questions packed into one training row behind their shared context (1: none).
    #[arg(long)]
    Operator qa_pack: usize;
    /// Segments packed into one contextualized-training row behind one context (1: none).
    #[arg(long)]
    Operator segment_pack: usize;
    /// The context before each auxiliary question in training: the document's head and tail
    /// (`head_tail`), or the passages an answer to it would show (`passages`).
    #[arg(long, value_parser = QaLayoutFlag)]
    Operator qa_layout: QaLayout;
    /// Most auxiliary QA pairs, a fixed cap (default: at most 64 per 1,000 document tokens, and
    /// never under 256).
    #[arg(long, alias = "max-qa")]
    Http aux_qa: usize;
    /// Auxiliary QA pairs per 1,000 document tokens, the length-scaled cap (0: the fixed cap
    /// alone).
    #[arg(long)]
    Operator pairs_per_1k_tokens: usize;
    /// The length-scaled cap is never below this many pairs (0: no floor).
    #[arg(long)]
    Operator cap_floor: usize;
    /// Also have the model write QA pairs (the paper's A.3 prompt; slow, and the default 135M
    /// model writes almost no valid ones).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    Operator model_qa: bool;
    /// Keep only the auxiliary QA pairs the base answers when it reads their evidence: `off`
    /// (the default), `pairs` (each pair on its own) or `facts` (a fact's every wording when one
    /// of them is answered).
    #[arg(long, value_enum)]
    Operator keep_answerable: KeepAnswerable;
    /// Absorb until learned: hold some QA pairs aside as probes and stop once they stop
    /// improving (`epochs` is then the ceiling); false: the fixed schedule. Default: the
    /// server's options.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    Http until_learned: bool;
    /// The seed of the plan, the training and the QA pairs.
    #[arg(long)]
    Operator seed: u64;
    /// Seconds the absorb may take: the plan is fitted to it at the measured rate (fewer epochs,
    /// no segment overlap, fewer QA pairs; said in warnings) and training stops at it. Default:
    /// the server's `--absorb-budget`, else none.
    #[arg(long, alias = "budget")]
    Http budget_seconds: f64;
}

/// `--epochs A,B`.
fn parse_epochs(s: &str) -> Result<[usize; 2], String> {
    let v: Vec<usize> = s.split(',').map(|x| x.trim().parse()).collect::<Result<_, _>>().map_err(|e| format!("{e}"))?;
    <[usize; 2]>::try_from(v).map_err(|_| "two numbers, e.g. 3,5".to_string())
}

/// Adapted layers as users name them: every layer, or a list (`15-29`, `3,5,7`, or a JSON list).
#[derive(Clone, Debug, PartialEq)]
pub enum LayerSpec {
    All,
    List(Vec<usize>),
}

impl std::str::FromStr for LayerSpec {
    type Err = String;
    fn from_str(spec: &str) -> Result<Self, String> {
        if spec.trim() == "all" {
            return Ok(LayerSpec::All);
        }
        let mut out = Vec::new();
        let num = |x: &str| x.trim().parse::<usize>().map_err(|e| format!("'{x}': {e}"));
        for part in spec.split(',') {
            match part.split_once('-') {
                Some((a, b)) => out.extend(num(a)?..=num(b)?),
                None => out.push(num(part)?),
            }
        }
        out.sort_unstable();
        out.dedup();
        Ok(LayerSpec::List(out))
    }
}

impl Serialize for LayerSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            LayerSpec::All => s.serialize_str("all"),
            LayerSpec::List(l) => l.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for LayerSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Given {
            List(Vec<usize>),
            Text(String),
        }
        match Given::deserialize(d)? {
            Given::List(l) => Ok(LayerSpec::List(l)),
            Given::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl OptionOverlay {
    /// The flat names, in the order of the declaration.
    pub fn names() -> Vec<String> {
        Self::NAMES.iter().map(|(n, _)| n.to_string()).collect()
    }

    /// `base` with the settings given here.
    pub fn apply(&self, base: &AbsorbOptions) -> AbsorbOptions {
        let mut o = base.clone();
        if let Some(r) = self.recipe {
            r.set(&mut o);
        }
        set(&mut o.adapter, self.adapter);
        match &self.layers {
            Some(LayerSpec::All) => o.layers = None,
            Some(LayerSpec::List(l)) => o.layers = Some(l.clone()),
            None => {}
        }
        set(&mut o.plan.window, self.window);
        if self.stride.is_some() {
            o.plan.stride = self.stride;
        }
        set(&mut o.plan.training_context_tokens, self.training_context_tokens);
        if self.qa_context_tokens.is_some() {
            o.plan.qa_context_tokens = self.qa_context_tokens;
        }
        set(&mut o.train.epochs, self.epochs);
        if self.lr.is_some() {
            o.lr = self.lr;
        }
        set(&mut o.train.accumulation, self.accumulation);
        if self.batch_rows.is_some() {
            o.train.batch_rows = self.batch_rows;
        }
        set(&mut o.train.warmup_steps, self.warmup_steps);
        set(&mut o.plan.qa_pack, self.qa_pack);
        set(&mut o.plan.segment_pack, self.segment_pack);
        set(&mut o.plan.qa_layout, self.qa_layout);
        if let Some(n) = self.aux_qa {
            // A count asked for is a fixed cap, in place of the length-scaled one, and the floor
            // never above it.
            o.qa.max_pairs = n;
            o.qa.pairs_per_1k_tokens = 0;
            o.qa.min_pairs = o.qa.min_pairs.min(n);
        }
        set(&mut o.qa.pairs_per_1k_tokens, self.pairs_per_1k_tokens);
        set(&mut o.qa.cap_floor, self.cap_floor);
        set(&mut o.qa.use_model, self.model_qa);
        set(&mut o.qa.keep_answerable, self.keep_answerable);
        match self.until_learned {
            Some(true) if o.train.until_learned.is_none() => o.train.until_learned = Some(Default::default()),
            Some(false) => o.train.until_learned = None,
            _ => {}
        }
        if let Some(s) = self.seed {
            o.train.seed = s;
            o.qa.seed = s;
        }
        if self.budget_seconds.is_some() {
            o.budget_seconds = self.budget_seconds;
        }
        o
    }
}

fn set<T>(slot: &mut T, value: Option<T>) {
    if let Some(v) = value {
        *slot = v;
    }
}

/// Older names of nested options, read as today's (options files and records written before the
/// rename): (object, old key, key).
const NESTED_ALIASES: &[(&str, &str, &str)] =
    &[("plan", "context_tokens", "training_context_tokens"), ("qa", "max_pairs", "aux_qa")];

impl AbsorbOptions {
    /// Options given as JSON over `self`, in either spelling: nested as this struct is saved
    /// (`{"plan": {"window": 128}, "train": {"epochs": [1, 2]}}`) or by the flat names of
    /// [`OptionOverlay`] (`{"window": 128, "epochs": [1, 2], "aux_qa": 8}`), or both (the flat
    /// names win). An unknown name is refused with the names that exist.
    pub fn with_json(&self, v: &serde_json::Value) -> Result<AbsorbOptions> {
        let given = v.as_object().ok_or_else(|| anyhow::anyhow!("absorb options must be a JSON object"))?;
        let flat_names = OptionOverlay::names();
        // A recipe lies under everything else given with it, nested keys included: laid over
        // `self` first, not by the overlay after the nested keys are merged.
        let mut under = self.clone();
        if let Some(r) = given.get("recipe") {
            let recipe: Recipe = serde_json::from_value(r.clone()).map_err(|e| anyhow::anyhow!("option 'recipe': {e}"))?;
            recipe.set(&mut under);
        }
        let mut nested = serde_json::to_value(&under)?;
        let mut flat = serde_json::Map::new();
        let mut given = given.clone();
        for name in strip_removed(&mut given) {
            tracing::warn!(option = name, "a removed absorb option is ignored (docs/options.md, 'Removed options')");
        }
        for (key, value) in &given {
            if key == "recipe" {
                continue;
            }
            if flat_names.contains(key) {
                flat.insert(key.clone(), value.clone());
            } else if nested.get(key).is_some() {
                let mut value = value.clone();
                for (object, old, new) in NESTED_ALIASES {
                    if let Some(o) = value.as_object_mut().filter(|_| key == object) {
                        if let Some(x) = o.remove(*old) {
                            o.insert(new.to_string(), x);
                        }
                    }
                }
                merge_json(&mut nested[key], &value);
            } else {
                let mut known: Vec<&str> = nested.as_object().map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
                known.extend(flat_names.iter().map(String::as_str));
                known.sort_unstable();
                known.dedup();
                anyhow::bail!("unknown option '{key}' (options: {})", known.join(", "));
            }
        }
        // The nested option structs accept unknown keys (records of older options must still
        // read): any key set here that no option reads is refused by name.
        let mut ignored = Vec::new();
        let base: AbsorbOptions = serde_ignored::deserialize(nested, |path| ignored.push(path.to_string()))?;
        if let Some(path) = ignored.first() {
            // The names beside it: those of the same object in these options.
            let defaults = serde_json::to_value(self)?;
            let parent = path.rsplit_once('.').map(|(p, _)| p);
            let siblings = parent.and_then(|p| p.split('.').try_fold(&defaults, |v, k| v.get(k))).and_then(|v| v.as_object());
            let known: Vec<&str> = siblings.map(|o| o.keys().map(String::as_str).collect()).unwrap_or_default();
            anyhow::bail!("unknown option '{path}' (options in '{}': {})", parent.unwrap_or(""), known.join(", "));
        }
        let overlay: OptionOverlay = serde_path_to_error::deserialize(serde_json::Value::Object(flat))
            .map_err(|e| anyhow::anyhow!("option '{}': {}", e.path(), e.inner()))?;
        Ok(overlay.apply(&base))
    }

    /// Options read from a JSON file over the defaults (see [`AbsorbOptions::with_json`]).
    pub fn from_file(path: &std::path::Path) -> Result<AbsorbOptions> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: cannot read: {e}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Self::default().with_json(&v).map_err(|e| anyhow::anyhow!("{}: invalid absorb options: {e}", path.display()))
    }
}

/// Options measured and removed (docs/recipe-search.md): still read from options files and
/// records, with a warning, and ignored; a request naming one is refused (`removed_option`), and so
/// is a command line ([`RemovedFlags`]), each with [`removed_why`]. (the object they sat in, or ""
/// for a flat name; key; what it was.)
pub const REMOVED: &[(&str, &str, &str)] = &[
    ("", "distill", "context distillation"),
    ("", "qa_select", "training a selected share of the questions"),
    ("train", "distill", "context distillation"),
    ("plan", "qa_select", "training a selected share of the questions"),
];

/// Why a removed option (a flat name of [`REMOVED`]) is gone and what to use instead, as a
/// request's refusal and the command line's say it after the option's name.
pub fn removed_why(name: &str) -> Option<String> {
    let (_, _, what) = REMOVED.iter().find(|(object, key, _)| object.is_empty() && *key == name)?;
    Some(format!(
        "was measured and removed ({what}: docs/recipe-search.md): the `recipe` option (`--recipe`) chooses \
         between the schedules kept, `paper` (the default) and `lean`"
    ))
}

/// The removed options' flags (`--distill`, `--qa-select`: the flat names of [`REMOVED`]), hidden,
/// flattened beside the flat options' flags so that a command line naming one is refused with
/// [`removed_why`], not as an unknown argument. The refusal is the flag's value parser: it comes
/// as the flag is read, before clap asks for the arguments the command requires.
#[derive(Clone, Debug, Default)]
pub struct RemovedFlags;

impl clap::Args for RemovedFlags {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        REMOVED.iter().filter(|(object, ..)| object.is_empty()).fold(cmd, |cmd, (_, key, _)| {
            // clap keeps a flag's name for the program's life: a few bytes per command built.
            let flag: &'static str = Box::leak(key.replace('_', "-").into_boxed_str());
            let why = format!("--{flag} {}", removed_why(key).unwrap_or_default());
            let arg = clap::Arg::new(*key).long(flag).hide(true).num_args(0..=1).default_missing_value("");
            cmd.arg(arg.value_parser(Refuse(why)))
        })
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for RemovedFlags {
    fn from_arg_matches(_: &clap::ArgMatches) -> Result<Self, clap::Error> {
        Ok(Self)
    }

    fn update_from_arg_matches(&mut self, _: &clap::ArgMatches) -> Result<(), clap::Error> {
        Ok(())
    }
}

/// A value parser that refuses any value with its message.
#[derive(Clone)]
struct Refuse(String);

impl clap::builder::TypedValueParser for Refuse {
    type Value = String;

    fn parse_ref(&self, cmd: &clap::Command, _: Option<&clap::Arg>, _: &OsStr) -> Result<String, clap::Error> {
        Err(refusal(cmd, &self.0))
    }
}

/// The command line's refusal of a removed option: its message alone, no usage.
fn refusal(cmd: &clap::Command, message: &str) -> clap::Error {
    clap::Error::raw(clap::error::ErrorKind::UnknownArgument, format!("{message}\n")).with_cmd(cmd)
}

/// Question layouts measured and removed (docs/recipe-search.md): an options file or a record
/// that names one reads it as `passages`, with a warning; `--qa-layout` refuses it. (name; what it
/// was.)
pub const REMOVED_QA_LAYOUTS: &[(&str, &str)] =
    &[("recall", "the questions' passages without their evidence"), ("mixed", "`recall` and `passages` in turn")];

/// `--qa-layout`: the layouts kept, read as clap reads any enum; a removed one refused with what
/// it was and the layouts kept.
#[derive(Clone)]
struct QaLayoutFlag;

impl clap::builder::TypedValueParser for QaLayoutFlag {
    type Value = QaLayout;

    fn parse_ref(&self, cmd: &clap::Command, arg: Option<&clap::Arg>, value: &OsStr) -> Result<QaLayout, clap::Error> {
        if let Some((name, what)) = REMOVED_QA_LAYOUTS.iter().find(|(name, _)| value.to_str() == Some(*name)) {
            let why = format!(
                "--qa-layout {name} was measured and removed ({what}: docs/recipe-search.md): the layouts kept are \
                 `head_tail` (the default) and `passages` (what options files naming it read it as)"
            );
            return Err(refusal(cmd, &why));
        }
        clap::builder::EnumValueParser::<QaLayout>::new().parse_ref(cmd, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        let kept = <QaLayout as clap::ValueEnum>::value_variants();
        Some(Box::new(kept.iter().filter_map(clap::ValueEnum::to_possible_value)))
    }
}

/// The settings with no flat name, set only by their nested keys in an options file: the
/// optimizer's and the LoRA's constants, the extractive generator's, and what `until_learned`
/// holds (docs/options.md); `train.lr` is saved but never read (the learning rate is `lr`). Every
/// other setting has a flat name (a test holds both lists true).
pub const NESTED_ONLY: &[&str] = &["lora", "train.lr", "train.weight_decay", "train.beta1", "train.beta2", "train.eps",
    "train.max_grad_norm", "train.early_stop", "train.until_learned", "qa.sentences_per_pair", "qa.min_pairs",
    "qa.window_sentences", "qa.retries", "qa.max_new_tokens", "qa.wordings_per_fact"];

/// Takes the removed options out of `given` (flat names and nested keys); their names.
pub fn strip_removed(given: &mut serde_json::Map<String, serde_json::Value>) -> Vec<String> {
    let mut gone = Vec::new();
    for (object, key, _) in REMOVED {
        let slot = if object.is_empty() { Some(&mut *given) } else { given.get_mut(*object).and_then(|v| v.as_object_mut()) };
        if slot.and_then(|o| o.remove(*key)).is_some() {
            gone.push(if object.is_empty() { key.to_string() } else { format!("{object}.{key}") });
        }
    }
    // The removed question layouts read as the one they were built on.
    for object in ["", "plan"] {
        let slot = if object.is_empty() { Some(&mut *given) } else { given.get_mut(object).and_then(|v| v.as_object_mut()) };
        let removed = |v: &&mut serde_json::Value| REMOVED_QA_LAYOUTS.iter().any(|(name, _)| v.as_str() == Some(*name));
        if let Some(layout) = slot.and_then(|o| o.get_mut("qa_layout")).filter(removed) {
            gone.push(format!("qa_layout {layout} (read as passages)"));
            *layout = serde_json::json!("passages");
        }
    }
    gone
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
        assert_eq!((one.plan.window, one.plan.training_context_tokens), (96, d.plan.training_context_tokens));
        let e = d.with_json(&serde_json::json!({"windw": 64})).unwrap_err().to_string();
        assert!(e.contains("'windw'") && e.contains("window") && e.contains("plan") && !e.contains("windw,"), "{e}");
        let e = d.with_json(&serde_json::json!({"plan": {"windw": 64}})).unwrap_err().to_string();
        assert!(e.contains("windw") && e.contains("window"), "{e}");
    }
    #[test]
    fn removed_options_still_read_and_are_ignored() {
        let d = AbsorbOptions::default();
        let old = serde_json::json!({"distill": 0.25, "qa_select": 0.4, "epochs": [1, 2],
            "train": {"distill": {"weight": 0.5, "top_k": 16}}, "plan": {"qa_select": 0.5, "qa_layout": "mixed"}});
        let mut given = old.as_object().unwrap().clone();
        let gone = strip_removed(&mut given);
        assert_eq!(gone, ["distill", "qa_select", "train.distill", "plan.qa_select", "qa_layout \"mixed\" (read as passages)"]);
        let o = d.with_json(&old).unwrap();
        assert_eq!((o.train.epochs, o.plan.qa_layout), ([1, 2], QaLayout::Passages));
        // A record saved with them reads too (the nested structs keep no such field).
        let record: AbsorbOptions = serde_json::from_value(serde_json::json!({"train": {"distill": {"weight": 0.5}},
            "plan": {"qa_select": 0.5, "qa_layout": "recall"}})).unwrap();
        assert_eq!(record.plan.qa_layout, QaLayout::Passages);
        // A default document's saved options, part of its id, name none of them.
        let plain = serde_json::to_value(&d).unwrap();
        for (part, key) in [("train", "distill"), ("train", "batch_rows"), ("plan", "qa_layout"), ("plan", "qa_select")] {
            assert!(plain[part].get(key).is_none(), "{part}.{key} in {plain}");
        }
    }

    #[test]
    fn the_command_line_refuses_a_removed_option_with_why_and_what_instead() {
        #[derive(clap::Parser, Debug)]
        #[allow(dead_code)]
        struct Cli {
            file: String,
            #[command(flatten)]
            overlay: OptionOverlay,
            #[command(flatten)]
            removed: RemovedFlags,
        }
        use clap::Parser;
        // With or without a value, before or after the arguments the command requires.
        let cases = [
            &["absorb", "--distill"][..],
            &["absorb", "doc.txt", "--distill", "0.5"],
            &["absorb", "--qa-select=0.3", "doc.txt"],
        ];
        for args in cases {
            let e = Cli::try_parse_from(args).unwrap_err();
            let flag = if args.iter().any(|a| a.starts_with("--distill")) { "--distill" } else { "--qa-select" };
            let text = e.to_string();
            let says = text.contains(&format!("{flag} was measured and removed")) && text.contains("`--recipe`");
            assert!(says, "{args:?}: {text}");
            assert_eq!(e.exit_code(), 2, "{args:?}");
        }
        let ok = Cli::try_parse_from(["absorb", "doc.txt", "--recipe", "lean", "--qa-layout", "passages"]).unwrap();
        assert_eq!((ok.overlay.recipe, ok.overlay.qa_layout), (Some(Recipe::Lean), Some(QaLayout::Passages)));
        // A removed question layout too, with the layouts kept; a layout that never was, as clap says it.
        for (name, what) in REMOVED_QA_LAYOUTS {
            let e = Cli::try_parse_from(["absorb", "doc.txt", "--qa-layout", name]).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(&format!("--qa-layout {name} was measured and removed ({what}")), "{text}");
            assert!(text.contains("`head_tail` (the default) and `passages`") && e.exit_code() == 2, "{text}");
        }
        let e = Cli::try_parse_from(["absorb", "doc.txt", "--qa-layout", "wide"]).unwrap_err().to_string();
        assert!(e.contains("invalid value 'wide'") && e.contains("head_tail, passages"), "{e}");
        // Every flat name removed has its flag.
        for (_, key, _) in REMOVED.iter().filter(|(object, ..)| object.is_empty()) {
            let flag = format!("--{}", key.replace('_', "-"));
            let e = Cli::try_parse_from(["absorb", "doc.txt", flag.as_str()]).unwrap_err().to_string();
            assert!(e.contains(&format!("{flag} {}", removed_why(key).unwrap())), "{e}");
        }
    }

    /// The JSON leaves of `v` (`plan.window`), objects walked, anything else a leaf.
    fn leaves(v: &serde_json::Value, at: &str, out: &mut std::collections::BTreeMap<String, serde_json::Value>) {
        match v.as_object() {
            Some(o) if !o.is_empty() => {
                for (k, x) in o {
                    leaves(x, &if at.is_empty() { k.clone() } else { format!("{at}.{k}") }, out);
                }
            }
            _ => {
                out.insert(at.to_string(), v.clone());
            }
        }
    }

    #[test]
    fn every_setting_has_a_flat_name_or_is_nested_only_and_docs_options_names_them_all() {
        let d = AbsorbOptions::default();
        // A value of each flat name other than its default.
        let example = serde_json::json!({"recipe": "lean", "adapter": "lora", "layers": [1, 2], "window": 64, "stride": 16,
            "training_context_tokens": 48, "qa_context_tokens": 0, "epochs": [0, 2], "lr": 0.01, "accumulation": 2,
            "batch_rows": 0.25, "warmup_steps": 4, "qa_pack": 3, "segment_pack": 2, "qa_layout": "passages", "aux_qa": 6,
            "pairs_per_1k_tokens": 32, "cap_floor": 100, "model_qa": true, "until_learned": true, "seed": 9,
            "budget_seconds": 60.0, "keep_answerable": "pairs"});
        let example = example.as_object().unwrap();
        let mut before = Default::default();
        leaves(&serde_json::to_value(&d).unwrap(), "", &mut before);
        let mut every = before.clone();
        let mut covered = std::collections::BTreeSet::new();
        for (name, _) in OptionOverlay::NAMES {
            let value = example.get(*name).unwrap_or_else(|| panic!("flat name '{name}' without an example here"));
            let o = d.with_json(&serde_json::json!({ *name: value })).unwrap();
            let mut after = Default::default();
            leaves(&serde_json::to_value(&o).unwrap(), "", &mut after);
            let changed: Vec<String> = after.iter().filter(|(k, v)| before.get(*k) != Some(v)).map(|(k, _)| k.clone()).collect();
            assert!(!changed.is_empty() || *name == "recipe", "'{name}' changes no saved setting");
            covered.extend(changed);
            every.extend(after);
        }
        let missing: Vec<&String> =
            every.keys().filter(|k| !covered.contains(*k) && !NESTED_ONLY.iter().any(|n| *k == n || k.starts_with(&format!("{n}.")))).collect();
        assert!(missing.is_empty(), "settings with no flat name (give them one, or list them in NESTED_ONLY): {missing:?}");
        // docs/options.md has a row for every flat name and names every nested-only setting.
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/options.md")).unwrap();
        for (name, exposure) in OptionOverlay::NAMES {
            let row = doc.lines().find(|l| l.starts_with(&format!("| `{name}`")));
            let row = row.unwrap_or_else(|| panic!("docs/options.md has no row for '{name}'"));
            let says_http = row.split('|').nth(2).is_some_and(|c| c.contains("yes"));
            assert_eq!(says_http, *exposure == Exposure::Http, "docs/options.md: whether a request may set '{name}'");
        }
        // The table after it says, for every flat name, when to set it, the measured figure ("not
        // measured" where there is none) and, for a figure, the section that holds it.
        let advice: Vec<&str> =
            doc.lines().skip_while(|l| !l.starts_with("| name | when to set it")).skip(2).take_while(|l| l.starts_with('|')).collect();
        for (name, _) in OptionOverlay::NAMES {
            let row = advice.iter().find(|l| l.starts_with(&format!("| `{name}` |")));
            let row = row.unwrap_or_else(|| panic!("docs/options.md: '{name}' has no row saying when to set it"));
            let cells: Vec<String> = row.replace("\\|", "/").split('|').map(|c| c.trim().to_string()).collect();
            let [_, _, when, figure, source, _] = cells.as_slice() else { panic!("docs/options.md: '{name}': not 4 cells: {row}") };
            assert!(!when.is_empty() && !figure.is_empty(), "docs/options.md: '{name}' says no case to set it in, or no figure");
            assert!(figure == "not measured" || source.contains("]("), "docs/options.md: '{name}': a figure without its source");
        }
        for n in NESTED_ONLY {
            assert!(doc.contains(&format!("`{n}`")), "docs/options.md does not name the nested-only setting '{n}'");
        }
    }

    #[test]
    fn one_name_per_setting_and_the_older_names_still_read() {
        let d = AbsorbOptions::default();
        // Saved under today's names...
        let saved = serde_json::to_value(&d).unwrap();
        assert!(saved["plan"].get("training_context_tokens").is_some() && saved["plan"].get("context_tokens").is_none());
        assert!(saved["qa"].get("aux_qa").is_some() && saved["qa"].get("max_pairs").is_none());
        // ...and records and files written under the older ones read the same.
        let old = serde_json::json!({"plan": {"context_tokens": 40}, "qa": {"max_pairs": 5}});
        let record: AbsorbOptions = serde_json::from_value(old.clone()).unwrap();
        let file = d.with_json(&old).unwrap();
        for o in [&record, &file] {
            assert_eq!((o.plan.training_context_tokens, o.qa.max_pairs), (40, 5));
        }
        // Every flat name is read by the overlay, with the effect its flag or field has.
        let all = serde_json::json!({"adapter": "lora", "layers": [1, 2], "window": 64, "stride": 16,
            "training_context_tokens": 48, "epochs": [0, 2], "lr": 0.01, "accumulation": 2, "qa_pack": 3,
            "segment_pack": 2, "aux_qa": 6, "model_qa": true, "until_learned": true, "seed": 9, "budget_seconds": 60.0,
            "recipe": "lean", "qa_layout": "head_tail", "qa_context_tokens": 0, "batch_rows": 0.25, "warmup_steps": 4,
            "pairs_per_1k_tokens": 32, "cap_floor": 100, "keep_answerable": "facts"});
        let names: Vec<&String> = all.as_object().unwrap().keys().collect();
        assert_eq!(names.len(), OptionOverlay::names().len(), "a flat name without a case here");
        let o = d.with_json(&all).unwrap();
        assert_eq!((o.plan.qa_context_tokens, o.train.batch_rows, o.train.warmup_steps), (Some(0), Some(0.25), 4));
        // A named count of pairs per 1,000 tokens wins over the fixed cap's zero, and the floor
        // named over the recipe's.
        assert_eq!((o.qa.pairs_per_1k_tokens, o.qa.cap_floor, o.qa.keep_answerable), (32, 100, KeepAnswerable::Facts));
        let o = d.with_json(&serde_json::json!({"layers": "15-17,3"})).unwrap();
        assert_eq!(o.layers, Some(vec![3, 15, 16, 17]));
        assert_eq!(d.with_json(&serde_json::json!({"layers": "all"})).unwrap().layers, None);
        let o = d.with_json(&all).unwrap();
        assert_eq!((o.adapter, o.layers.clone(), o.plan.window, o.plan.stride), (AdapterKind::Lora, Some(vec![1, 2]), 64, Some(16)));
        assert_eq!((o.plan.training_context_tokens, o.train.epochs, o.lr, o.train.accumulation), (48, [0, 2], Some(0.01), 2));
        assert_eq!((o.plan.qa_pack, o.plan.segment_pack, o.qa.max_pairs), (3, 2, 6));
        assert!(o.qa.use_model && o.train.until_learned.is_some() && o.qa.min_pairs <= 6);
        assert_eq!((o.train.seed, o.qa.seed, o.budget_seconds), (9, 9, Some(60.0)));
        // The recipe first, the settings named over it.
        assert_eq!(o.plan.qa_layout, QaLayout::HeadTail);
        // A flat name of the wrong type says which.
        let e = d.with_json(&serde_json::json!({"window": "wide"})).unwrap_err().to_string();
        assert!(e.contains("window"), "{e}");
    }

    #[test]
    fn a_recipe_lies_under_the_nested_keys_given_with_it() {
        let d = AbsorbOptions::default();
        let lean = d.with_json(&serde_json::json!({"recipe": "lean"})).unwrap();
        assert_eq!((lean.train.epochs, lean.qa.cap_floor, lean.plan.qa_layout), ([1, 2], 0, QaLayout::Passages));
        // An options file naming keys the recipe also sets keeps its own values, in either
        // spelling, whatever the order of its keys; the recipe's other settings stay.
        for file in [
            serde_json::json!({"recipe": "lean", "train": {"epochs": [2, 4]}, "qa": {"cap_floor": 7}}),
            serde_json::json!({"train": {"epochs": [2, 4]}, "qa": {"cap_floor": 7}, "recipe": "lean"}),
        ] {
            let o = d.with_json(&file).unwrap();
            assert_eq!((o.train.epochs, o.qa.cap_floor), ([2, 4], 7), "{file}");
            assert_eq!(o.plan.qa_layout, QaLayout::Passages, "{file}: the recipe's setting the file leaves alone");
        }
        let e = d.with_json(&serde_json::json!({"recipe": "fast"})).unwrap_err().to_string();
        assert!(e.contains("recipe") && e.contains("lean"), "{e}");
    }
}
