//! Absorb benchmark on the default model: end-to-end absorb time, training tokens/s and peak
//! memory for documents of several lengths, the time ratio to the shortest (linear cost means
//! ratio ≈ length ratio), and the adapter's size next to the KV cache the same document would
//! need in context.
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench absorb
//!   BENCH_LENGTHS=1024,4096,16384 BENCH_OPTIONS=options.json cargo bench --bench absorb
//!
//! Documents are built from the prose fixtures (chapters renumbered so that no two are identical)
//! and cut at the sentence that reaches the length. Options: `BENCH_OPTIONS` (AbsorbOptions JSON),
//! else the defaults with extractive QA only (`BENCH_MODEL_QA=1` keeps model QA). The prepared
//! base is `base/` when present, as for `absorb`; `BENCH_PREPARED_BASE=DIR|none` picks another.
//! `BENCH_DEVICE=cuda` and `BENCH_MODEL=random-smollm2` (see common/target.rs) absorb on a GPU
//! (there the peak RSS column is the host's, not the GPU's memory).

use lift_serve::document::Document;
use lift_serve::lift::{absorb, AbsorbEvent, AbsorbOptions};
use std::time::Instant;

#[path = "common/target.rs"]
mod target;

#[path = "common/prose.rs"]
mod prose;
use prose::document;

/// Peak resident memory of this process so far (VmHWM), in MiB; the kernel lets us reset it.
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn main() -> anyhow::Result<()> {
    lift_serve::runtime::tune_cpu();
    let lengths: Vec<usize> = std::env::var("BENCH_LENGTHS")
        .unwrap_or_else(|_| "1024,2048,4096".into())
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let mut opts: AbsorbOptions = match std::env::var("BENCH_OPTIONS") {
        // Laid over the defaults, flat or nested, as the server and the CLI read options files.
        Ok(path) => AbsorbOptions::from_file(std::path::Path::new(&path))?,
        Err(_) => AbsorbOptions::default(),
    };
    if std::env::var("BENCH_MODEL_QA").is_err() {
        opts.qa.use_model = false;
    }
    let dev = target::device()?;
    let target::Target { mut model, label, .. } = target::load(&dev)?;
    println!("model: {label}  device: {dev:?}");
    // As `absorb` does: the prepared base in base/ if present; BENCH_PREPARED_BASE=DIR|none.
    lift_serve::base::install_from_arg(&mut model, std::env::var("BENCH_PREPARED_BASE").ok().as_deref())?;
    println!("prepared base: {}", model.info.prepared_base.as_deref().unwrap_or("none"));
    let cfg = model.config();
    println!("threads: {}  options: {}", rayon::current_num_threads(), serde_json::to_string(&opts)?);
    println!(
        "| tokens | absorb s | ratio to first | length ratio | QA pairs | steps | train tok/s | peak RSS MiB | adapter bytes | KV cache bytes (f32) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut first: Option<(usize, f64)> = None;
    for &n in &lengths {
        let text = document(&model, n)?;
        reset_peak_rss();
        let t0 = Instant::now();
        let mut last_step = 0;
        // Tokenizing stays inside the timed span, as it was inside `absorb` before.
        let doc = Document::encode(&model, text)?;
        let absorbed = absorb(
            &model,
            &doc,
            None,
            &opts,
            &mut |e| {
                if let AbsorbEvent::Train(p) = e {
                    if p.step >= last_step + 50 {
                        last_step = p.step;
                        eprintln!("  {n}: step {}/{} loss {:.3}", p.step, p.steps, p.loss);
                    }
                }
            },
            &|| false,
        )?;
        let secs = t0.elapsed().as_secs_f64();
        let tokens = doc.len();
        let (t1, s1) = *first.get_or_insert((tokens, secs));
        let adapter_bytes = absorbed.bundle.bytes();
        // K and V for every layer and KV head, f32, for the whole document in context.
        let kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * tokens;
        println!(
            "| {tokens} | {secs:.1} | {:.2} | {:.2} | {} | {} | {:.0} | {:.0} | {adapter_bytes} | {kv_bytes} |",
            secs / s1,
            tokens as f64 / t1 as f64,
            absorbed.qa.len(),
            absorbed.report.steps,
            absorbed.report.tokens_per_s,
            peak_rss_mib(),
        );
    }
    Ok(())
}
