//! A server on the tiny random model for the HTTP tests: a temp adapters directory, tiny absorb
//! options, a real socket on 127.0.0.1:0.

use super::get_json;
use lift_serve::server::{self, Running, ServeConfig};
use lift_serve::testing::write_tiny_server_setup;
use reqwest::Client;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

pub struct Env {
    pub _tmp: tempfile::TempDir,
    pub model: PathBuf,
    pub adapters: PathBuf,
    pub options: PathBuf,
}

pub fn env() -> Env {
    let tmp = tempfile::tempdir().unwrap();
    let (model, options) = write_tiny_server_setup(tmp.path()).unwrap();
    let adapters = tmp.path().join("adapters");
    Env { _tmp: tmp, model, adapters, options }
}

pub fn config(e: &Env, keys: &[&str]) -> ServeConfig {
    let mut c = ServeConfig::new(e.model.clone(), e.adapters.clone());
    c.absorb_options = Some(e.options.clone());
    c.api_keys = keys.iter().map(|k| k.to_string()).collect();
    c.max_body_bytes = 64 * 1024;
    c.max_document_tokens = 4000;
    c.max_question_chars = 1000;
    c.max_tokens_limit = 64;
    c.default_max_tokens = 8;
    // The refusal tests name this cap.
    c.max_training_tokens = 10_000_000;
    c.extract_worker = Some(env!("CARGO_BIN_EXE_lift-serve").into());
    c
}

pub async fn start(c: ServeConfig) -> (Running, String) {
    let state = server::build_state(c, &candle_core::Device::Cpu).unwrap();
    let running = server::start(state).await.unwrap();
    let base = format!("http://{}", running.addr);
    (running, base)
}

pub fn client() -> Client {
    Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

pub async fn wait_ready(c: &Client, base: &str, id: &str, key: Option<&str>) -> Value {
    for _ in 0..1200 {
        let (s, d) = get_json(c, &format!("{base}/documents/{id}"), key).await;
        assert_eq!(s, 200, "{d}");
        match d["status"].as_str() {
            Some("ready") => return d,
            Some("failed") | Some("cancelled") => panic!("document did not become ready: {d}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    panic!("timed out waiting for {id}");
}

pub fn assert_error_shape(v: &Value, code: &str, ctx: &str) {
    let e = &v["error"];
    assert_eq!(e["code"], code, "{ctx}: {v}");
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{ctx}: {v}");
    assert!(e["type"].as_str().is_some(), "{ctx}: {v}");
    assert!(e.get("param").is_some(), "{ctx}: {v}");
}

