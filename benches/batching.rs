//! Continuous batching over real HTTP on the default model: N clients (default 16), each asking
//! about its own absorbed document (so every sequence in the batch has a different Gated Memory
//! adapter), streamed chat completions. The same load runs against servers with `--max-batch`
//! 1 (one request at a time, the old engine), 4 and 16, on one adapter store, in one run:
//! aggregate decode throughput (completion tokens / wall time), requests/s, p50/p95 time to
//! first token and latency; then, at the largest batch, the same load in mode `icl` (no adapter,
//! same prompt): the adapter's cost per token in a mixed batch.
//!
//!   RAYON_NUM_THREADS=2 LIFT_MODELS_DIR=models cargo bench --bench batching
//!
//! Environment: BENCH_CLIENTS (16), BENCH_REQUESTS per client (2), BENCH_MAX_TOKENS (32),
//! BENCH_CONTEXT_TOKENS (256), BENCH_BATCHES ("1,4,16"), BENCH_ADAPTERS (a directory kept between
//! runs: the 16 absorptions take ~10 minutes on 2 cores).

#[path = "common/stats.rs"]
mod stats;
use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use lift_serve::server::{self, ServeConfig};
use serde_json::{json, Value};
use stats::percentile;
use std::path::Path;
use std::time::{Duration, Instant};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// One streamed chat completion: (time to first content, total, completion tokens).
async fn stream_chat(c: &reqwest::Client, base: &str, doc: &str, question: &str, mode: &str, max_tokens: usize) -> Result<(f64, f64, usize)> {
    let body = json!({"model": doc, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                      "stream": true, "stream_options": {"include_usage": true}, "mode": mode});
    let t0 = Instant::now();
    let resp = c.post(format!("{base}/v1/chat/completions")).json(&body).send().await?;
    if resp.status() != 200 {
        bail!("chat: {} {}", resp.status(), resp.text().await.unwrap_or_default());
    }
    let mut stream = resp.bytes_stream();
    let (mut buf, mut first, mut tokens) = (String::new(), None, 0usize);
    while let Some(bytes) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&bytes?));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data)?;
            if first.is_none() && v["choices"][0]["delta"]["content"].as_str().is_some_and(|s| !s.is_empty()) {
                first = Some(t0.elapsed().as_secs_f64());
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            }
        }
    }
    let total = t0.elapsed().as_secs_f64();
    Ok((first.unwrap_or(total), total, tokens))
}

async fn start(adapters: &Path, max_batch: usize, context_tokens: usize, options: &Path) -> Result<(server::Running, String)> {
    let model = lift_serve::fetch::resolve_model(None)?;
    let mut cfg = ServeConfig::new(model, adapters.to_path_buf());
    cfg.runtime = lift_serve::runtime::RuntimeConfig::from_env()?;
    cfg.absorb_options = Some(options.to_path_buf());
    cfg.context_tokens = Some(context_tokens);
    cfg.max_batch = max_batch;
    cfg.generate_queue = 256;
    cfg.train_queue = 64;
    let state = tokio::task::block_in_place(|| server::build_state(cfg, &candle_core::Device::Cpu))?;
    let running = server::start(state).await?;
    let base = format!("http://{}", running.addr);
    Ok((running, base))
}

struct Load {
    wall: f64,
    tokens: usize,
    requests: usize,
    ttft: Vec<f64>,
    latency: Vec<f64>,
}

async fn load(base: &str, docs: &[String], per_client: usize, mode: &str, max_tokens: usize) -> Result<Load> {
    let questions = ["Who built the harbor?", "What happened in the storm?", "Describe the lighthouse.", "What is the harbor known for?"];
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (k, doc) in docs.iter().enumerate() {
        let (base, doc, mode) = (base.to_string(), doc.clone(), mode.to_string());
        tasks.push(tokio::spawn(async move {
            let c = reqwest::Client::builder().timeout(Duration::from_secs(1200)).build()?;
            let mut out = Vec::new();
            for j in 0..per_client {
                out.push(stream_chat(&c, &base, &doc, questions[(k + j) % questions.len()], &mode, max_tokens).await?);
            }
            anyhow::Ok(out)
        }));
    }
    let mut l = Load { wall: 0.0, tokens: 0, requests: 0, ttft: Vec::new(), latency: Vec::new() };
    for t in tasks {
        for (ttft, total, tokens) in t.await?? {
            l.ttft.push(ttft * 1e3);
            l.latency.push(total * 1e3);
            l.tokens += tokens;
            l.requests += 1;
        }
    }
    l.wall = t0.elapsed().as_secs_f64();
    Ok(l)
}

