//! The absorb cost estimate (`POST /documents` with `dry_run`) against the measured absorb, on the
//! server in-process over HTTP, for documents of several lengths taken in order: each length's
//! estimate is what the server says at that moment (the documented prior before any absorb has
//! finished, then its measured rate), then the real absorb is timed from the POST to `ready`. The
//! estimate every length would get from the prior alone is printed beside it.
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench estimate
//!   BENCH_LENGTHS=1024,2048,4096 BENCH_OPTIONS='{"epochs": [3, 5]}' cargo bench --bench estimate
//!
//! Defaults: 128, 256 and 512 tokens with small options (window 128, epochs [1, 2], 8 QA pairs),
//! minutes on 2 cores.
//!
//! Documents: the prose fixtures (as `benches/absorb.rs`). The prepared base is `base/` when
//! present, as for the server.

use lift_serve::lift::pricing::{PRIOR_OVERHEAD_SECONDS, PRIOR_SECONDS_PER_TOKEN};
use lift_serve::server::{self, ServeConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[path = "common/prose.rs"]
mod prose;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let lengths: Vec<usize> = std::env::var("BENCH_LENGTHS")
        .unwrap_or_else(|_| "128,256,512".into())
        .split(',')
        .map(|s| s.trim().parse().expect("BENCH_LENGTHS: numbers"))
        .collect();
    let options: Value = serde_json::from_str(
        &std::env::var("BENCH_OPTIONS").unwrap_or_else(|_| r#"{"window": 128, "epochs": [1, 2], "aux_qa": 8}"#.into()),
    )?;
    let tmp = tempfile::tempdir()?;
    let model = lift_serve::fetch::resolve_model(None)?;
    let mut cfg = ServeConfig::new(model, tmp.path().join("adapters"));
    cfg.runtime = lift_serve::runtime::RuntimeConfig::from_env()?;
    if std::path::Path::new("base/manifest.json").exists() {
        cfg.prepared_base = Some("base".into());
    }
    let state = server::build_state(cfg, &candle_core::Device::Cpu)?;
    let running = server::start(state).await?;
    let base = format!("http://{}", running.addr);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(7200)).build()?;
    println!("options {options}");
    println!("| tokens | planned steps | training tokens | estimate s (rate) | prior-only estimate s | measured s | estimate / measured |");
    println!("|---|---|---|---|---|---|---|");
    for &len in &lengths {
        let text = prose::document(running.state.service.model(), len)?;
        let body = json!({"text": text, "options": options});
        let mut dry = body.clone();
        dry["dry_run"] = json!(true);
        let est: Value = http.post(format!("{base}/documents")).json(&dry).send().await?.json().await?;
        let e = &est["estimate"];
        anyhow::ensure!(e.is_object(), "dry run refused: {est}");
        let t0 = Instant::now();
        let d: Value = http.post(format!("{base}/documents")).json(&body).send().await?.json().await?;
        let id = d["id"].as_str().ok_or_else(|| anyhow::anyhow!("post refused: {d}"))?.to_string();
        let ready = loop {
            let v: Value = http.get(format!("{base}/documents/{id}")).send().await?.json().await?;
            match v["status"].as_str() {
                Some("ready") => break v,
                Some("failed" | "cancelled") => anyhow::bail!("absorb ended: {v}"),
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        let measured = t0.elapsed().as_secs_f64();
        anyhow::ensure!(ready["training"]["planned_steps"] == e["planned_steps"], "steps differ: {ready} vs {est}");
        let (said, tokens) = (e["seconds"].as_f64().unwrap(), e["training_tokens"].as_u64().unwrap());
        println!(
            "| {} | {} | {} | {:.1} ({}, {} absorbs) | {:.1} | {:.1} | {:.2} |",
            est["tokens"], e["planned_steps"], tokens, said, e["rate"].as_str().unwrap(), e["measured_absorbs"],
            PRIOR_OVERHEAD_SECONDS + tokens as f64 * PRIOR_SECONDS_PER_TOKEN, measured, said / measured
        );
    }
    running.shutdown().await;
    Ok(())
}
