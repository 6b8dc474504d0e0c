//! The FltLM context filter ("FltLM: An Integrated Long-Context Large Language Model for
//! Effective Context Filtering and Understanding", Deng et al., §4) as a part of the model: its
//! parameters, the chunk scores it reads at layer N and the soft mask it adds to the attention
//! of the layers above. How prompts are laid out for it and its loss live in `lift::answer::layout`
//! (its QA examples in `lift::absorb::qa_examples`, its training in `base::train`); a prepared
//! base installs a trained one under every answer.
//!
//! - Score (eq. 3): `s_i = Linear(rms_normalise(h_N[marker_i]))`, `h_N` the residual stream after
//!   layer N (default: the middle layer), read by [`FilterHooks::after_layer`].
//! - Soft mask (eqs. 8–9): `I_i = min(0, w·s_i + b)` is added to the attention logits of every
//!   query at or after marker i for the keys of chunk i, in the layers above N
//!   ([`FilterHooks::attention_bias`]).

use super::{ForwardHooks, ModelConfig};
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
/// `[margin]` or `[margin, strength]` when the mask is calibrated relative to the best chunk
/// ([`MaskCalibration::Relative`]; strength 1 when left out); absent: FltLM's absolute threshold.
pub const RELATIVE_MARGIN: &str = "filter.mask.relative_margin";
/// The calibration documents' absorbs train under when it differs from the answers' one:
/// `[0]` absolute, `[1, margin, strength]` relative; absent: the answers' calibration.
pub const ABSORB_MASK: &str = "filter.mask.absorb";

/// How chunk scores become mask intensities.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaskCalibration {
    /// FltLM's eq. 8, `I = min(0, w·s + b)`: a threshold learned in the layout the filter
    /// trained on (the prepared base's head-and-tail 32-token chunks). In another layout (the
    /// BM25 passages answers read) the ranking holds but the threshold does not: it left the
    /// evidence open in only 36–39% of the eval split's answers (docs/prepared-base.md).
    Absolute,
    /// The same ranking, thresholded against the best-scored chunk in context:
    /// `I = min(0, strength·w·(s − max s + margin))`. The best chunk, and every chunk within
    /// `margin` of it, is open; the rest are closed by how far they fall below it. Independent
    /// of the layout's score level.
    Relative { margin: f32, strength: f32 },
    /// Scores only, no mask (to measure what the mask does).
    Off,
}

impl MaskCalibration {
    /// `absolute`, `relative` (margin [`DEFAULT_RELATIVE_MARGIN`], strength 1), `relative:M`,
    /// `relative:M:S` or `off`.
    pub fn parse(s: &str) -> Result<Self> {
        let mut parts = s.split(':');
        let number = |p: Option<&str>, what: &str, default: f32| -> Result<f32> {
            let Some(p) = p else { return Ok(default) };
            let x: f32 = p.parse().with_context(|| format!("mask calibration '{s}': the {what} is a number"))?;
            anyhow::ensure!(x.is_finite() && x >= 0.0, "mask calibration '{s}': the {what} is at least 0");
            Ok(x)
        };
        let c = match parts.next() {
            Some("absolute") => Self::Absolute,
            Some("off") => Self::Off,
            Some("relative") => Self::Relative {
                margin: number(parts.next(), "margin", DEFAULT_RELATIVE_MARGIN)?,
                strength: number(parts.next(), "strength", 1.0)?,
            },
            _ => anyhow::bail!("unknown mask calibration '{s}' (absolute, relative[:MARGIN[:STRENGTH]], off)"),
        };
        anyhow::ensure!(parts.next().is_none(), "mask calibration '{s}': too many parts");
        Ok(c)
    }

    pub fn name(&self) -> String {
        match self {
            Self::Absolute => "absolute".into(),
            Self::Relative { margin, strength } if *strength == 1.0 => format!("relative:{margin}"),
            Self::Relative { margin, strength } => format!("relative:{margin}:{strength}"),
            Self::Off => "off".into(),
        }
    }
}

/// The relative calibration's margin, in score units.
pub const DEFAULT_RELATIVE_MARGIN: f32 = 2.0;

