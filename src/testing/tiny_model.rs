//! A tiny randomly-initialised Llama model written to disk in both Hugging Face
//! (safetensors + config + tokenizer) and GGUF form, for fast mechanics tests. Deterministic:
//! the same seed writes the same bytes. Real-model behaviour is tested on the default model.

use crate::adapters::init::Rng;
use anyhow::Result;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Shape of the tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub max_positions: usize,
    pub qkv_bias: bool,
    pub seed: u64,
    /// Vocabulary size: 0 for the tiny byte vocabulary alone; more pads it with filler tokens
    /// that the tokenizer never produces (a model of a real vocabulary's shape, for benchmarks).
    pub vocab: usize,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self { hidden: 64, intermediate: 128, layers: 2, heads: 4, kv_heads: 2, max_positions: 2048, qkv_bias: false, seed: 42, vocab: 0 }
    }
}

impl TinySpec {
    /// A randomly initialised model of SmolLM2-135M's exact shapes (the default model's), its
    /// vocabulary size included: timings of every matmul, attention and the LM head match the
    /// real model's where its weights cannot travel (a GPU machine without the model file).
    pub fn smollm2_135m_shaped() -> Self {
        let c = smollm2_135m_config();
        Self {
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            layers: c.num_layers,
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            max_positions: c.max_position_embeddings,
            qkv_bias: false,
            seed: 42,
            vocab: c.vocab_size,
        }
    }

    /// Random weights of Qwen2.5-0.5B's shapes (biased q/k/v, 14 query and 2 KV heads, its
    /// 151,936-entry vocabulary): what a deployment-size model costs, for benchmarks.
    pub fn qwen2_5_0_5b_shaped() -> Self {
        Self { hidden: 896, intermediate: 4864, layers: 24, heads: 14, kv_heads: 2, max_positions: 32768, qkv_bias: true, seed: 42, vocab: 151_936 }
    }

    /// Random weights of Llama-3.2-1B's shapes (16 layers, 32 query and 8 KV heads of 64, its
    /// 128,256-entry vocabulary), for benchmarks.
    pub fn llama_3_2_1b_shaped() -> Self {
        Self { hidden: 2048, intermediate: 8192, layers: 16, heads: 32, kv_heads: 8, max_positions: 32768, qkv_bias: false, seed: 42, vocab: 128_256 }
    }

    /// The vocabulary: the tiny byte vocabulary, padded to `vocab` entries if that is larger.
    pub fn vocabulary(&self) -> Vec<String> {
        let mut v = tiny_vocab();
        let n = v.len();
        v.extend((n..self.vocab).map(|i| format!("<|filler_{i}|>")));
        v
    }
}

/// The default model's configuration (SmolLM2-135M), for size computations in tests.
pub fn smollm2_135m_config() -> crate::model::ModelConfig {
    crate::model::ModelConfig {
        architecture: crate::model::Architecture::Llama,
        vocab_size: 49152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_layers: 30,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 100000.0,
        rope_scaling: None,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        attention_bias: false,
        sliding_window: None,
    }
}

pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";


/// GPT-2's byte → printable-character map used by byte-level BPE vocabularies.
pub fn byte_to_char() -> Vec<char> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0u32..256 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    let mut map = vec![' '; 256];
    for (b, c) in printable.iter().zip(chars) {
        map[*b as usize] = char::from_u32(c).expect("valid char");
    }
    map
}

/// Vocabulary: the 3 special tokens, then the 256 byte tokens (no merges: one token per byte).
pub fn tiny_vocab() -> Vec<String> {
    let mut v: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    v.extend(byte_to_char().into_iter().map(|c| c.to_string()));
    v
}

