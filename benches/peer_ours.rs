//! Our side of the llama.cpp peer benchmark (benches/peers.sh): prefill of 512 and 2048 tokens
//! through `prefill` (the serving path) and 64 greedy decode steps after a 128-token prompt, on
//! token ids shared with the llama.cpp side. Prints one JSON line.
//!
//!   PEERS_IDS=target/peers/ids.json RAYON_NUM_THREADS=2 cargo bench --bench peer_ours

use candle_core::Device;
use lift_serve::model::generate::prefill;
use lift_serve::model::{KvCache, Model, NoHooks};
use std::time::Instant;

#[path = "common/decode.rs"]
mod decode;

const DECODE_PROMPT: usize = 128;
const DECODE_STEPS: usize = 64;

fn main() -> anyhow::Result<()> {
    lift_serve::runtime::tune_cpu();
    let ids_path = std::env::var("PEERS_IDS").map_err(|_| anyhow::anyhow!("set PEERS_IDS to the ids JSON file"))?;
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ids_path)?)?;
    let ids: Vec<u32> = serde_json::from_value(doc["ids"].clone())?;
    anyhow::ensure!(ids.len() >= 2048, "{ids_path}: need at least 2048 ids, found {}", ids.len());

    let dev = Device::Cpu;
    let path = lift_serve::fetch::resolve_model(None)?;
    let t_load = Instant::now();
    let model = Model::load_with(&path, &dev, &lift_serve::runtime::RuntimeConfig::from_env()?)?;
    model.decoder.prepare_float_weights()?;
    let load_s = t_load.elapsed().as_secs_f64();
    let layers = model.config().num_layers;

    let time_prefill = |n: usize| -> anyhow::Result<f64> {
        let mut cache = KvCache::new(layers);
        let t = Instant::now();
        prefill(&model, &ids[..n], &mut cache, None, &mut NoHooks)?;
        Ok(t.elapsed().as_secs_f64())
    };
    // Greedy decode after a fresh prompt; returns the time of each step (argmax + one forward).
    let decode = |steps: usize| -> anyhow::Result<Vec<f64>> {
        let mut cache = KvCache::new(layers);
        let logits = prefill(&model, &ids[..DECODE_PROMPT], &mut cache, None, &mut NoHooks)?.unsqueeze(0)?;
        decode::timed_greedy_steps(&model, &mut cache, logits, steps)
    };

    // Warm-up: touches every weight, the allocator's pools and both paths once.
    time_prefill(512)?;
    decode(4)?;

    let p512 = time_prefill(512)?;
    let p2048 = time_prefill(2048)?;
    let steps = decode(DECODE_STEPS)?;
    let mean = steps.iter().sum::<f64>() / steps.len() as f64;
    let mut sorted = steps.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted[sorted.len() / 2];

    let out = serde_json::json!({
        "side": "ours",
        "threads": rayon::current_num_threads(),
        "model": path.display().to_string(),
        "load_s": load_s,
        "prefill_512_ms": p512 * 1e3,
        "prefill_512_tok_s": 512.0 / p512,
        "prefill_2048_ms": p2048 * 1e3,
        "prefill_2048_tok_s": 2048.0 / p2048,
        "decode_ms_per_tok": mean * 1e3,
        "decode_median_ms_per_tok": median * 1e3,
        "decode_steps": DECODE_STEPS,
        "decode_prompt": DECODE_PROMPT,
    });
    println!("{out}");
    Ok(())
}
