//! Architecture hyper-parameters shared by every loader (GGUF metadata, HF `config.json`).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The Llama-family variants we run. They differ only in small details, so one decoder serves all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Llama,
    Qwen2,
    Mistral,
}

impl Architecture {
    pub fn parse(name: &str, source: &Path) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "llama" | "llamaforcausallm" => Ok(Self::Llama),
            "qwen2" | "qwen2forcausallm" => Ok(Self::Qwen2),
            "mistral" | "mistralforcausallm" => Ok(Self::Mistral),
            other => bail!(
                "{}: unknown architecture '{other}' (supported: llama, qwen2, mistral)",
                source.display()
            ),
        }
    }
}

/// How RoPE frequencies are adjusted for long context.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3.x: low frequencies divided by `factor`, high ones kept, smooth in between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// Positions divided by `factor`.
    Linear { factor: f32 },
    /// Per-frequency divisors shipped with the weights (GGUF `rope_freqs.weight`).
    Factors { factors: Vec<f32> },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2).
    pub attention_bias: bool,
    /// Mistral-style local attention: a query sees at most this many keys.
    pub sliding_window: Option<usize>,
}

impl ModelConfig {
    pub fn validate(&self, source: &Path) -> Result<()> {
        let ctx = || format!("{}: inconsistent model configuration", source.display());
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.num_layers == 0 {
            return Err(anyhow::anyhow!("heads and layers must be > 0")).with_context(ctx);
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(anyhow::anyhow!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads,
                self.num_kv_heads
            ))
            .with_context(ctx);
        }
        if self.head_dim % 2 != 0 {
            return Err(anyhow::anyhow!("head_dim {} must be even for RoPE", self.head_dim))
                .with_context(ctx);
        }
        Ok(())
    }

    /// Query heads that share one key/value head.
    pub fn kv_groups(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Inverse RoPE frequencies, one per rotated pair, after any scaling.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f32> = (0..d)
            .step_by(2)
            .map(|i| 1.0 / self.rope_theta.powf(i as f32 / d as f32))
            .collect();
        match &self.rope_scaling {
            None | Some(RopeScaling::Linear { .. }) => base,
            Some(RopeScaling::Factors { factors }) => base
                .iter()
                .enumerate()
                .map(|(i, f)| f / factors.get(i).copied().unwrap_or(1.0))
                .collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old = *original_max_position_embeddings as f32;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth =
                                (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Position multiplier for linear RoPE scaling.
    pub fn rope_position_scale(&self) -> f32 {
        match &self.rope_scaling {
            Some(RopeScaling::Linear { factor }) => 1.0 / factor,
            _ => 1.0,
        }
    }

    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read model config", path.display()))?;
        let raw: HfConfig = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a valid model config", path.display()))?;
        let arch_name = raw
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .or(raw.model_type.clone())
            .with_context(|| format!("{}: neither 'architectures' nor 'model_type' is set", path.display()))?;
        let architecture = Architecture::parse(&arch_name, path)?;
        let num_heads = raw.num_attention_heads;
        let rope_scaling = match &raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => parse_hf_rope_scaling(v, path)?,
        };
        let cfg = ModelConfig {
            architecture,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads,
            num_kv_heads: raw.num_key_value_heads.unwrap_or(num_heads),
            head_dim: raw.head_dim.unwrap_or(raw.hidden_size / num_heads.max(1)),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5),
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_bias: raw
                .attention_bias
                .unwrap_or(architecture == Architecture::Qwen2),
            sliding_window: match architecture {
                Architecture::Mistral => raw.sliding_window,
                // Qwen2 configs carry a window but only apply it with use_sliding_window.
                Architecture::Qwen2 if raw.use_sliding_window == Some(true) => raw.sliding_window,
                _ => None,
            },
        };
        cfg.validate(path)?;
        Ok(cfg)
    }
}

fn parse_hf_rope_scaling(v: &serde_json::Value, path: &Path) -> Result<Option<RopeScaling>> {
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("default");
    let num = |k: &str| v.get(k).and_then(|x| x.as_f64()).map(|x| x as f32);
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: num("factor").unwrap_or(1.0),
        })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: num("factor").unwrap_or(8.0),
            low_freq_factor: num("low_freq_factor").unwrap_or(1.0),
            high_freq_factor: num("high_freq_factor").unwrap_or(4.0),
            original_max_position_embeddings: num("original_max_position_embeddings")
                .unwrap_or(8192.0) as usize,
        })),
        other => bail!("{}: unsupported rope_scaling type '{other}'", path.display()),
    }
}

#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f32>,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
}
