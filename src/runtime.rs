//! Process-wide settings for fast CPU work: allocator behaviour and device choice.

use anyhow::Result;
use candle_core::Device;

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
/// they hold a core the gemm threads need. Measured on 2 cores (README, "Continuous batching"):
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
