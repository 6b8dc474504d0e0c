//! The batch engine without HTTP: 16 generations (no adapter, greedy, fixed lengths) through
//! `engine::batcher::Batch` at max batch 1 and 16, for a short prompt (decode-bound) and a
//! 290-token prompt (prefill-bound, like the server benchmark's document questions): wall time,
//! steps, the mean pure-decode step, and decode throughput. Measures what batching buys on this
//! machine apart from the server around it.
//!
//!   RAYON_NUM_THREADS=2 LIFT_MODELS_DIR=models cargo bench --bench batch_steps
//!
//! BENCH_SHORT_ONLY=1 runs the 30-token prompts only. BENCH_GATED_MEMORY=1 gives each generation
//! its own Gated Memory adapter on every layer (random, the default absorb's shape), as 16 users
//! on 16 documents are: the adapters' cost per token in a mixed batch. BENCH_FLOAT_ROWS=N moves the decoder's `float_batch_min_rows` (the float-weights decode path).

use candle_core::Device;
use lift_serve::adapters::GatedMemory;
use lift_serve::engine::batcher::{Batch, Entry};
use lift_serve::model::Adapter;
use std::sync::Arc;
use lift_serve::model::generate::{SamplingParams, Sequence, PREFILL_CHUNK};
use lift_serve::model::{KvCache, Model, NoHooks};
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    lift_serve::runtime::tune_cpu();
    let path = lift_serve::fetch::resolve_model(None)?;
    let mut m = Model::load(&path, &Device::Cpu)?;
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
            let gm = GatedMemory::new(cfg, &layers, cfg.attention_bias, 100 + i as u64, &Device::Cpu)?;
            Ok(Some(Arc::new(gm.detached())))
        })
        .collect::<anyhow::Result<_>>()?;
    println!("adapters: {}", if adapters[0].is_some() { "a Gated Memory per generation, all layers" } else { "none" });
    println!("threads: {}  generations: {n}  float decode from {} rows", rayon::current_num_threads(), m.decoder.float_batch_min_rows);
    println!("| prompt | answer | max batch | wall s | steps | pure-decode step ms | ms per decoded token | vs max batch 1 |");
    println!("|---|---|---|---|---|---|---|---|");
    let only_short = std::env::var("BENCH_SHORT_ONLY").is_ok();
    for (prompt, answer) in [(30usize, 64usize), (290, 32)] {
        if only_short && prompt > 30 {
            continue;
        }
        let mut first = None;
        for max_batch in [1usize, n] {
            let mut batch: Batch<NoHooks, usize> = Batch::new(max_batch, PREFILL_CHUNK);
            let mut waiting: Vec<usize> = (0..n).collect();
            let (t0, mut steps, mut pure, mut done) = (Instant::now(), 0usize, Vec::new(), 0usize);
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
                let t = Instant::now();
                done += batch.step(&m, &mut |_: &mut usize, _: &str| true)?.len();
                if prompt_left == 0 && decoding == max_batch {
                    pure.push(t.elapsed().as_secs_f64() * 1e3);
                }
                steps += 1;
            }
            let wall = t0.elapsed().as_secs_f64();
            let step = pure.iter().sum::<f64>() / pure.len().max(1) as f64;
            let one = *first.get_or_insert(wall);
            println!(
                "| {prompt} | {answer} | {max_batch} | {wall:.2} | {steps} | {step:.1} | {:.2} | {:.2}× |",
                step / max_batch as f64,
                one / wall
            );
        }
    }
    Ok(())
}