/// A chunk whose intensity is above this is open ("unmasked": its keys keep over 90% of their
/// attention weight); at or below it, masked. The one threshold every report and test uses.
pub const UNMASKED_ABOVE: f32 = -0.1;

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
    pub calibration: MaskCalibration,
    /// The calibration a document's absorb trains its adapter under, when it differs from the
    /// one answers use (`calibration`); None: the same.
    pub absorb_mask: Option<MaskCalibration>,
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
            calibration: MaskCalibration::Absolute,
            absorb_mask: None,
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

    /// The filter a document's absorb masks its training rows with: this one under
    /// `absorb_mask` when that is set.
    pub fn for_absorb(&self) -> Self {
        Self { calibration: self.absorb_mask.unwrap_or(self.calibration), ..self.clone() }
    }

    /// The absorbs' calibration when it differs from the answers' (what is stored and reported).
    pub fn distinct_absorb_mask(&self) -> Option<MaskCalibration> {
        self.absorb_mask.filter(|c| *c != self.calibration)
    }

    /// The calibrations by name: `relative:2`, or `relative:2 (absorbs: absolute)`.
    pub fn mask_name(&self) -> String {
        match self.distinct_absorb_mask() {
            Some(absorb) => format!("{} (absorbs: {})", self.calibration.name(), absorb.name()),
            None => self.calibration.name(),
        }
    }

    /// The bundle extras holding this filter.
    pub fn to_extras(&self) -> Result<BTreeMap<String, Tensor>> {
        let dev = self.head_w.device();
        let config = Tensor::new(&[self.layer as f32, self.chunk_tokens as f32], dev)?;
        let mut extras: BTreeMap<String, Tensor> = [
            (HEAD_WEIGHT, self.head_w.detach()),
            (HEAD_BIAS, self.head_b.detach()),
            (MASK_W, self.w.detach()),
            (MASK_B, self.b.detach()),
            (LOG_TAU, self.log_tau.detach()),
            (CONFIG, config),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        match self.calibration {
            MaskCalibration::Absolute => {}
            MaskCalibration::Relative { margin, strength } => {
                let v = if strength == 1.0 { vec![margin] } else { vec![margin, strength] };
                extras.insert(RELATIVE_MARGIN.into(), Tensor::new(v, dev)?);
            }
            MaskCalibration::Off => anyhow::bail!("a filter without its mask is for measuring; it is not stored"),
        }
        match self.distinct_absorb_mask() {
            None => {}
            Some(MaskCalibration::Absolute) => {
                extras.insert(ABSORB_MASK.into(), Tensor::new(&[0f32], dev)?);
            }
            Some(MaskCalibration::Relative { margin, strength }) => {
                extras.insert(ABSORB_MASK.into(), Tensor::new(&[1f32, margin, strength], dev)?);
            }
            Some(MaskCalibration::Off) => anyhow::bail!("absorbs train under a mask; 'off' is for measuring"),
        }
        Ok(extras)
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
            calibration: match extras.get(RELATIVE_MARGIN) {
                None => MaskCalibration::Absolute,
                // `[margin]` alone: strength 1.
                Some(t) => {
                    let v = t.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                    anyhow::ensure!(matches!(v.len(), 1 | 2), "{RELATIVE_MARGIN} must hold [margin] or [margin, strength]");
                    MaskCalibration::Relative { margin: v[0], strength: v.get(1).copied().unwrap_or(1.0) }
                }
            },
            absorb_mask: match extras.get(ABSORB_MASK) {
                None => None,
                Some(t) => match t.to_dtype(DType::F32)?.to_vec1::<f32>()?.as_slice() {
                    [k] if *k == 0.0 => Some(MaskCalibration::Absolute),
                    [k, margin, strength] if *k == 1.0 => Some(MaskCalibration::Relative { margin: *margin, strength: *strength }),
                    v => anyhow::bail!("{ABSORB_MASK} must hold [0] (absolute) or [1, margin, strength] (relative), not {v:?}"),
                },
            },
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

    /// Mask intensities of the chunks in context, from their scores `s` (every chunk the
    /// queries can see), by the calibration: `I = min(0, w·s + b)` (absolute) or
    /// `min(0, strength·w·(s − max s + margin))` (relative; the max a constant of the graph). The left
    /// derivative (1) is taken at 0: at the zero start (`w = b = 0`) every chunk sits exactly
    /// there, and a derivative of 0 there (what `x − relu(x)` gives, relu passing 1 at 0) would
    /// leave w and b without gradient forever. The gate `x ≤ 0` is a constant of the graph.
    pub fn intensities(&self, s: &Tensor) -> candle_core::Result<Tensor> {
        let x = match self.calibration {
            MaskCalibration::Absolute => s.broadcast_mul(&self.w)?.broadcast_add(&self.b)?,
            MaskCalibration::Relative { strength, .. } => (self.relevance(s)?.broadcast_mul(&self.w)? * strength as f64)?,
            MaskCalibration::Off => return s.zeros_like(),
        };
        let gate = x.le(0.0)?.to_dtype(x.dtype())?;
        x * gate
    }

    /// The relevance reported for each chunk (positive: relevant): the raw score under the
    /// absolute calibration, the score above the open threshold under the relative one (so a
    /// chunk reported relevant is one left open).
    pub fn relevance(&self, s: &Tensor) -> candle_core::Result<Tensor> {
        match self.calibration {
            MaskCalibration::Relative { margin, .. } => {
                let best = s.max_keepdim(0)?.detach();
                s.broadcast_sub(&best)? + margin as f64
            }
            MaskCalibration::Absolute | MaskCalibration::Off => Ok(s.clone()),
        }
    }
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
        let s = self.filter.relevance(&s)?.to_vec1::<f32>()?;
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
