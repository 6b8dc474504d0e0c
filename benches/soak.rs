//! Soak: one `lift-serve serve` process on the default model (files mode, the shipped prepared
//! base) held under a mixed load for minutes, stopped with SIGTERM and started again in the middle,
//! then asked what it lost.
//!
//! - 16 clients ask across 8 ready documents (`/ask` in `lift` and `rag`, and chat completions),
//!   each waiting `SOAK_THINK_MS` between answers;
//! - 2 documents at a time absorb with `"recipe": "lean"` (~1K tokens each; the next pair is posted
//!   once both are ready), so absorbs run under the load from start to end;
//! - one client posts a document and deletes it, in a loop;
//! - one client sends the hostile uploads of `tests/server.rs` (bombs, deep nesting), in a loop;
//! - at half time, once one absorb of a pair is training past its first checkpoint and the other
//!   waits or trains, the server gets SIGTERM and is started again on the same store.
//!
//! Reported: answers and errors by request kind and status (target: no 5xx but 503 between the
//! SIGTERM and the new process's health); RSS at the start, the first minute's plateau, the peak
//! and the end (target: the end within 10% of the plateau); lost jobs (documents not ready, or
//! gone, at the end; target 0); and every absorb that resumed across the restart absorbed again
//! by a clean server with its own store, its adapter compared (target: none differs by more than
//! 1e-4, the server resume test's tolerance) and its id compared.
//!
//!   LIFT_MODELS_DIR=models cargo bench --bench soak
//!
//! Environment: SOAK_SECONDS (900), SOAK_CLIENTS (16), SOAK_THINK_MS (1000), SOAK_READY_WORDS (150:
//! the ready documents' length), SOAK_OUT (a JSON report; default target/soak.json), SOAK_KEEP
//! (keep the stores and logs). Needs the essays (`lift-serve fetch-data`).

#[path = "common/stats.rs"]
mod stats;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use stats::percentile;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn env_num<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// What every client books: (request kind, outcome) counts, the 5xx with their time, latencies.
#[derive(Default)]
struct Tally {
    counts: BTreeMap<(String, String), usize>,
    server_errors: Vec<(f64, String, u16, String)>,
    ask_ms: Vec<f64>,
}

/// The soak's shared state: the server's address and pid (a new pid after the restart), the clock,
/// the tally, the restart window and the stop flag.
struct Soak {
    base: String,
    pid: AtomicU32,
    t0: Instant,
    tally: Mutex<Tally>,
    /// (SIGTERM sent, new process healthy), in seconds since the start.
    restart: Mutex<Option<(f64, Option<f64>)>>,
    stop: AtomicBool,
    client: reqwest::Client,
}

impl Soak {
    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    /// Books a response (or the failure to get one) of request kind `kind`.
    fn book(&self, kind: &str, outcome: &std::result::Result<(u16, String), String>) {
        let t = self.now();
        let mut tally = self.tally.lock().unwrap();
        let key = match outcome {
            Ok((status, body)) => {
                if *status >= 500 {
                    tally.server_errors.push((t, kind.to_string(), *status, body.chars().take(200).collect()));
                }
                status.to_string()
            }
            // Refused connections belong to the restart; any other is counted apart.
            Err(why) if why == "unreachable" && !self.restarting(t) => "unreachable outside the restart".into(),
            Err(why) => why.clone(),
        };
        *tally.counts.entry((kind.to_string(), key)).or_default() += 1;
    }

    /// Whether `t` falls between the SIGTERM and the new process's health (with 2 s of slack for
    /// connections refused just before the health check saw it).
    fn restarting(&self, t: f64) -> bool {
        self.restart.lock().unwrap().is_some_and(|(from, to)| t >= from && to.is_none_or(|to| t <= to + 2.0))
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> std::result::Result<(u16, String), String> {
        match req.timeout(Duration::from_secs(300)).send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                Ok((status, r.text().await.unwrap_or_default()))
            }
            Err(e) if e.is_timeout() => Err("timeout".into()),
            Err(_) => Err("unreachable".into()),
        }
    }

    async fn json(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> std::result::Result<(u16, String), String> {
        let mut req = self.client.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        self.send(req).await
    }

    async fn status_of(&self, id: &str) -> Option<Value> {
        let (s, body) = self.json(reqwest::Method::GET, &format!("/documents/{id}"), None).await.ok()?;
        (s == 200).then(|| serde_json::from_str(&body).ok()).flatten()
    }
}

