//! The BPE models GGUF tokenizers name: GPT-2 style byte-level BPE with each family's
//! pre-tokenizer (SmolLM2, Qwen2, Llama 3, Mistral tekken), and SentencePiece-style BPE with byte
//! fallback (Llama 2, Mistral), its merges derived from the piece scores.

use std::collections::{HashMap, HashSet};

use anyhow::{anyhow, bail, Result};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{NormalizerWrapper, SplitDelimiterBehavior, Tokenizer};


/// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
pub(super) const TOKEN_NORMAL: i64 = 1;

/// Llama 3 `tokenizer.json` split regex (digits grouped by up to three).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 `tokenizer.json` split regex (single digits).
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral "tekken" split regex (as in llama.cpp).
const TEKKEN_PATTERN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)";

/// Byte-level BPE as in GPT-2 / Llama 3 / Qwen2 `tokenizer.json` files.
/// Returns the tokenizer and the default for `add_bos_token`.
pub(super) fn build_byte_level_bpe(
    vocab: HashMap<String, u32>,
    merges: &[String],
    pre: &str,
) -> Result<(Tokenizer, bool)> {
    let mut seen = HashSet::new();
    let mut pairs = Vec::with_capacity(merges.len());
    for m in merges {
        let (a, b) = m
            .split_once(' ')
            .ok_or_else(|| anyhow!("malformed merge {m:?} in tokenizer.ggml.merges"))?;
        // The BPE builder rejects merges outside the vocab; llama.cpp just never
        // applies them, so skipping is equivalent. Keep the first rank of a pair.
        let merged = format!("{a}{b}");
        if vocab.contains_key(a)
            && vocab.contains_key(b)
            && vocab.contains_key(&merged)
            && seen.insert((a, b))
        {
            pairs.push((a.to_string(), b.to_string()));
        }
    }

    // Pre-tokenizer per `tokenizer.ggml.pre`, mirroring the HF tokenizer.json
    // of each family; unknown values fall back to GPT-2.
    let byte_level = |use_regex| ByteLevel::new(false, true, use_regex);
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        let s = Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| anyhow!("invalid pre-tokenizer regex: {e}"))?;
        Ok(s.into())
    };
    let regex_then_bytes = |pattern: &str| -> Result<PreTokenizerWrapper> {
        Ok(PreTokenizerSequence::new(vec![split(pattern)?, byte_level(false).into()]).into())
    };
    let mut normalizer: Option<NormalizerWrapper> = None;
    let mut ignore_merges = false;
    let mut add_bos = false;
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "dbrx" | "smaug-bpe" => {
            ignore_merges = true;
            add_bos = true;
            regex_then_bytes(LLAMA3_PATTERN)?
        }
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => {
            normalizer = Some(NFC.into());
            regex_then_bytes(QWEN2_PATTERN)?
        }
        "tekken" => regex_then_bytes(TEKKEN_PATTERN)?,
        // StarCoder family: every digit is its own piece, then GPT-2 regex.
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" => {
            PreTokenizerSequence::new(vec![Digits::new(true).into(), byte_level(true).into()])
                .into()
        }
        // "gpt-2", "default" and anything unknown: ByteLevel's built-in GPT-2 regex.
        _ => byte_level(true).into(),
    };

    let bpe = BPE::builder()
        .vocab_and_merges(vocab.into_iter().collect::<Vocab>(), pairs)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| anyhow!("invalid BPE vocabulary: {e}"))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_normalizer(normalizer)
        .map_err(|e| anyhow!("tokenizer normalizer: {e}"))?
        .with_pre_tokenizer(Some(pre_tokenizer))
        .with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
    Ok((tok, add_bos))
}

/// What a GGUF "llama" (SentencePiece) tokenizer is made of.
pub(super) struct SentencePieceVocab<'a> {
    pub(super) tokens: &'a [String],
    pub(super) types: &'a [i64],
    pub(super) scores: Option<&'a [f32]>,
    pub(super) unk: Option<String>,
    pub(super) add_space_prefix: bool,
}

/// SentencePiece-style BPE (Llama 2, Mistral): merges are derived from the
/// piece scores the way HF's `SentencePieceExtractor` does, spaces become `▁`,
/// and characters outside the vocab fall back to `<0xNN>` byte tokens.
pub(super) fn build_sentencepiece_bpe(
    spm: SentencePieceVocab<'_>,
    vocab: HashMap<String, u32>,
) -> Result<Tokenizer> {
    if let Some(s) = spm.scores {
        if s.len() != spm.tokens.len() {
            bail!(
                "tokenizer.ggml.scores has {} entries for {} tokens",
                s.len(),
                spm.tokens.len()
            );
        }
    }
    let merges = sentencepiece_merges(&spm);

    let byte_fallback = vocab.contains_key("<0x00>");
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab.into_iter().collect::<Vocab>(), merges)
        .byte_fallback(byte_fallback)
        .fuse_unk(true);
    if let Some(unk) = spm.unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder
        .build()
        .map_err(|e| anyhow!("invalid BPE vocabulary: {e}"))?;

    let (normalizer, decoder) = sentencepiece_spaces(spm.add_space_prefix)?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_normalizer(Some(normalizer))
        .map_err(|e| anyhow!("tokenizer normalizer: {e}"))?
        .with_decoder(Some(decoder));
    Ok(tok)
}

/// The merges of a SentencePiece vocabulary, best score first: every split of a normal piece
/// into two normal pieces, ranked by the whole piece's score.
fn sentencepiece_merges(spm: &SentencePieceVocab<'_>) -> Vec<(String, String)> {
    let SentencePieceVocab { tokens, types, scores, .. } = *spm;
    // Without scores, earlier pieces are assumed to be more frequent.
    let score = |id: usize| scores.map_or(-(id as f32), |s| s[id]);

    // Only normal pieces take part in merging (not bytes/control tokens).
    let normal: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .filter(|(id, _)| types[*id] == TOKEN_NORMAL)
        .map(|(id, t)| (t.as_str(), id))
        .collect();
    let mut merges: Vec<(usize, usize, f32)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types[id] != TOKEN_NORMAL {
            continue;
        }
        let mut local: Vec<(usize, usize)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                Some((*normal.get(l)?, *normal.get(r)?))
            })
            .collect();
        local.sort_unstable();
        merges.extend(local.into_iter().map(|(l, r)| (l, r, score(id))));
    }
    // Stable sort: equal scores keep vocab order, as in HF's extractor.
    merges.sort_by(|a, b| b.2.total_cmp(&a.2));
    merges
        .into_iter()
        .map(|(l, r, _)| (tokens[l].clone(), tokens[r].clone()))
        .collect()
}

/// SentencePiece's spaces: `▁` for a space (and a `▁` prefix with `add_space_prefix`) when
/// encoding, undone with the byte fallback when decoding.
fn sentencepiece_spaces(add_space_prefix: bool) -> Result<(NormalizerSequence, DecoderSequence)> {
    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|e| anyhow!("invalid replace pattern: {e}"))
    };
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        normalizers.push(Prepend::new("▁".to_string()).into());
    }
    normalizers.push(replace(" ", "▁")?.into());
    let mut decoders: Vec<DecoderWrapper> = vec![
        DecoderWrapper::Replace(replace("▁", " ")?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_space_prefix {
        // Undo the prefix space added when encoding.
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    Ok((NormalizerSequence::new(normalizers), DecoderSequence::new(decoders)))
}
