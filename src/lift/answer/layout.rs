//! The FltLM prompt layout and the filter's loss ("FltLM: An Integrated Long-Context Large
//! Language Model for Effective Context Filtering and Understanding", Deng et al., §4): the layout
//! that puts a document's context in FltLM's chunks, each followed by a marker, and the loss the
//! filter trains with. The filter itself is not here: it is the prepared base's
//! ([`crate::model::filter`], one for every document, trained by `prepare-base`); it scores the
//! chunks of the in-context document and softly masks the irrelevant ones, in the same forward
//! pass that answers.
//!
//! - Layout (§4.1, "naive" strategy with query-aware contextualization): the user turn is
//!   `Question: q` + the truncated document cut into sentence-aligned chunks of at most
//!   `chunk_tokens`, each followed by a marker token + the question again.
//! - Score (eq. 3) and soft mask (eqs. 8–9): the filter itself, a part of the model
//!   ([`crate::model::filter`]). Differentiable: `prepare-base` trains it with the base's LoRA.
//! - Loss (eq. 7): `log(1 + Σ_pos e^{-(s_i − m)/τ}) + log(1 + Σ_neg e^{s_i/τ})`, τ learnable; the
//!   total is `L_lm + λ·L_flt` (eq. 10). Labels come from the auxiliary QA evidence: the chunks that
//!   overlap it are positive, the others negative (evidence out of the window: no positive).
//!
//! Only QA examples (those with a question) use the layout
//! ([`crate::lift::absorb::qa_examples`]); contextualized-training examples keep theirs.

use super::prompt::{chat_after_turns, elision_tokens, kept_ranges};
pub use crate::model::filter::{
    Chunk, ChunkScore, Filter, FilterHooks, FilterOptions, MaskCalibration, CONFIG, HEAD_BIAS, HEAD_WEIGHT, LOG_TAU, MASK_B, MASK_W, W_INIT,
};
use crate::model::{Adapter, ChatMessage, Model, Projection};
use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use serde::Serialize;

/// Eq. 7: `log(1 + Σ_pos e^{-(s_i − m)/τ}) + log(1 + Σ_neg e^{s_i/τ})` for scores `[n]`.
pub fn filter_loss(scores: &Tensor, positive: &[bool], margin: f64, log_tau: &Tensor) -> candle_core::Result<Tensor> {
    let dev = scores.device();
    let inv_tau = log_tau.neg()?.exp()?;
    let pick = |want: bool| -> candle_core::Result<Option<Tensor>> {
        let idx: Vec<u32> = positive.iter().enumerate().filter(|(_, &p)| p == want).map(|(i, _)| i as u32).collect();
        if idx.is_empty() {
            return Ok(None);
        }
        scores.index_select(&Tensor::new(idx.as_slice(), dev)?, 0).map(Some)
    };
    let mut total = Tensor::zeros(1, DType::F32, dev)?;
    if let Some(pos) = pick(true)? {
        total = (total + log1p_sum_exp(&(pos.affine(-1.0, margin)?.broadcast_mul(&inv_tau)?))?)?;
    }
    if let Some(neg) = pick(false)? {
        total = (total + log1p_sum_exp(&neg.broadcast_mul(&inv_tau)?)?)?;
    }
    total.squeeze(0)
}

/// `log(1 + Σ e^{x_i})`, stable (log-sum-exp over `[0, x…]`, the shift detached).
fn log1p_sum_exp(x: &Tensor) -> candle_core::Result<Tensor> {
    let all = Tensor::cat(&[&Tensor::zeros(1, x.dtype(), x.device())?, x], 0)?;
    let m = all.max_keepdim(0)?.detach();
    all.broadcast_sub(&m)?.exp()?.sum_keepdim(0)?.log()? + m
}