async fn run() -> Result<()> {
    let clients = env_usize("BENCH_CLIENTS", 16).max(1);
    let per_client = env_usize("BENCH_REQUESTS", 2).max(1);
    let max_tokens = env_usize("BENCH_MAX_TOKENS", 32);
    let context_tokens = env_usize("BENCH_CONTEXT_TOKENS", 256);
    let batches: Vec<usize> = std::env::var("BENCH_BATCHES")
        .unwrap_or_else(|_| "1,4,16".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let tmp = tempfile::tempdir()?;
    // BENCH_ADAPTERS: a store kept between runs (its documents are found again, not re-absorbed).
    let adapters = std::env::var_os("BENCH_ADAPTERS").map_or_else(|| tmp.path().join("adapters"), std::path::PathBuf::from);
    let options = tmp.path().join("absorb.json");
    // Quick absorptions: this measures serving, not what the adapters learned.
    std::fs::write(&options, json!({"plan": {"window": 128, "context_tokens": 32}, "train": {"epochs": [1, 1]},
                                    "qa": {"use_model": false, "max_pairs": 2, "min_pairs": 1}}).to_string())?;
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/harbor_history.txt"))?;
    let head: String = text.chars().take(1500).collect();

    // Absorb one document per client (different texts: different ids and adapters).
    let (running, base) = start(&adapters, 1, context_tokens, &options).await?;
    let c = reqwest::Client::builder().timeout(Duration::from_secs(1200)).build()?;
    let t0 = Instant::now();
    let mut docs = Vec::new();
    for k in 0..clients {
        let body = json!({"text": format!("Record {k} of the harbor archive.\n\n{head}"), "title": format!("harbor {k}")});
        let d: Value = c.post(format!("{base}/documents")).json(&body).send().await?.json().await?;
        docs.push(d["id"].as_str().with_context(|| format!("POST /documents: {d}"))?.to_string());
    }
    for id in &docs {
        loop {
            let d: Value = c.get(format!("{base}/documents/{id}")).send().await?.json().await?;
            match d["status"].as_str() {
                Some("ready") => break,
                Some("queued") | Some("training") => tokio::time::sleep(Duration::from_millis(500)).await,
                _ => bail!("absorb failed: {d}"),
            }
        }
    }
    running.shutdown().await;
    println!(
        "threads: {}  clients: {clients} (one document each, absorbed in {:.0} s)  requests: {per_client} per client  \
         answer: {max_tokens} tokens  context: {context_tokens} tokens",
        rayon::current_num_threads(),
        t0.elapsed().as_secs_f64()
    );

    println!("\n| max batch | mode | requests/s | decode tok/s (aggregate) | p50 / p95 time to first token | p50 / p95 latency | vs batch 1 |");
    println!("|---|---|---|---|---|---|---|");
    let mut one = None;
    let mut runs = Vec::new();
    for &b in &batches {
        let modes: &[&str] = if Some(&b) == batches.iter().max() { &["lift", "icl"] } else { &["lift"] };
        let (running, base) = start(&adapters, b, context_tokens, &options).await?;
        // Warm-up: every adapter loaded once.
        load(&base, &docs, 1, "lift", 2).await?;
        for &mode in modes {
            let l = load(&base, &docs, per_client, mode, max_tokens).await?;
            let tps = l.tokens as f64 / l.wall;
            if b == 1 && mode == "lift" {
                one = Some(tps);
            }
            println!(
                "| {b} | {mode} | {:.2} | {tps:.1} | {:.0} / {:.0} ms | {:.0} / {:.0} ms | {} |",
                l.requests as f64 / l.wall,
                percentile(&l.ttft, 0.5),
                percentile(&l.ttft, 0.95),
                percentile(&l.latency, 0.5),
                percentile(&l.latency, 0.95),
                one.map_or("".into(), |o| format!("{:.2}×", tps / o))
            );
            runs.push((b, mode, tps));
        }
        running.shutdown().await;
    }
    let top = batches.iter().max().copied().unwrap_or(1);
    let lift = runs.iter().find(|r| r.0 == top && r.1 == "lift").map(|r| r.2);
    let icl = runs.iter().find(|r| r.0 == top && r.1 == "icl").map(|r| r.2);
    if let (Some(l), Some(i)) = (lift, icl) {
        println!("\nadapter cost per token in a batch of {top} different adapters: {:+.1}% (icl {i:.1} tok/s vs lift {l:.1})", (i / l - 1.0) * 100.0);
    }
    Ok(())
}

fn main() -> Result<()> {
    lift_serve::runtime::tune_cpu();
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(run())
}
