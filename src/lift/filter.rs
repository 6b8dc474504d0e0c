//! FltLM ("FltLM: An Integrated Long-Context Large Language Model for Effective Context Filtering
//! and Understanding", Deng et al., §4), adapted to one document: a context filter that
//! scores the chunks of the in-context document and softly masks the irrelevant ones, in the same
//! forward pass that answers.
//!
//! - Layout (§4.1, "naive" strategy with query-aware contextualization): the user turn is
//!   `Question: q` + the truncated document cut into sentence-aligned chunks of at most
//!   `chunk_tokens`, each followed by a marker token + the question again.
//! - Score (eq. 3): `s_i = Linear(rms_normalise(h_N[marker_i]))`, `h_N` the residual stream after
//!   layer N (default: the middle layer), read by [`FilterHooks::after_layer`].
//! - Soft mask (eqs. 8–9): `I_i = min(0, w·s_i + b)` is added to the attention logits of every
//!   query at or after marker i for the keys of chunk i, in the layers above N
//!   ([`FilterHooks::attention_bias`]). Differentiable: trained jointly with the adapter.
//! - Loss (eq. 7): `log(1 + Σ_pos e^{-(s_i − m)/τ}) + log(1 + Σ_neg e^{s_i/τ})`, τ learnable; the
//!   total is `L_lm + λ·L_flt` (eq. 10). Labels come from the auxiliary QA evidence: the chunks that
//!   overlap it are positive, the others negative (evidence out of the window: no positive).
//!
//! The parameters are bundle extras (`filter.*`), saved with the adapter. Only QA examples (those
//! with a question) use the layout; contextualized-training examples keep theirs.

use super::plan::{Example, ExampleKind};
use super::prompt::{chat_with_context_at, elision_tokens, end_of_turn, kept_ranges};
use super::qa::QaPair;
use crate::document::Document;
use crate::model::{Adapter, ForwardHooks, Model, ModelConfig, Projection};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var, D};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct FilterOptions {
    pub enabled: bool,
    /// Layer N whose output gives the scores; the mask acts on layers N+1.. (default: the middle).
    pub layer: Option<usize>,
    /// Most document tokens per chunk (chunks end at sentence ends where possible).
    pub chunk_tokens: usize,
    /// Weight of the filter loss (eq. 10; the paper's 0.5).
    pub lambda: f64,
    /// Margin m of eq. 7: positive chunks should score above it.
    pub margin: f64,
    /// Initial temperature τ (learned).
    pub tau: f64,
    /// Learning rate of the filter's parameters relative to the adapter's (the paper trains them
    /// at 100× the LoRA rate; starting from a zero head and b = 0 they must move far in a few
    /// hundred steps).
    pub lr_scale: f64,
}

impl Default for FilterOptions {
    fn default() -> Self {
        Self { enabled: false, layer: None, chunk_tokens: 32, lambda: 0.5, margin: 1.0, tau: 1.0, lr_scale: 10.0 }
    }
}

impl FilterOptions {
    pub fn layer_for(&self, cfg: &ModelConfig) -> usize {
        self.layer.unwrap_or(cfg.num_layers / 2).min(cfg.num_layers.saturating_sub(1))
    }
}

/// The soft mask's initial `w`: FltLM's trained value (w = 0.289, b = −0.206, §5.3), rounded; the
/// paper expects `w > 0` (a low score, a strong mask).
pub const W_INIT: f32 = 0.3;

/// Extra tensor names in an adapter bundle.
pub const HEAD_WEIGHT: &str = "filter.head.weight";
pub const HEAD_BIAS: &str = "filter.head.bias";
pub const MASK_W: &str = "filter.mask.w";
pub const MASK_B: &str = "filter.mask.b";
pub const LOG_TAU: &str = "filter.log_tau";
/// `[layer, chunk_tokens]` as f32, so a loaded bundle lays prompts out as it was trained.
pub const CONFIG: &str = "filter.config";

/// The filter's parameters: a linear score head on layer N's hidden state, the soft-mask `w`, `b`
/// and the loss temperature (as log τ).
#[derive(Clone)]
pub struct Filter {
    pub layer: usize,
    pub chunk_tokens: usize,
    pub head_w: Tensor,
    pub head_b: Tensor,
    pub w: Tensor,
    pub b: Tensor,
    pub log_tau: Tensor,
    vars: Vec<Var>,
}

