//! LoRA (low-rank adaptation) on the decoder's linear projections: for a target projection `W`
//! (`y = x·Wᵀ`), the adapted output is `y + (x·A)·B·(α/r)` with `A: [in, r]` and `B: [r, out]`.
//! `A` starts kaiming-uniform (bound `1/√in`, as PEFT's `kaiming_uniform_(a=√5)`), `B` starts at
//! zero, so a fresh LoRA is exactly the base model and the first gradient reaches `B` only.
//!
//! Layout note: our `A`/`B` are the transposes of PEFT's `lora_A.weight` (`[r, in]`) and
//! `lora_B.weight` (`[out, r]`), so the forward pass needs no transposes.
//!
//! The later version of "LIFT: Improving Long Context Understanding of Large Language Models
//! through Long Input Fine-Tuning" replaced Gated Memory with LoRA at r = 128, α = 256 on all
//! linear layers, trained with AdamW at lr 5e-5: that is `LoraConfig::default()` and
//! [`RECOMMENDED_LR`].

use crate::model::{Adapter, DecodeMix, ModelConfig, Projection};
use super::init::Rng;
use candle_core::{Device, Result, Tensor, Var};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Learning rate the LIFT authors used with [`LoraConfig::default`] (AdamW).
pub const RECOMMENDED_LR: f64 = 5e-5;

/// Which projections of which layers get a low-rank update, and its rank and scale.
/// Every field has a default, so `{"rank": 16}` is a valid JSON configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank `r` of the update.
    pub rank: usize,
    /// The update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Adapted projections (`"q"`, `"k"`, `"v"`, `"o"`, `"gate"`, `"up"`, `"down"`).
    pub targets: Vec<Projection>,
    /// Adapted layers; empty = all layers.
    pub layers: Vec<usize>,
}

impl Default for LoraConfig {
    /// r = 128, α = 256, all seven linear projections of every layer (the LIFT authors' LoRA).
    fn default() -> Self {
        Self { rank: 128, alpha: 256.0, targets: Projection::ALL.to_vec(), layers: Vec::new() }
    }
}

impl LoraConfig {
    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// The adapted layers of a model with `num_layers` layers, ascending.
    pub fn resolved_layers(&self, num_layers: usize) -> Vec<usize> {
        if self.layers.is_empty() {
            (0..num_layers).collect()
        } else {
            let mut l = self.layers.clone();
            l.sort_unstable();
            l.dedup();
            l
        }
    }

    /// The same configuration with targets in `Projection::ALL` order and layers sorted, both
    /// without duplicates (what an adapter and its manifest record).
    pub fn normalized(&self) -> Self {
        let targets = Projection::ALL.into_iter().filter(|p| self.targets.contains(p)).collect();
        let mut layers = self.layers.clone();
        layers.sort_unstable();
        layers.dedup();
        Self { rank: self.rank, alpha: self.alpha, targets, layers }
    }

    /// Checks the configuration against a model.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        if self.rank == 0 {
            candle_core::bail!("LoRA rank must be > 0");
        }
        if !self.alpha.is_finite() {
            candle_core::bail!("LoRA alpha must be finite, got {}", self.alpha);
        }
        if self.targets.is_empty() {
            candle_core::bail!("LoRA needs at least one target projection");
        }
        if let Some(&l) = self.layers.iter().find(|&&l| l >= cfg.num_layers) {
            candle_core::bail!("LoRA layer {l} does not exist (the model has {} layers)", cfg.num_layers);
        }
        Ok(())
    }

    /// Trainable parameters this configuration gives on a model (without allocating it).
    pub fn num_parameters(&self, cfg: &ModelConfig) -> usize {
        let n = self.normalized();
        let per_layer: usize = n
            .targets
            .iter()
            .map(|&p| {
                let (i, o) = projection_dims(cfg, p);
                self.rank * (i + o)
            })
            .sum();
        per_layer * n.resolved_layers(cfg.num_layers).len()
    }
}

