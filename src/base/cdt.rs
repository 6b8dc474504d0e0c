//! CDT, context denoising training ("Revisiting Long-context Modeling from Context Denoising Perspective", §4): for each training
//! example, pass 1 takes the gradient of the loss with respect to the input embeddings only;
//! document tokens whose gradient L2 norm is at least the document's mean are *critical*; every
//! other document token's embedding moves against its gradient (eq. 2, applied to the irrelevant
//! tokens as the authors' text and trainer do), by a step set so that the mean relative move is
//! `CdtOptions::relative_move`; pass 2 is the real training step on those denoised embeddings
//! (eq. 3). CDT is post-training of the base model: it runs in `prepare-base` (`crate::base`),
//! never in a document's absorb, and there only on the QA examples' document passages (a chat
//! template or an attention sink is not "noise").

use crate::lift::absorb::qa_examples::FilterExample;
use crate::lift::absorb::plan::Example;
use crate::lift::absorb::trainer::{prepare, total_loss, FilterTraining};
use crate::model::{Adapter, Model};
use candle_core::{Result, Tensor, Var, D};
use serde::{Deserialize, Serialize};

/// Where a training prompt's document tokens are, and the evidence among them.
#[derive(Clone, Debug, Default)]
pub struct QaPositions {
    pub context: Vec<usize>,
    pub evidence: Vec<usize>,
}

