//! Auxiliary QA for LIFT (seeds/001 §3.2, App. A.3): question/answer pairs about the document,
//! trained alongside the document segments (loss on the answer only).
//!
//! Two sources, both from the document alone (never from an evaluation set):
//! - **Model**: the loaded model reads 16 consecutive sentences with the paper's App. A.3 prompt
//!   (the Narrativeqa variant, "focus on the details like names, dates") and answers in its
//!   `Question:/Answer:/Evidence:` format. The reply is scaffolded: the model writes each field
//!   after its label and the next label is appended for it (a 135M model otherwise rarely writes
//!   an evidence line). The evidence must occur verbatim in the document (located in the whole
//!   document, preferring the window; a reply that quotes some sentences verbatim and then drifts
//!   keeps its longest verbatim run of adjacent sentences), every name and number in the answer and
//!   most of its words must occur in the window, and the answer must not be given away by the
//!   question. Failures are retried (greedy first, then seeded sampling). Windows are spread evenly
//!   over the whole document, one per `sentences_per_pair` sentences; once several windows gave
//!   (almost) nothing valid the model is no longer asked.
//! - **Extractive**: a deterministic rule-based generator over fact-bearing sentences (numbers,
//!   dates, capitalised names, quoted strings, `X is Y` copulas, possessives, `named/called Z`),
//!   several differently-worded questions per fact (a direct wh-question, "According to the
//!   document, …" with the full sentence as answer, a cloze, a typed or in-place variant, …). It
//!   always contributes — how a fact's question is worded decides whether it is recalled later —
//!   and fills the quota when the model produces too few valid pairs, so absorption never trains
//!   without QA; when facts are scarce, plain cloze questions top up to `min_pairs`.
//!
//! The result is capped by `max_pairs` with even coverage over the document (first one wording per
//! fact everywhere, then further wordings), sorted by position in the document and deterministic
//! for a given seed. Deduplication: no two pairs share a normalised question; model pairs also
//! never repeat an (answer, evidence) of another model pair, while the extractive wordings of one
//! fact share theirs on purpose.

use super::text::{list_marker_len, split_sentences, Span};
use crate::model::generate::{generate, prefill, FinishReason, SamplingParams};
use crate::model::{ChatMessage, KvCache, Model, NoHooks};
use anyhow::Result;
use std::collections::{HashMap, HashSet};
use std::time::Instant;

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

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct QaOptions {
    /// Coverage: one model-generated pair per this many sentences (windows spread evenly).
    pub sentences_per_pair: usize,
    /// Cap on all pairs (model + extractive); extractive pairs are thinned evenly to fit.
    pub max_pairs: usize,
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
    pub seed: u64,
}