/// A prompt in the filter layout.
#[derive(Clone, Debug)]
pub struct FilterPrompt {
    pub tokens: Vec<u32>,
    pub chunks: Vec<Chunk>,
    /// Document tokens `[0, head_end)` and `[tail_start, n)` are in the prompt.
    pub head_end: usize,
    pub tail_start: usize,
}

impl FilterPrompt {
    /// Prompt position of document token `d`, when it is in the prompt.
    pub fn position_of(&self, d: usize) -> Option<usize> {
        self.chunks.iter().find(|c| (c.doc_start..c.doc_end).contains(&d)).map(|c| c.start + d - c.doc_start)
    }

    /// Which chunks overlap document tokens `span` (evidence labels).
    pub fn labels(&self, span: (usize, usize)) -> Vec<bool> {
        self.chunks.iter().map(|c| c.doc_start < span.1 && span.0 < c.doc_end).collect()
    }
}

pub use crate::document::{breaks, chunk_ranges, Break};

/// The marker token placed after each chunk (a line break: it reads naturally between sentences).
pub fn marker_token(model: &Model) -> Result<u32> {
    model.tokenizer.encode("\n", false)?.last().copied().context("the tokenizer cannot encode a line break")
}

/// The filter-layout prompt for `question` about `doc` with a document budget of `budget` tokens
/// (head and tail halves, as `head_tail`). `breaks` from [`breaks`].
pub fn build_prompt(
    model: &Model,
    doc: &[u32],
    breaks: &[Break],
    question: &str,
    budget: usize,
    chunk_tokens: usize,
) -> Result<FilterPrompt> {
    build_prompt_after(model, &[], doc, breaks, question, budget, chunk_tokens)
}

/// [`build_prompt`] after the earlier turns of a conversation (see
/// [`chat_after_turns`](super::prompt::chat_after_turns)).
pub fn build_prompt_after(
    model: &Model,
    turns: &[ChatMessage],
    doc: &[u32],
    breaks: &[Break],
    question: &str,
    budget: usize,
    chunk_tokens: usize,
) -> Result<FilterPrompt> {
    let elision = elision_tokens(model)?;
    let (head_end, tail_start) = kept_ranges(doc.len(), budget, budget / 2, elision.len());
    let mut ranges = chunk_ranges(breaks, 0, head_end, chunk_tokens);
    let head_chunks = ranges.len();
    let elide = (tail_start < doc.len()).then_some((head_chunks, elision.as_slice()));
    if tail_start < doc.len() {
        ranges.extend(chunk_ranges(breaks, tail_start, doc.len(), chunk_tokens));
    }
    let (tokens, chunks) = layout(model, turns, doc, &ranges, elide, question)?;
    Ok(FilterPrompt { tokens, chunks, head_end, tail_start })
}

/// The filter-layout prompt for `question` over the document ranges `ranges` of `doc` (in
/// order), one chunk per range: retrieved passages, which are the document's chunks already.
pub fn ranges_prompt(model: &Model, doc: &[u32], ranges: &[(usize, usize)], question: &str) -> Result<(Vec<u32>, Vec<Chunk>)> {
    ranges_prompt_after(model, &[], doc, ranges, question)
}

/// [`ranges_prompt`] after the earlier turns of a conversation.
pub fn ranges_prompt_after(
    model: &Model,
    turns: &[ChatMessage],
    doc: &[u32],
    ranges: &[(usize, usize)],
    question: &str,
) -> Result<(Vec<u32>, Vec<Chunk>)> {
    layout(model, turns, doc, ranges, None, question)
}

