//! Per-document adapters over the frozen base model: Gated Memory (LIFT §3.4) and LoRA (the LIFT
//! authors' later version), behind one type for callers ([`AnyAdapter`]), plus their storage on
//! disk ([`manifest`]: `adapter.safetensors` + `manifest.json`).
//!
//! Tensor names (stable; they are the on-disk format):
//! - Gated Memory: `layers.{l}.{mem_w1|mem_b1|mem_w2|mem_b2|gate_w1|gate_b1|gate_w2}`, `[heads, in, out]`;
//! - LoRA: `layers.{l}.{q_proj|k_proj|…|down_proj}.{lora_a|lora_b}`, `a: [in, r]`, `b: [r, out]`.
//!
//! Everything under `layers.` belongs to the adapter; an [`AdapterBundle`] may carry extra named
//! tensors beside it (e.g. a FltLM filter head, `filter.head.weight`) under any other name.

pub mod gated_memory;
pub mod init;
pub mod lora;
pub mod manifest;

pub use gated_memory::{GatedMemory, GatedMemoryLayer};
pub use lora::{Lora, LoraConfig, LoraPair};
pub use manifest::{load, save, BaseModelRef, DocumentRef, Manifest, FORMAT_VERSION};

use crate::model::{Adapter, DecodeMix, ModelConfig, Projection};
use anyhow::{bail, Context};
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The adapter kinds the server trains and serves (`--adapter gated-memory|lora` on the CLI).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AdapterKind {
    GatedMemory,
    Lora,
}

impl AdapterKind {
    /// The serde name (`gated_memory`, `lora`).
    pub fn name(self) -> &'static str {
        match self {
            AdapterKind::GatedMemory => "gated_memory",
            AdapterKind::Lora => "lora",
        }
    }
}

impl std::fmt::Display for AdapterKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Prefix of every adapter tensor name; extras must use other names.
pub const ADAPTER_PREFIX: &str = "layers.";

/// Either adapter kind. Implements [`Adapter`] by delegation, so the decoder takes `&AnyAdapter`.
#[derive(Clone)]
pub enum AnyAdapter {
    GatedMemory(GatedMemory),
    Lora(Lora),
}

impl From<GatedMemory> for AnyAdapter {
    fn from(a: GatedMemory) -> Self {
        AnyAdapter::GatedMemory(a)
    }
}

impl From<Lora> for AnyAdapter {
    fn from(a: Lora) -> Self {
        AnyAdapter::Lora(a)
    }
}

impl AnyAdapter {
    pub fn kind(&self) -> AdapterKind {
        match self {
            AnyAdapter::GatedMemory(_) => AdapterKind::GatedMemory,
            AnyAdapter::Lora(_) => AdapterKind::Lora,
        }
    }

    /// Trainable parameters; empty for a detached (inference) copy.
    pub fn vars(&self) -> &[Var] {
        match self {
            AnyAdapter::GatedMemory(a) => a.vars(),
            AnyAdapter::Lora(a) => a.vars(),
        }
    }

    /// Plain-tensor copy for inference (no autograd graph can reach the KV cache).
    pub fn detached(&self) -> Self {
        match self {
            AnyAdapter::GatedMemory(a) => AnyAdapter::GatedMemory(a.detached()),
            AnyAdapter::Lora(a) => AnyAdapter::Lora(a.detached()),
        }
    }

    /// The same values as fresh `Var`s, to resume training (e.g. after `manifest::load`).
    pub fn trainable(&self, cfg: &ModelConfig) -> anyhow::Result<Self> {
        Ok(match self {
            AnyAdapter::GatedMemory(a) => AnyAdapter::GatedMemory(GatedMemory::from_layers(a.layers.clone(), true)?),
            AnyAdapter::Lora(a) => AnyAdapter::Lora(a.trainable(cfg)?),
        })
    }

    pub fn num_parameters(&self) -> usize {
        match self {
            AnyAdapter::GatedMemory(a) => a.num_parameters(),
            AnyAdapter::Lora(a) => a.num_parameters(),
        }
    }

