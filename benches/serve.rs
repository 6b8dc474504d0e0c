//! Serving benchmark on the default model over real HTTP: the server runs in this process on a
//! free port of 127.0.0.1 (the same `server::build_state` + `server::start` as `lift-serve serve`),
//! absorbs `tests/fixtures/harbor_history.txt` with short absorb options, then
//! a. asks the same question with the cached adapter (mode `lift`, context `head_tail`) and with
//!    the base model (mode `icl`), same prompt, same context budget, modes interleaved run by run: time to first token
//!    and decode rate from streamed chat completions (`mode` extension field), total latency of
//!    streamed chat and of `/ask`; medians after a warm-up; the adapter's overhead as a ratio;
//! b. 16 concurrent clients (tokio tasks, one reqwest client each) asking short questions with
//!    `max_tokens` 16: requests/s, p50/p99 latency, errors by status, deepest generation queue;
//! c. self-gating's cost: a second server over a copy of the adapter store with self-gating on
//!    (a. and b. run without it: the adapter's own cost), the short questions asked of both, one
//!    after the other, alternating which goes first: median `/ask` latency and the ratio.
//!
//!   RAYON_NUM_THREADS=2 LIFT_MODELS_DIR=models cargo bench --bench serve
//!
//! Environment: BENCH_RUNS (10), BENCH_CONTEXT_TOKENS (in-context document budget, 512),
//! BENCH_MAX_TOKENS (answer length for a., 48), BENCH_CLIENTS (16), BENCH_REQUESTS (concurrent
//! requests in all, 48), BENCH_GENERATE_QUEUE (the server's generation queue, default 32).

#[path = "common/stats.rs"]
mod stats;
use stats::percentile;
use anyhow::{bail, Context, Result};
use futures_util::StreamExt;
use lift_serve::server::{self, ServeConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn median(xs: &[f64]) -> f64 {
    percentile(xs, 0.5)
}


/// One streamed chat completion, timed on the client.
struct Streamed {
    ttft: f64,
    total: f64,
    tokens: usize,
    /// Decode tokens/s between the first and the last content chunk.
    decode_tps: f64,
}

/// Sets `mode` (`lift`, or with a context policy `lift:head_tail`) in a request body.
fn with_mode(body: &mut Value, mode: &str) {
    let mut parts = mode.split(':');
    body["mode"] = json!(parts.next().unwrap_or(mode));
    if let Some(context) = parts.next() {
        body["context"] = json!(context);
    }
}

async fn stream_chat(
    c: &reqwest::Client,
    base: &str,
    doc: &str,
    question: &str,
    mode: &str,
    max_tokens: usize,
) -> Result<Streamed> {
    let mut body = json!({"model": doc, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                          "stream": true, "stream_options": {"include_usage": true}});
    with_mode(&mut body, mode);
    let t0 = Instant::now();
    let resp = c.post(format!("{base}/v1/chat/completions")).json(&body).send().await?;
    if resp.status() != 200 {
        bail!("chat {mode}: {} {}", resp.status(), resp.text().await.unwrap_or_default());
    }
    let mut stream = resp.bytes_stream();
    let (mut buf, mut first, mut last, mut tokens, mut done) = (String::new(), None, None, None, false);
    while let Some(chunk) = stream.next().await {
        buf.push_str(std::str::from_utf8(&chunk?)?);
        while let Some(nl) = buf.find('\n') {
            let line: String = buf.drain(..=nl).collect();
            let Some(data) = line.trim_end().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data)?;
            if v.get("error").is_some() {
                bail!("chat {mode}: {v}");
            }
            if v["choices"][0]["delta"]["content"].as_str().is_some_and(|s| !s.is_empty()) {
                let now = t0.elapsed().as_secs_f64();
                first.get_or_insert(now);
                last = Some(now);
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n as usize);
            }
        }
    }
    let total = t0.elapsed().as_secs_f64();
    let (Some(first), Some(last), Some(tokens), true) = (first, last, tokens, done) else {
        bail!("chat {mode}: incomplete stream");
    };
    let decode_tps = if tokens > 1 && last > first { (tokens - 1) as f64 / (last - first) } else { f64::NAN };
    Ok(Streamed { ttft: first, total, tokens, decode_tps })
}

/// One `/ask`: client-side latency and the server's timings.
struct Asked {
    total: f64,
    prompt_ms: f64,
    decode_tps: f64,
    tokens: usize,
    /// Self-gating kept the passages' answer.
    passages: bool,
}

