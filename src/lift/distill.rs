//! Context distillation for the auxiliary QA: the adapter learns to answer as the same model
//! answers *reading the evidence*, a distribution at every answer position instead of the answer's
//! tokens alone ("Cartridges: Lightweight and general-purpose long context representations via
//! self-study", Eyuboglu et al., arXiv 2506.06266; Doc-to-LoRA, arXiv 2602.15902).
//!
//! - **Teacher**: the frozen model with the prepared base (no document adapter), its FltLM filter
//!   masking as when answering, reading the question with the fact's evidence passages shown first
//!   (`answer::evidence_prompt`, [`Evidence::Shown`](super::answer::Evidence)). One pass per QA
//!   example, without a graph, cached for the whole run ([`TeacherCache`]): its top-k tokens at
//!   each answer position.
//! - **Student**: the model with the adapter, in the QA layout of the plan (`plan.qa_layout`): the
//!   question's own passages as an answer shows them, or without the evidence (`recall`), where
//!   the student must give from what it learned the answer the teacher reads.
//! - **Loss** ([`soft_loss`]): `(1 − α)·CE(answer tokens) + α·CE(teacher's top-k)`.

use super::plan::{SoftTargets, TeacherRow};
use crate::model::{ForwardHooks, Model, NoHooks};
use anyhow::Result;
use candle_core::{Tensor, D};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct DistillOptions {
    /// α, the teacher's share of the QA loss (1: the teacher's distribution alone).
    pub weight: f64,
    /// Teacher tokens kept per answer position (renormalised over them).
    pub top_k: usize,
}

impl Default for DistillOptions {
    fn default() -> Self {
        Self { weight: 0.5, top_k: 16 }
    }
}

/// The teacher's targets for `row`'s answer positions: one pass of the model with the prepared
/// base alone (its filter masking the row's chunks), no graph.
pub fn teacher_targets(model: &Model, row: &TeacherRow, opts: &DistillOptions) -> Result<SoftTargets> {
    let logits = answer_logits(model, &row.example, &row.chunks)?;
    top_k_distribution(&logits, opts.top_k.max(1), opts.weight)
}

/// The vocabulary logits `[answer positions, vocab]` of `example` under the frozen model with the
/// prepared base alone (no document adapter; its filter masking `chunks`), without a graph.
pub fn answer_logits(model: &Model, example: &super::plan::Example, chunks: &[crate::model::filter::Chunk]) -> Result<Tensor> {
    let n = example.tokens.len();
    anyhow::ensure!(n >= 2, "a row of {n} tokens");
    let dev = model.device();
    let pos: Vec<u32> = (0..n - 1).filter(|&i| example.target[i + 1]).map(|i| i as u32).collect();
    anyhow::ensure!(!pos.is_empty(), "a row without answer tokens");
    let input = Tensor::new(&example.tokens[..n - 1], dev)?.unsqueeze(0)?;
    let emb = model.decoder.embed(&input)?;
    let layers = model.config().num_layers;
    let mut filter_hooks = model
        .base_filter()
        .filter(|_| !chunks.is_empty())
        .map(|f| crate::model::filter::FilterHooks::new(f, chunks, layers));
    let hooks: &mut dyn ForwardHooks = match filter_hooks.as_mut() {
        Some(h) => h,
        None => &mut NoHooks,
    };
    let hidden = model.decoder.forward_train_packed(&emb, None, None, hooks)?;
    let at = Tensor::new(pos.as_slice(), dev)?;
    Ok(model.decoder.logits_train(&hidden.squeeze(0)?.index_select(&at, 0)?)?.detach())
}

/// Each row's `k` most likely tokens under `logits` `[n, vocab]` and their probabilities
/// renormalised over the k.
fn top_k_distribution(logits: &Tensor, k: usize, weight: f64) -> Result<SoftTargets> {
    let rows = logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    let k = k.min(rows.first().map_or(1, Vec::len));
    let (mut indices, mut probs) = (Vec::with_capacity(rows.len() * k), Vec::with_capacity(rows.len() * k));
    for row in &rows {
        let mut order: Vec<u32> = (0..row.len() as u32).collect();
        order.select_nth_unstable_by(k - 1, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
        order.truncate(k);
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
        let top = row[order[0] as usize];
        let e: Vec<f32> = order.iter().map(|&i| (row[i as usize] - top).exp()).collect();
        let sum: f32 = e.iter().sum();
        indices.extend_from_slice(&order);
        probs.extend(e.iter().map(|x| x / sum));
    }
    let dev = logits.device();
    Ok(SoftTargets {
        indices: Tensor::from_vec(indices, (rows.len(), k), dev)?,
        probs: Tensor::from_vec(probs, (rows.len(), k), dev)?,
        weight,
    })
}

/// The QA loss with a teacher: `(1 − α)·hard + α·Σᵢ wᵢ Σⱼ pᵢⱼ·(−log softmax(logitsᵢ)[idxᵢⱼ]) / Σᵢ wᵢ`,
/// `hard` the row's cross-entropy on its answer tokens (same weights), `logits` `[n, vocab]` at
/// the answer positions.
pub fn soft_loss(logits: &Tensor, hard: &Tensor, soft: &SoftTargets, weights: &Tensor) -> candle_core::Result<Tensor> {
    let lsm = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let per_row = (lsm.gather(&soft.indices, 1)? * &soft.probs)?.sum(1)?.neg()?;
    let w = weights.detach().to_dtype(per_row.dtype())?;
    let teacher = (per_row * &w)?.sum_all()?.div(&w.sum_all()?.maximum(1e-8)?)?;
    (hard * (1.0 - soft.weight))? + (teacher * soft.weight)?
}

/// The teacher's targets of a run's QA examples, each computed once (at its first use) and kept:
/// the teacher is frozen, so they are the same every epoch.
pub struct TeacherCache<'a> {
    rows: &'a [TeacherRow],
    opts: DistillOptions,
    targets: HashMap<usize, Arc<SoftTargets>>,
    /// Teacher passes run, and their tokens (part of the absorb's cost).
    pub passes: usize,
    pub tokens: usize,
}

