//! `prepare-base` step time on the default model, per arm of the pre-registered comparison (plain
//! LoRA, + filter, + CDT, + both), on training examples of the shipped data builder.
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench prepare
//!   BENCH_STEPS=4 BENCH_TOKENS=1024 BENCH_ARMS=both cargo bench --bench prepare
//!
//! Prints, per arm, the median seconds per step after the first (which pays the allocator's
//! warm-up), the mean tokens per example, and the ratio to the plain-LoRA arm measured in the
//! same run.

use candle_core::Device;
use lift_serve::base::data::{self, BuildOptions};
use lift_serve::corpus::Split;
use lift_serve::base::train::{self, PrepareOptions};
use lift_serve::lift::absorb::trainer::RunControl;
use lift_serve::model::Model;
use std::time::Instant;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> anyhow::Result<()> {
    lift_serve::runtime::tune_cpu();
    let steps: usize = env_or("BENCH_STEPS", 3);
    let tokens: usize = env_or("BENCH_TOKENS", 1024);
    let arms = std::env::var("BENCH_ARMS").unwrap_or_else(|_| "lora,filter,cdt,both".into());
    let runtime = lift_serve::runtime::RuntimeConfig::from_env()?;
    let model = Model::load_with(&lift_serve::fetch::resolve_model(None)?, &Device::Cpu, &runtime)?;
    let essays = lift_serve::corpus::data_dir().join("pg-essays");
    let build = BuildOptions { min_tokens: tokens, max_tokens: tokens, ..Default::default() };
    let examples = data::build_examples_with(&essays, Split::Train, steps, 0, &build)?;
    let lens: Vec<usize> =
        examples.iter().enumerate().map(|(i, e)| Ok(train::filter_example(&model, e, i)?.0.example.tokens.len())).collect::<anyhow::Result<_>>()?;
    println!("examples: {steps}, tokens {lens:?}");
    let mut baseline = None;
    for arm in arms.split(',') {
        let mut opts = PrepareOptions { checkpoint_seconds: 1e9, ..Default::default() };
        opts.shape.filter.enabled = matches!(arm, "filter" | "both");
        opts.cdt.enabled = matches!(arm, "cdt" | "both");
        let out = tempfile::tempdir()?;
        let mut times = Vec::new();
        let mut last = Instant::now();
        let training_set = train::TrainingSet { examples: &examples, hash: "bench" };
        let on_progress = &mut |_: &train::PrepareProgress| {
            times.push(last.elapsed().as_secs_f64());
            last = Instant::now();
        };
        train::prepare(&model, training_set, &opts, out.path(), false, RunControl { on_progress, cancel: &|| false })?;
        let per_step = median(times[1.min(times.len() - 1)..].to_vec());
        let base = *baseline.get_or_insert(per_step);
        println!(
            "{arm:>6}: {per_step:6.2} s/step (steps {:?}), ×{:.2} of plain LoRA",
            times.iter().map(|t| (t * 100.0).round() / 100.0).collect::<Vec<_>>(),
            per_step / base
        );
    }
    Ok(())
}
