//! Auxiliary QA for LIFT: question/answer pairs about the document, trained alongside the document
//! segments (loss on the answer only), as in "LIFT: Improving Long Context Understanding of Large
//! Language Models through Long Input Fine-Tuning" (Mao et al.), §3.2 and App. A.3.
//!
//! Two sources, both from the document alone (never from an evaluation set):
//! - **Model** (`model`, replies parsed by `parse` and checked by `evidence`): the loaded
//!   model reads windows of consecutive sentences spread over the document, with the LIFT paper's
//!   App. A.3 prompt, and writes `Question:/Answer:/Evidence:`; the evidence must be verbatim
//!   document text and the answer grounded in the window. Off by default (`use_model`).
//! - **Extractive** (`extractive`): a deterministic rule-based generator over fact-bearing
//!   sentences, several differently-worded questions per fact. It always contributes — how a
//!   fact's question is worded decides whether it is recalled later — and fills the quota when the
//!   model produces too few valid pairs, so absorption never trains without QA; when facts are
//!   scarce, plain cloze questions top up to `min_pairs`.
//!
//! The result is capped by `max_pairs` with even coverage over the document (first one wording per
//! fact everywhere, then further wordings), sorted by position in the document and deterministic
//! for a given seed. Deduplication: no two pairs share a normalised question; model pairs also
//! never repeat an (answer, evidence) of another model pair, while the extractive wordings of one
//! fact share theirs on purpose.

mod evidence;
mod extractive;
mod model;
mod parse;
mod words;

// Reading data from real prose for the prepared base (`base::real`, research).
#[cfg(feature = "research")]
pub(crate) use extractive::is_cloze;
pub use evidence::{locate_evidence, locate_evidence_near};
pub use model::qa_prompt;
pub use parse::parse_qa;
pub use words::normalize_question;

use super::text::{normalize_layout, split_sentences, Span};
use crate::model::Model;
use anyhow::Result;
use extractive::{extractive_candidates, fallback_candidates};
use std::collections::{HashMap, HashSet};

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum QaSource {
    Model,
    Extractive,
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct QaPair {
    pub question: String,
    pub answer: String,
    /// Verbatim document text: `doc[evidence_span.0..evidence_span.1] == evidence`.
    pub evidence: String,
    /// Byte offsets in the document.
    pub evidence_span: (usize, usize),
    pub source: QaSource,
}

/// Which auxiliary QA pairs the evidence check keeps (`qa.keep_answerable`,
/// [`crate::lift::absorb::answerable`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum KeepAnswerable {
    /// Every pair, unchecked (the default).
    #[default]
    Off,
    /// A pair only when the base, reading its evidence, answers it.
    Pairs,
    /// A fact's every wording when the base, reading its evidence, answers one of them.
    Facts,
}

impl KeepAnswerable {
    pub fn is_off(&self) -> bool {
        *self == KeepAnswerable::Off
    }
}

/// The most auxiliary QA pairs a document may ask for (a 64K-token document's prose yields ~3,500;
/// the training-token cap bounds what they cost).
pub const MAX_AUX_QA: usize = 20_000;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct QaOptions {
    /// Coverage: one model-generated pair per this many sentences (windows spread evenly).
    pub sentences_per_pair: usize,
    /// Cap on all pairs (model + extractive); extractive pairs are thinned evenly to fit. Named
    /// `aux_qa` wherever it is set (read under its older name `max_pairs` too).
    #[serde(rename = "aux_qa", alias = "max_pairs")]
    pub max_pairs: usize,
    /// A cap that grows with the document: at most this many pairs per 1,000 document tokens
    /// (0: none), so that a long document is asked about all through, not in a fixed number of
    /// pairs ([`QaOptions::for_document`]). The extractive generator finds about one fact per 18
    /// tokens of prose, so on prose this cap rarely binds.
    pub pairs_per_1k_tokens: usize,
    /// The length-scaled cap is never below this many pairs: a short document's every fact in its
    /// four wordings, as the fixed cap of 256 gave the 1K-token documents the adapter's eval
    /// figures were measured on (docs/recipe-search.md: with 64 per 1,000 tokens alone, one wording
    /// a fact, the adapter answered 13 of 45 validation questions against 32).
    pub cap_floor: usize,
    /// Floor: the extractive generator (and, failing that, plain cloze questions) fills up to it.
    pub min_pairs: usize,
    /// Consecutive sentences shown to the model (the paper's 16).
    pub window_sentences: usize,
    /// Extra attempts per window after the first (greedy) one; the paper's 5.
    pub retries: usize,
    pub use_model: bool,
    /// Tokens the model may write per attempt: the evidence may use all of them, the question and
    /// the answer half each (a question or answer still unfinished then is dropped).
    pub max_new_tokens: usize,
    /// Differently-worded extractive questions per fact (short, full-sentence, cloze, typed, ...).
    pub wordings_per_fact: usize,
    /// Which pairs are kept once the base has read each one's evidence and answered it
    /// ([`KeepAnswerable`]); left out of the JSON (and so of document ids) when off.
    #[serde(skip_serializing_if = "KeepAnswerable::is_off")]
    pub keep_answerable: KeepAnswerable,
    pub seed: u64,
}

