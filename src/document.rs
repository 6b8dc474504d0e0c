//! A document as the base model reads it: its text and token ids, tokenized once (when it is
//! posted or read from a file) and passed along — absorb trains on these ids, the store keeps them
//! beside the adapter, and every answer lays out its context from them. Sentence boundaries,
//! which the prepared base's filter chunks the context by, and the passage index that answers
//! retrieve from ([`crate::retrieve`]) are made once per loaded document.

use crate::model::Model;
use crate::retrieve::PassageIndex;
use anyhow::{ensure, Result};
use std::sync::OnceLock;

pub struct Document {
    pub text: String,
    tokens: Vec<u32>,
    /// `breaks(model, tokens)`, computed on first use (answers without a filter never need it).
    breaks: OnceLock<Vec<Break>>,
    /// The passages and their index, with the passage size they were cut at; made on first use.
    passages: OnceLock<(usize, PassageIndex)>,
}

impl Document {
    /// Tokenizes `text` with the model's tokenizer, as plain text (`Model::encode_document`).
    pub fn encode(model: &Model, text: impl Into<String>) -> Result<Self> {
        let text = text.into();
        let tokens = model.encode_document(&text)?;
        Ok(Self::from_tokens(text, tokens))
    }

    /// A document whose ids were computed before (read back from the store).
    pub fn from_tokens(text: String, tokens: Vec<u32>) -> Self {
        Self { text, tokens, breaks: OnceLock::new(), passages: OnceLock::new() }
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// What break follows each token (see [`breaks`]); computed once.
    pub fn breaks(&self, model: &Model) -> Result<&[Break]> {
        if let Some(b) = self.breaks.get() {
            return Ok(b);
        }
        let breaks = breaks(model, &self.tokens)?;
        Ok(self.breaks.get_or_init(|| breaks))
    }

    /// The document's sentence-aligned passages of at most `chunk_tokens` tokens (the FltLM
    /// layout's chunks) and their BM25 index; made once (a passage size other than the first
    /// one asked for is indexed afresh, uncached).
    pub fn passages(&self, model: &Model, chunk_tokens: usize) -> Result<std::borrow::Cow<'_, PassageIndex>> {
        if let Some((c, idx)) = self.passages.get() {
            if *c == chunk_tokens {
                return Ok(std::borrow::Cow::Borrowed(idx));
            }
            return Ok(std::borrow::Cow::Owned(self.index_passages(model, chunk_tokens)?));
        }
        let idx = self.index_passages(model, chunk_tokens)?;
        let _ = self.passages.set((chunk_tokens, idx));
        self.passages(model, chunk_tokens)
    }

    fn index_passages(&self, model: &Model, chunk_tokens: usize) -> Result<PassageIndex> {
        let ranges = chunk_ranges(self.breaks(model)?, 0, self.tokens.len(), chunk_tokens);
        let texts = ranges.iter().map(|&(a, b)| model.tokenizer.decode(&self.tokens[a..b])).collect::<Result<Vec<_>>>()?;
        Ok(PassageIndex::from_texts(ranges, &texts))
    }

    /// Bytes held in memory (text, ids and boundaries), for cache accounting.
    pub fn bytes(&self) -> usize {
        self.text.len() + self.tokens.len() * 5
    }

    /// The ids as stored on disk: little-endian u32, no header.
    pub fn tokens_to_bytes(&self) -> Vec<u8> {
        self.tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }
}

/// Ids stored by [`Document::tokens_to_bytes`]; `expected` is the count the manifest records.
pub fn tokens_from_bytes(bytes: &[u8], expected: usize) -> Result<Vec<u32>> {
    ensure!(
        bytes.len() == expected * 4,
        "the stored token ids hold {} bytes; the manifest records {expected} tokens ({} bytes)",
        bytes.len(),
        expected * 4
    );
    Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// The document tokens `[a, b)` that the byte span `span` of `text` falls in: the tokens of
/// `text[..start]` and `text[..end]` counted as the document is tokenized (at least one token).
pub fn token_span(model: &Model, text: &str, span: (usize, usize)) -> Result<(usize, usize)> {
    let count = |end: usize| -> Result<usize> { Ok(model.encode_document(&text[..end.min(text.len())])?.len()) };
    let a = count(span.0)?;
    Ok((a, count(span.1)?.max(a + 1)))
}

/// What follows a document token: nothing (the next token continues its word: "21" then "2" of
/// "212"), a word break, or the end of a sentence or line. Chunks end at sentence ends, and a
/// sentence too long for one chunk is cut at a word break, never inside a word or a number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Break {
    Inside,
    Word,
    Sentence,
}

/// The break after each document token.
pub fn breaks(model: &Model, doc: &[u32]) -> Result<Vec<Break>> {
    let texts = doc.iter().map(|&t| model.tokenizer.decode(&[t])).collect::<Result<Vec<_>>>()?;
    Ok((0..texts.len())
        .map(|i| {
            let s = texts[i].trim_end_matches([' ', '"', '\'', ')']);
            if s.contains('\n') || s.ends_with(['.', '!', '?']) {
                Break::Sentence
            } else if texts[i].ends_with(char::is_whitespace)
                || texts.get(i + 1).is_none_or(|n| n.starts_with(char::is_whitespace))
            {
                Break::Word
            } else {
                Break::Inside
            }
        })
        .collect())
}

/// Chunks of document tokens `from..to`: sentences (ending after a token whose break is
/// [`Break::Sentence`]) packed greedily up to `max` tokens; a longer sentence is cut at its last
/// word break within `max` tokens (every `max` tokens where a word is longer than that).
pub fn chunk_ranges(breaks: &[Break], from: usize, to: usize, max: usize) -> Vec<(usize, usize)> {
    let max = max.max(1);
    let mut pieces = Vec::new();
    let (mut s, mut i) = (from, from);
    let mut last_word = None;
    while i < to {
        if breaks[i] == Break::Sentence || i + 1 == to {
            pieces.push((s, i + 1));
            (s, last_word) = (i + 1, None);
        } else {
            if breaks[i] == Break::Word {
                last_word = Some(i);
            }
            if i + 1 - s == max {
                let cut = last_word.unwrap_or(i) + 1;
                pieces.push((s, cut));
                (s, last_word, i) = (cut, None, cut);
                continue;
            }
        }
        i += 1;
    }
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (a, b) in pieces {
        match out.last_mut() {
            Some(last) if b - last.0 <= max => last.1 = b,
            _ => out.push((a, b)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_tokens_round_trip_and_are_checked() {
        let d = Document::from_tokens("x".into(), vec![0, 1, 70_000, u32::MAX]);
        let bytes = d.tokens_to_bytes();
        assert_eq!(tokens_from_bytes(&bytes, 4).unwrap(), d.tokens());
        assert!(tokens_from_bytes(&bytes, 3).is_err());
        assert!(tokens_from_bytes(&bytes[..15], 4).is_err());
    }
}