/// `(in, out)` features of projection `p` in every layer of a model with configuration `cfg`.
pub fn projection_dims(cfg: &ModelConfig, p: Projection) -> (usize, usize) {
    let (h, q, kv, i) = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    );
    match p {
        Projection::Q => (h, q),
        Projection::K | Projection::V => (h, kv),
        Projection::O => (q, h),
        Projection::Gate | Projection::Up => (h, i),
        Projection::Down => (i, h),
    }
}

/// The two factors of one adapted projection: `a: [in, r]`, `b: [r, out]`.
#[derive(Clone)]
pub struct LoraPair {
    pub a: Tensor,
    pub b: Tensor,
}

/// A LoRA adapter. Training holds `Var`s; `detached()` gives the plain tensors used for inference.
#[derive(Clone)]
pub struct Lora {
    config: LoraConfig,
    scale: f64,
    /// Per adapted layer, its adapted projections in `Projection::ALL` order.
    layers: BTreeMap<usize, Vec<(Projection, LoraPair)>>,
    vars: Vec<Var>,
}

impl Lora {
    /// Fresh trainable adapter: `A` kaiming-uniform (deterministic from `seed`), `B` zeros.
    pub fn new(cfg: &ModelConfig, lora: &LoraConfig, seed: u64, device: &Device) -> Result<Self> {
        lora.validate(cfg)?;
        let config = lora.normalized();
        let r = config.rank;
        let mut rng = Rng::new(seed);
        let mut layers = BTreeMap::new();
        for l in config.resolved_layers(cfg.num_layers) {
            let mut pairs = Vec::new();
            for &p in &config.targets {
                let (i, o) = projection_dims(cfg, p);
                let bound = 1.0 / (i as f32).sqrt();
                let a = Tensor::from_vec(rng.vec(i * r, bound), (i, r), device)?;
                let b = Tensor::zeros((r, o), candle_core::DType::F32, device)?;
                pairs.push((p, LoraPair { a, b }));
            }
            layers.insert(l, pairs);
        }
        Self::from_pairs(cfg, &config, layers, true)
    }

    /// Wraps existing factors (e.g. loaded from disk), checking them against the model and the
    /// configuration: exactly the configured (layer, projection) pairs, f32, the right shapes.
    /// `trainable` makes them `Var`s (to train or resume training); otherwise they are used as is.
    pub fn from_pairs(
        cfg: &ModelConfig,
        lora: &LoraConfig,
        layers: BTreeMap<usize, Vec<(Projection, LoraPair)>>,
        trainable: bool,
    ) -> Result<Self> {
        lora.validate(cfg)?;
        let config = lora.normalized();
        let r = config.rank;
        let want_layers = config.resolved_layers(cfg.num_layers);
        let have_layers: Vec<usize> = layers.keys().copied().collect();
        if have_layers != want_layers {
            candle_core::bail!("LoRA factors cover layers {have_layers:?}, the configuration says {want_layers:?}");
        }
        let mut vars = Vec::new();
        let mut out = BTreeMap::new();
        for (l, pairs) in layers {
            let mut by_proj: Vec<(Projection, LoraPair)> = Vec::new();
            for &p in &config.targets {
                let Some((_, pair)) = pairs.iter().find(|(q, _)| *q == p) else {
                    candle_core::bail!("LoRA layer {l}: {} factors missing", p.name());
                };
                let (i, o) = projection_dims(cfg, p);
                for (what, t, want) in [("lora_a", &pair.a, [i, r]), ("lora_b", &pair.b, [r, o])] {
                    if t.dims() != want {
                        candle_core::bail!("LoRA layers.{l}.{}.{what}: shape {:?}, expected {want:?}", p.name(), t.dims());
                    }
                    if t.dtype() != candle_core::DType::F32 {
                        candle_core::bail!("LoRA layers.{l}.{}.{what}: dtype {:?}, expected F32", p.name(), t.dtype());
                    }
                }
                let pair = if trainable {
                    let (va, vb) = (Var::from_tensor(&pair.a)?, Var::from_tensor(&pair.b)?);
                    let pair = LoraPair { a: va.as_tensor().clone(), b: vb.as_tensor().clone() };
                    vars.push(va);
                    vars.push(vb);
                    pair
                } else {
                    pair.clone()
                };
                by_proj.push((p, pair));
            }
            if pairs.len() != by_proj.len() {
                let extra: Vec<&str> =
                    pairs.iter().filter(|(p, _)| !config.targets.contains(p)).map(|(p, _)| p.name()).collect();
                candle_core::bail!("LoRA layer {l}: factors for {extra:?}, which the configuration does not target");
            }
            out.insert(l, by_proj);
        }
        Ok(Self { scale: config.scale(), config, layers: out, vars })
    }