impl Default for QaOptions {
    fn default() -> Self {
        Self {
            sentences_per_pair: 8,
            // The length-scaled cap below is what bounds a long document's pairs; this one is
            // the user's `aux_qa`.
            max_pairs: MAX_AUX_QA,
            pairs_per_1k_tokens: 64,
            cap_floor: 256,
            min_pairs: 10,
            window_sentences: 16,
            retries: 5,
            // Off by default: the default 135M model writes almost no valid pairs (the extractive
            // generator carries the load) and generating them costs minutes per document.
            use_model: false,
            max_new_tokens: 128,
            wordings_per_fact: 4,
            keep_answerable: KeepAnswerable::Off,
            seed: 0,
        }
    }
}

impl QaOptions {
    /// These options for a document of `tokens` tokens: `max_pairs` lowered to the length-scaled
    /// cap (`pairs_per_1k_tokens`, never below `min_pairs`).
    pub fn for_document(&self, tokens: usize) -> QaOptions {
        let mut o = self.clone();
        if self.pairs_per_1k_tokens > 0 {
            let scaled =
                (tokens.saturating_mul(self.pairs_per_1k_tokens)).div_ceil(1000).max(self.cap_floor).max(self.min_pairs).max(1);
            o.max_pairs = o.max_pairs.min(scaled);
        }
        o
    }
}

/// Progress of model generation: windows done out of total, valid model pairs so far.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct QaProgress {
    pub done: usize,
    pub total: usize,
    pub valid: usize,
}

/// What happened during [`generate_qa_with_stats`] (for logs and reports).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct QaStats {
    pub sentences: usize,
    pub windows: usize,
    pub attempts: usize,
    pub generated_tokens: usize,
    pub model_valid: usize,
    pub rejected_parse: usize,
    pub rejected_evidence: usize,
    pub rejected_answer: usize,
    pub rejected_duplicate: usize,
    /// The model stopped being asked: after at least 3 windows, fewer than 1 in 10 gave a pair.
    pub model_gave_up: bool,
    pub model_seconds: f64,
    /// Extractive pairs available before the `max_pairs` cap, and kept after it.
    pub extractive_candidates: usize,
    pub extractive: usize,
    /// Plain cloze pairs added to reach `min_pairs` when facts were scarce.
    pub fallback: usize,
    pub total: usize,
}

/// Generates auxiliary QA pairs for `doc`: model pairs from windows spread over the whole document
/// plus extractive pairs (see the module docs). `progress` is called as model windows finish;
/// `cancel` is polled between and during generations (an `Err` wrapping
/// [`Cancelled`](crate::lift::absorb::cancelled::Cancelled) results).
pub fn generate_qa(
    model: &Model,
    doc: &str,
    opts: &QaOptions,
    progress: &mut dyn FnMut(&QaProgress),
    cancel: &dyn Fn() -> bool,
) -> Result<Vec<QaPair>> {
    generate_qa_with_stats(model, doc, opts, progress, cancel).map(|(pairs, _)| pairs)
}

