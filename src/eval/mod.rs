//! `lift-serve eval`: long-document QA, offline, methods side by side on the same documents.
//!
//! Documents come from real prose with planted facts ([`needles`], the essays of [`data`]) or
//! from a user's JSONL file ([`load_jsonl`]). Every question is labelled in-window or
//! out-of-window for the truncated context the answering code actually builds
//! ([`crate::lift::answer::build_prompt`]), answered by each method (named presets of absorb
//! options and an answer mode: [`method`]) either in-process or through a running server's HTTP
//! API ([`client`]), and scored by SQuAD-normalised exact match, token F1 and containment
//! ([`metrics`]). [`report`] writes the JSON results, a markdown table and PNG plots.

pub mod client;
pub mod gating;
mod jsonl;
pub mod mask;
pub mod needles;
pub mod qa_report;
pub mod report;

pub use jsonl::load_jsonl;

use crate::document::Document;
use crate::lift::answer::{answer, build_prompt, AnswerPrompt, Ask, ContextPolicy, Mode};
use crate::lift::{self, AbsorbEvent, AbsorbOptions};
use crate::model::filter::ChunkScore;
use crate::model::generate::SamplingParams;
use crate::model::Model;
use anyhow::{bail, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use crate::corpus::scoring::{self as metrics, Scores};
use crate::corpus as data;
use needles::FactKind;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// A question about a document, with the answers accepted for it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EvalQuestion {
    pub id: String,
    pub question: String,
    pub answers: Vec<String>,
    /// Planted needles: the kind of fact, the requested depth and the planted sentence(s).
    pub kind: Option<FactKind>,
    pub depth: Option<f64>,
    /// Where the planted sentence starts, as a fraction of the document's tokens.
    pub actual_depth: Option<f64>,
    pub planted: Option<String>,
    pub distractor: Option<String>,
    /// Every evidence span is needed to answer (a two-hop question), not any one of them.
    #[serde(default)]
    pub needs_all_evidence: bool,
    /// A user set's question form (who, what, when, how_many, condition, ...), for the report's
    /// table by form.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub form: Option<String>,
    /// Byte spans of the text that answers the question (the planted sentence; for user data,
    /// every occurrence of an answer or of the given evidence) and their token spans.
    pub evidence: Vec<(usize, usize)>,
    pub evidence_tokens: Vec<(usize, usize)>,
    pub distractor_tokens: Option<(usize, usize)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EvalDocument {
    pub id: String,
    /// Where the text came from (essay names, or the JSONL file and line).
    pub source: String,
    pub target_tokens: Option<usize>,
    pub tokens: usize,
    pub text: String,
    pub questions: Vec<EvalQuestion>,
}

/// Whether the question's evidence is in the prompt: `Some(true)` when some evidence span lies
/// wholly in the document text the prompt shows (every span, for a two-hop question), `None`
/// without evidence.
pub fn in_window(prompt: &AnswerPrompt, q: &EvalQuestion) -> Option<bool> {
    let mut shown = q.evidence_tokens.iter().map(|&span| prompt.shows(span));
    match (q.evidence_tokens.is_empty(), q.needs_all_evidence) {
        (true, _) => None,
        (false, true) => Some(shown.all(|s| s)),
        (false, false) => Some(shown.any(|s| s)),
    }
}

/// A method: an answer mode, and the absorb options of its adapter (`None`: no adapter).
#[derive(Clone, Debug, Serialize)]
pub struct Method {
    pub name: String,
    pub mode: Mode,
    /// The context policy it answers with (`None`: the mode's default).
    pub context: Option<ContextPolicy>,
    /// Its in-context budget in tokens (`None`: the run's `--context-tokens`).
    pub context_tokens: Option<usize>,
    pub absorb: Option<AbsorbOptions>,
}

/// The known methods and what they are. A new variant is one entry here and one arm in
/// [`method`]: the absorb options it changes and the mode it asks in. (FltLM and CDT are not
/// methods: they are the prepared base's, under every method; compare bases with
/// `--prepared-base`.)
pub const METHODS: &[(&str, &str)] = &[
    ("rag", "base model, the passages retrieved for the question in context, no adapter"),
    ("icl", "base model, truncated document in context (head + tail): the paper's baseline"),
    ("lift", "adapter absorbed from the document + the retrieved passages in context"),
    ("memory", "adapter only, no document text in context"),
    ("lift-paper", "lift absorbed with the paper's recipe (AbsorbOptions::paper_faithful)"),
    ("lift-fixed", "lift absorbed on the fixed schedule (the epochs run to their end)"),
    ("lift-until-learned", "lift absorbed until learned (train.until_learned; its defaults unless the options set it)"),
];

/// The method preset `name` on top of the base absorb options (for a model of `num_layers`).
/// `name:policy` answers with that context policy (`lift:head_tail`, `icl:full`, …) and
/// `name:N` with an in-context budget of N tokens (`rag:256`, `lift:head_tail:256`), so one
/// absorb answers at several budgets.
pub fn method(name: &str, base: &AbsorbOptions, num_layers: usize) -> Result<Method> {
    let mut parts = name.split(':');
    let preset = parts.next().unwrap_or_default();
    let (mut context, mut context_tokens) = (None, None);
    for p in parts {
        if let Ok(n) = p.parse::<usize>() {
            anyhow::ensure!(n > 0 && context_tokens.is_none(), "method '{name}': one budget of at least 1 token");
            context_tokens = Some(n);
        } else {
            let policy = ContextPolicy::parse(p).with_context(|| {
                format!("unknown context policy '{p}' in method '{name}' (bm25, retrieved, head_tail, full, or a budget in tokens)")
            })?;
            anyhow::ensure!(context.is_none(), "method '{name}': one context policy");
            context = Some(policy);
        }
    }
    let (mode, absorb) = match preset {
        "rag" => (Mode::Rag, None),
        "icl" => (Mode::Icl, None),
        "lift" => (Mode::Lift, Some(base.clone())),
        "memory" => (Mode::Memory, Some(base.clone())),
        "lift-paper" => {
            // The paper trains with the same truncated document it answers with: the context
            // budget stays the run's.
            let mut o = AbsorbOptions::paper_faithful(num_layers);
            o.plan.training_context_tokens = base.plan.training_context_tokens;
            (Mode::Lift, Some(o))
        }
        "lift-fixed" => {
            let mut o = base.clone();
            o.train.until_learned = None;
            (Mode::Lift, Some(o))
        }
        "lift-until-learned" => {
            let mut o = base.clone();
            o.train.until_learned.get_or_insert_with(Default::default);
            (Mode::Lift, Some(o))
        }
        _ => {
            let known: Vec<_> = METHODS.iter().map(|m| m.0).collect();
            bail!("unknown method '{name}' (known: {})", known.join(", "))
        }
    };
    anyhow::ensure!(
        mode.uses_context() || (context.is_none() && context_tokens.is_none()),
        "method '{name}': `memory` shows no context to choose"
    );
    anyhow::ensure!(
        context != Some(ContextPolicy::Full) || context_tokens.is_none(),
        "method '{name}': `full` shows what fits the window, not a budget"
    );
    Ok(Method { name: name.to_string(), mode, context, context_tokens, absorb })
}

/// What absorbing one document with one set of options cost and produced.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AbsorbRecord {
    pub document: String,
    /// Methods answered with this adapter.
    pub methods: Vec<String>,
    /// Wall time of the whole absorption (QA generation, training, saving; in server mode from
    /// POST to ready, queueing included).
    pub seconds: f64,
    pub train_seconds: Option<f64>,
    /// Training tokens (forward + backward) per second.
    pub tokens_per_s: Option<f64>,
    pub steps: usize,
    pub qa_pairs: Option<usize>,
    pub parameters: usize,
    pub adapter_bytes: usize,
    pub step_losses: Vec<f64>,
    pub epoch_losses: Vec<f64>,
    pub final_loss: Option<f64>,
    /// Absorbing until learned: `(step, loss of the held-aside probe questions)`, and the steps
    /// the fixed schedule would have run.
    #[serde(default)]
    pub probe_curve: Vec<(usize, f64)>,
    #[serde(default)]
    pub planned_steps: Option<usize>,
    /// What the absorb's estimate said before it ran (in-process runs: at this run's measured
    /// rate, the prior before its first absorb), and the training tokens it counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_tokens: Option<u64>,
    /// Training stopped at the absorb's time budget.
    #[serde(default)]
    pub out_of_time: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AnswerRecord {
    pub document: String,
    pub question: String,
    pub method: String,
    pub prediction: String,
    pub scores: Scores,
    pub in_window: Option<bool>,
    pub depth: Option<f64>,
    pub kind: Option<FactKind>,
    pub target_tokens: Option<usize>,
    pub document_tokens: usize,
    pub prompt_tokens: usize,
    pub seconds: f64,
    /// Whether the question's evidence is in this answer's prompt (the passages it was shown,
    /// whatever chose them; None without evidence spans or in `memory` mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence_in_context: Option<bool>,
    /// The question's form, for a user set that gives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub form: Option<String>,
    /// What the prepared base's FltLM mask did to the context (None without a base filter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask: Option<mask::MaskRecord>,
    /// Each generated token's log-probability (empty from a backend that gives none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<f32>,
}

/// Run settings shared by both backends.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunConfig {
    pub methods: Vec<String>,
    /// In-context document budget when answering (`None`: what fits the model's window).
    pub context_tokens: Option<usize>,
    pub max_tokens: usize,
    pub absorb: AbsorbOptions,
    pub needles: Option<needles::NeedleSpec>,
    pub jsonl: Option<PathBuf>,
    pub server: Option<String>,
    /// The prepared base filter's mask calibration the run used (None: no base filter).
    #[serde(default)]
    pub filter_mask: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Results {
    pub model: String,
    pub config: RunConfig,
    pub documents: Vec<EvalDocument>,
    pub absorbs: Vec<AbsorbRecord>,
    pub answers: Vec<AnswerRecord>,
    pub seconds: f64,
}

impl Results {
    /// One report from labelled runs of the same documents: their methods, absorbs and answers
    /// side by side (the first run's config and documents; every run must hold the same
    /// documents). A method already in an earlier run is renamed `method@label`.
    pub fn merge(runs: Vec<(String, Results)>) -> Result<Results> {
        let mut it = runs.into_iter();
        let (_, mut out) = it.next().context("nothing to merge")?;
        for (label, mut r) in it {
            let ids = |r: &Results| r.documents.iter().map(|d| (d.id.clone(), d.text.len())).collect::<Vec<_>>();
            anyhow::ensure!(ids(&r) == ids(&out), "the runs to merge hold different documents");
            for m in r.config.methods.clone() {
                if !out.config.methods.contains(&m) {
                    out.config.methods.push(m);
                    continue;
                }
                let renamed = format!("{m}@{label}");
                anyhow::ensure!(!out.config.methods.contains(&renamed), "method {renamed} is in two of the runs");
                r.absorbs.iter_mut().flat_map(|a| a.methods.iter_mut()).filter(|x| **x == m).for_each(|x| x.clone_from(&renamed));
                r.answers.iter_mut().filter(|a| a.method == m).for_each(|a| a.method.clone_from(&renamed));
                out.config.methods.push(renamed);
            }
            out.absorbs.extend(r.absorbs);
            out.answers.extend(r.answers);
            out.seconds += r.seconds;
        }
        Ok(out)
    }

    /// One report from labelled runs over different documents (e.g. more documents added by a
    /// later run with another `--seed`): their documents, absorbs and answers pooled, so paired
    /// comparisons run over every question. Only the methods every run answered are kept (the
    /// others are dropped with a warning). A document id already in an earlier run is renamed
    /// `label/id`; a document that is in two runs (same text) is an error, since its questions
    /// would count twice.
    pub fn pool(mut runs: Vec<(String, Results)>) -> Result<Results> {
        let Some((_, first)) = runs.first() else { bail!("nothing to pool") };
        let common: Vec<String> =
            first.config.methods.iter().filter(|m| runs.iter().all(|(_, r)| r.config.methods.contains(m))).cloned().collect();
        anyhow::ensure!(!common.is_empty(), "the runs to pool have no method in common");
        for (label, r) in &mut runs {
            let dropped: Vec<&String> = r.config.methods.iter().filter(|m| !common.contains(m)).collect();
            if !dropped.is_empty() {
                tracing::warn!(run = %label, ?dropped, "methods not in every run to pool: dropped");
            }
            r.config.methods.clone_from(&common);
            r.answers.retain(|a| common.contains(&a.method));
            r.absorbs.iter_mut().for_each(|a| a.methods.retain(|m| common.contains(m)));
            r.absorbs.retain(|a| !a.methods.is_empty());
        }
        let mut it = runs.into_iter();
        let (_, mut out) = it.next().context("nothing to pool")?;
        for (label, mut r) in it {
            anyhow::ensure!(r.model == out.model, "the runs to pool used different models ({} / {})", out.model, r.model);
            for d in &mut r.documents {
                anyhow::ensure!(!out.documents.iter().any(|o| o.text == d.text), "document {} is in two of the runs to pool", d.id);
                if out.documents.iter().any(|o| o.id == d.id) {
                    let renamed = format!("{label}/{}", d.id);
                    r.absorbs.iter_mut().filter(|a| a.document == d.id).for_each(|a| a.document.clone_from(&renamed));
                    r.answers.iter_mut().filter(|a| a.document == d.id).for_each(|a| a.document.clone_from(&renamed));
                    d.id = renamed;
                }
            }
            out.documents.extend(r.documents);
            out.absorbs.extend(r.absorbs);
            out.answers.extend(r.answers);
            out.seconds += r.seconds;
        }
        Ok(out)
    }
}

/// An answer as a backend gives it: the reply, the prompt's length in tokens, and each
/// in-context chunk's FltLM score and mask (empty without a base filter).
pub struct Asked {
    pub text: String,
    pub prompt_tokens: usize,
    pub chunks: Vec<ChunkScore>,
    pub logprobs: Vec<f32>,
}

/// Where absorbing and answering happen: in this process, or on a server ([`client::Server`]).
pub trait Backend {
    /// Absorbs `doc` with `opts`; returns the record and a handle for [`Backend::ask`].
    fn absorb(
        &mut self,
        doc: &EvalDocument,
        document: &Document,
        opts: &AbsorbOptions,
        on_step: &mut dyn FnMut(usize, usize, f64),
    ) -> Result<(AbsorbRecord, usize)>;
    /// Answers `ask` greedily (with adapter `handle`, if any).
    fn ask(&mut self, doc: &EvalDocument, document: &Document, handle: Option<usize>, ask: &Ask) -> Result<Asked>;
    /// Forgets the adapters of the current document.
    fn release(&mut self) {}
}

/// In-process backend: [`lift::absorb`] and [`answer`] on a loaded model.
pub struct Local<'a> {
    pub model: &'a Model,
    pub max_tokens: usize,
    adapters: Vec<lift::Absorbed>,
    /// This run's absorb rate, as a server keeps its own: a few steps timed before the first
    /// absorb ([`lift::calibrate`]) until an absorb has finished.
    rate: lift::estimate::AbsorbRate,
    calibrated: bool,
}