impl<'a> TeacherCache<'a> {
    pub fn new(rows: &'a [TeacherRow], opts: DistillOptions) -> Self {
        Self { rows, opts, targets: HashMap::new(), passes: 0, tokens: 0 }
    }

    /// QA example `i`'s targets, from the teacher's pass the first time.
    pub fn targets(&mut self, model: &Model, i: usize) -> Result<Arc<SoftTargets>> {
        if let Some(t) = self.targets.get(&i) {
            return Ok(t.clone());
        }
        let row = self.rows.get(i).ok_or_else(|| anyhow::anyhow!("no teacher row for QA example {i}"))?;
        let t = Arc::new(teacher_targets(model, row, &self.opts)?);
        self.passes += 1;
        self.tokens += row.example.tokens.len();
        self.targets.insert(i, t.clone());
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    #[test]
    fn the_soft_loss_gradient_matches_finite_differences() {
        let dev = Device::Cpu;
        let (n, vocab, k) = (3, 11, 4);
        let mut rng = crate::testing::Rng::new(7);
        let x = Var::from_tensor(&Tensor::from_vec(rng.vec(n * vocab, 2.0), (n, vocab), &dev).unwrap()).unwrap();
        let teacher = Tensor::from_vec(rng.vec(n * vocab, 3.0), (n, vocab), &dev).unwrap();
        let soft = top_k_distribution(&teacher, k, 0.7).unwrap();
        let targets = Tensor::new(&[1u32, 5, 9], &dev).unwrap();
        let weights = Tensor::new(&[1.0f32, 0.5, 2.0], &dev).unwrap();
        let loss_of = |logits: &Tensor| -> Tensor {
            let hard = crate::model::ops::cross_entropy_masked(logits, &targets, &weights).unwrap();
            soft_loss(logits, &hard, &soft, &weights).unwrap()
        };
        let grad = loss_of(x.as_tensor()).backward().unwrap().get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        let base = x.as_tensor().to_vec2::<f32>().unwrap();
        let eps = 1e-2f32;
        let mut worst = 0f32;
        for i in 0..n {
            for j in 0..vocab {
                let at = |d: f32| {
                    let mut v = base.clone();
                    v[i][j] += d;
                    let t = Tensor::new(v, &dev).unwrap();
                    loss_of(&t).to_scalar::<f32>().unwrap()
                };
                let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
                worst = worst.max((numeric - grad[i][j]).abs());
            }
        }
        assert!(worst < 2e-3, "analytic and numeric gradients differ by {worst}");
        // The teacher term matters: with α = 0 the loss is the hard one alone, with α > 0 not.
        let hard = crate::model::ops::cross_entropy_masked(x.as_tensor(), &targets, &weights).unwrap();
        let mixed = loss_of(x.as_tensor()).to_scalar::<f32>().unwrap();
        let hard_only = soft_loss(x.as_tensor(), &hard, &SoftTargets { weight: 0.0, ..soft.clone() }, &weights).unwrap();
        assert!((hard_only.to_scalar::<f32>().unwrap() - hard.to_scalar::<f32>().unwrap()).abs() < 1e-6);
        assert!((mixed - hard.to_scalar::<f32>().unwrap()).abs() > 1e-3);
        assert_eq!(soft.probs.dtype(), DType::F32);
    }

    #[test]
    fn top_k_keeps_the_most_likely_tokens_renormalised() {
        let logits = Tensor::new(&[[0.0f32, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.0]], &Device::Cpu).unwrap();
        let s = top_k_distribution(&logits, 2, 1.0).unwrap();
        assert_eq!(s.indices.to_vec2::<u32>().unwrap(), vec![vec![1, 3], vec![0, 3]]);
        let p = s.probs.to_vec2::<f32>().unwrap();
        let e = 1.0 / (1.0 + (-1.0f32).exp());
        for row in &p {
            assert!((row[0] - e).abs() < 1e-6 && (row[0] + row[1] - 1.0).abs() < 1e-6, "{row:?}");
        }
    }
}
