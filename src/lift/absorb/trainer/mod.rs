//! The LIFT trainer: two stages (segments only, then segments + auxiliary QA), AdamW with the
//! LIFT paper's settings (Table 9), gradient accumulation over small batches, global grad-norm
//! clipping, seeded shuffling, cancellation, progress reports and optional early stopping. With a
//! prepared base, its frozen FltLM filter masks the QA examples while the adapter trains.
//!
//!
//! Here: the options, the progress and report, the inputs and the entry points (`train`,
//! `train_with`); the step loop over epochs and batches (`run`: `train_long`), the losses it
//! trains on (`loss`), a run's checkpoints (`checkpoint`), several rows of a step as one batched
//! pass (`rows`), the optimizers (`optim`), the until-learned rule (probes, plateau, cool-down) in
//! `until_learned`.

mod checkpoint;
mod loss;
mod optim;
mod rows;
mod run;
mod until_learned;

use crate::lift::absorb::qa_examples::FilterExample;
use crate::lift::answer::layout::Filter;
use super::plan::Plan;
use crate::model::{Adapter, Model};
use anyhow::Result;
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

pub use checkpoint::{Checkpointing, Cursor, LongRun, TrainCheckpoint};
pub use loss::{example_loss, example_loss_with};
pub(crate) use loss::training_loss;
// CDT's two passes over the same losses (`base::cdt`, research).
#[cfg(feature = "research")]
pub(crate) use loss::{prepare, total_loss};
pub use optim::AdamW;
pub use run::train_long;
pub use until_learned::{CooldownCause, FocusState, Probes, UntilLearned, UntilLearnedState};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct TrainOptions {
    /// Epochs over the segments alone (stage 1) and over segments + QA (stage 2).
    pub epochs: [usize; 2],
    pub lr: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub max_grad_norm: f64,
    /// Examples per optimizer step. The paper steps once per epoch (all examples accumulated);
    /// measured on this model that leaves the segment loss at 3.4, while per-example steps reach
    /// 0.44, so small batches are the default.
    pub accumulation: usize,
    /// The rows of an optimizer step run as batched forwards/backwards (`rows`) when they can (no
    /// packing, no trainable filter), grouped by length so that each group's padding stays within
    /// this share of its tokens; None (the default): one by one. The same gradients either way.
    /// Off by default because the 2-core CPU gains nothing from it (its gemms are as efficient at
    /// one row as at four, docs/absorb-speed.md "Batched rows"); a GPU step is bound by launches.
    /// Left out of the JSON (and so of document ids) when off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_rows: Option<f64>,
    /// Linear warm-up of the learning rate over this many optimizer steps.
    pub warmup_steps: usize,
    /// Stop when the epoch's mean loss has not improved by `min_delta` for `patience` epochs.
    pub early_stop: Option<EarlyStop>,
    /// Absorb until learned: stop when held-aside probe questions stop improving (the fixed
    /// schedule, `epochs`, is then the ceiling). None: the paper's fixed schedule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until_learned: Option<UntilLearned>,
    pub seed: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EarlyStop {
    pub patience: usize,
    pub min_delta: f64,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            epochs: [3, 5],
            lr: 1e-3,
            weight_decay: 1e-4,
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-8,
            max_grad_norm: 1.0,
            accumulation: 1,
            batch_rows: None,
            warmup_steps: 0,
            early_stop: None,
            until_learned: None,
            seed: 0,
        }
    }
}

/// Early stopping's count: the best epoch mean so far and the epochs since it.
struct Patience {
    best: f64,
    since_best: usize,
}