impl Filter {
    /// Trainable parameters: head 0 (every score 0), `w = W_INIT`, `b = 0`: every intensity
    /// starts at exactly 0 (FltLM's "risk-free" start: the model without the soft mask), on the
    /// kink of `min(0, ·)`, where `b` gets the LM loss's gradient; once the head scores chunks
    /// (eq. 7), distractors' scores go negative, their mask with them, and `w` gets gradient.
    /// (Starting at `w = 0` instead, the first step that raised `b` closed the mask for good:
    /// `w·s + b = b > 0` for every chunk, no gradient to either; measured on the first prepared
    /// base run, w = 0 and b = 0.118 after 29 steps.)
    pub fn new(cfg: &ModelConfig, opts: &FilterOptions, dev: &Device) -> Result<Self> {
        let zero = Tensor::zeros(1, DType::F32, dev)?;
        let plain = Self {
            layer: opts.layer_for(cfg),
            chunk_tokens: opts.chunk_tokens.max(1),
            head_w: Tensor::zeros(cfg.hidden_size, DType::F32, dev)?,
            head_b: zero.clone(),
            w: Tensor::new(&[W_INIT], dev)?,
            b: zero,
            log_tau: Tensor::new(&[opts.tau.max(1e-3).ln() as f32], dev)?,
            vars: Vec::new(),
        };
        Ok(plain.trainable()?)
    }

    /// The same values as fresh `Var`s (to resume training from a checkpoint).
    pub fn trainable(&self) -> candle_core::Result<Self> {
        let vars = [&self.head_w, &self.head_b, &self.w, &self.b, &self.log_tau]
            .into_iter()
            .map(|t| Var::from_tensor(&t.detach()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            head_w: vars[0].as_tensor().clone(),
            head_b: vars[1].as_tensor().clone(),
            w: vars[2].as_tensor().clone(),
            b: vars[3].as_tensor().clone(),
            log_tau: vars[4].as_tensor().clone(),
            vars,
            ..self.clone()
        })
    }

    /// Trainable parameters; empty for a detached copy.
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Plain-tensor copy (inference: no autograd graph).
    pub fn detached(&self) -> Self {
        Self {
            head_w: self.head_w.detach(),
            head_b: self.head_b.detach(),
            w: self.w.detach(),
            b: self.b.detach(),
            log_tau: self.log_tau.detach(),
            vars: Vec::new(),
            ..self.clone()
        }
    }

    /// The bundle extras holding this filter.
    pub fn to_extras(&self) -> Result<BTreeMap<String, Tensor>> {
        let config = Tensor::new(&[self.layer as f32, self.chunk_tokens as f32], self.head_w.device())?;
        Ok([
            (HEAD_WEIGHT, self.head_w.detach()),
            (HEAD_BIAS, self.head_b.detach()),
            (MASK_W, self.w.detach()),
            (MASK_B, self.b.detach()),
            (LOG_TAU, self.log_tau.detach()),
            (CONFIG, config),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect())
    }

    /// The filter stored in a bundle's extras (None when it has none), checked against the model.
    pub fn from_extras(extras: &BTreeMap<String, Tensor>, cfg: &ModelConfig) -> Result<Option<Self>> {
        let Some(config) = extras.get(CONFIG) else { return Ok(None) };
        let get = |name: &str, len: usize| -> Result<Tensor> {
            let t = extras.get(name).with_context(|| format!("adapter bundle has {CONFIG} but no {name}"))?;
            anyhow::ensure!(t.dims() == [len], "{name} has shape {:?}, expected [{len}]", t.dims());
            Ok(t.to_dtype(DType::F32)?)
        };
        let c = config.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        anyhow::ensure!(c.len() == 2, "{CONFIG} must hold [layer, chunk_tokens]");
        let layer = c[0] as usize;
        anyhow::ensure!(layer < cfg.num_layers, "filter layer {layer} does not exist ({} layers)", cfg.num_layers);
        Ok(Some(Self {
            layer,
            chunk_tokens: (c[1] as usize).max(1),
            head_w: get(HEAD_WEIGHT, cfg.hidden_size)?,
            head_b: get(HEAD_BIAS, 1)?,
            w: get(MASK_W, 1)?,
            b: get(MASK_B, 1)?,
            log_tau: get(LOG_TAU, 1)?,
            vars: Vec::new(),
        }))
    }

    /// Scores `[m]` of hidden states `[m, hidden]` (RMS-normalised, so the head's scale does not
    /// depend on the residual stream's magnitude at layer N).
    /// The filter's parameters are f32 on every device; on CUDA the residual stream is bf16.
    pub fn scores(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let h = h.to_dtype(self.head_w.dtype())?;
        let rms = (h.sqr()?.mean_keepdim(D::Minus1)? + 1e-6)?.sqrt()?;
        let h = h.broadcast_div(&rms)?;
        h.matmul(&self.head_w.unsqueeze(1)?)?.squeeze(1)?.broadcast_add(&self.head_b)
    }

    /// Mask intensities `I = min(0, w·s + b)` for scores `s`, with the left derivative (1) at
    /// `w·s + b = 0`: at the zero start (`w = b = 0`) every chunk sits exactly there, and a
    /// derivative of 0 there (what `x − relu(x)` gives, relu passing 1 at 0) would leave w and b
    /// without gradient forever. The gate `x ≤ 0` is a constant of the graph.
    pub fn intensities(&self, s: &Tensor) -> candle_core::Result<Tensor> {
        let x = s.broadcast_mul(&self.w)?.broadcast_add(&self.b)?;
        let gate = x.le(0.0)?.to_dtype(x.dtype())?;
        x * gate
    }
}

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

/// One chunk of the in-context document: document tokens `doc_start..doc_end`, at prompt
/// positions `start..end`, followed by its marker at `end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Chunk {
    pub doc_start: usize,
    pub doc_end: usize,
    pub start: usize,
    pub end: usize,
}

