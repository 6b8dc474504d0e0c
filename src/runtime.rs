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