impl<'a> Local<'a> {
    pub fn new(model: &'a Model, max_tokens: usize) -> Self {
        Self { model, max_tokens, adapters: Vec::new(), rate: Default::default(), calibrated: false }
    }
}

impl Backend for Local<'_> {
    fn absorb(
        &mut self,
        doc: &EvalDocument,
        document: &Document,
        opts: &AbsorbOptions,
        on_step: &mut dyn FnMut(usize, usize, f64),
    ) -> Result<(AbsorbRecord, usize)> {
        if !std::mem::replace(&mut self.calibrated, true) {
            self.rate.set_calibrated(lift::calibrate::rate(self.model, opts));
        }
        let t0 = Instant::now();
        // The price a server would say, and the options it would train: fitted to their time
        // budget (as asked without one).
        let cost = lift::cost::estimate(self.model, document, opts, &self.rate);
        let opts = &cost.options;
        let absorbed = lift::absorb(
            self.model,
            document,
            Some(&doc.id),
            opts,
            &mut |e| {
                if let AbsorbEvent::Train(p) = e {
                    on_step(p.step, p.steps, p.loss);
                }
            },
            &|| false,
        )?;
        let r = &absorbed.report;
        let seconds = t0.elapsed().as_secs_f64();
        self.rate.record_absorb(self.model, document.len(), absorbed.qa.len(), opts, r.steps_this_run(), seconds);
        let rec = AbsorbRecord {
            document: doc.id.clone(),
            methods: Vec::new(),
            seconds,
            estimated_seconds: Some(cost.estimate.seconds),
            estimated_tokens: Some(cost.estimate.training_tokens),
            out_of_time: r.out_of_time,
            train_seconds: Some(r.seconds),
            tokens_per_s: Some(r.tokens_per_s),
            steps: r.steps,
            qa_pairs: Some(absorbed.qa.len()),
            parameters: absorbed.manifest.parameters,
            adapter_bytes: absorbed.manifest.bytes,
            step_losses: r.step_losses.clone(),
            epoch_losses: r.epoch_losses.clone(),
            final_loss: Some(r.final_loss),
            probe_curve: r.probe_curve.clone(),
            planned_steps: Some(r.planned_steps),
        };
        self.adapters.push(absorbed);
        Ok((rec, self.adapters.len() - 1))
    }

    fn ask(&mut self, _doc: &EvalDocument, document: &Document, handle: Option<usize>, ask: &Ask) -> Result<Asked> {
        let bundle = handle.map(|h| &self.adapters[h].bundle);
        let adapter = bundle.map(|b| &b.adapter as &dyn crate::model::Adapter);
        let params = SamplingParams { max_tokens: self.max_tokens, temperature: 0.0, ..Default::default() };
        let a = answer(self.model, document, adapter, ask, &params, &mut |_| true)?;
        Ok(Asked { text: a.generation.text, prompt_tokens: a.prompt.tokens.len(), chunks: a.chunks, logprobs: a.generation.logprobs })
    }

    fn release(&mut self) {
        self.adapters.clear();
    }
}