    /// Bytes of the parameters as stored and held in memory (f32).
    pub fn bytes(&self) -> usize {
        self.num_parameters() * std::mem::size_of::<f32>()
    }

    /// Adapted layers, ascending.
    pub fn layers(&self) -> Vec<usize> {
        match self {
            AnyAdapter::GatedMemory(a) => a.layers.keys().copied().collect(),
            AnyAdapter::Lora(a) => a.layers(),
        }
    }

    /// The LoRA configuration (None for Gated Memory).
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        match self {
            AnyAdapter::GatedMemory(_) => None,
            AnyAdapter::Lora(a) => Some(a.config()),
        }
    }

    /// All parameters under their stable names, in a fixed order (by layer, then the kind's own
    /// order). The tensors are the adapter's own (`Var`-backed when trainable).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        match self {
            AnyAdapter::GatedMemory(a) => a
                .layers
                .iter()
                .flat_map(|(l, layer)| {
                    layer.named().into_iter().map(move |(n, t)| (format!("{ADAPTER_PREFIX}{l}.{n}"), t.clone()))
                })
                .collect(),
            AnyAdapter::Lora(a) => a
                .pairs()
                .flat_map(|(l, p, pair)| {
                    [
                        (format!("{ADAPTER_PREFIX}{l}.{}.lora_a", p.name()), pair.a.clone()),
                        (format!("{ADAPTER_PREFIX}{l}.{}.lora_b", p.name()), pair.b.clone()),
                    ]
                })
                .collect(),
        }
    }

    /// Rebuilds an adapter (detached, for inference) from `named_tensors()` output, checking
    /// names, shapes and dtypes against the model. LoRA needs its configuration (`alpha` cannot be
    /// recovered from the tensors); Gated Memory ignores `lora`.
    pub fn from_named_tensors(
        kind: AdapterKind,
        config: &ModelConfig,
        lora: Option<&LoraConfig>,
        tensors: impl IntoIterator<Item = (String, Tensor)>,
    ) -> anyhow::Result<Self> {
        // layer → (rest of the name → tensor)
        let mut by_layer: BTreeMap<usize, BTreeMap<String, Tensor>> = BTreeMap::new();
        for (name, t) in tensors {
            let (layer, rest) = name
                .strip_prefix(ADAPTER_PREFIX)
                .and_then(|r| r.split_once('.'))
                .and_then(|(l, rest)| Some((l.parse::<usize>().ok()?, rest)))
                .with_context(|| format!("'{name}' is not an adapter tensor name (layers.<n>.<param>)"))?;
            if layer >= config.num_layers {
                bail!("'{name}': layer {layer} does not exist (the model has {} layers)", config.num_layers);
            }
            if by_layer.entry(layer).or_default().insert(rest.to_string(), t).is_some() {
                bail!("'{name}' appears twice");
            }
        }
        match kind {
            AdapterKind::GatedMemory => {
                let mut layers = BTreeMap::new();
                for (l, named) in by_layer {
                    layers.insert(l, GatedMemory::layer_from_named(config, l, named)?);
                }
                if layers.is_empty() {
                    bail!("a Gated Memory adapter needs at least one layer");
                }
                Ok(AnyAdapter::GatedMemory(GatedMemory::from_layers(layers, false)?))
            }
            AdapterKind::Lora => {
                let lora = lora.context("a LoRA adapter needs its LoraConfig (rank, alpha, targets, layers)")?;
                let mut layers = BTreeMap::new();
                for (l, named) in by_layer {
                    let mut parts: BTreeMap<&str, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
                    for (rest, t) in named {
                        let (proj, which) = rest
                            .split_once('.')
                            .and_then(|(p, w)| Some((Projection::ALL.into_iter().find(|x| x.name() == p)?, w)))
                            .with_context(|| format!("'layers.{l}.{rest}' is not a LoRA tensor name"))?;
                        let slot = parts.entry(proj.name()).or_default();
                        match which {
                            "lora_a" => slot.0 = Some(t),
                            "lora_b" => slot.1 = Some(t),
                            _ => bail!("'layers.{l}.{rest}' is not a LoRA tensor name (lora_a / lora_b)"),
                        }
                    }
                    let mut pairs = Vec::new();
                    for (pname, (a, b)) in parts {
                        let p = Projection::ALL.into_iter().find(|x| x.name() == pname).expect("parsed above");
                        let (Some(a), Some(b)) = (a, b) else {
                            bail!("LoRA layers.{l}.{pname}: lora_a and lora_b must both be present");
                        };
                        pairs.push((p, LoraPair { a, b }));
                    }
                    layers.insert(l, pairs);
                }
                Ok(AnyAdapter::Lora(Lora::from_pairs(config, lora, layers, false)?))
            }
        }
    }
}

