//! Hugging Face directory loader: `config.json`, `tokenizer.json`, `tokenizer_config.json`
//! (chat template, special tokens) and one or many `.safetensors` shards (with their index).

use super::chat::ChatTemplate;
use super::config::ModelConfig;
use super::llama::{Decoder, DecoderLayer};
use super::tokenizer::TextTokenizer;
use super::weights::Linear;
use crate::runtime::RuntimeConfig;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub struct HfParts {
    pub decoder: Decoder,
    pub tokenizer: TextTokenizer,
    pub chat_template: ChatTemplate,
}

pub fn load(dir: &Path, device: &Device, runtime: &RuntimeConfig) -> Result<HfParts> {
    let config_path = dir.join("config.json");
    if !config_path.exists() {
        bail!("{}: missing model config (config.json)", config_path.display());
    }
    let config = ModelConfig::from_hf_json(&config_path)?;
    let tokenizer = TextTokenizer::from_hf_dir(dir)?;
    let chat_template = ChatTemplate::from_hf_dir(dir, &tokenizer)?;
    let weights = Weights::open(dir)?;

    let get = |name: &str| weights.get(name, device);
    let opt = |name: &str| -> Result<Option<Tensor>> {
        if weights.has(name) { Ok(Some(weights.get(name, device)?)) } else { Ok(None) }
    };
    let embed = get("model.embed_tokens.weight")?.to_dtype(DType::F32)?;
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let p = format!("model.layers.{i}");
        let lin = |n: &str, bias: bool| -> Result<Linear> {
            let w = get(&format!("{p}.{n}.weight"))?;
            let b = if bias { opt(&format!("{p}.{n}.bias"))? } else { None };
            Ok(Linear::from_tensor(w, b, runtime)?)
        };
        layers.push(DecoderLayer {
            attn_norm: get(&format!("{p}.input_layernorm.weight"))?.to_dtype(DType::F32)?,
            q: lin("self_attn.q_proj", true)?,
            k: lin("self_attn.k_proj", true)?,
            v: lin("self_attn.v_proj", true)?,
            o: lin("self_attn.o_proj", false)?,
            ffn_norm: get(&format!("{p}.post_attention_layernorm.weight"))?.to_dtype(DType::F32)?,
            gate: lin("mlp.gate_proj", false)?,
            up: lin("mlp.up_proj", false)?,
            down: lin("mlp.down_proj", false)?,
        });
    }
    let norm = get("model.norm.weight")?.to_dtype(DType::F32)?;
    let lm_head = match opt("lm_head.weight")? {
        Some(w) if !config.tie_word_embeddings => Linear::from_tensor(w, None, runtime)?,
        _ => Linear::from_tensor(embed.clone(), None, runtime)?,
    };
    let decoder = Decoder::new(config, embed, layers, norm, lm_head, device, runtime)?;
    Ok(HfParts { decoder, tokenizer, chat_template })
}

/// The safetensors shards of a model and which file holds each tensor.
struct Weights {
    files: Vec<(PathBuf, candle_core::safetensors::MmapedSafetensors)>,
    index: HashMap<String, usize>,
}

impl Weights {
    fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("{}: cannot read", index_path.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", index_path.display()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{}: no 'weight_map'", index_path.display()))?;
            let mut files: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
            files.sort();
            files.dedup();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                bail!("{}: missing weights (model.safetensors or model.safetensors.index.json)", dir.display());
            }
            vec![single]
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for path in paths {
            if !path.exists() {
                bail!("{}: missing weight shard", path.display());
            }
            // Safety: the file is mapped read-only; a concurrent writer is the user's error.
            let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&path) }
                .map_err(|e| anyhow::anyhow!("{}: corrupt or truncated safetensors file: {e}", path.display()))?;
            for (name, _) in st.tensors() {
                index.insert(name, files.len());
            }
            files.push((path, st));
        }
        Ok(Self { files, index })
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn get(&self, name: &str, device: &Device) -> Result<Tensor> {
        let Some(&i) = self.index.get(name) else {
            let shown: Vec<_> = self.files.iter().map(|f| f.0.display().to_string()).collect();
            bail!("{}: missing tensor '{name}'", shown.join(", "));
        };
        let (path, st) = &self.files[i];
        st.load(name, device)
            .map_err(|e| anyhow::anyhow!("{}: tensor '{name}': {e}", path.display()))
    }
}
