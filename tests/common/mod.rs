//! Helpers the HTTP tests share (`mod common;` in each test file that talks to a server).
#![allow(dead_code)] // each test file uses its own subset

pub mod tiny_server;

use reqwest::{Client, StatusCode};
use serde_json::Value;

/// GET `url` (with `key` as the bearer token): the status and the JSON body (null if none).
pub async fn get_json(c: &Client, url: &str, key: Option<&str>) -> (StatusCode, Value) {
    let mut r = c.get(url);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let resp = r.send().await.unwrap();
    let s = resp.status();
    (s, resp.json().await.unwrap_or(Value::Null))
}

/// POST `body` as JSON to `url`: the status and the JSON body (null if none).
pub async fn post_json(c: &Client, url: &str, body: Value, key: Option<&str>) -> (StatusCode, Value) {
    let mut r = c.post(url).json(&body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let resp = r.send().await.unwrap();
    let s = resp.status();
    (s, resp.json().await.unwrap_or(Value::Null))
}

/// The value of the metric line that starts with `name` in Prometheus text (0 when absent).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

/// A tiny prepared base with a filter for the tiny model at `model`, saved in `dir`; its hash.
#[allow(dead_code)]
pub fn save_a_prepared_base(model: &std::path::Path, dir: &std::path::Path) -> String {
    let plain = lift_serve::model::Model::load(model, &candle_core::Device::Cpu).unwrap();
    let shape = lift_serve::base::BaseShape {
        rank: 2,
        filter: lift_serve::lift::answer::layout::FilterOptions { enabled: true, layer: Some(0), ..Default::default() },
    };
    let mut prepared = lift_serve::base::PreparedBase::new(&plain, &shape, 5).unwrap();
    prepared.save(dir).unwrap().sha256.clone()
}