/// The question as `m` asks it in this run.
fn ask<'q>(question: &'q str, m: &Method, cfg: &RunConfig) -> Ask<'q> {
    Ask { history: &[], question, mode: m.mode, context: m.context, context_tokens: budget(m, cfg) }
}

/// The in-context budget `m` answers with: its own (`rag:256`), else the run's; none for
/// methods that show what fits the window (`:full`).
fn budget(m: &Method, cfg: &RunConfig) -> Option<usize> {
    if m.context == Some(ContextPolicy::Full) {
        None
    } else {
        m.context_tokens.or(cfg.context_tokens)
    }
}

/// Runs every method on every document. `model` tokenizes and labels (and, with [`Local`],
/// answers); labels come from the same [`build_prompt`] the answering code uses.
pub fn run(
    model: &Model,
    backend: &mut dyn Backend,
    docs: Vec<EvalDocument>,
    cfg: &RunConfig,
    show_progress: bool,
    on_document: &mut dyn FnMut(&Results) -> Result<()>,
) -> Result<Results> {
    let t0 = Instant::now();
    let methods: Vec<Method> =
        cfg.methods.iter().map(|m| method(m, &cfg.absorb, model.config().num_layers)).collect::<Result<_>>()?;
    let groups = absorb_groups(&methods)?;
    let n_questions: usize = docs.iter().map(|d| d.questions.len()).sum();
    let bars = Bars::new(show_progress, (n_questions * methods.len() + docs.len() * groups.len()) as u64);
    let mut runner = Runner { model, backend, cfg, methods, groups, bars };
    let results = |documents: Vec<EvalDocument>, absorbs: &[AbsorbRecord], answers: &[AnswerRecord]| Results {
        model: model.info.id.clone(),
        config: cfg.clone(),
        documents,
        absorbs: absorbs.to_vec(),
        answers: answers.to_vec(),
        seconds: t0.elapsed().as_secs_f64(),
    };
    let (mut absorbs, mut answers) = (Vec::new(), Vec::new());
    for (i, doc) in docs.iter().enumerate() {
        let document = Document::encode(model, doc.text.clone())?;
        anyhow::ensure!(document.len() == doc.tokens, "{}: token count changed", doc.id);
        let handles = runner.absorb(doc, &document, &mut absorbs)?;
        for q in &doc.questions {
            runner.answer(doc, &document, q, &handles, &mut answers)?;
        }
        runner.backend.release();
        // The results so far (documents done), e.g. for a report that survives an interruption.
        on_document(&results(docs[..=i].to_vec(), &absorbs, &answers))?;
    }
    runner.bars.finish();
    Ok(results(docs, &absorbs, &answers))
}

