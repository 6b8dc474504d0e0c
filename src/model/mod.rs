//! The base model: configuration, loaders (GGUF, Hugging Face), the Llama-family decoder with its
//! inference and trainable paths, tokenizer, chat template and generation.

pub mod batch;
pub mod chat;
pub mod config;
pub mod filter;
pub mod generate;
pub mod gguf;
pub mod hf;
pub mod hooks;
pub mod kv_cache;
pub mod llama;
pub mod ops;
pub mod packing;
pub mod tokenizer;
pub mod train_path;
pub mod weights;

pub use batch::SeqInput;
pub use chat::{ChatMessage, ChatTemplate};
pub use config::{Architecture, ModelConfig};
pub use hooks::{Adapter, DecodeMix, ForwardHooks, NoHooks, Projection, RowHooks};
pub use kv_cache::KvCache;
pub use llama::{Decoder, Logits};
pub use packing::Packing;
pub use tokenizer::TextTokenizer;

use crate::runtime::RuntimeConfig;
use anyhow::{Context, Result};
use candle_core::Device;
use sha2::{Digest, Sha256};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Where the base model came from and how to recognise it again (adapters record this).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ModelInfo {
    /// Short id used by the API (`/v1/models`), e.g. `SmolLM2-135M-Instruct.Q4_1`.
    pub id: String,
    pub path: PathBuf,
    pub format: String,
    /// Hash of the weight files' sizes, heads and tails: cheap, and different for any other model.
    /// With a prepared base installed, the hash of both (adapters and document ids record it).
    pub fingerprint: String,
    /// The installed prepared base's hash, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prepared_base: Option<String>,
}

pub struct Model {
    pub decoder: Decoder,
    pub tokenizer: TextTokenizer,
    pub chat_template: ChatTemplate,
    pub info: ModelInfo,
    /// The prepared base's filter (a detached copy), which answers every in-context question;
    /// the base's LoRA is `decoder.base_adapter` and its hash `info.prepared_base` (installed by
    /// `base::PreparedBase::install`).
    pub base_filter: Option<filter::Filter>,
}

