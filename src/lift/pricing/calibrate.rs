//! This machine's training rate, measured before any absorb has finished: a few real optimizer
//! steps of a short built-in document, absorbed with the options the estimates will be asked
//! about. A documented prior rate (`estimate::PRIOR_SECONDS_PER_TOKEN`) is one CPU's figure; a
//! server on more cores, under load or on a GPU trains at another rate, and every cost it said
//! before its first absorb finished (the `dry_run`, the time budget's fit) was off by that ratio.
//! The first finished absorb replaces the calibration, as it replaced the prior.

use crate::lift::absorb::{absorb, AbsorbEvent};
use crate::lift::options::AbsorbOptions;
use crate::document::Document;
use crate::model::Model;
use anyhow::Result;
use std::cell::Cell;
use std::time::Instant;

/// A short document (about 400 tokens: a few segments and a few dozen questions), so that the
/// steps timed are the plan's own mix of segment and question rows.
const TEXT: &str = include_str!("calibration.txt");

/// Steps trained before timing starts: the first steps make caches and weight copies.
const WARM_STEPS: usize = 2;
/// Timing stops after at least this many steps and this many seconds, or at [`MAX_STEPS`].
const MIN_STEPS: usize = 4;
const MIN_SECONDS: f64 = 2.0;
const MAX_STEPS: usize = 32;

/// What a calibration measured.
#[derive(Clone, Copy, Debug)]
pub struct Calibration {
    /// Seconds per training token of the steps timed.
    pub seconds_per_token: f64,
    pub steps: usize,
    pub seconds: f64,
}

/// Trains a few steps of the built-in document with `opts` (one epoch of segments and questions;
/// no budget) and times them. Nothing is stored; the adapter is dropped.
pub fn calibrate(model: &Model, opts: &AbsorbOptions) -> Result<Calibration> {
    let mut o = opts.clone();
    o.train.epochs = [0, 1];
    o.budget_seconds = None;
    o.train.until_learned = None;
    let document = Document::encode(model, TEXT)?;
    let (timed_steps, timed_seconds, timed_tokens) = (Cell::new(0usize), Cell::new(0f64), Cell::new(0f64));
    let (steps, last) = (Cell::new(0usize), Cell::new(None::<Instant>));
    let on_event = &mut |e: AbsorbEvent| {
        let AbsorbEvent::Train(p) = e else { return };
        let now = Instant::now();
        steps.set(steps.get() + 1);
        if let (Some(before), true) = (last.get(), steps.get() > WARM_STEPS) {
            let dt = now.duration_since(before).as_secs_f64();
            timed_steps.set(timed_steps.get() + 1);
            timed_seconds.set(timed_seconds.get() + dt);
            // The step's tokens, from its own rate over its own time (about `dt`).
            timed_tokens.set(timed_tokens.get() + p.tokens_per_s * dt);
        }
        last.set(Some(now));
    };
    let enough = || {
        (timed_steps.get() >= MIN_STEPS && timed_seconds.get() >= MIN_SECONDS) || timed_steps.get() >= MAX_STEPS
    };
    match absorb(model, &document, None, &o, on_event, &enough) {
        Ok(_) => {}
        Err(e) if e.downcast_ref::<crate::lift::absorb::cancelled::Cancelled>().is_some() => {}
        Err(e) => return Err(e),
    }
    anyhow::ensure!(timed_steps.get() > 0 && timed_tokens.get() > 0.0, "the calibration document planned too few steps to time");
    Ok(Calibration {
        seconds_per_token: timed_seconds.get() / timed_tokens.get(),
        steps: timed_steps.get(),
        seconds: timed_seconds.get(),
    })
}

/// [`calibrate`]'s seconds per training token, logged; None (estimates keep the prior) when it
/// cannot be measured.
pub fn calibrated_rate(model: &Model, opts: &AbsorbOptions) -> Option<f64> {
    match calibrate(model, opts) {
        Ok(c) => {
            tracing::info!(
                ms_per_token = c.seconds_per_token * 1e3,
                steps = c.steps,
                seconds = c.seconds,
                "absorb rate calibrated on this machine (the estimates' rate until an absorb finishes)"
            );
            Some(c.seconds_per_token)
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "cannot calibrate the absorb rate: estimates use the prior");
            None
        }
    }
}