/// [`generate_qa`], also returning what happened.
pub fn generate_qa_with_stats(
    model: &Model,
    doc: &str,
    opts: &QaOptions,
    progress: &mut dyn FnMut(&QaProgress),
    cancel: &dyn Fn() -> bool,
) -> Result<(Vec<QaPair>, QaStats)> {
    // Sentences are cut from the text with its boxes and rules blanked (same offsets), so a
    // boxed paragraph is one sentence; every evidence is still read from `doc` itself.
    let clean = normalize_layout(doc);
    let sentences = split_sentences(&clean);
    let mut stats = QaStats { sentences: sentences.len(), ..Default::default() };
    let run = model::Run { model, doc, opts, cancel };
    let model_pairs = model::model_pairs(&run, &sentences, progress, &mut stats)?;
    let chosen = select_extractive(&clean, &sentences, opts, &model_pairs, &mut stats);
    let pairs = with_original_evidence(doc, in_document_order(model_pairs, chosen));
    stats.total = pairs.len();
    tracing::info!(
        sentences = stats.sentences,
        windows = stats.windows,
        model = stats.model_valid,
        extractive = stats.extractive,
        fallback = stats.fallback,
        seconds = stats.model_seconds,
        "auxiliary QA generated"
    );
    Ok((pairs, stats))
}

/// Deterministic rule-based QA over the document's fact-bearing sentences (no model): for each
/// fact, up to `wordings_per_fact` differently-worded questions with short and full-sentence
/// answers; capped by `max_pairs` with even coverage, topped up with plain cloze questions to
/// `min_pairs` when facts are scarce; no answer and not the cloze wordings over their share
/// ([`MAX_ANSWER_SHARE`], [`MAX_CLOZE_SHARE`]). Sentences are cut from the normalized layout
/// ([`normalize_layout`]).
pub fn extractive_qa(doc: &str, opts: &QaOptions) -> Vec<QaPair> {
    let clean = normalize_layout(doc);
    let sentences = split_sentences(&clean);
    let chosen = select_extractive(&clean, &sentences, opts, &[], &mut QaStats::default());
    with_original_evidence(doc, in_document_order(Vec::new(), chosen))
}

/// The pairs with their evidence read from the original text at their spans (the rules read the
/// normalized one, whose boxes are blanked).
fn with_original_evidence(doc: &str, mut pairs: Vec<QaPair>) -> Vec<QaPair> {
    for p in &mut pairs {
        p.evidence = doc[p.evidence_span.0..p.evidence_span.1].to_string();
    }
    pairs
}

/// Most of a document's pairs one answer string may take (normalised; never fewer than one fact's
/// wordings, `wordings_per_fact`, which share their answer on purpose): a reader trained on one
/// frequent term for many questions learns to answer with that term.
pub const MAX_ANSWER_SHARE: f64 = 0.05;
/// Most of a document's pairs the fill-in-the-blank wordings may take.
pub const MAX_CLOZE_SHARE: f64 = 0.25;

/// What makes two answers the same one for the caps: SQuAD's normalisation (case, punctuation
/// and articles dropped), so "The Project Leader" and "project leader" count together.
fn answer_key(answer: &str) -> String {
    crate::corpus::scoring::normalize(answer)
}

/// The figures of a document's pairs the caps above bound, for reports and tests.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct QaShares {
    pub pairs: usize,
    pub distinct_answers: usize,
    /// The largest share one normalised answer takes.
    pub top_answer_share: f64,
    pub cloze_share: f64,
    /// Pairs whose answer is a short span (at most 8 words).
    pub short_answer_share: f64,
}

pub fn qa_shares(pairs: &[QaPair]) -> QaShares {
    let n = pairs.len();
    if n == 0 {
        return QaShares::default();
    }
    let mut counts: HashMap<String, usize> = HashMap::new();
    for p in pairs {
        *counts.entry(answer_key(&p.answer)).or_default() += 1;
    }
    let share = |k: usize| k as f64 / n as f64;
    QaShares {
        pairs: n,
        distinct_answers: counts.len(),
        top_answer_share: share(counts.values().copied().max().unwrap_or(0)),
        cloze_share: share(pairs.iter().filter(|p| extractive::is_cloze(&p.question)).count()),
        short_answer_share: share(pairs.iter().filter(|p| p.answer.split_whitespace().count() <= 8).count()),
    }
}