/// Methods with the same absorb options share one adapter per document: (options, method names).
fn absorb_groups(methods: &[Method]) -> Result<Vec<(AbsorbOptions, Vec<String>)>> {
    let mut groups: Vec<(AbsorbOptions, Vec<String>)> = Vec::new();
    for m in methods {
        if let Some(o) = &m.absorb {
            let key = serde_json::to_string(o)?;
            match groups.iter_mut().find(|(g, _)| serde_json::to_string(g).is_ok_and(|k| k == key)) {
                Some((_, names)) => names.push(m.name.clone()),
                None => groups.push((o.clone(), vec![m.name.clone()])),
            }
        }
    }
    Ok(groups)
}

/// The run's progress: questions and absorptions overall, and the steps of the absorption running.
struct Bars {
    overall: ProgressBar,
    step: ProgressBar,
    _multi: MultiProgress,
}

impl Bars {
    fn new(show: bool, total: u64) -> Self {
        let multi = MultiProgress::with_draw_target(if show { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() });
        let bar = |len: u64, template: &str, prefix: &'static str| {
            let b = multi.add(ProgressBar::new(len));
            b.set_style(ProgressStyle::with_template(template).expect("valid template").progress_chars("=> "));
            b.set_prefix(prefix);
            b
        };
        let overall = bar(total, "{prefix:>8} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta} {msg}", "eval");
        let step = bar(0, "{prefix:>8} [{bar:30}] {pos}/{len} {msg}", "absorb");
        Self { overall, step, _multi: multi }
    }

    fn finish(&self) {
        self.step.finish_and_clear();
        self.overall.finish_and_clear();
    }
}

