//! Token generation: chunked prefill, sampling (greedy, temperature, top-p, seed), stop strings,
//! EOS, and streaming of decoded text through a callback.

use super::hooks::{Adapter, ForwardHooks};
use super::llama::{KvCache, Logits};
use super::Model;
use anyhow::Result;
use candle_core::Tensor;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::time::Instant;

/// A request's generation settings, as the APIs carry them (`temperature` 0: greedy).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    pub max_tokens: usize,
    /// 0 (or less) means greedy; see [`SamplingParams::sampling`].
    pub temperature: f64,
    pub top_p: f64,
    pub seed: u64,
    pub stop: Vec<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { max_tokens: 256, temperature: 0.0, top_p: 1.0, seed: 0, stop: Vec::new() }
    }
}

/// How the next token is picked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token.
    Greedy,
    /// From the softmax at `temperature`, restricted to the smallest set of tokens whose
    /// probability reaches `top_p` (1: all).
    Sample { temperature: f64, top_p: f64 },
}

impl SamplingParams {
    pub fn sampling(&self) -> Sampling {
        if self.temperature <= 0.0 {
            Sampling::Greedy
        } else {
            Sampling::Sample { temperature: self.temperature, top_p: self.top_p }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The callback asked to stop (client went away).
    Cancelled,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub finish_reason: FinishReason,
    pub prompt_ms: f64,
    pub generate_ms: f64,
}

impl Generation {
    pub fn tokens_per_second(&self) -> f64 {
        if self.generate_ms > 0.0 { self.tokens.len() as f64 / (self.generate_ms / 1000.0) } else { 0.0 }
    }
}

/// Prompt tokens processed per forward pass: bounds the attention score matrix of long prompts.
pub const PREFILL_CHUNK: usize = 512;

/// Picks the next token from a logits vector.
pub struct Sampler {
    rng: StdRng,
    sampling: Sampling,
}

impl Sampler {
    pub fn new(params: &SamplingParams) -> Self {
        Self { rng: StdRng::seed_from_u64(params.seed), sampling: params.sampling() }
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        match self.sampling {
            Sampling::Greedy => argmax(logits),
            Sampling::Sample { temperature, top_p } => self.draw(logits, temperature, top_p),
        }
    }

    fn draw(&mut self, logits: &[f32], temperature: f64, top_p: f64) -> u32 {
        let t = temperature as f32;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f32)> =
            logits.iter().enumerate().map(|(i, &l)| (i as u32, ((l - max) / t).exp())).collect();
        let sum: f32 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= sum);
        if top_p < 1.0 {
            probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p.1;
                if acc as f64 >= top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep.max(1));
        }
        let total: f32 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for (id, p) in &probs {
            r -= p;
            if r <= 0.0 {
                return *id;
            }
        }
        probs.last().map(|p| p.0).unwrap_or(0)
    }
}

pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// A prompt longer than the model's window, refused before any forward pass (a prompt past the
/// window would otherwise run its whole prefill before failing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextLengthExceeded {
    pub prompt: usize,
    pub window: usize,
}

impl std::fmt::Display for ContextLengthExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the prompt has {} tokens; the model's window is {}", self.prompt, self.window)
    }
}

impl std::error::Error for ContextLengthExceeded {}

/// Runs `ids` through the model in chunks, extending `cache`; returns the last position's logits.
pub fn prefill(
    model: &Model,
    ids: &[u32],
    cache: &mut KvCache,
    adapter: Option<&dyn Adapter>,
    hooks: &mut dyn ForwardHooks,
) -> Result<Tensor> {
    anyhow::ensure!(!ids.is_empty(), "empty prompt");
    let window = model.config().max_position_embeddings;
    if cache.len() + ids.len() > window {
        return Err(ContextLengthExceeded { prompt: cache.len() + ids.len(), window }.into());
    }
    let dev = model.device();
    let mut last = None;
    for chunk in ids.chunks(PREFILL_CHUNK) {
        let input = Tensor::new(chunk, dev)?.unsqueeze(0)?;
        last = Some(model.decoder.forward(&input, cache, adapter, hooks, Logits::Last)?);
    }
    Ok(last.expect("at least one chunk").squeeze(0)?)
}