/// `chosen` (after the model's pairs) with no answer over [`MAX_ANSWER_SHARE`] and the cloze
/// wordings within [`MAX_CLOZE_SHARE`] of `total` pairs (`None`: of what is kept, which shrinks
/// as pairs are dropped, so repeated until it holds). Kept first: lower wording ranks, then facts
/// spread over the document (bit-reversed order), so a frequent answer keeps its questions
/// from all through the text.
fn cap_shares(model_pairs: &[QaPair], mut chosen: Vec<Candidate>, total: Option<usize>, one_fact: usize) -> Vec<Candidate> {
    loop {
        let n = total.unwrap_or(model_pairs.len() + chosen.len());
        let per_answer = ((n as f64 * MAX_ANSWER_SHARE).floor() as usize).max(one_fact).max(1);
        let cloze_max = (n as f64 * MAX_CLOZE_SHARE).floor() as usize;
        let mut counts: HashMap<String, usize> = HashMap::new();
        for p in model_pairs {
            *counts.entry(answer_key(&p.answer)).or_default() += 1;
        }
        let mut order: Vec<usize> = (0..chosen.len()).collect();
        order.sort_by_key(|&i| (chosen[i].rank, chosen[i].fact.reverse_bits()));
        let (mut keep, mut cloze) = (vec![false; chosen.len()], 0);
        for i in order {
            let c = counts.entry(answer_key(&chosen[i].pair.answer)).or_default();
            let is_cloze = extractive::is_cloze(&chosen[i].pair.question);
            if *c >= per_answer || (is_cloze && cloze >= cloze_max) {
                continue;
            }
            *c += 1;
            cloze += usize::from(is_cloze);
            keep[i] = true;
        }
        let settled = total.is_some() || keep.iter().all(|&k| k);
        let mut it = keep.into_iter();
        chosen.retain(|_| it.next().unwrap_or(false));
        if settled {
            return chosen;
        }
    }
}

/// One extractive pair with its wording rank (0 = the most direct question for the fact) and the
/// index of its fact in document order.
#[derive(Clone, Debug)]
struct Candidate {
    rank: usize,
    fact: usize,
    pair: QaPair,
}

/// The extractive pairs for what `max_pairs` leaves after the model's: everything the rules find,
/// minus questions the model already asked, thinned evenly; then, never to train without QA, plain
/// cloze questions up to `min_pairs` when facts were too scarce. Fills the extractive counts of
/// `stats`.
fn select_extractive(
    doc: &str,
    sentences: &[Span],
    opts: &QaOptions,
    model_pairs: &[QaPair],
    stats: &mut QaStats,
) -> Vec<Candidate> {
    let max_pairs = opts.max_pairs.max(1);
    let mut seen: HashSet<String> = model_pairs.iter().map(|p| normalize_question(&p.question)).collect();
    let unseen = |cands: Vec<Candidate>, seen: &HashSet<String>| -> Vec<Candidate> {
        cands.into_iter().filter(|c| !seen.contains(&normalize_question(&c.pair.question))).collect()
    };
    let cands: Vec<Candidate> = unseen(extractive_candidates(doc, sentences, opts), &seen)
        .into_iter()
        .filter(|c| extractive::well_formed(&c.pair.question, &c.pair.answer))
        .collect();
    stats.extractive_candidates = cands.len();
    let room = max_pairs.saturating_sub(model_pairs.len());
    // The shares are bounded on the pool at the size the selection will have, then again on
    // what it kept.
    let expected = model_pairs.len() + room.min(cands.len());
    let one_fact = opts.wordings_per_fact;
    let cands = cap_shares(model_pairs, cands, Some(expected), one_fact);
    let mut chosen = cap_shares(model_pairs, select_even(cands, room), None, one_fact);
    stats.extractive = chosen.len();
    seen.extend(chosen.iter().map(|c| normalize_question(&c.pair.question)));
    let have = model_pairs.len() + chosen.len();
    let floor = opts.min_pairs.min(max_pairs);
    if have < floor {
        let extra = select_even(unseen(fallback_candidates(doc, sentences), &seen), floor - have);
        chosen.extend(extra);
        // The floor is not filled with blanks: the cloze share holds over the whole.
        chosen = cap_shares(model_pairs, chosen, None, one_fact);
        stats.fallback = (model_pairs.len() + chosen.len()).saturating_sub(have);
    }
    chosen
}