impl Default for QaOptions {
    fn default() -> Self {
        Self {
            sentences_per_pair: 8,
            max_pairs: 256,
            min_pairs: 10,
            window_sentences: 16,
            retries: 5,
            // Off by default: the default 135M model writes almost no valid pairs (the extractive
            // generator carries the load) and generating them costs minutes per document.
            use_model: false,
            max_new_tokens: 128,
            wordings_per_fact: 4,
            seed: 0,
        }
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

/// Sampling temperature / top-p of the retries (the first attempt is greedy).
const RETRY_TEMPERATURE: f64 = 0.5;
const RETRY_TOP_P: f64 = 0.9;
/// Stop asking the model once at least this many windows were tried and fewer than one in ten
/// gave a valid pair (a small model can cost minutes per window on a CPU for nothing).
const GIVE_UP_AFTER_WINDOWS: usize = 3;
/// Facts taken from one sentence by the extractive generator.
const MAX_FACTS_PER_SENTENCE: usize = 2;

/// The paper's App. A.3 instruction (the Narrativeqa variant, which asks for names and dates).
pub fn qa_prompt(context: &str) -> String {
    format!(
        "You are given a piece of text as the context. You should generate ONLY one question and the corresponding \
         answer according to the context. You should also select one or more sentences directly from the original \
         context as the evidence. The evidences must be EXACTLY SAME ADJACENT sentences retrieved from the context; \
         KEEP the special tokens in the sentences. Please answer in the following format:\n\
         Question: [question]\n\nAnswer: [answer]\n\nEvidence: [evidence]\n\n\
         Please DON'T output quotes when outputting evidences. The question should focus on the details like names, \
         dates, e.t.c. The following is the piece of text: {context}"
    )
}

// ---------------------------------------------------------------------------------------------
// Parsing the model's output
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Label {
    Question,
    Answer,
    Evidence,
}

/// If `line` starts a labelled field ("Question:", "**Answer:**", "2. Evidence 1:", "Q:"), the
/// label and the rest of the line.
fn label_of(line: &str) -> Option<(Label, &str)> {
    let mut s = line.trim();
    // Leading markdown / list decoration.
    loop {
        let before = s.len();
        s = s.trim_start_matches(['#', '>', '*', '_', '-', '•']).trim_start();
        let m = list_marker_len(s);
        if m > 0 {
            s = s[m..].trim_start();
        }
        if s.len() == before {
            break;
        }
    }
    const NAMES: &[(&str, Label)] = &[
        ("question", Label::Question),
        ("answer", Label::Answer),
        ("evidences", Label::Evidence),
        ("evidence", Label::Evidence),
        ("q", Label::Question),
        ("a", Label::Answer),
    ];
    for &(name, label) in NAMES {
        let Some(head) = s.get(..name.len()) else {
            continue;
        };
        if !head.eq_ignore_ascii_case(name) {
            continue;
        }
        let mut rest = s[name.len()..].trim_start_matches(['*', '_', ' ']);
        if name.len() > 1 {
            rest = rest.trim_start_matches(|c: char| c.is_ascii_digit()).trim_start_matches(['*', '_', ' ']);
        }
        let rest = rest.strip_prefix(':').or_else(|| rest.strip_prefix('：'))?;
        return Some((label, rest.trim_start_matches(['*', '_']).trim()));
    }
    None
}

/// Trims a field: whitespace, markdown bold, a template-style `[...]` wrapper, wrapping quotes.
fn clean_field(s: &str) -> String {
    let mut t = s.trim();
    loop {
        let before = t;
        t = t.trim_matches(['*', '_']).trim();
        if t.starts_with('[') && t.ends_with(']') && t.len() >= 2 {
            t = t[1..t.len() - 1].trim();
        }
        for (a, b) in [('"', '"'), ('“', '”'), ('\'', '\''), ('`', '`')] {
            if t.len() >= 2 && t.starts_with(a) && t.ends_with(b) {
                t = t[a.len_utf8()..t.len() - b.len_utf8()].trim();
            }
        }
        if t == before {
            break;
        }
    }
    let marker = list_marker_len(t);
    t[marker..].split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Parses `Question: … Answer: … Evidence: …` (the paper's format, with or without blank lines,
/// `**Question:**` markdown, leading numbering, content on the next line). Question and answer may
/// continue over following lines up to a blank line or the next label; the evidence is one line.
/// Only the first triple counts. `None` when a field is missing, out of order, empty or still the
/// template placeholder.
pub fn parse_qa(output: &str) -> Option<(String, String, String)> {
    let mut q: Option<String> = None;
    let mut a: Option<String> = None;
    let mut e: Option<String> = None;
    let mut current: Option<Label> = None;
    for raw in output.split('\n') {
        if let Some((label, rest)) = label_of(raw) {
            match label {
                Label::Question if a.is_none() => q = Some(rest.to_string()),
                Label::Answer if q.is_some() && a.is_none() => a = Some(rest.to_string()),
                Label::Evidence if a.is_some() => e = Some(rest.to_string()),
                _ => break,
            }
            current = Some(label);
            if label == Label::Evidence && !rest.is_empty() {
                break;
            }
            continue;
        }
        let line = raw.trim();
        let field = match current {
            Some(Label::Question) => q.as_mut(),
            Some(Label::Answer) => a.as_mut(),
            Some(Label::Evidence) => e.as_mut(),
            None => None,
        };
        let Some(field) = field else { continue };
        if line.is_empty() {
            // A blank line ends a field that has content; an empty field may still get its
            // content on a later line.
            if !field.trim().is_empty() {
                current = None;
            }
            continue;
        }
        if !field.is_empty() {
            field.push(' ');
        }
        field.push_str(line);
        if current == Some(Label::Evidence) {
            break;
        }
    }
    let (q, a, e) = (clean_field(&q?), clean_field(&a?), clean_field(&e?));
    let placeholder = |s: &str, p: &str| s.eq_ignore_ascii_case(p) || s.is_empty();
    if placeholder(&q, "question") || placeholder(&a, "answer") || placeholder(&e, "evidence") {
        return None;
    }
    Some((q, a, e))
}

// ---------------------------------------------------------------------------------------------
// Locating evidence
// ---------------------------------------------------------------------------------------------

const QUOTES: &[char] = &['"', '\'', '“', '”', '‘', '’', '`', '«', '»'];

/// All matches of `evidence` in `doc` (verbatim after trimming quotes/whitespace, tolerating only
/// differences in runs of whitespace), starting and ending on word boundaries.
fn find_all(doc: &str, evidence: &str, limit: usize) -> Vec<(usize, usize)> {
    let e = evidence.trim().trim_matches(|c: char| c.is_whitespace() || QUOTES.contains(&c));
    let words: Vec<&str> = e.split_whitespace().collect();
    let Some(first) = words.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let is_word = |c: char| c.is_alphanumeric();
    for (start, _) in doc.match_indices(first) {
        if out.len() >= limit {
            break;
        }
        if first.starts_with(is_word) && doc[..start].chars().next_back().is_some_and(is_word) {
            continue;
        }
        let mut pos = start + first.len();
        let mut ok = true;
        for w in &words[1..] {
            let rest = &doc[pos..];
            let trimmed = rest.trim_start();
            if trimmed.len() == rest.len() || !trimmed.starts_with(w) {
                ok = false;
                break;
            }
            pos += rest.len() - trimmed.len() + w.len();
        }
        if !ok {
            continue;
        }
        let last = words[words.len() - 1];
        if last.ends_with(is_word) && doc[pos..].chars().next().is_some_and(is_word) {
            continue;
        }
        out.push((start, pos));
    }
    out
}

/// Byte span of `evidence` in `doc`: verbatim (after trimming quotes/whitespace; only runs of
/// whitespace may differ), on word boundaries; `None` when it does not occur.
pub fn locate_evidence(doc: &str, evidence: &str) -> Option<(usize, usize)> {
    locate_evidence_near(doc, evidence, None)
}

/// Like [`locate_evidence`], preferring an occurrence inside `prefer` (a byte range), and
/// accepting the evidence without a final `.`/`!`/`?` the document lacks.
pub fn locate_evidence_near(doc: &str, evidence: &str, prefer: Option<(usize, usize)>) -> Option<(usize, usize)> {
    let pick = |hits: Vec<(usize, usize)>| -> Option<(usize, usize)> {
        prefer
            .and_then(|(ps, pe)| hits.iter().copied().find(|&(s, e)| s >= ps && e <= pe))
            .or_else(|| hits.first().copied())
    };
    if let Some(hit) = pick(find_all(doc, evidence, 64)) {
        return Some(hit);
    }
    let trimmed = evidence.trim().trim_end_matches(|c: char| c.is_whitespace() || QUOTES.contains(&c));
    let stripped = trimmed.trim_end_matches(['.', '!', '?']);
    if stripped.len() < trimmed.len() && !stripped.trim().is_empty() {
        return pick(find_all(doc, stripped, 64));
    }
    None
}

// ---------------------------------------------------------------------------------------------
// Words, normalisation, deduplication
// ---------------------------------------------------------------------------------------------

const STOPWORDS: &[&str] = &[
    "a", "an", "the", "and", "or", "but", "nor", "so", "yet", "of", "in", "on", "at", "to", "for", "from", "by",
    "with", "about", "as", "into", "onto", "over", "under", "after", "before", "during", "since", "until", "than",
    "that", "this", "these", "those", "there", "here", "it", "its", "he", "she", "they", "them", "his", "her", "their",
    "we", "our", "us", "you", "your", "i", "me", "my", "mine", "is", "are", "was", "were", "be", "been", "being", "am",
    "do", "does", "did", "has", "have", "had", "will", "would", "can", "could", "should", "shall", "may", "might",
    "must", "not", "no", "yes", "if", "then", "when", "where", "which", "who", "whom", "whose", "what", "why", "how",
    "all", "any", "each", "every", "some", "such", "also", "very", "just", "only", "too", "one", "both", "either",
    "neither", "while", "because", "although", "though", "however", "thus", "hence", "according", "document", "text",
    "up", "out", "off", "again", "more", "most", "other", "own", "same", "per", "via", "between", "through", "across",
    "against", "among", "within", "without", "near", "upon", "toward", "towards", "like", "unlike", "once", "now",
    "still", "even", "ever", "never", "always", "often", "many", "much",
];

fn is_stopword(w: &str) -> bool {
    STOPWORDS.contains(&w.to_lowercase().as_str())
}

/// Lower-case alphanumeric tokens.
fn tokens(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric()).filter(|t| !t.is_empty()).map(|t| t.to_lowercase()).collect()
}

fn content_tokens(s: &str) -> Vec<String> {
    tokens(s).into_iter().filter(|t| !is_stopword(t)).collect()
}

/// Normalised question text for deduplication.
pub fn normalize_question(q: &str) -> String {
    tokens(q).join(" ")
}

fn first_char_upper(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

fn squeeze(s: &str) -> String {
    let joined = s.split_whitespace().collect::<Vec<_>>().join(" ");
    joined.replace(" ,", ",").replace(" .", ".").replace(" ;", ";").replace(" :", ":").replace(" ?", "?")
}

/// Removes final sentence punctuation (and closers after it).
fn strip_final(s: &str) -> &str {
    s.trim().trim_end_matches(['.', '!', '?', ';', ':', ',', '…', '"', '”', '’', ')']).trim_end()
}

// ---------------------------------------------------------------------------------------------
// Model generation
// ---------------------------------------------------------------------------------------------

/// Sentence windows `[s0, s1)` for `count` pairs, centred on evenly spaced chunks of the document.
fn spread_windows(n: usize, window: usize, count: usize) -> Vec<(usize, usize)> {
    let window = window.max(1);
    if n == 0 || count == 0 {
        return Vec::new();
    }
    if n <= window {
        return vec![(0, n); count];
    }
    (0..count)
        .map(|i| {
            let centre = (i as f64 + 0.5) * n as f64 / count as f64;
            let s0 = (centre - window as f64 / 2.0).round().max(0.0) as usize;
            let s0 = s0.min(n - window);
            (s0, s0 + window)
        })
        .collect()
}

fn mix_seed(seed: u64, a: u64, b: u64) -> u64 {
    let mut x = seed ^ a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x
}

enum Verdict {
    Valid(QaPair),
    Parse,
    Evidence,
    Answer,
}

/// The first sentence of `text` when more follows it.
fn first_sentence(text: &str) -> Option<String> {
    let spans = split_sentences(text);
    (spans.len() > 1).then(|| spans[0].text(text).to_string())
}

/// Drops a meta preamble the model repeats before the real question ("What is the answer to the
/// question: Who built it?" → "Who built it?").
fn clean_question(q: &str) -> String {
    if let Some(pos) = q.rfind(':') {
        let tail = q[pos + 1..].trim();
        if tail.ends_with('?') && tail.split_whitespace().count() >= 3 && q[..pos].to_lowercase().contains("question") {
            return tail.to_string();
        }
    }
    q.to_string()
}

/// Locates the evidence; when the whole is not verbatim, keeps the longest run of its sentences
/// that are verbatim and adjacent in the document (models often quote faithfully, then drift).
fn locate_evidence_sentences(doc: &str, evidence: &str, window: (usize, usize)) -> Option<(usize, usize)> {
    if let Some(hit) = locate_evidence_near(doc, evidence, Some(window)) {
        return Some(hit);
    }
    let spans = split_sentences(evidence);
    if spans.len() < 2 {
        return None;
    }
    let hits: Vec<Option<(usize, usize)>> =
        spans.iter().map(|s| locate_evidence_near(doc, s.text(evidence), Some(window))).collect();
    let mut best: Option<(usize, usize)> = None;
    let mut i = 0;
    while i < hits.len() {
        let Some(mut run) = hits[i] else {
            i += 1;
            continue;
        };
        let mut j = i + 1;
        while let Some(Some(next)) = hits.get(j) {
            if next.0 < run.1 || !doc[run.1..next.0].trim().is_empty() {
                break;
            }
            run.1 = next.1;
            j += 1;
        }
        if best.is_none_or(|b| run.1 - run.0 > b.1 - b.0) {
            best = Some(run);
        }
        i = j;
    }
    best
}

/// Checks one model output against the document and the window it was shown.
fn validate_model_output(doc: &str, window: (usize, usize), output: &str) -> Verdict {
    let Some((q, a, e)) = parse_qa(output) else {
        return Verdict::Parse;
    };
    let q = clean_question(&q);
    let q_words = q.split_whitespace().count();
    if !(3..=60).contains(&q_words) || !q.chars().any(char::is_alphabetic) {
        return Verdict::Parse;
    }
    let Some((s, t)) = locate_evidence_sentences(doc, &e, window) else {
        return Verdict::Evidence;
    };
    let evidence = &doc[s..t];
    if evidence.split_whitespace().count() < 3 {
        return Verdict::Evidence;
    }
    // The answer must be short enough, grounded in the window/evidence (every name and number
    // in it, and most other words), and not given away by the question.
    let a_content = content_tokens(&a);
    if a.split_whitespace().count() > 40 || a_content.is_empty() {
        return Verdict::Answer;
    }
    let window_tokens: HashSet<String> = tokens(&doc[window.0..window.1]).into_iter().chain(tokens(evidence)).collect();
    let ev_tokens: HashSet<String> = tokens(evidence).into_iter().collect();
    let grounded = a_content.iter().filter(|t| window_tokens.contains(*t)).count();
    let names_grounded = a
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| w.chars().next().is_some_and(|c| c.is_uppercase() || c.is_ascii_digit()) && !is_stopword(w))
        .all(|w| window_tokens.contains(&w.to_lowercase()));
    if grounded * 4 < a_content.len() * 3 || !names_grounded || !a_content.iter().any(|t| ev_tokens.contains(t)) {
        return Verdict::Answer;
    }
    let q_tokens: HashSet<String> = tokens(&q).into_iter().collect();
    if a_content.iter().all(|t| q_tokens.contains(t)) {
        return Verdict::Answer;
    }
    let question = if q.ends_with('?') { q } else { format!("{}?", strip_final(&q)) };
    Verdict::Valid(QaPair {
        question,
        answer: a,
        evidence: evidence.to_string(),
        evidence_span: (s, t),
        source: QaSource::Model,
    })
}

/// Generates auxiliary QA pairs for `doc`: model pairs from windows spread over the whole document
/// plus extractive pairs (see the module docs). `progress` is called as model windows finish;
/// `cancel` is polled between and during generations (an `Err` wrapping [`Cancelled`] results).
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
    let sentences = split_sentences(doc);
    let mut stats = QaStats { sentences: sentences.len(), ..Default::default() };
    let max_pairs = opts.max_pairs.max(1);
    let target = if opts.use_model && !sentences.is_empty() {
        sentences.len().div_ceil(opts.sentences_per_pair.max(1)).min(max_pairs)
    } else {
        0
    };
    let windows = spread_windows(sentences.len(), opts.window_sentences, target);
    stats.windows = windows.len();
    let mut model_pairs: Vec<QaPair> = Vec::new();
    let mut seen_q: HashSet<String> = HashSet::new();
    let mut seen_ae: HashSet<(String, (usize, usize))> = HashSet::new();
    let mut prog = QaProgress { done: 0, total: windows.len(), valid: 0 };
    progress(&prog);
    let t0 = Instant::now();
    let mut seen_windows: HashSet<(usize, usize)> = HashSet::new();
    for (wi, &(s0, s1)) in windows.iter().enumerate() {
        if cancel() {
            return Err(super::Cancelled("QA generation").into());
        }
        if stats.model_gave_up {
            break;
        }
        let span = (sentences[s0].start, sentences[s1 - 1].end);
        let repeated = !seen_windows.insert((s0, s1));
        let valid = generate_for_window(model, doc, span, wi, repeated, opts, cancel, &mut stats, &mut |pair| {
            let qn = normalize_question(&pair.question);
            let ae = (normalize_question(&pair.answer), pair.evidence_span);
            if seen_q.contains(&qn) || seen_ae.contains(&ae) {
                return false;
            }
            seen_q.insert(qn);
            seen_ae.insert(ae);
            model_pairs.push(pair);
            true
        })?;
        if valid {
            stats.model_valid += 1;
        }
        prog.done = wi + 1;
        prog.valid = stats.model_valid;
        progress(&prog);
        let tried = wi + 1;
        if tried >= GIVE_UP_AFTER_WINDOWS && stats.model_valid * 10 < tried && tried < windows.len() {
            tracing::warn!(
                windows = tried,
                valid = stats.model_valid,
                "the model rarely produces valid QA pairs; the extractive generator fills in"
            );
            stats.model_gave_up = true;
        }
    }
    if prog.done < prog.total {
        prog.done = prog.total;
        progress(&prog);
    }
    stats.model_seconds = t0.elapsed().as_secs_f64();

    // Extractive pairs: everything the rules find, minus questions the model already asked, thinned
    // evenly to the remaining budget.
    let budget = max_pairs.saturating_sub(model_pairs.len());
    let cands: Vec<Candidate> = extractive_candidates(doc, &sentences, opts)
        .into_iter()
        .filter(|c| !seen_q.contains(&normalize_question(&c.pair.question)))
        .collect();
    stats.extractive_candidates = cands.len();
    let mut chosen = select_even(cands, budget);
    stats.extractive = chosen.len();
    for c in &chosen {
        seen_q.insert(normalize_question(&c.pair.question));
    }
    // Never train without QA: plain cloze questions when facts were too scarce.
    let have = model_pairs.len() + chosen.len();
    let floor = opts.min_pairs.min(max_pairs);
    if have < floor {
        let extra: Vec<Candidate> = fallback_candidates(doc, &sentences)
            .into_iter()
            .filter(|c| !seen_q.contains(&normalize_question(&c.pair.question)))
            .collect();
        let extra = select_even(extra, floor - have);
        stats.fallback = extra.len();
        chosen.extend(extra);
    }
    let mut all: Vec<(usize, usize, QaPair)> = model_pairs.into_iter().map(|p| (p.evidence_span.0, 0, p)).collect();
    all.extend(chosen.into_iter().map(|c| (c.pair.evidence_span.0, 1 + c.rank, c.pair)));
    all.sort_by_key(|&(pos, rank, _)| (pos, rank));
    let pairs: Vec<QaPair> = all.into_iter().map(|(_, _, p)| p).collect();
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

/// Runs the attempts for one window until a valid, new pair is accepted by `accept`.
///
/// The paper's prompt is used unchanged; the reply is scaffolded in its own format: the model
/// writes the question after `Question:`, then `Answer:` and `Evidence:` are appended for it and
/// it writes each field up to the end of its line. Small models otherwise drift (a 135M model
/// rarely wrote an `Evidence:` line unprompted).
#[allow(clippy::too_many_arguments)]
fn generate_for_window(
    model: &Model,
    doc: &str,
    span: (usize, usize),
    wi: usize,
    repeated: bool,
    opts: &QaOptions,
    cancel: &dyn Fn() -> bool,
    stats: &mut QaStats,
    accept: &mut dyn FnMut(QaPair) -> bool,
) -> Result<bool> {
    let messages = [
        ChatMessage::new("system", super::prompt::SYSTEM_PROMPT),
        ChatMessage::new("user", qa_prompt(&model.tokenizer.escape_specials(&doc[span.0..span.1]))),
    ];
    let prompt_text = model.chat_template.render(&messages, true)?;
    let add_bos = model.tokenizer.bos_token().is_some_and(|(bos, _)| !prompt_text.starts_with(&bos));
    let encode = |assistant: &str| model.tokenizer.encode(&format!("{prompt_text}{assistant}"), add_bos);
    let prompt_ids = encode("")?;
    let max_pos = model.config().max_position_embeddings;
    let max_new = opts.max_new_tokens.max(8);
    if prompt_ids.len() < 2 || prompt_ids.len() + 2 * max_new + 16 > max_pos {
        tracing::debug!(tokens = prompt_ids.len(), "QA window prompt too long for the model; skipped");
        stats.rejected_parse += 1;
        return Ok(false);
    }
    // The prompt is prefilled once; attempts continue from copies of its cache.
    let base_ids = &prompt_ids[..prompt_ids.len() - 1];
    let mut base = KvCache::new(model.config().num_layers);
    prefill(model, base_ids, &mut base, None, &mut NoHooks)?;
    // (label written for the model, then the field it writes, with its token budget)
    let fields: [(&str, usize); 3] =
        [("Question:", max_new / 2), ("\n\nAnswer:", max_new / 2), ("\n\nEvidence:", max_new)];
    for attempt in 0..1 + opts.retries {
        if cancel() {
            return Err(super::Cancelled("QA generation").into());
        }
        // A window seen before starts with sampling (greedy would repeat the same pair).
        let sampled = attempt > 0 || repeated;
        let mut cache = base.fork()?;
        let mut fed: Vec<u32> = base_ids.to_vec();
        let mut reply = String::new();
        let mut complete = true;
        for (fi, &(label, budget)) in fields.iter().enumerate() {
            reply.push_str(label);
            let ids = encode(&reply)?;
            // Reuse the cached prefix; feed the rest (at least one token).
            let mut keep = fed.iter().zip(&ids).take_while(|(a, b)| a == b).count();
            if keep >= ids.len() {
                keep = ids.len() - 1;
            }
            cache.truncate(keep);
            fed.truncate(keep);
            let params = SamplingParams {
                max_tokens: budget,
                temperature: if sampled { RETRY_TEMPERATURE } else { 0.0 },
                top_p: if sampled { RETRY_TOP_P } else { 1.0 },
                seed: mix_seed(opts.seed, wi as u64 + 1, (attempt * 4 + fi) as u64 + 1),
                stop: Vec::new(),
            };
            let mut text = String::new();
            let mut cancelled = false;
            let out = generate(model, &ids[keep..], &mut cache, None, &mut NoHooks, &params, &mut |piece| {
                text.push_str(piece);
                if cancel() {
                    cancelled = true;
                    return false;
                }
                // The field ends with its line.
                !text.trim_start().contains('\n')
            })?;
            stats.generated_tokens += out.tokens.len();
            if cancelled {
                return Err(super::Cancelled("QA generation").into());
            }
            let forwarded = cache.len().saturating_sub(ids.len());
            fed.extend_from_slice(&ids[keep..]);
            fed.extend_from_slice(&out.tokens[..forwarded.min(out.tokens.len())]);
            let mut field = out.text.trim_start().split('\n').next().unwrap_or("").trim().to_string();
            // A question must be one, and question and answer must end within their budget (an
            // answer cut off after its first sentence keeps that sentence).
            let truncated = out.finish_reason == FinishReason::Length && !out.text.trim_start().contains('\n');
            if truncated && fi == 1 {
                field = first_sentence(&field).unwrap_or_default();
            }
            if field.is_empty() || (fi == 0 && !field.contains('?')) || (fi == 0 && truncated) {
                tracing::trace!(window = wi, attempt, reply = %format!("{reply} {field}"), "QA attempt abandoned");
                complete = false;
                break;
            }
            reply.push(' ');
            reply.push_str(&field);
        }
        stats.attempts += 1;
        if !complete {
            stats.rejected_parse += 1;
            continue;
        }
        match validate_model_output(doc, span, &reply) {
            Verdict::Valid(pair) => {
                tracing::debug!(window = wi, attempt, question = %pair.question, answer = %pair.answer, "model QA pair");
                if accept(pair) {
                    return Ok(true);
                }
                stats.rejected_duplicate += 1;
            }
            Verdict::Parse => stats.rejected_parse += 1,
            Verdict::Evidence => stats.rejected_evidence += 1,
            Verdict::Answer => stats.rejected_answer += 1,
        }
        tracing::trace!(window = wi, attempt, reply = %reply, "QA attempt rejected");
    }
    Ok(false)
}

// ---------------------------------------------------------------------------------------------
// Extractive generation
// ---------------------------------------------------------------------------------------------

/// One extractive pair with its wording rank (0 = the most direct question for the fact) and the
/// index of its fact in document order.
#[derive(Clone, Debug)]
struct Candidate {
    rank: usize,
    fact: usize,
    pair: QaPair,
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

/// Deterministic rule-based QA over the document's fact-bearing sentences (no model): for each
/// fact, up to `wordings_per_fact` differently-worded questions with short and full-sentence
/// answers; capped by `max_pairs` with even coverage, topped up with plain cloze questions to
/// `min_pairs` when facts are scarce.
pub fn extractive_qa(doc: &str, sentences: &[Span], opts: &QaOptions) -> Vec<QaPair> {
    let max_pairs = opts.max_pairs.max(1);
    let mut chosen = select_even(extractive_candidates(doc, sentences, opts), max_pairs);
    let floor = opts.min_pairs.min(max_pairs);
    if chosen.len() < floor {
        let seen: HashSet<String> = chosen.iter().map(|c| normalize_question(&c.pair.question)).collect();
        let extra: Vec<Candidate> = fallback_candidates(doc, sentences)
            .into_iter()
            .filter(|c| !seen.contains(&normalize_question(&c.pair.question)))
            .collect();
        chosen.extend(select_even(extra, floor - chosen.len()));
    }
    chosen.sort_by_key(|c| (c.pair.evidence_span.0, c.rank));
    chosen.into_iter().map(|c| c.pair).collect()
}

#[derive(Clone, Debug)]
struct Word<'a> {
    /// Byte range of the whole whitespace-delimited token within the body.
    raw: (usize, usize),
    /// Byte range of the token without surrounding punctuation.
    core: (usize, usize),
    text: &'a str,
}

impl Word<'_> {
    fn lower(&self) -> String {
        self.text.to_lowercase()
    }
    fn capitalised(&self) -> bool {
        self.text.chars().next().is_some_and(char::is_uppercase)
    }
    fn starts_lower(&self) -> bool {
        self.text.chars().next().is_some_and(char::is_lowercase)
    }
    fn has_digit(&self) -> bool {
        self.text.chars().any(|c| c.is_ascii_digit())
    }
}

fn words_of(body: &str) -> Vec<Word<'_>> {
    let mut out = Vec::new();
    let mut i = 0;
    for tok in body.split_whitespace() {
        let start = i + body[i..].find(tok).unwrap_or(0);
        let end = start + tok.len();
        i = end;
        let lead = tok.len()
            - tok.trim_start_matches(|c: char| !c.is_alphanumeric() && c != '$' && c != '£' && c != '€').len();
        let inner = &tok[lead..];
        let mut core = inner.trim_end_matches(|c: char| !c.is_alphanumeric() && c != '%');
        // Possessive 's is not part of the word.
        for suffix in ["'s", "’s"] {
            if let Some(c) = core.strip_suffix(suffix) {
                core = c;
            }
        }
        // Dotted abbreviations keep their final dot ("p.m.", "U.S.").
        let cs = start + lead;
        let mut ce = cs + core.len();
        if core.contains('.') && body[ce..end].starts_with('.') {
            ce += 1;
        }
        if core.is_empty() {
            out.push(Word { raw: (start, end), core: (start, start), text: "" });
        } else {
            out.push(Word { raw: (start, end), core: (cs, ce), text: &body[cs..ce] });
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Number,
    /// A number followed by the noun it counts ("42 rooms"); `noun` is that word's index.
    Count {
        noun: usize,
    },
    Year,
    Date,
    Time,
    Person,
    Place,
    /// A name of something else; `head` is the index of a generic head noun ("Company") if any.
    Thing {
        head: Option<usize>,
    },
    Quote,
    /// An identifier mixing letters and digits ("LKN-7", "A4").
    Code,
    /// A short descriptive predicate ("a small fishing town").
    Phrase,
}

#[derive(Clone, Debug)]
struct Entity {
    /// Byte range in the body (the answer text).
    s: usize,
    e: usize,
    /// Word range `[w0, w1)`.
    w0: usize,
    w1: usize,
    kind: Kind,
    /// Preposition word right before the entity.
    prep: Option<usize>,
}

const MONTHS: &[&str] = &[
    "january", "february", "march", "april", "may", "june", "july", "august", "september", "october", "november",
    "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec",
];
const NUMBER_WORDS: &[&str] = &[
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen",
    "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty", "thirty", "forty", "fifty", "sixty",
    "seventy", "eighty", "ninety", "hundred", "thousand", "dozen", "dozens", "hundreds", "thousands", "millions",
];
const WEEKDAYS: &[&str] = &["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"];
const TITLES: &[&str] = &[
    "mr", "mrs", "ms", "miss", "dr", "prof", "professor", "sir", "dame", "lady", "lord", "king", "queen", "prince",
    "princess", "captain", "capt", "general", "gen", "colonel", "col", "lieutenant", "lt", "sergeant", "sgt", "judge",
    "president", "senator", "governor", "mayor", "father", "mother", "sister", "brother", "uncle", "aunt", "saint",
    "st", "rev", "reverend", "bishop", "detective", "inspector", "officer", "agent", "chief", "director", "doctor",
];
const PLACE_HEADS: &[&str] = &[
    "city", "town", "village", "county", "state", "province", "country", "republic", "kingdom", "island", "islands",
    "river", "lake", "sea", "ocean", "mountain", "mountains", "mount", "valley", "bay", "coast", "street", "road",
    "avenue", "square", "park", "bridge", "station", "airport", "harbor", "harbour", "port", "district", "region",
    "hall", "tower", "castle", "palace", "church", "cathedral", "museum", "library", "hotel", "office", "building",
    "house", "center", "centre", "hospital", "forest", "desert", "peninsula", "canal", "gate", "plaza", "market",
];
const ORG_HEADS: &[&str] = &[
    "company", "corporation", "corp", "inc", "ltd", "llc", "group", "bank", "university", "college", "school",
    "institute", "academy", "council", "committee", "department", "ministry", "agency", "association", "society",
    "foundation", "party", "club", "team", "army", "navy", "fund", "trust", "press", "times", "journal", "project",
    "program", "programme", "prize", "award", "act", "treaty", "war", "festival", "conference", "union", "league",
];
const CONNECTORS: &[&str] =
    &["of", "de", "da", "del", "della", "di", "du", "van", "von", "der", "den", "la", "le", "y", "bin", "al"];
const PREPOSITIONS: &[&str] = &[
    "in", "on", "at", "by", "from", "to", "into", "near", "during", "since", "until", "before", "after", "with", "for",
    "of", "about", "across", "through", "toward", "towards", "inside", "outside", "behind", "beside", "under", "over",
    "between", "among", "around", "past", "above", "below", "beneath", "along", "beyond", "opposite", "off", "outside",
    "throughout", "within", "without", "against", "upon", "via", "like", "than",
];
const COPULAS: &[&str] = &["is", "are", "was", "were"];
const AUXILIARIES: &[&str] = &["is", "are", "was", "were", "has", "have", "had", "will", "would", "can", "could"];
const PRONOUN_SUBJECTS: &[&str] = &[
    "it", "this", "that", "there", "he", "she", "they", "these", "those", "we", "i", "you", "here", "which", "who",
    "what", "one", "all", "some", "each", "both",
];
const NAMING_VERBS: &[&str] = &["named", "called", "titled", "entitled", "nicknamed", "dubbed", "known"];
const IRREGULAR_PARTICIPLES: &[&str] = &[
    "born", "held", "built", "made", "known", "given", "taken", "written", "found", "seen", "sold", "paid", "kept",
    "left", "sent", "told", "begun", "chosen", "done", "drawn", "driven", "fallen", "grown", "hidden", "led", "lost",
    "meant", "met", "put", "read", "set", "shown", "shut", "spent", "stolen", "struck", "thrown", "understood", "won",
    "worn", "bought", "brought", "caught", "taught", "thought", "sung", "run", "hung", "laid", "lit", "sold", "cast",
    "sworn", "torn", "woven", "frozen", "spoken", "broken", "forgotten", "risen", "beaten", "bitten", "eaten",
    "ridden", "shaken", "sunk", "drunk", "rung", "dug", "fed", "bred", "bent", "lent", "dealt", "swept", "bound",
];
const ADVERBS: &[&str] = &[
    "first", "later", "originally", "also", "once", "still", "then", "now", "formally", "officially", "finally",
    "recently",
];

fn is_participle(w: &str) -> bool {
    let l = w.to_lowercase();
    (l.len() > 4 && l.ends_with("ed")) || IRREGULAR_PARTICIPLES.contains(&l.as_str())
}

/// Letters and digits mixed, other than ordinals and decades ("2nd", "1990s").
fn is_code(w: &str) -> bool {
    let digits = w.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let suffix = &w[digits.len()..];
    let ordinal = digits.chars().all(|c| c.is_ascii_digit()) && matches!(suffix, "st" | "nd" | "rd" | "th" | "s");
    w.chars().any(|c| c.is_alphabetic()) && !ordinal
}

fn is_year(w: &str) -> bool {
    let t = w.strip_suffix('s').unwrap_or(w);
    t.len() == 4 && t.chars().all(|c| c.is_ascii_digit()) && (1000..=2199).contains(&t.parse::<u32>().unwrap_or(0))
}

fn is_day(w: &str) -> bool {
    let t = w.trim_end_matches(|c: char| c.is_alphabetic());
    !t.is_empty()
        && t.len() <= 2
        && t.chars().all(|c| c.is_ascii_digit())
        && (1..=31).contains(&t.parse::<u32>().unwrap_or(0))
}

fn is_time(w: &str) -> bool {
    let mut parts = w.split(':');
    matches!((parts.next(), parts.next()), (Some(h), Some(m)) if !h.is_empty() && h.len() <= 2 && m.len() == 2
        && h.chars().all(|c| c.is_ascii_digit()) && m.chars().all(|c| c.is_ascii_digit()))
}

/// Per-document knowledge used by the rules: capitalised words seen in mid-sentence (so a
/// sentence-initial capitalised word is a name only if it is also capitalised elsewhere).
struct Lexicon {
    proper: HashSet<String>,
    /// Words seen in two-word capitalised names or after a kinship word ("Thomas Reed", "his
    /// sister Margaret"): alone later, they still name a person.
    person_like: HashSet<String>,
}

impl Lexicon {
    /// Words capitalised in mid-sentence more often than they appear in lower case, counted
    /// over prose sentences only (title-case headings would make every word a name).
    fn new(doc: &str, sentences: &[Span]) -> Self {
        let mut capitalised: HashMap<&str, usize> = HashMap::new();
        let mut lower: HashMap<String, usize> = HashMap::new();
        let mut person_like = HashSet::new();
        let head = |w: &str| {
            let l = w.to_lowercase();
            ORG_HEADS.contains(&l.as_str()) || PLACE_HEADS.contains(&l.as_str()) || is_stopword(&l) || is_title(&l)
        };
        for span in sentences {
            let Some(s) = Sent::new(doc, span) else {
                continue;
            };
            for (i, w) in s.words.iter().enumerate() {
                if w.capitalised() && !head(w.text) && w.text.chars().any(char::is_lowercase) {
                    let prev = i.checked_sub(1).map(|p| s.words[p].lower());
                    if prev.as_deref().is_some_and(|p| KINSHIP.contains(&p.trim_end_matches('.'))) {
                        person_like.insert(w.text.to_string());
                    }
                    if let Some(next) = s.words.get(i + 1) {
                        let pair = next.capitalised()
                            && !head(next.text)
                            && next.text.chars().any(char::is_lowercase)
                            && !s.breaks_after(i)
                            && prev.as_deref() != Some("the")
                            && s.words.get(i + 2).is_none_or(|w3| !w3.capitalised());
                        if pair {
                            person_like.insert(w.text.to_string());
                            person_like.insert(next.text.to_string());
                        }
                    }
                }
                if w.starts_lower() {
                    *lower.entry(w.text.to_string()).or_default() += 1;
                    continue;
                }
                if i == 0 || !w.capitalised() || is_stopword(w.text) {
                    continue;
                }
                let prev = &s.words[i - 1];
                let prev_raw = &s.body[prev.raw.0..prev.raw.1];
                if !prev_raw.ends_with(['.', ':', '!', '?', '"', '“']) {
                    *capitalised.entry(w.text).or_default() += 1;
                }
            }
        }
        let proper = capitalised
            .into_iter()
            .filter(|(w, n)| *n > lower.get(&w.to_lowercase()).copied().unwrap_or(0))
            .map(|(w, _)| w.to_string())
            .collect();
        Self { proper, person_like }
    }
}

/// A sentence prepared for the rules: body (list marker dropped), its words and doc offset.
struct Sent<'a> {
    body: &'a str,
    offset: usize,
    words: Vec<Word<'a>>,
}

impl<'a> Sent<'a> {
    fn new(doc: &'a str, span: &Span) -> Option<Self> {
        let text = span.text(doc);
        let marker = list_marker_len(text);
        let text2 = &text[marker..];
        let hashes = text2.len() - text2.trim_start_matches(['#', '>']).trim_start().len();
        let lead = marker + hashes;
        let body = &text[lead..];
        let words = words_of(body);
        let n_alpha = words.iter().filter(|w| w.text.chars().any(char::is_alphabetic)).count();
        let punct = strip_final(body).len() < body.trim_end().len();
        // Skip headings, fragments, formulas, code and bibliography entries.
        if words.len() < 4 || n_alpha < 3 || (!punct && words.len() < 6) || words.len() > 80 || hashes > 0 {
            return None;
        }
        let markup =
            body.chars().filter(|c| matches!(c, '$' | '\\' | '{' | '}' | '^' | '=' | '|' | '<' | '>' | '~')).count();
        let letters = body.chars().filter(|c| c.is_alphabetic() || c.is_whitespace()).count();
        let initials = words.iter().filter(|w| {
            let raw = &body[w.raw.0..w.raw.1];
            let mut c = raw.chars();
            matches!((c.next(), c.next()), (Some(a), Some('.')) if a.is_uppercase())
        });
        let lower = body.to_lowercase();
        let bibliography =
            ["arxiv", "doi:", "pp.", "proceedings", "isbn"].iter().any(|k| lower.contains(k)) || body.starts_with('*');
        if markup > 0 || letters * 10 < body.chars().count() * 7 || initials.count() >= 3 || bibliography {
            return None;
        }
        Some(Self { body, offset: span.start + lead, words })
    }

    fn text(&self, w0: usize, w1: usize) -> &'a str {
        if w0 >= w1 {
            return "";
        }
        &self.body[self.words[w0].raw.0..self.words[w1 - 1].raw.1]
    }

    /// Text of words `[w0, w1)` without final punctuation.
    fn phrase(&self, w0: usize, w1: usize) -> String {
        strip_final(self.text(w0, w1)).to_string()
    }

    /// Whether the raw token of word `i` ends with punctuation that breaks a name run.
    fn breaks_after(&self, i: usize) -> bool {
        let w = &self.words[i];
        let raw = &self.body[w.raw.0..w.raw.1];
        let after = &raw[w.core.1 - w.raw.0..];
        let after = after.trim_start_matches(['\'', '’']).trim_start_matches('s');
        !(after.is_empty() || (after == "." && is_title(w.text)))
    }

    fn is_possessive(&self, i: usize) -> bool {
        let w = &self.words[i];
        let raw = &self.body[w.raw.0..w.raw.1];
        let after = &raw[w.core.1 - w.raw.0..];
        after.starts_with("'s") || after.starts_with("’s")
    }
}

/// "DON'T", "can't", "We'll" (not "O'Hara").
fn is_contraction(w: &str) -> bool {
    let l = w.to_lowercase().replace('’', "'");
    l.contains('\'')
        && (["n't", "'ll", "'re", "'ve", "'d", "'m"].iter().any(|s| l.ends_with(s))
            || !w.chars().any(char::is_lowercase))
}

const KINSHIP: &[&str] = &[
    "sister", "brother", "wife", "husband", "son", "daughter", "mother", "father", "friend", "colleague", "uncle",
    "aunt", "cousin", "nephew", "niece", "partner", "grandmother", "grandfather", "mr", "mrs", "ms", "dr",
];

fn is_title(w: &str) -> bool {
    TITLES.contains(&w.to_lowercase().trim_end_matches('.'))
}

/// Finds numbers, dates, times, names and quoted strings in a sentence.
fn find_entities(s: &Sent, lex: &Lexicon) -> Vec<Entity> {
    let ws = &s.words;
    let n = ws.len();
    // Words inside brackets (citations, asides, equation numbers) are not asked about.
    let mut used: Vec<bool> = {
        let mut depth = 0i32;
        let mut inside = vec![false; s.body.len() + 1];
        for (i, c) in s.body.char_indices() {
            match c {
                '(' | '[' => depth += 1,
                ')' | ']' => depth = (depth - 1).max(0),
                _ => {}
            }
            inside[i] = depth > 0;
        }
        ws.iter().map(|w| inside[w.core.0]).collect()
    };
    let mut out = Vec::new();
    let prep_before = |i: usize| -> Option<usize> {
        (i > 0 && PREPOSITIONS.contains(&ws[i - 1].lower().as_str()) && !s.breaks_after(i - 1)).then(|| i - 1)
    };
    let push = |out: &mut Vec<Entity>, used: &mut Vec<bool>, w0: usize, w1: usize, kind: Kind| {
        if w0 >= w1 || used[w0..w1].iter().any(|&u| u) {
            return;
        }
        used[w0..w1].iter_mut().for_each(|u| *u = true);
        out.push(Entity { s: ws[w0].core.0, e: ws[w1 - 1].core.1, w0, w1, kind, prep: prep_before(w0) });
    };
    // Quoted strings.
    for (open, close) in [('"', '"'), ('“', '”')] {
        let mut from = 0;
        while let Some(a) = s.body[from..].find(open).map(|p| p + from) {
            let inner_start = a + open.len_utf8();
            let Some(b) = s.body[inner_start..].find(close).map(|p| p + inner_start) else {
                break;
            };
            let inner = s.body[inner_start..b].trim_end_matches([',', '.']);
            let count = inner.split_whitespace().count();
            let w0 = ws.iter().position(|w| w.raw.0 <= inner_start && inner_start < w.raw.1.max(w.raw.0 + 1));
            let w1 = ws.iter().rposition(|w| w.raw.0 < b);
            if let (Some(w0), Some(w1)) = (w0, w1) {
                if (1..=10).contains(&count)
                    && w0 <= w1
                    && !used[w0..=w1].iter().any(|&u| u)
                    && !inner.trim().is_empty()
                {
                    used[w0..=w1].iter_mut().for_each(|u| *u = true);
                    let start = inner_start + (s.body[inner_start..].len() - s.body[inner_start..].trim_start().len());
                    out.push(Entity {
                        s: start,
                        e: inner_start + inner.trim_end().len(),
                        w0,
                        w1: w1 + 1,
                        kind: Kind::Quote,
                        prep: prep_before(w0),
                    });
                }
            }
            from = b + close.len_utf8();
        }
    }
    // Dates: "March 3, 1999", "3 March 1999", "March 1999", "March 3"; weekdays.
    let mut i = 0;
    while i < n {
        let l = ws[i].lower();
        let month = MONTHS.contains(&l.trim_end_matches('.')) && ws[i].capitalised();
        if month {
            let mut w0 = i;
            let mut w1 = i + 1;
            if i > 0 && is_day(ws[i - 1].text) && !s.breaks_after(i - 1) {
                w0 = i - 1;
            }
            if w1 < n && is_day(ws[w1].text) && !s.breaks_after(i) {
                w1 += 1;
            }
            if w1 < n
                && is_year(ws[w1].text)
                && (!s.breaks_after(w1 - 1) || s.body[ws[w1 - 1].raw.0..ws[w1 - 1].raw.1].ends_with(','))
            {
                w1 += 1;
            }
            // "May" alone is a verb more often than not.
            if w1 - w0 > 1 || (l != "may" && l != "march") {
                push(&mut out, &mut used, w0, w1, Kind::Date);
            }
            i = w1;
            continue;
        }
        if WEEKDAYS.contains(&l.as_str()) && ws[i].capitalised() {
            push(&mut out, &mut used, i, i + 1, Kind::Date);
        }
        i += 1;
    }
    // Numbers, years, times; spelled-out numbers when they count something ("four people").
    for i in 0..n {
        if !used[i] && NUMBER_WORDS.contains(&ws[i].lower().as_str()) && i + 1 < n && !s.breaks_after(i) {
            let next = &ws[i + 1];
            if next.starts_lower() && next.text.chars().all(char::is_alphabetic) && !is_stopword(next.text) {
                push(&mut out, &mut used, i, i + 1, Kind::Count { noun: i + 1 });
            }
            continue;
        }
        if used[i] || !ws[i].has_digit() {
            continue;
        }
        let t = ws[i].text;
        if is_time(t) {
            let w1 = if i + 1 < n && matches!(ws[i + 1].lower().as_str(), "a.m." | "p.m." | "a.m" | "p.m" | "am" | "pm")
            {
                i + 2
            } else {
                i + 1
            };
            push(&mut out, &mut used, i, w1, Kind::Time);
        } else if i + 1 < n
            && matches!(ws[i + 1].lower().as_str(), "a.m." | "p.m." | "a.m" | "p.m" | "am" | "pm" | "o'clock")
        {
            push(&mut out, &mut used, i, i + 2, Kind::Time);
        } else if is_year(t) {
            push(&mut out, &mut used, i, i + 1, Kind::Year);
        } else if is_code(t) {
            push(&mut out, &mut used, i, i + 1, Kind::Code);
        } else {
            let mut w1 = i + 1;
            if w1 < n
                && matches!(
                    ws[w1].lower().as_str(),
                    "hundred" | "thousand" | "million" | "billion" | "trillion" | "percent" | "per"
                )
            {
                w1 += if ws[w1].lower() == "per" && w1 + 1 < n { 2 } else { 1 };
            }
            let counted = w1 < n
                && !s.breaks_after(w1 - 1)
                && ws[w1].starts_lower()
                && ws[w1].text.chars().all(char::is_alphabetic)
                && !is_stopword(ws[w1].text)
                && !t.contains(['%', '$', '£', '€']);
            let kind = if counted { Kind::Count { noun: w1 } } else { Kind::Number };
            push(&mut out, &mut used, i, w1, kind);
        }
    }
    // Capitalised names (runs, with connectors inside: "Bank of England").
    let mut i = 0;
    while i < n {
        let cap = |j: usize| -> bool {
            let w = &ws[j];
            !used[j]
                && w.capitalised()
                && w.text.chars().any(char::is_alphabetic)
                && w.text != "I"
                && !is_contraction(w.text)
                && !MONTHS.contains(&w.lower().as_str())
                && !WEEKDAYS.contains(&w.lower().as_str())
        };
        if !cap(i) || (is_stopword(ws[i].text) && !is_title(ws[i].text)) {
            i += 1;
            continue;
        }
        let mut j = i + 1;
        while j < n && !s.breaks_after(j - 1) && !s.is_possessive(j - 1) && ws[j].raw.0 == ws[j].core.0 {
            if cap(j) && !is_stopword(ws[j].text) {
                j += 1;
            } else if CONNECTORS.contains(&ws[j].lower().as_str()) && j + 1 < n && cap(j + 1) && !s.breaks_after(j) {
                j += 2;
            } else {
                break;
            }
        }
        let w0 = i;
        let single = j - w0 == 1;
        let at_start = w0 == 0 || s.body[..ws[w0].raw.0].trim_end().ends_with([':', '"', '“', '(']);
        let titled = is_title(ws[w0].text) || (w0 > 0 && is_title(ws[w0 - 1].text));
        let only_title = (w0..j).all(|k| is_title(ws[k].text));
        let known = lex.proper.contains(ws[w0].text) || s.is_possessive(w0) || !single;
        if only_title || (at_start && single && !known) {
            i = j;
            continue;
        }
        let lowers: Vec<String> = (w0..j).map(|k| ws[k].lower()).collect();
        let has = |list: &[&str]| lowers.iter().rposition(|l| list.contains(&l.as_str()));
        let prep = prep_before(w0).map(|p| ws[p].lower());
        let the_before = w0 > 0 && ws[w0 - 1].lower() == "the";
        let kind = if let Some(h) = has(ORG_HEADS) {
            Kind::Thing { head: Some(w0 + h) }
        } else if let Some(h) = has(PLACE_HEADS) {
            if matches!(prep.as_deref(), Some("in" | "at" | "from" | "to" | "near" | "into")) {
                Kind::Place
            } else {
                Kind::Thing { head: Some(w0 + h) }
            }
        } else if titled {
            Kind::Person
        } else if matches!(prep.as_deref(), Some("in" | "at" | "from" | "to" | "near" | "into" | "across" | "through"))
            && !(single && ws[w0].text.chars().all(|c| !c.is_lowercase()))
        {
            Kind::Place
        } else if !the_before
            && ((!single && j - w0 <= 3 && !lowers.iter().any(|l| CONNECTORS.contains(&l.as_str())))
                || (j < n
                    && matches!(
                        ws[j].lower().as_str(),
                        "said"
                            | "says"
                            | "told"
                            | "asked"
                            | "wrote"
                            | "replied"
                            | "explained"
                            | "founded"
                            | "married"
                            | "died"
                    ))
                || (w0..j).all(|k| lex.person_like.contains(ws[k].text)))
        {
            Kind::Person
        } else {
            Kind::Thing { head: None }
        };
        push(&mut out, &mut used, w0, j, kind);
        i = j;
    }
    out.sort_by_key(|e| e.w0);
    out
}

/// The sentence's copula ("X is Y") split: (copula word index) when the subject is a real noun
/// phrase (not a pronoun, no leading preposition, no comma) of at most 12 words.
fn copula_split(s: &Sent) -> Option<usize> {
    let ws = &s.words;
    let c = ws.iter().position(|w| AUXILIARIES.contains(&w.lower().as_str()))?;
    if c == 0 || c > 12 || c + 1 >= ws.len() {
        return None;
    }
    let subj = s.text(0, c);
    if subj.contains([',', ';', ':', '('])
        || ws[..c].iter().any(|w| w.starts_lower() && COMMON_VERBS.contains(&w.lower().as_str()))
    {
        return None; // "The villagers thought the project was …"
    }
    let first = ws[0].lower();
    if (c == 1 && PRONOUN_SUBJECTS.contains(&first.as_str()))
        || PREPOSITIONS.contains(&first.as_str())
        || first == "there"
    {
        return None;
    }
    if ["when", "if", "while", "although", "because", "as", "after", "before", "since", "once"]
        .contains(&first.as_str())
    {
        return None;
    }
    Some(c)
}

/// Lower-cases the first letter of a noun phrase moved into the middle of a question, unless it
/// starts with a name or acronym.
fn decap(phrase: &str, lex: &Lexicon) -> String {
    let first = phrase.split_whitespace().next().unwrap_or("");
    let possessive = first.ends_with("'s") || first.ends_with("’s");
    let core = first.trim_end_matches("'s").trim_end_matches("’s").trim_matches(|c: char| !c.is_alphanumeric());
    let acronym = core.chars().count() > 1 && core.chars().all(|c| !c.is_lowercase());
    let next_capitalised =
        phrase.split_whitespace().nth(1).is_some_and(|w| w.chars().next().is_some_and(char::is_uppercase));
    let inner_caps = core.chars().skip(1).any(char::is_uppercase);
    let name = lex.proper.contains(core) || acronym || inner_caps || is_title(core) || possessive || next_capitalised;
    if is_stopword(core) || !name {
        let mut c = phrase.chars();
        match c.next() {
            Some(f) => f.to_lowercase().chain(c).collect(),
            None => String::new(),
        }
    } else {
        phrase.to_string()
    }
}

const CLAUSE_WORDS: &[&str] =
    &["and", "or", "but", "who", "which", "that", "when", "where", "while", "because", "although", "so"];
const COMMON_VERBS: &[&str] = &[
    "met", "saw", "gave", "became", "won", "led", "left", "wrote", "made", "took", "got", "sold", "bought", "found",
    "built", "told", "said", "went", "came", "ran", "paid", "kept", "held", "sent", "lost", "began", "chose", "drew",
    "drove", "ate", "fell", "flew", "grew", "hid", "knew", "meant", "put", "read", "set", "showed", "spent", "stole",
    "struck", "threw", "understood", "wore", "brought", "caught", "taught", "thought", "sang", "hung", "laid", "lit",
    "joined", "moved", "lives", "lived", "works", "worked", "owns", "owned", "runs", "leads", "holds", "keeps",
    "visited", "married", "remains", "remained", "contains", "contained", "includes", "included", "cost", "costs",
];

/// Whether word `w` looks like a verb (so a phrase may start or end next to it).
fn verbish(w: &Word) -> bool {
    let l = w.lower();
    w.starts_lower() && (AUXILIARIES.contains(&l.as_str()) || is_participle(&l) || COMMON_VERBS.contains(&l.as_str()))
}

/// The entity as a whole phrase: start word (including a determiner before it) when the entity
/// can be replaced or moved without breaking the sentence; `None` when it sits inside a larger
/// noun phrase ("the Lisbon office").
fn constituent(s: &Sent, ent: &Entity) -> Option<usize> {
    let ws = &s.words;
    let n = ws.len();
    let mut cs = ent.w0;
    if cs > 0 && matches!(ws[cs - 1].lower().as_str(), "the" | "a" | "an") && !s.breaks_after(cs - 1) {
        cs -= 1;
    }
    let numeric = matches!(ent.kind, Kind::Number | Kind::Count { .. } | Kind::Year | Kind::Code);
    // A label's number ("Table 9", "Room 12") is part of a name.
    let prev = ent.w0.checked_sub(1).map(|p| &ws[p]);
    if numeric && prev.is_some_and(|p| p.capitalised() && !is_stopword(p.text) && !s.breaks_after(ent.w0 - 1)) {
        return None;
    }
    let start_ok = cs == 0
        || (numeric && cs == ent.w0)
        || s.body[..ws[cs].raw.0].trim_end().ends_with([',', ':', ';', '(', '—', '"', '“'])
        || PREPOSITIONS.contains(&ws[cs - 1].lower().as_str())
        || verbish(&ws[cs - 1]);
    let intro = cs == 0 || s.body[..ws[cs].raw.0].trim_end().ends_with(',');
    let end_ok = ent.w1 == n
        || s.breaks_after(ent.w1 - 1)
        || (intro && ws[ent.w1].starts_lower())
        || matches!(ent.kind, Kind::Count { .. })
        || PREPOSITIONS.contains(&ws[ent.w1].lower().as_str())
        || CLAUSE_WORDS.contains(&ws[ent.w1].lower().as_str())
        || verbish(&ws[ent.w1]);
    (start_ok && end_ok).then_some(cs)
}

/// A wh-phrase standing in for an entity ("which year", "how many", "whom", "which company").
fn wh_phrase(s: &Sent, ent: &Entity, subject: bool) -> String {
    match ent.kind {
        Kind::Number => "what number".to_string(),
        Kind::Count { .. } => "how many".to_string(),
        Kind::Year => "which year".to_string(),
        Kind::Date => "what date".to_string(),
        Kind::Time => "what time".to_string(),
        Kind::Person if subject => "who".to_string(),
        Kind::Person => "whom".to_string(),
        Kind::Place => "which place".to_string(),
        Kind::Thing { head: Some(h) } => format!("which {}", s.words[h].lower()),
        Kind::Thing { head: None } => "what".to_string(),
        Kind::Code => "what code".to_string(),
        Kind::Quote | Kind::Phrase => "what".to_string(),
    }
}

/// Type noun for "Which … is X?" questions ("" when there is none).
fn kind_noun(kind: Kind) -> &'static str {
    match kind {
        Kind::Number | Kind::Count { .. } => "number",
        Kind::Year => "year",
        Kind::Date => "date",
        Kind::Time => "time",
        Kind::Person => "person",
        Kind::Place => "place",
        Kind::Thing { .. } | Kind::Quote => "name",
        Kind::Code => "code",
        Kind::Phrase => "",
    }
}