/// A `lift-serve serve` process on `adapters`, its stderr appended to `log`.
fn spawn_server(port: u16, adapters: &Path, log: &Path) -> Result<std::process::Child> {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_lift-serve"))
        .args(["serve", "--port", &port.to_string(), "--checkpoint-secs", "15"])
        .arg("--adapters-dir")
        .arg(adapters)
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()?;
    Ok(child)
}

async fn wait_health(client: &reqwest::Client, base: &str, child: &mut std::process::Child) -> Result<()> {
    for _ in 0..6000 {
        if let Ok(r) = client.get(format!("{base}/health")).send().await {
            if r.status() == 200 {
                return Ok(());
            }
        }
        if let Some(code) = child.try_wait()? {
            bail!("the server exited ({code}) before it was healthy; see its log");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the server never became healthy")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Resident and peak resident bytes of process `pid`.
fn rss(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)?.trim().trim_end_matches(" kB").parse::<u64>().ok());
    Some((kb("VmRSS:")? << 10, kb("VmHWM:")? << 10))
}

/// The first `words` words of each essay, from the `skip`-th essay on (sorted by name).
fn essays(skip: usize, n: usize, words: usize) -> Result<Vec<String>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/pg-essays");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("{}: run `lift-serve fetch-data` first", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    names.retain(|p| p.extension().is_some_and(|e| e == "txt"));
    names.sort();
    let mut out = Vec::new();
    for p in names {
        let text = std::fs::read_to_string(&p)?;
        let w: Vec<&str> = text.split_whitespace().collect();
        if w.len() >= words {
            out.push(w[..words].join(" "));
        }
    }
    anyhow::ensure!(out.len() >= skip + n, "{} essays of {words} words, {} wanted", out.len(), skip + n);
    Ok(out.into_iter().skip(skip).take(n).collect())
}

const LEAN: &str = r#"{"recipe": "lean"}"#;

async fn post(soak: &Soak, kind: &str, text: &str) -> Option<String> {
    let body = json!({"text": text, "options": serde_json::from_str::<Value>(LEAN).unwrap()});
    let r = soak.json(reqwest::Method::POST, "/documents", Some(body)).await;
    soak.book(kind, &r);
    let (s, body) = r.ok()?;
    (s == 202).then(|| serde_json::from_str::<Value>(&body).ok()?["id"].as_str().map(str::to_string)).flatten()
}

async fn asker(soak: Arc<Soak>, k: usize, ready: Arc<Vec<String>>, think: Duration) {
    let questions = ["What is the main argument?", "Who does the author mention first?", "What should one do?"];
    let mut n = k;
    while !soak.stop.load(Ordering::Relaxed) {
        let id = &ready[n % ready.len()];
        let question = questions[n % questions.len()];
        let started = Instant::now();
        let (kind, r) = if n % 4 == 3 {
            let body = json!({"model": id, "messages": [{"role": "user", "content": question}], "max_tokens": 16});
            ("chat", soak.json(reqwest::Method::POST, "/v1/chat/completions", Some(body)).await)
        } else {
            let mode = if n % 2 == 0 { "lift" } else { "rag" };
            let body = json!({"document_id": id, "question": question, "mode": mode, "max_tokens": 16});
            (if mode == "lift" { "ask lift" } else { "ask rag" }, soak.json(reqwest::Method::POST, "/ask", Some(body)).await)
        };
        if matches!(r, Ok((200, _))) {
            soak.tally.lock().unwrap().ask_ms.push(started.elapsed().as_secs_f64() * 1e3);
        }
        let down = r.is_err();
        soak.book(kind, &r);
        n += 1;
        // A client that cannot connect (the restart) retries at a slower pace.
        tokio::time::sleep(if down { Duration::from_secs(1) } else { think }).await;
    }
}

