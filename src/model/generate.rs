//! Token generation: chunked prefill, sampling (greedy, temperature, top-p, seed), stop strings,
//! EOS, and streaming of decoded text through a callback.

use super::hooks::{Adapter, ForwardHooks};
use super::{KvCache, SeqInput};
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
    /// The most likely alternatives recorded beside each generated token (OpenAI's
    /// `top_logprobs`; 0: none). Recording never changes what is picked.
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { max_tokens: 256, temperature: 0.0, top_p: 1.0, seed: 0, stop: Vec::new(), top_logprobs: 0 }
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

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    /// Each generated token's log-probability under the model (natural log, the softmax of the
    /// raw logits whatever the sampling temperature): the one confidence signal answers are
    /// compared by.
    pub logprobs: Vec<f32>,
    /// With `SamplingParams::top_logprobs` > 0: each generated token's most likely
    /// alternatives, (id, log-probability), most likely first.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub prompt_tokens: usize,
    pub finish_reason: FinishReason,
    pub prompt_ms: f64,
    pub generate_ms: f64,
}

impl Generation {
    pub fn tokens_per_second(&self) -> f64 {
        if self.generate_ms > 0.0 { self.tokens.len() as f64 / (self.generate_ms / 1000.0) } else { 0.0 }
    }

    /// The generated tokens' ids and log-probabilities, moved out (spelled only when a client
    /// asks for them: [`TokenScores::spell`]).
    pub fn take_scores(&mut self) -> TokenScores {
        TokenScores {
            ids: self.tokens.clone(),
            logprobs: std::mem::take(&mut self.logprobs),
            top: std::mem::take(&mut self.top_logprobs),
        }
    }

    /// The mean log-probability of the generated tokens (None when nothing was generated).
    pub fn mean_logprob(&self) -> Option<f64> {
        mean_logprob(&self.logprobs)
    }
}

/// The mean of `logprobs` (None when empty): a generation's one confidence signal.
pub fn mean_logprob(logprobs: &[f32]) -> Option<f64> {
    (!logprobs.is_empty()).then(|| logprobs.iter().map(|&x| f64::from(x)).sum::<f64>() / logprobs.len() as f64)
}

/// A generation's tokens with their log-probabilities and recorded alternatives.
#[derive(Clone, Debug, Default)]
pub struct TokenScores {
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub top: Vec<Vec<(u32, f32)>>,
}

impl TokenScores {
    /// The mean log-probability of the tokens (None without any).
    pub fn mean_logprob(&self) -> Option<f64> {
        mean_logprob(&self.logprobs)
    }

    /// Each token with its log-probability and alternatives, spelled out (OpenAI's
    /// `logprobs.content`).
    pub fn spell(&self, tokenizer: &super::tokenizer::TextTokenizer) -> Vec<GeneratedToken> {
        let spell = |id: u32, logprob: f32| {
            let bytes = tokenizer.token_bytes(id);
            TokenLogprob { token: String::from_utf8_lossy(&bytes).into_owned(), bytes, logprob }
        };
        self.ids
            .iter()
            .zip(&self.logprobs)
            .enumerate()
            .map(|(i, (&id, &lp))| GeneratedToken {
                token: spell(id, lp),
                top_logprobs: self.top.get(i).map_or_else(Vec::new, |top| top.iter().map(|&(t, l)| spell(t, l)).collect()),
            })
            .collect()
    }
}

/// A token, its bytes and its log-probability (OpenAI's shape: `token` is the bytes' text, with
/// U+FFFD where a token holds part of a character).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// A generated token and the most likely alternatives at its step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GeneratedToken {
    #[serde(flatten)]
    pub token: TokenLogprob,
    pub top_logprobs: Vec<TokenLogprob>,
}

/// The log-probability of token `id` under the softmax of `logits` (computed stably, in f64 for
/// the sum over the vocabulary).
pub fn log_prob(logits: &[f32], id: u32) -> f32 {
    match log_normalizer(logits) {
        Some(z) => (f64::from(logits[id as usize]) - z) as f32,
        None => f32::NEG_INFINITY,
    }
}

