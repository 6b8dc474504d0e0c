//! The training plan of one document: overlapping segments with contextualized training (CT)
//! examples and auxiliary-QA examples (the LIFT paper, "LIFT: Improving Long Context Understanding of Large Language Models through
//! Long Input Fine-Tuning", §3.1–3.3).

use crate::lift::answer::prompt::{chat_with_context, elision_tokens, end_of_turn, head_tail, RECITE_PROMPT};
use super::qa::QaPair;
use crate::model::{Model, Packing};
use anyhow::Result;
use rand::{Rng, SeedableRng};

/// The plan's and the trainer's seeded stream: ChaCha12, the same stream `rand`'s `StdRng` gives
/// for a seed, but one whose position can be read and set, so a checkpointed run resumes where
/// its draws left off.
pub type PlanRng = rand_chacha::ChaCha12Rng;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PlanOptions {
    /// Tokens per training segment ℓ (the authors use 2048 on GPUs; CPU default 256).
    pub window: usize,
    /// Tokens between segment starts (default ⌊3ℓ/8⌋).
    pub stride: Option<usize>,
    /// Head+tail document tokens placed before each segment (and each question, unless
    /// `qa_context_tokens` says otherwise) during training. Not the answering budget (`/ask`'s
    /// `context_tokens`); read under that older name from files and records.
    #[serde(alias = "context_tokens")]
    pub training_context_tokens: usize,
    /// Head+tail document tokens before each auxiliary question (default: `training_context_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qa_context_tokens: Option<usize>,
    /// Auxiliary questions packed into one training row behind their shared head+tail context
    /// (`model::Packing`: each sees the context and itself only, so the gradient is that of the
    /// separate examples summed, at a fraction of the tokens). 1: one question per row. Left out
    /// of the JSON (and so of document ids) when 1. No effect under a prepared base with an FltLM
    /// filter: its QA examples are built one question per row (`lift::absorb::plan`).
    #[serde(skip_serializing_if = "is_unpacked")]
    pub qa_pack: usize,
    /// Segments packed into one contextualized-training row behind one head+tail context (as
    /// `qa_pack`; the segments of a row share the context's head/tail split). 1: one per row.
    #[serde(skip_serializing_if = "is_unpacked")]
    pub segment_pack: usize,
    /// How an auxiliary question's context is laid out in training: the document's head and tail
    /// (the LIFT paper's layout, the default) or the passages an answer to that question would
    /// show (`passages`: BM25's for the question, within `qa_context` tokens), so the adapter trains
    /// in the layout it answers in. Left out of the JSON (and so of document ids) when the default.
    #[serde(skip_serializing_if = "QaLayout::is_head_tail")]
    pub qa_layout: QaLayout,
}

/// The context before an auxiliary question in training ([`PlanOptions::qa_layout`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum QaLayout {
    /// The document's head and tail within the budget (the LIFT paper's truncation).
    #[default]
    #[value(name = "head_tail")]
    HeadTail,
    /// The passages BM25 retrieves for the question within the budget, in document order: the
    /// layout of an answer under the `bm25` context policy (`answer::build_prompt`); adapters
    /// trained on it answer as well under `linked`, the default (docs/real-text.md). Saved
    /// records of the removed `recall` and `mixed` layouts (docs/recipe-search.md) read as this
    /// one.
    #[serde(alias = "recall", alias = "mixed")]
    Passages,
}

impl QaLayout {
    fn is_head_tail(&self) -> bool {
        *self == QaLayout::HeadTail
    }
}

fn is_unpacked(pack: &usize) -> bool {
    *pack <= 1
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            window: 256,
            stride: None,
            training_context_tokens: 128,
            qa_context_tokens: None,
            qa_pack: 1,
            segment_pack: 1,
            qa_layout: QaLayout::HeadTail,
        }
    }
}

impl PlanOptions {
    pub fn stride(&self) -> usize {
        self.stride.unwrap_or(self.window * 3 / 8).max(1)
    }