/// The filter-layout prompt for `question` over `passages` (token ids), one chunk per passage:
/// the layout of the prepared base's training examples, whose passages are already
/// sentence-aligned chunks. `elide_before`: the elision marker goes before that passage, as
/// [`build_prompt`] joins the head and tail of a truncated document.
pub fn passages_prompt(
    model: &Model,
    passages: &[Vec<u32>],
    question: &str,
    elide_before: Option<usize>,
) -> Result<FilterPrompt> {
    let doc: Vec<u32> = passages.concat();
    let mut ranges = Vec::with_capacity(passages.len());
    let mut at = 0;
    for p in passages {
        ranges.push((at, at + p.len()));
        at += p.len();
    }
    let elision = elision_tokens(model)?;
    let elide = elide_before.map(|i| (i, elision.as_slice()));
    let (tokens, chunks) = layout(model, &[], &doc, &ranges, elide, question)?;
    // Every token of `passages` is in the prompt (what was elided never reached this function).
    Ok(FilterPrompt { tokens, chunks, head_end: doc.len(), tail_start: doc.len() })
}

/// `Question: q`, then each document range of `doc` followed by a marker (the `elide` tokens
/// before range `elide.0`), in the chat template with the question again after the context;
/// `turns`, a conversation's earlier turns, before them.
fn layout(
    model: &Model,
    turns: &[ChatMessage],
    doc: &[u32],
    ranges: &[(usize, usize)],
    elide: Option<(usize, &[u32])>,
    question: &str,
) -> Result<(Vec<u32>, Vec<Chunk>)> {
    let marker = marker_token(model)?;
    let mut ctx = model.tokenizer.encode(&format!("Question: {}\n\n", question.trim()), false)?;
    let mut chunks = Vec::with_capacity(ranges.len());
    for (i, &(a, b)) in ranges.iter().enumerate() {
        if let Some((_, elision)) = elide.filter(|(at, _)| *at == i) {
            ctx.extend_from_slice(elision);
        }
        // Positions are relative to the context until its offset in the prompt is known.
        let start = ctx.len();
        ctx.extend_from_slice(&doc[a..b]);
        chunks.push(Chunk { doc_start: a, doc_end: b, start, end: ctx.len() });
        ctx.push(marker);
    }
    let (tokens, offset) = chat_after_turns(model, turns, &ctx, question)?;
    for c in &mut chunks {
        c.start += offset;
        c.end += offset;
    }
    Ok((tokens, chunks))
}

/// An adapter that reports `first` as its lowest layer, so the trainable path keeps gradients
/// through the layers the soft mask acts on even when the adapter starts higher.
pub struct FromLayer<'a> {
    pub inner: &'a dyn Adapter,
    pub first: usize,
}

impl Adapter for FromLayer<'_> {
    fn linear_delta(&self, layer: usize, proj: Projection, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.inner.linear_delta(layer, proj, x)
    }
    fn mix_attention(&self, layer: usize, q: &Tensor, attn: Tensor) -> candle_core::Result<Tensor> {
        self.inner.mix_attention(layer, q, attn)
    }
    fn first_layer(&self) -> usize {
        self.inner.first_layer().min(self.first)
    }
    fn decode_mix(&self, layer: usize) -> crate::model::DecodeMix<'_> {
        self.inner.decode_mix(layer)
    }
}

/// Evidence recall of the filter at the paper's relevance criterion: a chunk counts as relevant
/// ("kept") when its score `s_i > 0`, over QA pairs whose evidence is in the window.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FilterEval {
    pub questions: usize,
    pub evidence_chunks: usize,
    pub evidence_kept: usize,
    pub other_chunks: usize,
    pub other_kept: usize,
    pub mean_evidence_score: f64,
    pub mean_other_score: f64,
    #[serde(skip)]
    score_sums: (f64, f64),
}

impl FilterEval {
    /// Counts one question's chunks (`labels`: evidence or not).
    pub fn add(&mut self, report: &[ChunkScore], labels: &[bool]) {
        self.questions += 1;
        for (c, &pos) in report.iter().zip(labels) {
            let kept = c.relevant() as usize;
            if pos {
                self.evidence_chunks += 1;
                self.evidence_kept += kept;
                self.score_sums.0 += c.score as f64;
            } else {
                self.other_chunks += 1;
                self.other_kept += kept;
                self.score_sums.1 += c.score as f64;
            }
        }
        self.mean_evidence_score = self.score_sums.0 / self.evidence_chunks.max(1) as f64;
        self.mean_other_score = self.score_sums.1 / self.other_chunks.max(1) as f64;
    }

