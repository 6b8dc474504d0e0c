//! Collections at scale: what a question asked of a collection of 10, 100 and 1,000 documents
//! costs before generation, what its index holds, and whether it is routed to the right document.
//!
//! Documents of ~1K tokens are cut from the essays (a slice each; texts repeat across documents),
//! each with three planted facts about its own people ("Ilse Marwood's locker code is 4417."),
//! every document's facts on the same three templates with other people and values, so that only
//! the facts tell documents apart. Nothing is absorbed: the documents are posted to an in-process
//! service with training held (queued documents are read by the index as absorbed ones are: their
//! text and token ids), so 1,000 documents cost 1,000 tokenizations, not 1,000 absorbs.
//!
//! Per size (`rag`; the collection is the first n documents):
//! - the whole `/ask` before generation (`Service::ask_collection` up to the answer's queueing,
//!   generation held: the collection's record, the documents' views, the index brought in line,
//!   the BM25 ranking, routing, the prompt): cold, a new collection's first question, which builds
//!   its index; the first question after the index was built (`collection_index_figures`); warm,
//!   median and p90 over the questions × rounds;
//! - the index's build alone, its documents, passages and bytes;
//! - routing accuracy: the best passage is in the document holding the asked fact (warm questions),
//!   also split by whether the planted sentence lies whole in one of its document's passages, and
//!   against two other rules on the same questions (the best single passage's document; the
//!   document with the largest sum of its passages' scores);
//! - at 10 and 100, the same questions over real HTTP (`POST /ask`, `max_tokens` 1: this one
//!   includes the context's prefill and one generated token).
//!
//!   LIFT_MODELS_DIR=models cargo bench --bench collections
//!
//! Environment: BENCH_BACKEND (files; pg: a replica that only answers, on a throwaway
//! PostgreSQL, the documents queued there), BENCH_SIZES (10,100,1000), BENCH_QUESTIONS (60 per size), BENCH_ROUNDS (3),
//! BENCH_COLD (3 fresh collections per size), BENCH_HTTP_MAX (100: the largest size asked over HTTP),
//! BENCH_SEED (0: which essay slices, people and values the documents get; 0 is the draw the
//! figures before it were made on — tune on one seed, report on others), BENCH_DEBUG (1: print
//! each misrouted question with its planted sentence and the top units of the ranking).

#[path = "common/stats.rs"]
mod stats;
use anyhow::{bail, Context, Result};
use candle_core::Device;
use lift_serve::corpus as data;
use lift_serve::formats::Source;
use lift_serve::lift::answer::Mode;
use lift_serve::model::generate::SamplingParams;
use lift_serve::server::{self, AppState, ServeConfig};
use lift_serve::service::{NewDocument, Question, Submitted};
use serde_json::{json, Value};
use stats::percentile;
use std::time::{Duration, Instant};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

fn ms(s: f64) -> String {
    format!("{:.2} ms", s * 1000.0)
}

const FIRST: [&str; 30] = [
    "Ilse", "Tobias", "Ingrid", "Oswin", "Priya", "Lucian", "Marisol", "Anselm", "Dagny", "Ferran", "Mirela",
    "Casimir", "Elodie", "Gideon", "Halvard", "Isolde", "Jorun", "Kasimir", "Leontine", "Matthias", "Nerys", "Octavia",
    "Piet", "Quirin", "Rosalind", "Sander", "Thea", "Ulrike", "Valentin", "Wendeline",
];
const LAST_HEAD: [&str; 10] = ["Mar", "Ash", "Bell", "Crane", "Dun", "Fair", "Glen", "Hollo", "Kes", "Lind"];
const LAST_TAIL: [&str; 10] = ["wood", "ford", "ridge", "moor", "field", "brook", "stone", "ley", "holt", "wick"];

/// Person `k` (k < 3,000) under `seed`: a first name shared by 100 people, a last name by 30
/// (seed 0: person k is the k-th name; another seed shifts who is who, one name per person still).
fn person(k: usize, seed: usize) -> String {
    let k = (k + seed * 1_237) % 3_000;
    let last = k / FIRST.len();
    format!("{} {}{}", FIRST[k % FIRST.len()], LAST_HEAD[last % 10], LAST_TAIL[(last / 10) % 10])
}

/// The three templates every document plants: (fact, question), `{P}` the person, `{N}` the value.
const TEMPLATES: [(&str, &str); 3] = [
    ("{P}'s locker code is {N}.", "What is {P}'s locker code?"),
    (
        "{P} parks a green bicycle in bay {N} of the station garage.",
        "In which bay of the station garage does {P} park the green bicycle?",
    ),
    (
        "The spare key of {P} hangs on hook number {N} in the hallway.",
        "On which hook in the hallway does the spare key of {P} hang?",
    ),
];

