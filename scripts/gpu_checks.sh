#!/usr/bin/env bash
# The GPU checks, run ON a GPU machine that cannot build (no crate registry, no model file): the
# portable binaries that `GPU_TESTS=1 scripts/cuda_compile_check.sh` leaves in target/gpu-carry/
# are unpacked and run — tests/cuda.rs (every model-side feature, CUDA vs CPU), then the runtime,
# absorb and batch_steps benches on the GPU with a randomly initialised model of the default
# model's exact shapes (BENCH_MODEL=random-smollm2: timings need shapes, not trained weights).
# Each step has its own time limit, so one that hangs does not hide the others. Logs go to
# $OUT (or ./gpu-logs).
#
#   scripts/gpu_checks.sh            # everything
#   GPU_STEPS=tests,runtime scripts/gpu_checks.sh
# A bench binary named NAME-old.xz beside NAME.xz (another build, carried for a comparison) runs
# alternately with it, two rounds each (the absorb and batch steps).
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS="${OUT:-gpu-logs}"
mkdir -p "$LOGS"
STEPS="${GPU_STEPS:-tests,runtime,absorb,batch}"
want() { [[ ",$STEPS," == *",$1,"* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
# The CUDA libraries the binaries link (cuBLAS, cuBLASLt, NVRTC, cuRAND, the runtime) from
# wherever this machine keeps them: a toolkit or the Python wheels.
libs=""
for so in libcublas.so.13 libnvrtc.so.13 libcurand.so.10 libcudart.so.13; do
    d="$(find /usr/local /opt /usr/lib -name "$so" -print -quit 2>/dev/null | xargs -r dirname)"
    [ -n "$d" ] && [[ ":$libs:" != *":$d:"* ]] && libs="$libs:$d"
done
export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

BIN=/tmp/gpu-bin
mkdir -p "$BIN"
for f in target/gpu-carry/*.xz; do
    n="$(basename "$f" .xz)"
    xz -dc "$f" > "$BIN/$n" && chmod +x "$BIN/$n"
done
ldd "$BIN/cuda-tests" | grep -E "not found|cublas|nvrtc|curand|cudart|libcuda" || true

run() { # name, limit in seconds, command...
    local name="$1" limit="$2"
    shift 2
    echo "=== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]}, $((SECONDS - t0)) s"
}

# A bench, or a bench and its -old build alternately, two rounds each.
ab() { # binary name, limit in seconds, env assignments...
    local name="$1" limit="$2" rounds=1
    shift 2
    [ -x "$BIN/$name-old" ] && rounds=2
    for r in $(seq "$rounds"); do
        [ -x "$BIN/$name-old" ] && run "$name-old-$r" "$limit" env "$@" "$BIN/$name-old"
        run "$name-$r" "$limit" env "$@" "$BIN/$name"
    done
}

export BENCH_DEVICE=cuda BENCH_MODEL=random-smollm2 RUST_LOG=warn
want tests && run cuda-tests 180 "$BIN/cuda-tests" --test-threads=1
want runtime && ab runtime 90 BENCH_RUNS=5 BENCH_ONLY=prefill,decode,decode_adapter,train BENCH_TRAIN_SEQS=512,2048
want absorb && ab absorb 120 BENCH_LENGTHS="${GPU_ABSORB_LENGTHS:-1024,4096}" BENCH_PREPARED_BASE=none
want batch && ab batch_steps 75 BENCH_GATED_MEMORY=1
exit 0
