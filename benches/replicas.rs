//! Replicas on a shared PostgreSQL and adapter store, against one process on files: real
//! `lift-serve serve` processes on the default model, a throwaway PostgreSQL cluster
//! (scripts/pg_cluster.sh), a `file://` blob store, real HTTP.
//!
//! a. **Queue overhead**: time from POST to ready for the same kind of document (a slice of
//!    `tests/fixtures/harbor_history.txt`, short absorb options), on one process with files vs
//!    posted to an answer-only replica A and trained by a training-only replica B; the overhead
//!    is the wall time minus the absorb's own seconds (`training.total_seconds`: QA, plan, training).
//! b. **Answer latency on a cache miss vs a hit**: a fresh answer-only replica asks about a ready
//!    document (first ask: fetch the archive, verify, unpack, load), then asks again (cached);
//!    `max_tokens` 1, so the figure is load + prompt. The same on files (first ask loads from the
//!    local directory).
//! c. **One trainer vs two**: 4 documents posted at once; one `all` replica with
//!    `RAYON_NUM_THREADS=2` vs two with 1 thread each (the same cores): time until all are ready.
//!
//!   LIFT_MODELS_DIR=models cargo bench --bench replicas
//!
//! Environment: BENCH_RUNS (3: documents timed in a.), BENCH_ASKS (5: cached asks in b.).

#[path = "common/stats.rs"]
mod stats;
use anyhow::{bail, Context, Result};
use lift_serve::testing::PgCluster;
use serde_json::{json, Value};
use stats::percentile;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn median(xs: &[f64]) -> f64 {
    percentile(xs, 0.5)
}