/// Questions for one fact, most direct first: (question, answer).
struct Fact {
    questions: Vec<(String, String)>,
}

fn question(s: &str) -> String {
    format!("{}?", first_char_upper(&squeeze(strip_final(s))))
}

/// The direct wh-question for an entity, when the sentence's shape allows one.
fn direct_question(
    s: &Sent,
    lex: &Lexicon,
    ent: &Entity,
    copula: Option<usize>,
) -> (Option<String>, Option<String>, Option<String>) {
    let ws = &s.words;
    let n = ws.len();
    let prep_word = ent.prep.map(|p| ws[p].lower());
    let cs = constituent(s, ent);
    let (mut direct, mut typed, mut tense) = (None, None, None);

    if let Some(c) = copula {
        let cop = ws[c].lower();
        let subject = decap(&s.phrase(0, c), lex);
        let mut p0 = c + 1;
        while p0 < n && ADVERBS.contains(&ws[p0].lower().as_str()) {
            p0 += 1;
        }
        let participle = p0 < n && is_participle(ws[p0].text);
        let det = |i: usize| matches!(ws[i].lower().as_str(), "the" | "a" | "an");
        let pred_start = ent.w0 == p0 || (ent.w0 == p0 + 1 && (ent.prep == Some(p0) || det(p0)));
        let is_cop = COPULAS.contains(&cop.as_str());
        // "X is Y, a …": the appositive does not belong in the question.
        let apposed = ent.w1 < n && s.body[ent.e..].starts_with(',');
        if is_cop && pred_start && (ent.w1 == n || apposed) && !participle {
            // "X is Y": What/Who/When/Where is X?
            let wh = match ent.kind {
                Kind::Person => "Who",
                Kind::Year | Kind::Date | Kind::Time => "When",
                Kind::Place => "Where",
                _ if ent.prep == Some(p0) && matches!(prep_word.as_deref(), Some("in" | "at" | "near" | "on")) => {
                    "Where"
                }
                _ => "What",
            };
            direct = Some(format!("{wh} {cop} {subject}?"));
            let noun = kind_noun(ent.kind);
            typed = Some(if noun.is_empty() || ent.prep == Some(p0) {
                format!("What does the document say {subject} {cop}?")
            } else {
                format!("Which {noun} {cop} {subject}?")
            });
            let other = match cop.as_str() {
                "is" => "was",
                "was" => "is",
                "are" => "were",
                _ => "are",
            };
            tense = Some(format!("{wh} {other} {subject}?"));
        } else if ent.w0 > c && cs.is_some() && (!is_cop || participle) {
            // "X was founded in 1998 by Y" → When was X founded by Y? / By whom was X founded in 1998?
            let cs = cs.unwrap_or(ent.w0);
            let with_prep = matches!(ent.prep, Some(p) if p + 1 == cs && p > c);
            let a = if with_prep { cs - 1 } else { cs };
            let b = match ent.kind {
                Kind::Count { noun } if noun == ent.w1 && noun < n => noun + 1,
                _ => ent.w1,
            };
            let wh = match (ent.kind, prep_word.as_deref()) {
                (Kind::Person, Some("by")) if with_prep => "By whom".to_string(),
                (Kind::Year | Kind::Date | Kind::Time, Some("in" | "on" | "at" | "during")) if with_prep => {
                    "When".to_string()
                }
                (Kind::Place, Some("in" | "at" | "near")) if with_prep => "Where".to_string(),
                (Kind::Place, Some("from")) if with_prep => "From where".to_string(),
                (Kind::Place, Some(p)) if with_prep => {
                    format!("{} which place", first_char_upper(p))
                }
                (Kind::Count { noun }, _) if !with_prep => format!("How many {}", ws[noun].lower()),
                (Kind::Person, Some(p)) if with_prep => format!("{} whom", first_char_upper(p)),
                (_, Some(p)) if with_prep => format!("{} what", first_char_upper(p)),
                (Kind::Person, _) => "Who".to_string(),
                _ => "What".to_string(),
            };
            // An appositive after the entity (", a retired sea captain") is dropped.
            let after =
                if b < n && !s.body[ws[ent.w1 - 1].core.1..ws[b].raw.0].contains(',') { s.text(b, n) } else { "" };
            let rest = squeeze(strip_final(&format!("{} {}", s.text(c + 1, a), after)));
            let possession = matches!(cop.as_str(), "has" | "have" | "had") && !participle;
            if possession && !matches!(ent.kind, Kind::Count { .. }) {
                return (None, None, None);
            }
            let (aux, tail) = match cop.as_str() {
                "has" | "have" | "had" if !participle => (
                    if cop == "had" {
                        "did"
                    } else if cop == "has" {
                        "does"
                    } else {
                        "do"
                    }
                    .to_string(),
                    format!("have {rest}"),
                ),
                _ => (cop.clone(), rest),
            };
            if !tail.trim().is_empty() || is_cop {
                direct = Some(question(&format!("{wh} {aux} {subject} {tail}")));
            }
        }
        // Possessive subject: "Anna's favourite colour is green." → Whose favourite colour is green?
        if ent.w0 == 0 && ent.w1 < c && s.is_possessive(ent.w1 - 1) {
            direct = Some(question(&format!("Whose {}", s.text(ent.w1, n))));
        }
    }
    // Naming: "a dog named Rex" → What is the name of the dog? / "The ship was called the Aurora."
    if direct.is_none() && ent.w0 >= 1 {
        let mut v = ent.w0 - 1;
        if v >= 1 && ws[v].lower() == "the" {
            v -= 1;
        }
        let verb = ws[v].lower();
        if NAMING_VERBS.contains(&verb.as_str()) && !(verb == "known" && prep_word.as_deref() != Some("as")) {
            let det = (v.saturating_sub(5)..v).rev().find(|&d| {
                ["a", "an", "the", "his", "her", "their", "its", "our", "my", "your"].contains(&ws[d].lower().as_str())
            });
            if v >= 1 && COPULAS.contains(&ws[v - 1].lower().as_str()) && v >= 2 {
                let subject = decap(&s.phrase(0, v - 1), lex);
                direct = Some(question(&format!("What {} {} {}", ws[v - 1].lower(), subject, verb)));
            } else if let Some(d) = det.filter(|&d| d + 1 < v) {
                let np = s.phrase(d + 1, v);
                direct = Some(question(&format!("What is the name of the {np}")));
                typed = Some(question(&format!("What was the {np} called")));
            }
        }
    }
    // Apposition: "The nearest town, Longyearbyen, is …" → What is the name of the nearest town?
    if direct.is_none() && matches!(ent.kind, Kind::Person | Kind::Place | Kind::Thing { .. }) && ent.w0 >= 2 {
        let before_comma = s.body[..ws[ent.w0].raw.0].trim_end().ends_with(',');
        let after_comma = ent.w1 == n || s.body[ent.e..].starts_with(',');
        let det = (ent.w0.saturating_sub(6)..ent.w0 - 1).rev().find(|&d| {
            ["a", "an", "the", "his", "her", "their", "its", "our", "my", "your"].contains(&ws[d].lower().as_str())
        });
        if let (true, true, Some(d)) = (before_comma, after_comma, det) {
            let np = s.phrase(d, ent.w0);
            if !np.contains(',')
                && (d == 0
                    || s.body[..ws[d].raw.0].trim_end().ends_with(',')
                    || PREPOSITIONS.contains(&ws[d - 1].lower().as_str())
                    || verbish(&ws[d - 1]))
            {
                direct = Some(question(&format!("What is the name of {}", decap(&np, lex))));
            }
        }
    }
    // Subject position: "Maria Santos founded the company." → Who founded the company?
    // (also after an introductory phrase: "In 1998, Maria Santos founded …" → "In 1998, who founded …")
    if direct.is_none() {
        if let Some(cs) = cs {
            let intro = cs == 0 || s.body[..s.words[cs].raw.0].trim_end().ends_with(',');
            let verb_next = ent.w1 < n && ws[ent.w1].starts_lower() && !s.breaks_after(ent.w1 - 1);
            if intro && verb_next {
                let (wh, rest_from) = match ent.kind {
                    Kind::Thing { head: Some(h) } => (format!("which {}", ws[h].lower()), ent.w1),
                    Kind::Count { noun } if noun == ent.w1 => (format!("how many {}", ws[noun].lower()), noun + 1),
                    Kind::Person => ("who".to_string(), ent.w1),
                    _ => ("what".to_string(), ent.w1),
                };
                if rest_from < n {
                    let prefix = &s.body[..ws[cs].raw.0];
                    direct = Some(question(&format!("{prefix}{wh} {}", s.text(rest_from, n))));
                }
            }
        }
    }
    (direct, typed, tense)
}