impl Patience {
    /// Books an epoch of mean loss `mean`; true when `early_stop` (if any) says to stop.
    fn exhausted(&mut self, early_stop: Option<&EarlyStop>, mean: f64) -> bool {
        let Some(es) = early_stop else { return false };
        if mean < self.best - es.min_delta {
            self.best = mean;
            self.since_best = 0;
            false
        } else {
            self.since_best += 1;
            self.since_best >= es.patience
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Segments,
    SegmentsAndQa,
}

#[derive(Clone, Debug, Serialize)]
pub struct Progress {
    pub stage: Stage,
    /// 1-based epoch over both stages, of `epochs` in all.
    pub epoch: usize,
    pub epochs: usize,
    /// Optimizer steps done, of `steps` planned in all.
    pub step: usize,
    pub steps: usize,
    /// Mean loss of the last optimizer step.
    pub loss: f64,
    /// Training tokens (forward + backward) per second over the last step.
    pub tokens_per_s: f64,
    /// The latest probe loss (absorb until learned).
    pub probe_loss: Option<f64>,
    /// This step ended its epoch (the adapter is as the epoch left it: a snapshot point).
    pub epoch_end: bool,
    /// The step this run continued from, when it resumed a checkpoint.
    pub resumed_from: Option<usize>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TrainReport {
    pub steps: usize,
    pub examples: usize,
    pub tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    /// Mean loss per epoch.
    pub epoch_losses: Vec<f64>,
    /// Loss of every optimizer step (for plots).
    pub step_losses: Vec<f64>,
    pub final_loss: f64,
    pub stopped_early: bool,
    /// Steps the fixed schedule plans (the ceiling when absorbing until learned).
    pub planned_steps: usize,
    /// `(step, probe loss)` at every probe (absorb until learned).
    pub probe_curve: Vec<(usize, f64)>,
    /// The step at which the probes plateaued and the learning rate began to cool down (absorb
    /// until learned).
    #[serde(default)]
    pub cooldown_from: Option<usize>,
    /// Why the cool-down began: the probes plateaued, or the step budget was reached.
    #[serde(default)]
    pub cooldown_cause: Option<CooldownCause>,
    /// Examples (segments and QA pairs) skipped as learned, summed over epochs (absorb until
    /// learned).
    pub skipped_examples: usize,
    /// Training stopped at the absorb's time budget, before its planned steps.
    #[serde(default)]
    pub out_of_time: bool,
    /// The step this run continued from, when it resumed a checkpoint: the steps before it were
    /// trained (and timed) by an earlier process.
    #[serde(default)]
    pub resumed_from: Option<usize>,
}

impl TrainReport {
    /// The optimizer steps this process ran: all of them, less those a resumed checkpoint had.
    pub fn steps_this_run(&self) -> usize {
        self.steps - self.resumed_from.unwrap_or(0).min(self.steps)
    }
}

/// A FltLM filter in training: the filter, the QA examples in its layout (they replace
/// `plan.qa`), the loss weight λ and margin m. Trainable when the filter has `Var`s (the prepared
/// base's training); [`FilterTraining::frozen`] only lays out and masks (a document's absorb over
/// the prepared base).
pub struct FilterTraining<'a> {
    pub filter: &'a Filter,
    pub examples: &'a [FilterExample],
    pub lambda: f64,
    pub margin: f64,
    /// The filter's learning rate relative to the adapter's.
    pub lr_scale: f64,
}

impl<'a> FilterTraining<'a> {
    /// The prepared base's filter (a detached copy) over `examples`: masks, learns nothing, adds
    /// no loss.
    pub fn frozen(filter: &'a Filter, examples: &'a [FilterExample]) -> Self {
        Self { filter, examples, lambda: 0.0, margin: 0.0, lr_scale: 0.0 }
    }

    /// Masks only: no parameters to train and no loss.
    pub fn is_frozen(&self) -> bool {
        self.filter.vars().is_empty() && self.lambda == 0.0
    }
}

/// What a LIFT run trains: `adapter` (its parameters `vars`) on the document `doc` as `plan` lays
/// it out.
#[derive(Clone, Copy)]
pub struct TrainInputs<'a> {
    pub doc: &'a [u32],
    pub plan: &'a Plan,
    pub adapter: &'a dyn Adapter,
    pub vars: &'a [Var],
}

/// How a caller follows and stops a training run: `on_progress` after every optimizer step,
/// `cancel` polled before each.
pub struct RunControl<'a, P> {
    pub on_progress: &'a mut dyn FnMut(&P),
    pub cancel: &'a dyn Fn() -> bool,
}

/// Trains `inputs.vars` (the parameters behind `inputs.adapter`) on `inputs.plan`: plain LIFT.
pub fn train(
    model: &Model,
    inputs: TrainInputs,
    opts: &TrainOptions,
    control: RunControl<Progress>,
) -> Result<TrainReport> {
    train_with(model, inputs, opts, None, None, control)
}

/// Trains `inputs.vars` (the parameters behind `inputs.adapter`) on `inputs.plan`, the QA examples
/// in `filter`'s layout and under its mask when there is one. A trainable filter's parameters are
/// trained beside the adapter's with their own optimizer, learning rate (× `lr_scale`) and
/// clipping (their gradients would otherwise dominate the global norm and shrink the adapter's
/// updates). With `opts.until_learned` and `probes`, the run stops once the probes are learned.
pub fn train_with(
    model: &Model,
    inputs: TrainInputs,
    opts: &TrainOptions,
    filter: Option<&FilterTraining>,
    probes: Option<&Probes>,
    control: RunControl<Progress>,
) -> Result<TrainReport> {
    train_long(model, inputs, opts, filter, probes, control, LongRun::default())
}