async fn ask(
    c: &reqwest::Client,
    base: &str,
    doc: &str,
    question: &str,
    mode: &str,
    max_tokens: usize,
) -> Result<Asked> {
    let t0 = Instant::now();
    let resp = c
        .post(format!("{base}/ask"))
        .json(&{
            let mut body = json!({"document_id": doc, "question": question, "max_tokens": max_tokens});
            with_mode(&mut body, mode);
            body
        })
        .send()
        .await?;
    let status = resp.status();
    let v: Value = resp.json().await?;
    let total = t0.elapsed().as_secs_f64();
    if status != 200 {
        bail!("ask {mode}: {status} {v}");
    }
    let tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
    let gen_ms = v["timings"]["generate_ms"].as_f64().unwrap_or(f64::NAN);
    Ok(Asked {
        total,
        prompt_ms: v["timings"]["prompt_ms"].as_f64().unwrap_or(f64::NAN),
        decode_tps: tokens as f64 / (gen_ms / 1000.0),
        tokens,
        passages: v["answered_by"] == "passages",
    })
}

async fn wait_ready(c: &reqwest::Client, base: &str, id: &str) -> Result<Value> {
    loop {
        let d: Value = c.get(format!("{base}/documents/{id}")).send().await?.json().await?;
        match d["status"].as_str() {
            Some("ready") => return Ok(d),
            Some("queued") | Some("training") => tokio::time::sleep(Duration::from_millis(500)).await,
            _ => bail!("absorb failed: {d}"),
        }
    }
}

#[derive(Default)]
struct ModeRuns {
    ttft: Vec<f64>,
    stream_total: Vec<f64>,
    stream_tps: Vec<f64>,
    stream_tokens: Vec<f64>,
    ask_total: Vec<f64>,
    ask_prompt: Vec<f64>,
    ask_tps: Vec<f64>,
    ask_tokens: Vec<f64>,
}

