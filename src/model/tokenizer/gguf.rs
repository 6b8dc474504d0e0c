//! The tokenizer from GGUF metadata (`tokenizer.ggml.*`): the vocabulary and token types, the
//! model it names (`gpt2` or `llama`, built in `bpe.rs`), special and end-of-turn tokens, and the
//! typed metadata accessors.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file;
use tokenizers::{AddedToken, Tokenizer};

use super::bpe::{build_byte_level_bpe, build_sentencepiece_bpe, SentencePieceVocab, TOKEN_NORMAL};
use super::{dedup, plain_text, TextTokenizer, END_OF_TURN_TOKENS};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`; `TOKEN_NORMAL` is the
/// BPE builders').
const TOKEN_UNKNOWN: i64 = 2;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// The tokenizer the metadata describes, with its special and end-of-generation tokens.
pub(super) fn build_from_gguf(md: &HashMap<String, gguf_file::Value>) -> Result<TextTokenizer> {
    let model = meta_str(md, "tokenizer.ggml.model")?
        .ok_or_else(|| anyhow!("no tokenizer.ggml.model in the metadata"))?;
    let vocab = GgufVocab::read(md)?;
    let pre = meta_str(md, "tokenizer.ggml.pre")?.unwrap_or("default");
    let (mut inner, default_add_bos) = build_gguf_model(md, model, pre, &vocab)?;
    inner
        .add_special_tokens(vocab.added_tokens())
        .map_err(|e| anyhow!("special tokens: {e}"))?;

    let GgufVocab { tokens, types } = &vocab;
    let token_at = |key: &str| -> Result<Option<(String, u32)>> {
        Ok(meta_u32(md, key)?.and_then(|id| tokens.get(id as usize).map(|t| (t.clone(), id))))
    };
    let bos = token_at("tokenizer.ggml.bos_token_id")?;
    let eos = token_at("tokenizer.ggml.eos_token_id")?;
    let pad = meta_u32(md, "tokenizer.ggml.padding_token_id")?;
    let add_bos = meta_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);

    let mut stop_ids: Vec<u32> = eos.iter().map(|(_, id)| *id).collect();
    for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        stop_ids.extend(meta_u32(md, key)?);
    }
    for name in END_OF_TURN_TOKENS {
        stop_ids.extend(special_token_id(tokens, types, name));
    }

    Ok(TextTokenizer {
        plain: plain_text(&inner),
        inner,
        bos,
        eos,
        pad,
        eos_ids: dedup(stop_ids),
        add_bos,
        vocab_size: tokens.len(),
    })
}

/// A GGUF tokenizer's token texts and their types (`tokenizer.ggml.token_type`).
struct GgufVocab {
    tokens: Vec<String>,
    types: Vec<i64>,
}

impl GgufVocab {
    fn read(md: &HashMap<String, gguf_file::Value>) -> Result<Self> {
        let tokens = meta_str_array(md, "tokenizer.ggml.tokens")?
            .ok_or_else(|| anyhow!("no tokenizer.ggml.tokens in the metadata"))?;
        if tokens.is_empty() {
            bail!("tokenizer.ggml.tokens is empty");
        }
        let types = match meta_int_array(md, "tokenizer.ggml.token_type")? {
            Some(t) if t.len() == tokens.len() => t,
            Some(t) => bail!(
                "tokenizer.ggml.token_type has {} entries for {} tokens",
                t.len(),
                tokens.len()
            ),
            None => vec![TOKEN_NORMAL; tokens.len()],
        };
        Ok(Self { tokens, types })
    }

    /// Text → id. Duplicate token texts exist in some GGUFs: the first id wins.
    fn ids(&self) -> HashMap<String, u32> {
        let mut vocab: HashMap<String, u32> = HashMap::with_capacity(self.tokens.len());
        for (id, tok) in self.tokens.iter().enumerate() {
            vocab.entry(tok.clone()).or_insert(id as u32);
        }
        vocab
    }

    /// Control/unknown tokens are special; user-defined ones are matched
    /// verbatim but are ordinary text. Both bypass normalization.
    fn added_tokens(&self) -> Vec<AddedToken> {
        self.tokens
            .iter()
            .zip(&self.types)
            .filter(|(tok, _)| !tok.is_empty())
            .filter_map(|(tok, &ty)| match ty {
                TOKEN_CONTROL | TOKEN_UNKNOWN => Some(AddedToken::from(tok.clone(), true)),
                TOKEN_USER_DEFINED => Some(AddedToken::from(tok.clone(), false)),
                _ => None,
            })
            .map(|t| t.normalized(false))
            .collect()
    }
}

/// The tokenizer model named by `tokenizer.ggml.model` (`pre`: `tokenizer.ggml.pre`), and the
/// default for `add_bos_token`.
fn build_gguf_model(
    md: &HashMap<String, gguf_file::Value>,
    model: &str,
    pre: &str,
    vocab: &GgufVocab,
) -> Result<(Tokenizer, bool)> {
    let ids = vocab.ids();
    match model {
        "gpt2" => {
            let merges = meta_str_array(md, "tokenizer.ggml.merges")?
                .ok_or_else(|| anyhow!("no tokenizer.ggml.merges for a gpt2 tokenizer"))?;
            build_byte_level_bpe(ids, &merges, pre)
        }
        "llama" => {
            let tokens = &vocab.tokens;
            let scores = meta_f32_array(md, "tokenizer.ggml.scores")?;
            let add_space_prefix =
                meta_bool(md, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
            let unk = meta_u32(md, "tokenizer.ggml.unknown_token_id")?
                .and_then(|id| tokens.get(id as usize).cloned());
            let spm = SentencePieceVocab {
                tokens,
                types: &vocab.types,
                scores: scores.as_deref(),
                unk,
                add_space_prefix,
            };
            Ok((build_sentencepiece_bpe(spm, ids)?, true))
        }
        other => bail!(
            "unsupported tokenizer model {other:?} (tokenizer.ggml.model); \
             supported: \"gpt2\", \"llama\""
        ),
    }
}


/// Id of `name` if it is a control or user-defined token (not plain text).
fn special_token_id(tokens: &[String], types: &[i64], name: &str) -> Option<u32> {
    tokens
        .iter()
        .zip(types)
        .position(|(t, &ty)| t == name && (ty == TOKEN_CONTROL || ty == TOKEN_USER_DEFINED))
        .map(|pos| pos as u32)
}


// GGUF metadata accessors: `Ok(None)` when the key is absent, an error when
// it has an unexpected type.

fn meta_str<'m>(md: &'m HashMap<String, gguf_file::Value>, key: &str) -> Result<Option<&'m str>> {
    match md.get(key) {
        None => Ok(None),
        Some(gguf_file::Value::String(s)) => Ok(Some(s.as_str())),
        Some(v) => bail!("{key} should be a string, found {:?}", v.value_type()),
    }
}

fn meta_bool(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Option<bool>> {
    match md.get(key) {
        None => Ok(None),
        Some(gguf_file::Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => bail!("{key} should be a bool, found {:?}", v.value_type()),
    }
}

fn as_int(v: &gguf_file::Value) -> Option<i64> {
    use gguf_file::Value as V;
    Some(match v {
        V::U8(x) => *x as i64,
        V::I8(x) => *x as i64,
        V::U16(x) => *x as i64,
        V::I16(x) => *x as i64,
        V::U32(x) => *x as i64,
        V::I32(x) => *x as i64,
        V::U64(x) => i64::try_from(*x).ok()?,
        V::I64(x) => *x,
        _ => return None,
    })
}

fn meta_u32(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Option<u32>> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => as_int(v)
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| anyhow!("{key} should be a token id, found {v:?}")),
    }
}

fn meta_array<'m>(
    md: &'m HashMap<String, gguf_file::Value>,
    key: &str,
) -> Result<Option<&'m Vec<gguf_file::Value>>> {
    match md.get(key) {
        None => Ok(None),
        Some(gguf_file::Value::Array(a)) => Ok(Some(a)),
        Some(v) => bail!("{key} should be an array, found {:?}", v.value_type()),
    }
}

fn meta_str_array(
    md: &HashMap<String, gguf_file::Value>,
    key: &str,
) -> Result<Option<Vec<String>>> {
    let Some(arr) = meta_array(md, key)? else {
        return Ok(None);
    };
    arr.iter()
        .map(|v| match v {
            gguf_file::Value::String(s) => Ok(s.clone()),
            v => bail!("{key} should hold strings, found {:?}", v.value_type()),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn meta_int_array(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Option<Vec<i64>>> {
    let Some(arr) = meta_array(md, key)? else {
        return Ok(None);
    };
    arr.iter()
        .map(|v| as_int(v).ok_or_else(|| anyhow!("{key} should hold integers, found {v:?}")))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn meta_f32_array(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Option<Vec<f32>>> {
    let Some(arr) = meta_array(md, key)? else {
        return Ok(None);
    };
    arr.iter()
        .map(|v| match v {
            gguf_file::Value::F32(x) => Ok(*x),
            gguf_file::Value::F64(x) => Ok(*x as f32),
            v => bail!("{key} should hold floats, found {:?}", v.value_type()),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}
