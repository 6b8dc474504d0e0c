//! A run's checkpoints: the cursor that continues it exactly, the checkpoint written (cursor,
//! parameters, optimizer moments), and what a long run adds (checkpoints, a deadline).

use super::{TrainReport, UntilLearnedState};
use anyhow::Result;
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Where a run stands after an optimizer step: what, with the parameters and the optimizers'
/// moments, continues it exactly as if it had never stopped.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Cursor {
    /// Optimizer steps done.
    pub step: usize,
    /// The epoch in progress (1-based over both stages) and its batches done.
    pub epoch: usize,
    pub batch: usize,
    /// The seeded stream's position before this epoch's draw, and now (ChaCha word positions,
    /// as decimal strings: JSON numbers stop at 2⁵³).
    pub epoch_rng: String,
    pub rng: String,
    /// The epoch's loss sum so far and `report.examples` when it began.
    pub epoch_loss: f64,
    pub epoch_examples: usize,
    /// Early stopping's count (no best yet: None; JSON has no infinity).
    pub best_epoch_loss: Option<f64>,
    pub epochs_since_best: usize,
    /// The report so far (its `seconds`: training time before this point).
    pub report: TrainReport,
    /// Absorbing until learned: the rule's state and the examples' visits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_learned: Option<UntilLearnedState>,
}

/// A checkpoint of a run: its [`Cursor`] and named tensors (`param.{i}`: the trained parameters
/// in `TrainInputs::vars` order; `optimizer.*`: the moments and step counts).
pub struct TrainCheckpoint {
    pub cursor: Cursor,
    pub tensors: std::collections::HashMap<String, Tensor>,
}

/// A run's checkpoints: written every `interval` and when the segment stage ends (at a step
/// boundary; never part-way through a step), and the one it resumes from.
pub struct Checkpointing<'a> {
    pub interval: std::time::Duration,
    pub resume: Option<TrainCheckpoint>,
    pub save: &'a mut dyn FnMut(TrainCheckpoint) -> Result<()>,
}

/// What a long run adds to [`train_with`](super::train_with): checkpoints, and a deadline at which it stops at the
/// next step boundary and keeps what it has trained (an absorb's time budget).
#[derive(Default)]
pub struct LongRun<'a> {
    pub checkpoints: Option<Checkpointing<'a>>,
    pub deadline: Option<Instant>,
}
