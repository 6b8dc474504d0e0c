//! Model-written pairs: the LIFT paper's App. A.3 prompt over windows of consecutive sentences
//! spread evenly over the document, one per `sentences_per_pair` sentences. The reply is
//! scaffolded: the model writes each field after its label and the next label is appended for it
//! (a 135M model otherwise rarely writes an evidence line). Failures are retried (greedy first,
//! then seeded sampling); once several windows gave (almost) nothing valid the model is no longer
//! asked.

use super::evidence::{validate_model_output, Verdict};
use super::words::normalize_question;
use super::{QaOptions, QaPair, QaProgress, QaStats};
use crate::lift::absorb::text::{split_sentences, Span};
use crate::lift::absorb::cancelled::Cancelled;
use crate::model::generate::{generate, prefill, FinishReason, SamplingParams};
use crate::model::{ChatMessage, KvCache, Model, NoHooks};
use anyhow::Result;
use std::collections::HashSet;
use std::time::Instant;

/// Sampling temperature / top-p of the retries (the first attempt is greedy).
const RETRY_TEMPERATURE: f64 = 0.5;
const RETRY_TOP_P: f64 = 0.9;
/// Stop asking the model once at least this many windows were tried and fewer than one in ten
/// gave a valid pair (a small model can cost minutes per window on a CPU for nothing).
const GIVE_UP_AFTER_WINDOWS: usize = 3;

/// The paper's App. A.3 instruction (the Narrativeqa variant, which asks for names and dates).
pub fn qa_prompt(context: &str) -> String {
    format!(
        "You are given a piece of text as the context. You should generate ONLY one question and the corresponding \
         answer according to the context. You should also select one or more sentences directly from the original \
         context as the evidence. The evidences must be EXACTLY SAME ADJACENT sentences retrieved from the context; \
         KEEP the special tokens in the sentences. Please answer in the following format:\n\
         Question: [question]\n\nAnswer: [answer]\n\nEvidence: [evidence]\n\n\
         Please DON'T output quotes when outputting evidences. The question should focus on the details like names, \
         dates, e.t.c. The following is the piece of text: {context}"
    )
}

/// Sentence windows `[s0, s1)` for `count` pairs, centred on evenly spaced chunks of the document.
fn spread_windows(n: usize, window: usize, count: usize) -> Vec<(usize, usize)> {
    let window = window.max(1);
    if n == 0 || count == 0 {
        return Vec::new();
    }
    if n <= window {
        return vec![(0, n); count];
    }
    (0..count)
        .map(|i| {
            let centre = (i as f64 + 0.5) * n as f64 / count as f64;
            let s0 = (centre - window as f64 / 2.0).round().max(0.0) as usize;
            let s0 = s0.min(n - window);
            (s0, s0 + window)
        })
        .collect()
}

fn mix_seed(seed: u64, a: u64, b: u64) -> u64 {
    let mut x = seed ^ a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x
}

/// The first sentence of `text` when more follows it.
fn first_sentence(text: &str) -> Option<String> {
    let spans = split_sentences(text);
    (spans.len() > 1).then(|| spans[0].text(text).to_string())
}

/// What all windows of one document share.
pub(super) struct Run<'a> {
    pub(super) model: &'a Model,
    pub(super) doc: &'a str,
    pub(super) opts: &'a QaOptions,
    /// Polled between and during generations.
    pub(super) cancel: &'a dyn Fn() -> bool,
}

/// Asks the model for one pair per window, windows spread over the whole document (none unless
/// `use_model`); fills the model's part of `stats` and reports progress as windows finish.
pub(super) fn model_pairs(
    run: &Run,
    sentences: &[Span],
    progress: &mut dyn FnMut(&QaProgress),
    stats: &mut QaStats,
) -> Result<Vec<QaPair>> {
    let opts = run.opts;
    let target = if opts.use_model && !sentences.is_empty() {
        sentences.len().div_ceil(opts.sentences_per_pair.max(1)).min(opts.max_pairs.max(1))
    } else {
        0
    };
    let windows = spread_windows(sentences.len(), opts.window_sentences, target);
    stats.windows = windows.len();
    let mut accepted = Accepted::default();
    let mut prog = QaProgress { done: 0, total: windows.len(), valid: 0 };
    progress(&prog);
    let t0 = Instant::now();
    let mut seen_windows: HashSet<(usize, usize)> = HashSet::new();
    for (wi, &(s0, s1)) in windows.iter().enumerate() {
        run.check_cancel()?;
        if stats.model_gave_up {
            break;
        }
        let window = Window {
            span: (sentences[s0].start, sentences[s1 - 1].end),
            index: wi,
            repeated: !seen_windows.insert((s0, s1)),
        };
        if generate_for_window(run, &window, stats, &mut accepted)? {
            stats.model_valid += 1;
        }
        prog.done = wi + 1;
        prog.valid = stats.model_valid;
        progress(&prog);
        let tried = wi + 1;
        if tried >= GIVE_UP_AFTER_WINDOWS && stats.model_valid * 10 < tried && tried < windows.len() {
            tracing::warn!(
                windows = tried,
                valid = stats.model_valid,
                "the model rarely produces valid QA pairs; the extractive generator fills in"
            );
            stats.model_gave_up = true;
        }
    }
    if prog.done < prog.total {
        prog.done = prog.total;
        progress(&prog);
    }
    stats.model_seconds = t0.elapsed().as_secs_f64();
    Ok(accepted.pairs)
}