/// The `k` most likely tokens under the softmax of `logits`, (id, log-probability), most likely
/// first (ties by lower id, so the list is deterministic).
pub fn top_log_probs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let Some(z) = log_normalizer(logits) else { return Vec::new() };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let k = k.min(ids.len());
    if k > 0 && k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
    }
    ids.truncate(k);
    ids.sort_by(order);
    ids.into_iter().map(|id| (id, (f64::from(logits[id as usize]) - z) as f32)).collect()
}

/// log Σ exp(logits) (computed stably, in f64 for the sum over the vocabulary); None when no
/// logit is finite.
fn log_normalizer(logits: &[f32]) -> Option<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return None;
    }
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    Some(f64::from(max) + sum.ln())
}

/// Prompt tokens processed per forward pass: bounds the attention score matrix of long prompts,
/// and how long a batch of decoding sequences waits for a newcomer's prompt step (chunked
/// prefill). One size for alone and batched, so a prompt is cut the same way in both.
pub const PREFILL_CHUNK: usize = 256;

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
    // The maximum in 16 lanes (vectorises; a running index is a serial chain through the whole
    // vocabulary, 16 rows of 49,152 a batch step), then its first position. NaNs are skipped
    // as the plain loop skips them, except a NaN first element, which that loop never left.
    const LANES: usize = 16;
    if xs.first().is_none_or(|x| x.is_nan()) {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let mut max = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    for c in chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = if x > *l { x } else { *l };
        }
    }
    for l in lanes {
        max = if l > max { l } else { max };
    }
    xs.iter().position(|&x| x == max).unwrap_or(0) as u32
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
    check_window(model, cache.len() + ids.len())?;
    let mut last = None;
    for chunk in ids.chunks(PREFILL_CHUNK) {
        let input = SeqInput { ids: chunk, cache: &mut *cache, adapter, adapter_key: 0, hooks: &mut *hooks };
        last = Some(model.decoder.forward_batch(&mut [input])?);
    }
    Ok(last.expect("at least one chunk").squeeze(0)?)
}

fn check_window(model: &Model, tokens: usize) -> Result<()> {
    let window = model.config().max_position_embeddings;
    if tokens > window {
        return Err(ContextLengthExceeded { prompt: tokens, window }.into());
    }
    Ok(())
}

/// Generates a continuation of `prompt` (token ids, after what `cache` already holds).
/// `on_text` receives each newly decoded piece of text (stop strings never leak into it) and
/// returns `false` to cancel. A [`Sequence`] run alone: the same steps as in a batch.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    cache: &mut KvCache,
    adapter: Option<&dyn Adapter>,
    hooks: &mut dyn ForwardHooks,
    params: &SamplingParams,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation> {
    let held = std::mem::replace(cache, KvCache::new(0));
    let seq = Sequence::new(model, prompt.to_vec(), held, params.clone(), hooks)?;
    let (generation, held, _) = run_alone(model, seq, adapter, on_text)?;
    *cache = held;
    Ok(generation)
}

/// Runs `seq` to its end on its own (a batch of one).
pub fn run_alone<'m, H: ForwardHooks>(
    model: &'m Model,
    mut seq: Sequence<'m, H>,
    adapter: Option<&dyn Adapter>,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<(Generation, KvCache, H)> {
    while !seq.is_finished() {
        let logits = model.decoder.forward_batch(&mut [seq.input(adapter, 0)])?;
        seq.advance(&logits, 0, on_text)?;
    }
    Ok(seq.into_parts())
}

/// One generation in progress: the prompt still to feed (in chunks of [`PREFILL_CHUNK`]), its
/// KV cache, its hooks, and the decoding state (sampler, EOS, stop strings, streamed text).
/// [`generate`] runs one alone; the engine's batcher runs many side by side through
/// `Decoder::forward_batch`, so the same code picks every token either way.
pub struct Sequence<'m, H> {
    pub cache: KvCache,
    pub hooks: H,
    prompt: Vec<u32>,
    /// Prompt tokens already in the cache.
    fed: usize,
    /// The token sampled last, to feed next.
    next: Option<u32>,
    params: SamplingParams,
    sampler: Sampler,
    eos: Vec<u32>,
    window: usize,
    stream: super::tokenizer::DecodeStream<'m>,
    text: String,
    emitted: usize,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    finish: Option<FinishReason>,
    started: Instant,
    prompt_ms: f64,
    decode_started: Option<Instant>,
}