struct Runner<'a> {
    model: &'a Model,
    backend: &'a mut dyn Backend,
    cfg: &'a RunConfig,
    methods: Vec<Method>,
    groups: Vec<(AbsorbOptions, Vec<String>)>,
    bars: Bars,
}

impl Runner<'_> {
    /// Absorbs `doc` once per group of methods; returns each method's adapter handle.
    fn absorb(&mut self, doc: &EvalDocument, document: &Document, absorbs: &mut Vec<AbsorbRecord>) -> Result<BTreeMap<String, usize>> {
        let mut handles = BTreeMap::new();
        for (opts, names) in &self.groups {
            let (overall, step) = (&self.bars.overall, &self.bars.step);
            overall.set_message(format!("absorbing {} ({} tokens) for {}", doc.id, doc.tokens, names.join(",")));
            let (mut rec, h) = self.backend.absorb(doc, document, opts, &mut |n, steps, loss| {
                step.set_length(steps as u64);
                step.set_position(n as u64);
                step.set_message(format!("loss {loss:.3}"));
            })?;
            rec.methods = names.clone();
            tracing::info!(document = %doc.id, seconds = rec.seconds, steps = rec.steps, bytes = rec.adapter_bytes, "absorbed");
            absorbs.push(rec);
            handles.extend(names.iter().map(|n| (n.clone(), h)));
            overall.inc(1);
        }
        Ok(handles)
    }

    /// Every method answers `q`; each answer is labelled in or out of window by the prompt the
    /// answering code builds, and its prompt length is checked against that prompt.
    fn answer(
        &mut self,
        doc: &EvalDocument,
        document: &Document,
        q: &EvalQuestion,
        handles: &BTreeMap<String, usize>,
        answers: &mut Vec<AnswerRecord>,
    ) -> Result<()> {
        let (model, cfg) = (self.model, self.cfg);
        // In or out of the window: of the head and tail the paper's truncation shows at the
        // method's budget (one label per budget the run answers with).
        let mut labels: BTreeMap<Option<usize>, Option<bool>> = BTreeMap::new();
        for m in &self.methods {
            self.bars.overall.set_message(format!("{} {} {}", doc.id, q.id, m.name));
            let window_budget = m.context_tokens.or(cfg.context_tokens);
            let label = match labels.get(&window_budget) {
                Some(l) => *l,
                None => {
                    let head_tail =
                        Ask { context: Some(ContextPolicy::HeadTail), context_tokens: window_budget, ..Ask::new(&q.question, Mode::Icl) };
                    let l = in_window(&build_prompt(model, document, &head_tail, cfg.max_tokens)?, q);
                    labels.insert(window_budget, l);
                    l
                }
            };
            let t = Instant::now();
            let asked = ask(&q.question, m, cfg);
            let Asked { text: prediction, prompt_tokens, chunks, logprobs } =
                self.backend.ask(doc, document, handles.get(&m.name).copied(), &asked)?;
            let expected = build_prompt(model, document, &asked, cfg.max_tokens)?;
            if prompt_tokens != expected.tokens.len() {
                bail!(
                    "{} {}: the {} prompt has {prompt_tokens} tokens, the labels assume {}: the answering side uses \
                     another context budget",
                    doc.id,
                    q.id,
                    m.name,
                    expected.tokens.len()
                );
            }
            answers.push(AnswerRecord {
                document: doc.id.clone(),
                question: q.id.clone(),
                method: m.name.clone(),
                scores: metrics::score(&prediction, &q.answers),
                prediction,
                in_window: label,
                depth: q.depth,
                kind: q.kind,
                target_tokens: doc.target_tokens,
                document_tokens: doc.tokens,
                prompt_tokens,
                seconds: t.elapsed().as_secs_f64(),
                evidence_in_context: if expected.shown.is_empty() { None } else { in_window(&expected, q) },
                form: q.form.clone(),
                mask: mask::measure(q, &chunks),
                logprobs,
            });
            self.bars.overall.inc(1);
        }
        Ok(())
    }
}

