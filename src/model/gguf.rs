//! GGUF loader: llama (incl. SmolLM2, Mistral, Llama 3) and qwen2 architectures, any quantized
//! type candle reads (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, …, F16, F32). The tokenizer and the chat
//! template come from the file's metadata.

use super::chat::ChatTemplate;
use super::config::{Architecture, ModelConfig, RopeScaling};
use super::llama::{Decoder, DecoderLayer};
use super::tokenizer::TextTokenizer;
use super::weights::{dequantize, Linear};
use crate::runtime::RuntimeConfig;
use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, QTensor};
use candle_core::Device;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

pub struct GgufParts {
    pub decoder: Decoder,
    pub tokenizer: TextTokenizer,
    pub chat_template: ChatTemplate,
    pub name: Option<String>,
}

pub fn load(path: &Path, device: &Device, runtime: &RuntimeConfig) -> Result<GgufParts> {
    let file = File::open(path).with_context(|| format!("{}: cannot open model file", path.display()))?;
    let file_len = file.metadata()?.len();
    let mut reader = BufReader::new(file);
    let content = gguf_file::Content::read(&mut reader)
        .map_err(|e| anyhow::anyhow!("{}: not a readable GGUF file: {e}", path.display()))?;
    check_complete(&content, file_len, path)?;

    let md = Metadata { content: &content, path };
    let arch_name = md.string("general.architecture")?;
    let architecture = Architecture::parse(&arch_name, path)?;
    let config = md.config(&arch_name, architecture)?;

    let mut read = |name: &str| -> Result<QTensor> {
        content
            .tensor(&mut reader, name, device)
            .map_err(|e| anyhow::anyhow!("{}: tensor '{name}': {e}", path.display()))
    };
    let has = |name: &str| content.tensor_infos.contains_key(name);

    let embed_q = read("token_embd.weight")?;
    let embed = dequantize(&embed_q)?;
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let p = format!("blk.{i}");
        let bias = |read: &mut dyn FnMut(&str) -> Result<QTensor>, n: &str| -> Result<Option<candle_core::Tensor>> {
            let name = format!("{p}.{n}.bias");
            if has(&name) { Ok(Some(dequantize(&read(&name)?)?)) } else { Ok(None) }
        };
        // llama-architecture files keep llama.cpp's permuted q/k rows: the decoder then uses
        // interleaved RoPE (`Decoder::rope_interleaved`), exactly as llama.cpp does.
        let wq = read(&format!("{p}.attn_q.weight"))?;
        let wk = read(&format!("{p}.attn_k.weight"))?;
        let bq = bias(&mut read, "attn_q")?;
        let bk = bias(&mut read, "attn_k")?;
        let bv = bias(&mut read, "attn_v")?;
        layers.push(DecoderLayer {
            attn_norm: dequantize(&read(&format!("{p}.attn_norm.weight"))?)?,
            q: Linear::from_qtensor(wq, bq, runtime)?,
            k: Linear::from_qtensor(wk, bk, runtime)?,
            v: Linear::from_qtensor(read(&format!("{p}.attn_v.weight"))?, bv, runtime)?,
            o: Linear::from_qtensor(read(&format!("{p}.attn_output.weight"))?, None, runtime)?,
            ffn_norm: dequantize(&read(&format!("{p}.ffn_norm.weight"))?)?,
            gate: Linear::from_qtensor(read(&format!("{p}.ffn_gate.weight"))?, None, runtime)?,
            up: Linear::from_qtensor(read(&format!("{p}.ffn_up.weight"))?, None, runtime)?,
            down: Linear::from_qtensor(read(&format!("{p}.ffn_down.weight"))?, None, runtime)?,
        });
    }
    let norm = dequantize(&read("output_norm.weight")?)?;
    let (lm_head, tied) = if has("output.weight") {
        (Linear::from_qtensor(read("output.weight")?, None, runtime)?, false)
    } else {
        (Linear::from_qtensor(embed_q, None, runtime)?, true)
    };
    let mut config = config;
    config.tie_word_embeddings = tied;
    if has("rope_freqs.weight") {
        let f = dequantize(&read("rope_freqs.weight")?)?.to_vec1::<f32>()?;
        config.rope_scaling = Some(RopeScaling::Factors { factors: f });
    }

    let tokenizer = TextTokenizer::from_gguf(&content, path)?;
    let chat_template = ChatTemplate::from_gguf(&content, &tokenizer)
        .with_context(|| format!("{}: chat template", path.display()))?;
    let name = content
        .metadata
        .get("general.name")
        .and_then(|v| v.to_string().ok().cloned());
    let mut decoder = Decoder::new(config, embed, layers, norm, lm_head, device, runtime)?;
    decoder.rope_interleaved = architecture != Architecture::Qwen2;
    Ok(GgufParts { decoder, tokenizer, chat_template, name })
}

