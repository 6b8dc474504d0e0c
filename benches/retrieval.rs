//! What query-aware context costs, on the default model over the shipped prepared base:
//! a. the passage index's build time and a question's retrieval (BM25 + selection) and re-rank
//!    (the prepared base's filter over BM25's candidates) times, for a 4K- and a ~100K-token
//!    document cut from the eval essays, beside the whole `rag` answer's time at 4K with the
//!    default context (`bm25`) and with the re-rank (`retrieved`) (the target: retrieval +
//!    re-rank ≤ 5% of the answer);
//! b. through the server (in this process, real HTTP), the wait from `POST /documents` of a
//!    4K-token document to a first correct answer about a fact planted out of the head-and-tail
//!    window (the answer comes in `rag` mode while the adapter trains; the job is then deleted).
//!
//!   RAYON_NUM_THREADS=2 cargo bench --bench retrieval
//!
//! Environment: BENCH_RUNS (5; medians over the questions × runs), BENCH_LONG_TOKENS (100000),
//! BENCH_MAX_TOKENS (answer length, 32).

#[path = "common/stats.rs"]
mod stats;
use anyhow::{Context, Result};
use candle_core::Device;
use lift_serve::document::Document;
use lift_serve::corpus as data;
use lift_serve::eval::{needles, EvalDocument};
use lift_serve::lift::answer::{answer, build_prompt, passage_tokens, Ask, ContextPolicy, Mode};
use lift_serve::model::generate::SamplingParams;
use lift_serve::model::Model;
use lift_serve::server::{self, ServeConfig};
use serde_json::{json, Value};
use stats::percentile;
use std::time::{Duration, Instant};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn median(xs: &[f64]) -> f64 {
    percentile(xs, 0.5)
}

fn ms(s: f64) -> String {
    format!("{:.2} ms", s * 1000.0)
}

/// A document of about `tokens` tokens with planted facts.
fn document(model: &Model, essays: &[data::Essay], tokens: usize, seed: u64) -> Result<EvalDocument> {
    let spec = needles::NeedleSpec {
        lengths: vec![tokens],
        depths: vec![0.2, 0.4, 0.6, 0.8],
        needles_per_depth: 2,
        docs_per_length: 1,
        seed,
    };
    Ok(needles::build_set(model, essays, &spec)?.remove(0))
}

fn time<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, f64)> {
    let t = Instant::now();
    let v = f()?;
    Ok((v, t.elapsed().as_secs_f64()))
}

/// `eval`: the eval split's essays (the 4K document); `all`: every essay (the long one: the
/// eval split alone is too short; costs do not depend on which essays).
fn costs(model: &Model, eval: &[data::Essay], all: &[data::Essay], runs: usize, max_tokens: usize) -> Result<()> {
    let long = env_usize("BENCH_LONG_TOKENS", 100_000);
    for (label, tokens, essays) in [("4K", 4096, eval), ("long", long, all)] {
        let d = document(model, essays, tokens, 31)?;
        let (doc, encode) = time(|| Document::encode(model, d.text.clone()))?;
        let (_, build) = time(|| Ok(doc.passages(model, passage_tokens(model))?.len()))?;
        let index = doc.passages(model, passage_tokens(model))?;
        let (mut search, mut bm25_prompt, mut retrieved_prompt) = (Vec::new(), Vec::new(), Vec::new());
        let (mut bm25_answers, mut retrieved_answers) = (Vec::new(), Vec::new());
        for _ in 0..runs {
            for q in &d.questions {
                let (_, s) = time(|| Ok(index.search(&q.question)))?;
                search.push(s);
                let ask = |context| Ask { history: &[], question: &q.question, mode: Mode::Rag, context: Some(context), context_tokens: None };
                bm25_prompt.push(time(|| build_prompt(model, &doc, &ask(ContextPolicy::Bm25), max_tokens))?.1);
                retrieved_prompt.push(time(|| build_prompt(model, &doc, &ask(ContextPolicy::Retrieved), max_tokens))?.1);
                if tokens <= 8192 {
                    let params = SamplingParams { max_tokens, ..Default::default() };
                    bm25_answers.push(time(|| answer(model, &doc, None, &ask(ContextPolicy::Bm25), &params, &mut |_| true))?.1);
                    retrieved_answers.push(time(|| answer(model, &doc, None, &ask(ContextPolicy::Retrieved), &params, &mut |_| true))?.1);
                }
            }
        }
        println!(
            "{label}: {} tokens, {} passages; tokenize {}, index build {}; per question (medians): BM25 search {}, \
             BM25 prompt {}, retrieved prompt (BM25 + filter re-rank where it runs) {}",
            doc.len(),
            index.len(),
            ms(encode),
            ms(build),
            ms(median(&search)),
            ms(median(&bm25_prompt)),
            ms(median(&retrieved_prompt))
        );
        // The re-rank is skipped where every passage BM25 found fits the budget: its cost where it
        // runs, against the answer it precedes.
        let rerank: Vec<f64> = retrieved_prompt.iter().zip(&bm25_prompt).map(|(r, b)| r - b).collect();
        let ran: Vec<usize> = (0..rerank.len()).filter(|&i| rerank[i] > 1e-3).collect();
        if !ran.is_empty() && !retrieved_answers.is_empty() {
            let cost: Vec<f64> = ran.iter().map(|&i| rerank[i]).collect();
            let share: Vec<f64> = ran.iter().map(|&i| rerank[i] / retrieved_answers[i]).collect();
            println!(
                "{label}: the re-rank ran for {} of {} questions; where it ran: re-rank {}, the retrieved answer {}, the re-rank {:.1}% of it (medians)",
                ran.len(),
                retrieved_prompt.len(),
                ms(median(&cost)),
                ms(median(&ran.iter().map(|&i| retrieved_answers[i]).collect::<Vec<_>>())),
                100.0 * median(&share)
            );
        }
        if !bm25_answers.is_empty() {
            let (b, r) = (median(&bm25_answers), median(&retrieved_answers));
            println!(
                "{label}: whole rag answer ({max_tokens} tokens max, medians over every question): default (bm25) {}, \
                 BM25 prompt {:.1}% of it; with the re-rank (retrieved) {}",
                ms(b),
                100.0 * median(&bm25_prompt) / b,
                ms(r)
            );
        }
    }
    Ok(())
}

