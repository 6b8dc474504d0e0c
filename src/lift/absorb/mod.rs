//! Absorbing: what makes an adapter. document (tokenized once: [`crate::document::Document`]) →
//! auxiliary QA ([`qa`]) → plan ([`plan`]: segments with contextualized training, QA examples) →
//! train ([`trainer`]) → adapter bundle + manifest; resumable from a [`checkpoint`].

pub mod answerable;
pub mod cancelled;
pub mod checkpoint;
pub mod plan;
pub mod qa;
pub mod qa_examples;
pub mod text;
pub mod trainer;

use crate::adapters::manifest::{BaseModelRef, DocumentRef, Manifest};
use crate::adapters::{AdapterBundle, AdapterKind, AnyAdapter, GatedMemory, Lora};
use crate::document::Document;
use crate::lift::answer;
use crate::lift::answer::layout;
use crate::lift::options::AbsorbOptions;
use crate::model::Model;
use crate::store::NewAdapter;
use anyhow::Result;
use plan::Plan;
use qa::{QaPair, QaProgress};
use serde::{Deserialize, Serialize};
use std::time::Instant;
use trainer::{FilterTraining, Progress, RunControl, TrainInputs, TrainReport};

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
            let (pairs, _) = answerable::keep_answerable(model, document, &pairs, qa_opts.keep_answerable, cancel)?;
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
    // The prepared base's filter masks the training rows under the absorb's calibration.
    let absorb_filter = model.base_filter().map(crate::model::filter::Filter::for_absorb);
    let base_filter = absorb_filter.as_ref().map(|f| FilterTraining::frozen(f, &filter_examples));
    // Probes in the layout the QA examples train in, one question per row.
    let mut probe_opts = opts.clone();
    probe_opts.plan.qa_pack = 1;
    let probe_plan = match held.is_empty() {
        true => None,
        false => Some(self::plan(model, document, &held, &probe_opts)?),
    };
    let probes = probe_plan.as_ref().map(|(p, fx)| trainer::Probes {
        examples: &p.qa,
        filter: absorb_filter.as_ref().map(|f| FilterTraining::frozen(f, fx)),
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
/// out the context; the filter then masks them, frozen (a detached copy, no filter loss). In the
/// `passages` layout each question's context is what an answer to it would show.
fn plan(model: &Model, document: &Document, pairs: &[QaPair], opts: &AbsorbOptions) -> Result<(Plan, Vec<qa_examples::FilterExample>)> {
    let budget = opts.plan.qa_context();
    let n = document.tokens().len();
    // A prompt of the answer layout: BM25's passages for the question, as answering finds them.
    let passages = |pair: &QaPair| {
        let ask = answer::Ask {
            context: Some(answer::ContextPolicy::Bm25),
            context_tokens: Some(budget),
            ..answer::Ask::new(&pair.question, answer::Mode::Lift)
        };
        let p = answer::build_prompt(model, document, &ask, QA_ANSWER_TOKENS)?;
        Ok(layout::FilterPrompt { tokens: p.tokens, chunks: p.chunks, head_end: 0, tail_start: n })
    };
    use plan::QaLayout;
    let examples = match (model.base_filter(), opts.plan.qa_layout) {
        (None, QaLayout::HeadTail) => return Ok((Plan::new(model, document.tokens(), pairs, &opts.plan)?, Vec::new())),
        (Some(f), QaLayout::HeadTail) => qa_examples::qa_examples(model, document, pairs, budget, f)?,
        (_, QaLayout::Passages) => qa_examples::qa_examples_laid_out(model, document, pairs, &|_, pair, _| passages(pair))?,
    };
    if opts.plan.qa_pack > 1 {
        // Each question's filter masks the context its own way; a packed row shares one context.
        tracing::warn!(qa_pack = opts.plan.qa_pack, "qa_pack has no effect under the prepared base's filter or the passages layouts: one question per row");
    }
    let qa = examples.iter().map(|e| e.example.clone()).collect();
    Ok((Plan::with_qa(model, document.tokens(), qa, &opts.plan)?, examples))
}

/// The answer length the passages layout leaves room for (it only matters where the model's
/// window is shorter than the budget): an auxiliary answer is a few words.
const QA_ANSWER_TOKENS: usize = 32;

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

    use qa::QaSource;

    fn pair(q: &str, span: (usize, usize)) -> QaPair {
        QaPair { question: q.into(), answer: "a".into(), evidence: "e".into(), evidence_span: span, source: QaSource::Extractive }
    }

    #[test]
    fn the_passages_layout_trains_each_question_on_the_prompt_its_answer_shows() {
        use candle_core::Device;
        let dir = tempfile::tempdir().unwrap();
        let path = crate::testing::write_hf(&dir.path().join("tiny"), &crate::testing::TinySpec::default()).unwrap();
        let model = Model::load(&path, &Device::Cpu).unwrap();
        // A fact in the middle of a document much longer than the budget: out of the head and tail.
        let filler = "Gulls circle the harbor while the tide turns slowly. ";
        let fact = "The lighthouse keeper is Anselm Varga.";
        let text = format!("{}{fact} {}", filler.repeat(6), filler.repeat(6));
        let document = Document::encode(&model, text.clone()).unwrap();
        let at = text.find(fact).unwrap();
        let question = "Who is the lighthouse keeper?";
        let pair = QaPair {
            question: question.into(),
            answer: "Anselm Varga".into(),
            evidence: fact.into(),
            evidence_span: (at, at + fact.len()),
            source: QaSource::Extractive,
        };
        let mut opts = AbsorbOptions::default();
        opts.plan.training_context_tokens = 48;
        opts.plan.qa_layout = plan::QaLayout::HeadTail;
        let answer_tokens = model.tokenizer.encode("Anselm Varga", false).unwrap();
        let (head_tail, _) = plan(&model, &document, std::slice::from_ref(&pair), &opts).unwrap();
        opts.plan.qa_layout = plan::QaLayout::Passages;
        let (passages, _) = plan(&model, &document, std::slice::from_ref(&pair), &opts).unwrap();
        let ask = answer::Ask {
            context: Some(answer::ContextPolicy::Bm25),
            context_tokens: Some(48),
            ..answer::Ask::new(question, answer::Mode::Lift)
        };
        let shown = answer::build_prompt(&model, &document, &ask, 32).unwrap();
        let fact_tokens = crate::document::token_span(&model, &text, pair.evidence_span).unwrap();
        assert!(shown.shows(fact_tokens), "BM25 finds the fact's passage");
        let ex = &passages.qa[0];
        let k = shown.tokens.len();
        assert_eq!(&ex.tokens[..k], shown.tokens.as_slice(), "the prompt is the answer's");
        assert_eq!(&ex.tokens[k..k + answer_tokens.len()], answer_tokens.as_slice());
        assert!(ex.target[..k].iter().all(|&t| !t) && ex.target[k..].iter().all(|&t| t), "the loss is on the answer alone");
        // The head-and-tail layout of the same question shows another context, without the fact.
        let ht = &head_tail.qa[0];
        assert_ne!(ht.tokens, ex.tokens);
        let fact_ids = &document.tokens()[fact_tokens.0..fact_tokens.1];
        let contains = |hay: &[u32]| hay.windows(fact_ids.len()).any(|w| w == fact_ids);
        assert!(contains(&ex.tokens) && !contains(&ht.tokens));
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
