#!/usr/bin/env bash
# Compiles the CUDA build without a GPU or a system CUDA toolkit: installs the CUDA compiler and
# libraries from their PyPI wheels into a throwaway venv, lays them out as a CUDA root, and runs
# `cargo build --release --features cuda --all-targets` (our kernels in kernels/ are compiled to
# PTX by build.rs, candle's kernels by candle-kernels' build script, and the result is linked).
# Works from a fresh clone: every step says what it does and, when it fails, why.
#
# Why CUDA 13: the cu12 nvcc wheels ship only ptxas; the CUDA 13 wheels (nvidia-cuda-nvcc,
# nvidia-nvvm, nvidia-cuda-crt) carry a complete nvcc. candle 0.11.1 links the CUDA libraries at
# build time (cudarc's `dynamic-linking`: -lcuda -lnvrtc -lcurand -lcublas -lcublasLt, plus
# -lcudart from candle-kernels), so the wheels' versioned .so files get unversioned links, and
# libcuda.so (the driver, not on PyPI) is replaced by a stub generated from cudarc's own list
# of driver entry points, as the toolkit's lib64/stubs/libcuda.so would be. The binary is only
# linked here, never run.
#
#   scripts/cuda_compile_check.sh              # cuda feature: build (release, all targets)
#   FLASH_ATTN=1 scripts/cuda_compile_check.sh # also `cargo check --features cuda,flash-attn`
#                                              # (compiles flash-attn's kernels: very long)
# PORTABLE_ONLY=1 with GPU_TESTS=1 builds only the portable GPU binaries (skips the all-targets build).
# CHECK_ONLY=1 runs `cargo check` instead of the build (our kernels compiled, candle's stood in for,
# Rust type-checked, not linked; into the target folder's `cuda-check/`): CI's setting.
# Environment: VENV (default /tmp/lift-cuda-venv; kept between runs, so a second run only
# rebuilds what changed), CUDA_COMPUTE_CAP (default 80), CARGO_TARGET_DIR (the CUDA build goes to
# its `cuda/` subfolder so it never replaces the CPU build's binaries).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-/tmp/lift-cuda-venv}"
CUDA_VERSION_PIN="${CUDA_VERSION_PIN:-13.0}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-80}"
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-2}"

STEP="start"
step() {
    STEP="$1"
    echo "cuda compile check: $STEP" >&2
}
fail() {
    echo "cuda compile check FAILED at: $STEP${1:+ — $1}" >&2
    exit 1
}
trap 'fail "the command above exited with status $?"' ERR

step "python venv at $VENV"
command -v python3 >/dev/null || fail "python3 is not on PATH"
if [ ! -x "$VENV/bin/pip" ]; then
    python3 -m venv "$VENV" || fail "python3 -m venv failed (on Debian: apt-get install python3-venv)"
fi

step "CUDA $CUDA_VERSION_PIN compiler and libraries from their wheels"
# The compiler and headers; the libraries only for a build that links (cuBLAS alone is most of
# the 1.2 GB). pip answers at once when they are there already.
wheels=("nvidia-cuda-nvcc==$CUDA_VERSION_PIN.*" "nvidia-nvvm==$CUDA_VERSION_PIN.*"
    "nvidia-cuda-crt==$CUDA_VERSION_PIN.*" "nvidia-cuda-runtime==$CUDA_VERSION_PIN.*"
    "nvidia-cuda-cccl==$CUDA_VERSION_PIN.*")
if [ "${CHECK_ONLY:-0}" != 1 ]; then
    wheels+=("nvidia-cuda-nvrtc==$CUDA_VERSION_PIN.*" nvidia-cublas nvidia-curand)
fi
"$VENV/bin/pip" install -q "${wheels[@]}" || fail "pip could not install the CUDA wheels (is the package index reachable?)"
CU="$("$VENV/bin/python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
[ -x "$CU/bin/nvcc" ] || fail "no nvcc in $CU/bin: the wheels' layout changed"