/// The loss of one training example under CDT (`target`: the mean relative move of the document
/// embeddings, `positions`: the prompt's document tokens): pass 1 (embedding gradients of the LM
/// loss), critical tokens, denoised document embeddings, then the loss on them (pass 2), as
/// `(L_lm + λ·L_flt, L_flt)`.
pub fn cdt_loss(
    model: &Model,
    adapter: &dyn Adapter,
    example: &Example,
    filter: Option<(&FilterTraining, &FilterExample)>,
    target: f64,
    positions: &QaPositions,
    stats: &mut CdtStats,
) -> anyhow::Result<(Tensor, Option<Tensor>)> {
    let p = prepare(model, example)?;
    let emb = model.decoder.embed(&p.input)?;
    let v = Var::from_tensor(&emb)?;
    let (_, pass1, _) = total_loss(model, adapter, v.as_tensor(), &p, filter)?;
    let grads = pass1.backward()?;
    let e = emb.squeeze(0)?;
    let g = match grads.get(v.as_tensor()) {
        Some(g) => g.detach().squeeze(0)?,
        None => e.zeros_like()?,
    };
    let d = denoise_document(&e, &g, &positions.context, target)?;
    let (total, pass2, flt) = total_loss(model, adapter, &d.emb.unsqueeze(0)?, &p, filter)?;
    stats.add(&d, Some(positions), pass1.to_scalar::<f32>()? as f64, pass2.to_scalar::<f32>()? as f64);
    Ok((total, flt))
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CdtOptions {
    pub enabled: bool,
    /// Target relative move ‖Δe‖/‖e‖ of the denoised embeddings, averaged over the tokens moved
    /// in each example: eq. 2's step `lr·β` is set per example to reach it.
    pub relative_move: f64,
}

impl Default for CdtOptions {
    /// The paper (Context Denoising Training, §5) moves embeddings by `lr·β·grad` with lr 1e-5 and
    /// β 5 in a full fine-tune: 5e-5 × the gradient. Absolute steps do not carry over between
    /// models and optimizers (our learning rates are adapters'), relative moves do; and since an
    /// embedding's gradient is far smaller than the embedding (here ‖g‖ ≈ 0.05, ‖e‖ ≈ 2.7 on the
    /// 135M model), 5e-5 bounds the paper's relative move from above. (A fixed `lr·β` of 1e-3 ×
    /// 1000 moved every embedding by ~4.7% of its norm, thousands of times that.)
    fn default() -> Self {
        Self { enabled: false, relative_move: 5e-5 }
    }
}

/// Critical tokens of embedding gradients `[t, hidden]`: L2 norm ≥ the mean norm. Also returns
/// the norms.
pub fn critical_tokens(grad: &Tensor) -> Result<(Vec<bool>, Vec<f32>)> {
    let norms = row_norms(grad)?;
    let mean = norms.iter().sum::<f32>() / norms.len().max(1) as f32;
    Ok((norms.iter().map(|&n| n >= mean).collect(), norms))
}

fn row_norms(x: &Tensor) -> Result<Vec<f32>> {
    x.sqr()?.sum(D::Minus1)?.sqrt()?.to_vec1::<f32>()
}

/// Eq. 2: `e' = e − step·grad` for the tokens that are not critical (`step = lr·β`); critical
/// rows are returned unchanged. `emb` and `grad` are `[t, hidden]`.
pub fn denoise(emb: &Tensor, grad: &Tensor, critical: &[bool], step: f64) -> Result<Tensor> {
    let scale: Vec<f64> = critical.iter().map(|&c| if c { 0.0 } else { step }).collect();
    shift_rows(emb, grad, &scale)
}

/// `e_i − scale_i·grad_i` for every row i.
fn shift_rows(emb: &Tensor, grad: &Tensor, scale: &[f64]) -> Result<Tensor> {
    let scale: Vec<f32> = scale.iter().map(|&s| s as f32).collect();
    let scale = Tensor::from_vec(scale, (emb.dim(0)?, 1), emb.device())?;
    emb - grad.broadcast_mul(&scale)?
}

/// The outcome of denoising one example's document tokens.
#[derive(Clone, Debug)]
pub struct Denoised {
    /// The embeddings `[t, hidden]` with the moved rows shifted.
    pub emb: Tensor,
    /// Per row: a document token whose gradient norm is at least the document tokens' mean.
    pub critical: Vec<bool>,
    /// Rows moved (document tokens that are not critical).
    pub moved: usize,
    /// Measured mean ‖Δe‖/‖e‖ over the moved rows.
    pub relative_move: f64,
}

/// Eq. 2 on the document tokens only (rows `document` of `emb`, `grad`, both `[t, hidden]`):
/// critical tokens by gradient norm among the document tokens, the others moved against their
/// gradient with the step that makes their mean relative move `target`. Template tokens (the
/// attention sink among them), the question and the answer never move: "noise" means irrelevant
/// context, and only the document is context.
pub fn denoise_document(emb: &Tensor, grad: &Tensor, document: &[usize], target: f64) -> Result<Denoised> {
    let t = emb.dim(0)?;
    let g = row_norms(grad)?;
    let e = row_norms(emb)?;
    let doc: Vec<usize> = document.iter().copied().filter(|&i| i < t).collect();
    let mut critical = vec![false; t];
    let mean = doc.iter().map(|&i| g[i]).sum::<f32>() / doc.len().max(1) as f32;
    let mut moved = Vec::new();
    for &i in &doc {
        if g[i] >= mean {
            critical[i] = true;
        } else if g[i] > 0.0 && e[i] > 0.0 {
            moved.push(i);
        }
    }
    let ratio = moved.iter().map(|&i| (g[i] / e[i]) as f64).sum::<f64>() / moved.len().max(1) as f64;
    let step = if ratio > 0.0 { target / ratio } else { 0.0 };
    let mut scale = vec![0.0; t];
    moved.iter().for_each(|&i| scale[i] = step);
    let out = shift_rows(emb, grad, &scale)?;
    let delta = row_norms(&(&out - emb)?)?;
    let relative_move = moved.iter().map(|&i| (delta[i] / e[i]) as f64).sum::<f64>() / moved.len().max(1) as f64;
    Ok(Denoised { emb: out, critical, moved: moved.len(), relative_move })
}

/// Counts of critical tokens, to check that CDT flags what matters: on QA examples the evidence
/// tokens should be critical far more often than the document context as a whole.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CdtStats {
    pub examples: usize,
    pub tokens: usize,
    pub critical: usize,
    /// Document-context tokens of QA examples, and how many were critical (the base rate).
    pub context_tokens: usize,
    pub context_critical: usize,
    /// Evidence tokens (in the window) of QA examples, and how many were critical.
    pub evidence_tokens: usize,
    pub evidence_critical: usize,
    /// Mean relative move ‖Δe‖/‖e‖ of the denoised (non-critical document) tokens, measured.
    pub mean_relative_shift: f64,
    /// Mean over examples of the pass-2 (denoised) / pass-1 LM loss.
    pub mean_loss_ratio: f64,
    #[serde(skip)]
    sums: (f64, f64),
}