/// Fails clearly when the file ends before its last tensor (an interrupted download or copy).
fn check_complete(content: &gguf_file::Content, file_len: u64, path: &Path) -> Result<()> {
    let mut needed = content.tensor_data_offset;
    for (name, info) in &content.tensor_infos {
        let elems = info.shape.elem_count();
        let bs = info.ggml_dtype.block_size();
        if elems % bs != 0 {
            bail!("{}: tensor '{name}' has {elems} elements, not a multiple of its block size {bs}", path.display());
        }
        let end = content.tensor_data_offset + info.offset + (elems / bs * info.ggml_dtype.type_size()) as u64;
        needed = needed.max(end);
    }
    if file_len < needed {
        bail!(
            "{}: truncated GGUF file: {} bytes, its tensors need {} bytes",
            path.display(),
            file_len,
            needed
        );
    }
    Ok(())
}

/// llama.cpp's q/k row permutation (HF row `h*d + j*d/2 + i` → row `h*d + 2i + j`), for tests
/// that write llama GGUF files.
pub fn permute_rows_for_gguf(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let d = rows / heads;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let gguf = h * d + 2 * i + j;
                let hf = h * d + j * (d / 2) + i;
                out[gguf * cols..(gguf + 1) * cols].copy_from_slice(&w[hf * cols..(hf + 1) * cols]);
            }
        }
    }
    out
}

struct Metadata<'a> {
    content: &'a gguf_file::Content,
    path: &'a Path,
}

impl Metadata<'_> {
    fn get(&self, key: &str) -> Result<&gguf_file::Value> {
        self.content
            .metadata
            .get(key)
            .with_context(|| format!("{}: missing metadata key '{key}'", self.path.display()))
    }
    fn string(&self, key: &str) -> Result<String> {
        Ok(self.get(key)?.to_string().map_err(|e| anyhow::anyhow!("{}: {key}: {e}", self.path.display()))?.clone())
    }
    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        let n = v
            .to_u64()
            .or_else(|_| v.to_u32().map(u64::from))
            .or_else(|_| v.to_i32().map(|x| x as u64))
            .map_err(|e| anyhow::anyhow!("{}: {key}: {e}", self.path.display()))?;
        Ok(n as usize)
    }
    fn f32(&self, key: &str) -> Result<f32> {
        let v = self.get(key)?;
        v.to_f32()
            .or_else(|_| v.to_f64().map(|x| x as f32))
            .map_err(|e| anyhow::anyhow!("{}: {key}: {e}", self.path.display()))
    }

    fn config(&self, a: &str, architecture: Architecture) -> Result<ModelConfig> {
        let hidden = self.usize(&format!("{a}.embedding_length"))?;
        let heads = self.usize(&format!("{a}.attention.head_count"))?;
        let kv = self.usize(&format!("{a}.attention.head_count_kv")).unwrap_or(heads);
        let vocab = match self.content.tensor_infos.get("token_embd.weight") {
            Some(info) => info.shape.dims()[0],
            None => bail!("{}: missing tensor 'token_embd.weight'", self.path.display()),
        };
        let head_dim = self
            .usize(&format!("{a}.attention.key_length"))
            .unwrap_or(hidden / heads.max(1));
        let rope_scaling = match self.string(&format!("{a}.rope.scaling.type")).ok().as_deref() {
            Some("linear") => Some(RopeScaling::Linear {
                factor: self.f32(&format!("{a}.rope.scaling.factor")).unwrap_or(1.0),
            }),
            _ => None,
        };
        let cfg = ModelConfig {
            architecture,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: self.usize(&format!("{a}.feed_forward_length"))?,
            num_layers: self.usize(&format!("{a}.block_count"))?,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim,
            rms_norm_eps: self.f32(&format!("{a}.attention.layer_norm_rms_epsilon")).unwrap_or(1e-5) as f64,
            rope_theta: self.f32(&format!("{a}.rope.freq_base")).unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: self.usize(&format!("{a}.context_length")).unwrap_or(4096),
            tie_word_embeddings: false,
            attention_bias: architecture == Architecture::Qwen2,
            sliding_window: None,
        };
        cfg.validate(self.path)?;
        Ok(cfg)
    }
}