fn tensors(spec: &TinySpec) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut rng = Rng::new(spec.seed);
    let vocab = spec.vocabulary().len();
    let hd = spec.hidden / spec.heads;
    let (h, i) = (spec.hidden, spec.intermediate);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![vocab, h], rng.vec(vocab * h, 0.5))];
    let lin = |rng: &mut Rng, o: usize, inn: usize| rng.vec(o * inn, 1.0 / (inn as f32).sqrt());
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        let norm = |rng: &mut Rng| (0..h).map(|_| 1.0 + 0.1 * rng.next_f32()).collect::<Vec<_>>();
        out.push((format!("{p}.input_layernorm.weight"), vec![h], norm(&mut rng)));
        out.push((format!("{p}.self_attn.q_proj.weight"), vec![spec.heads * hd, h], lin(&mut rng, spec.heads * hd, h)));
        out.push((format!("{p}.self_attn.k_proj.weight"), vec![spec.kv_heads * hd, h], lin(&mut rng, spec.kv_heads * hd, h)));
        out.push((format!("{p}.self_attn.v_proj.weight"), vec![spec.kv_heads * hd, h], lin(&mut rng, spec.kv_heads * hd, h)));
        if spec.qkv_bias {
            out.push((format!("{p}.self_attn.q_proj.bias"), vec![spec.heads * hd], rng.vec(spec.heads * hd, 0.1)));
            out.push((format!("{p}.self_attn.k_proj.bias"), vec![spec.kv_heads * hd], rng.vec(spec.kv_heads * hd, 0.1)));
            out.push((format!("{p}.self_attn.v_proj.bias"), vec![spec.kv_heads * hd], rng.vec(spec.kv_heads * hd, 0.1)));
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, spec.heads * hd], lin(&mut rng, h, spec.heads * hd)));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h], norm(&mut rng)));
        out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h], lin(&mut rng, i, h)));
        out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h], lin(&mut rng, i, h)));
        out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i], lin(&mut rng, h, i)));
    }
    out.push(("model.norm.weight".to_string(), vec![h], vec![1.0; h]));
    out
}

/// Writes the tiny model as a Hugging Face directory; returns `dir`.
pub fn write_hf(dir: &Path, spec: &TinySpec) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let dev = Device::Cpu;
    let mut map: HashMap<String, Tensor> = HashMap::new();
    for (name, shape, data) in tensors(spec) {
        map.insert(name, Tensor::from_vec(data, shape, &dev)?);
    }
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let vocab = spec.vocabulary().len();
    let arch = if spec.qkv_bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" };
    let config = serde_json::json!({
        "architectures": [arch],
        "vocab_size": vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": true,
        "attention_bias": spec.qkv_bias,
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json_of(&spec.vocabulary()))?;
    let tcfg = serde_json::json!({
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": false,
        "chat_template": CHATML_TEMPLATE,
    });
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&tcfg)?)?;
    Ok(dir.to_path_buf())
}

/// The tiny model's `tokenizer.json`: byte-level BPE, one token per byte, ChatML specials.
pub fn tokenizer_json() -> String {
    tokenizer_json_of(&tiny_vocab())
}

/// A byte-level BPE tokenizer over `vocab` (the tiny vocabulary first), no merges.
fn tokenizer_json_of(vocab: &[String]) -> String {
    let vocab: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, t)| (t, serde_json::Value::from(i)))
        .collect();
    let added: Vec<serde_json::Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    })
    .to_string()
}

