//! What a run records and writes: each absorb's cost and product, each answer with its scores,
//! the run's settings, and the results — merged across runs of the same documents or pooled
//! across runs of different ones.

use super::needles::{self, FactKind};
use super::{mask, EvalDocument};
use crate::corpus::scoring::Scores;
use crate::lift::AbsorbOptions;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
    /// Asked of a collection (`eval --collection`): whether routing chose the question's
    /// document.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_right: Option<bool>,
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
