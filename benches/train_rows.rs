//! Batched training rows against the same rows one by one: one epoch of segments + QA (the
//! absorb's second stage) on a real document with the default model and the prepared base, at
//! several rows per optimizer step, each size trained batched (`TrainOptions::batch_rows`: a
//! forward/backward over the step's rows of like length) and one by one, alternating A B A B. The two give the
//! same gradients (`lift::absorb::trainer` tests), so the same step losses: the bench prints how far apart
//! they came out as well as the training seconds, tokens/s and the ratio.
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench train_rows
//!
//! BENCH_TOKENS (1024): the document's length; BENCH_ROWS (4,8): rows per step; BENCH_REPEATS
//! (2): runs of each; BENCH_PADDING (0.25): the padding a batched group may carry (see
//! `TrainOptions::batch_rows`; 100: every row of a step in one forward); BENCH_OPTIONS: AbsorbOptions JSON (else the defaults, extractive QA only).
//! `BENCH_DEVICE=cuda` and `BENCH_MODEL=random-smollm2` (see common/target.rs) run it on a GPU.

use lift_serve::document::Document;
use lift_serve::lift::{absorb, AbsorbOptions};

#[path = "common/target.rs"]
mod target;

#[path = "common/prose.rs"]
mod prose;

#[path = "common/stats.rs"]
#[allow(dead_code)]
mod stats;

fn env_list(name: &str, default: &str) -> anyhow::Result<Vec<usize>> {
    Ok(std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?)
}

fn main() -> anyhow::Result<()> {
    lift_serve::runtime::tune_cpu();
    let tokens = env_list("BENCH_TOKENS", "1024")?[0];
    let sizes = env_list("BENCH_ROWS", "4,8")?;
    let repeats = env_list("BENCH_REPEATS", "2")?[0].max(1);
    let padding: f64 = std::env::var("BENCH_PADDING").map_or(Ok(0.25), |s| s.parse())?;
    let mut opts: AbsorbOptions = match std::env::var("BENCH_OPTIONS") {
        Ok(path) => serde_json::from_str(&std::fs::read_to_string(path)?)?,
        Err(_) => AbsorbOptions::default(),
    };
    if std::env::var("BENCH_OPTIONS").is_err() {
        opts.qa.use_model = false;
    }
    // One epoch of the second stage: every segment and question once.
    opts.train.epochs = [0, 1];
    let dev = target::device()?;
    let target::Target { mut model, label, .. } = target::load(&dev)?;
    lift_serve::base::install_from_arg(&mut model, std::env::var("BENCH_PREPARED_BASE").ok().as_deref())?;
    let base = model.info.prepared_base.clone().unwrap_or_else(|| "none".into());
    println!("model: {label}  device: {dev:?}  prepared base: {base}  threads: {}", rayon::current_num_threads());
    let doc = Document::encode(&model, prose::document(&model, tokens)?)?;
    println!(
        "document: {} tokens; one epoch of segments + QA per run, {repeats} runs of each; padding {padding}",
        doc.len()
    );
    println!("| rows per step | steps | batched s | one by one s | batched tok/s | one by one tok/s | one by one / batched | step-loss max diff |");
    println!("|---|---|---|---|---|---|---|---|");
    for &rows in &sizes {
        let mut secs = [Vec::new(), Vec::new()];
        let mut tok_s = [Vec::new(), Vec::new()];
        let mut losses: [Vec<f64>; 2] = Default::default();
        let mut steps = 0;
        for _ in 0..repeats {
            for (k, batch_rows) in [Some(padding), None].into_iter().enumerate() {
                let mut o = opts.clone();
                o.train.accumulation = rows;
                o.train.batch_rows = batch_rows;
                let absorbed = absorb(&model, &doc, None, &o, &mut |_| {}, &|| false)?;
                target::sync(&dev);
                let r = &absorbed.report;
                eprintln!("  {rows} rows, batched {batch_rows:?}: {} steps in {:.1} s", r.steps, r.seconds);
                secs[k].push(r.seconds);
                tok_s[k].push(r.tokens_per_s);
                losses[k] = r.step_losses.clone();
                steps = r.steps;
            }
        }
        // The middle run, or the mean of the middle two.
        let median = |v: &[f64]| (stats::percentile(v, 0.5) + stats::percentile(v, 0.5 + 0.5 / v.len() as f64)) / 2.0;
        let diff = losses[0].iter().zip(&losses[1]).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        println!(
            "| {rows} | {steps} | {:.1} | {:.1} | {:.0} | {:.0} | {:.2} | {diff:.1e} |",
            median(&secs[0]),
            median(&secs[1]),
            median(&tok_s[0]),
            median(&tok_s[1]),
            median(&secs[1]) / median(&secs[0]),
        );
    }
    Ok(())
}