struct Fact {
    document: usize,
    question: String,
    /// The planted sentence.
    sentence: String,
}

/// Document `i`: about 680 words of essay (a slice that starts elsewhere for each document) with
/// its three facts at 20%, 50% and 80%.
/// `seed` moves the slices, the people and the values (seed 0: the draw before seeds existed).
fn document(i: usize, seed: usize, words: &[&str], facts: &mut Vec<Fact>) -> String {
    const WORDS: usize = 680;
    let start = (i * 7919 + seed * 104_729) % (words.len() - WORDS);
    let mut out: Vec<String> = words[start..start + WORDS].iter().map(|w| w.to_string()).collect();
    for (t, (fact, question)) in TEMPLATES.iter().enumerate().rev() {
        let p = person(3 * i + t, seed);
        let value = 1000 + (i * 7_331 + t * 2_719 + seed * 4_421) % 9000;
        let at = WORDS * [1, 5, 8][t] / 10;
        let sentence = fact.replace("{P}", &p).replace("{N}", &value.to_string());
        out.insert(at, sentence.clone());
        facts.push(Fact { document: i, question: question.replace("{P}", &p), sentence });
    }
    out.join(" ")
}

fn question(collection: &str, text: &str) -> Question {
    Question {
        document_id: collection.to_string(),
        question: text.to_string(),
        history: Vec::new(),
        mode: Mode::Rag,
        context: None,
        context_tokens: None,
    }
}

/// One question through the service up to its answer's queueing: (seconds, best passage's document).
async fn ask(state: &AppState, collection: &str, text: &str) -> Result<(f64, String)> {
    let params = SamplingParams { max_tokens: 1, ..Default::default() };
    let t = Instant::now();
    let (pending, read) = state.service.ask_collection(None, question(collection, text), params, None).await?;
    let s = t.elapsed().as_secs_f64();
    drop(pending);
    Ok((s, read.document_id))
}