struct Proc {
    child: std::process::Child,
    base: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Bench {
    tmp: tempfile::TempDir,
    options: PathBuf,
    client: reqwest::Client,
}

impl Bench {
    /// A `lift-serve serve` process; `shared`: (database URL, role) for a replica.
    async fn start(&self, name: &str, shared: Option<(&str, &str)>, threads: usize) -> Result<Proc> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_lift-serve"));
        cmd.args(["serve", "--port", &port.to_string(), "--prepared-base", "none"])
            .arg("--adapters-dir")
            .arg(self.tmp.path().join(format!("dir-{name}")))
            .arg("--absorb-options")
            .arg(&self.options)
            .env("RAYON_NUM_THREADS", threads.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(self.tmp.path().join(format!("{name}.log")))?);
        if let Some((url, role)) = shared {
            let store = format!("file://{}", self.tmp.path().join("blobs").display());
            cmd.args(["--database-url", url, "--adapter-store", &store, "--role", role, "--replica-id", name]);
        }
        let mut p = Proc { child: cmd.spawn()?, base: format!("http://127.0.0.1:{port}") };
        for _ in 0..1200 {
            if let Ok(r) = self.client.get(format!("{}/health", p.base)).send().await {
                if r.status() == 200 {
                    return Ok(p);
                }
            }
            if p.child.try_wait()?.is_some() {
                bail!("{name} exited; see its log");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("{name} never became healthy")
    }

    async fn post(&self, p: &Proc, text: &str) -> Result<String> {
        let r = self.client.post(format!("{}/documents", p.base)).json(&json!({"text": text})).send().await?;
        let (s, v): (_, Value) = (r.status(), r.json().await?);
        if s != 202 {
            bail!("POST /documents: {s} {v}");
        }
        Ok(v["id"].as_str().context("no id")?.to_string())
    }

    async fn wait_ready(&self, p: &Proc, id: &str) -> Result<Value> {
        loop {
            let v: Value = self.client.get(format!("{}/documents/{id}", p.base)).send().await?.json().await?;
            match v["status"].as_str() {
                Some("ready") => return Ok(v),
                Some("failed") | Some("cancelled") => bail!("{id}: {v}"),
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// POST, then ready: (wall seconds, the training's own seconds).
    async fn absorb(&self, post_to: &Proc, text: &str) -> Result<(f64, f64)> {
        let t0 = Instant::now();
        let id = self.post(post_to, text).await?;
        let d = self.wait_ready(post_to, &id).await?;
        let trained = d["training"]["total_seconds"].as_f64().context("no absorb seconds")?;
        Ok((t0.elapsed().as_secs_f64(), trained))
    }

    async fn ask_ms(&self, p: &Proc, id: &str) -> Result<f64> {
        let t0 = Instant::now();
        let r = self
            .client
            .post(format!("{}/ask", p.base))
            .json(&json!({"document_id": id, "question": "Who built the harbor?", "max_tokens": 1}))
            .send()
            .await?;
        if r.status() != 200 {
            bail!("ask: {} {}", r.status(), r.text().await?);
        }
        r.bytes().await?;
        Ok(t0.elapsed().as_secs_f64() * 1000.0)
    }

    async fn metric(&self, p: &Proc, name: &str) -> Result<f64> {
        let text = self.client.get(format!("{}/metrics", p.base)).send().await?.text().await?;
        Ok(text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0))
    }
}

/// `n` distinct documents of about `words` words from the fixture.
fn documents(n: usize, words: usize) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/harbor_history.txt"))?;
    let all: Vec<&str> = text.split_whitespace().collect();
    Ok((0..n)
        .map(|i| {
            let start = (i * 97) % all.len().saturating_sub(words).max(1);
            format!("Record {i}. {}", all[start..(start + words).min(all.len())].join(" "))
        })
        .collect())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let runs = env_usize("BENCH_RUNS", 3);
    let asks = env_usize("BENCH_ASKS", 5);
    let tmp = tempfile::tempdir()?;
    let options = tmp.path().join("absorb.json");
    std::fs::write(
        &options,
        json!({"plan": {"window": 128, "context_tokens": 64}, "train": {"epochs": [1, 1]},
               "qa": {"use_model": false, "max_pairs": 4}})
        .to_string(),
    )?;
    let b = Bench { tmp, options, client: reqwest::Client::builder().timeout(Duration::from_secs(1800)).build()? };
    let docs = documents(runs * 2 + 4, 160)?;
    println!("replicas bench: default model, documents of ~160 words, window 128, epochs [1,1], 4 extractive QA pairs");

    // a. POST → ready.
    let (mut files_over, mut files_wall, mut shared_over, mut shared_wall) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let files = b.start("files", None, 2).await?;
    let pg = PgCluster::start()?;
    let server = b.start("server", Some((&pg.url, "server")), 2).await?;
    let trainer = b.start("trainer", Some((&pg.url, "trainer")), 2).await?;
    for i in 0..runs {
        // Alternating, so that drift on a shared machine falls on both alike.
        let (w, t) = b.absorb(&files, &docs[2 * i]).await?;
        files_wall.push(w);
        files_over.push((w - t) * 1000.0);
        let (w, t) = b.absorb(&server, &docs[2 * i + 1]).await?;
        shared_wall.push(w);
        shared_over.push((w - t) * 1000.0);
        println!("  run {i}: files {:.1} s (overhead {:.0} ms); replicas {:.1} s (overhead {:.0} ms)", files_wall[i], files_over[i], shared_wall[i], shared_over[i]);
    }
    println!(
        "a. POST → ready, median of {runs}: one process on files {:.2} s, overhead {:.0} ms; posted to A, trained by B {:.2} s, overhead {:.0} ms",
        median(&files_wall), median(&files_over), median(&shared_wall), median(&shared_over)
    );
    drop(trainer);

    // b. Cache miss vs hit.
    let id_files = {
        let v: Value = b.client.get(format!("{}/documents", files.base)).send().await?.json().await?;
        v["data"][0]["id"].as_str().context("no document")?.to_string()
    };
    let v: Value = b.client.get(format!("{}/documents", server.base)).send().await?.json().await?;
    let id_shared = v["data"][0]["id"].as_str().context("no document")?.to_string();
    drop(files);
    let files = b.start("files", None, 2).await?; // a new process: nothing in memory
    let fresh = b.start("fresh", Some((&pg.url, "server")), 2).await?;
    let files_miss = b.ask_ms(&files, &id_files).await?;
    let shared_miss = b.ask_ms(&fresh, &id_shared).await?;
    let (mut files_hit, mut shared_hit) = (Vec::new(), Vec::new());
    for _ in 0..asks {
        files_hit.push(b.ask_ms(&files, &id_files).await?);
        shared_hit.push(b.ask_ms(&fresh, &id_shared).await?);
    }
    let fetched = b.metric(&fresh, "lift_blob_fetches").await?;
    println!(
        "b. answer latency (max_tokens 1): files first ask {files_miss:.0} ms, cached {:.0} ms; replica first ask (archive fetched and verified: {fetched}) {shared_miss:.0} ms, cached {:.0} ms",
        median(&files_hit), median(&shared_hit)
    );
    drop((files, fresh, server));

    // c. One trainer vs two on the same cores.
    let batch = &docs[2 * runs..2 * runs + 4];
    let mut walls = Vec::new();
    for (label, trainers) in [("one trainer, 2 threads", 1usize), ("two trainers, 1 thread each", 2)] {
        let pg = PgCluster::start()?;
        let threads = 2 / trainers;
        let mut procs = Vec::new();
        for t in 0..trainers {
            procs.push(b.start(&format!("{label}-{t}").replace([' ', ','], "_"), Some((&pg.url, "all")), threads).await?);
        }
        let t0 = Instant::now();
        let mut ids = Vec::new();
        for d in batch {
            ids.push(b.post(&procs[0], d).await?);
        }
        for id in &ids {
            b.wait_ready(&procs[0], id).await?;
        }
        let wall = t0.elapsed().as_secs_f64();
        println!("c. {label}: 4 documents ready in {wall:.1} s ({:.2} documents/min)", 4.0 * 60.0 / wall);
        walls.push(wall);
    }
    println!("c. throughput ratio two trainers / one trainer: {:.2}", walls[0] / walls[1]);
    Ok(())
}
