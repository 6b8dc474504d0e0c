//! Prompt layout shared by training and answering, so the adapter is trained on exactly the
//! format it is asked in (the LIFT paper §3.3: contextualized training aligns the
//! memorisation task with the question-answering one).
//!
//! user turn = [document context tokens] + "\n\n" + instruction or question; the assistant turn
//! follows. The document context is spliced in as token ids, never re-tokenised.

use crate::model::{ChatMessage, ChatPart, Model};
use anyhow::{Context, Result};

/// The system message of every LIFT prompt (SmolLM2's own default derails it).
pub const SYSTEM_PROMPT: &str = "You are a helpful assistant.";

/// The recite instruction of contextualized training (LIFT authors' code).
pub const RECITE_PROMPT: &str = "Given above context, please recite following segment of the context:";

/// Joins the head and the tail of a truncated document.
pub const ELISION: &str = "\n...\n";

/// Tokens of a chat prompt whose user turn is `context` followed by `suffix`, ending with the
/// assistant's generation prompt. With an empty context the user turn is `suffix` alone.
pub fn chat_with_context(model: &Model, context: &[u32], suffix: &str) -> Result<Vec<u32>> {
    Ok(chat_with_context_at(model, context, suffix)?.0)
}

/// `chat_with_context` and the position of the context's first token in the prompt.
pub fn chat_with_context_at(model: &Model, context: &[u32], suffix: &str) -> Result<(Vec<u32>, usize)> {
    chat_after_turns(model, &[], context, suffix)
}

/// `chat_with_context_at` after the earlier turns of a conversation (`turns`: user and assistant
/// messages, oldest first), each its own turn of the chat template between the system message and
/// the user turn that shows the context and asks `suffix`.
pub fn chat_after_turns(model: &Model, turns: &[ChatMessage], context: &[u32], suffix: &str) -> Result<(Vec<u32>, usize)> {
    let user = if context.is_empty() {
        vec![ChatPart::Text(suffix)]
    } else {
        vec![ChatPart::Tokens(context), ChatPart::Text("\n\n"), ChatPart::Text(suffix)]
    };
    let mut messages = Vec::with_capacity(turns.len() + 2);
    messages.push(("system", vec![ChatPart::Text(SYSTEM_PROMPT)]));
    messages.extend(turns.iter().map(|t| (t.role.as_str(), vec![ChatPart::Text(&t.content)])));
    messages.push(("user", user));
    let (ids, starts) = model.encode_chat_parts(&messages)?;
    if context.is_empty() {
        let n = ids.len();
        return Ok((ids, n));
    }
    // The last user turn's parts are the last three rendered: the context, the break, `suffix`.
    let at = starts.len().checked_sub(3).map(|i| starts[i]).context("chat template dropped the user message")?;
    Ok((ids, at))
}

/// The document truncated to `budget` tokens: `head` tokens from the start, the elision marker,
/// and the rest from the end. The whole document when it fits.
pub fn head_tail(doc: &[u32], budget: usize, head: usize, elision: &[u32]) -> Vec<u32> {
    if doc.len() <= budget {
        return doc.to_vec();
    }
    let room = budget.saturating_sub(elision.len());
    let head = head.min(room);
    let tail = room - head;
    let mut out = Vec::with_capacity(budget);
    out.extend_from_slice(&doc[..head]);
    out.extend_from_slice(elision);
    out.extend_from_slice(&doc[doc.len() - tail..]);
    out
}

/// Which document tokens `head_tail` keeps, as (head_end, tail_start): tokens `head_end..tail_start`
/// are out of the window. `(n, n)` when the whole document fits.
pub fn kept_ranges(doc_len: usize, budget: usize, head: usize, elision_len: usize) -> (usize, usize) {
    if doc_len <= budget {
        return (doc_len, doc_len);
    }
    let room = budget.saturating_sub(elision_len);
    let head = head.min(room);
    (head, doc_len - (room - head))
}

/// The elision marker's tokens for `model`.
pub fn elision_tokens(model: &Model) -> Result<Vec<u32>> {
    model.tokenizer.encode(ELISION, false)
}

/// The tokens that close an assistant turn (trained after every answer so the model stops).
pub fn end_of_turn(model: &Model) -> Vec<u32> {
    model.tokenizer.eos_token_ids().first().copied().into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_tail_keeps_both_ends() {
        let doc: Vec<u32> = (0..100).collect();
        let e = [999u32];
        let t = head_tail(&doc, 21, 10, &e);
        assert_eq!(t.len(), 21);
        assert_eq!(&t[..10], &doc[..10]);
        assert_eq!(t[10], 999);
        assert_eq!(&t[11..], &doc[90..]);
        assert_eq!(kept_ranges(100, 21, 10, 1), (10, 90));
        assert_eq!(head_tail(&doc[..15], 21, 10, &e), doc[..15].to_vec());
        assert_eq!(kept_ranges(15, 21, 10, 1), (15, 15));
    }
}