/// `lift-serve eval` options (absorb options come from the shared training flags).
#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// Output directory: results.json, results.md, heatmap.png, loss.png.
    #[arg(long, default_value = "eval-results")]
    pub out: PathBuf,
    /// Methods to compare: icl (baseline, no adapter), lift (adapter + truncated document),
    /// memory (adapter only), lift-paper (the paper's recipe).
    #[arg(long, value_delimiter = ',', default_value = "icl,lift,memory")]
    pub methods: Vec<String>,
    /// Document lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "1024,2048")]
    pub lengths: Vec<usize>,
    /// Relative depths of the planted facts (0 = start, 1 = end).
    #[arg(long, value_delimiter = ',', default_value = "0,0.5,1")]
    pub depths: Vec<f64>,
    #[arg(long, default_value_t = 2)]
    pub needles_per_depth: usize,
    #[arg(long, default_value_t = 1)]
    pub docs_per_length: usize,
    /// The user's evaluation set (JSONL) instead of planted facts.
    #[arg(long)]
    pub jsonl: Option<PathBuf>,
    /// Directory of essays (default: $LIFT_DATA_DIR/pg-essays, fetched when missing).
    #[arg(long)]
    pub essays: Option<PathBuf>,
    /// Which essays the documents are cut from: `eval` (reported figures) or `validation` (for
    /// tuning options; never the figures reported). The prepared base trained on neither. With
    /// `--jsonl`, the lines of that split (`train` too) when given; without it, every line.
    #[arg(long, value_enum)]
    pub split: Option<EssaySplit>,
    /// A plain-text file to cut the documents from in place of the essays (no split: a text the
    /// prepared base never trained on, e.g. for lengths past the 43K tokens the eval split holds).
    #[arg(long, conflicts_with_all = ["essays", "jsonl"])]
    pub haystack: Option<PathBuf>,
    /// In-context document budget when answering, as `ask --context-tokens` (default: the
    /// training head+tail budget, `--training-context-tokens`). `--ask-context-tokens` is its
    /// older name.
    #[arg(long, alias = "ask-context-tokens")]
    pub context_tokens: Option<usize>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Evaluate a running lift-serve server through its HTTP API instead of in-process.
    #[arg(long)]
    pub server: Option<String>,
    #[arg(long, env = "LIFT_API_KEY")]
    pub api_key: Option<String>,
    /// Only redraw the report (markdown, plots) from OUT/results.json.
    #[arg(long)]
    pub report_only: bool,
    /// Merge the results.json of runs of the same documents with different methods (run apart,
    /// e.g. side by side) into one report in OUT: one table, and each method paired by question
    /// against the first.
    #[arg(long, value_delimiter = ',')]
    pub merge: Vec<PathBuf>,
    /// Pool the results.json of runs over different documents (e.g. a later run with another
    /// `--seed`) into one report in OUT, paired over all their questions (the methods every run
    /// answered).
    #[arg(long, value_delimiter = ',', conflicts_with = "merge")]
    pub pool: Vec<PathBuf>,
    /// How the prepared base's FltLM filter turns scores into its soft mask for this run
    /// (absorbs and answers): `absolute`, `relative[:MARGIN]` or `off` (default: the base's own).
    /// In-process runs only.
    #[arg(long)]
    pub filter_mask: Option<String>,
    /// The calibration absorbs train their adapters under, when it is to differ from the one
    /// answers use (`--filter-mask`, or the base's own). In-process runs only.
    #[arg(long)]
    pub absorb_filter_mask: Option<String>,
    /// Only print the auxiliary QA an absorb would train on for each document (its figures, and
    /// this many pairs of each): no absorb, no answers.
    #[arg(long)]
    pub qa_report: Option<usize>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Sets the prepared base's mask calibration for the run (`--filter-mask`).
