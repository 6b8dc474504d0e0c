//! `eval --server URL`: the same evaluation through a running lift-serve's HTTP API (docs/API.md),
//! so it measures the real serving path: `POST /documents`, progress from
//! `GET /documents/{id}/events` until done, `POST /ask`.
//!
//! The API takes the absorb options `adapter`, `window`, `stride`, `epochs` and `aux_qa`; the
//! rest (training context, model-generated QA, seeds) are the server's `--absorb-options`, and the
//! answer context budget is its `--context-tokens`. The evaluation checks every prompt's length
//! (`usage.prompt_tokens`) against the prompt it labelled questions with, so a server with another
//! context budget is reported instead of mislabelled.

use super::{AbsorbRecord, AnswerRecord, Asked, Backend, EvalDocument};
use crate::lift::answer::Mode;
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
    /// Every document of the run as the server knows it: (the run's id, the server's id of its
    /// first adapter), for `--collection`.
    absorbed: Vec<(String, String)>,
}

impl Server {
    pub fn new(url: &str, key: Option<String>, max_tokens: usize) -> Result<Self> {
        let http = reqwest::blocking::Client::builder().timeout(None::<Duration>).build()?;
        let s = Self { base: url.trim_end_matches('/').to_string(), key, max_tokens, http, ids: Vec::new(), absorbed: Vec::new() };
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

impl Server {
    /// `eval --collection`: every question of `docs` asked again, in each of `modes`, of one
    /// collection of all the run's documents (the first adapter of each), as a user with a
    /// library would ask (docs/collections.md). Each answer records whether routing chose the
    /// question's document (the one whose passage ranked first, whose adapter answers in `lift`).
    pub fn ask_collection(&mut self, docs: &[EvalDocument], modes: &[Mode]) -> Result<Vec<AnswerRecord>> {
        let ids: Vec<&str> = self.absorbed.iter().map(|(_, id)| id.as_str()).collect();
        anyhow::ensure!(!ids.is_empty(), "--collection: no document of the run was absorbed on the server");
        let created = self.send(
            self.http.post(format!("{}/collections", self.base)).json(&json!({"title": "eval", "document_ids": ids})),
        )?;
        let collection = created["id"].as_str().context("POST /collections answered no id")?.to_string();
        let mut out = Vec::new();
        for doc in docs {
            let own = self.absorbed.iter().find(|(d, _)| *d == doc.id).map(|(_, id)| id.clone());
            for q in &doc.questions {
                for mode in modes {
                    let t = Instant::now();
                    let body = json!({"collection_id": collection, "question": q.question, "mode": mode.name(),
                        "max_tokens": self.max_tokens, "temperature": 0});
                    let r = self.send(self.http.post(format!("{}/ask", self.base)).json(&body))?;
                    let prediction = r["answer"].as_str().context("POST /ask answered no answer")?.to_string();
                    let routed = r["document_id"].as_str().context("POST /ask on a collection answered no document_id")?;
                    out.push(AnswerRecord {
                        document: doc.id.clone(),
                        question: q.id.clone(),
                        method: format!("{COLLECTION_PREFIX}{}", mode.name()),
                        scores: crate::corpus::scoring::score(&prediction, &q.answers),
                        prediction,
                        in_window: None,
                        depth: q.depth,
                        kind: q.kind,
                        target_tokens: doc.target_tokens,
                        document_tokens: doc.tokens,
                        prompt_tokens: r["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize,
                        seconds: t.elapsed().as_secs_f64(),
                        evidence_in_context: None,
                        form: q.form.clone(),
                        mask: None,
                        logprobs: Vec::new(),
                        routed_right: Some(own.as_deref() == Some(routed)),
                    });
                }
            }
        }
        let _ = self.auth(self.http.delete(format!("{}/collections/{collection}", self.base))).send();
        Ok(out)
    }
}

/// The method name of an answer asked of the run's collection (`collection:lift`).
pub const COLLECTION_PREFIX: &str = "collection:";

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
        if self.ids.is_empty() {
            self.absorbed.push((doc.id.clone(), id.clone()));
        }
        self.ids.push(id);
        Ok((rec, self.ids.len() - 1))
    }

    fn ask(
        &mut self,
        doc: &EvalDocument,
        _document: &crate::document::Document,
        handle: Option<usize>,
        ask: &Ask,
        each_passage: bool,
    ) -> Result<Asked> {
        anyhow::ensure!(!each_passage, "reading each passage on its own is measured in-process only (not through --server)");
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