    pub fn qa_context(&self) -> usize {
        self.qa_context_tokens.unwrap_or(self.training_context_tokens)
    }
}

/// Token range `[start, end)` of the document.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub start: usize,
    pub end: usize,
}

/// Windows of `window` tokens every `stride` tokens; the last one ends at the document's end;
/// a document shorter than a window is one segment.
pub fn segments(n_tokens: usize, window: usize, stride: usize) -> Vec<Segment> {
    assert!(window > 0 && stride > 0);
    if n_tokens <= window {
        return vec![Segment { start: 0, end: n_tokens }];
    }
    let mut out = Vec::new();
    let mut start = 0;
    while start + window < n_tokens {
        out.push(Segment { start, end: start + window });
        start += stride;
    }
    out.push(Segment { start: n_tokens - window, end: n_tokens });
    out
}

/// Tokens a training row adds around its segment or question: the chat template and the recite
/// prompt (an upper bound for the cost estimate below).
const ROW_OVERHEAD_TOKENS: usize = 32;
/// A generous size of one auxiliary question with its answer.
const QA_PAIR_TOKENS: usize = 64;

/// About how many tokens go through the model to train a document of `doc_tokens`: every
/// segment's row (head+tail context, template, window) in each of `epochs[0] + epochs[1]` epochs,
/// and each of up to `qa_pairs` question rows in the `epochs[1]` epochs with QA. Unpacked rows:
/// an upper bound when packing is on. Known before any model work, so a server can refuse a
/// plan it would not finish.
pub fn planned_training_tokens(doc_tokens: usize, opts: &PlanOptions, epochs: [usize; 2], qa_pairs: usize) -> u64 {
    let window = opts.window.max(1);
    let segments = if doc_tokens <= window { 1 } else { (doc_tokens - window).div_ceil(opts.stride()) + 1 };
    let segment_row = (opts.training_context_tokens + ROW_OVERHEAD_TOKENS + window.min(doc_tokens.max(1))) as u64;
    let qa_row = qa_row_tokens(opts);
    let ct = segments as u64 * segment_row * (epochs[0] + epochs[1]) as u64;
    ct + qa_pairs as u64 * qa_row * epochs[1] as u64
}