impl Chunk {
    pub fn marker(&self) -> usize {
        self.end
    }
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

pub use crate::document::{chunk_ranges, sentence_ends};

/// The marker token placed after each chunk (a line break: it reads naturally between sentences).
pub fn marker_token(model: &Model) -> Result<u32> {
    model.tokenizer.encode("\n", false)?.last().copied().context("the tokenizer cannot encode a line break")
}

/// The filter-layout prompt for `question` about `doc` with a document budget of `budget` tokens
/// (head and tail halves, as `head_tail`). `ends` from [`sentence_ends`].
pub fn build_prompt(
    model: &Model,
    doc: &[u32],
    ends: &[bool],
    question: &str,
    budget: usize,
    chunk_tokens: usize,
) -> Result<FilterPrompt> {
    let elision = elision_tokens(model)?;
    let (head_end, tail_start) = kept_ranges(doc.len(), budget, budget / 2, elision.len());
    let mut ranges = chunk_ranges(ends, 0, head_end, chunk_tokens);
    let head_chunks = ranges.len();
    let elide = (tail_start < doc.len()).then_some((head_chunks, elision.as_slice()));
    if tail_start < doc.len() {
        ranges.extend(chunk_ranges(ends, tail_start, doc.len(), chunk_tokens));
    }
    let (tokens, chunks) = layout(model, doc, &ranges, elide, question)?;
    Ok(FilterPrompt { tokens, chunks, head_end, tail_start })
}

/// The filter-layout prompt for `question` over the document ranges `ranges` of `doc` (in
/// order), one chunk per range: retrieved passages, which are the document's chunks already.
pub fn ranges_prompt(model: &Model, doc: &[u32], ranges: &[(usize, usize)], question: &str) -> Result<(Vec<u32>, Vec<Chunk>)> {
    layout(model, doc, ranges, None, question)
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
    let (tokens, chunks) = layout(model, &doc, &ranges, elide, question)?;
    // Every token of `passages` is in the prompt (what was elided never reached this function).
    Ok(FilterPrompt { tokens, chunks, head_end: doc.len(), tail_start: doc.len() })
}

/// `Question: q`, then each document range of `doc` followed by a marker (the `elide` tokens
/// before range `elide.0`), in the chat template with the question again after the context.
fn layout(
    model: &Model,
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
    let (tokens, offset) = chat_with_context_at(model, &ctx, question)?;
    for c in &mut chunks {
        c.start += offset;
        c.end += offset;
    }
    Ok((tokens, chunks))
}

/// Document token span of a QA pair's evidence (byte offsets → tokens of the prefix).
pub fn evidence_tokens(model: &Model, text: &str, pair: &QaPair) -> Result<(usize, usize)> {
    crate::document::token_span(model, text, pair.evidence_span)
}

/// A QA training example in the filter layout with its chunk labels.
#[derive(Clone, Debug)]
pub struct FilterExample {
    pub example: Example,
    pub chunks: Vec<Chunk>,
    pub positive: Vec<bool>,
    /// Prompt positions of the evidence tokens that are in the window.
    pub evidence: Vec<usize>,
}

/// The QA examples of `pairs` in the filter layout (same context budget as the plain ones).
pub fn qa_examples(
    model: &Model,
    document: &Document,
    pairs: &[QaPair],
    budget: usize,
    filter: &Filter,
) -> Result<Vec<FilterExample>> {
    let (text, doc) = (document.text.as_str(), document.tokens());
    let ends = document.sentence_ends(model)?;
    let eot = end_of_turn(model);
    pairs
        .iter()
        .enumerate()
        .map(|(i, pair)| {
            let p = build_prompt(model, doc, ends, &pair.question, budget, filter.chunk_tokens)?;
            let span = evidence_tokens(model, text, pair)?;
            let evidence = (span.0..span.1).filter_map(|d| p.position_of(d)).collect();
            let mut answer = model.tokenizer.encode(pair.answer.trim(), false)?;
            answer.extend_from_slice(&eot);
            let mut target = vec![false; p.tokens.len()];
            target.extend(std::iter::repeat_n(true, answer.len()));
            let mut tokens = p.tokens.clone();
            tokens.extend_from_slice(&answer);
            let positive = p.labels(span);
            Ok(FilterExample { example: Example { kind: ExampleKind::Qa(i), tokens, target, packing: None }, chunks: p.chunks, positive, evidence })
        })
        .collect()
}

/// The hooks of one forward pass (or one generation: prefill chunks and decode steps) through the
/// filter: reads scores at layer N, biases the attention of the layers above it.
pub struct FilterHooks<'a> {
    filter: &'a Filter,
    /// Its own copy of the layout, so a generation in a batch can hold its hooks.
    chunks: Vec<Chunk>,
    num_layers: usize,
    /// Positions already processed by earlier forward calls.
    seen: usize,
    /// Score `[1]` of each chunk once its marker has been through layer N.
    scores: Vec<Option<Tensor>>,
    /// The bias of the current forward call (layers above N), with its (q_start, q_len, k_len).
    bias: Option<(usize, usize, usize, Tensor)>,
}