    /// The (normalized) configuration.
    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Adapted layers, ascending.
    pub fn layers(&self) -> Vec<usize> {
        self.layers.keys().copied().collect()
    }

    /// Every adapted projection, by layer then in `Projection::ALL` order.
    pub fn pairs(&self) -> impl Iterator<Item = (usize, Projection, &LoraPair)> + '_ {
        self.layers.iter().flat_map(|(&l, v)| v.iter().map(move |(p, pair)| (l, *p, pair)))
    }

    pub fn get(&self, layer: usize, proj: Projection) -> Option<&LoraPair> {
        self.layers.get(&layer)?.iter().find(|(p, _)| *p == proj).map(|(_, pair)| pair)
    }

    /// Trainable parameters (`a`, `b` of each pair in `pairs()` order; empty for a detached copy).
    pub fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Plain-tensor copy for inference.
    pub fn detached(&self) -> Self {
        let layers = self
            .layers
            .iter()
            .map(|(&l, v)| {
                let v = v.iter().map(|(p, x)| (*p, LoraPair { a: x.a.detach(), b: x.b.detach() })).collect();
                (l, v)
            })
            .collect();
        Self { config: self.config.clone(), scale: self.scale, layers, vars: Vec::new() }
    }

    /// The same factors as fresh `Var`s (to resume training from a loaded adapter).
    pub fn trainable(&self, cfg: &ModelConfig) -> Result<Self> {
        Self::from_pairs(cfg, &self.config, self.layers.clone(), true)
    }

    /// The update of projection `proj` in `layer` as a weight, `[out, in]`: `scale · (A·B)ᵀ`
    /// (what merging the adapter into a frozen weight adds).
    pub fn weight_delta(&self, layer: usize, proj: Projection) -> Result<Option<Tensor>> {
        let Some(pair) = self.get(layer, proj) else { return Ok(None) };
        Ok(Some((pair.a.matmul(&pair.b)?.t()?.contiguous()? * self.scale)?))
    }

    pub fn num_parameters(&self) -> usize {
        self.pairs().map(|(_, _, x)| x.a.elem_count() + x.b.elem_count()).sum()
    }
}

impl Adapter for Lora {
    fn linear_delta(&self, layer: usize, proj: Projection, x: &Tensor) -> Result<Option<Tensor>> {
        let Some(pair) = self.get(layer, proj) else { return Ok(None) };
        let dims = x.dims().to_vec();
        let Some(&inp) = dims.last() else { candle_core::bail!("LoRA input must have a feature dimension") };
        let rows = x.elem_count() / inp.max(1);
        let x2 = x.reshape((rows, inp))?.to_dtype(pair.a.dtype())?;
        // One row (decode) runs as two: the CPU gemm takes a different path for a single row,
        // and a sequence must get the same arithmetic alone as in a batch of decoding sequences
        // (`Decoder::forward_batch`), where its row shares the matmul with others.
        let single = rows == 1 && x2.device().is_cpu();
        let x2 = if single { Tensor::cat(&[&x2, &x2], 0)? } else { x2 };
        // Scale the narrow [rows, r] intermediate rather than the [rows, out] result.
        let h = (x2.matmul(&pair.a)? * self.scale)?;
        let d = h.matmul(&pair.b)?.to_dtype(x.dtype())?;
        let d = if single { d.narrow(0, 0, 1)? } else { d };
        let mut out = dims;
        *out.last_mut().expect("non-empty dims") = d.dim(1)?;
        Ok(Some(d.reshape(out)?))
    }