/// Generates a continuation of `prompt` (token ids, after what `cache` already holds).
/// `on_text` receives each newly decoded piece of text (stop strings never leak into it) and
/// returns `false` to cancel.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    cache: &mut KvCache,
    adapter: Option<&dyn Adapter>,
    hooks: &mut dyn ForwardHooks,
    params: &SamplingParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation> {
    let dev = model.device().clone();
    let max_pos = model.config().max_position_embeddings;
    let t0 = Instant::now();
    let mut logits = prefill(model, prompt, cache, adapter, hooks)?;
    let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;

    let t1 = Instant::now();
    let mut sampler = Sampler::new(params);
    let eos = model.tokenizer.eos_token_ids().to_vec();
    let mut stream = model.tokenizer.decode_stream();
    let mut text = String::new();
    let mut emitted = 0usize;
    let mut tokens = Vec::new();
    let mut finish = FinishReason::Length;
    while tokens.len() < params.max_tokens && cache.len() < max_pos {
        let next = sampler.sample(&logits.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?);
        if eos.contains(&next) {
            finish = FinishReason::Stop;
            break;
        }
        tokens.push(next);
        if let Some(piece) = stream.push(next)? {
            text.push_str(&piece);
            if let Some(cut) = find_stop(&text, &params.stop) {
                text.truncate(cut);
                if cut > emitted && !on_text(&text[emitted..cut]) {
                    finish = FinishReason::Cancelled;
                    break;
                }
                emitted = cut;
                finish = FinishReason::Stop;
                break;
            }
            let safe = text.len() - held_back(&text, &params.stop);
            if safe > emitted {
                if !on_text(&text[emitted..safe]) {
                    finish = FinishReason::Cancelled;
                    break;
                }
                emitted = safe;
            }
        }
        if tokens.len() >= params.max_tokens {
            break;
        }
        let input = Tensor::new(&[next], &dev)?.unsqueeze(0)?;
        logits = model.decoder.forward(&input, cache, adapter, hooks, Logits::Last)?.squeeze(0)?;
    }
    if finish != FinishReason::Cancelled && text.len() > emitted {
        on_text(&text[emitted..]);
    }
    Ok(Generation {
        text,
        tokens,
        prompt_tokens: prompt.len(),
        finish_reason: finish,
        prompt_ms,
        generate_ms: t1.elapsed().as_secs_f64() * 1e3,
    })
}

/// Byte offset where the earliest stop string starts, if any occurs.
fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter(|s| !s.is_empty()).filter_map(|s| text.find(s.as_str())).min()
}

/// Length of the longest tail of `text` that could still grow into a stop string.
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for s in stops {
        for (i, _) in s.char_indices().skip(1) {
            if text.ends_with(&s[..i]) {
                hold = hold.max(i);
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_found_and_held_back() {
        let stops = vec!["\nQuestion:".to_string(), "END".to_string()];
        assert_eq!(find_stop("abc END x", &stops), Some(4));
        assert_eq!(find_stop("abc", &stops), None);
        assert_eq!(held_back("answer\nQues", &stops), 5);
        assert_eq!(held_back("answer E", &stops), 1);
        assert_eq!(held_back("answer", &stops), 0);
    }

    #[test]
    fn sampler_greedy_and_seeded() {
        let logits = vec![0.1, 2.0, 0.3, 1.9];
        let mut g = Sampler::new(&SamplingParams::default());
        assert_eq!(g.sample(&logits), 1);
        let p = SamplingParams { temperature: 1.0, seed: 7, ..Default::default() };
        let a: Vec<u32> = { let mut s = Sampler::new(&p); (0..20).map(|_| s.sample(&logits)).collect() };
        let b: Vec<u32> = { let mut s = Sampler::new(&p); (0..20).map(|_| s.sample(&logits)).collect() };
        assert_eq!(a, b);
        assert!(a.iter().any(|&x| x != a[0]), "temperature 1 should not always pick one token");
        // top_p small keeps only the most likely token.
        let p = SamplingParams { temperature: 1.0, top_p: 0.01, seed: 3, ..Default::default() };
        let mut s = Sampler::new(&p);
        assert!((0..20).all(|_| s.sample(&logits) == 1));
    }
}