impl Adapter for AnyAdapter {
    fn linear_delta(&self, layer: usize, proj: Projection, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        match self {
            AnyAdapter::GatedMemory(a) => a.linear_delta(layer, proj, x),
            AnyAdapter::Lora(a) => a.linear_delta(layer, proj, x),
        }
    }

    fn mix_attention(&self, layer: usize, q_pre_rope: &Tensor, attn: Tensor) -> candle_core::Result<Tensor> {
        match self {
            AnyAdapter::GatedMemory(a) => a.mix_attention(layer, q_pre_rope, attn),
            AnyAdapter::Lora(a) => a.mix_attention(layer, q_pre_rope, attn),
        }
    }

    fn first_layer(&self) -> usize {
        match self {
            AnyAdapter::GatedMemory(a) => a.first_layer(),
            AnyAdapter::Lora(a) => a.first_layer(),
        }
    }

    fn decode_mix(&self, layer: usize) -> DecodeMix<'_> {
        match self {
            AnyAdapter::GatedMemory(a) => a.decode_mix(layer),
            AnyAdapter::Lora(a) => a.decode_mix(layer),
        }
    }
}

/// An adapter plus extra named tensors stored in the same file (e.g. a FltLM filter head as
/// `filter.head.weight`). Extra names must not start with `layers.`; their dtype is kept as is.
#[derive(Clone)]
pub struct AdapterBundle {
    pub adapter: AnyAdapter,
    pub extras: BTreeMap<String, Tensor>,
}

impl AdapterBundle {
    /// A bundle without extras.
    pub fn new(adapter: impl Into<AnyAdapter>) -> Self {
        Self { adapter: adapter.into(), extras: BTreeMap::new() }
    }