impl<'m, H: ForwardHooks> Sequence<'m, H> {
    /// A generation of `prompt` after what `cache` holds; refused when the prompt does not fit
    /// the model's window.
    pub fn new(model: &'m Model, prompt: Vec<u32>, cache: KvCache, params: SamplingParams, hooks: H) -> Result<Self> {
        anyhow::ensure!(!prompt.is_empty(), "empty prompt");
        check_window(model, cache.len() + prompt.len())?;
        Ok(Self {
            cache,
            hooks,
            prompt,
            fed: 0,
            next: None,
            sampler: Sampler::new(&params),
            params,
            eos: model.tokenizer.eos_token_ids().to_vec(),
            window: model.config().max_position_embeddings,
            stream: model.tokenizer.decode_stream(),
            text: String::new(),
            emitted: 0,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            finish: None,
            started: Instant::now(),
            prompt_ms: 0.0,
            decode_started: None,
        })
    }

    pub fn is_finished(&self) -> bool {
        self.finish.is_some()
    }

    /// Still feeding its prompt.
    pub fn in_prefill(&self) -> bool {
        self.fed < self.prompt.len()
    }

    /// Tokens its cache holds at the end at most (what is there, the prompt, the answer).
    pub fn cache_tokens(&self) -> usize {
        (self.cache.len() + self.prompt_left() + self.params.max_tokens.saturating_sub(self.tokens.len())).min(self.window)
    }

    /// Prompt tokens still to feed.
    pub fn prompt_left(&self) -> usize {
        self.prompt.len() - self.fed
    }

    /// The tokens its next step feeds: the next prompt chunk, or the token sampled last.
    pub fn pending(&self) -> &[u32] {
        pending_ids(&self.prompt, self.fed, &self.next, self.is_finished())
    }

    /// Its part of the next forward step, with `adapter` active (`key`: see `SeqInput`).
    pub fn input<'s>(&'s mut self, adapter: Option<&'s dyn Adapter>, key: usize) -> SeqInput<'s> {
        let finished = self.is_finished();
        let ids = pending_ids(&self.prompt, self.fed, &self.next, finished);
        SeqInput { ids, cache: &mut self.cache, adapter, adapter_key: key, hooks: &mut self.hooks }
    }

    /// Takes row `row` of a step's logits (`[n, vocab]`) after `pending()` went through the
    /// model: a prompt chunk moves on; after the prompt, the next token is picked, streamed
    /// through `on_text` and checked against EOS, stop strings and the limits.
    pub fn advance(&mut self, logits: &Tensor, row: usize, on_text: &mut dyn FnMut(&str) -> bool) -> Result<()> {
        if self.is_finished() {
            return Ok(());
        }
        if self.in_prefill() {
            self.fed = (self.fed + PREFILL_CHUNK).min(self.prompt.len());
            if self.in_prefill() {
                return Ok(());
            }
            self.prompt_ms = self.started.elapsed().as_secs_f64() * 1e3;
            self.decode_started = Some(Instant::now());
        }
        if self.tokens.len() >= self.params.max_tokens || self.cache.len() >= self.window {
            return self.end(FinishReason::Length, on_text);
        }
        let row = logits.get(row)?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
        let next = self.sampler.sample(&row);
        if self.eos.contains(&next) {
            return self.end(FinishReason::Stop, on_text);
        }
        self.tokens.push(next);
        self.logprobs.push(log_prob(&row, next));
        if self.params.top_logprobs > 0 {
            self.top_logprobs.push(top_log_probs(&row, self.params.top_logprobs));
        }
        self.next = Some(next);
        if let Some(piece) = self.stream.push(next)? {
            self.text.push_str(&piece);
            if let Some(cut) = find_stop(&self.text, &self.params.stop) {
                self.text.truncate(cut);
                if cut > self.emitted && !on_text(&self.text[self.emitted..cut]) {
                    self.finish = Some(FinishReason::Cancelled);
                    return Ok(());
                }
                self.emitted = cut;
                return self.end(FinishReason::Stop, on_text);
            }
            let safe = self.text.len() - held_back(&self.text, &self.params.stop);
            if safe > self.emitted {
                if !on_text(&self.text[self.emitted..safe]) {
                    self.finish = Some(FinishReason::Cancelled);
                    return Ok(());
                }
                self.emitted = safe;
            }
        }
        if self.tokens.len() >= self.params.max_tokens {
            return self.end(FinishReason::Length, on_text);
        }
        Ok(())
    }

