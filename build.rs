//! Compiles the CUDA kernels in `kernels/` to PTX, only with the `cuda` feature (the default CPU
//! build runs nothing here). nvcc: `$NVCC`, else `$CUDA_ROOT|$CUDA_HOME|$CUDA_PATH/bin/nvcc`,
//! else `nvcc` on PATH. Target: `compute_$CUDA_COMPUTE_CAP` (else what nvidia-smi reports, else
//! 80); PTX is JIT-compiled by the driver for that capability and newer ones.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 4] = ["gated_memory", "masked_softmax", "decode_attention", "adamw"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in ["NVCC", "CUDA_ROOT", "CUDA_HOME", "CUDA_PATH", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = nvcc();
    let cap = compute_cap();
    for name in KERNELS {
        let src = format!("kernels/{name}.cu");
        println!("cargo:rerun-if-changed={src}");
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=compute_{cap}"), "-o"])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {} ({e}): set NVCC or CUDA_ROOT", nvcc.display()));
        assert!(status.success(), "nvcc failed on {src}");
    }
}

fn nvcc() -> PathBuf {
    if let Some(p) = std::env::var_os("NVCC") {
        return p.into();
    }
    for var in ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            let p = PathBuf::from(root).join("bin/nvcc");
            if p.exists() {
                return p;
            }
        }
    }
    "nvcc".into()
}

fn compute_cap() -> String {
    if let Ok(cap) = std::env::var("CUDA_COMPUTE_CAP") {
        return cap.trim().trim_end_matches(['a', 'f']).replace('.', "");
    }
    let smi = Command::new("nvidia-smi").args(["--query-gpu=compute_cap", "--format=csv,noheader"]).output();
    match smi {
        Ok(o) if o.status.success() => {
            let s = String::from_utf8_lossy(&o.stdout);
            s.lines().next().unwrap_or("8.0").trim().replace('.', "")
        }
        _ => "80".into(),
    }
}