/// The gradient of `loss` for each of `vars` (zeros where it does not depend on one), detached.
pub(crate) fn gradients(loss: &Tensor, vars: &[Var]) -> Result<Vec<Tensor>> {
    let grads = loss.backward()?;
    Ok(vars
        .iter()
        .map(|v| match grads.get(v.as_tensor()) {
            Some(g) => Ok(g.detach()),
            None => v.zeros_like(),
        })
        .collect::<candle_core::Result<_>>()?)
}

#[cfg(test)]
mod tests {
    use super::loss::FrozenCache;
    use super::*;
    use crate::lift::absorb::plan::Example;
    use candle_core::{Device, Tensor};

    use crate::adapters::GatedMemory;
    use crate::lift::absorb::qa_examples::qa_examples;
    use crate::lift::answer::layout::FilterOptions;
    use crate::lift::absorb::qa::{QaPair, QaSource};

    const TEXT: &str = "The ferry leaves at dawn. The keeper is Anselm Varga. Tickets cost eleven coins. \
                        The captain is Ilse Moreau. Gulls nest on the island all summer long.";

    fn pair(question: &str, answer: &str, evidence: &str) -> QaPair {
        let at = TEXT.find(evidence).unwrap();
        QaPair {
            question: question.into(),
            answer: answer.into(),
            evidence: evidence.into(),
            evidence_span: (at, at + evidence.len()),
            source: QaSource::Extractive,
        }
    }

    /// The tiny model (4 layers, f32 float matmuls) over a prepared base whose filter scores at
    /// layer 1 and masks (its head scores every chunk about 4.5, its bias −3).
    fn tiny_with_filter() -> (tempfile::TempDir, Model) {
        let dir = tempfile::tempdir().unwrap();
        let spec = crate::testing::TinySpec { layers: 4, ..Default::default() };
        let path = crate::testing::write_hf(&dir.path().join("tiny"), &spec).unwrap();
        let mut model = Model::load(&path, &Device::Cpu).unwrap();
        // The cached layers run the f32 inference kernels: compare with the f32 trainable path.
        model.decoder.cpu_float_dtype = candle_core::DType::F32;
        let opts = FilterOptions { enabled: true, layer: Some(1), chunk_tokens: 24, ..Default::default() };
        let shape = crate::base::BaseShape { rank: 2, filter: opts };
        let mut base = crate::base::PreparedBase::new(&model, &shape, 3).unwrap();
        // A scoring head and a mask that acts (this head scores every chunk about 4.5).
        let mut f = base.filter.detached();
        let h = model.config().hidden_size;
        f.head_w = Tensor::from_vec(crate::testing::Rng::new(5).vec(h, 1.0), h, &Device::Cpu).unwrap();
        f.b = Tensor::new(&[-3.0f32], &Device::Cpu).unwrap();
        base.filter = f;
        base.save(&dir.path().join("base")).unwrap();
        base.install(&mut model).unwrap();
        (dir, model)
    }

    #[test]
    fn a_frozen_filter_gives_the_same_loss_and_gradients_over_cached_frozen_layers() {
        let (_dir, model) = tiny_with_filter();
        let pair = pair("Who is the keeper?", "Anselm Varga", "The keeper is Anselm Varga.");
        let document = crate::document::Document::encode(&model, TEXT).unwrap();
        let filter = model.base_filter().unwrap();
        let examples = qa_examples(&model, &document, &[pair], 1000, filter).unwrap();
        assert!(examples[0].chunks.len() >= 2);
        let ft = FilterTraining::frozen(filter, &examples);
        let gm = GatedMemory::new(model.config(), &[2, 3], false, 1, &Device::Cpu).unwrap();
        let ex = &examples[0].example;
        let (plain, _) = training_loss(&model, &gm, ex, Some((&ft, &examples[0])), None).unwrap();
        let g_plain = gradients(&plain, gm.vars()).unwrap();
        let mut cache = FrozenCache::new(1 << 30);
        for round in 0..2 {
            // Round 0 fills the cache (the stream entering layer 1, the score layer), round 1 reads it.
            let key = Some((&mut cache, 0));
            let (cached, _) = training_loss(&model, &gm, ex, Some((&ft, &examples[0])), key).unwrap();
            let d = (cached.to_scalar::<f32>().unwrap() - plain.to_scalar::<f32>().unwrap()).abs();
            assert!(d < 1e-4, "round {round}: loss differs by {d}");
            for (a, b) in gradients(&cached, gm.vars()).unwrap().iter().zip(&g_plain) {
                let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(d < 1e-4, "round {round}: gradient differs by {d}");
            }
        }
        assert!(cache.bytes > 0, "the stream below the filter was cached");
        // The mask acts: without the filter the same tokens have another loss.
        let (unmasked, _) = training_loss(&model, &gm, ex, None, None).unwrap();
        let d = (unmasked.to_scalar::<f32>().unwrap() - plain.to_scalar::<f32>().unwrap()).abs();
        assert!(d > 1e-4, "the soft mask changed nothing ({d})");
    }

