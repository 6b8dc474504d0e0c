//! `eval --server URL`: the same evaluation through a running lift-serve's HTTP API (docs/API.md),
//! so it measures the real serving path: `POST /documents`, progress from
//! `GET /documents/{id}/events` until done, `POST /ask`.
//!
//! The API takes the absorb options `adapter`, `window`, `stride`, `epochs` and `aux_qa`; the
//! rest (training context, model-generated QA, seeds) are the server's `--absorb-options`, and the
//! answer context budget is its `--context-tokens`. The evaluation checks every prompt's length
//! (`usage.prompt_tokens`) against the prompt it labelled questions with, so a server with another
//! context budget is reported instead of mislabelled.

use super::{AbsorbRecord, Asked, Backend, EvalDocument};
use crate::model::filter::ChunkScore;
use crate::adapters::AdapterKind;
use crate::lift::answer::Ask;
use crate::lift::AbsorbOptions;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::io::BufRead;
use std::time::{Duration, Instant};

pub struct Server {
    base: String,
    key: Option<String>,
    max_tokens: usize,
    http: reqwest::blocking::Client,
    /// Document ids absorbed for the current document, by handle.
    ids: Vec<String>,
}

impl Server {
    pub fn new(url: &str, key: Option<String>, max_tokens: usize) -> Result<Self> {
        let http = reqwest::blocking::Client::builder().timeout(None::<Duration>).build()?;
        let s = Self { base: url.trim_end_matches('/').to_string(), key, max_tokens, http, ids: Vec::new() };
        let health: Value = s.send(s.http.get(format!("{}/health", s.base)))?;
        anyhow::ensure!(health["status"] == "ok", "{}: server not healthy: {health}", s.base);
        Ok(s)
    }

    fn auth(&self, r: reqwest::blocking::RequestBuilder) -> reqwest::blocking::RequestBuilder {
        match &self.key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    fn send(&self, r: reqwest::blocking::RequestBuilder) -> Result<Value> {
        let resp = self.auth(r).send().with_context(|| format!("{}: request failed", self.base))?;
        let status = resp.status();
        let body: Value = resp.json().unwrap_or(Value::Null);
        if !status.is_success() {
            bail!("server answered {status}: {}", body["error"]["message"].as_str().unwrap_or(&body.to_string()));
        }
        Ok(body)
    }

    /// The options the API accepts, from `opts`.
    pub fn api_options(opts: &AbsorbOptions) -> Value {
        let mut o = json!({
            "adapter": match opts.adapter { AdapterKind::GatedMemory => "gated_memory", AdapterKind::Lora => "lora" },
            "window": opts.plan.window,
            "epochs": opts.train.epochs,
            "aux_qa": opts.qa.max_pairs,
        });
        if let Some(s) = opts.plan.stride {
            o["stride"] = json!(s);
        }
        if let Some(b) = opts.budget_seconds {
            o["budget_seconds"] = json!(b);
        }
        o
    }
}

impl Backend for Server {
    fn absorb(
        &mut self,
        doc: &EvalDocument,
        _document: &crate::document::Document,
        opts: &AbsorbOptions,
        on_step: &mut dyn FnMut(usize, usize, f64),
    ) -> Result<(AbsorbRecord, usize)> {
        let t0 = Instant::now();
        let body = json!({"text": doc.text, "title": doc.id, "options": Self::api_options(opts)});
        let created = self.send(self.http.post(format!("{}/documents", self.base)).json(&body))?;
        let id = created["id"].as_str().context("POST /documents answered no id")?.to_string();
        if created["status"] == "ready" {
            tracing::warn!(id, "the server had already absorbed this document: its absorb time is not measured");
        }
        // Follow the event stream to the end, keeping one loss per optimizer step.
        let resp = self.auth(self.http.get(format!("{}/documents/{id}/events", self.base))).send()?;
        anyhow::ensure!(resp.status().is_success(), "GET /documents/{id}/events answered {}", resp.status());
        let mut losses: Vec<f64> = Vec::new();
        let mut last = Value::Null;
        let mut event = String::new();
        for line in std::io::BufReader::new(resp).lines() {
            let line = line?;
            if let Some(e) = line.strip_prefix("event:") {
                event = e.trim().to_string();
            } else if let Some(d) = line.strip_prefix("data:") {
                let v: Value = serde_json::from_str(d.trim()).context("bad event data")?;
                let p = &v["progress"];
                if let (Some(step), Some(steps), Some(loss)) =
                    (p["step"].as_u64(), p["steps"].as_u64(), p["loss"].as_f64())
                {
                    if p["stage"] == "training" && step as usize > losses.len() && step > 0 {
                        losses.resize(step as usize - 1, f64::NAN);
                        losses.push(loss);
                        on_step(step as usize, steps as usize, loss);
                    }
                }
                last = v;
                if event == "done" {
                    break;
                }
            }
        }
        let doc_json = self.send(self.http.get(format!("{}/documents/{id}", self.base)))?;
        if doc_json["status"] != "ready" {
            bail!(
                "{}: absorbing failed on the server: {}",
                doc.id,
                doc_json["error"]["message"].as_str().unwrap_or(&last.to_string())
            );
        }
        // The adapter's own record of every step's loss; the progress events skip steps when
        // the stream falls behind (their gaps were NaN here), so they are only the fallback.
        let recorded: Option<Vec<f64>> = serde_json::from_value(doc_json["training"]["step_losses"].clone()).ok();
        let losses = recorded.filter(|l| !l.is_empty()).unwrap_or(losses);
        let rec = AbsorbRecord {
            document: doc.id.clone(),
            seconds: t0.elapsed().as_secs_f64(),
            steps: losses.len(),
            parameters: doc_json["adapter"]["parameters"].as_u64().unwrap_or(0) as usize,
            adapter_bytes: doc_json["adapter"]["bytes"].as_u64().unwrap_or(0) as usize,
            final_loss: losses.last().copied(),
            step_losses: losses,
            probe_curve: serde_json::from_value(doc_json["training"]["probe_curve"].clone()).unwrap_or_default(),
            planned_steps: doc_json["training"]["planned_steps"].as_u64().map(|n| n as usize),
            estimated_seconds: created["estimate"]["seconds"].as_f64(),
            estimated_tokens: created["estimate"]["training_tokens"].as_u64(),
            out_of_time: doc_json["training"]["out_of_time"].as_bool().unwrap_or(false),
            ..Default::default()
        };
        self.ids.push(id);
        Ok((rec, self.ids.len() - 1))
    }

