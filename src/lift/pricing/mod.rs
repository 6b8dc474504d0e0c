//! Pricing: what absorbing a document will cost, said before it runs. [`estimate`] is the one
//! cost function (the service, the engine, the server and the CLI ask it, and nothing outside
//! `lift` counts steps, training tokens or QA pairs): it counts the plan at the measured rate
//! (`estimate.rs`: [`plan_counts`], [`AbsorbRate`]) after fitting the options to their time budget
//! (`budget.rs`). Before any absorb has finished, the rate is this machine's, measured by a few
//! timed training steps when the server starts (`calibrate.rs`: [`calibrated_rate`]).

mod budget;
mod calibrate;
mod cost;
mod estimate;

pub use calibrate::{calibrate, calibrated_rate, Calibration};
pub use cost::{estimate, Cost};
pub use estimate::{
    most_training_tokens, plan_counts, qa_pairs_planned, AbsorbRate, Estimate, OptionWarning, PRIOR_OVERHEAD_SECONDS,
    PRIOR_SECONDS_PER_TOKEN,
};