async fn run() -> Result<()> {
    let sizes: Vec<usize> = std::env::var("BENCH_SIZES")
        .unwrap_or_else(|_| "10,100,1000".into())
        .split(',')
        .map(|s| s.trim().parse().context("BENCH_SIZES"))
        .collect::<Result<_>>()?;
    let n_max = *sizes.iter().max().context("no sizes")?;
    if n_max > 1000 {
        bail!("at most 1,000 documents (3,000 people)");
    }
    let (n_questions, rounds, colds) =
        (env_usize("BENCH_QUESTIONS", 60), env_usize("BENCH_ROUNDS", 3).max(1), env_usize("BENCH_COLD", 3).max(1));
    let http_max = env_usize("BENCH_HTTP_MAX", 100);
    let (seed, debug) = (env_usize("BENCH_SEED", 0), env_usize("BENCH_DEBUG", 0) > 0);

    let essays = data::load_essays(&data::fetch_essays(&data::data_dir())?)?;
    let all: String = essays.iter().map(|e| e.text.as_str()).collect::<Vec<_>>().join(" ");
    let words: Vec<&str> = all.split_whitespace().collect();

    let tmp = tempfile::tempdir()?;
    let mut cfg = ServeConfig::new(lift_serve::fetch::resolve_model(None)?, tmp.path().join("adapters"));
    cfg.runtime = lift_serve::runtime::RuntimeConfig::from_env()?;
    cfg.train_queue = n_max + 8;
    cfg.generate_queue = 4096;
    cfg.max_collection_documents = n_max.max(1000);
    // BENCH_BACKEND=pg: a replica (role `server`: it trains nothing) on a throwaway PostgreSQL.
    let backend = std::env::var("BENCH_BACKEND").unwrap_or_else(|_| "files".into());
    let pg = match backend.as_str() {
        "files" => None,
        "pg" => {
            let pg = lift_serve::testing::PgCluster::start()?;
            cfg.database_url = Some(pg.url.clone());
            cfg.adapter_store = Some(format!("file://{}", tmp.path().join("store").display()));
            cfg.role = lift_serve::service::postgres::Role::Server;
            cfg.replica_id = Some("bench".into());
            Some(pg)
        }
        other => bail!("BENCH_BACKEND: files or pg, not {other}"),
    };
    let state = tokio::task::block_in_place(|| server::build_state(cfg, &Device::Cpu))?;
    let t = Instant::now();
    while !matches!(state.service.health().await, lift_serve::service::Health::Ok) {
        if t.elapsed() > Duration::from_secs(60) {
            bail!("the database did not come up");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let running = server::start(state.clone()).await?;
    let base = format!("http://{}", running.addr);
    // Nothing is absorbed: the documents stay queued, read by the index from memory.
    let (_hold_training, held) = std::sync::mpsc::channel::<()>();
    state.service.engine.hold_training(held)?;

    let mut facts = Vec::new();
    let mut ids = Vec::new();
    let mut texts = Vec::new();
    let mut tokens = 0usize;
    let t = Instant::now();
    for i in 0..n_max {
        let text = document(i, seed, &words, &mut facts);
        texts.push(text.clone());
        let doc = NewDocument {
            source: Source::as_sent(&text, "application/json"),
            text,
            title: Some(format!("Dossier {i}")),
            options: state.default_options.clone(),
        };
        let view = match state.service.submit(None, doc).await?.0 {
            Submitted::Queued(v) | Submitted::Existing(v) => v,
        };
        tokens += view.tokens;
        ids.push(view.id);
    }
    println!(
        "{backend}; seed {seed}; threads: {}; {n_max} documents posted (training held) in {:.1} s, {:.0} tokens each on average; \
         {n_questions} questions per size × {rounds} rounds, {colds} cold collections",
        rayon::current_num_threads(),
        t.elapsed().as_secs_f64(),
        tokens as f64 / n_max as f64
    );

    let http = reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?;
    let mut rows = Vec::new();
    for &n in &sizes {
        let members = ids[..n].to_vec();
        // The questions: spread over the collection's documents and the three templates.
        let mine: Vec<&Fact> = facts.iter().filter(|f| f.document < n).collect();
        let step = (mine.len() as f64 / n_questions.min(mine.len()) as f64).max(1.0);
        let asked: Vec<&Fact> = (0..n_questions.min(mine.len())).map(|k| mine[(k as f64 * step) as usize]).collect();

        // Generation is held while the service is timed: an answer is queued, never run.
        let (hold_generation, held) = std::sync::mpsc::channel::<()>();
        state.service.engine.hold_generation(held)?;
        let (mut cold, mut build, mut after_build) = (Vec::new(), Vec::new(), Vec::new());
        let mut figures = None;
        for c in 0..colds {
            let q = &asked[c % asked.len()].question;
            let col = state.service.create_collection(None, None, members.clone()).await?;
            cold.push(ask(&state, &col.id, q).await?.0);
            let fresh = state.service.create_collection(None, None, members.clone()).await?;
            let t = Instant::now();
            figures = Some(state.service.collection_index_figures(None, &fresh.id).await?);
            build.push(t.elapsed().as_secs_f64());
            after_build.push(ask(&state, &fresh.id, q).await?.0);
            state.service.delete_collection(None, &col.id).await?;
        }
        let figures = figures.context("no figures")?;
        let col = state.service.create_collection(None, None, members.clone()).await?;
        ask(&state, &col.id, &asked[0].question).await?;
        // The same documents in an index of the bench's own, to score other routing rules on the
        // same questions: the best single passage's document (the rule before windows), and the
        // document with the largest sum of its passages' scores.
        let model = state.service.model();
        let mut alt = lift_serve::collection_index::CollectionIndex::default();
        let mut whole_in_passage = Vec::new();
        for (i, text) in texts[..n].iter().enumerate() {
            let doc = lift_serve::document::Document::encode(model, text.clone())?;
            let passages = lift_serve::service::index_passages(model, &doc)?;
            for f in asked.iter().filter(|f| f.document == i) {
                whole_in_passage.push((f.question.clone(), passages.iter().any(|p| p.2.contains(&f.sentence))));
            }
            alt.add(&ids[i], None, passages);
        }
        let (mut by_passage, mut by_sum) = (0, 0);
        for f in &asked {
            let hits = alt.search(&[(f.question.as_str(), 1.0)]);
            let doc_of = |slot: u32| alt.passage(slot).map(|p| p.document_id.clone()).unwrap_or_default();
            by_passage += usize::from(hits.first().is_some_and(|h| doc_of(h.passage) == ids[f.document]));
            let mut sums: std::collections::BTreeMap<String, f32> = Default::default();
            for h in &hits {
                *sums.entry(doc_of(h.passage)).or_default() += h.score;
            }
            let best = sums.into_iter().max_by(|a, b| a.1.total_cmp(&b.1)).map(|(d, _)| d);
            by_sum += usize::from(best.as_deref() == Some(ids[f.document].as_str()));
            if debug {
                print_miss(&alt, f, &ids[f.document], &ids);
            }
        }
        let (mut warm, mut right, mut total) = (Vec::new(), 0, 0);
        // Misses by whether the planted sentence lies whole in one of its document's passages.
        let (mut whole, mut whole_right) = (0, 0);
        for r in 0..rounds {
            for f in &asked {
                let (s, top) = ask(&state, &col.id, &f.question).await?;
                warm.push(s);
                if r == 0 {
                    total += 1;
                    right += usize::from(top == ids[f.document]);
                    if whole_in_passage.iter().any(|(q, whole)| *whole && q == &f.question) {
                        whole += 1;
                        whole_right += usize::from(top == ids[f.document]);
                    }
                }
            }
        }
        drop(hold_generation);

        let mut http_row = String::from("—");
        if n <= http_max {
            let (mut times, mut http_right) = (Vec::new(), 0);
            for f in &asked {
                let t = Instant::now();
                let a: Value = http
                    .post(format!("{base}/ask"))
                    .json(&json!({"collection_id": col.id, "question": f.question, "mode": "rag", "max_tokens": 1}))
                    .send()
                    .await?
                    .json()
                    .await?;
                times.push(t.elapsed().as_secs_f64());
                let top = a["document_id"].as_str().with_context(|| format!("POST /ask: {a}"))?;
                http_right += usize::from(top == ids[f.document]);
            }
            http_row = format!(
                "{} / {} ({http_right}/{})",
                ms(percentile(&times, 0.5)),
                ms(percentile(&times, 0.9)),
                asked.len()
            );
        }
        let row = format!(
            "| {n} | {} | {} | {} | {} | {} | {} | {} | {:.1} MB ({} B) | {right}/{total} ({:.0}%) | {http_row} |",
            figures.passages,
            ms(percentile(&cold, 0.5)),
            ms(percentile(&build, 0.5)),
            ms(percentile(&after_build, 0.5)),
            ms(percentile(&warm, 0.5)),
            ms(percentile(&warm, 0.9)),
            ms(warm.iter().sum::<f64>() / warm.len() as f64),
            figures.bytes as f64 / 1e6,
            figures.bytes,
            100.0 * right as f64 / total as f64,
        );
        println!("{row}");
        println!(
            "{n} documents: routed right {whole_right}/{whole} where the planted sentence lies whole in one passage, {}/{} where a passage boundary cuts it",
            right - whole_right,
            total - whole
        );
        println!(
            "{n} documents: routing by the best window (shipped) {right}/{total}; by the best single passage {by_passage}/{total}; \
             by the sum of a document's passage scores {by_sum}/{total}"
        );
        rows.push(row);
    }
    println!();
    println!(
        "| documents | passages | cold: first question (builds the index) | index build alone | first question after the build \
         | warm median | warm p90 | warm mean | index memory | routing accuracy | HTTP `/ask` median / p90, max_tokens 1 (routing) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
    // The training hold is never released (1,000 absorbs would start): leave without a shutdown.
    if let Some(pg) = pg {
        pg.stop()?;
    }
    std::process::exit(0)
}

/// BENCH_DEBUG: a question the ranking routes to another document, with its planted sentence,
/// the passages of the right document that hold parts of it, and the top five ranked passages.
fn print_miss(index: &lift_serve::collection_index::CollectionIndex, f: &Fact, right: &str, ids: &[String]) {
    let ranked = index.rank(&[(f.question.as_str(), 1.0)]);
    let doc_of = |slot: u32| index.passage(slot).map(|p| p.document_id.clone()).unwrap_or_default();
    if ranked.first().is_some_and(|h| doc_of(h.passage) == right) {
        return;
    }
    let number = |id: &str| ids.iter().position(|d| d == id).unwrap_or(usize::MAX);
    let flat = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
    println!("MISS doc {}: {}\n  planted: {}", f.document, f.question, f.sentence);
    if let Some(rank) = ranked.iter().position(|h| doc_of(h.passage) == right) {
        let h = ranked[rank];
        println!("  right doc first at rank {rank}, slot {} score {:.3}: {}", h.passage, h.score, flat(&index.passage(h.passage).unwrap().text));
    }
    for h in ranked.iter().take(5) {
        let p = index.passage(h.passage).unwrap();
        println!("  top: doc {} slot {} score {:.3}: {}", number(&p.document_id), h.passage, h.score, flat(&p.text));
    }
}

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(run())
}