    fn ask(&mut self, doc: &EvalDocument, _document: &crate::document::Document, handle: Option<usize>, ask: &Ask) -> Result<Asked> {
        // `icl` and `rag` need no adapter, but the API asks about a document by id: any of its adapters.
        let id = match handle.or(self.ids.len().checked_sub(1)) {
            Some(h) => self.ids[h].clone(),
            None => bail!("{}: through the server, `icl` needs another method that absorbs the document", doc.id),
        };
        let mut body = json!({"document_id": id, "question": ask.question, "mode": ask.mode.name(), "max_tokens": self.max_tokens,
            "temperature": 0, "include_context": true});
        if let Some(c) = ask.context {
            body["context"] = json!(c.name());
        }
        // The run's budget, not the server's default, so the labels match what was shown.
        if let Some(n) = ask.context_tokens.filter(|_| ask.mode.uses_context()) {
            body["context_tokens"] = json!(n);
        }
        let r = self.send(self.http.post(format!("{}/ask", self.base)).json(&body))?;
        let answer = r["answer"].as_str().context("POST /ask answered no answer")?.to_string();
        let chunks = r["context"]["chunks"].as_array().map_or(Ok(Vec::new()), |cs| {
            cs.iter()
                .map(|c| {
                    let n = |k: &str| c[k].as_f64().with_context(|| format!("POST /ask: a context chunk without `{k}`"));
                    Ok(ChunkScore { start: n("start")? as usize, end: n("end")? as usize, score: n("score")? as f32, mask: n("mask")? as f32 })
                })
                .collect::<Result<Vec<_>>>()
        })?;
        Ok(Asked { text: answer, prompt_tokens: r["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize, chunks, logprobs: Vec::new() })
    }

    fn release(&mut self) {
        self.ids.clear();
    }
}