    /// Adapter tensors then extras, as stored.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut v = self.adapter.named_tensors();
        v.extend(self.extras.iter().map(|(k, t)| (k.clone(), t.clone())));
        v
    }

    /// Elements of everything stored (adapter + extras).
    pub fn num_parameters(&self) -> usize {
        self.adapter.num_parameters() + self.extras.values().map(|t| t.elem_count()).sum::<usize>()
    }

    /// Bytes of everything stored (adapter in f32 + extras in their own dtype): what the bundle
    /// holds in memory and what the tensor data in `adapter.safetensors` takes.
    pub fn bytes(&self) -> usize {
        self.adapter.bytes() + self.extras.values().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum::<usize>()
    }

    /// Plain-tensor copy of the adapter and the extras.
    pub fn detached(&self) -> Self {
        Self {
            adapter: self.adapter.detached(),
            extras: self.extras.iter().map(|(k, t)| (k.clone(), t.detach())).collect(),
        }
    }

    /// Checks the extras' names (not under `layers.`, no clash with the adapter).
    pub fn validate(&self) -> anyhow::Result<()> {
        for name in self.extras.keys() {
            if name.starts_with(ADAPTER_PREFIX) {
                bail!("extra tensor '{name}': names under '{ADAPTER_PREFIX}' are reserved for the adapter");
            }
            if name.is_empty() || name == "__metadata__" {
                bail!("extra tensor name '{name}' is not allowed");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::smollm2_135m_config as smollm2_135m;

    #[test]
    fn adapter_sizes_on_smollm2_135m() {
        let c = smollm2_135m();
        // Gated Memory, all 30 layers, no bias: per layer 9 heads × (64·128 + 128·64 + 64·8 + 8·1).
        let gm = GatedMemory::parameter_count(&c, 30, false);
        assert_eq!(gm, 30 * 9 * (64 * 128 + 128 * 64 + 64 * 8 + 8));
        assert_eq!(gm, 4_564_080);
        // LoRA r = 128 on all seven projections of all 30 layers.
        let lora = LoraConfig::default().num_parameters(&c);
        assert_eq!(lora, 39_075_840);
        eprintln!("135M: gated memory {gm} params / {} bytes; LoRA r=128 {lora} params / {} bytes", gm * 4, lora * 4);
    }

    #[test]
    fn kind_names_are_snake_case() {
        assert_eq!(serde_json::to_string(&AdapterKind::GatedMemory).unwrap(), "\"gated_memory\"");
        assert_eq!(serde_json::from_str::<AdapterKind>("\"lora\"").unwrap(), AdapterKind::Lora);
        assert_eq!(AdapterKind::GatedMemory.to_string(), "gated_memory");
    }

    #[test]
    fn named_tensors_round_trip_and_bad_names_are_refused() {
        let mut c = smollm2_135m();
        c.num_layers = 3;
        c.hidden_size = 32;
        c.intermediate_size = 48;
        c.num_heads = 2;
        c.num_kv_heads = 1;
        c.head_dim = 16;
        let dev = candle_core::Device::Cpu;
        let gm = AnyAdapter::GatedMemory(GatedMemory::new(&c, &[2, 0], false, 1, &dev).unwrap());
        let names: Vec<String> = gm.named_tensors().into_iter().map(|x| x.0).collect();
        assert_eq!(names[0], "layers.0.mem_w1");
        assert_eq!(names.len(), 8);
        let back = AnyAdapter::from_named_tensors(AdapterKind::GatedMemory, &c, None, gm.named_tensors()).unwrap();
        assert_eq!(back.layers(), vec![0, 2]);
        assert_eq!(back.num_parameters(), gm.num_parameters());
        assert_eq!(back.bytes(), 4 * gm.num_parameters());
        assert_eq!(gm.vars().len(), 8);

        let cfg = LoraConfig { rank: 2, alpha: 4.0, targets: vec![Projection::Up, Projection::Q], layers: vec![1] };
        let lora = AnyAdapter::Lora(Lora::new(&c, &cfg, 3, &dev).unwrap());
        let names: Vec<String> = lora.named_tensors().into_iter().map(|x| x.0).collect();
        assert_eq!(names, ["layers.1.q_proj.lora_a", "layers.1.q_proj.lora_b", "layers.1.up_proj.lora_a", "layers.1.up_proj.lora_b"]);
        let rebuilt = AnyAdapter::from_named_tensors(AdapterKind::Lora, &c, Some(&cfg), lora.named_tensors()).unwrap();
        assert_eq!(rebuilt.lora_config(), lora.lora_config());

        // Missing LoraConfig, a missing factor, a wrong shape, a foreign name, a layer out of range.
        assert!(AnyAdapter::from_named_tensors(AdapterKind::Lora, &c, None, lora.named_tensors()).is_err());
        let mut t = lora.named_tensors();
        t.pop();
        assert!(AnyAdapter::from_named_tensors(AdapterKind::Lora, &c, Some(&cfg), t).is_err());
        let mut t = lora.named_tensors();
        t[0].1 = candle_core::Tensor::zeros((32, 3), candle_core::DType::F32, &dev).unwrap();
        let e = AnyAdapter::from_named_tensors(AdapterKind::Lora, &c, Some(&cfg), t).err().unwrap().to_string();
        assert!(e.contains("q_proj") && e.contains("[32, 3]"), "{e}");
        let mut t = gm.named_tensors();
        t.push(("layers.0.bogus".into(), t[0].1.clone()));
        assert!(AnyAdapter::from_named_tensors(AdapterKind::GatedMemory, &c, None, t).is_err());
        let mut t = gm.named_tensors();
        t[0].0 = "layers.7.mem_w1".into();
        assert!(AnyAdapter::from_named_tensors(AdapterKind::GatedMemory, &c, None, t).is_err());
    }
}
