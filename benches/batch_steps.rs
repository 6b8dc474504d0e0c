//! The batch engine without HTTP: 16 generations (no adapter, greedy, at most N tokens each)
//! through `engine::batcher::Batch` at max batch 1 and 16, for a short prompt (decode-bound) and a
//! 290-token prompt (prefill-bound, like the server benchmark's document questions): wall time,
//! steps, decode rows (tokens decoded: greedy answers may end early, the same ones at either
//! batch size) and their rate, and the median of the steps that decode a full batch and prefill
//! nothing (the first ones, before any answer ends). Measures what batching buys on this
//! machine apart from the server around it.
//!
//!   RAYON_NUM_THREADS=2 LIFT_MODELS_DIR=models cargo bench --bench batch_steps
//!
//! BENCH_SHORT_ONLY=1 runs the 30-token prompts only; BENCH_ANSWER=N gives them at most N
//! tokens (64); BENCH_MAX_BATCH=1 or 16 runs one of the two batch sizes (to profile one).
//! BENCH_GATED_MEMORY=1 gives each generation its own Gated Memory adapter on every layer
//! (random, the default absorb's shape), as 16 users on 16 documents are: the adapters' cost per
//! token in a mixed batch. BENCH_FLOAT_ROWS=N moves the decoder's `float_batch_min_rows` (the
//! float-weights decode path). `BENCH_DEVICE=cuda` and `BENCH_MODEL=random-smollm2` (see
//! common/target.rs) run it on a GPU.

#[path = "common/stats.rs"]
mod stats;
#[path = "common/target.rs"]
mod target;
use stats::percentile;
use lift_serve::adapters::GatedMemory;
use lift_serve::engine::batcher::{Batch, Entry};
use lift_serve::model::Adapter;
use std::sync::Arc;
use lift_serve::model::generate::{SamplingParams, Sequence, PREFILL_CHUNK};
use lift_serve::model::{KvCache, NoHooks};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    lift_serve::runtime::tune_cpu();
    let dev = target::device()?;
    let target::Target { model: mut m, label, .. } = target::load(&dev)?;
    println!("model: {label}  device: {dev:?}");
    if let Some(rows) = std::env::var("BENCH_FLOAT_ROWS").ok().and_then(|s| s.parse().ok()) {
        m.decoder.float_batch_min_rows = rows;
    }
    m.decoder.prepare_float_weights()?;
    let layers = m.config().num_layers;
    let n = 16;
    let adapters: Vec<Option<Arc<dyn Adapter>>> = (0..n)
        .map(|i| -> anyhow::Result<Option<Arc<dyn Adapter>>> {
            if std::env::var("BENCH_GATED_MEMORY").is_err() {
                return Ok(None);
            }
            let cfg = m.config();
            let layers: Vec<usize> = (0..cfg.num_layers).collect();
            let gm = GatedMemory::new(cfg, &layers, cfg.attention_bias, 100 + i as u64, &dev)?;
            Ok(Some(Arc::new(gm.detached())))
        })
        .collect::<anyhow::Result<_>>()?;
    println!("adapters: {}", if adapters[0].is_some() { "a Gated Memory per generation, all layers" } else { "none" });
    println!("threads: {}  generations: {n}  float decode from {} rows", rayon::current_num_threads(), m.decoder.float_batch_min_rows);
    println!("| prompt | answer | max batch | wall s | steps | decode rows | decode rows/s | full-batch decode steps | their median ms | ms per decoded token | vs max batch 1 |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let only_short = std::env::var("BENCH_SHORT_ONLY").is_ok();
    let short_answer = std::env::var("BENCH_ANSWER").ok().and_then(|s| s.parse().ok()).unwrap_or(64usize);
    let only_batch: Option<usize> = std::env::var("BENCH_MAX_BATCH").ok().and_then(|s| s.parse().ok());
    for (prompt, answer) in [(30usize, short_answer), (290, 32)] {
        if only_short && prompt > 30 {
            continue;
        }
        let mut first = None;
        for max_batch in [1usize, n] {
            if only_batch.is_some_and(|b| b != max_batch) {
                continue;
            }
            let mut batch: Batch<NoHooks, usize> = Batch::new(max_batch, PREFILL_CHUNK);
            let mut waiting: Vec<usize> = (0..n).collect();
            let (t0, mut steps, mut pure, mut done, mut rows) = (Instant::now(), 0usize, Vec::new(), 0usize, 0usize);
            while done < n {
                while batch.has_room() && !waiting.is_empty() {
                    let i = waiting.remove(0);
                    let ids: Vec<u32> = (0..prompt).map(|j| ((i * 31 + j * 7) % 5000) as u32 + 100).collect();
                    let params = SamplingParams { max_tokens: answer, ..Default::default() };
                    let seq = Sequence::new(&m, ids, KvCache::new(layers), params, NoHooks)?;
                    let adapter_key = if adapters[i].is_some() { i + 1 } else { 0 };
                    batch.join(Entry { seq, adapter: adapters[i].clone(), adapter_key, data: i });
                }
                let (decoding, prompt_left) = batch.load();
                rows += decoding;
                let t = Instant::now();
                done += batch.step(&m, &mut |_: &mut usize, _: &str| true)?.len();
                if prompt_left == 0 && decoding == max_batch {
                    pure.push(t.elapsed().as_secs_f64() * 1e3);
                }
                steps += 1;
            }
            let wall = t0.elapsed().as_secs_f64();
            // The median: on a shared machine a few slow steps move a mean.
            let step = if pure.is_empty() { 0.0 } else { percentile(&pure, 0.5) };
            let one = *first.get_or_insert(wall);
            println!(
                "| {prompt} | {answer} | {max_batch} | {wall:.2} | {steps} | {rows} | {:.1} | {} | {step:.1} | {:.2} | {:.2}× |",
                rows as f64 / wall,
                pure.len(),
                step / max_batch as f64,
                one / wall
            );
        }
    }
    Ok(())
}
