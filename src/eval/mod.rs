//! `lift-serve eval`: long-document QA, offline, methods side by side on the same documents.
//!
//! Documents come from real prose with planted facts ([`needles`], the essays of
//! [`data`](crate::corpus)) or from a user's JSONL file ([`load_jsonl`]). Every question is
//! labelled in-window or out-of-window for the truncated context the answering code actually
//! builds ([`crate::lift::answer::build_prompt`]), answered by each method (named presets of
//! absorb options and an answer mode: [`method`]) either in-process or through a running
//! server's HTTP API ([`client`]), and scored by SQuAD-normalised exact match, token F1 and
//! containment ([`metrics`](crate::corpus::scoring)). [`report`] writes the JSON results, a
//! markdown table and PNG plots.
//!
//! Here: the documents and questions; the methods (`methods.rs`), the records and results
//! (`records.rs`), the backends (`backend.rs`), the run (`runner.rs`) and the command
//! (`cli.rs`).

mod backend;
pub mod client;
mod cli;
pub mod gating;
mod jsonl;
pub mod mask;
mod methods;
pub mod needles;
pub mod qa_report;
mod records;
pub mod report;
mod runner;

pub use backend::{Asked, Backend, Local};
pub use cli::{apply_filter_mask, run_cli, EssaySplit, EvalArgs};
pub use jsonl::load_jsonl;
pub use methods::{method, Method, METHODS};
pub use records::{AbsorbRecord, AnswerRecord, Results, RunConfig};
pub use runner::run;

use crate::lift::answer::AnswerPrompt;
use needles::FactKind;
use serde::{Deserialize, Serialize};

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
