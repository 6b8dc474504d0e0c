//! Model-written pairs: the LIFT paper's App. A.3 prompt over windows of consecutive sentences
//! spread evenly over the document, one per `sentences_per_pair` sentences. The reply is
//! scaffolded: the model writes each field after its label and the next label is appended for it
//! (a 135M model otherwise rarely writes an evidence line). Failures are retried (greedy first,
//! then seeded sampling); once several windows gave (almost) nothing valid the model is no longer
//! asked.

use super::evidence::{validate_model_output, Verdict};
use super::{QaOptions, QaPair, QaStats};
use crate::lift::text::split_sentences;
use crate::model::generate::{generate, prefill, FinishReason, SamplingParams};
use crate::model::{ChatMessage, KvCache, Model, NoHooks};
use anyhow::Result;

/// Sampling temperature / top-p of the retries (the first attempt is greedy).
const RETRY_TEMPERATURE: f64 = 0.5;
const RETRY_TOP_P: f64 = 0.9;
/// Stop asking the model once at least this many windows were tried and fewer than one in ten
/// gave a valid pair (a small model can cost minutes per window on a CPU for nothing).
pub(super) const GIVE_UP_AFTER_WINDOWS: usize = 3;

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
pub(super) fn spread_windows(n: usize, window: usize, count: usize) -> Vec<(usize, usize)> {
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

/// Runs the attempts for one window until a valid, new pair is accepted by `accept`.
///
/// The paper's prompt is used unchanged; the reply is scaffolded in its own format: the model
/// writes the question after `Question:`, then `Answer:` and `Evidence:` are appended for it and
/// it writes each field up to the end of its line. Small models otherwise drift (a 135M model
/// rarely wrote an `Evidence:` line unprompted).
#[allow(clippy::too_many_arguments)]
pub(super) fn generate_for_window(
    model: &Model,
    doc: &str,
    span: (usize, usize),
    wi: usize,
    repeated: bool,
    opts: &QaOptions,
    cancel: &dyn Fn() -> bool,
    stats: &mut QaStats,
    accept: &mut dyn FnMut(QaPair) -> bool,
) -> Result<bool> {
    let messages = [
        ChatMessage::new("system", crate::lift::prompt::SYSTEM_PROMPT),
        ChatMessage::new("user", qa_prompt(&model.tokenizer.escape_specials(&doc[span.0..span.1]))),
    ];
    let prompt_text = model.chat_template.render(&messages, true)?;
    let add_bos = model.tokenizer.bos_token().is_some_and(|(bos, _)| !prompt_text.starts_with(&bos));
    let encode = |assistant: &str| model.tokenizer.encode(&format!("{prompt_text}{assistant}"), add_bos);
    let prompt_ids = encode("")?;
    let max_pos = model.config().max_position_embeddings;
    let max_new = opts.max_new_tokens.max(8);
    if prompt_ids.len() < 2 || prompt_ids.len() + 2 * max_new + 16 > max_pos {
        tracing::debug!(tokens = prompt_ids.len(), "QA window prompt too long for the model; skipped");
        stats.rejected_parse += 1;
        return Ok(false);
    }
    // The prompt is prefilled once; attempts continue from copies of its cache.
    let base_ids = &prompt_ids[..prompt_ids.len() - 1];
    let mut base = KvCache::new(model.config().num_layers);
    prefill(model, base_ids, &mut base, None, &mut NoHooks)?;
    // (label written for the model, then the field it writes, with its token budget)
    let fields: [(&str, usize); 3] =
        [("Question:", max_new / 2), ("\n\nAnswer:", max_new / 2), ("\n\nEvidence:", max_new)];
    for attempt in 0..1 + opts.retries {
        if cancel() {
            return Err(crate::lift::Cancelled("QA generation").into());
        }
        // A window seen before starts with sampling (greedy would repeat the same pair).
        let sampled = attempt > 0 || repeated;
        let mut cache = base.fork()?;
        let mut fed: Vec<u32> = base_ids.to_vec();
        let mut reply = String::new();
        let mut complete = true;
        for (fi, &(label, budget)) in fields.iter().enumerate() {
            reply.push_str(label);
            let ids = encode(&reply)?;
            // Reuse the cached prefix; feed the rest (at least one token).
            let mut keep = fed.iter().zip(&ids).take_while(|(a, b)| a == b).count();
            if keep >= ids.len() {
                keep = ids.len() - 1;
            }
            cache.truncate(keep);
            fed.truncate(keep);
            let params = SamplingParams {
                max_tokens: budget,
                temperature: if sampled { RETRY_TEMPERATURE } else { 0.0 },
                top_p: if sampled { RETRY_TOP_P } else { 1.0 },
                seed: mix_seed(opts.seed, wi as u64 + 1, (attempt * 4 + fi) as u64 + 1),
                stop: Vec::new(),
            };
            let mut text = String::new();
            let mut cancelled = false;
            let out = generate(model, &ids[keep..], &mut cache, None, &mut NoHooks, &params, &mut |piece| {
                text.push_str(piece);
                if cancel() {
                    cancelled = true;
                    return false;
                }
                // The field ends with its line.
                !text.trim_start().contains('\n')
            })?;
            stats.generated_tokens += out.tokens.len();
            if cancelled {
                return Err(crate::lift::Cancelled("QA generation").into());
            }
            let forwarded = cache.len().saturating_sub(ids.len());
            fed.extend_from_slice(&ids[keep..]);
            fed.extend_from_slice(&out.tokens[..forwarded.min(out.tokens.len())]);
            let mut field = out.text.trim_start().split('\n').next().unwrap_or("").trim().to_string();
            // A question must be one, and question and answer must end within their budget (an
            // answer cut off after its first sentence keeps that sentence).
            let truncated = out.finish_reason == FinishReason::Length && !out.text.trim_start().contains('\n');
            if truncated && fi == 1 {
                field = first_sentence(&field).unwrap_or_default();
            }
            if field.is_empty() || (fi == 0 && !field.contains('?')) || (fi == 0 && truncated) {
                tracing::trace!(window = wi, attempt, reply = %format!("{reply} {field}"), "QA attempt abandoned");
                complete = false;
                break;
            }
            reply.push(' ');
            reply.push_str(&field);
        }
        stats.attempts += 1;
        if !complete {
            stats.rejected_parse += 1;
            continue;
        }
        match validate_model_output(doc, span, &reply) {
            Verdict::Valid(pair) => {
                tracing::debug!(window = wi, attempt, question = %pair.question, answer = %pair.answer, "model QA pair");
                if accept(pair) {
                    return Ok(true);
                }
                stats.rejected_duplicate += 1;
            }
            Verdict::Parse => stats.rejected_parse += 1,
            Verdict::Evidence => stats.rejected_evidence += 1,
            Verdict::Answer => stats.rejected_answer += 1,
        }
        tracing::trace!(window = wi, attempt, reply = %reply, "QA attempt rejected");
    }
    Ok(false)
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