    /// Precision and recall of "relevant" (`s_i > 0`) against the evidence labels.
    pub fn precision_recall(&self) -> (f64, f64) {
        let kept = self.evidence_kept + self.other_kept;
        (self.evidence_kept as f64 / kept.max(1) as f64, self.evidence_kept as f64 / self.evidence_chunks.max(1) as f64)
    }
}

/// The chunk scores of a filter prompt (one prefill, no generation).
pub fn score_prompt(model: &Model, adapter: Option<&dyn Adapter>, filter: &Filter, p: &FilterPrompt) -> Result<Vec<ChunkScore>> {
    let mut hooks = FilterHooks::new(filter, &p.chunks, model.config().num_layers);
    let mut cache = crate::model::KvCache::new(model.config().num_layers);
    crate::model::generate::prefill(model, &p.tokens, &mut cache, adapter, &mut hooks)?;
    hooks.report()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use crate::model::ForwardHooks;
    use std::collections::BTreeMap;

    #[test]
    fn chunks_follow_sentences_and_stay_bounded() {
        // Sentences end after tokens 2, 5, 17 (a 12-token sentence), 19; no word breaks: a long
        // sentence is cut every `max` tokens.
        let mut ends = vec![Break::Inside; 20];
        for i in [2, 5, 17, 19] {
            ends[i] = Break::Sentence;
        }
        let c = chunk_ranges(&ends, 0, 20, 6);
        assert_eq!(c, vec![(0, 6), (6, 12), (12, 18), (18, 20)]);
        let c = chunk_ranges(&ends, 0, 20, 8);
        assert_eq!(c, vec![(0, 6), (6, 14), (14, 20)]);
        for (a, b) in chunk_ranges(&ends, 3, 20, 4) {
            assert!(b - a <= 4 && a >= 3 && b <= 20);
        }
        assert!(chunk_ranges(&ends, 5, 5, 4).is_empty());
    }

    #[test]
    fn a_long_sentence_is_cut_between_words() {
        // One 12-token sentence; words end after tokens 2, 3, 7 and 9 (tokens 4..=7 are one word).
        let mut breaks = vec![Break::Inside; 12];
        for i in [2, 3, 7, 9] {
            breaks[i] = Break::Word;
        }
        breaks[11] = Break::Sentence;
        assert_eq!(chunk_ranges(&breaks, 0, 12, 6), vec![(0, 4), (4, 10), (10, 12)]);
        // A word longer than a chunk is still cut at `max`.
        assert_eq!(chunk_ranges(&breaks, 4, 12, 3), vec![(4, 7), (7, 10), (10, 12)]);
    }

    #[test]
    fn filter_loss_matches_hand_computation() {
        let dev = Device::Cpu;
        let s = Tensor::new(&[2.0f32, -1.0, 0.5, 3.0], &dev).unwrap();
        let pos = [true, false, false, true];
        let (m, tau) = (1.0f64, 0.5f64);
        let log_tau = Tensor::new(&[tau.ln() as f32], &dev).unwrap();
        let got = filter_loss(&s, &pos, m, &log_tau).unwrap().to_scalar::<f32>().unwrap() as f64;
        let want = (1.0 + (-(2.0 - m) / tau).exp() + (-(3.0 - m) / tau).exp()).ln()
            + (1.0 + (-1.0f64 / tau).exp() + (0.5f64 / tau).exp()).ln();
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        // No positive chunk: only the negative term.
        let got = filter_loss(&s, &[false; 4], m, &log_tau).unwrap().to_scalar::<f32>().unwrap() as f64;
        let want = (1.0 + [2.0f64, -1.0, 0.5, 3.0].iter().map(|x| (x / tau).exp()).sum::<f64>()).ln();
        assert!((got - want).abs() < 1e-5, "{got} vs {want}");
        // Large scores stay finite.
        let big = Tensor::new(&[500.0f32, -500.0], &dev).unwrap();
        assert!(filter_loss(&big, &[false, true], m, &log_tau).unwrap().to_scalar::<f32>().unwrap().is_finite());
    }

    #[test]
    fn soft_mask_biases_exactly_the_keys_of_scored_chunks_after_their_markers() {
        let dev = Device::Cpu;
        let mut cfg = crate::testing::smollm2_135m_config();
        cfg.hidden_size = 4;
        cfg.num_layers = 4;
        let mut f = Filter::new(&cfg, &FilterOptions { layer: Some(1), ..Default::default() }, &dev).unwrap();
        f = f.detached();
        f.head_w = Tensor::new(&[1.0f32, 0.0, 0.0, 0.0], &dev).unwrap();
        f.w = Tensor::new(&[2.0f32], &dev).unwrap();
        f.b = Tensor::new(&[0.5f32], &dev).unwrap();
        // Two chunks: tokens 2..4 (marker 4) and 5..8 (marker 8); 10 positions.
        let chunks = [Chunk { doc_start: 0, doc_end: 2, start: 2, end: 4 }, Chunk { doc_start: 2, doc_end: 5, start: 5, end: 8 }];
        let mut hidden = vec![0.0f32; 10 * 4];
        // Marker rows: chunk 0 normalised first component 1 → s = 2·... ; chunk 1 negative.
        hidden[4 * 4..4 * 4 + 4].copy_from_slice(&[-3.0, 1.0, 1.0, 1.0]);
        hidden[8 * 4..8 * 4 + 4].copy_from_slice(&[1.0, 1.0, 1.0, 1.0]);
        let h = Tensor::from_vec(hidden, (1, 10, 4), &dev).unwrap();
        let mut hooks = FilterHooks::new(&f, &chunks, 4);
        assert!(hooks.attention_bias(2, 0, 10, 10).unwrap().is_none(), "nothing scored yet");
        hooks.after_layer(0, &h).unwrap();
        hooks.after_layer(1, &h).unwrap();
        assert!(hooks.attention_bias(1, 0, 10, 10).unwrap().is_none(), "layer N itself is not masked");
        let bias = hooks.attention_bias(2, 0, 10, 10).unwrap().unwrap().to_vec2::<f32>().unwrap();
        // s0 = -3/rms(-3,1,1,1) = -3/sqrt(3) ; I0 = min(0, 2 s0 + 0.5); s1 = 1 → I1 = min(0, 2.5) = 0.
        let i0 = (2.0 * (-3.0 / 3f32.sqrt()) + 0.5).min(0.0);
        assert!(i0 < -1.0);
        for q in 0..10 {
            for k in 0..10 {
                let want = if q >= 4 && (2..4).contains(&k) { i0 } else { 0.0 };
                assert!((bias[q][k] - want).abs() < 1e-5, "q={q} k={k}: {} vs {want}", bias[q][k]);
            }
        }
        let r = hooks.report().unwrap();
        assert_eq!((r[0].start, r[0].end, r[1].start, r[1].end), (0, 2, 2, 5));
        assert!((r[0].mask - i0).abs() < 1e-5 && r[1].mask == 0.0 && (r[1].score - 1.0).abs() < 1e-5);

        // Incremental (prefill in two calls, then a decode step): each call sees its own rows.
        let mut hooks = FilterHooks::new(&f, &chunks, 4);
        for l in 0..4 {
            if l == 2 {
                let b = hooks.attention_bias(2, 0, 6, 6).unwrap().unwrap().to_vec2::<f32>().unwrap();
                assert!((b[5][2] - i0).abs() < 1e-5 && b[3][2] == 0.0 && b[5][5] == 0.0);
            }
            hooks.after_layer(l, &h.narrow(1, 0, 6).unwrap()).unwrap();
        }
        for l in 0..4 {
            if l == 3 {
                let b = hooks.attention_bias(3, 6, 4, 10).unwrap().unwrap().to_vec2::<f32>().unwrap();
                assert_eq!(b.len(), 4);
                assert!((b[0][3] - i0).abs() < 1e-5 && b[0][6] == 0.0 && b[3][6] == 0.0);
            }
            hooks.after_layer(l, &h.narrow(1, 6, 4).unwrap()).unwrap();
        }
        assert!(hooks.attention_bias(3, 6, 4, 10).unwrap().is_none(), "cleared after the last layer");
    }

    #[test]
    fn mask_parameters_get_gradient_at_the_zero_start() {
        let dev = Device::Cpu;
        let cfg = crate::testing::smollm2_135m_config();
        let fresh = Filter::new(&cfg, &FilterOptions::default(), &dev).unwrap();
        // A fresh filter scores every chunk 0: every intensity exactly 0, the plain model.
        let zeros = fresh.scores(&Tensor::ones((3, cfg.hidden_size), DType::F32, &dev).unwrap()).unwrap();
        assert_eq!(fresh.intensities(&zeros).unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 3]);
        assert_eq!(fresh.w.to_vec1::<f32>().unwrap(), vec![W_INIT]);
        let mut f = fresh.detached();
        f.w = Tensor::zeros(1, DType::F32, &dev).unwrap();
        let f = f.trainable().unwrap();
        // w = b = 0: every intensity is exactly 0, on the kink of min(0, ·).
        let s = Tensor::new(&[1.5f32, -2.0, 0.5], &dev).unwrap();
        let c = Tensor::new(&[0.3f32, -0.7, 1.1], &dev).unwrap();
        let i = f.intensities(&s).unwrap();
        assert_eq!(i.to_vec1::<f32>().unwrap(), vec![0.0; 3]);
        let loss = (&i * &c).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let gw = grads.get(&f.w).expect("w has a gradient").to_vec1::<f32>().unwrap()[0];
        let gb = grads.get(&f.b).expect("b has a gradient").to_vec1::<f32>().unwrap()[0];
        // dL/dw = Σ c_i s_i, dL/db = Σ c_i (left derivative 1 at the kink).
        let want_w = 0.3 * 1.5 + 0.7 * 2.0 + 1.1 * 0.5;
        let want_b = 0.3 - 0.7 + 1.1;
        assert!((gw - want_w).abs() < 1e-5, "dL/dw {gw} vs {want_w}");
        assert!((gb - want_b).abs() < 1e-5, "dL/db {gb} vs {want_b}");
        // Away from the kink: min(0, x) with gradient only where x < 0.
        let mut g = f.detached();
        g.w = Tensor::new(&[1.0f32], &dev).unwrap();
        g.b = Tensor::new(&[-1.0f32], &dev).unwrap();
        assert_eq!(g.intensities(&s).unwrap().to_vec1::<f32>().unwrap(), vec![0.0, -3.0, -0.5]);
    }

    #[test]
    fn the_relative_mask_opens_what_scores_near_the_best_and_round_trips() {
        let dev = Device::Cpu;
        let cfg = crate::testing::smollm2_135m_config();
        let mut f = Filter::new(&cfg, &FilterOptions { enabled: true, ..Default::default() }, &dev).unwrap().detached();
        f.w = Tensor::new(&[0.5f32], &dev).unwrap();
        f.b = Tensor::new(&[-10.0f32], &dev).unwrap();
        // Scores far below any absolute threshold: b closes every chunk.
        let s = Tensor::new(&[-9.0f32, -10.5, -14.0, -20.0], &dev).unwrap();
        assert!(f.intensities(&s).unwrap().to_vec1::<f32>().unwrap().iter().all(|&i| i < -10.0));
        // Against the best: within the margin open, the rest by their distance below it, b unused.
        f.calibration = MaskCalibration::parse("relative:2").unwrap();
        assert_eq!(f.intensities(&s).unwrap().to_vec1::<f32>().unwrap(), vec![0.0, 0.0, -1.5, -4.5]);
        assert_eq!(f.relevance(&s).unwrap().to_vec1::<f32>().unwrap(), vec![2.0, 0.5, -3.0, -9.0]);
        f.calibration = MaskCalibration::parse("relative:2:2").unwrap();
        assert_eq!(f.intensities(&s).unwrap().to_vec1::<f32>().unwrap(), vec![0.0, 0.0, -3.0, -9.0]);
        f.calibration = MaskCalibration::Off;
        assert_eq!(f.intensities(&s).unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 4]);
        assert!(f.to_extras().is_err(), "a filter without its mask is not stored");
        for name in ["absolute", "relative:2", "relative:1.5:3"] {
            f.calibration = MaskCalibration::parse(name).unwrap();
            assert_eq!(f.calibration.name(), name);
            let back = Filter::from_extras(&f.to_extras().unwrap(), &cfg).unwrap().unwrap();
            assert_eq!(back.calibration, f.calibration);
        }
        // Absorbs may train under another calibration than answers use; stored with the filter.
        f.calibration = MaskCalibration::parse("relative:2").unwrap();
        for absorb in [None, Some("absolute"), Some("relative:1:3"), Some("relative:2")] {
            f.absorb_mask = absorb.map(|a| MaskCalibration::parse(a).unwrap());
            let back = Filter::from_extras(&f.to_extras().unwrap(), &cfg).unwrap().unwrap();
            assert_eq!(back.calibration, f.calibration, "{absorb:?}");
            assert_eq!(back.for_absorb().calibration, f.absorb_mask.unwrap_or(f.calibration), "{absorb:?}");
            assert_eq!(back.for_absorb().intensities(&s).unwrap().to_vec1::<f32>().unwrap(), f.for_absorb().intensities(&s).unwrap().to_vec1::<f32>().unwrap());
        }
        f.absorb_mask = Some(MaskCalibration::Off);
        assert!(f.to_extras().is_err(), "absorbs train under a mask");
        for bad in ["relative:-1", "relative:x", "relative:1:2:3", "soft"] {
            assert!(MaskCalibration::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn relevance_is_a_positive_score_not_a_mask_above_minus_one() {
        let chunk = |score: f32, mask: f32| ChunkScore { start: 0, end: 1, score, mask };
        // At the zero start every mask is 0 (> −1), yet a negative score is not relevant.
        let report = [chunk(0.8, 0.0), chunk(-0.4, 0.0), chunk(0.2, 0.0), chunk(-3.0, -2.0)];
        let mut e = FilterEval::default();
        e.add(&report, &[true, true, false, false]);
        assert_eq!((e.evidence_chunks, e.evidence_kept, e.other_chunks, e.other_kept), (2, 1, 2, 1));
        assert_eq!(e.precision_recall(), (0.5, 0.5));
        assert!((e.mean_evidence_score - 0.2).abs() < 1e-6 && (e.mean_other_score + 1.4).abs() < 1e-6);
    }

    #[test]
    fn extras_round_trip() {
        let dev = Device::Cpu;
        let cfg = crate::testing::smollm2_135m_config();
        let f = Filter::new(&cfg, &FilterOptions { enabled: true, chunk_tokens: 24, ..Default::default() }, &dev).unwrap();
        let back = Filter::from_extras(&f.to_extras().unwrap(), &cfg).unwrap().unwrap();
        assert_eq!((back.layer, back.chunk_tokens), (15, 24));
        assert_eq!(back.w.to_vec1::<f32>().unwrap(), vec![W_INIT]);
        assert!(Filter::from_extras(&BTreeMap::new(), &cfg).unwrap().is_none());
        let mut bad = f.to_extras().unwrap();
        bad.remove(MASK_B);
        assert!(Filter::from_extras(&bad, &cfg).is_err());
    }
}