/// Posts a document, reads it, deletes it, reads it again (404), in a loop.
async fn post_delete(soak: Arc<Soak>, text: String) {
    let mut n = 0;
    while !soak.stop.load(Ordering::Relaxed) {
        n += 1;
        match post(&soak, "post (loop)", &format!("{text} This is copy number {n}.")).await {
            None => tokio::time::sleep(Duration::from_secs(2)).await,
            Some(id) => {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let r = soak.json(reqwest::Method::GET, &format!("/documents/{id}"), None).await;
                soak.book("get (loop)", &r);
                let r = soak.json(reqwest::Method::DELETE, &format!("/documents/{id}"), None).await;
                soak.book("delete (loop)", &r);
                let r = soak.json(reqwest::Method::GET, &format!("/documents/{id}"), None).await;
                soak.book("get deleted (loop)", &r);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// The hostile uploads of `tests/server.rs`, one every 2 s, in a loop.
async fn hostile(soak: Arc<Soak>) {
    use lift_serve::testing::hostile;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("text/html", hostile::nested_html(50_000)),
        ("application/pdf", hostile::flate_bomb_pdf(b"BT /F1 12 Tf (A) Tj ET\n", 1 << 30)),
        ("application/pdf", hostile::flate_bomb_pdf(b"\0", 1 << 30)),
        ("application/pdf", hostile::nested_array_pdf(100_000)),
        ("text/markdown", hostile::deep_markdown_list(100_000)),
    ];
    let mut n = 0;
    while !soak.stop.load(Ordering::Relaxed) {
        let (media_type, bytes) = &cases[n % cases.len()];
        let req = soak.client.post(format!("{}/documents", soak.base)).header("content-type", *media_type).body(bytes.clone());
        let r = soak.send(req).await;
        soak.book("hostile upload", &r);
        n += 1;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Every absorb posted: (id, text), and those a restart interrupted.
#[derive(Default)]
struct Absorbs {
    posted: Vec<(String, String)>,
    across_restart: Vec<String>,
}

/// Posts absorbing documents two at a time, the next pair once both are ready; at half time,
/// once one of a pair trains past its first checkpoint, restarts the server (SIGTERM).
async fn absorber(soak: Arc<Soak>, texts: Vec<String>, half: f64, restart: impl Fn() -> Result<()>) -> Result<Absorbs> {
    let mut absorbs = Absorbs::default();
    let mut restarted = false;
    for pair in texts.chunks(2) {
        if soak.stop.load(Ordering::Relaxed) {
            break;
        }
        let mut ids = Vec::new();
        for text in pair {
            if let Some(id) = post(&soak, "post (absorb)", text).await {
                absorbs.posted.push((id.clone(), text.clone()));
                ids.push(id);
            }
        }
        loop {
            let mut states = Vec::new();
            for id in &ids {
                states.push(soak.status_of(id).await);
            }
            let status = |s: &Option<Value>| s.as_ref().and_then(|v| v["status"].as_str().map(str::to_string));
            if states.iter().all(|s| status(s).as_deref() == Some("ready")) {
                break;
            }
            if let Some(bad) = states.iter().find(|s| matches!(status(s).as_deref(), Some("failed") | Some("damaged"))) {
                eprintln!("an absorb ended badly: {bad:?}");
                break;
            }
            // Past the first checkpoint (written every 15 s) and still training.
            let training_past_checkpoint = states.iter().any(|s| {
                s.as_ref().is_some_and(|v| v["status"] == "training" && v["progress"]["step"].as_u64().unwrap_or(0) >= 3)
            }) && states.iter().all(|s| matches!(status(s).as_deref(), Some("training") | Some("queued")));
            if !restarted && soak.now() >= half && training_past_checkpoint {
                tokio::time::sleep(Duration::from_secs(20)).await;
                eprintln!("[{:.0} s] SIGTERM and restart while absorbing {ids:?}", soak.now());
                restart()?;
                restarted = true;
                absorbs.across_restart.extend(ids.iter().cloned());
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }
    Ok(absorbs)
}

fn adapter_difference(a: &Path, b: &Path) -> Result<f32> {
    let a = candle_core::safetensors::load(a, &candle_core::Device::Cpu)?;
    let b = candle_core::safetensors::load(b, &candle_core::Device::Cpu)?;
    anyhow::ensure!(a.len() == b.len(), "{} tensors against {}", a.len(), b.len());
    let mut worst = 0f32;
    for (k, x) in &a {
        let y = b.get(k).with_context(|| format!("{k} missing"))?;
        worst = worst.max((x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
    }
    Ok(worst)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let seconds: f64 = env_num("SOAK_SECONDS", 900.0);
    let clients: usize = env_num("SOAK_CLIENTS", 16);
    let think = Duration::from_millis(env_num("SOAK_THINK_MS", 1000));
    let out = std::env::var("SOAK_OUT").unwrap_or_else(|_| "target/soak.json".into());
    let tmp = tempfile::tempdir()?;
    let (adapters, log) = (tmp.path().join("adapters"), tmp.path().join("serve.log"));
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::builder().pool_max_idle_per_host(64).build()?;

    // The 8 ready documents (SOAK_READY_WORDS words each), absorbed before the clock starts.
    let ready_texts = essays(0, 8, env_num("SOAK_READY_WORDS", 150))?;
    let absorb_texts = essays(8, 16, 750)?;
    let loop_text = essays(24, 1, 200)?.remove(0);
    let mut child = spawn_server(port, &adapters, &log)?;
    wait_health(&client, &base, &mut child).await?;
    let soak = Arc::new(Soak {
        base: base.clone(),
        pid: AtomicU32::new(child.id()),
        t0: Instant::now(),
        tally: Mutex::default(),
        restart: Mutex::new(None),
        stop: AtomicBool::new(false),
        client: client.clone(),
    });
    let setup = Instant::now();
    let mut ready = Vec::new();
    for text in &ready_texts {
        ready.push(post(&soak, "setup", text).await.context("a ready document was refused")?);
    }
    for id in &ready {
        loop {
            let v = soak.status_of(id).await;
            match v.as_ref().and_then(|v| v["status"].as_str()) {
                Some("ready") => break,
                Some("queued") | Some("training") => tokio::time::sleep(Duration::from_secs(2)).await,
                _ => bail!("a ready document did not absorb: {v:?}"),
            }
        }
    }
    eprintln!("8 documents ready in {:.0} s; the soak runs {seconds:.0} s", setup.elapsed().as_secs_f64());
    let soak = Arc::new(Soak { t0: Instant::now(), tally: Mutex::default(), ..Arc::try_unwrap(soak).ok().unwrap() });

    // RSS every second, of whichever process serves.
    let samples: Arc<Mutex<Vec<(f64, u32, u64, u64)>>> = Arc::default();
    let sampler = {
        let (soak, samples) = (soak.clone(), samples.clone());
        tokio::spawn(async move {
            while !soak.stop.load(Ordering::Relaxed) {
                let pid = soak.pid.load(Ordering::Relaxed);
                if let Some((rss, hwm)) = rss(pid) {
                    samples.lock().unwrap().push((soak.now(), pid, rss, hwm));
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    let ready = Arc::new(ready);
    let mut tasks = Vec::new();
    for k in 0..clients {
        tasks.push(tokio::spawn(asker(soak.clone(), k, ready.clone(), think)));
    }
    tasks.push(tokio::spawn(post_delete(soak.clone(), loop_text)));
    tasks.push(tokio::spawn(hostile(soak.clone())));
    let child = Arc::new(Mutex::new(child));
    let restart = {
        let (soak, child, adapters, log) = (soak.clone(), child.clone(), adapters.clone(), log.clone());
        move || -> Result<()> {
            let t = soak.now();
            *soak.restart.lock().unwrap() = Some((t, None));
            let mut c = child.lock().unwrap();
            // SAFETY: a plain signal to our own child process.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let code = c.wait()?;
            eprintln!("[{:.0} s] the server exited ({code}) {:.1} s after SIGTERM", soak.now(), soak.now() - t);
            *c = spawn_server(port, &adapters, &log)?;
            soak.pid.store(c.id(), Ordering::Relaxed);
            Ok(())
        }
    };
    let absorbing = {
        let soak = soak.clone();
        tokio::spawn(async move { absorber(soak, absorb_texts, seconds / 2.0, restart).await })
    };
    // The new process's health ends the restart window.
    let watcher = {
        let soak = soak.clone();
        tokio::spawn(async move {
            while !soak.stop.load(Ordering::Relaxed) {
                let pending = matches!(*soak.restart.lock().unwrap(), Some((_, None)));
                if pending && matches!(soak.json(reqwest::Method::GET, "/health", None).await, Ok((200, _))) {
                    if let Some((_, healthy)) = soak.restart.lock().unwrap().as_mut() {
                        *healthy = Some(soak.now());
                    }
                    eprintln!("[{:.0} s] the new process is healthy", soak.now());
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    soak.stop.store(true, Ordering::Relaxed);
    let end = soak.now();
    for t in tasks {
        t.await?;
    }
    sampler.await?;
    watcher.await?;
    let absorbs = absorbing.await??;

    // Lost jobs: every absorb posted and every ready document ready at the end (waiting for the
    // absorbs the stop left training).
    let wait_from = Instant::now();
    let mut lost = Vec::new();
    for (id, _) in &absorbs.posted {
        loop {
            let v = soak.status_of(id).await;
            match v.as_ref().and_then(|v| v["status"].as_str()) {
                Some("ready") => break,
                Some("queued") | Some("training") if wait_from.elapsed() < Duration::from_secs(1800) => {
                    tokio::time::sleep(Duration::from_secs(2)).await
                }
                other => {
                    lost.push(format!("{id}: {}", other.unwrap_or("gone")));
                    break;
                }
            }
        }
    }
    for id in ready.iter() {
        let body = json!({"document_id": id, "question": "What is the main argument?", "mode": "lift", "max_tokens": 4});
        match soak.json(reqwest::Method::POST, "/ask", Some(body)).await {
            Ok((200, _)) => {}
            other => lost.push(format!("{id} (ready before the soak) asked at the end: {other:?}")),
        }
    }
    let serving_pid = soak.pid.load(Ordering::Relaxed);
    let (rss_end, _) = rss(serving_pid).unwrap_or_default();
    {
        let mut c = child.lock().unwrap();
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        c.wait()?;
    }

    // Absorbs that crossed the restart, absorbed again by a clean server with its own store.
    let clean_dir = tmp.path().join("clean");
    let clean_port = free_port();
    let clean_base = format!("http://127.0.0.1:{clean_port}");
    let mut clean = spawn_server(clean_port, &clean_dir, &tmp.path().join("clean.log"))?;
    wait_health(&client, &clean_base, &mut clean).await?;
    let clean_soak = Soak { base: clean_base, pid: AtomicU32::new(clean.id()), t0: Instant::now(), tally: Mutex::default(), restart: Mutex::new(None), stop: AtomicBool::new(false), client: client.clone() };
    let mut resumed = Vec::new();
    for id in &absorbs.across_restart {
        let text = &absorbs.posted.iter().find(|(i, _)| i == id).unwrap().1;
        let clean_id = post(&clean_soak, "clean", text).await.context("the clean server refused the text")?;
        while clean_soak.status_of(&clean_id).await.map(|v| v["status"].as_str() == Some("ready")) != Some(true) {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let soaked = std::fs::read_to_string(adapters.join(id).join("manifest.json")).ok();
        let resumed_from = soaked
            .and_then(|m| serde_json::from_str::<Value>(&m).ok())
            .and_then(|m| m["training"]["resumed_from_step"].as_u64());
        let diff = adapter_difference(&adapters.join(id).join("adapter.safetensors"), &clean_dir.join(&clean_id).join("adapter.safetensors"))?;
        resumed.push(json!({"id": id, "clean_id": clean_id, "same_id": id == &clean_id, "resumed_from_step": resumed_from, "max_difference": diff}));
    }
    unsafe { libc::kill(clean.id() as i32, libc::SIGTERM) };
    clean.wait()?;

    // The report.
    let tally = soak.tally.lock().unwrap();
    let healthy_again = soak.restart.lock().unwrap().and_then(|(_, to)| to);
    let window = *soak.restart.lock().unwrap();
    let in_window = |t: f64| window.is_some_and(|(from, to)| t >= from && to.is_none_or(|to| t <= to));
    let unexpected: Vec<_> = tally.server_errors.iter().filter(|(t, _, s, _)| !(*s == 503 && in_window(*t))).collect();
    let samples = samples.lock().unwrap();
    let first_pid = samples.first().map(|s| s.1);
    let plateau: Vec<f64> = samples.iter().filter(|s| Some(s.1) == first_pid && s.0 >= 30.0 && s.0 <= 60.0).map(|s| s.2 as f64).collect();
    let plateau = percentile(&plateau, 0.5);
    // The restarted process's own first minute: the plateau the end is judged against (the first
    // process's depends on what it was training then).
    let last_pid = samples.last().map(|s| s.1);
    let plateau_after: Vec<f64> = healthy_again.map_or(Vec::new(), |h| {
        samples.iter().filter(|s| Some(s.1) == last_pid && s.0 >= h + 30.0 && s.0 <= h + 60.0).map(|s| s.2 as f64).collect()
    });
    let plateau_after = percentile(&plateau_after, 0.5);
    let peak = samples.iter().map(|s| s.3).max().unwrap_or(0);
    let rss_start = samples.first().map_or(0, |s| s.2);
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let end_vs_plateau = rss_end as f64 / plateau - 1.0;
    let end_vs_after = rss_end as f64 / plateau_after - 1.0;
    let differing = resumed.iter().filter(|r| r["max_difference"].as_f64().unwrap_or(f64::INFINITY) > 1e-4 || r["same_id"] != true).count();

    println!("soak: {end:.0} s, {clients} clients asking 8 ready documents (think {} ms), absorbs posted {}, restart window {window:?}", think.as_millis(), absorbs.posted.len());
    println!("\n| request | outcome | count |\n|---|---|---|");
    for ((kind, outcome), n) in &tally.counts {
        println!("| {kind} | {outcome} | {n} |");
    }
    let ask_p50 = percentile(&tally.ask_ms, 0.5);
    let ask_p99 = percentile(&tally.ask_ms, 0.99);
    println!("\nanswers 200: p50 {ask_p50:.0} ms, p99 {ask_p99:.0} ms");
    println!("5xx: {} in all, {} outside the restart's 503s (target 0)", tally.server_errors.len(), unexpected.len());
    for e in unexpected.iter().take(10) {
        println!("  {e:?}");
    }
    println!(
        "RSS: start {:.0} MiB, first minute's plateau {:.0} MiB, peak {:.0} MiB; after the restart a first minute's plateau of {:.0} MiB; end {:.0} MiB ({:+.1}% of the first plateau, {:+.1}% of the restarted process's; target: not over +10%)",
        mib(rss_start as f64), mib(plateau), mib(peak as f64), mib(plateau_after), mib(rss_end as f64), 100.0 * end_vs_plateau, 100.0 * end_vs_after
    );
    println!("lost jobs: {} (target 0) {lost:?}", lost.len());
    println!("resumed absorbs: {} across the restart, {differing} differing from a clean absorb (> 1e-4 or another id; target 0)", resumed.len());
    for r in &resumed {
        println!("  {r}");
    }
    let report = json!({
        "seconds": end, "clients": clients, "think_ms": think.as_millis() as u64,
        "counts": tally.counts.iter().map(|((k, o), n)| json!({"request": k, "outcome": o, "count": n})).collect::<Vec<_>>(),
        "server_errors": tally.server_errors.iter().map(|(t, k, s, b)| json!({"t": t, "request": k, "status": s, "body": b})).collect::<Vec<_>>(),
        "unexpected_server_errors": unexpected.len(),
        "restart_window": window,
        "ask_ms": {"p50": ask_p50, "p99": ask_p99, "n": tally.ask_ms.len()},
        "rss_mib": {"start": mib(rss_start as f64), "plateau": mib(plateau), "plateau_after_restart": mib(plateau_after), "peak": mib(peak as f64), "end": mib(rss_end as f64)},
        "rss_samples": samples.iter().map(|s| json!([s.0, s.1, s.2 >> 20])).collect::<Vec<_>>(),
        "lost": lost, "absorbs_posted": absorbs.posted.len(), "resumed": resumed, "resumed_differing": differing,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
    println!("report: {out}; the server logs were in {}", tmp.path().display());
    if std::env::var_os("SOAK_KEEP").is_some() {
        let kept = tmp.keep();
        println!("kept {}", kept.display());
    }
    Ok(())
}