async fn first_answer(model_path: std::path::PathBuf, essays: &[data::Essay], model: &Model) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let mut cfg = ServeConfig::new(model_path, tmp.path().join("adapters"));
    cfg.runtime = lift_serve::runtime::RuntimeConfig::from_env()?;
    cfg.prepared_base = Some(concat!(env!("CARGO_MANIFEST_DIR"), "/base").to_string());
    let state = tokio::task::block_in_place(|| server::build_state(cfg, &Device::Cpu))?;
    let running = server::start(state).await?;
    let base = format!("http://{}", running.addr);
    let c = reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?;
    let d = document(model, essays, 4096, 47)?;
    // A fact out of the head and tail the LIFT paper's truncation would show.
    let doc = Document::encode(model, d.text.clone())?;
    let q = d
        .questions
        .iter()
        .find(|q| {
            let ask = Ask { history: &[], question: &q.question, mode: Mode::Icl, context: Some(ContextPolicy::HeadTail), context_tokens: None };
            build_prompt(model, &doc, &ask, 32).is_ok_and(|p| !q.evidence_tokens.iter().any(|&s| p.shows(s)))
        })
        .context("no out-of-window question")?;
    let t0 = Instant::now();
    let posted: Value = c.post(format!("{base}/documents")).json(&json!({"text": d.text})).send().await?.json().await?;
    let id = posted["id"].as_str().with_context(|| format!("POST /documents: {posted}"))?.to_string();
    let post_s = t0.elapsed().as_secs_f64();
    let mut tries = 0;
    loop {
        tries += 1;
        let a: Value = c
            .post(format!("{base}/ask"))
            .json(&json!({"document_id": id, "question": q.question, "max_tokens": 32}))
            .send()
            .await?
            .json()
            .await?;
        let reply = a["answer"].as_str().unwrap_or("").to_lowercase();
        let right = q.answers.iter().any(|x| reply.contains(&x.to_lowercase()));
        if right || tries >= 3 {
            println!(
                "server: POST /documents of {} tokens answered in {}; first {} answer to an out-of-window question ({:?} → {:?}, \
                 mode {}, adapter {}) {:.2} s after the POST (try {tries})",
                posted["tokens"],
                ms(post_s),
                if right { "correct" } else { "(still wrong)" },
                q.question,
                a["answer"].as_str().unwrap_or(""),
                a["mode"],
                a["adapter"],
                t0.elapsed().as_secs_f64()
            );
            break;
        }
    }
    c.delete(format!("{base}/documents/{id}")).send().await?;
    running.shutdown().await;
    Ok(())
}

fn main() -> Result<()> {
    let runs = env_usize("BENCH_RUNS", 5).max(1);
    let max_tokens = env_usize("BENCH_MAX_TOKENS", 32);
    let path = lift_serve::fetch::resolve_model(None)?;
    let mut model = Model::load_with(&path, &Device::Cpu, &lift_serve::runtime::RuntimeConfig::from_env()?)?;
    lift_serve::base::install_from_arg(&mut model, Some(concat!(env!("CARGO_MANIFEST_DIR"), "/base")))?;
    let dir = data::fetch_essays(&data::data_dir())?;
    let all = data::load_essays(&dir)?;
    let essays = lift_serve::corpus::essays_in(&all, lift_serve::corpus::Split::Eval);
    println!("threads: {}  runs: {runs}  answer: {max_tokens} tokens", rayon::current_num_threads());
    costs(&model, &essays, &all, runs, max_tokens)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(first_answer(path, &essays, &model))
}
