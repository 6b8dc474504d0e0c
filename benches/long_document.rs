//! A long document through the server, as a user sends it: real prose of BENCH_TOKENS tokens (the
//! essays of `lift-serve fetch-data`, in file order) posted with `budget_seconds`, on the server
//! in-process over HTTP (the prepared base `base/` when present, as for the server). Prints:
//! the dry run's estimate with and without the budget (QA pairs, coverage, steps, what the budget
//! gave up), the first answer's latency right after the upload (mode `lift`, which answers from
//! the passages until an adapter exists), the absorb's wall time against the budget and the
//! fitted estimate, the peak resident memory sampled during the absorb, the steps trained and
//! the adapter's size.
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench long_document
//!   BENCH_TOKENS=16384 BENCH_BUDGET=600 cargo bench --bench long_document
//!
//! Defaults: 65,536 tokens, a budget of 1,800 s (about 35 minutes on 2 cores in all).

use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().map(|v| v.parse().ok().unwrap_or_else(|| panic!("{name}: not a number"))).unwrap_or(default)
}

/// The essays in file order, joined, cut at a paragraph once past `tokens` tokens.
fn essays(model: &lift_serve::model::Model, tokens: usize) -> anyhow::Result<String> {
    let dir = lift_serve::corpus::data_dir().join(lift_serve::corpus::ESSAYS_DIR);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|e| anyhow::anyhow!("{}: {e} (run `lift-serve fetch-data`)", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    files.sort();
    let mut text = String::new();
    for f in files {
        for para in std::fs::read_to_string(&f)?.split("\n\n") {
            let para = para.trim();
            if para.is_empty() {
                continue;
            }
            text.push_str(para);
            text.push_str("\n\n");
            // Counting every paragraph would tokenize the whole text again each time: estimate
            // by characters first.
            if text.len() > tokens * 3 && model.tokenizer.encode(&text, false)?.len() >= tokens {
                return Ok(text);
            }
        }
    }
    anyhow::bail!("the essays hold fewer than {tokens} tokens")
}

/// Resident and peak resident memory of this process, in MB.
fn memory_mb() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let tokens: usize = env_or("BENCH_TOKENS", 65_536);
    let budget: f64 = env_or("BENCH_BUDGET", 1800.0);
    let tmp = tempfile::tempdir()?;
    let model = lift_serve::fetch::resolve_model(None)?;
    let mut cfg = lift_serve::server::ServeConfig::new(model, tmp.path().join("adapters"));
    cfg.runtime = lift_serve::runtime::RuntimeConfig::from_env()?;
    cfg.max_body_bytes = 64 << 20;
    if std::path::Path::new("base/manifest.json").exists() {
        cfg.prepared_base = Some("base".into());
    }
    let state = lift_serve::server::build_state(cfg, &candle_core::Device::Cpu)?;
    let running = lift_serve::server::start(state).await?;
    let base = format!("http://{}", running.addr);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(7200)).build()?;
    let text = essays(running.state.service.model(), tokens)?;
    let post = |body: Value| {
        let http = http.clone();
        let url = format!("{base}/documents");
        async move { http.post(url).json(&body).send().await?.json::<Value>().await }
    };

    let asked = post(json!({"text": text, "dry_run": true})).await?;
    let fitted = post(json!({"text": text, "dry_run": true, "options": {"budget_seconds": budget}})).await?;
    for (name, d) in [("as asked", &asked), ("fitted to the budget", &fitted)] {
        let e = &d["estimate"];
        anyhow::ensure!(e.is_object(), "dry run refused: {d}");
        println!(
            "{name}: {} tokens, {} QA pairs (one per {:.1} tokens), {} steps, {} training tokens, estimate {:.0} s ({} rate)",
            d["tokens"], e["qa_pairs"], e["tokens_per_qa_pair"].as_f64().unwrap_or(f64::NAN), e["planned_steps"],
            e["training_tokens"], e["seconds"].as_f64().unwrap_or(f64::NAN), e["rate"].as_str().unwrap_or("?")
        );
    }
    for w in fitted["warnings"].as_array().into_iter().flatten() {
        println!("warning {}: {}", w["code"], w["message"]);
    }

    let t0 = Instant::now();
    let d = post(json!({"text": text, "options": {"budget_seconds": budget}})).await?;
    let id = d["id"].as_str().ok_or_else(|| anyhow::anyhow!("post refused: {d}"))?.to_string();
    let posted = t0.elapsed().as_secs_f64();
    let question = json!({"document_id": id, "question": "What did the founders of the startup do first?", "max_tokens": 16});
    let a: Value = http.post(format!("{base}/ask")).json(&question).send().await?.json().await?;
    let first_answer = t0.elapsed().as_secs_f64();
    println!(
        "upload answered in {posted:.2} s; first answer {first_answer:.2} s after the upload began (mode {}, adapter {}): {:?}",
        a["mode"], a["adapter"], a["answer"].as_str().unwrap_or("")
    );

    let mut peak_rss: f64 = 0.0;
    let mut last_line = Instant::now();
    let mut asked_while_training = false;
    let ready = loop {
        let v: Value = http.get(format!("{base}/documents/{id}")).send().await?.json().await?;
        peak_rss = peak_rss.max(memory_mb().0);
        // An answer while training steps run (the first one above may fall in the QA stage).
        if !asked_while_training && v["progress"]["stage"] == "training" && v["progress"]["step"].as_u64() >= Some(3) {
            asked_while_training = true;
            let t = Instant::now();
            let a: Value = http.post(format!("{base}/ask")).json(&question).send().await?.json().await?;
            println!("an answer while training (step {}): {:.2} s (mode {})", v["progress"]["step"], t.elapsed().as_secs_f64(), a["mode"]);
        }
        match v["status"].as_str() {
            Some("ready") => break v,
            Some("failed" | "cancelled") => anyhow::bail!("absorb ended: {v}"),
            _ => {}
        }
        if last_line.elapsed() >= Duration::from_secs(60) {
            eprintln!("{:.0} s: {}", t0.elapsed().as_secs_f64(), v["progress"]);
            last_line = Instant::now();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let took = t0.elapsed().as_secs_f64();
    let tr = &ready["training"];
    let said = fitted["estimate"]["seconds"].as_f64().unwrap_or(f64::NAN);
    println!(
        "absorbed in {took:.0} s: budget {budget:.0} s ({:+.1}%), fitted estimate {said:.0} s (estimate / measured {:.2}); \
         {} of {} planned steps, out of time: {}, {} QA pairs",
        100.0 * (took - budget) / budget, said / took, tr["steps"], tr["planned_steps"], tr["out_of_time"], tr["qa_pairs"]
    );
    println!(
        "peak RSS during the absorb {peak_rss:.0} MB (process peak {:.0} MB); adapter {} bytes; options trained: epochs {}, stride {}",
        memory_mb().1, ready["adapter"]["bytes"], ready["options"]["train"]["epochs"], ready["options"]["plan"]["stride"]
    );
    running.shutdown().await;
    Ok(())
}