impl<'a> FilterHooks<'a> {
    pub fn new(filter: &'a Filter, chunks: &[Chunk], num_layers: usize) -> Self {
        Self { filter, chunks: chunks.to_vec(), num_layers, seen: 0, scores: vec![None; chunks.len()], bias: None }
    }

    /// Scores `[n]` of every chunk (all markers must have been seen).
    pub fn scores(&self) -> Result<Tensor> {
        let s: Vec<Tensor> = self.scores.iter().map(|s| s.clone().context("a chunk marker was not run")).collect::<Result<_>>()?;
        anyhow::ensure!(!s.is_empty(), "no chunks");
        Ok(Tensor::cat(&s, 0)?)
    }

    /// Per chunk: (document start, end, score, mask intensity), for reports.
    pub fn report(&self) -> Result<Vec<ChunkScore>> {
        if self.chunks.is_empty() {
            return Ok(Vec::new());
        }
        let s = self.scores()?.detach();
        let m = self.filter.intensities(&s)?.to_vec1::<f32>()?;
        let s = s.to_vec1::<f32>()?;
        Ok(self
            .chunks
            .iter()
            .zip(s.iter().zip(&m))
            .map(|(c, (&score, &mask))| ChunkScore { start: c.doc_start, end: c.doc_end, score, mask })
            .collect())
    }