/// The sentence with the entity replaced in place by a wh-phrase ("The hotel has how many rooms?",
/// "Maria Santos founded the company in which year?"); an introductory "In 1998," moves to the end.
fn in_situ_question(s: &Sent, ent: &Entity) -> Option<String> {
    let ws = &s.words;
    let cs = constituent(s, ent)?;
    if s.body[..ws[cs].raw.0].trim_end().ends_with(',') && s.body[ent.e..].starts_with(',') {
        return None; // an appositive
    }
    let with_prep = matches!(ent.prep, Some(p) if p + 1 == cs);
    let a = if with_prep { cs - 1 } else { cs };
    let intro = a == 0 || s.body[..ws[a].raw.0].trim_end().ends_with(',');
    let subject = intro && !with_prep && ent.w1 < ws.len() && ws[ent.w1].starts_lower();
    let wh = wh_phrase(s, ent, subject || (a == 0 && !with_prep));
    let wh = if with_prep { format!("{} {wh}", ws[a].lower()) } else { wh };
    let (mut start, mut end) = if a == cs && cs == ent.w0 { (ent.s, ent.e) } else { (ws[a].core.0, ent.e) };
    // A quoted name is replaced with its quotes.
    for (o, c) in [('"', '"'), ('“', '”')] {
        if s.body[..start].ends_with(o) && s.body[end..].starts_with(c) {
            start -= o.len_utf8();
            end += c.len_utf8();
        }
    }
    let after = &s.body[end..];
    if a == 0 && with_prep && after.starts_with(',') {
        // "In 1998, X did Y." → "X did Y in which year?"
        let rest = first_char_upper(strip_final(after[1..].trim()));
        return Some(question(&format!("{rest} {wh}")));
    }
    let q = format!("{}{}{}", &s.body[..start], wh, after);
    Some(question(&q))
}