/// One window of sentences shown to the model.
struct Window {
    /// Byte range in the document.
    span: (usize, usize),
    index: usize,
    /// The same sentences were shown before (a short document asked for several pairs).
    repeated: bool,
}

/// Model pairs accepted so far: no two share a normalised question or an (answer, evidence).
#[derive(Default)]
struct Accepted {
    pairs: Vec<QaPair>,
    questions: HashSet<String>,
    answers: HashSet<(String, (usize, usize))>,
}

impl Accepted {
    /// Keeps `pair` unless it repeats an accepted one.
    fn accept(&mut self, pair: QaPair) -> bool {
        let qn = normalize_question(&pair.question);
        let ae = (normalize_question(&pair.answer), pair.evidence_span);
        if self.questions.contains(&qn) || self.answers.contains(&ae) {
            return false;
        }
        self.questions.insert(qn);
        self.answers.insert(ae);
        self.pairs.push(pair);
        true
    }
}

/// Runs the attempts for one window until a valid, new pair is accepted.
///
/// The paper's prompt is used unchanged; the reply is scaffolded in its own format: the model
/// writes the question after `Question:`, then `Answer:` and `Evidence:` are appended for it and
/// it writes each field up to the end of its line. Small models otherwise drift (a 135M model
/// rarely wrote an `Evidence:` line unprompted).
fn generate_for_window(run: &Run, window: &Window, stats: &mut QaStats, accepted: &mut Accepted) -> Result<bool> {
    let Some(prompt) = run.prompt(window.span)? else {
        stats.rejected_parse += 1;
        return Ok(false);
    };
    for index in 0..1 + run.opts.retries {
        run.check_cancel()?;
        // A window seen before starts with sampling (greedy would repeat the same pair).
        let attempt = Attempt { window: window.index, index, sampled: index > 0 || window.repeated };
        let reply = run.scaffolded_reply(&prompt, attempt, stats)?;
        stats.attempts += 1;
        let Some(reply) = reply else {
            stats.rejected_parse += 1;
            continue;
        };
        match validate_model_output(run.doc, window.span, &reply) {
            Verdict::Valid(pair) => {
                tracing::debug!(window = window.index, attempt = index, question = %pair.question, answer = %pair.answer, "model QA pair");
                if accepted.accept(pair) {
                    return Ok(true);
                }
                stats.rejected_duplicate += 1;
            }
            Verdict::Parse => stats.rejected_parse += 1,
            Verdict::Evidence => stats.rejected_evidence += 1,
            Verdict::Answer => stats.rejected_answer += 1,
        }
        tracing::trace!(window = window.index, attempt = index, reply = %reply, "QA attempt rejected");
    }
    Ok(false)
}

/// A window's prompt, prefilled once: attempts continue from copies of its cache.
struct Prompt {
    /// The rendered chat prompt (the reply is encoded after it).
    text: String,
    add_bos: bool,
    /// The prompt's tokens in `cache`: all but the last, which each attempt feeds.
    ids: Vec<u32>,
    cache: KvCache,
}

/// One attempt at a window.
#[derive(Clone, Copy)]
struct Attempt {
    window: usize,
    index: usize,
    sampled: bool,
}

impl Attempt {
    /// Greedy, or seeded sampling by window, attempt and field.
    fn params(&self, seed: u64, field: usize, max_tokens: usize) -> SamplingParams {
        SamplingParams {
            max_tokens,
            temperature: if self.sampled { RETRY_TEMPERATURE } else { 0.0 },
            top_p: if self.sampled { RETRY_TOP_P } else { 1.0 },
            seed: mix_seed(seed, self.window as u64 + 1, (self.index * 4 + field) as u64 + 1),
            stop: Vec::new(),
            top_logprobs: 0,
        }
    }
}

/// A reply being written: its text, the cache holding it and the tokens in that cache.
struct Reply {
    text: String,
    cache: KvCache,
    fed: Vec<u32>,
}

