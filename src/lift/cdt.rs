//! CDT, context denoising training (seeds/000_27daafaf793f066d.txt §4): for each training
//! example, pass 1 takes the gradient of the loss with respect to the input embeddings only;
//! tokens whose gradient L2 norm is at least the sequence mean are *critical*; every other token's
//! embedding moves by `−lr·β·grad` (eq. 2, applied to the irrelevant tokens as the authors' text
//! and trainer do); pass 2 is the real training step on those denoised embeddings (eq. 3).

use super::filter::evidence_tokens;
use super::prompt::{chat_with_context_at, elision_tokens, head_tail, kept_ranges};
use super::qa::QaPair;
use super::trainer::QaPositions;
use crate::model::Model;
use candle_core::{Result, Tensor, D};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CdtApply {
    Qa,
    Ct,
    #[default]
    Both,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CdtOptions {
    pub enabled: bool,
    /// Denoising strength β of eq. 2: non-critical embeddings move by `lr·β·grad`.
    pub beta: f64,
    /// Which examples are denoised: auxiliary QA, contextualized-training segments, or both.
    pub apply_to: CdtApply,
}

impl Default for CdtOptions {
    /// β: the paper's 5 goes with a full fine-tune at lr 1e-5 (a step of 5e-5·grad). Measured on
    /// the 135M model (a CT example at the start of training, loss 3.8): per-token embedding
    /// gradients have L2 norm ≈ 0.035 (median) to 0.055 (mean), embeddings ≈ 2.7. At our adapter
    /// lr of 1e-3, β = 5 would move a non-critical embedding by ~6e-5 of its norm: no denoising at
    /// all. β = 1000 (a step of 1·grad) moves it by ~1% of its norm at the start, less as the loss
    /// falls; the mean relative move is reported (`CdtStats::mean_relative_shift`).
    fn default() -> Self {
        Self { enabled: false, beta: 1000.0, apply_to: CdtApply::Both }
    }
}

impl CdtOptions {
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    pub fn applies(&self, is_qa: bool) -> bool {
        self.enabled
            && match self.apply_to {
                CdtApply::Both => true,
                CdtApply::Qa => is_qa,
                CdtApply::Ct => !is_qa,
            }
    }
}

/// Critical tokens of embedding gradients `[t, hidden]`: L2 norm ≥ the mean norm. Also returns
/// the norms.
pub fn critical_tokens(grad: &Tensor) -> Result<(Vec<bool>, Vec<f32>)> {
    let norms = grad.sqr()?.sum(D::Minus1)?.sqrt()?.to_vec1::<f32>()?;
    let mean = norms.iter().sum::<f32>() / norms.len().max(1) as f32;
    Ok((norms.iter().map(|&n| n >= mean).collect(), norms))
}

/// Eq. 2: `e' = e − step·grad` for the tokens that are not critical (`step = lr·β`); critical
/// rows are returned unchanged. `emb` and `grad` are `[t, hidden]`.
pub fn denoise(emb: &Tensor, grad: &Tensor, critical: &[bool], step: f64) -> Result<Tensor> {
    let keep: Vec<f32> = critical.iter().map(|&c| if c { 0.0 } else { 1.0 }).collect();
    let keep = Tensor::from_vec(keep, (critical.len(), 1), emb.device())?;
    emb - (grad.broadcast_mul(&keep)? * step)?
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
    /// Mean relative move ‖Δe‖/‖e‖ of the denoised (non-critical) tokens.
    pub mean_relative_shift: f64,
}

impl CdtStats {
    pub fn evidence_rate(&self) -> f64 {
        self.evidence_critical as f64 / self.evidence_tokens.max(1) as f64
    }
    pub fn context_rate(&self) -> f64 {
        self.context_critical as f64 / self.context_tokens.max(1) as f64
    }
}

/// Prompt positions of the document context and of the evidence of each QA pair, in the plain
/// QA layout of `Plan::new` (head and tail halves of `budget` tokens, then the question).
pub fn plain_qa_positions(
    model: &Model,
    text: &str,
    doc: &[u32],
    pairs: &[QaPair],
    budget: usize,
) -> anyhow::Result<Vec<QaPositions>> {
    let elision = elision_tokens(model)?;
    let ctx = head_tail(doc, budget, budget / 2, &elision);
    let (head_end, tail_start) = kept_ranges(doc.len(), budget, budget / 2, elision.len());
    let in_ctx = |d: usize| -> Option<usize> {
        if d < head_end {
            Some(d)
        } else if d >= tail_start {
            Some(if doc.len() <= budget { d } else { head_end + elision.len() + d - tail_start })
        } else {
            None
        }
    };
    pairs
        .iter()
        .map(|pair| {
            let (_, offset) = chat_with_context_at(model, &ctx, &pair.question)?;
            let (a, b) = evidence_tokens(model, text, pair)?;
            Ok(QaPositions {
                context: (0..doc.len()).filter_map(in_ctx).map(|i| offset + i).collect(),
                evidence: (a..b).filter_map(in_ctx).map(|i| offset + i).collect(),
            })
        })
        .collect()
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
        let (lr, beta) = (1e-3, 500.0);
        let out = denoise(&emb, &grad, &crit, lr * beta).unwrap().to_vec2::<f32>().unwrap();
        let e = emb.to_vec2::<f32>().unwrap();
        let g = grad.to_vec2::<f32>().unwrap();
        for i in 0..4 {
            for j in 0..2 {
                let want = if crit[i] { e[i][j] } else { e[i][j] - (lr * beta) as f32 * g[i][j] };
                assert_eq!(out[i][j], want, "row {i} col {j}");
            }
        }
        assert_ne!(out[1], e[1], "a non-critical row moved");
        let opts = CdtOptions { enabled: true, apply_to: CdtApply::Qa, ..Default::default() };
        assert!(opts.applies(true) && !opts.applies(false));
        assert!(!CdtOptions::default().applies(true));
    }
}