    /// The additive bias `[q_len, k_len]` for queries `start..start+q_len`: intensity `I_i` on the
    /// keys of chunk i for queries at or after its marker; None when no chunk is scored yet.
    fn build_bias(&self, start: usize, q_len: usize, k_len: usize) -> candle_core::Result<Option<Tensor>> {
        let known: Vec<usize> = (0..self.chunks.len()).filter(|&i| self.scores[i].is_some()).collect();
        if known.is_empty() {
            return Ok(None);
        }
        let dev = self.filter.w.device();
        let s = Tensor::cat(&known.iter().map(|&i| self.scores[i].clone().expect("known")).collect::<Vec<_>>(), 0)?;
        let values = Tensor::cat(&[&Tensor::zeros(1, DType::F32, dev)?, &self.filter.intensities(&s)?], 0)?;
        let mut idx = vec![0u32; q_len * k_len];
        for (slot, &i) in known.iter().enumerate() {
            let c = self.chunks[i];
            let first_q = c.marker().max(start) - start;
            for q in first_q..q_len {
                let row = &mut idx[q * k_len..(q + 1) * k_len];
                row[c.start.min(k_len)..c.end.min(k_len)].fill(slot as u32 + 1);
            }
        }
        let idx = Tensor::from_vec(idx, q_len * k_len, dev)?;
        values.index_select(&idx, 0)?.reshape((q_len, k_len)).map(Some)
    }
}

impl ForwardHooks for FilterHooks<'_> {
    fn after_layer(&mut self, layer: usize, hidden: &Tensor) -> candle_core::Result<()> {
        let t = hidden.dim(1)?;
        if layer == self.filter.layer {
            let here: Vec<usize> = (0..self.chunks.len())
                .filter(|&i| self.scores[i].is_none() && (self.seen..self.seen + t).contains(&self.chunks[i].marker()))
                .collect();
            if !here.is_empty() {
                let rows: Vec<u32> = here.iter().map(|&i| (self.chunks[i].marker() - self.seen) as u32).collect();
                let h = hidden.get(0)?.index_select(&Tensor::new(rows.as_slice(), hidden.device())?, 0)?;
                let s = self.filter.scores(&h)?;
                for (j, &i) in here.iter().enumerate() {
                    self.scores[i] = Some(s.narrow(0, j, 1)?);
                }
            }
            let k_len = self.seen + t;
            self.bias = self.build_bias(self.seen, t, k_len)?.map(|b| (self.seen, t, k_len, b));
        }
        if layer + 1 == self.num_layers {
            self.seen += t;
            self.bias = None;
        }
        Ok(())
    }

    /// A trainable filter's bias reaches the layers above its score layer: they must run in the
    /// graph even without an adapter below them (a frozen copy has no parameters).
    fn first_trainable_layer(&self) -> Option<usize> {
        (!self.filter.vars().is_empty()).then_some(self.filter.layer + 1)
    }

    fn attention_bias(&self, layer: usize, q_start: usize, q_len: usize, k_len: usize) -> candle_core::Result<Option<Tensor>> {
        if layer <= self.filter.layer {
            return Ok(None);
        }
        match &self.bias {
            Some((s, q, k, b)) if (*s, *q, *k) == (q_start, q_len, k_len) => Ok(Some(b.clone())),
            Some(_) => candle_core::bail!("filter bias computed for another forward call"),
            None => Ok(None),
        }
    }
}

/// One chunk's score as reported by `/ask` (document token offsets).
#[derive(Clone, Copy, Debug, Serialize, PartialEq)]
pub struct ChunkScore {
    pub start: usize,
    pub end: usize,
    pub score: f32,
    pub mask: f32,
}

impl ChunkScore {
    /// FltLM's relevance criterion (§4): the chunk is relevant when its score is positive.
    pub fn relevant(&self) -> bool {
        self.score > 0.0
    }
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

/// Runs the filter (prompt forward only) on `pairs` and counts evidence chunks kept.
pub fn evaluate(
    model: &Model,
    adapter: Option<&dyn Adapter>,
    filter: &Filter,
    document: &Document,
    pairs: &[QaPair],
    budget: usize,
) -> Result<FilterEval> {
    let (text, doc) = (document.text.as_str(), document.tokens());
    let ends = document.sentence_ends(model)?;
    let mut e = FilterEval::default();
    for pair in pairs {
        let p = build_prompt(model, doc, ends, &pair.question, budget, filter.chunk_tokens)?;
        let labels = p.labels(evidence_tokens(model, text, pair)?);
        if !labels.iter().any(|&l| l) {
            continue;
        }
        e.add(&score_prompt(model, adapter, filter, &p)?, &labels);
    }
    Ok(e)
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

    #[test]
    fn chunks_follow_sentences_and_stay_bounded() {
        // Sentences end after tokens 2, 5, 17 (a 12-token sentence), 19.
        let mut ends = vec![false; 20];
        for i in [2, 5, 17, 19] {
            ends[i] = true;
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