impl Run<'_> {
    fn check_cancel(&self) -> Result<()> {
        if (self.cancel)() {
            return Err(Cancelled("QA generation").into());
        }
        Ok(())
    }

    /// Tokens the model may write per field (the evidence's budget; question and answer get half).
    fn max_new(&self) -> usize {
        self.opts.max_new_tokens.max(8)
    }

    /// The prefilled prompt for the window at byte range `span`; `None` when it is too long for
    /// the model.
    fn prompt(&self, span: (usize, usize)) -> Result<Option<Prompt>> {
        let model = self.model;
        let messages = [
            ChatMessage::new("system", crate::lift::answer::prompt::SYSTEM_PROMPT),
            ChatMessage::new("user", qa_prompt(&model.tokenizer.escape_specials(&self.doc[span.0..span.1]))),
        ];
        let text = model.chat_template.render(&messages, true)?;
        let add_bos = model.tokenizer.bos_token().is_some_and(|(bos, _)| !text.starts_with(&bos));
        let prompt_ids = model.tokenizer.encode(&text, add_bos)?;
        let max_pos = model.config().max_position_embeddings;
        if prompt_ids.len() < 2 || prompt_ids.len() + 2 * self.max_new() + 16 > max_pos {
            tracing::debug!(tokens = prompt_ids.len(), "QA window prompt too long for the model; skipped");
            return Ok(None);
        }
        let ids = prompt_ids[..prompt_ids.len() - 1].to_vec();
        let mut cache = KvCache::new(model.config().num_layers);
        prefill(model, &ids, &mut cache, None, &mut NoHooks)?;
        Ok(Some(Prompt { text, add_bos, ids, cache }))
    }

    /// The reply in the paper's format, the model writing each field after its label; `None` when
    /// a field came out empty, or the question without a "?" or cut off.
    fn scaffolded_reply(&self, prompt: &Prompt, attempt: Attempt, stats: &mut QaStats) -> Result<Option<String>> {
        let max_new = self.max_new();
        // (label written for the model, then the field it writes, with its token budget)
        let fields: [(&str, usize); 3] =
            [("Question:", max_new / 2), ("\n\nAnswer:", max_new / 2), ("\n\nEvidence:", max_new)];
        let mut reply = Reply { text: String::new(), cache: prompt.cache.fork()?, fed: prompt.ids.clone() };
        for (fi, &(label, budget)) in fields.iter().enumerate() {
            reply.text.push_str(label);
            let params = attempt.params(self.opts.seed, fi, budget);
            let (mut field, truncated) = self.write_field(prompt, &mut reply, &params, stats)?;
            // A question must be one, and question and answer must end within their budget (an
            // answer cut off after its first sentence keeps that sentence).
            if truncated && fi == 1 {
                field = first_sentence(&field).unwrap_or_default();
            }
            if field.is_empty() || (fi == 0 && !field.contains('?')) || (fi == 0 && truncated) {
                let reply = format!("{} {field}", reply.text);
                tracing::trace!(window = attempt.window, attempt = attempt.index, reply = %reply, "QA attempt abandoned");
                return Ok(None);
            }
            reply.text.push(' ');
            reply.text.push_str(&field);
        }
        Ok(Some(reply.text))
    }

    /// Lets the model write one field after `reply.text` (which ends with the field's label), up to
    /// the end of its line: that line, and whether the token budget cut it off.
    fn write_field(
        &self,
        prompt: &Prompt,
        reply: &mut Reply,
        params: &SamplingParams,
        stats: &mut QaStats,
    ) -> Result<(String, bool)> {
        let ids = self.model.tokenizer.encode(&format!("{}{}", prompt.text, reply.text), prompt.add_bos)?;
        // Reuse the cached prefix; feed the rest (at least one token).
        let mut keep = reply.fed.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        if keep >= ids.len() {
            keep = ids.len() - 1;
        }
        reply.cache.truncate(keep);
        reply.fed.truncate(keep);
        let mut text = String::new();
        let mut cancelled = false;
        let out = generate(self.model, &ids[keep..], &mut reply.cache, None, &mut NoHooks, params, &mut |piece| {
            text.push_str(piece);
            if (self.cancel)() {
                cancelled = true;
                return false;
            }
            // The field ends with its line.
            !text.trim_start().contains('\n')
        })?;
        stats.generated_tokens += out.tokens.len();
        if cancelled {
            return Err(Cancelled("QA generation").into());
        }
        let forwarded = reply.cache.len().saturating_sub(ids.len());
        reply.fed.extend_from_slice(&ids[keep..]);
        reply.fed.extend_from_slice(&out.tokens[..forwarded.min(out.tokens.len())]);
        let line = out.text.trim_start().split('\n').next().unwrap_or("").trim().to_string();
        let truncated = out.finish_reason == FinishReason::Length && !out.text.trim_start().contains('\n');
        Ok((line, truncated))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_spread_over_the_document() {
        let w = spread_windows(100, 16, 5);
        assert_eq!(w.len(), 5);
        assert_eq!(w[0].0, 2);
        assert!(w.iter().all(|&(a, b)| b - a == 16 && b <= 100));
        assert!(w.windows(2).all(|p| p[0].0 < p[1].0));
        assert!(w[4].1 >= 96);
        assert_eq!(spread_windows(10, 16, 2), vec![(0, 10), (0, 10)]);
        assert!(spread_windows(0, 16, 2).is_empty());
        let all = spread_windows(160, 16, 10);
        assert_eq!(all.first().unwrap().0, 0);
        assert_eq!(all.last().unwrap().1, 160);
    }
}