    fn first_layer(&self) -> usize {
        self.layers.keys().next().copied().unwrap_or(usize::MAX)
    }

    fn decode_mix(&self, _layer: usize) -> DecodeMix<'_> {
        DecodeMix::Identity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::smollm2_135m_config as smollm2_135m;

    #[test]
    fn projection_dims_follow_the_model() {
        let c = smollm2_135m();
        assert_eq!(projection_dims(&c, Projection::Q), (576, 576));
        assert_eq!(projection_dims(&c, Projection::K), (576, 192));
        assert_eq!(projection_dims(&c, Projection::V), (576, 192));
        assert_eq!(projection_dims(&c, Projection::O), (576, 576));
        assert_eq!(projection_dims(&c, Projection::Gate), (576, 1536));
        assert_eq!(projection_dims(&c, Projection::Up), (576, 1536));
        assert_eq!(projection_dims(&c, Projection::Down), (1536, 576));
    }

    #[test]
    fn default_lora_size_on_smollm2_135m() {
        let c = smollm2_135m();
        let d = LoraConfig::default();
        assert_eq!(d.scale(), 2.0);
        // Per layer: q 2·73728, k/v 98304 each, o 147456, gate/up/down 270336 each.
        assert_eq!(d.num_parameters(&c), 1_302_528 * 30);
        let small = LoraConfig { rank: 8, alpha: 16.0, targets: vec![Projection::V, Projection::Q], layers: vec![3, 1, 3] };
        assert_eq!(small.num_parameters(&c), 2 * 8 * ((576 + 576) + (576 + 192)));
        assert_eq!(small.normalized().targets, vec![Projection::Q, Projection::V]);
        assert_eq!(small.normalized().layers, vec![1, 3]);
    }

    #[test]
    fn config_json_defaults_and_validation() {
        let c: LoraConfig = serde_json::from_str(r#"{"rank": 16, "targets": ["q", "v"]}"#).unwrap();
        assert_eq!(c.rank, 16);
        assert_eq!(c.alpha, 256.0);
        assert_eq!(c.targets, vec![Projection::Q, Projection::V]);
        assert!(c.layers.is_empty());
        assert!(serde_json::from_str::<LoraConfig>(r#"{"rnk": 16}"#).is_err());
        let m = smollm2_135m();
        assert!(LoraConfig { rank: 0, ..Default::default() }.validate(&m).is_err());
        assert!(LoraConfig { layers: vec![30], ..Default::default() }.validate(&m).is_err());
        assert!(LoraConfig { targets: vec![], ..Default::default() }.validate(&m).is_err());
    }

    #[test]
    fn fresh_lora_is_deterministic_and_zero_delta() {
        let mut c = smollm2_135m();
        c.num_layers = 2;
        let cfg = LoraConfig { rank: 4, alpha: 8.0, targets: vec![Projection::Down, Projection::K], layers: vec![] };
        let a = Lora::new(&c, &cfg, 7, &Device::Cpu).unwrap();
        let b = Lora::new(&c, &cfg, 7, &Device::Cpu).unwrap();
        assert_eq!(a.vars().len(), 2 * 2 * 2);
        assert_eq!(a.num_parameters(), cfg.num_parameters(&c));
        for ((_, _, x), (_, _, y)) in a.pairs().zip(b.pairs()) {
            let d = (&x.a - &y.a).unwrap().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(d, 0.0);
        }
        let x = Tensor::ones((1, 3, 1536), candle_core::DType::F32, &Device::Cpu).unwrap();
        let d = a.linear_delta(1, Projection::Down, &x).unwrap().unwrap();
        assert_eq!(d.dims(), &[1, 3, 576]);
        assert_eq!(d.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
        assert!(a.linear_delta(1, Projection::Q, &x).unwrap().is_none());
        assert_eq!(a.first_layer(), 0);
    }
}