fn make_fact(s: &Sent, lex: &Lexicon, ent: &Entity, copula: Option<usize>) -> Option<Fact> {
    let answer = s.body[ent.s..ent.e].to_string();
    if answer.trim().is_empty() || content_tokens(&answer).is_empty() {
        return None;
    }
    let full = squeeze(s.body.trim());
    let cloze_text = squeeze(&format!("{}___{}", &s.body[..ent.s], &s.body[ent.e..]));
    let cloze = format!("Complete the sentence from the document: {cloze_text}");
    let (direct, typed, tense) = direct_question(s, lex, ent, copula);
    let in_situ = in_situ_question(s, ent);
    let direct = direct.or_else(|| in_situ.clone());
    let mut questions = Vec::new();
    match &direct {
        Some(d) => {
            questions.push((d.clone(), answer.clone()));
            questions.push((format!("According to the document, {}", decap(d, lex)), full.clone()));
            questions.push((cloze, answer.clone()));
        }
        None => {
            questions.push((cloze, answer.clone()));
            questions.push((format!("Which sentence of the document mentions {answer}?"), full.clone()));
        }
    }
    let mut alts: Vec<String> = Vec::new();
    alts.extend(typed);
    if in_situ != direct {
        alts.extend(in_situ);
    }
    alts.extend(tense);
    if let Some(d) = &direct {
        alts.push(format!("{}, according to the document?", strip_final(d)));
        alts.push(format!("Answer briefly: {d}"));
    }
    for alt in alts {
        questions.push((alt, answer.clone()));
    }
    questions.push((format!("Fill in the blank with the exact words from the document: {cloze_text}"), answer.clone()));
    if matches!(ent.kind, Kind::Person | Kind::Place | Kind::Thing { .. }) {
        questions.push((format!("What does the document say about {answer}?"), full.clone()));
    }
    if let Some(d) = &direct {
        questions.push((format!("Quote the sentence of the document that answers: {d}"), full));
    }
    Some(Fact { questions })
}

