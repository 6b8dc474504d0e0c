//! Replicas on one PostgreSQL and one adapter store: real `lift-serve serve` processes on the
//! tiny model, a real throwaway PostgreSQL cluster (scripts/pg_cluster.sh), a shared `file://`
//! blob store, real HTTP. Killing a replica is SIGKILL; restarting the database is `pg_ctl stop`
//! then start on the same port.

mod common;

use common::{get_json, metric, post_json};
use lift_serve::testing::{write_tiny_server_setup, PgCluster};
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const DOC: &str = "The harbor of Velmora was built in 1843 by the engineer Ada Quill. \
It has three piers: the north pier for fishing boats, the east pier for ferries and the south pier for cargo. \
The lighthouse keeper, Tomas Brell, painted the tower blue in 1901. \
Every spring the town holds a lantern festival on the east pier.";

struct Env {
    tmp: tempfile::TempDir,
    model: PathBuf,
    options: PathBuf,
    blobs: PathBuf,
    pg: PgCluster,
}

fn env() -> Env {
    let tmp = tempfile::tempdir().unwrap();
    let (model, options) = write_tiny_server_setup(tmp.path()).unwrap();
    let blobs = tmp.path().join("blobs");
    Env { model, options, blobs, pg: PgCluster::start().unwrap(), tmp }
}