/// Writes the same tiny model as a llama-architecture GGUF file (q/k rows permuted the way
/// llama.cpp's converter does), with weights stored as `dtype` (norms stay F32).
pub fn write_gguf(path: &Path, spec: &TinySpec, dtype: GgmlDType) -> Result<PathBuf> {
    let dev = Device::Cpu;
    let hd = spec.hidden / spec.heads;
    let mut qtensors: Vec<(String, QTensor)> = Vec::new();
    for (name, shape, data) in tensors(spec) {
        let gname = gguf_name(&name);
        let is_norm = name.ends_with("norm.weight") || name.ends_with(".bias");
        // llama.cpp permutes q/k rows of llama-architecture models only (not qwen2).
        let permute = !spec.qkv_bias;
        let data = if permute && name.ends_with("q_proj.weight") {
            crate::model::gguf::permute_rows_for_gguf(&data, shape[0], shape[1], spec.heads)
        } else if permute && name.ends_with("k_proj.weight") {
            crate::model::gguf::permute_rows_for_gguf(&data, shape[0], shape[1], spec.kv_heads)
        } else {
            data
        };
        let t = Tensor::from_vec(data, shape, &dev)?;
        let q = if is_norm { QTensor::quantize(&t, GgmlDType::F32)? } else { QTensor::quantize(&t, dtype)? };
        qtensors.push((gname, q));
    }
    use gguf_file::Value as V;
    let vocab = spec.vocabulary();
    let arch = if spec.qkv_bias { "qwen2" } else { "llama" };
    let md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        ("general.name".into(), V::String("tiny".into())),
        (format!("{arch}.block_count"), V::U32(spec.layers as u32)),
        (format!("{arch}.embedding_length"), V::U32(spec.hidden as u32)),
        (format!("{arch}.feed_forward_length"), V::U32(spec.intermediate as u32)),
        (format!("{arch}.attention.head_count"), V::U32(spec.heads as u32)),
        (format!("{arch}.attention.head_count_kv"), V::U32(spec.kv_heads as u32)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), V::F32(1e-5)),
        (format!("{arch}.rope.freq_base"), V::F32(10000.0)),
        (format!("{arch}.context_length"), V::U32(spec.max_positions as u32)),
        (format!("{arch}.rope.dimension_count"), V::U32(hd as u32)),
        ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), V::String("default".into())),
        ("tokenizer.ggml.tokens".into(), V::Array(vocab.iter().map(|t| V::String(t.clone())).collect())),
        (
            "tokenizer.ggml.token_type".into(),
            V::Array((0..vocab.len()).map(|i| V::I32(if i < SPECIALS.len() { 3 } else { 1 })).collect()),
        ),
        ("tokenizer.ggml.merges".into(), V::Array(vec![])),
        ("tokenizer.ggml.eos_token_id".into(), V::U32(2)),
        ("tokenizer.ggml.padding_token_id".into(), V::U32(0)),
        ("tokenizer.ggml.add_bos_token".into(), V::Bool(false)),
        ("tokenizer.chat_template".into(), V::String(CHATML_TEMPLATE.into())),
    ];
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path)?;
    gguf_file::write(&mut f, &md_refs, &t_refs)?;
    Ok(path.to_path_buf())
}

fn gguf_name(hf: &str) -> String {
    if hf == "model.embed_tokens.weight" {
        return "token_embd.weight".into();
    }
    if hf == "model.norm.weight" {
        return "output_norm.weight".into();
    }
    let rest = hf.strip_prefix("model.layers.").unwrap_or(hf);
    let (layer, tail) = rest.split_once('.').unwrap_or((rest, ""));
    let t = tail
        .replace("self_attn.q_proj", "attn_q")
        .replace("self_attn.k_proj", "attn_k")
        .replace("self_attn.v_proj", "attn_v")
        .replace("self_attn.o_proj", "attn_output")
        .replace("mlp.gate_proj", "ffn_gate")
        .replace("mlp.up_proj", "ffn_up")
        .replace("mlp.down_proj", "ffn_down")
        .replace("post_attention_layernorm", "ffn_norm")
        .replace("input_layernorm", "attn_norm");
    format!("blk.{layer}.{t}")
}

/// The tiny model and absorb options of the server tests in `dir`: `(model directory, options
/// file)`. The options train in a fraction of a second (window 32, one epoch each, 2–4 extractive
/// QA pairs).
pub fn write_tiny_server_setup(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    let model = write_hf(&dir.join("tiny"), &TinySpec::default())?;
    let options = dir.join("absorb.json");
    let json = serde_json::json!({"plan": {"window": 32, "context_tokens": 16},
                                  "train": {"epochs": [1, 1]},
                                  "qa": {"use_model": false, "max_pairs": 4, "min_pairs": 2}});
    std::fs::write(&options, json.to_string())?;
    Ok((model, options))
}