// ---------------------------------------------------------------------------------------------
// Clauses: short statements rewritten out of long sentences
// ---------------------------------------------------------------------------------------------

/// Regular past participles that are also the simple past ("founded", "designed"), so an agent
/// question can be worded actively: "was founded by X" → "Who founded …?".
fn past_equals_participle(w: &str) -> bool {
    let l = w.to_lowercase();
    (l.len() > 4 && l.ends_with("ed"))
        || ["built", "made", "held", "found", "sold", "paid", "kept", "led", "bought", "brought", "taught", "won"]
            .contains(&l.as_str())
}

/// The last noun phrase of a comma-separated piece that a following participle or relative clause
/// can attach to: a trailing name run ("… called the Grey Petrel"), else the piece's noun phrase
/// after its last verb or preposition ("… by a ship's carpenter").
fn antecedent(piece: &str, lex: &Lexicon) -> Option<String> {
    let ws = words_of(piece);
    let n = ws.len();
    if n == 0 {
        return None;
    }
    let mut i = n;
    while i > 0 && ws[i - 1].capitalised() && !is_stopword(ws[i - 1].text) {
        i -= 1;
    }
    if i < n && (i > 0 || lex.proper.contains(ws[0].text)) {
        let start = if i > 0 && ws[i - 1].lower() == "the" { i - 1 } else { i };
        return Some(strip_final(&piece[ws[start].raw.0..]).to_string());
    }
    // A bare noun phrase ("The great refractor, installed in 1908, …").
    let determiner = ["the", "a", "an", "this", "its", "their", "his", "her", "our"].contains(&ws[0].lower().as_str());
    (determiner && n <= 8 && !ws.iter().any(verbish)).then(|| decap(strip_final(piece), lex))
}

/// Simple clauses rewritten out of a sentence, so the question rules see short subject–verb
/// statements:
/// - the sentence up to its first comma ("X was Y, a …" → "X was Y"), or whole when it has none;
/// - each coordinated clause (", and the combination … was 7319" → "the combination … was 7319");
/// - a participial phrase with its noun restored ("the Grey Petrel, launched in 1921" → "the Grey
///   Petrel was launched in 1921");
/// - a relative clause with its antecedent ("Ingrid Solberg, who had learned …" → "Ingrid Solberg
///   had learned …");
/// - a possessive-pronoun subject resolved to the previous sentence's last name ("Her hull was …"
///   → "the Grey Petrel's hull was …"), a guess that is right far more often than not in prose.
///
/// Every answer taken from a clause is still verbatim document text; the evidence stays the whole
/// sentence.
fn clauses(s: &Sent, lex: &Lexicon, prev_name: Option<&str>) -> Vec<String> {
    let body = strip_final(s.body);
    // Narrative prose is in the past unless the sentence says otherwise.
    let present = s.words.iter().any(|w| matches!(w.lower().as_str(), "is" | "are" | "has" | "have"));
    let past = s.words.iter().any(|w| {
        matches!(w.lower().as_str(), "was" | "were" | "had")
            || (w.starts_lower() && COMMON_VERBS.contains(&w.lower().as_str()))
    });
    let tense = if present && !past { "is" } else { "was" };
    // Comma/semicolon pieces (not the comma inside "1,500").
    // (piece, whether a semicolon precedes it)
    let mut pieces: Vec<(&str, bool)> = Vec::new();
    let (mut start, mut semi) = (0, false);
    for (i, c) in body.char_indices() {
        if (c == ',' || c == ';') && body[i + 1..].starts_with(' ') {
            pieces.push((body[start..i].trim(), semi));
            (start, semi) = (i + 1, c == ';');
        }
    }
    pieces.push((body[start..].trim(), semi));
    let mut out: Vec<String> = Vec::new();
    let has_verb = |t: &str| words_of(t).iter().any(verbish);
    for (k, &(piece, after_semicolon)) in pieces.iter().enumerate() {
        let ws = words_of(piece);
        if ws.len() < 3 {
            continue;
        }
        let first = ws[0].lower();
        let clause = if k == 0 {
            Some(piece.to_string())
        } else if ["and", "but", "while", "yet", "so", "whereas"].contains(&first.as_str()) {
            let rest = piece[ws[1].raw.0..].to_string();
            // "…, and she carried …" / "…, and the combination … was …" (not "…, and generous").
            (words_of(&rest).len() >= 3).then_some(rest)
        } else if ws[0].starts_lower() && is_participle(ws[0].text) && !NAMING_VERBS.contains(&first.as_str()) {
            antecedent(pieces[k - 1].0, lex).map(|a| format!("{a} {tense} {piece}"))
        } else if matches!(first.as_str(), "who" | "which") {
            antecedent(pieces[k - 1].0, lex).map(|a| format!("{a} {}", &piece[ws[1].raw.0..]))
        } else if after_semicolon {
            Some(piece.to_string())
        } else {
            None
        };
        let Some(mut clause) = clause else { continue };
        if !has_verb(&clause) {
            continue;
        }
        // A possessive pronoun subject takes the previous sentence's last name.
        let cw = words_of(&clause);
        if let (Some(name), Some(w0)) = (prev_name, cw.first()) {
            if matches!(w0.lower().as_str(), "her" | "his" | "its" | "their") && cw.len() > 2 {
                clause = format!("{name}'s {}", &clause[cw[1].raw.0..]);
            }
        }
        out.push(clause);
    }
    out
}

/// Extra entity for a passive clause: the noun phrase after the participle's first preposition
/// ("her hull was planked with larch from …" → "larch"), ended at the next preposition, comma or
/// clause word; common nouns are facts too.
fn passive_object(s: &Sent) -> Option<Entity> {
    let ws = &s.words;
    let n = ws.len();
    let c = ws.iter().position(|w| COPULAS.contains(&w.lower().as_str()))?;
    let mut p = c + 1;
    while p < n && ADVERBS.contains(&ws[p].lower().as_str()) {
        p += 1;
    }
    if p + 2 >= n || !is_participle(ws[p].text) || !ws[p].starts_lower() {
        return None;
    }
    let prep = p + 1;
    if !["with", "from", "of", "for", "on", "into", "in"].contains(&ws[prep].lower().as_str()) || s.breaks_after(p) {
        return None;
    }
    let mut w0 = prep + 1;
    if w0 < n && matches!(ws[w0].lower().as_str(), "a" | "an" | "the") {
        w0 += 1;
    }
    let mut w1 = w0;
    while w1 < n
        && !PREPOSITIONS.contains(&ws[w1].lower().as_str())
        && !CLAUSE_WORDS.contains(&ws[w1].lower().as_str())
        && !verbish(&ws[w1])
        && !ws[w1].has_digit()
    {
        w1 += 1;
        if s.breaks_after(w1 - 1) {
            break;
        }
    }
    if w1 < n && (ws[w1].lower() == "of" || ws[w1].has_digit()) {
        return None; // "in the spring of 1887": the noun is only a frame
    }
    let idiom = w1 == w0 + 1
        && ["part", "turn", "fact", "general", "particular", "time", "order", "place", "use"]
            .contains(&ws[w0].lower().as_str());
    if w1 == w0 || w1 - w0 > 5 || idiom || (w0..w1).any(|i| ws[i].capitalised()) {
        return None;
    }
    Some(Entity { s: ws[w0].core.0, e: ws[w1 - 1].core.1, w0, w1, kind: Kind::Phrase, prep: Some(prep) })
}

/// Base form of a past-tense verb ("bought" → "buy", "hired" → "hire", "stopped" → "stop"), for
/// "When did X buy …?"; `None` when the word does not look like a simple past.
fn base_form(past: &str) -> Option<String> {
    const IRREGULAR: &[(&str, &str)] = &[
        ("bought", "buy"),
        ("built", "build"),
        ("began", "begin"),
        ("sold", "sell"),
        ("made", "make"),
        ("took", "take"),
        ("gave", "give"),
        ("wrote", "write"),
        ("found", "find"),
        ("became", "become"),
        ("won", "win"),
        ("led", "lead"),
        ("left", "leave"),
        ("held", "hold"),
        ("kept", "keep"),
        ("paid", "pay"),
        ("sent", "send"),
        ("met", "meet"),
        ("brought", "bring"),
        ("came", "come"),
        ("went", "go"),
        ("got", "get"),
        ("saw", "see"),
        ("told", "tell"),
        ("said", "say"),
        ("lost", "lose"),
        ("spent", "spend"),
        ("grew", "grow"),
        ("drew", "draw"),
        ("ran", "run"),
        ("rose", "rise"),
        ("fell", "fall"),
        ("knew", "know"),
        ("chose", "choose"),
        ("taught", "teach"),
        ("caught", "catch"),
        ("sank", "sink"),
        ("set", "set"),
        ("put", "put"),
        ("hit", "hit"),
        ("moved", "move"),
        ("opened", "open"),
        ("closed", "close"),
        ("joined", "join"),
    ];
    let l = past.to_lowercase();
    if let Some((_, base)) = IRREGULAR.iter().find(|(p, _)| *p == l) {
        return Some(base.to_string());
    }
    let stem = l.strip_suffix("ed").filter(|s| s.len() >= 3)?;
    let b = stem.as_bytes();
    let last = b[b.len() - 1];
    let vowel = |c: u8| b"aeiou".contains(&c);
    Some(if let Some(s) = stem.strip_suffix('i') {
        format!("{s}y") // carried → carry
    } else if b.len() >= 3 && last == b[b.len() - 2] && b"bdgmnpt".contains(&last) {
        stem[..stem.len() - 1].to_string() // stopped → stop
    } else if b"vcuz".contains(&last)
        || (vowel(b[b.len() - 2])
            && !vowel(b[b.len().saturating_sub(3)])
            && b"rst".contains(&last)
            && b[b.len() - 2] != b'e')
    {
        format!("{stem}e") // survived, introduced, argued, hired, based, located
    } else {
        stem.to_string() // opened, employed, launched
    })
}

/// "In 1903 the company bought a second slipway" / "The company bought … in 1903" → "When did the
/// company buy a second slipway?" (and "In what year …" for a year).
fn active_date_questions(s: &Sent, ent: &Entity) -> Vec<String> {
    let ws = &s.words;
    let n = ws.len();
    let Some(p) = ent.prep.filter(|&p| matches!(ws[p].lower().as_str(), "in" | "on" | "during")) else {
        return Vec::new();
    };
    // The clause without the date's phrase.
    let keep: Vec<usize> = (0..n).filter(|&i| i < p || i >= ent.w1).collect();
    let pos_of_verb = keep.iter().position(|&i| {
        let w = &ws[i];
        w.starts_lower()
            && !AUXILIARIES.contains(&w.lower().as_str())
            && (COMMON_VERBS.contains(&w.lower().as_str()) || w.lower().ends_with("ed"))
    });
    let Some(vpos) = pos_of_verb else {
        return Vec::new();
    };
    let v = keep[vpos];
    let subj: Vec<usize> = keep[..vpos].to_vec();
    if subj.is_empty() || subj.len() > 8 || subj.iter().any(|&i| AUXILIARIES.contains(&ws[i].lower().as_str())) {
        return Vec::new();
    }
    let first = ws[subj[0]].lower();
    if PRONOUN_SUBJECTS.contains(&first.as_str()) && subj.len() == 1 || PREPOSITIONS.contains(&first.as_str()) {
        return Vec::new();
    }
    let Some(base) = base_form(ws[v].text) else {
        return Vec::new();
    };
    let mut obj = Vec::new();
    for &i in &keep[vpos + 1..] {
        if CLAUSE_WORDS.contains(&ws[i].lower().as_str()) {
            break;
        }
        obj.push(i);
        if s.breaks_after(i) {
            break;
        }
    }
    let words =
        |ix: &[usize]| ix.iter().map(|&i| strip_final(&s.body[ws[i].raw.0..ws[i].raw.1])).collect::<Vec<_>>().join(" ");
    let subject = words(&subj);
    let subject = match subject.split_once(' ') {
        Some((f, rest)) if !ws[subj[0]].capitalised() || is_stopword(f) => {
            format!("{} {rest}", f.to_lowercase())
        }
        _ => subject,
    };
    let tail = words(&obj);
    let mut out = vec![question(&format!("When did {subject} {base} {tail}"))];
    if ent.kind == Kind::Year {
        out.push(question(&format!("In what year did {subject} {base} {tail}")));
    }
    out
}

