//! Process-wide settings for fast CPU work: allocator behaviour, device choice, and the
//! numeric knobs the model is loaded with (`RuntimeConfig`).

use crate::kernels::{bf16_matmul, quant_matmul};
use anyhow::Result;
use candle_core::{DType, Device};

/// Keeps glibc from returning large buffers to the OS after every training step (measured: a
/// 15–20% slowdown from repeated mmap/munmap of multi-megabyte activations).
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        // -1: never trim. A 512-token step frees over 1 GiB of activations at its end; with a
        // finite threshold glibc handed that back and the next step paid a page fault (and a
        // page clear) for every page again.
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
    }
}

/// Idle spinning of candle's CPU thread pool, in spin-loop iterations, unless
/// `CANDLE_BARRIER_POOL_SPIN_LIMIT` says otherwise. Two pools share the cores: candle's (its
/// elementwise ops, our int8 and decode-attention kernels) and rayon's (the gemm crate's float
/// matmuls). candle's idle workers spin 25,000 iterations (about a millisecond) before they
/// park, so in work that alternates between the pools — every training step, every prompt —
/// they hold a core the gemm threads need. Measured on 2 cores (docs/cpu-kernels.md):
/// a 256-token training step 1.42 → 1.20 s, 16 generations after 290-token prompts 11.6 →
/// 9.8 s, the 16-row decode step unchanged (5,000 spins still bridge its gaps; 1,000 did not).
/// The cost: a server batch of 16 Gated Memory answers decodes ~5% slower (each sequence's mix
/// runs between the pool's jobs, long enough for the workers to park); `icl` batches ~21% faster.
pub const BARRIER_POOL_SPIN_LIMIT: u32 = 5_000;

/// Process-wide CPU settings, called first thing in `main` (before any thread is started:
/// it sets an environment variable): the allocator (`tune_allocator`) and candle's pool
/// spinning (`BARRIER_POOL_SPIN_LIMIT`).
pub fn tune_cpu() {
    tune_allocator();
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", BARRIER_POOL_SPIN_LIMIT.to_string());
    }
}

/// Hands the heap's free pages back to the OS. `tune_allocator` never trims during training, so
/// after a job the process would keep its peak (about 2 GB after one absorb on the default model)
/// for good; a job's end is the one point where trimming costs nothing.
pub fn release_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Resident memory of this process in bytes (Linux; None elsewhere).
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// `cpu`, `cuda` or `cuda:N`.
pub fn device(spec: &str) -> Result<Device> {
    match spec {
        "cpu" => Ok(Device::Cpu),
        s if s.starts_with("cuda") => {
            let ordinal = s.strip_prefix("cuda:").map(str::parse::<usize>).transpose()?.unwrap_or(0);
            Ok(Device::new_cuda(ordinal)?)
        }
        other => anyhow::bail!("unknown device '{other}' (cpu, cuda, cuda:N)"),
    }
}

/// Prompt chunks of at least this many tokens run through the float weights by default
/// (`RuntimeConfig::float_prefill_min_rows`).
pub const DEFAULT_FLOAT_PREFILL_MIN_ROWS: usize = 16;

/// A float dtype a knob can ask for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum FloatDtype {
    #[default]
    Bf16,
    F32,
}

/// Which kernel runs block-quantized matmuls on the CPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CpuQuantMatmul {
    /// Our int8 kernel (`kernels::quant_matmul`) in the best version this CPU runs, else candle's.
    #[default]
    Auto,
    /// Our kernel's AVX2 version even on an AVX-512 CPU, to compare the two.
    Avx2,
    /// candle's quantized matmul, the reference benchmarks compare ours with.
    Candle,
}

