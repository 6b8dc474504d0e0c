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
# A binary named NAME-old.xz beside NAME.xz (another build, carried for a comparison) runs
# alternately with it, two rounds each, in the `batch` step.
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

export BENCH_DEVICE=cuda BENCH_MODEL=random-smollm2 RUST_LOG=warn
want tests && run cuda-tests 180 "$BIN/cuda-tests" --test-threads=1
want runtime && run runtime 90 env BENCH_RUNS=5 BENCH_ONLY=prefill,decode,decode_adapter,train \
    BENCH_TRAIN_SEQS=512,2048 "$BIN/runtime"
want absorb && run absorb 120 env BENCH_LENGTHS=1024,4096 "$BIN/absorb"
if want batch; then
    rounds=1
    [ -x "$BIN/batch_steps-old" ] && rounds=2
    for r in $(seq "$rounds"); do
        [ -x "$BIN/batch_steps-old" ] && run "batch_steps-old-$r" 75 env BENCH_GATED_MEMORY=1 "$BIN/batch_steps-old"
        run "batch_steps-$r" 75 env BENCH_GATED_MEMORY=1 "$BIN/batch_steps"
    done
fi
exit 0