    /// Stops it (the client went away): nothing more is streamed.
    pub fn cancel(&mut self) {
        if self.finish.is_none() {
            self.finish = Some(FinishReason::Cancelled);
        }
    }

    /// Finishes with `reason`, streaming the text held back for stop strings.
    fn end(&mut self, reason: FinishReason, on_text: &mut dyn FnMut(&str) -> bool) -> Result<()> {
        self.finish = Some(reason);
        if self.text.len() > self.emitted {
            on_text(&self.text[self.emitted..]);
            self.emitted = self.text.len();
        }
        Ok(())
    }

    /// The generation (its figures so far when not finished), the cache and the hooks.
    pub fn into_parts(self) -> (Generation, KvCache, H) {
        let generate_ms = self.decode_started.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
        let generation = Generation {
            text: self.text,
            tokens: self.tokens,
            logprobs: self.logprobs,
            top_logprobs: self.top_logprobs,
            prompt_tokens: self.prompt.len(),
            finish_reason: self.finish.unwrap_or(FinishReason::Cancelled),
            prompt_ms: self.prompt_ms,
            generate_ms,
        };
        (generation, self.cache, self.hooks)
    }
}

/// What a sequence feeds next: the prompt chunk from `fed` (at most `PREFILL_CHUNK`), else the
/// token sampled last; nothing once finished.
fn pending_ids<'a>(prompt: &'a [u32], fed: usize, next: &'a Option<u32>, finished: bool) -> &'a [u32] {
    if finished {
        &[]
    } else if fed < prompt.len() {
        &prompt[fed..(fed + PREFILL_CHUNK).min(prompt.len())]
    } else {
        next.as_ref().map_or(&[], std::slice::from_ref)
    }
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
    fn log_prob_is_the_log_softmax() {
        let logits = [2.0f32, -1.0, 0.5, 2.0, 30.0, -50.0];
        let total: f64 = (0..logits.len() as u32).map(|i| f64::from(log_prob(&logits, i)).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        let direct = |i: usize| {
            let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
            (f64::from(logits[i]).exp() / z).ln()
        };
        for i in 0..logits.len() {
            assert!((f64::from(log_prob(&logits, i as u32)) - direct(i)).abs() < 1e-4, "{i}");
        }
        assert!((log_prob(&[0.0; 8], 3) + 8f32.ln()).abs() < 1e-6, "uniform");
        assert_eq!(log_prob(&[f32::NEG_INFINITY; 4], 0), f32::NEG_INFINITY);
    }

    #[test]
    fn top_log_probs_are_the_most_likely_in_order_with_their_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let top = top_log_probs(&logits, 3);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 2], "ties by lower id");
        for (id, lp) in &top {
            assert!((lp - log_prob(&logits, *id)).abs() < 1e-6, "{id}");
        }
        assert_eq!(top_log_probs(&logits, 9).len(), logits.len(), "k past the vocabulary");
        assert!(top_log_probs(&logits, 0).is_empty());
        assert!(top_log_probs(&[f32::NEG_INFINITY; 3], 2).is_empty());
    }

    /// The vectorised argmax against the plain first-maximum loop: ties (the first wins),
    /// NaNs, infinities, lengths around the 16-lane blocks.
    #[test]
    fn argmax_is_the_first_maximum() {
        fn plain(xs: &[f32]) -> u32 {
            let mut best = 0;
            for (i, &x) in xs.iter().enumerate() {
                if x > xs[best] {
                    best = i;
                }
            }
            best as u32
        }
        let mut seed = 9u64;
        for len in [1, 2, 15, 16, 17, 33, 100, 49_152] {
            for case in 0..6 {
                let mut xs: Vec<f32> = (0..len)
                    .map(|_| {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        ((seed >> 40) % 50) as f32 // few distinct values: many ties
                    })
                    .collect();
                match case {
                    1 => xs[len / 2] = f32::NAN,
                    2 => xs[0] = f32::NAN,
                    3 => xs[len - 1] = f32::INFINITY,
                    4 => xs.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                    5 => xs.iter_mut().for_each(|x| *x = -*x),
                    _ => {}
                }
                assert_eq!(argmax(&xs), plain(&xs), "length {len}, case {case}");
            }
        }
    }

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