pub fn apply_filter_mask(model: &mut Model, args: &EvalArgs) -> Result<()> {
    use crate::model::filter::MaskCalibration;
    if args.filter_mask.is_none() && args.absorb_filter_mask.is_none() {
        return Ok(());
    }
    anyhow::ensure!(args.server.is_none(), "--filter-mask and --absorb-filter-mask set this process's model: not with --server");
    let filter = model.base_filter.as_mut().context("--filter-mask, --absorb-filter-mask: the model has no prepared base with a filter")?;
    if let Some(name) = &args.filter_mask {
        filter.calibration = MaskCalibration::parse(name)?;
    }
    if let Some(name) = &args.absorb_filter_mask {
        filter.absorb_mask = Some(MaskCalibration::parse(name)?);
    }
    Ok(())
}

/// The split `eval` takes its documents from (essays, or a JSONL set's `split` field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EssaySplit {
    Eval,
    Validation,
    /// JSONL sets only: the essays' train split is the prepared base's.
    Train,
}

impl EssaySplit {
    pub fn name(self) -> &'static str {
        match self {
            EssaySplit::Eval => "eval",
            EssaySplit::Validation => "validation",
            EssaySplit::Train => "train",
        }
    }
}

/// The `eval` command: build or load the documents, run, write the report.
pub fn run_cli(model: &Model, absorb: AbsorbOptions, seed: u64, args: &EvalArgs) -> Result<()> {
    if !args.merge.is_empty() || !args.pool.is_empty() {
        let runs = args
            .merge
            .iter()
            .chain(&args.pool)
            .map(|p| {
                let r: Results = serde_json::from_slice(&std::fs::read(p).with_context(|| format!("{}: cannot read", p.display()))?)?;
                // A run's label: the name of the directory its results.json is in.
                let dir = p.parent().and_then(|d| d.file_name()).map_or_else(|| p.display().to_string(), |d| d.to_string_lossy().into_owned());
                Ok((dir, r))
            })
            .collect::<Result<Vec<(String, Results)>>>()?;
        let combined = if args.pool.is_empty() { Results::merge(runs)? } else { Results::pool(runs)? };
        report::write(&combined, &args.out)?;
        print!("{}", report::markdown(&combined));
        return Ok(());
    }
    if args.report_only {
        let results: Results = serde_json::from_slice(&std::fs::read(args.out.join(report::RESULTS_FILE))?)?;
        return report::write(&results, &args.out);
    }
    let (docs, spec) = match &args.jsonl {
        Some(path) => (load_jsonl(model, path, args.split.map(EssaySplit::name))?, None),
        None => {
            let essays = haystack_essays(args)?;
            let spec = needles::NeedleSpec {
                lengths: args.lengths.clone(),
                depths: args.depths.clone(),
                needles_per_depth: args.needles_per_depth,
                docs_per_length: args.docs_per_length,
                seed,
            };
            (needles::build_set(model, &essays, &spec)?, Some(spec))
        }
    };
    if let Some(sample) = args.qa_report {
        print!("{}", qa_report::report(&docs, &absorb.qa, sample));
        return Ok(());
    }
    let cfg = RunConfig {
        methods: args.methods.clone(),
        context_tokens: Some(args.context_tokens.unwrap_or(absorb.plan.training_context_tokens)),
        max_tokens: args.max_tokens,
        absorb,
        needles: spec,
        jsonl: args.jsonl.clone(),
        server: args.server.clone(),
        filter_mask: model.base_filter().map(|f| f.mask_name()),
    };
    let results = match &args.server {
        Some(url) => {
            let mut backend = client::Server::new(url, args.api_key.clone(), cfg.max_tokens)?;
            run(model, &mut backend, docs, &cfg, !args.quiet, &mut |partial| report::write(partial, &args.out))?
        }
        None => {
            let mut backend = Local::new(model, cfg.max_tokens);
            run(model, &mut backend, docs, &cfg, !args.quiet, &mut |partial| report::write(partial, &args.out))?
        }
    };
    report::write(&results, &args.out)?;
    print!("{}", report::markdown(&results));
    Ok(())
}