/// Questions shaped by the clause's construction (passive object, naming predicate, dates, labelled
/// numbers, agents) for one fact.
fn shaped_questions(s: &Sent, lex: &Lexicon, ent: &Entity, copula: Option<usize>) -> Vec<String> {
    let ws = &s.words;
    let n = ws.len();
    let subject = copula.map(|c| decap(&s.phrase(0, c), lex));
    let mut out = Vec::new();
    if copula.is_none() && matches!(ent.kind, Kind::Year | Kind::Date) {
        out.extend(active_date_questions(s, ent));
    }
    let (Some(c), Some(subj)) = (copula, subject.as_ref()) else {
        return out;
    };
    let cop = ws[c].lower();
    let part = (c + 1 < n && is_participle(ws[c + 1].text) && ws[c + 1].starts_lower()).then(|| ws[c + 1].lower());
    // The participle's object: "What was X planked with?" / "With what was X planked?"
    if let (Kind::Phrase, Some(p), Some(part)) = (ent.kind, ent.prep, part.as_ref()) {
        let pw = ws[p].lower();
        out.push(format!("What {cop} {subj} {part} {pw}?"));
        out.push(format!("{} what {cop} {subj} {part}?", first_char_upper(&pw)));
        return out;
    }
    // Copula with a naming predicate: "X was a quiet woman named Y" → "Who was X?".
    if part.is_none() && ent.w1 == n && ent.w0 >= 2 && NAMING_VERBS.contains(&ws[ent.w0 - 1].lower().as_str()) {
        let wh = if ent.kind == Kind::Person { "Who" } else { "What" };
        out.push(format!("{wh} {cop} {subj}?"));
    }
    // A counted predicate: "the rent of the cottage was 40 shillings" → "How many shillings was …?"
    if let (None, Kind::Count { noun }) = (&part, ent.kind) {
        if ent.w0 == c + 1 && noun + 1 == n {
            out.push(format!("How many {} {cop} {subj}?", ws[noun].lower()));
        }
    }
    let Some(part) = part else { return out };
    // Dates: "founded in the spring of 1887" → "When was X founded?" / "In what year …?".
    if matches!(ent.kind, Kind::Year | Kind::Date) && ent.w0 > c + 1 {
        let in_pp = (c + 2..ent.w0).any(|i| matches!(ws[i].lower().as_str(), "in" | "on" | "during"));
        if in_pp {
            out.push(format!("When {cop} {subj} {part}?"));
            if ent.kind == Kind::Year {
                out.push(format!("In what year {cop} {subj} {part}?"));
            }
        }
    }
    // A labelled number: "stamped with the number 4862" → "What number was X stamped with?"
    if matches!(ent.kind, Kind::Number | Kind::Code) && ent.w0 >= c + 4 {
        let label = &ws[ent.w0 - 1];
        let prep = c + 2;
        let np_ok = (prep + 1..ent.w0 - 1).all(|i| matches!(ws[i].lower().as_str(), "the" | "a" | "an"));
        if PREPOSITIONS.contains(&ws[prep].lower().as_str())
            && np_ok
            && label.starts_lower()
            && !is_stopword(label.text)
        {
            let (pw, noun) = (ws[prep].lower(), label.lower());
            out.push(format!("What {noun} {cop} {subj} {part} {pw}?"));
            out.push(format!("What {cop} {subj} {part} {pw}?"));
        }
    }
    // Agent: "founded … by (a carpenter named) Tobias Wren" → "Who founded X?".
    if ent.kind == Kind::Person {
        let by = (c + 2..ent.w0).rev().find(|&i| ws[i].lower() == "by");
        let named_or_direct =
            by.is_some_and(|b| b + 1 == ent.w0 || NAMING_VERBS.contains(&ws[ent.w0 - 1].lower().as_str()));
        if named_or_direct {
            if past_equals_participle(&part) {
                out.push(format!("Who {part} {subj}?"));
            }
            out.push(format!("By whom {cop} {subj} {part}?"));
        }
    }
    out
}

/// Short questions about one clause, each with its short answer: the direct wh-question of every
/// fact the rules find, a stranded-preposition variant ("What was X planked with?"), "When/In what
/// year" for dates reached through "in the spring of 1887", and an active agent question for
/// passives with a named agent ("was founded … by a carpenter named Tobias Wren" → "Who founded
/// the Saltmere Harbor Company?").
fn clause_questions(text: &str, offset: usize, lex: &Lexicon) -> Vec<(String, String)> {
    let words = words_of(text);
    let s = Sent { body: text, offset, words };
    let ws = &s.words;
    let n = ws.len();
    if n < 3 {
        return Vec::new();
    }
    let copula = copula_split(&s);
    let mut ents = find_entities(&s, lex);
    ents.extend(predicate_entity(&s, copula, &ents));
    if let Some(o) = passive_object(&s) {
        if !ents.iter().any(|e| e.w0 < o.w1 && o.w0 < e.w1) {
            ents.push(o);
        }
    }
    let mut out = Vec::new();
    for ent in &ents {
        let answer = text[ent.s..ent.e].to_string();
        out.extend(shaped_questions(&s, lex, ent, copula).into_iter().map(|q| (q, answer.clone())));
        // The general rules after, where the fact opens or closes the clause (so the question
        // stays short).
        if ent.w0 == 0 || ent.w1 == n {
            if let (Some(d), _, _) = direct_question(&s, lex, ent, copula) {
                out.push((d, answer.clone()));
            }
        }
    }
    out
}

/// The predicate of a short copula is a fact in itself ("The museum is a former prison"), when
/// no other entity sits in it.
fn predicate_entity(s: &Sent, copula: Option<usize>, ents: &[Entity]) -> Option<Entity> {
    let c = copula?;
    let n = s.words.len();
    let mut p0 = c + 1;
    while p0 < n && ADVERBS.contains(&s.words[p0].lower().as_str()) {
        p0 += 1;
    }
    let pred_words = n - p0;
    let passive = is_participle(s.words[p0].text)
        && s.words.get(p0 + 1).is_none_or(|w| PREPOSITIONS.contains(&w.lower().as_str()) || s.breaks_after(p0));
    let fits = COPULAS.contains(&s.words[c].lower().as_str())
        && (1..=10).contains(&pred_words)
        && !passive
        && !ents.iter().any(|e| e.w0 >= p0);
    fits.then(|| Entity {
        s: s.words[p0].core.0,
        e: s.words[n - 1].core.1,
        w0: p0,
        w1: n,
        kind: Kind::Phrase,
        prep: None,
    })
}

/// All extractive candidates in document order (before the `max_pairs` cap).
fn extractive_candidates(doc: &str, sentences: &[Span], opts: &QaOptions) -> Vec<Candidate> {
    let lex = Lexicon::new(doc, sentences);
    let per_fact = opts.wordings_per_fact.max(1);
    let mut out = Vec::new();
    let mut fact_idx = 0;
    let mut prev_name: Option<String> = None;
    for span in sentences {
        let Some(s) = Sent::new(doc, span) else {
            prev_name = None;
            continue;
        };
        // Short questions from the sentence's clauses, grouped by answer (in order).
        let mut by_answer: Vec<(String, Vec<String>)> = Vec::new();
        for clause in clauses(&s, &lex, prev_name.as_deref()) {
            for (q, a) in clause_questions(&clause, s.offset, &lex) {
                if !s.body.contains(a.as_str()) || content_tokens(&a).is_empty() {
                    continue;
                }
                match by_answer.iter_mut().find(|(x, _)| *x == a) {
                    Some((_, qs)) => qs.push(q),
                    None => by_answer.push((a, vec![q])),
                }
            }
        }
        let copula = copula_split(&s);
        let mut ents = find_entities(&s, &lex);
        prev_name = ents
            .iter()
            .filter(|e| matches!(e.kind, Kind::Person | Kind::Place | Kind::Thing { .. }))
            .max_by_key(|e| e.w0)
            .map(|e| {
                let the = e.w0 > 0 && s.words[e.w0 - 1].lower() == "the";
                let start = if the { s.words[e.w0 - 1].core.0 } else { e.s };
                s.body[start..e.e].to_string()
            });
        ents.extend(predicate_entity(&s, copula, &ents));
        // Priority: predicates of copulas and naming, numbers/dates, then names.
        let score = |e: &Entity| -> (usize, usize) {
            let pred = copula.is_some_and(|c| e.w0 > c && e.w1 == s.words.len());
            let p = match e.kind {
                _ if pred => 0,
                Kind::Number | Kind::Count { .. } | Kind::Year | Kind::Date | Kind::Time | Kind::Code => 1,
                Kind::Person | Kind::Quote => 2,
                Kind::Place | Kind::Thing { .. } => 3,
                Kind::Phrase => 4,
            };
            (p, e.w0)
        };
        ents.sort_by_key(score);
        let mut facts: Vec<Vec<(String, String)>> = Vec::new();
        for ent in &ents {
            if facts.len() >= MAX_FACTS_PER_SENTENCE {
                break;
            }
            let Some(fact) = make_fact(&s, &lex, ent, copula) else {
                continue;
            };
            let answer = &s.body[ent.s..ent.e];
            let short = match by_answer.iter().position(|(a, _)| a == answer) {
                Some(i) => by_answer.remove(i).1,
                None => Vec::new(),
            };
            // Clause questions lead (short, the way people ask), the sentence's wordings follow.
            let mut wordings: Vec<(String, String)> = Vec::new();
            let mut rest = fact.questions.into_iter();
            for q in short {
                wordings.push((q, answer.to_string()));
                wordings.extend(rest.next());
            }
            wordings.extend(rest);
            facts.push(wordings);
        }
        // Facts only the clauses found (common nouns, predicates of coordinated clauses).
        let full = squeeze(s.body.trim());
        for (answer, qs) in by_answer.into_iter().take(MAX_FACTS_PER_SENTENCE) {
            let mut wordings = vec![(qs[0].clone(), answer.clone())];
            wordings.push((format!("According to the document, {}", decap(&qs[0], &lex)), full.clone()));
            wordings.extend(qs[1..].iter().map(|q| (q.clone(), answer.clone())));
            facts.push(wordings);
        }
        for questions in facts {
            let ev = (s.offset, s.offset + s.body.len());
            let mut seen = HashSet::new();
            let mut rank = 0;
            for (q, a) in questions {
                if rank >= per_fact {
                    break;
                }
                if !seen.insert(normalize_question(&q)) {
                    continue;
                }
                out.push(Candidate {
                    rank,
                    fact: fact_idx,
                    pair: QaPair {
                        question: q,
                        answer: a,
                        evidence: doc[ev.0..ev.1].to_string(),
                        evidence_span: ev,
                        source: QaSource::Extractive,
                    },
                });
                rank += 1;
            }
            fact_idx += 1;
        }
    }
    out
}

