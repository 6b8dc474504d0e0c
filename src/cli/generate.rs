//! `generate`: one chat message to the base model (its prepared base included), streamed to
//! stdout.

use super::{print_piece, ModelArgs};
use anyhow::Result;
use candle_core::Device;
use lift_serve::model::generate::{generate, SamplingParams};
use lift_serve::model::{ChatMessage, KvCache, NoHooks};
use lift_serve::runtime::RuntimeConfig;

#[derive(clap::Args)]
pub(crate) struct GenerateArgs {
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

impl GenerateArgs {
    /// `generate`: one chat message to the base model, streamed to stdout.
    pub(crate) fn run(&self, device: &Device, runtime: &RuntimeConfig) -> Result<()> {
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
            top_logprobs: 0,
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