    /// The largest absolute difference between `a` and `b`, against `b`'s largest magnitude.
    fn max_diff(a: &Tensor, b: &Tensor) -> (f32, f32) {
        let max = |t: Tensor| t.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        (max((a - b).unwrap()), max(b.clone()))
    }

    #[test]
    fn batched_rows_give_each_row_its_own_loss_and_the_step_the_rows_mean_gradients() {
        let (_dir, model) = tiny_with_filter();
        let pairs = [
            pair("Who is the keeper?", "Anselm Varga", "The keeper is Anselm Varga."),
            pair("What do tickets cost?", "eleven coins", "Tickets cost eleven coins."),
            pair("Who captains the ferry that leaves at dawn?", "Ilse Moreau", "The captain is Ilse Moreau."),
        ];
        let document = crate::document::Document::encode(&model, TEXT).unwrap();
        let filter = model.base_filter().unwrap();
        let examples = qa_examples(&model, &document, &pairs, 1000, filter).unwrap();
        // One is a plain row of another length without the filter: the whole text recited.
        let doc = document.tokens().to_vec();
        let plain = Example {
            kind: crate::lift::absorb::plan::ExampleKind::Segment(0),
            target: (0..doc.len()).map(|i| i > 0).collect(),
            tokens: doc,
            packing: None,
        };
        let lens: Vec<usize> = examples.iter().map(|e| e.example.tokens.len()).chain([plain.tokens.len()]).collect();
        assert!(lens.iter().min() < lens.iter().max(), "rows of different lengths are padded: {lens:?}");
        let rows: Vec<rows::Row> = examples
            .iter()
            .enumerate()
            .map(|(i, fx)| rows::Row { example: &fx.example, filter: Some(fx), cache_key: Some(i) })
            .chain([rows::Row { example: &plain, filter: None, cache_key: None }])
            .collect();
        let ft = FilterTraining::frozen(filter, &examples);
        assert!(rows.iter().all(|r| rows::batchable(r.example, Some(&ft))));
        // The adapter on every layer (the whole stack on the graph), and above the filter's score
        // layer (the layers below it frozen and cached).
        for layers in [vec![0, 1, 2, 3], vec![2, 3]] {
            let gm = GatedMemory::new(model.config(), &layers, false, 1, &Device::Cpu).unwrap();
            let alone: Vec<Tensor> = rows
                .iter()
                .map(|r| {
                    let fx = r.filter.map(|fx| (&ft, fx));
                    training_loss(&model, &gm, r.example, fx, None).unwrap().0
                })
                .collect();
            let mean = (Tensor::stack(&alone, 0).unwrap().sum_all().unwrap() / rows.len() as f64).unwrap();
            let want = gradients(&mean, gm.vars()).unwrap();
            let mut cache = FrozenCache::new(1 << 30);
            // Round 0 fills the frozen-layer cache of the QA rows, round 1 reads it.
            for round in 0..2 {
                let batched = rows::row_losses(&model, &gm, &rows.iter().collect::<Vec<_>>(), Some(filter), &mut cache).unwrap();
                for (i, (a, b)) in batched.iter().zip(&alone).enumerate() {
                    let (a, b) = (a.to_scalar::<f32>().unwrap(), b.to_scalar::<f32>().unwrap());
                    assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{layers:?} round {round}: row {i}'s loss {a} alone {b}");
                }
                let mean = (Tensor::stack(&batched, 0).unwrap().sum_all().unwrap() / rows.len() as f64).unwrap();
                for (g, w) in gradients(&mean, gm.vars()).unwrap().iter().zip(&want) {
                    let (diff, scale) = max_diff(g, w);
                    assert!(scale > 0.0, "{layers:?}: a parameter got no gradient");
                    assert!(diff <= 1e-4 * scale, "{layers:?} round {round}: gradient differs by {diff} (scale {scale})");
                }
            }
            assert_eq!(cache.bytes > 0, layers[0] > 0, "{layers:?}: the QA rows' frozen layers are cached");
        }
    }
}