/// A replica process, killed when dropped (also when a test fails).
struct Replica {
    child: std::process::Child,
    base: String,
    log: PathBuf,
}

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Replica {
    /// `lift-serve serve` on the shared database and store, with its own local cache; waits until
    /// it reports healthy.
    async fn start(e: &Env, name: &str, role: &str, extra: &[&str]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let log = e.tmp.path().join(format!("{name}-{port}.log"));
        let cache = e.tmp.path().join(format!("cache-{name}"));
        let store = format!("file://{}", e.blobs.display());
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_lift-serve"))
            .args(["serve", "--port", &port.to_string()])
            .arg("--model").arg(&e.model)
            .arg("--adapters-dir").arg(&cache)
            .arg("--absorb-options").arg(&e.options)
            .args(if extra.contains(&"--prepared-base") { &[][..] } else { &["--prepared-base", "none"][..] })
            .args(["--database-url", &e.pg.url, "--adapter-store", &store])
            .args(["--role", role, "--replica-id", name])
            .args(if extra.contains(&"--lease-secs") { &[][..] } else { &["--lease-secs", "2"][..] })
            .args(["--api-keys", "key-one,key-two"])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut r = Replica { child, base: format!("http://127.0.0.1:{port}"), log };
        r.wait_health(StatusCode::OK).await;
        r
    }

    async fn wait_health(&mut self, want: StatusCode) -> Value {
        let c = client();
        for _ in 0..600 {
            if let Ok(resp) = c.get(format!("{}/health", self.base)).send().await {
                if resp.status() == want {
                    return resp.json().await.unwrap();
                }
            }
            assert!(self.child.try_wait().unwrap().is_none(), "the replica exited: {}", self.log_text());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the replica's /health never answered {want}: {}", self.log_text());
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn metrics(&self) -> String {
        client().get(self.url("/metrics")).bearer_auth("metrics").send().await.unwrap().text().await.unwrap()
    }
}

fn client() -> Client {
    Client::builder().timeout(Duration::from_secs(60)).build().unwrap()
}

async fn get(url: &str, key: &str) -> (StatusCode, Value) {
    get_json(&client(), url, Some(key)).await
}

async fn post(url: &str, body: Value, key: &str) -> (StatusCode, Value) {
    post_json(&client(), url, body, Some(key)).await
}

async fn wait_status(r: &Replica, id: &str, key: &str, want: &str, secs: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let (s, d) = get(&r.url(&format!("/documents/{id}")), key).await;
        assert_eq!(s, 200, "{d}");
        if d["status"] == want {
            return d;
        }
        assert!(!matches!(d["status"].as_str(), Some("failed" | "cancelled")), "{d}");
        assert!(Instant::now() < deadline, "{id} never became {want}: {d}\n{}", r.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn archives(dir: &Path) -> Vec<String> {
    match std::fs::read_dir(dir) {
        Ok(d) => d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().to_string()).filter(|n| n.ends_with(".zip")).collect(),
        Err(_) => Vec::new(),
    }
}

async fn ask(r: &Replica, id: &str, key: &str) -> (StatusCode, Value) {
    post(&r.url("/ask"), json!({"document_id": id, "question": "Who built the harbor?", "max_tokens": 4}), key).await
}

/// Reads the shared queue directly (the jobs nobody finished).
async fn jobs_left(url: &str) -> i64 {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    c.query_one("SELECT count(*) FROM jobs", &[]).await.unwrap().get(0)
}

/// A document posted to an answer-only replica is trained by a training-only one and answered
/// by the first, which fetches (and verifies) the adapter from the shared store; its progress
/// streams on the replica that does not train it; listing and tenants hold across replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_posted_to_one_replica_is_trained_by_another_and_answered_by_any() {
    let e = env();
    let trainer = Replica::start(&e, "trainer", "trainer", &["--metrics-key", "metrics"]).await;
    let server = Replica::start(&e, "server", "server", &["--metrics-key", "metrics"]).await;

    let body = json!({"text": DOC.repeat(3), "title": "velmora", "options": {"epochs": [6, 6]}});
    let (s, d) = post(&server.url("/documents"), body.clone(), "key-one").await;
    assert_eq!(s, 202, "{d}");
    let id = d["id"].as_str().unwrap().to_string();

    // The event stream on the answer-only replica follows training on the other one.
    let resp = client().get(server.url(&format!("/documents/{id}/events"))).bearer_auth("key-one").send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let events = resp.text().await.unwrap();
    let steps: Vec<u64> = events
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .filter_map(|v| v["progress"]["step"].as_u64().filter(|_| v["progress"]["stage"] == "training"))
        .collect();
    assert!(!steps.is_empty(), "training progress reached the other replica's stream: {events}");
    assert!(events.contains("event: done"), "{events}");
    let ready = wait_status(&server, &id, "key-one", "ready", 120).await;
    assert_eq!(ready["adapter"]["kind"], "gated_memory", "{ready}");
    assert!(ready["training"]["steps"].as_u64() > Some(0), "{ready}");

    // The trainer does not answer; the server does, from the shared store.
    let (s, a) = ask(&trainer, &id, "key-one").await;
    assert_eq!((s, a["error"]["code"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("not_serving")), "{a}");
    let (s, a) = ask(&server, &id, "key-one").await;
    assert_eq!(s, 200, "{a}");
    assert!(a["answer"].is_string(), "{a}");
    let m = server.metrics().await;
    assert_eq!(metric(&m, "lift_blob_fetches"), 1.0, "fetched once: {m}");
    let (s, _) = ask(&server, &id, "key-one").await;
    assert_eq!(s, 200);
    let m = server.metrics().await;
    assert_eq!(metric(&m, "lift_blob_fetches"), 1.0, "the second answer is a cache hit: {m}");
    assert!(metric(&m, "lift_adapter_cache_hits") >= 1.0, "{m}");
    let t = trainer.metrics().await;
    assert_eq!(metric(&t, "lift_jobs_claimed_total{how=\"fresh\"}"), 1.0, "{t}");
    assert_eq!(metric(&t, "lift_blob_puts"), 1.0, "{t}");
    assert!(metric(&t, "lift_lease_renewals_total") >= 1.0, "the lease was renewed while training: {t}");
    assert_eq!(archives(&e.blobs).len(), 1);

    // Listing and tenants, across replicas.
    let (s, list) = get(&trainer.url("/documents"), "key-one").await;
    assert_eq!(s, 200);
    assert_eq!(list["data"].as_array().map(|a| a.len()), Some(1), "{list}");
    assert_eq!(list["data"][0]["id"], id.as_str());
    let (s, list) = get(&server.url("/documents"), "key-two").await;
    assert_eq!((s, list["data"].as_array().map(|a| a.len())), (StatusCode::OK, Some(0)), "{list}");
    let (s, d) = get(&server.url(&format!("/documents/{id}")), "key-two").await;
    assert_eq!((s, d["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("document_not_found")), "{d}");
    let (s, _) = ask(&server, &id, "key-two").await;
    assert_eq!(s, 404);
    let resp = client().delete(trainer.url(&format!("/documents/{id}"))).bearer_auth("key-two").send().await.unwrap();
    assert_eq!(resp.status(), 404, "another tenant cannot delete it");

    // The same post on the other replica is the same document, already ready.
    let (s, d) = post(&trainer.url("/documents"), body, "key-one").await;
    assert_eq!((s, d["id"].as_str(), d["status"].as_str()), (StatusCode::OK, Some(id.as_str()), Some("ready")), "{d}");

    // A document posted to the trainer answers on the server from the first second, from its
    // passages (the server reads its text from the shared queue), before any adapter exists.
    let long = json!({"text": DOC.repeat(2), "title": "velmora-long", "options": {"epochs": [50, 50]}});
    let (s, d) = post(&trainer.url("/documents"), long, "key-one").await;
    assert_eq!(s, 202, "{d}");
    let long_id = d["id"].as_str().unwrap().to_string();
    let (s, a) = ask(&server, &long_id, "key-one").await;
    assert_eq!(s, 200, "{a}");
    assert_eq!(a["mode"], "rag", "{a}");
    assert!(a["adapter"].is_null(), "{a}");
    let resp = client().delete(server.url(&format!("/documents/{long_id}"))).bearer_auth("key-one").send().await.unwrap();
    assert_eq!(resp.status(), 204);

    // Deleted on one replica: gone on both, its archive too.
    let resp = client().delete(trainer.url(&format!("/documents/{id}"))).bearer_auth("key-one").send().await.unwrap();
    assert_eq!(resp.status(), 204);
    let (s, _) = get(&server.url(&format!("/documents/{id}")), "key-one").await;
    assert_eq!(s, 404);
    let (s, _) = ask(&server, &id, "key-one").await;
    assert_eq!(s, 404);
    assert!(archives(&e.blobs).is_empty(), "the archive is deleted with its document");
}

/// Replicas name a damaged adapter as one process does: a damaged local copy is fetched again
/// from the verified archive and answers; a damaged archive answers 409 `adapter_damaged` and
/// marks the document `damaged` for every replica; posting the same text and options again
/// (on another replica) queues it again under its id, and it answers everywhere once ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_adapter_is_named_across_replicas_and_a_repost_absorbs_it_again() {
    let e = env();
    let a = Replica::start(&e, "a", "all", &[]).await;
    let b = Replica::start(&e, "b", "server", &[]).await;
    let body = json!({"text": DOC, "title": "velmora"});
    let (s, d) = post(&a.url("/documents"), body.clone(), "key-one").await;
    assert_eq!(s, 202, "{d}");
    let id = d["id"].as_str().unwrap().to_string();
    wait_status(&a, &id, "key-one", "ready", 120).await;
    let flip = |path: &Path| {
        let mut bytes = std::fs::read(path).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 0x01;
        std::fs::write(path, bytes).unwrap();
    };

    // The trainer's local copy damaged: fetched again from the shared archive, it answers.
    flip(&e.tmp.path().join("cache-a").join(&id).join("adapter.safetensors"));
    let (s, r) = ask(&a, &id, "key-one").await;
    assert_eq!(s, 200, "{r}\n{}", a.log_text());

    // The archive damaged: a replica without a copy cannot fetch it; the document is damaged.
    let zips = archives(&e.blobs);
    assert_eq!(zips.len(), 1, "{zips:?}");
    flip(&e.blobs.join(&zips[0]));
    let (s, r) = ask(&b, &id, "key-one").await;
    assert_eq!((s, r["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("adapter_damaged")), "{r}\n{}", b.log_text());
    assert!(r["error"]["message"].as_str().unwrap().contains(&id), "{r}");
    let d = wait_status(&a, &id, "key-one", "damaged", 10).await;
    assert!(d["error"]["message"].as_str().unwrap().contains("POST"), "{d}");
    let (s, r) = ask(&a, &id, "key-one").await;
    assert_eq!((s, r["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("adapter_damaged")), "{r}");

    // The way back, posted to the replica that does not train: the same id, trained again.
    let (s, d) = post(&b.url("/documents"), body, "key-one").await;
    assert_eq!((s, d["id"].as_str()), (StatusCode::ACCEPTED, Some(id.as_str())), "{d}");
    wait_status(&b, &id, "key-one", "ready", 120).await;
    for r in [&a, &b] {
        let (s, v) = ask(r, &id, "key-one").await;
        assert_eq!(s, 200, "{v}\n{}", r.log_text());
    }
}

/// Reads one value of one row of the shared database.
async fn db_value<T: for<'a> tokio_postgres::types::FromSql<'a>>(url: &str, sql: &str, id: &str) -> T {
    let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    c.query_one(sql, &[&id]).await.unwrap().get(0)
}

/// A new base under the shared store. Documents absorbed over a prepared base, one of them asked;
/// then replicas over the plain model: an answering one sees both `queued` with `reabsorbing` and
/// answers from their passages (no 409, the old archives kept) while no trainer over the new base
/// runs; a trainer then absorbs them again, the asked one first (the other's base read from its
/// archive, as in a row written before bases were recorded), under the ids they were posted
/// under, and their old archives give way to the new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_over_a_new_base_absorbs_the_documents_again_most_recently_asked_first() {
    let e = env();
    let base_dir = e.tmp.path().join("base");
    common::save_a_prepared_base(&e.model, &base_dir);
    let a = Replica::start(&e, "a", "all", &["--prepared-base", base_dir.to_str().unwrap()]).await;
    let mut ids = Vec::new();
    for text in [DOC.to_string(), format!("{DOC} The ferry to Osk leaves at noon.")] {
        let (s, d) = post(&a.url("/documents"), json!({"text": text}), "key-one").await;
        assert_eq!(s, 202, "{d}");
        ids.push(d["id"].as_str().unwrap().to_string());
    }
    let (p, q) = (ids[0].clone(), ids[1].clone());
    for id in &ids {
        wait_status(&a, id, "key-one", "ready", 120).await;
    }
    let (s, r) = ask(&a, &q, "key-one").await;
    assert_eq!((s, r["mode"].as_str()), (StatusCode::OK, Some("lift")), "{r}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while db_value::<Option<i64>>(&e.pg.url, "SELECT last_asked_at FROM documents WHERE id = $1", &q).await.is_none() {
        assert!(Instant::now() < deadline, "the question was never recorded: {}", a.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(a);
    let old = archives(&e.blobs);
    assert_eq!(old.len(), 2);

    // Answering only: nothing over the new base trains yet.
    let b = Replica::start(&e, "b", "server", &[]).await;
    for id in &ids {
        let (s, d) = get(&b.url(&format!("/documents/{id}")), "key-one").await;
        assert_eq!((s, d["status"].as_str()), (StatusCode::OK, Some("queued")), "{d}");
        assert!(d["reabsorbing"]["previous_base"].as_str().is_some_and(|b| b.contains("with prepared base")), "{d}");
    }
    // (Asked here too: the last question, on any replica, orders the re-absorbs.)
    let (s, r) = ask(&b, &q, "key-one").await;
    assert_eq!(s, StatusCode::OK, "{r}\n{}", b.log_text());
    assert_eq!((r["mode"].as_str(), &r["adapter"]), (Some("rag"), &Value::Null), "{r}");
    assert!(r["notice"].as_str().is_some_and(|n| n.contains("absorbed again")), "{r}");
    assert_eq!(archives(&e.blobs), old, "the old archives are kept meanwhile");

    // P's row as a replica before bases were recorded wrote it: the trainer reads its base
    // from the archive's manifest.
    let (pg, conn) = tokio_postgres::connect(&e.pg.url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    assert_eq!(pg.execute("UPDATE documents SET base = NULL, base_name = NULL WHERE id = $1", &[&p]).await.unwrap(), 1);
    let c = Replica::start(&e, "c", "trainer", &[]).await;
    // (B shows P ready until C has read its base: its status alone cannot be waited on.)
    let published = "SELECT coalesce(status = 'ready' AND base_name LIKE '%without a prepared base', false) FROM documents WHERE id = $1";
    let deadline = Instant::now() + Duration::from_secs(120);
    for id in &ids {
        while !db_value::<bool>(&e.pg.url, published, id).await {
            assert!(Instant::now() < deadline, "{id} was never absorbed again: {}", c.log_text());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let log = c.log_text();
    let at = |id: &str| log.lines().position(|l| l.contains("absorbing again over this replica's base") && l.contains(id));
    let (first, second) = (at(&q).expect(&log), at(&p).expect(&log));
    assert!(first < second, "the asked document is absorbed again first: {log}");
    for id in &ids {
        let (s, r) = ask(&b, id, "key-one").await;
        assert_eq!((s, r["mode"].as_str()), (StatusCode::OK, Some("lift")), "{r}");
        assert!(r["adapter"].is_object() && r["notice"].is_null(), "{r}");
    }
    let new = archives(&e.blobs);
    assert_eq!(new.len(), 2, "{new:?}");
    assert!(new.iter().all(|z| !old.contains(z)), "the old archives went once replaced: {old:?} {new:?}");
    assert_eq!(jobs_left(&e.pg.url).await, 0);
}

/// A replica killed (SIGKILL) while it trains: once its lease runs out another replica claims
/// the job and the document becomes ready; one archive is written; a restarted replica reads it.
/// The step of the absorb checkpoint of `id` in the shared store (None: none there).
fn checkpoint_step(e: &Env, id: &str) -> Option<usize> {
    let bytes = std::fs::read(e.blobs.join("checkpoints").join(format!("{id}.safetensors"))).ok()?;
    Some(lift_serve::lift::absorb::checkpoint::Checkpoint::decode(&bytes, &candle_core::Device::Cpu).unwrap().train.cursor.step)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_job_is_taken_over_after_its_lease() {
    let e = env();
    let flags = ["--metrics-key", "metrics", "--checkpoint-secs", "0.3"];
    let mut a = Replica::start(&e, "a", "all", &flags).await;
    let body = json!({"text": DOC.repeat(4), "title": "long", "options": {"epochs": [30, 30]}});
    let (s, d) = post(&a.url("/documents"), body, "key-one").await;
    assert_eq!(s, 202, "{d}");
    let id = d["id"].as_str().unwrap().to_string();
    // Training on A, past its first steps and a checkpoint in the shared store.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, d) = get(&a.url(&format!("/documents/{id}")), "key-one").await;
        if d["status"] == "training" && d["progress"]["step"].as_u64() >= Some(2) && checkpoint_step(&e, &id).is_some_and(|s| s >= 1) {
            break;
        }
        assert!(d["status"] == "queued" || d["status"] == "training", "A must still be training when it is killed: {d}");
        assert!(Instant::now() < deadline, "training never started: {d}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = Replica::start(&e, "b", "all", &flags).await;
    a.child.kill().unwrap(); // SIGKILL: no shutdown handler runs
    a.child.wait().unwrap();
    let killed_at = Instant::now();
    let kept = checkpoint_step(&e, &id).expect("A's checkpoint is in the shared store");

    let ready = wait_status(&b, &id, "key-one", "ready", 300).await;
    assert!(killed_at.elapsed() >= Duration::from_millis(1500), "B waited for A's lease to run out");
    assert_eq!(ready["adapter"]["kind"], "gated_memory", "{ready}");
    assert_eq!(ready["training"]["resumed_from_step"], kept, "B continued from A's checkpoint: {ready}");
    assert_eq!(checkpoint_step(&e, &id), None, "the checkpoint is removed once the adapter is published");
    let m = b.metrics().await;
    assert_eq!(metric(&m, "lift_jobs_claimed_total{how=\"stolen\"}"), 1.0, "B took over A's job: {m}");
    assert_eq!(metric(&m, "lift_blob_puts"), 1.0, "{m}");
    assert_eq!(archives(&e.blobs).len(), 1, "one adapter archive");
    assert_eq!(jobs_left(&e.pg.url).await, 0, "the job is done");
    let (s, a1) = ask(&b, &id, "key-one").await;
    assert_eq!(s, 200, "{a1}");

    // A comes back (a new process, its cache dir has no adapter): it answers from the store.
    let a = Replica::start(&e, "a", "all", &["--metrics-key", "metrics"]).await;
    let (s, a2) = ask(&a, &id, "key-one").await;
    assert_eq!(s, 200, "{a2}");
    assert_eq!(a1["answer"], a2["answer"], "the same adapter answers alike (greedy)");
    assert_eq!(metric(&a.metrics().await, "lift_blob_fetches"), 1.0);
    assert_eq!(archives(&e.blobs).len(), 1, "nothing was written twice");
}

/// The same documents posted to both replicas at the same moment: one id, one job, one adapter
/// each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_document_posted_to_both_replicas_at_once_is_one_document() {
    let e = env();
    let a = Replica::start(&e, "a", "all", &["--metrics-key", "metrics"]).await;
    let b = Replica::start(&e, "b", "all", &["--metrics-key", "metrics"]).await;
    let mut ids = Vec::new();
    for i in 0..4 {
        let body = json!({"text": format!("{DOC} Copy {i}."), "options": {"epochs": [2, 2]}});
        let (url_a, url_b) = (a.url("/documents"), b.url("/documents"));
        let (ra, rb) = tokio::join!(post(&url_a, body.clone(), "key-one"), post(&url_b, body, "key-one"));
        assert_eq!(ra.1["id"], rb.1["id"], "{ra:?} {rb:?}");
        let mut codes = [ra.0.as_u16(), rb.0.as_u16()];
        codes.sort();
        assert_eq!(codes, [200, 202], "one post made the job, the other found it: {ra:?} {rb:?}");
        ids.push(ra.1["id"].as_str().unwrap().to_string());
    }
    for id in &ids {
        wait_status(&a, id, "key-one", "ready", 300).await;
    }
    let (ma, mb) = (a.metrics().await, b.metrics().await);
    let claimed = |m: &str| metric(m, "lift_jobs_claimed_total{how=\"fresh\"}") + metric(m, "lift_jobs_claimed_total{how=\"stolen\"}");
    assert_eq!(claimed(&ma) + claimed(&mb), 4.0, "one job per document:\n{ma}\n{mb}");
    assert_eq!(metric(&ma, "lift_blob_puts") + metric(&mb, "lift_blob_puts"), 4.0);
    assert_eq!(archives(&e.blobs).len(), 4, "one adapter per document");
    let (_, list) = get(&b.url("/documents"), "key-one").await;
    assert_eq!(list["data"].as_array().map(|l| l.len()), Some(4), "{list}");
}

/// PostgreSQL stopped while a replica trains: both replicas say so on /health (503), writes and
/// reads answer 503 in the API's shape; when it is back they recover on their own and the job
/// finishes. Nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restart_mid_run_loses_nothing() {
    let e = env();
    let mut a = Replica::start(&e, "a", "all", &[]).await;
    let mut b = Replica::start(&e, "b", "server", &[]).await;
    let (s, first) = post(&b.url("/documents"), json!({"text": DOC, "options": {"epochs": [2, 2]}}), "key-one").await;
    assert_eq!(s, 202, "{first}");
    let first = first["id"].as_str().unwrap().to_string();
    wait_status(&b, &first, "key-one", "ready", 120).await;
    let body = json!({"text": DOC.repeat(4), "options": {"epochs": [30, 30]}});
    let (s, d) = post(&b.url("/documents"), body, "key-one").await;
    assert_eq!(s, 202, "{d}");
    let id = d["id"].as_str().unwrap().to_string();
    wait_status(&a, &id, "key-one", "training", 60).await;

    e.pg.stop().unwrap();
    for r in [&mut a, &mut b] {
        let h = r.wait_health(StatusCode::SERVICE_UNAVAILABLE).await;
        assert_eq!(h["status"], "database_unavailable", "{h}");
    }
    let (s, err) = post(&a.url("/documents"), json!({"text": "A document posted while the database is away."}), "key-one").await;
    assert_eq!((s, err["error"]["code"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("database_unavailable")), "{err}");
    let (s, err) = get(&b.url("/documents"), "key-one").await;
    assert_eq!((s, err["error"]["code"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("database_unavailable")), "{err}");
    tokio::time::sleep(Duration::from_secs(3)).await; // longer than the lease: the holder must keep it

    e.pg.restart().unwrap();
    for r in [&mut a, &mut b] {
        r.wait_health(StatusCode::OK).await;
    }
    wait_status(&b, &id, "key-one", "ready", 300).await;
    assert!(a.log_text().contains("cannot renew the lease"), "A trained on through the outage: {}", a.log_text());
    let (s, list) = get(&b.url("/documents"), "key-one").await;
    assert_eq!(s, 200);
    let ids: Vec<&str> = list["data"].as_array().unwrap().iter().filter_map(|d| d["id"].as_str()).collect();
    assert_eq!(ids, [first.as_str(), id.as_str()], "nothing lost, nothing added");
    for doc in [&first, &id] {
        let (s, r) = ask(&b, doc, "key-one").await;
        assert_eq!(s, 200, "{r}");
    }
    assert_eq!(archives(&e.blobs).len(), 2);
    assert_eq!(jobs_left(&e.pg.url).await, 0);
}

/// A replica stopped gracefully (SIGTERM) mid-training hands its job back at once: another
/// replica claims it long before the lease (60 s) would have run out, as a fresh claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_hands_the_job_back_at_once() {
    let e = env();
    let lease = ["--metrics-key", "metrics", "--lease-secs", "60"];
    let mut a = Replica::start(&e, "a", "all", &lease).await;
    let body = json!({"text": DOC.repeat(4), "options": {"epochs": [30, 30]}});
    let (s, d) = post(&a.url("/documents"), body, "key-one").await;
    assert_eq!(s, 202, "{d}");
    let id = d["id"].as_str().unwrap().to_string();
    wait_status(&a, &id, "key-one", "training", 60).await;
    let b = Replica::start(&e, "b", "all", &lease).await;
    let t0 = Instant::now();
    unsafe { libc::kill(a.child.id() as i32, libc::SIGTERM) };
    let status = a.child.wait().unwrap();
    assert!(status.success(), "A exits cleanly: {status:?}\n{}", a.log_text());
    // The moment B claims the job, not the moment it finishes training it (which depends on
    // the machine's speed): a handed-back job is claimed at once, a taken-over one only after
    // the 60 s lease.
    let claimed = loop {
        let m = b.metrics().await;
        if metric(&m, "lift_jobs_claimed_total{how=\"fresh\"}") >= 1.0 {
            break t0.elapsed();
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "B has not claimed the job: {m}\n{}", b.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(claimed < Duration::from_secs(50), "claimed before the 60 s lease ran out: {claimed:?}");
    wait_status(&b, &id, "key-one", "ready", 300).await;
    let m = b.metrics().await;
    assert_eq!(metric(&m, "lift_jobs_claimed_total{how=\"fresh\"}"), 1.0, "handed back, not taken over: {m}");
    assert_eq!(metric(&m, "lift_jobs_claimed_total{how=\"stolen\"}"), 0.0, "handed back, not taken over: {m}");
    assert_eq!(archives(&e.blobs).len(), 1);
}

/// A collection made on one replica is asked on another (one ranking over both documents, the
/// routed adapter fetched from the shared store), changed there, and loses a document deleted on
/// the first (the database's cascade); other tenants do not see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collection_posted_on_one_replica_is_served_by_another() {
    let e = env();
    let a = Replica::start(&e, "a", "all", &[]).await;
    let b = Replica::start(&e, "b", "server", &[]).await;
    let key = "key-one";
    let orchard = "The orchard of Brindle grows pears and quinces on the south slope. \
The orchard keeper, Mira Falk, planted the first quince tree in 1877.";
    let mut ids = Vec::new();
    for (text, title) in [(DOC, "Harbor"), (orchard, "Orchard")] {
        let (s, d) = post(&a.url("/documents"), json!({"text": text, "title": title}), key).await;
        assert_eq!(s, StatusCode::ACCEPTED, "{d}");
        ids.push(d["id"].as_str().unwrap().to_string());
    }
    for id in &ids {
        wait_status(&a, id, key, "ready", 120).await;
    }
    let (s, col) = post(&a.url("/collections"), json!({"title": "Towns", "document_ids": ids}), key).await;
    assert_eq!(s, StatusCode::CREATED, "{col}");
    let id = col["id"].as_str().unwrap().to_string();

    let (s, v) = get(&b.url(&format!("/collections/{id}")), key).await;
    assert_eq!((s, v["document_ids"].as_array().map(Vec::len)), (StatusCode::OK, Some(2)), "{v}");
    let ask = json!({"collection_id": id, "question": "Who planted the first quince tree?", "max_tokens": 4});
    let (s, r) = post(&b.url("/ask"), ask.clone(), key).await;
    assert_eq!(s, 200, "{r}\n{}", b.log_text());
    assert_eq!((r["document_id"].as_str(), r["mode"].as_str()), (Some(ids[1].as_str()), Some("lift")), "{r}");
    assert_eq!(r["adapter"]["document_id"], ids[1].as_str(), "{r}");
    let (_, models) = get(&b.url("/v1/models"), key).await;
    assert!(models["data"].as_array().unwrap().iter().any(|m| m["id"] == id.as_str()), "{models}");
    let (s, _) = get(&b.url(&format!("/collections/{id}")), "key-two").await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // Changed on b, seen on a; a document deleted on a leaves it everywhere.
    let patch = client().patch(b.url(&format!("/collections/{id}"))).bearer_auth(key).json(&json!({"remove": [ids[0]]})).send().await.unwrap();
    assert_eq!(patch.status(), 200);
    let (_, v) = get(&a.url(&format!("/collections/{id}")), key).await;
    assert_eq!(v["document_ids"], json!([ids[1]]), "{v}");
    let del = client().delete(a.url(&format!("/documents/{}", ids[1]))).bearer_auth(key).send().await.unwrap();
    assert_eq!(del.status(), 204);
    let (_, v) = get(&b.url(&format!("/collections/{id}")), key).await;
    assert_eq!(v["document_ids"], json!([]), "{v}");
    let (s, r) = post(&b.url("/ask"), ask, key).await;
    assert_eq!((s, r["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("collection_empty")), "{r}");
}