step "a CUDA root at $VENV/cuda (bin/include/nvvm from the wheels, lib/ with unversioned links)"
ROOT="$VENV/cuda"
mkdir -p "$ROOT/lib/stubs"
for d in bin include nvvm; do ln -sfn "$CU/$d" "$ROOT/$d"; done
for f in "$CU"/lib/*.so.*; do
    base="$(basename "$f")"
    ln -sf "$f" "$ROOT/lib/$base"
    ln -sf "$f" "$ROOT/lib/${base%%.so.*}.so"
done
for f in "$CU"/lib/*.a; do
    if [ -e "$f" ]; then ln -sf "$f" "$ROOT/lib/$(basename "$f")"; fi
done

if [ ! -f "$ROOT/lib/stubs/libcuda.so" ]; then
    # cudarc's sources must be in the cargo registry; a machine that only built the CPU variant
    # has not downloaded them (cudarc is an optional dependency), so fetch the whole lock file.
    step "cargo fetch (cudarc's sources, for the driver stub)"
    cargo fetch --quiet || fail "cargo fetch failed (is the crate registry reachable?)"
    step "locate cudarc's sources with cargo metadata"
    CUDARC_DIR="$(cargo metadata --format-version 1 --features cuda 2>/dev/null | python3 -c '
import json, os, sys
pkgs = [p for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc"]
print(os.path.dirname(pkgs[0]["manifest_path"]) if pkgs else "")')" || true
    [ -n "$CUDARC_DIR" ] && [ -f "$CUDARC_DIR/src/driver/sys/mod.rs" ] ||
        fail "cudarc is not in the resolved dependencies with --features cuda, or its layout changed (looked for src/driver/sys/mod.rs in '${CUDARC_DIR:-nothing found}')"
    step "libcuda.so link stub from cudarc's driver entry points"
    grep -ohP '^pub unsafe fn \Kcu[A-Za-z0-9_]+' "$CUDARC_DIR/src/driver/sys/mod.rs" | sort -u |
        sed 's/.*/void &(void) {}/' > "$ROOT/lib/stubs/cuda_stub.c"
    [ -s "$ROOT/lib/stubs/cuda_stub.c" ] || fail "no driver entry points found in $CUDARC_DIR/src/driver/sys/mod.rs"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$ROOT/lib/stubs/cuda_stub.c" ||
        fail "cc could not build the driver stub"
fi
# So the CUDA build's CPU tests can also be run here:
#   LD_LIBRARY_PATH=$ROOT/lib:$ROOT/lib/stubs <test binary> (never create a CUDA device with it).
ln -sf libcuda.so "$ROOT/lib/stubs/libcuda.so.1"

export CUDA_ROOT="$ROOT" CUDA_HOME="$ROOT" CUDA_PATH="$ROOT"
export PATH="$ROOT/bin:$PATH"
export LIBRARY_PATH="$ROOT/lib:$ROOT/lib/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}/cuda"
nvcc --version | tail -2

if [ "${CHECK_ONLY:-0}" = 1 ]; then
    # Type-checks every CUDA path and compiles our kernels (build scripts run), without code
    # generation or linking: what CI runs, at a fraction of the build's time. candle's own
    # kernels are stood in for (scripts/nvcc_for_check.sh says why); the full build compiles them.
    # Its own target folder: the kernel builder's cache would keep the stand-ins for a later
    # full build in the same folder.
    export CARGO_TARGET_DIR="$CARGO_TARGET_DIR-check"
    step "cargo check --release --features cuda --all-targets (into $CARGO_TARGET_DIR)"
    start=$(date +%s)
    REAL_NVCC="$ROOT/bin/nvcc" NVCC="$PWD/scripts/nvcc_for_check.sh" \
        cargo check --release --features cuda --all-targets
    echo "cuda check: $(($(date +%s) - start)) s"
elif [ "${PORTABLE_ONLY:-0}" != 1 ]; then
    step "cargo build --release --features cuda --all-targets (into $CARGO_TARGET_DIR)"
    start=$(date +%s)
    cargo build --release --features cuda --all-targets
    echo "cuda build: $(($(date +%s) - start)) s"
fi
if [ "${FLASH_ATTN:-0}" = 1 ]; then
    step "cargo check --release --features cuda,flash-attn --all-targets"
    start=$(date +%s)
    cargo check --release --features cuda,flash-attn --all-targets
    echo "cuda,flash-attn check: $(($(date +%s) - start)) s"
fi
if [ "${GPU_TESTS:-0}" = 1 ]; then
    # tests/cuda.rs, the GPU-capable benches (runtime, absorb, batch_steps) and the lift-serve
    # binary (a real model's absorb and eval on the GPU) for a GPU machine:
    # built for any AVX2 CPU (the default build uses this machine's own instruction set, which
    # another machine's CPU may lack: SIGILL), stripped and compressed to target/gpu-carry/*.xz
    # (about 9 MB each) to carry there; scripts/gpu_checks.sh runs them on the GPU machine.
    step "portable tests/cuda.rs and GPU bench binaries (into $CARGO_TARGET_DIR-portable)"
    start=$(date +%s)
    mkdir -p "$CARGO_TARGET_DIR-portable"
    CARGO_TARGET_DIR="$CARGO_TARGET_DIR-portable" RUSTFLAGS="-C target-cpu=x86-64-v3" \
        cargo build --release --features cuda,research --test cuda \
        --bench runtime --bench absorb --bench batch_steps --bin lift-serve --message-format=json |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in ("cuda", "runtime", "absorb", "batch_steps", "lift-serve"):
        print(m["target"]["name"], m["executable"])' > "$CARGO_TARGET_DIR-portable/gpu-binaries.txt"
    mkdir -p target/gpu-carry
    while read -r name exe; do
        [ "$name" = cuda ] && name=cuda-tests
        strip -o "target/gpu-carry/$name" "$exe"
        xz -f -T2 "target/gpu-carry/$name"
    done < "$CARGO_TARGET_DIR-portable/gpu-binaries.txt"
    echo "portable GPU binaries: $(($(date +%s) - start)) s"
    du -h target/gpu-carry/*.xz
fi
trap - ERR
echo "cuda compile check: ok"