/// Keeps at most `budget` candidates: rank by rank (every fact's first wording before any fact's
/// second), thinning a rank evenly over the document when it does not fit. Drops repeated
/// questions.
fn select_even(mut cands: Vec<Candidate>, budget: usize) -> Vec<Candidate> {
    let mut seen = HashSet::new();
    cands.retain(|c| seen.insert(normalize_question(&c.pair.question)));
    let max_rank = cands.iter().map(|c| c.rank).max().unwrap_or(0);
    let mut out = Vec::new();
    for rank in 0..=max_rank {
        let left = budget - out.len();
        if left == 0 {
            break;
        }
        let group: Vec<&Candidate> = cands.iter().filter(|c| c.rank == rank).collect();
        if group.len() <= left {
            out.extend(group.into_iter().cloned());
        } else {
            let n = group.len();
            out.extend((0..left).map(|i| group[((2 * i + 1) * n) / (2 * left)].clone()));
        }
    }
    out.sort_by_key(|c| (c.fact, c.rank));
    out
}

/// All pairs by position in the document; at one position the model's pair first, then the
/// extractive ones by wording rank.
fn in_document_order(model_pairs: Vec<QaPair>, chosen: Vec<Candidate>) -> Vec<QaPair> {
    let mut all: Vec<(usize, usize, QaPair)> = model_pairs.into_iter().map(|p| (p.evidence_span.0, 0, p)).collect();
    all.extend(chosen.into_iter().map(|c| (c.pair.evidence_span.0, 1 + c.rank, c.pair)));
    all.sort_by_key(|&(pos, rank, _)| (pos, rank));
    all.into_iter().map(|(_, _, p)| p).collect()
}