async fn run() -> Result<()> {
    let runs = env_usize("BENCH_RUNS", 10).max(1);
    let context_tokens = env_usize("BENCH_CONTEXT_TOKENS", 512);
    let max_tokens = env_usize("BENCH_MAX_TOKENS", 48);
    let clients = env_usize("BENCH_CLIENTS", 16).max(1);
    let requests = env_usize("BENCH_REQUESTS", 48).max(clients);
    let gen_queue = env_usize("BENCH_GENERATE_QUEUE", 32);

    let tmp = tempfile::tempdir()?;
    let options = tmp.path().join("absorb.json");
    std::fs::write(
        &options,
        json!({"plan": {"window": 128, "context_tokens": 64}, "train": {"epochs": [1, 1]},
               "qa": {"use_model": false, "max_pairs": 4, "min_pairs": 2}})
        .to_string(),
    )?;
    let model = lift_serve::fetch::resolve_model(None)?;
    let mut cfg = ServeConfig::new(model.clone(), tmp.path().join("adapters"));
    cfg.runtime = lift_serve::runtime::RuntimeConfig::from_env()?;
    cfg.absorb_options = Some(options);
    cfg.context_tokens = Some(context_tokens);
    cfg.generate_queue = gen_queue;
    cfg.self_gating = false;
    let gated_cfg = {
        let mut g = cfg.clone();
        g.self_gating = true;
        g.adapters_dir = tmp.path().join("adapters-gated");
        g
    };
    let state = tokio::task::block_in_place(|| server::build_state(cfg, &candle_core::Device::Cpu))?;
    let running = server::start(state).await?;
    let base = format!("http://{}", running.addr);
    let c = reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?;
    println!(
        "model: {}  threads: {}  runs: {runs}  context budget: {context_tokens} tokens  answer: {max_tokens} tokens  server: {base}",
        model.display(),
        rayon::current_num_threads()
    );

    // Absorb.
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/harbor_history.txt"))?;
    let t0 = Instant::now();
    let d: Value = c
        .post(format!("{base}/documents"))
        .json(&json!({"text": text, "title": "harbor history"}))
        .send()
        .await?
        .json()
        .await?;
    let id = d["id"].as_str().with_context(|| format!("POST /documents: {d}"))?.to_string();
    let d = wait_ready(&c, &base, &id).await?;
    println!(
        "absorbed {} tokens in {:.1} s (window 128, epochs [1,1], 4 extractive QA): adapter {} ({} bytes)",
        d["tokens"],
        t0.elapsed().as_secs_f64(),
        d["adapter"]["kind"].as_str().unwrap_or("?"),
        d["adapter"]["bytes"]
    );

    // a. Adapter overhead: lift vs icl, same prompt and context budget, interleaved.
    let question = "Tell the history of the harbor in detail, from its founding to today.";
    // The same prompt: `lift` reads the head and tail as `icl` does (its default `linked`
    // passages are shorter).
    let modes = ["lift:head_tail", "icl"];
    for mode in modes {
        stream_chat(&c, &base, &id, question, mode, max_tokens).await?; // warm-up (loads the adapter)
        ask(&c, &base, &id, question, mode, max_tokens).await?;
    }
    let mut by_mode: Vec<ModeRuns> = modes.iter().map(|_| ModeRuns::default()).collect();
    for run in 0..runs {
        // Each measurement of one mode is next to the same measurement of the other, and which
        // goes first alternates, so that drifting load on the machine hits both alike.
        let order: Vec<usize> = if run % 2 == 0 { vec![0, 1] } else { vec![1, 0] };
        for &mi in &order {
            let s = stream_chat(&c, &base, &id, question, modes[mi], max_tokens).await?;
            let r = &mut by_mode[mi];
            r.ttft.push(s.ttft * 1e3);
            r.stream_total.push(s.total * 1e3);
            r.stream_tps.push(s.decode_tps);
            r.stream_tokens.push(s.tokens as f64);
        }
        for &mi in &order {
            let a = ask(&c, &base, &id, question, modes[mi], max_tokens).await?;
            let r = &mut by_mode[mi];
            r.ask_total.push(a.total * 1e3);
            r.ask_prompt.push(a.prompt_ms);
            r.ask_tps.push(a.decode_tps);
            r.ask_tokens.push(a.tokens as f64);
        }
    }
    let (l, i) = (&by_mode[0], &by_mode[1]);
    println!("\n## a. adapter overhead (medians of {runs}; lift = adapter + truncated document, icl = base model, same prompt)");
    println!("| measure | lift | icl | lift/icl (ratio of medians) | lift/icl (median of paired runs) |");
    println!("|---|---|---|---|---|");
    let row = |name: &str, a: &[f64], b: &[f64], unit: &str, digits: usize| {
        let (ma, mb) = (median(a), median(b));
        let paired: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
        println!("| {name} | {ma:.digits$} {unit} | {mb:.digits$} {unit} | {:.3} | {:.3} |", ma / mb, median(&paired));
    };
    row("time to first token (streamed chat)", &l.ttft, &i.ttft, "ms", 0);
    row("total, streamed chat", &l.stream_total, &i.stream_total, "ms", 0);
    row("decode rate, streamed chat", &l.stream_tps, &i.stream_tps, "tok/s", 1);
    row("completion tokens, streamed chat", &l.stream_tokens, &i.stream_tokens, "", 0);
    row("total, /ask", &l.ask_total, &i.ask_total, "ms", 0);
    row("prompt (server prompt_ms), /ask", &l.ask_prompt, &i.ask_prompt, "ms", 0);
    row("decode rate (server), /ask", &l.ask_tps, &i.ask_tps, "tok/s", 1);
    row("completion tokens, /ask", &l.ask_tokens, &i.ask_tokens, "", 0);
    // Paired per-run ratios; time per token so that different answer lengths do not skew totals.
    let paired =
        |f: &dyn Fn(&ModeRuns, usize) -> f64| median(&(0..runs).map(|k| f(l, k) / f(i, k)).collect::<Vec<_>>()) - 1.0;
    println!(
        "adapter overhead (median of paired runs): time to first token {:+.1}%, time per decoded token (streamed) {:+.1}%, \
         /ask time per answer token {:+.1}% (target ≤ 20%)",
        paired(&|r, k| r.ttft[k]) * 100.0,
        paired(&|r, k| 1.0 / r.stream_tps[k]) * 100.0,
        paired(&|r, k| r.ask_total[k] / r.ask_tokens[k].max(1.0)) * 100.0
    );

    // b. Concurrent clients.
    let questions = [
        "Who built the harbor?",
        "When was the lighthouse painted?",
        "What does the bell do?",
        "Which pier is for ferries?",
    ];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let depth_probe = {
        let (c, base, stop) = (c.clone(), base.clone(), stop.clone());
        tokio::spawn(async move {
            let mut max = 0usize;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Ok(r) = c.get(format!("{base}/metrics")).send().await {
                    let text = r.text().await.unwrap_or_default();
                    let depth = text
                        .lines()
                        .find_map(|l| l.strip_prefix("lift_generation_queue_depth "))
                        .and_then(|v| v.trim().parse::<f64>().ok());
                    max = max.max(depth.unwrap_or(0.0) as usize);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            max
        })
    };
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..clients {
        let (base, id) = (base.clone(), id.clone());
        let n = requests / clients + usize::from(k < requests % clients);
        tasks.push(tokio::spawn(async move {
            let c = reqwest::Client::builder().timeout(Duration::from_secs(600)).build().expect("client");
            let mut out = Vec::new();
            for j in 0..n {
                let q = questions[(k + j) % questions.len()];
                let t = Instant::now();
                let r = c
                    .post(format!("{base}/ask"))
                    .json(&json!({"document_id": id, "question": q, "max_tokens": 16}))
                    .send()
                    .await;
                let status = match r {
                    Ok(r) => {
                        let s = r.status().as_u16();
                        let _ = r.bytes().await;
                        s
                    }
                    Err(_) => 0,
                };
                out.push((status, t.elapsed().as_secs_f64()));
            }
            out
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await?);
    }
    let wall = t0.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let max_depth = depth_probe.await?;
    let ok: Vec<f64> = results.iter().filter(|r| r.0 == 200).map(|r| r.1 * 1e3).collect();
    let mut errors = std::collections::BTreeMap::new();
    for r in results.iter().filter(|r| r.0 != 200) {
        *errors.entry(r.0).or_insert(0usize) += 1;
    }
    println!("\n## b. {clients} concurrent clients, {} requests of /ask (mode lift, max_tokens 16), generation queue {gen_queue}", results.len());
    println!("| measure | result |");
    println!("|---|---|");
    println!("| wall time | {wall:.1} s |");
    println!("| requests/s | {:.2} |", ok.len() as f64 / wall);
    println!("| latency p50 | {:.0} ms |", percentile(&ok, 0.5));
    println!("| latency p99 | {:.0} ms |", percentile(&ok, 0.99));
    println!("| errors | {} {:?} (status → count; 0 = transport error) |", results.len() - ok.len(), errors);
    println!("| deepest generation queue seen | {max_depth} of {gen_queue} |");
    if !errors.is_empty() {
        running.shutdown().await;
        bail!("{} requests failed: {errors:?}", results.len() - ok.len());
    }

    // c. Self-gating's cost.
    copy_dir(&tmp.path().join("adapters"), &gated_cfg.adapters_dir)?;
    let state = tokio::task::block_in_place(|| server::build_state(gated_cfg, &candle_core::Device::Cpu))?;
    let gated = server::start(state).await?;
    let gated_base = format!("http://{}", gated.addr);
    wait_ready(&c, &gated_base, &id).await?;
    let servers = [base.as_str(), gated_base.as_str()];
    for q in questions {
        for b in servers {
            ask(&c, b, &id, q, "lift", 16).await?; // warm-up (loads the adapter)
        }
    }
    let (mut alone, mut both, mut passages) = (Vec::new(), Vec::new(), 0);
    for run in 0..runs {
        for (k, q) in questions.iter().enumerate() {
            let order = if (run + k) % 2 == 0 { [0, 1] } else { [1, 0] };
            for i in order {
                let a = ask(&c, servers[i], &id, q, "lift", 16).await?;
                if i == 0 {
                    alone.push(a.total * 1e3);
                } else {
                    both.push(a.total * 1e3);
                    passages += usize::from(a.passages);
                }
            }
        }
    }
    let paired: Vec<f64> = both.iter().zip(&alone).map(|(g, a)| g / a).collect();
    println!(
        "\n## c. self-gating's cost ({} answers a side: /ask mode lift, default `linked` context within {context_tokens} tokens, \
         max_tokens 16, the questions of b.)",
        alone.len()
    );
    println!("| measure | result |");
    println!("|---|---|");
    println!("| latency, adapter alone (median) | {:.0} ms |", median(&alone));
    println!("| latency, self-gated (median) | {:.0} ms |", median(&both));
    println!("| self-gated / alone (ratio of medians; median of paired answers) | {:.3}; {:.3} |", median(&both) / median(&alone), median(&paired));
    println!("| answers kept from the passages | {passages} of {} |", both.len());
    gated.shutdown().await;
    running.shutdown().await;
    Ok(())
}

/// Copies the directory tree `from` to `to` (a stopped-in-time copy of an adapter store).
fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    lift_serve::runtime::tune_cpu();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(run())
}