/// How the model computes on this machine: dtypes and kernels chosen at load. Every command
/// takes these as global flags (with `LIFT_*` variables); the defaults are the measured best.
/// Built once in `main` and handed to `Model::load_with`, which stores what each layer needs.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
pub struct RuntimeConfig {
    /// Frozen base weights and activations on CUDA: bf16, or f32 (a diagnostic: tells bf16's
    /// arithmetic from a bug in a CUDA path when the GPU's answers differ from the CPU's).
    #[arg(long, global = true, env = "LIFT_CUDA_DTYPE", value_enum, ignore_case = true, default_value_t)]
    pub cuda_dtype: FloatDtype,
    /// Frozen float matmuls on the CPU (training, prompt chunks): bf16 inputs with f32 sums where
    /// the CPU has AVX-512 BF16 (else f32), or f32 throughout.
    #[arg(long, global = true, env = "LIFT_CPU_FLOAT_DTYPE", value_enum, ignore_case = true, default_value_t)]
    pub cpu_float_dtype: FloatDtype,
    /// Kernel of the quantized matmuls on the CPU (decode rows of a quantized file).
    #[arg(long, global = true, env = "LIFT_CPU_QMATMUL", value_enum, ignore_case = true, default_value_t)]
    pub cpu_qmatmul: CpuQuantMatmul,
    /// Prompt chunks of at least this many tokens run through the float weights, shorter ones
    /// (decode) through the quantized ones; 1 sends decode rows to the float weights too, as on
    /// CUDA (a diagnostic that tells the int8 kernel's arithmetic from a device's).
    #[arg(long, global = true, env = "LIFT_FLOAT_MIN_ROWS", default_value_t = DEFAULT_FLOAT_PREFILL_MIN_ROWS)]
    pub float_prefill_min_rows: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            cuda_dtype: FloatDtype::default(),
            cpu_float_dtype: FloatDtype::default(),
            cpu_qmatmul: CpuQuantMatmul::default(),
            float_prefill_min_rows: DEFAULT_FLOAT_PREFILL_MIN_ROWS,
        }
    }
}

impl RuntimeConfig {
    /// The configuration the `LIFT_*` variables give, defaults elsewhere: for programs that take
    /// no flags (benches, and the tests whose documented diagnostics switch a knob this way).
    pub fn from_env() -> Result<Self> {
        #[derive(clap::Parser)]
        struct EnvOnly {
            #[command(flatten)]
            runtime: RuntimeConfig,
        }
        Ok(<EnvOnly as clap::Parser>::try_parse_from(["lift-serve"])?.runtime)
    }

    /// Dtype of the frozen float weights and the decoder's activations on `device`: f32 on the
    /// CPU (our fused ops are f32), bf16 on CUDA unless `cuda_dtype` is f32.
    pub fn base_dtype(&self, device: &Device) -> DType {
        if device.is_cuda() && self.cuda_dtype == FloatDtype::Bf16 {
            DType::BF16
        } else {
            DType::F32
        }
    }

    /// What the frozen float matmuls compute in on the CPU: bf16 only where the kernel runs.
    pub fn cpu_float_matmul_dtype(&self) -> DType {
        if self.cpu_float_dtype == FloatDtype::Bf16 && bf16_matmul::available() {
            DType::BF16
        } else {
            DType::F32
        }
    }

    /// The version of our int8 kernel quantized layers are packed for on the CPU; `None`: they
    /// stay on candle's quantized matmul (asked for, or a CPU without AVX2).
    pub fn quant_matmul_isa(&self) -> Option<quant_matmul::Isa> {
        match self.cpu_qmatmul {
            CpuQuantMatmul::Candle => None,
            CpuQuantMatmul::Avx2 if quant_matmul::cpu_has(quant_matmul::Isa::Avx2) => Some(quant_matmul::Isa::Avx2),
            CpuQuantMatmul::Avx2 | CpuQuantMatmul::Auto => quant_matmul::isa(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        runtime: RuntimeConfig,
    }

    #[test]
    fn flag_defaults_are_the_default_config() {
        let names = ["LIFT_CUDA_DTYPE", "LIFT_CPU_FLOAT_DTYPE", "LIFT_CPU_QMATMUL", "LIFT_FLOAT_MIN_ROWS"];
        if names.iter().any(|n| std::env::var_os(n).is_some()) {
            return; // a knob set in this environment would rightly differ from the defaults
        }
        assert_eq!(Flags::try_parse_from(["x"]).unwrap().runtime, RuntimeConfig::default());
    }

    #[test]
    fn flags_set_every_knob() {
        let args = ["x", "--cuda-dtype", "F32", "--cpu-float-dtype", "f32", "--cpu-qmatmul", "candle"];
        let flags = Flags::try_parse_from(args.into_iter().chain(["--float-prefill-min-rows", "1"])).unwrap();
        let expected = RuntimeConfig {
            cuda_dtype: FloatDtype::F32,
            cpu_float_dtype: FloatDtype::F32,
            cpu_qmatmul: CpuQuantMatmul::Candle,
            float_prefill_min_rows: 1,
        };
        assert_eq!(flags.runtime, expected);
        assert_eq!(expected.cpu_float_matmul_dtype(), DType::F32);
        assert_eq!(expected.quant_matmul_isa(), None);
        assert_eq!(expected.base_dtype(&Device::Cpu), DType::F32);
    }
}