/// The texts the needle documents are cut from: the `--haystack` file, else the essays of the
/// prepared base's Eval (or Validation) split, which the base never trained on.
fn haystack_essays(args: &EvalArgs) -> Result<Vec<crate::corpus::Essay>> {
    if let Some(path) = &args.haystack {
        let raw = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let name = path.file_stem().map_or("haystack".into(), |n| n.to_string_lossy().to_string());
        return Ok(vec![crate::corpus::Essay { name, text: haystack_text(&raw) }]);
    }
    let dir = match &args.essays {
        Some(d) => d.clone(),
        None => data::fetch_essays(&data::data_dir())?,
    };
    let split = match args.split.unwrap_or(EssaySplit::Eval) {
        EssaySplit::Eval => crate::corpus::Split::Eval,
        EssaySplit::Validation => crate::corpus::Split::Validation,
        EssaySplit::Train => bail!("--split train: the train essays are the prepared base's training text, not an evaluation"),
    };
    Ok(crate::corpus::essays_in(&data::load_essays(&dir)?, split))
}

/// A `--haystack` text as needles can be planted in: its paragraphs that hold no digit. A planted
/// number must be the only one in the document (`needles` redraws values the text contains), and
/// a reference text (a glossary, a manual) holds every number from 11 to 99 somewhere.
fn haystack_text(raw: &str) -> String {
    let mut kept = String::new();
    let mut paragraph = String::new();
    // Paragraphs end at a blank line (one of whitespace only).
    for line in raw.lines().chain(std::iter::once("")) {
        if !line.trim().is_empty() {
            paragraph.push_str(line);
            paragraph.push('\n');
            continue;
        }
        if !paragraph.is_empty() && !paragraph.bytes().any(|b| b.is_ascii_digit()) {
            kept.push_str(&paragraph);
            kept.push('\n');
        }
        paragraph.clear();
    }
    crate::corpus::normalize_essay(&kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_haystack_keeps_the_paragraphs_without_digits() {
        let raw = "The first paragraph\nwraps here.\n   \nVersion 4.4.7 of it.\n\nThe last one stays.";
        let text = haystack_text(raw);
        assert!(text.contains("The first paragraph wraps here."), "{text}");
        assert!(text.contains("The last one stays."), "{text}");
        assert!(!text.contains("Version"), "{text}");
    }

    #[test]
    fn method_presets_are_modes_and_absorb_options() {
        let base = AbsorbOptions::default();
        for (name, _) in METHODS {
            let m = method(name, &base, 30).unwrap();
            assert_eq!(m.absorb.is_none(), ["icl", "rag"].contains(name), "{name}");
        }
        let h = method("lift:head_tail", &base, 30).unwrap();
        assert_eq!((h.mode, h.context, h.absorb.is_some()), (Mode::Lift, Some(ContextPolicy::HeadTail), true));
        assert!(method("lift:everything", &base, 30).is_err() && method("memory:full", &base, 30).is_err());
        assert_eq!(method("memory", &base, 30).unwrap().mode, Mode::Memory);
        // A budget per method: one absorb answers at several budgets.
        let b = method("lift:head_tail:256", &base, 30).unwrap();
        assert_eq!((b.context, b.context_tokens), (Some(ContextPolicy::HeadTail), Some(256)));
        assert_eq!(method("rag:64", &base, 30).unwrap().context_tokens, Some(64));
        assert_eq!(method("lift", &base, 30).unwrap().context_tokens, None);
        for bad in ["memory:64", "icl:full:64", "lift:0", "rag:64:128", "lift:full:head_tail"] {
            assert!(method(bad, &base, 30).is_err(), "{bad}");
        }
        // FltLM and CDT belong to the prepared base, not to a method.
        assert!(method("lift+filter", &base, 30).is_err() && method("lift+cdt", &base, 30).is_err());
        let p = method("lift-paper", &base, 30).unwrap().absorb.unwrap();
        assert_eq!((p.layers.unwrap().len(), p.train.epochs, p.plan.window), (30, [3, 5], 256));
        assert!(method("nope", &base, 30).is_err());
    }
}
