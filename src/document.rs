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
    /// `sentence_ends(model, tokens)`, computed on first use (answers without a filter never need it).
    ends: OnceLock<Vec<bool>>,
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
        Self { text, tokens, ends: OnceLock::new(), passages: OnceLock::new() }
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

    /// Whether each token ends a sentence or a line (see [`sentence_ends`]); computed once.
    pub fn sentence_ends(&self, model: &Model) -> Result<&[bool]> {
        if let Some(e) = self.ends.get() {
            return Ok(e);
        }
        let ends = sentence_ends(model, &self.tokens)?;
        Ok(self.ends.get_or_init(|| ends))
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
        let ranges = chunk_ranges(self.sentence_ends(model)?, 0, self.tokens.len(), chunk_tokens);
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

/// Whether each document token ends a sentence or a line.
pub fn sentence_ends(model: &Model, doc: &[u32]) -> Result<Vec<bool>> {
    doc.iter()
        .map(|&t| {
            let s = model.tokenizer.decode(&[t])?;
            let s = s.trim_end_matches([' ', '"', '\'', ')']);
            Ok(s.contains('\n') || s.ends_with(['.', '!', '?']))
        })
        .collect()
}

/// Chunks of document tokens `from..to`: sentences (ending after a token where `boundary` is true)
/// packed greedily up to `max` tokens; a longer sentence is cut every `max` tokens.
pub fn chunk_ranges(boundary: &[bool], from: usize, to: usize, max: usize) -> Vec<(usize, usize)> {
    let max = max.max(1);
    let mut pieces = Vec::new();
    let mut s = from;
    for i in from..to {
        if boundary[i] || i + 1 == to || i + 1 - s == max {
            pieces.push((s, i + 1));
            s = i + 1;
        }
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