impl CdtStats {
    /// Records one denoised example: its document tokens' critical flags, evidence and context
    /// positions (for the rates), the measured move and both passes' LM losses.
    pub fn add(&mut self, d: &Denoised, positions: Option<&QaPositions>, pass1: f64, pass2: f64) {
        let n_crit = d.critical.iter().filter(|&&c| c).count();
        self.examples += 1;
        self.critical += n_crit;
        if let Some(qp) = positions {
            let count = |ps: &[usize]| {
                ps.iter()
                    .filter(|&&i| i < d.critical.len())
                    .fold((0, 0), |(n, c), &i| (n + 1, c + d.critical[i] as usize))
            };
            let (cn, cc) = count(&qp.context);
            let (en, ec) = count(&qp.evidence);
            self.tokens += cn;
            self.context_tokens += cn;
            self.context_critical += cc;
            self.evidence_tokens += en;
            self.evidence_critical += ec;
        }
        self.sums.0 += d.relative_move;
        self.sums.1 += pass2 / pass1.max(1e-12);
        self.mean_relative_shift = self.sums.0 / self.examples as f64;
        self.mean_loss_ratio = self.sums.1 / self.examples as f64;
        tracing::debug!(
            critical = n_crit,
            moved = d.moved,
            relative_move = d.relative_move,
            pass1,
            pass2,
            "cdt example"
        );
    }

    pub fn evidence_rate(&self) -> f64 {
        self.evidence_critical as f64 / self.evidence_tokens.max(1) as f64
    }
    pub fn context_rate(&self) -> f64 {
        self.context_critical as f64 / self.context_tokens.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn critical_tokens_stay_and_the_others_move_by_lr_beta_grad() {
        let dev = Device::Cpu;
        let emb = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], &dev).unwrap();
        // Norms 5, 0.5, 1, 10 → mean 4.125: rows 0 and 3 critical.
        let grad = Tensor::new(&[[3.0f32, 4.0], [0.3, 0.4], [0.6, 0.8], [6.0, 8.0]], &dev).unwrap();
        let (crit, norms) = critical_tokens(&grad).unwrap();
        assert_eq!(crit, vec![true, false, false, true]);
        assert!((norms[0] - 5.0).abs() < 1e-6);
        let step = 0.5;
        let out = denoise(&emb, &grad, &crit, step).unwrap().to_vec2::<f32>().unwrap();
        let e = emb.to_vec2::<f32>().unwrap();
        let g = grad.to_vec2::<f32>().unwrap();
        for i in 0..4 {
            for j in 0..2 {
                let want = if crit[i] { e[i][j] } else { e[i][j] - step as f32 * g[i][j] };
                assert!((out[i][j] - want).abs() < 1e-6, "row {i} col {j}");
            }
        }
        assert!(!CdtOptions::default().enabled);
    }

    #[test]
    fn only_document_tokens_move_and_their_mean_relative_move_is_the_target() {
        let dev = Device::Cpu;
        // Rows 0–1: template (BOS, role), 2–6: document, 7: question. Row 0 has a tiny gradient,
        // as attention sinks do: it must stay anyway.
        let emb = Tensor::new(
            &[[1.0f32, 0.0], [0.0, 2.0], [3.0, 4.0], [1.0, 1.0], [0.0, 5.0], [2.0, 0.0], [1.0, 2.0], [4.0, 4.0]],
            &dev,
        )
        .unwrap();
        let grad = Tensor::new(
            &[[0.001f32, 0.0], [0.1, 0.1], [0.3, 0.4], [0.01, 0.02], [0.0, 0.05], [0.02, 0.0], [2.0, 1.0], [0.01, 0.0]],
            &dev,
        )
        .unwrap();
        let target = 1e-3;
        let d = denoise_document(&emb, &grad, &[2, 3, 4, 5, 6], target).unwrap();
        // Document gradient norms 0.5, 0.022, 0.05, 0.02, 2.24 → mean 0.57: row 6 critical
        // (and row 2 is not: 0.5 < 0.57).
        assert_eq!(d.critical, vec![false, false, false, false, false, false, true, false]);
        assert_eq!(d.moved, 4);
        assert!((d.relative_move - target).abs() < 1e-6, "measured move {} vs {target}", d.relative_move);
        let (e, out) = (emb.to_vec2::<f32>().unwrap(), d.emb.to_vec2::<f32>().unwrap());
        for i in [0, 1, 6, 7] {
            assert_eq!(out[i], e[i], "row {i} must not move");
        }
        for i in [2, 3, 4, 5] {
            assert_ne!(out[i], e[i], "row {i} moves");
        }
        // Twice the target, twice the move.
        let d2 = denoise_document(&emb, &grad, &[2, 3, 4, 5, 6], 2.0 * target).unwrap();
        assert!((d2.relative_move - 2.0 * target).abs() < 1e-6);
        // No document tokens: nothing moves.
        let none = denoise_document(&emb, &grad, &[], target).unwrap();
        assert_eq!((none.moved, none.relative_move), (0, 0.0));
        assert_eq!(none.emb.to_vec2::<f32>().unwrap(), e);
    }
}