/// Counts pairs per source (for logs and tests).
pub fn count_by_source(pairs: &[QaPair]) -> HashMap<&'static str, usize> {
    let mut m = HashMap::new();
    for p in pairs {
        *m.entry(match p.source {
            QaSource::Model => "model",
            QaSource::Extractive => "extractive",
        })
        .or_insert(0) += 1;
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const PARAGRAPH: &str = "The Harbor Museum opened in 1987 in the old customs house. \
The museum was founded by Elena Marsh, a retired sea captain. \
Its first director was Tomas Berg. \
The collection holds 4,200 objects from the age of sail. \
Most visitors come in the summer. \
The vault code at the Lisbon office is 4417. \
The museum's oldest ship model is called \"Morning Star\". \
On March 3, 1999, a fire damaged the east wing. \
The restoration cost 2.5 million euros. \
Anna's favourite exhibit is the brass telescope. \
The library has 12,000 books about navigation. \
In 2005, Maria Santos became the chief curator. \
The museum is a popular place for school trips. \
Every winter the staff repaint the figureheads. \
The annual lecture takes place at 7:30 p.m. on the first Friday of October. \
Visitors can reach the museum from Central Station in ten minutes.";

    pub(super) fn assert_verbatim(doc: &str, pairs: &[QaPair]) {
        for p in pairs {
            let (s, e) = p.evidence_span;
            assert_eq!(&doc[s..e], p.evidence, "evidence not at its span: {p:?}");
            assert!(!p.question.trim().is_empty() && !p.answer.trim().is_empty(), "{p:?}");
        }
    }

    /// Real prose (from the Debian constitution, a train-split document of the real-text set),
    /// hard-wrapped and indented as it ships.
    const CONSTITUTION: &str = "  5.2. Appointment

    1. The Project Leader is elected by the Developers.
    2. The election begins six weeks before the leadership post becomes
       vacant, or (if it is too late already) immediately.
    3. For the first week any Developer may nominate themselves as a
       candidate Project Leader, and summarize their plans for their term.
    4. For three weeks after that no more candidates may be nominated;
       candidates should use this time for campaigning and discussion. If
       there are no candidates at the end of the nomination period then
       the nomination period is extended for an additional week,
       repeatedly if necessary.
    5. The next two weeks are the polling period during which Developers
       may cast their votes. Votes in leadership elections are kept
       secret, even after the election is finished.
    6. The options on the ballot will be those candidates who have
       nominated themselves and have not yet withdrawn, plus None Of The
       Above. If None Of The Above wins the election then the election
       procedure is repeated, many times if necessary.
    7. The decision will be made using the method specified in section
       §A.5 of the Standard Resolution Procedure. The quorum is the same
       as for a General Resolution (§4.2) and the default option is
       \"None Of The Above\".
    8. The Project Leader serves for one year from their election.

  5.3. Procedure

   The Project Leader should attempt to make decisions which are
   consistent with the consensus of the opinions of the Developers.

   Where practical the Project Leader should informally solicit the views
   of the Developers.

   The Project Leader should avoid overemphasizing their own point of view
   when making decisions in their capacity as Leader.
";

    /// The QA of real prose: wh-questions (who, what, how many, under what condition, what happens
    /// if) with short answers, every answer within its share and the blanks within theirs.
    #[test]
    fn real_prose_gets_wh_questions_with_short_answers_within_their_shares() {
        let o = QaOptions::default().for_document(CONSTITUTION.len() / 4);
        let pairs = extractive_qa(CONSTITUTION, &o);
        assert_verbatim(CONSTITUTION, &pairs);
        let has = |q: &str, a: &str| pairs.iter().any(|p| p.question == q && p.answer == a);
        let questions: Vec<(&str, &str)> = pairs.iter().map(|p| (p.question.as_str(), p.answer.as_str())).collect();
        assert!(has("Who should attempt to make decisions which are consistent with the consensus of the opinions of the Developers?", "The Project Leader"), "{questions:#?}");
        assert!(has("What happens if None Of The Above wins the election?", "the election procedure is repeated"), "{questions:#?}");
        assert!(pairs.iter().any(|p| p.question.starts_with("Under what condition") && p.answer.split_whitespace().count() <= 14), "{questions:#?}");
        // Most questions ask with a question word and most answers are a few words.
        let wh = ["who", "whom", "whose", "what", "when", "which", "where", "how"];
        let asked = pairs.iter().filter(|p| words::tokens(&p.question).iter().any(|t| wh.contains(&t.as_str()))).count();
        let short = pairs.iter().filter(|p| p.answer.split_whitespace().count() <= 8).count();
        assert!(2 * asked >= pairs.len() && 2 * short >= pairs.len(), "{asked} wh, {short} short of {}: {questions:#?}", pairs.len());
        // The shares hold: no answer over 5% (one fact's wordings at least), blanks at most 25%.
        let sh = qa_shares(&pairs);
        let per_answer = ((pairs.len() as f64 * MAX_ANSWER_SHARE).floor() as usize).max(o.wordings_per_fact);
        assert!(sh.top_answer_share * pairs.len() as f64 <= per_answer as f64 + 1e-9, "{sh:?}");
        assert!(sh.cloze_share <= MAX_CLOZE_SHARE, "{sh:?}");
        // "The Project Leader" answers many sentences here: it is kept to its share.
        let leader = pairs.iter().filter(|p| answer_key(&p.answer) == "project leader").count();
        assert!(leader <= per_answer, "{leader} pairs answer the Project Leader");
    }

    /// A frequent term never takes more than its share of the pairs, however often the text has it.
    #[test]
    fn a_frequent_answer_keeps_to_its_share() {
        let doc: String = (0..60)
            .map(|i| format!("The Licensor must deliver copy number {i} of the Work to the office in region {}.\n\n", 1000 + 7 * i))
            .collect();
        let o = QaOptions::default().for_document(doc.len() / 4);
        let pairs = extractive_qa(&doc, &o);
        assert!(pairs.len() > 40, "{}", pairs.len());
        let sh = qa_shares(&pairs);
        let cap = ((pairs.len() as f64 * MAX_ANSWER_SHARE).floor() as usize).max(o.wordings_per_fact);
        assert!(sh.top_answer_share * pairs.len() as f64 <= cap as f64 + 1e-9, "{sh:?}");
        assert!(sh.cloze_share <= MAX_CLOZE_SHARE, "{sh:?}");
    }

    #[test]
    fn the_pair_cap_grows_with_the_document_and_the_users_cap_still_holds() {
        let o = QaOptions::default();
        // 64 per 1,000 tokens, never under 256: 256 up to 4K tokens, 4,096 at 64K.
        assert_eq!(o.for_document(1_000).max_pairs, 256);
        assert_eq!(o.for_document(4_000).max_pairs, 256);
        assert_eq!(o.for_document(64_000).max_pairs, 4_096);
        let unfloored = QaOptions { cap_floor: 0, ..Default::default() };
        assert_eq!(unfloored.for_document(1_000).max_pairs, 64);
        assert_eq!(unfloored.for_document(10).max_pairs, o.min_pairs, "never below the floor");
        let asked = QaOptions { max_pairs: 52, ..Default::default() };
        assert_eq!(asked.for_document(64_000).max_pairs, 52, "the user's aux_qa is a cap");
        let unscaled = QaOptions { pairs_per_1k_tokens: 0, max_pairs: 300, ..Default::default() };
        assert_eq!(unscaled.for_document(64_000).max_pairs, 300);
        // On long prose the generator finds more facts than the old fixed cap of 256 kept.
        let long: String = (0..400)
            .map(|i| format!("In {}, the guild of weaver number {i} moved to the harbor town of Port {i}. ", 1700 + i))
            .collect();
        let tokens = long.len() / 4;
        let pairs = extractive_qa(&long, &o.for_document(tokens));
        assert!(pairs.len() > 256, "{} pairs for ~{tokens} tokens", pairs.len());
        let (head, tail) = (long.len() / 20, long.len() - long.len() / 20);
        assert!(pairs.iter().any(|p| p.evidence_span.0 < head) && pairs.iter().any(|p| p.evidence_span.0 > tail),
            "the pairs cover the document from its first twentieth to its last");
    }

    #[test]
    fn generate_qa_with_a_tiny_model_falls_back_to_extractive() {
        use crate::testing::{write_hf, TinySpec};
        let dir = tempfile::tempdir().unwrap();
        let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
        let model = Model::load(&path, &candle_core::Device::Cpu).unwrap();
        let o = QaOptions {
            retries: 1,
            max_new_tokens: 8,
            min_pairs: 12,
            max_pairs: 40,
            use_model: true,
            ..Default::default()
        };
        let mut reports = Vec::new();
        let (pairs, stats) =
            generate_qa_with_stats(&model, PARAGRAPH, &o, &mut |p| reports.push((p.done, p.total)), &|| false).unwrap();
        assert_eq!(stats.windows, 2);
        assert_eq!(reports.first(), Some(&(0, 2)));
        assert_eq!(reports.last(), Some(&(2, 2)));
        assert!(pairs.len() >= 12 && pairs.len() <= 40, "{}", pairs.len());
        assert_verbatim(PARAGRAPH, &pairs);
        let qs: HashSet<String> = pairs.iter().map(|p| normalize_question(&p.question)).collect();
        assert_eq!(qs.len(), pairs.len());
        let again = generate_qa(&model, PARAGRAPH, &o, &mut |_| {}, &|| false).unwrap();
        assert_eq!(serde_json::to_string(&pairs).unwrap(), serde_json::to_string(&again).unwrap());
        // Cancellation is an error that says so.
        let err = generate_qa(&model, PARAGRAPH, &o, &mut |_| {}, &|| true).unwrap_err();
        assert!(err.downcast_ref::<crate::lift::absorb::cancelled::Cancelled>().is_some());
        // Without the model: extractive only.
        let no_model = QaOptions { use_model: false, ..o };
        let pairs = generate_qa(&model, PARAGRAPH, &no_model, &mut |_| {}, &|| false).unwrap();
        assert!(pairs.len() >= 12 && pairs.iter().all(|p| p.source == QaSource::Extractive));
    }
}
