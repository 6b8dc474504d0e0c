//! Where a bench runs (shared through `#[path]`): the device and the model.
//!
//! `BENCH_DEVICE=cpu|cuda|cuda:N` (default cpu; cuda needs the `cuda` feature).
//! `BENCH_MODEL=random-smollm2` builds a randomly initialised model of SmolLM2-135M's exact
//! (`random-qwen2.5-0.5b`, `random-llama-3.2-1b`: deployment-size shapes, the same way)
//! shapes, vocabulary included, in a temporary folder: the default model's matmuls, attention and
//! LM head for timing on a machine the weights file cannot reach (the GPU machine), with a
//! byte-level tokenizer (one token per byte of text). A path (a `.gguf` file or a Hugging Face
//! directory) loads that model. Otherwise the default model (or `LIFT_MODELS_DIR`), as everywhere.
//! The `LIFT_*` runtime variables (`RuntimeConfig`) apply as they do to the commands.

use candle_core::Device;
use lift_serve::model::Model;
use lift_serve::runtime::RuntimeConfig;

pub struct Target {
    pub model: Model,
    /// What the model is, for the bench's first lines.
    pub label: String,
    _dir: Option<tempfile::TempDir>,
}

pub fn device() -> anyhow::Result<Device> {
    lift_serve::runtime::device(&std::env::var("BENCH_DEVICE").unwrap_or_else(|_| "cpu".into()))
}

/// Loads the bench's model with the dtypes and kernels the `LIFT_*` variables choose
/// (`LIFT_CPU_QMATMUL=candle`, `LIFT_CPU_FLOAT_DTYPE=f32`, ...: the comparisons benches make).
pub fn load(dev: &Device) -> anyhow::Result<Target> {
    let runtime = RuntimeConfig::from_env()?;
    match std::env::var("BENCH_MODEL").ok().as_deref() {
        Some(name @ ("random-smollm2" | "random-qwen2.5-0.5b" | "random-llama-3.2-1b")) => {
            use lift_serve::testing::TinySpec;
            let (spec, shapes) = match name {
                "random-smollm2" => (TinySpec::smollm2_135m_shaped(), "SmolLM2-135M"),
                "random-qwen2.5-0.5b" => (TinySpec::qwen2_5_0_5b_shaped(), "Qwen2.5-0.5B"),
                _ => (TinySpec::llama_3_2_1b_shaped(), "Llama-3.2-1B"),
            };
            let dir = tempfile::tempdir()?;
            let path = lift_serve::testing::write_hf(&dir.path().join(name), &spec)?;
            let model = Model::load_with(&path, dev, &runtime)?;
            Ok(Target { model, label: format!("random weights of {shapes}'s shapes"), _dir: Some(dir) })
        }
        Some(file) if std::path::Path::new(file).exists() => {
            let model = Model::load_with(std::path::Path::new(file), dev, &runtime)?;
            Ok(Target { model, label: file.to_string(), _dir: None })
        }
        Some(other) => anyhow::bail!(
            "BENCH_MODEL={other}: random-smollm2, random-qwen2.5-0.5b, random-llama-3.2-1b, a model file or directory (or unset: the default model)"
        ),
        None => {
            let path = lift_serve::fetch::resolve_model(None)?;
            let model = Model::load_with(&path, dev, &runtime)?;
            Ok(Target { model, label: path.display().to_string(), _dir: None })
        }
    }
}

/// Waits for the device's queued work, so that a timer read after it covers the work (CUDA
/// launches return before their kernels finish).
#[allow(dead_code)] // not every bench that includes this file times device work itself
pub fn sync(dev: &Device) {
    dev.synchronize().expect("device synchronize");
}
