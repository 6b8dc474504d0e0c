//! A run: every method on every document — one absorb per group of methods sharing options,
//! every question answered by each method, labelled in or out of the window and scored — with
//! its progress bars.

use super::{in_window, mask, method, AbsorbRecord, AnswerRecord, Asked, Backend, EvalDocument, EvalQuestion, Method, Results, RunConfig};
use crate::corpus::scoring as metrics;
use crate::document::Document;
use crate::lift::answer::{build_prompt, Ask, ContextPolicy, Mode};
use crate::lift::AbsorbOptions;
use crate::model::Model;
use anyhow::{bail, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::BTreeMap;
use std::time::Instant;

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
                self.backend.ask(doc, document, handles.get(&m.name).copied(), &asked, m.each_passage)?;
            // (Reading each passage alone, the prompt is the kept answer's: its evidence is
            // counted over every passage read.)
            let expected = build_prompt(model, document, &asked, cfg.max_tokens)?;
            if prompt_tokens != expected.tokens.len() && !m.each_passage {
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
                routed_right: None,
            });
            self.bars.overall.inc(1);
        }
        Ok(())
    }
}
