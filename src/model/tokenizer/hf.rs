//! The tokenizer from a Hugging Face model directory: `tokenizer.json`, with special tokens from
//! `tokenizer_config.json` and stop ids from `generation_config.json` / `config.json`.

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use tokenizers::Tokenizer;

use super::{dedup, plain_text, TextTokenizer, END_OF_TURN_TOKENS};

/// The tokenizer of the model directory `dir`.
pub(super) fn build_from_hf_dir(dir: &Path) -> Result<TextTokenizer> {
    let tok_path = dir.join("tokenizer.json");
    let inner = Tokenizer::from_file(&tok_path)
        .map_err(|e| anyhow!("cannot read {}: {e}", tok_path.display()))?;
    let config = read_json_opt(&dir.join("tokenizer_config.json"))?;
    let gen_config = read_json_opt(&dir.join("generation_config.json"))?;
    let model_config = read_json_opt(&dir.join("config.json"))?;

    let by_name = |field: &str| -> Option<(String, u32)> {
        let name = token_field(config.as_ref()?.get(field)?)?;
        inner.token_to_id(&name).map(|id| (name, id))
    };
    // generation_config.json takes priority over config.json, as in transformers.
    let config_ids = |field: &str| -> Vec<u32> {
        [&gen_config, &model_config]
            .into_iter()
            .flatten()
            .map(|c| json_ids(c.get(field)))
            .find(|ids| !ids.is_empty())
            .unwrap_or_default()
    };
    let by_id = |field: &str| -> Option<(String, u32)> {
        let id = *config_ids(field).first()?;
        inner.id_to_token(id).map(|t| (t, id))
    };
    let bos = by_name("bos_token").or_else(|| by_id("bos_token_id"));
    let eos = by_name("eos_token").or_else(|| by_id("eos_token_id"));
    let pad = by_name("pad_token")
        .map(|(_, id)| id)
        .or_else(|| by_id("pad_token_id").map(|(_, id)| id));

    let add_bos = match config
        .as_ref()
        .and_then(|c| c.get("add_bos_token"))
        .and_then(|v| v.as_bool())
    {
        Some(b) => b,
        // No flag: the post-processor decides (e.g. Llama 3's TemplateProcessing).
        None => match &bos {
            Some((_, bos_id)) => inner
                .encode_fast("", true)
                .map(|e| e.get_ids().first() == Some(bos_id))
                .unwrap_or(false),
            None => false,
        },
    };

    let mut stop_ids: Vec<u32> = eos.iter().map(|(_, id)| *id).collect();
    stop_ids.extend(config_ids("eos_token_id"));
    let added = inner.get_added_tokens_decoder();
    for name in END_OF_TURN_TOKENS {
        stop_ids.extend(
            added
                .iter()
                .filter(|(_, t)| t.special && t.content == *name)
                .map(|(id, _)| *id),
        );
    }

    let vocab_size = inner
        .get_vocab(true)
        .values()
        .max()
        .map_or(0, |&max| max as usize + 1);
    Ok(TextTokenizer {
        plain: plain_text(&inner),
        inner,
        bos,
        eos,
        pad,
        eos_ids: dedup(stop_ids),
        add_bos,
        vocab_size,
    })
}

fn read_json_opt(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let value = serde_json::from_str(&text)
        .with_context(|| format!("invalid JSON in {}", path.display()))?;
    Ok(Some(value))
}

/// A special token in tokenizer_config.json: a string or an AddedToken object.
fn token_field(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// A token id field that may be an integer or a list of integers.
fn json_ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    let as_id = |v: &serde_json::Value| v.as_u64().and_then(|x| u32::try_from(x).ok());
    match v {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(as_id).collect(),
        Some(v) => as_id(v).into_iter().collect(),
        None => Vec::new(),
    }
}