/// About how many tokens one auxiliary question's row takes (its context, template, question and
/// answer).
pub fn qa_row_tokens(opts: &PlanOptions) -> u64 {
    (opts.qa_context() + ROW_OVERHEAD_TOKENS + QA_PAIR_TOKENS) as u64
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type", content = "index")]
pub enum ExampleKind {
    Segment(usize),
    Qa(usize),
}

/// One training row: `tokens[i]` is predicted (and counted in the loss) where `target[i]`.
/// A packed row (`packing`) holds several sequences behind a shared prefix; its loss is the mean
/// of their mean losses.
#[derive(Clone, Debug)]
pub struct Example {
    pub kind: ExampleKind,
    pub tokens: Vec<u32>,
    pub target: Vec<bool>,
    pub packing: Option<Packing>,
}

impl Example {
    pub fn target_count(&self) -> usize {
        self.target.iter().filter(|&&t| t).count()
    }
}

pub struct Plan {
    pub segments: Vec<Segment>,
    /// Auxiliary-QA examples, `qa_pack` questions per row (CT examples are drawn per epoch by
    /// `segment_example`).
    pub qa: Vec<Example>,
    opts: PlanOptions,
    elision: Vec<u32>,
}

impl Plan {
    /// The plan with QA examples that are already built (the prepared base's filter layout, one
    /// question per row).
    pub fn with_qa(model: &Model, doc: &[u32], qa: Vec<Example>, opts: &PlanOptions) -> Result<Self> {
        let segments = segments(doc.len(), opts.window, opts.stride());
        Ok(Self { segments, qa, opts: opts.clone(), elision: elision_tokens(model)? })
    }

    /// The plan with QA examples in the plain layout, `qa_pack` questions per row.
    pub fn new(model: &Model, doc: &[u32], qa_pairs: &[QaPair], opts: &PlanOptions) -> Result<Self> {
        let elision = elision_tokens(model)?;
        // QA examples: the same truncated document as at answer time (head and tail halves).
        let budget = opts.qa_context();
        let ctx = head_tail(doc, budget, budget / 2, &elision);
        let eot = end_of_turn(model);
        let mut singles = Vec::with_capacity(qa_pairs.len());
        for pair in qa_pairs {
            let prompt = chat_with_context(model, &ctx, &pair.question)?;
            let mut answer = model.encode_document(pair.answer.trim())?;
            answer.extend_from_slice(&eot);
            singles.push((prompt, answer));
        }
        // Row r holds questions r, r + rows, r + 2·rows, …: each row spans the whole document.
        let rows = qa_pairs.len().div_ceil(opts.qa_pack.max(1));
        let qa = (0..rows)
            .map(|r| {
                let members: Vec<&(Vec<u32>, Vec<u32>)> = singles.iter().skip(r).step_by(rows).collect();
                Self::packed_example(ExampleKind::Qa(r), &members)
            })
            .collect();
        Self::with_qa(model, doc, qa, opts)
    }

    fn example(kind: ExampleKind, prompt: Vec<u32>, answer: &[u32]) -> Example {
        let mut target = vec![false; prompt.len()];
        target.extend(std::iter::repeat_n(true, answer.len()));
        let mut tokens = prompt;
        tokens.extend_from_slice(answer);
        Example { kind, tokens, target, packing: None }
    }

    /// One row of (prompt, answer) pairs: the prompts' common prefix once, then each pair's
    /// rest of the prompt and its answer. A single pair is a plain example.
    fn packed_example(kind: ExampleKind, members: &[&(Vec<u32>, Vec<u32>)]) -> Example {
        if let [(prompt, answer)] = members {
            return Self::example(kind, prompt.clone(), answer);
        }
        // Every sequence keeps at least one prompt token, so no answer token is ever predicted
        // from another sequence's last token.
        let shortest = members.iter().map(|(p, _)| p.len()).min().unwrap_or(0);
        let first = &members[0].0;
        let prefix = members
            .iter()
            .map(|(p, _)| p.iter().zip(first).take_while(|(a, b)| a == b).count())
            .min()
            .unwrap_or(0)
            .min(shortest.saturating_sub(1));
        let mut tokens = first[..prefix].to_vec();
        let mut target = vec![false; prefix];
        let mut lens = Vec::with_capacity(members.len());
        for (prompt, answer) in members {
            let rest = &prompt[prefix..];
            tokens.extend_from_slice(rest);
            tokens.extend_from_slice(answer);
            target.extend(std::iter::repeat_n(false, rest.len()));
            target.extend(std::iter::repeat_n(true, answer.len()));
            lens.push(rest.len() + answer.len());
        }
        Example { kind, tokens, target, packing: Some(Packing::new(prefix, &lens)) }
    }

    /// The CT example of segment `i` with a head/tail split drawn from `rng`: the document's
    /// head and tail (a random split of the context budget), the recite prompt, then the segment,
    /// which alone is in the loss.
    pub fn segment_example(&self, model: &Model, doc: &[u32], i: usize, rng: &mut PlanRng) -> Result<Example> {
        self.segments_example(model, doc, &[i], rng)
    }

    /// One CT row of the segments `idx` behind a single context (one split drawn from `rng`);
    /// one index is a plain example.
    pub fn segments_example(&self, model: &Model, doc: &[u32], idx: &[usize], rng: &mut PlanRng) -> Result<Example> {
        let budget = self.opts.training_context_tokens;
        let ctx = if budget == 0 {
            Vec::new()
        } else {
            let head = rng.random_range(0..=budget);
            head_tail(doc, budget, head, &self.elision)
        };
        let prompt = chat_with_context(model, &ctx, RECITE_PROMPT)?;
        let members: Vec<(Vec<u32>, Vec<u32>)> =
            idx.iter().map(|&i| (prompt.clone(), doc[self.segments[i].start..self.segments[i].end].to_vec())).collect();
        Ok(Self::packed_example(ExampleKind::Segment(idx[0]), &members.iter().collect::<Vec<_>>()))
    }

    /// Deterministic generator for the plan's random choices.
    pub fn rng(seed: u64) -> PlanRng {
        PlanRng::seed_from_u64(seed)
    }

    pub fn options(&self) -> &PlanOptions {
        &self.opts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planned_training_tokens_counts_the_segments_and_grows_with_the_work() {
        let o = PlanOptions::default();
        for n in [10, 256, 257, 1000, 200_000] {
            let planned = planned_training_tokens(n, &o, [1, 0], 0);
            let rows = segments(n, o.window, o.stride()).len() as u64;
            assert_eq!(planned, rows * (o.training_context_tokens + ROW_OVERHEAD_TOKENS + o.window.min(n)) as u64, "n = {n}");
        }
        // The defaults on a document of the server's largest size stay under its default cap.
        let defaults = crate::lift::options::AbsorbOptions::default();
        let pairs = defaults.qa.for_document(200_000).max_pairs;
        let max_doc = planned_training_tokens(200_000, &defaults.plan, defaults.train.epochs, pairs);
        assert!(max_doc < 25_000_000, "{max_doc}");
        // The request on a 162-token document: stride 1 and 100 + 100 epochs.
        let absurd = PlanOptions { window: 32, stride: Some(1), ..PlanOptions::default() };
        assert!(
            planned_training_tokens(162, &absurd, [100, 100], 1000)
                > 10 * planned_training_tokens(162, &o, [3, 5], 256)
        );
    }

    #[test]
    fn segments_cover_every_token_with_stride_and_last_window() {
        for (n, w, s) in
            [(1000, 256, 96), (257, 256, 96), (256, 256, 96), (10, 256, 96), (5000, 512, 192), (777, 100, 37)]
        {
            let segs = segments(n, w, s);
            let mut covered = vec![false; n];
            for seg in &segs {
                assert!(seg.end <= n && seg.start < seg.end);
                assert_eq!(seg.end - seg.start, w.min(n));
                covered[seg.start..seg.end].iter_mut().for_each(|c| *c = true);
            }
            assert!(covered.iter().all(|&c| c), "n={n}: a token is not covered");
            assert_eq!(segs.last().unwrap().end, n, "the last window ends at the document's end");
            for pair in segs.windows(2).take(segs.len().saturating_sub(2)) {
                assert_eq!(pair[1].start - pair[0].start, s, "stride");
            }
            if segs.len() >= 2 {
                let k = segs.len();
                assert!(segs[k - 1].start - segs[k - 2].start <= s, "last window starts within one stride");
            }
        }
        assert_eq!(segments(10, 256, 96), vec![Segment { start: 0, end: 10 }]);
        assert_eq!(PlanOptions { window: 2048, ..Default::default() }.stride(), 768);
    }

    #[test]
    fn packing_stays_out_of_the_options_json_until_it_is_used() {
        // Document ids hash this JSON: adding the packing options must not change the ids of
        // documents absorbed without packing.
        let plain = serde_json::to_value(PlanOptions::default()).unwrap();
        assert!(plain.get("qa_pack").is_none() && plain.get("segment_pack").is_none(), "{plain}");
        let packed = PlanOptions { qa_pack: 8, segment_pack: 2, ..Default::default() };
        let json = serde_json::to_value(&packed).unwrap();
        assert_eq!((json["qa_pack"].as_u64(), json["segment_pack"].as_u64()), (Some(8), Some(2)));
        assert_eq!(serde_json::from_value::<PlanOptions>(json).unwrap(), packed);
        assert_eq!(serde_json::from_value::<PlanOptions>(plain).unwrap(), PlanOptions::default());
    }
}