impl Model {
    /// Loads a `.gguf` file or a Hugging Face model directory with the default
    /// [`RuntimeConfig`] (tests; the commands pass theirs to `load_with`).
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        Self::load_with(path, device, &RuntimeConfig::default())
    }

    /// Loads a `.gguf` file or a Hugging Face model directory, its dtypes and kernels as
    /// `runtime` says.
    pub fn load_with(path: &Path, device: &Device, runtime: &RuntimeConfig) -> Result<Self> {
        if !path.exists() {
            anyhow::bail!("{}: model not found (run `lift-serve fetch-model` for the default model)", path.display());
        }
        let (decoder, tokenizer, chat_template, format, files, name) = if path.is_dir() {
            let parts = hf::load(path, device, runtime)?;
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.extension().is_some_and(|e| e == "safetensors")
                        || p.file_name().is_some_and(|n| n == "config.json")
                })
                .collect();
            files.sort();
            (parts.decoder, parts.tokenizer, parts.chat_template, "hf", files, None)
        } else {
            let parts = gguf::load(path, device, runtime)?;
            (parts.decoder, parts.tokenizer, parts.chat_template, "gguf", vec![path.to_path_buf()], parts.name)
        };
        let stem = if path.is_dir() {
            path.file_name().map(|s| s.to_string_lossy().to_string())
        } else {
            path.file_stem().map(|s| s.to_string_lossy().to_string())
        };
        let id = stem.or(name).unwrap_or_else(|| "model".into());
        let fingerprint = fingerprint(&files)?;
        // Which CPU kernels run says most about speed on a given machine (an AVX2-only CPU
        // trains in f32, an AVX-512 one in bf16; quantized layers on our int8 kernel or candle's).
        let quantized_kernel = match decoder.layers.first().map(|l| (&l.q, l.q.packed_isa())) {
            Some((_, Some(isa))) => format!("int8 {isa:?}"),
            Some((q, None)) if q.is_quantized() => "candle".to_string(),
            _ => "none (float weights)".to_string(),
        };
        tracing::info!(
            model = %id,
            format,
            layers = decoder.config.num_layers,
            hidden = decoder.config.hidden_size,
            quantized_kernel,
            float_matmuls = ?decoder.cpu_float_dtype,
            "model loaded"
        );
        Ok(Self {
            decoder,
            tokenizer,
            chat_template,
            info: ModelInfo { id, path: path.to_path_buf(), format: format.into(), fingerprint, prepared_base: None },
            base_filter: None,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.decoder.config
    }

    pub fn device(&self) -> &Device {
        self.decoder.device()
    }

    /// Bytes one token takes in an inference KV cache (keys and values of every layer).
    pub fn kv_bytes_per_token(&self) -> usize {
        let c = self.config();
        c.num_layers * 2 * c.num_kv_heads * c.head_dim * self.decoder.kv_dtype().size_in_bytes()
    }

    /// The prepared base's filter (a detached copy), which answers every in-context question.
    pub fn base_filter(&self) -> Option<&filter::Filter> {
        self.base_filter.as_ref()
    }

    /// Token ids of a document: its text read as plain text (special tokens written in it never
    /// match), the same everywhere a document is trained on, counted or shown.
    pub fn encode_document(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode_plain(text)
    }

    /// Renders chat messages with the model's template and tokenizes them (special tokens written
    /// by the template are parsed as such; no extra BOS when the template already wrote one).
    /// Message contents are user text: special tokens written in them stay plain text.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let parts: Vec<(&str, Vec<ChatPart>)> =
            messages.iter().map(|m| (m.role.as_str(), vec![ChatPart::Text(&m.content)])).collect();
        Ok(self.encode_chat_parts(&parts)?.0)
    }

    /// `encode_chat` with contents made of parts: user text (encoded plain, at the token level,
    /// rather than escaped in the text) and ready token ids (spliced in, never re-tokenised).
    /// Returns the ids and where each part present in the rendered prompt starts, in order.
    pub fn encode_chat_parts(&self, messages: &[(&str, Vec<ChatPart>)]) -> Result<(Vec<u32>, Vec<usize>)> {
        // Each part is rendered as a marker the template cannot produce, then replaced by its ids.
        let marker = |i: usize| format!("\u{E000}LIFT-PART-{i}\u{E001}");
        let mut all = Vec::new();
        let rendered: Vec<ChatMessage> = messages
            .iter()
            .map(|(role, parts)| {
                let content = parts
                    .iter()
                    .map(|p| {
                        all.push(p);
                        marker(all.len() - 1)
                    })
                    .collect();
                ChatMessage { role: role.to_string(), content }
            })
            .collect();
        let text = self.chat_template.render(&rendered, true)?;
        let add_bos = self.tokenizer.bos_token().is_some_and(|(bos, _)| !text.starts_with(&bos));
        let mut ids = Vec::new();
        let mut starts = Vec::new();
        let mut rest = text.as_str();
        let mut first = true;
        while let Some(at) = rest.find("\u{E000}LIFT-PART-") {
            let end = rest[at..].find('\u{E001}').context("chat template broke a message marker")? + at;
            let i: usize =
                rest[at + "\u{E000}LIFT-PART-".len()..end].parse().context("chat template broke a message marker")?;
            let part = all.get(i).context("chat template broke a message marker")?;
            ids.extend(self.tokenizer.encode(&rest[..at], add_bos && first)?);
            first = false;
            starts.push(ids.len());
            match part {
                ChatPart::Text(t) => ids.extend(self.tokenizer.encode_plain(t)?),
                ChatPart::Tokens(t) => ids.extend_from_slice(t),
            }
            rest = &rest[end + '\u{E001}'.len_utf8()..];
        }
        ids.extend(self.tokenizer.encode(rest, add_bos && first)?);
        Ok((ids, starts))
    }
}

/// A piece of a chat message's content (see `Model::encode_chat_parts`).
#[derive(Clone, Copy, Debug)]
pub enum ChatPart<'a> {
    /// User text: special tokens written in it are plain text.
    Text(&'a str),
    /// Token ids spliced in as they are.
    Tokens(&'a [u32]),
}

fn fingerprint(files: &[PathBuf]) -> Result<String> {
    const PART: u64 = 1 << 20;
    let mut h = Sha256::new();
    for path in files {
        let mut f = std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
        let len = f.metadata()?.len();
        h.update(len.to_le_bytes());
        let mut buf = vec![0u8; PART.min(len) as usize];
        f.read_exact(&mut buf)?;
        h.update(&buf);
        if len > PART {
            f.seek(SeekFrom::Start(len - PART.min(len)))?;
            f.read_exact(&mut buf)?;
            h.update(&buf);
        }
    }
    Ok(hex::encode(&h.finalize()[..16]))
}