/// Plain cloze questions over any sentence of six words or more (used only to reach `min_pairs`).
fn fallback_candidates(doc: &str, sentences: &[Span]) -> Vec<Candidate> {
    let mut out = Vec::new();
    for (i, span) in sentences.iter().enumerate() {
        let text = span.text(doc);
        let words = words_of(text);
        if words.len() < 6 {
            continue;
        }
        // The last content word, blanked.
        let Some(k) = words
            .iter()
            .rposition(|w| w.text.len() >= 3 && !is_stopword(w.text) && w.text.chars().all(char::is_alphanumeric))
        else {
            continue;
        };
        let w = &words[k];
        let cloze = squeeze(&format!("{}___{}", &text[..w.core.0], &text[w.core.1..]));
        let pair = |q: String, a: String, rank| Candidate {
            rank,
            fact: i,
            pair: QaPair {
                question: q,
                answer: a,
                evidence: text.to_string(),
                evidence_span: (span.start, span.end),
                source: QaSource::Extractive,
            },
        };
        out.push(pair(format!("Complete the sentence from the document: {cloze}"), w.text.to_string(), 0));
        let half = words.len() / 2;
        let head = squeeze(&text[..words[half - 1].raw.1]);
        let tail = text[words[half].raw.0..].to_string();
        out.push(pair(format!("Continue this sentence from the document: {head} ..."), tail, 1));
    }
    out
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

    fn opts() -> QaOptions {
        QaOptions { max_pairs: 1000, ..Default::default() }
    }

    fn extract(doc: &str, opts: &QaOptions) -> Vec<QaPair> {
        extractive_qa(doc, &split_sentences(doc), opts)
    }

    fn assert_verbatim(doc: &str, pairs: &[QaPair]) {
        for p in pairs {
            let (s, e) = p.evidence_span;
            assert_eq!(&doc[s..e], p.evidence, "evidence not at its span: {p:?}");
            assert!(!p.question.trim().is_empty() && !p.answer.trim().is_empty(), "{p:?}");
        }
    }

    fn find<'a>(pairs: &'a [QaPair], q: &str) -> Option<&'a QaPair> {
        pairs.iter().find(|p| p.question == q)
    }

    #[test]
    fn parse_paper_format_and_variants() {
        let want = Some((
            "Who founded the museum?".to_string(),
            "Elena Marsh".to_string(),
            "The museum was founded by Elena Marsh.".to_string(),
        ));
        let paper = "Question: Who founded the museum?\n\nAnswer: Elena Marsh\n\nEvidence: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(paper), want);
        let compact = "Question: Who founded the museum?\nAnswer: Elena Marsh\nEvidence: The museum was founded by Elena Marsh.\n";
        assert_eq!(parse_qa(compact), want);
        let markdown = "Here is a question:\n\n**Question:** Who founded the museum?\n**Answer:** Elena Marsh\n**Evidence:** The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(markdown), want);
        let bold_outside = "**Question**: Who founded the museum?\n**Answer**: Elena Marsh\n**Evidence**: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(bold_outside), want);
        let numbered = "1. Question: Who founded the museum?\n2. Answer: Elena Marsh\n3. Evidence: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(numbered), want);
        let next_line = "Question 1:\nWho founded the museum?\n\nAnswer:\nElena Marsh\n\nEvidence:\n\"The museum was founded by Elena Marsh.\"";
        assert_eq!(parse_qa(next_line), want);
        let short_labels =
            "Q: Who founded the museum?\nA: [Elena Marsh]\nEvidence: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(short_labels), want);
        let lower =
            "question: Who founded the museum?\nanswer: Elena Marsh\nevidence: The museum was founded by Elena Marsh.";
        assert_eq!(parse_qa(lower), want);
        // Only the first triple counts.
        let two = format!("{compact}\nQuestion: Another?\nAnswer: x\nEvidence: y");
        assert_eq!(parse_qa(&two), want);
    }

    #[test]
    fn parse_rejects_malformed() {
        assert_eq!(parse_qa(""), None);
        assert_eq!(parse_qa("The museum was founded by Elena Marsh."), None);
        assert_eq!(parse_qa("Question: Who founded the museum?\nAnswer: Elena Marsh"), None);
        assert_eq!(parse_qa("Question: Who founded the museum?\nEvidence: The museum was founded."), None);
        assert_eq!(parse_qa("Answer: Elena Marsh\nEvidence: The museum was founded by Elena Marsh."), None);
        assert_eq!(parse_qa("Question: Who?\nAnswer:\nEvidence: The museum was founded."), None);
        assert_eq!(parse_qa("Question: [question]\n\nAnswer: [answer]\n\nEvidence: [evidence]"), None);
        // Evidence before the answer is out of order.
        assert_eq!(parse_qa("Question: Who?\nEvidence: The museum was founded.\nAnswer: Elena"), None);
    }

    #[test]
    fn evidence_must_be_verbatim() {
        let doc = "The museum opened in 1987.  It was founded by\nElena Marsh. The museum opened again.";
        assert_eq!(locate_evidence(doc, "The museum opened in 1987."), Some((0, 26)));
        // Whitespace runs may differ; quotes and surrounding whitespace are trimmed.
        let (s, e) = locate_evidence(doc, " \"It was founded by Elena Marsh.\" ").unwrap();
        assert_eq!(&doc[s..e], "It was founded by\nElena Marsh.");
        // A missing final period is accepted (the rest is verbatim).
        let (s, e) = locate_evidence(doc, "The museum opened in 1987").unwrap();
        assert_eq!(&doc[s..e], "The museum opened in 1987");
        // Anything else is rejected.
        assert_eq!(locate_evidence(doc, "The museum opened in 1988."), None);
        assert_eq!(locate_evidence(doc, "the museum opened in 1987."), None);
        assert_eq!(locate_evidence(doc, "The museum was founded by Elena Marsh."), None);
        assert_eq!(locate_evidence(doc, "useum opened"), None, "must start on a word boundary");
        assert_eq!(locate_evidence(doc, "   "), None);
        // Prefers an occurrence inside the window.
        let first = locate_evidence(doc, "The museum opened").unwrap();
        let near = locate_evidence_near(doc, "The museum opened", Some((40, doc.len()))).unwrap();
        assert_eq!(first.0, 0);
        assert!(near.0 > 40 && &doc[near.0..near.1] == "The museum opened");
    }

    #[test]
    fn model_outputs_are_validated_against_the_document() {
        let doc = PARAGRAPH;
        let window = (0, doc.len());
        let ok = "Question: Who founded the museum?\nAnswer: Elena Marsh\nEvidence: The museum was founded by Elena Marsh, a retired sea captain.\n";
        match validate_model_output(doc, window, ok) {
            Verdict::Valid(p) => {
                assert_eq!(p.source, QaSource::Model);
                assert_eq!(&doc[p.evidence_span.0..p.evidence_span.1], p.evidence);
            }
            _ => panic!("valid pair rejected"),
        }
        let invented = "Question: Who founded the museum?\nAnswer: Elena Marsh\nEvidence: Elena Marsh founded the museum in 1850.\n";
        assert!(matches!(validate_model_output(doc, window, invented), Verdict::Evidence));
        let ungrounded = "Question: Who founded the museum?\nAnswer: Napoleon Bonaparte\nEvidence: The museum was founded by Elena Marsh, a retired sea captain.\n";
        assert!(matches!(validate_model_output(doc, window, ungrounded), Verdict::Answer));
        let given_away = "Question: What did Elena Marsh do?\nAnswer: Elena Marsh\nEvidence: The museum was founded by Elena Marsh, a retired sea captain.\n";
        assert!(matches!(validate_model_output(doc, window, given_away), Verdict::Answer));
        assert!(matches!(validate_model_output(doc, window, "I cannot do that."), Verdict::Parse));
        // Evidence that drifts after verbatim sentences keeps the verbatim, adjacent run; a meta
        // preamble before the question is dropped.
        let drift = "Question: What is the answer to the question: Who was the first director?\nAnswer: Tomas Berg\n\
                     Evidence: The museum was founded by Elena Marsh, a retired sea captain. Its first director was Tomas Berg. It had 900 rooms.";
        match validate_model_output(doc, window, drift) {
            Verdict::Valid(p) => {
                assert_eq!(p.question, "Who was the first director?");
                assert_eq!(
                    p.evidence,
                    "The museum was founded by Elena Marsh, a retired sea captain. Its first director was Tomas Berg."
                );
                assert_eq!(&doc[p.evidence_span.0..p.evidence_span.1], p.evidence);
            }
            _ => panic!("drifting evidence rejected"),
        }
    }

    #[test]
    fn extractive_wordings_short_and_full_answers() {
        let pairs = extract(PARAGRAPH, &opts());
        assert_verbatim(PARAGRAPH, &pairs);
        let sentence = "The vault code at the Lisbon office is 4417.";
        let about: Vec<&QaPair> = pairs.iter().filter(|p| p.evidence == sentence).collect();
        assert!(about.len() >= 4, "several wordings per fact: {about:#?}");
        assert_eq!(find(&pairs, "What is the vault code at the Lisbon office?").unwrap().answer, "4417");
        assert_eq!(
            find(&pairs, "According to the document, what is the vault code at the Lisbon office?").unwrap().answer,
            sentence
        );
        assert_eq!(
            find(&pairs, "Complete the sentence from the document: The vault code at the Lisbon office is ___.")
                .unwrap()
                .answer,
            "4417"
        );
        assert_eq!(find(&pairs, "Which number is the vault code at the Lisbon office?").unwrap().answer, "4417");
        // Names, dates, places, counts, possessives, naming.
        assert_eq!(find(&pairs, "By whom was the museum founded?").unwrap().answer, "Elena Marsh");
        assert_eq!(find(&pairs, "Who was its first director?").unwrap().answer, "Tomas Berg");
        assert_eq!(find(&pairs, "A fire damaged the east wing on what date?").unwrap().answer, "March 3, 1999");
        assert_eq!(find(&pairs, "How many books does the library have about navigation?").unwrap().answer, "12,000");
        assert_eq!(find(&pairs, "Whose favourite exhibit is the brass telescope?").unwrap().answer, "Anna");
        assert_eq!(find(&pairs, "What is the museum's oldest ship model called?").unwrap().answer, "Morning Star");
        assert_eq!(find(&pairs, "In 2005, who became the chief curator?").unwrap().answer, "Maria Santos");
        assert_eq!(
            find(&pairs, "From where can visitors reach the museum in ten minutes?").unwrap().answer,
            "Central Station"
        );
        // Every fact has short answers and a full-sentence answer.
        let full = pairs.iter().filter(|p| p.answer == p.evidence).count();
        let short = pairs.iter().filter(|p| p.answer.len() < p.evidence.len() / 2).count();
        assert!(full >= 8 && short >= 20, "full {full}, short {short}");
        // No repeated questions; all extractive.
        let qs: HashSet<String> = pairs.iter().map(|p| normalize_question(&p.question)).collect();
        assert_eq!(qs.len(), pairs.len());
        assert!(pairs.iter().all(|p| p.source == QaSource::Extractive));
    }

    #[test]
    fn clause_questions_are_short_and_natural() {
        let doc = "The museum's oldest bell, cast in 1742 after a long winter, still rings at noon. \
                   The keeper's cottage stood beside the Marsh Hall. Her roof was covered with slate from the \
                   northern quarries, and the rent of the cottage was 40 shillings. In 1903 the society bought \
                   a printing press. The chief engineer in those years was a patient man named Arvid Holm, who \
                   had trained in Glasgow. The library was founded by a teacher named Ruth Ellery. The safe was \
                   opened with the code 5531. The favourite dish of the crew was salted cod with potatoes.";
        let o = QaOptions { max_pairs: 1000, wordings_per_fact: 12, ..Default::default() };
        let pairs = extract(doc, &o);
        assert_verbatim(doc, &pairs);
        for (q, a) in [
            ("When was the museum's oldest bell cast?", "1742"),
            ("In what year was the museum's oldest bell cast?", "1742"),
            ("What was the Marsh Hall's roof covered with?", "slate"),
            ("How many shillings was the rent of the cottage?", "40"),
            ("When did the society buy a printing press?", "1903"),
            ("Who was the chief engineer in those years?", "Arvid Holm"),
            ("Who had trained in Glasgow?", "Arvid Holm"),
            ("Who founded the library?", "Ruth Ellery"),
            ("What code was the safe opened with?", "5531"),
            ("What was the favourite dish of the crew?", "salted cod with potatoes"),
        ] {
            let p = find(&pairs, q).unwrap_or_else(|| {
                panic!("missing {q:?} in {:#?}", pairs.iter().map(|p| &p.question).collect::<Vec<_>>())
            });
            assert_eq!(p.answer, a, "{q}");
            // The evidence is the whole sentence the answer came from.
            assert!(p.evidence.contains(a) && p.evidence.ends_with('.'), "{p:?}");
        }
    }

    #[test]
    fn extractive_is_deterministic_and_covers_the_whole_text() {
        let o = QaOptions { max_pairs: 1000, wordings_per_fact: 4, ..Default::default() };
        let a = extract(PARAGRAPH, &o);
        let b = extract(PARAGRAPH, &o);
        assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
        let has = |needle: &str| a.iter().any(|p| p.answer.contains(needle) && p.answer != p.evidence);
        assert!(has("1987") && has("4417") && has("March 3, 1999") && has("Central Station"));
        // Wordings per fact are capped.
        let mut per: HashMap<(usize, String), usize> = HashMap::new();
        for p in &a {
            if p.answer != p.evidence {
                *per.entry((p.evidence_span.0, p.answer.clone())).or_default() += 1;
            }
        }
        assert!(per.values().all(|&n| n <= 4));

        // A tight cap keeps the start, middle and end covered.
        let small = QaOptions { max_pairs: 8, min_pairs: 0, ..Default::default() };
        let few = extract(PARAGRAPH, &small);
        assert_eq!(few.len(), 8);
        assert_verbatim(PARAGRAPH, &few);
        let third = PARAGRAPH.len() / 3;
        assert!(few.iter().any(|p| p.evidence_span.0 < third));
        assert!(few.iter().any(|p| p.evidence_span.0 >= third && p.evidence_span.0 < 2 * third));
        assert!(few.iter().any(|p| p.evidence_span.0 >= 2 * third));
    }

    #[test]
    fn extractive_fills_min_pairs_without_facts() {
        let doc = "the old cat slept under the warm kitchen stove all afternoon.\n\n\
                   a gentle rain kept falling on the quiet garden outside.\n\n\
                   nobody in the house wanted to go out into the cold wet evening.";
        let o = QaOptions { min_pairs: 5, ..Default::default() };
        let pairs = extract(doc, &o);
        assert!(pairs.len() >= 5, "{pairs:#?}");
        assert_verbatim(doc, &pairs);
        assert!(extract("", &o).is_empty());
    }

    #[test]
    fn windows_spread_over_the_document() {
        let w = spread_windows(100, 16, 5);
        assert_eq!(w.len(), 5);
        assert_eq!(w[0].0, 2);
        assert!(w.iter().all(|&(a, b)| b - a == 16 && b <= 100));
        assert!(w.windows(2).all(|p| p[0].0 < p[1].0));
        assert!(w[4].1 >= 96);
        assert_eq!(spread_windows(10, 16, 2), vec![(0, 10), (0, 10)]);
        assert!(spread_windows(0, 16, 2).is_empty());
        let all = spread_windows(160, 16, 10);
        assert_eq!(all.first().unwrap().0, 0);
        assert_eq!(all.last().unwrap().1, 160);
    }

    #[test]
    fn generate_qa_with_a_tiny_model_falls_back_to_extractive() {
        use crate::testing::{write_hf, TinySpec};
        let dir = tempfile::tempdir().unwrap();
        let path = write_hf(&dir.path().join("tiny"), &TinySpec::default()).unwrap();
        let model = Model::load(&path, &candle_core::Device::Cpu).unwrap();
        let o = QaOptions { retries: 1, max_new_tokens: 8, min_pairs: 12, max_pairs: 40, use_model: true, ..Default::default() };
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
        assert!(err.downcast_ref::<crate::lift::Cancelled>().is_some());
        // Without the model: extractive only.
        let no_model = QaOptions { use_model: false, ..o };
        let pairs = generate_qa(&model, PARAGRAPH, &no_model, &mut |_| {}, &|| false).unwrap();
        assert!(pairs.len() >= 12 && pairs.iter().all(|p| p.source == QaSource::Extractive));
    }

    #[test]
    fn sentence_spans_feed_extractive_evidence() {
        let doc = "# Notes\n\n- The gate code is 9021.\n- Dr. Ruth Klein runs the lab.\n\nShe joined in 2019.";
        let pairs = extract(doc, &opts());
        assert_verbatim(doc, &pairs);
        assert!(pairs.iter().any(|p| p.answer == "9021" && p.evidence == "The gate code is 9021."));
        assert!(pairs.iter().any(|p| p.answer.contains("Ruth Klein")));
        assert!(pairs.iter().any(|p| p.answer == "2019"));
        assert!(!pairs.iter().any(|p| p.evidence.contains("Notes")));
    }

    #[test]
    fn random_text_never_breaks_the_rules() {
        // Pseudo-random "documents" of words, numbers, names, punctuation, quotes and non-ASCII.
        let pieces = [
            "the", "museum", "Anna", "Berg's", "is", "was", "in", "1987", "3.14", "4,200", "LKN-7", "Dr.", "U.S.",
            "\"Star\"", "“Moon”", "(see", "p.", "12)", "Zürich", "日本", "😀", "e.g.", "March", "3,", "named",
            "called", ",", ".", "!", "?", "...", "\n", "\n\n", "- ", "# ", "1. ", "'s", "—", "$x$", "{", "}", "has",
            "42", "rooms", "by", "Maria", "Santos", "at", "7:30", "p.m.", "Tuesday",
        ];
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..200 {
            let mut doc = String::new();
            for _ in 0..60 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                doc.push_str(pieces[(state % pieces.len() as u64) as usize]);
                if !state.is_multiple_of(3) {
                    doc.push(' ');
                }
            }
            let sentences = split_sentences(&doc);
            let pairs = extractive_qa(&doc, &sentences, &QaOptions { min_pairs: 3, ..Default::default() });
            assert_verbatim(&doc, &pairs);
            let qs: HashSet<String> = pairs.iter().map(|p| normalize_question(&p.question)).collect();
            assert_eq!(qs.len(), pairs.len());
        }
    }

    /// Development aid: `QA_DOC=path cargo test --release --lib print_extractive -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn print_extractive() {
        let doc = std::env::var("QA_DOC")
            .map(|p| std::fs::read_to_string(p).unwrap())
            .unwrap_or_else(|_| PARAGRAPH.to_string());
        let o = QaOptions { max_pairs: 100_000, ..Default::default() };
        for p in extract(&doc, &o) {
            eprintln!("{}  =>  {}", p.question, p.answer);
        }
    }
}
