#!/usr/bin/env bash
# The GPU checks, run ON a GPU machine that cannot build (no crate registry, no model file): the
# portable binaries that `GPU_TESTS=1 scripts/cuda_compile_check.sh` leaves in target/gpu-carry/
# are unpacked and run — tests/cuda.rs (every model-side feature, CUDA vs CPU), then the runtime,
# absorb and batch_steps benches on the GPU with a randomly initialised model of the default
# model's exact shapes (BENCH_MODEL=random-smollm2: timings need shapes, not trained weights).
# Each step has its own time limit, so one that hangs does not hide the others. Logs go to
# ./gpu-logs, or with the device tool to one archive $OUT/gpu-logs.tgz (the tool returns at most 8
# files).
#
#   scripts/gpu_checks.sh            # tests,runtime,absorb,batch,rows (rows: the runtime bench's
#                                    # training step at 1 and 16 rows of 512 tokens per step, and
#                                    # a 4K absorb at 8 rows a step)
#   GPU_STEPS=tests,runtime scripts/gpu_checks.sh
# More steps, named only:
#   shapes  the runtime bench's training step on random models of deployment shapes
#           (BENCH_MODEL=random-qwen2.5-0.5b, random-llama-3.2-1b)
#   real    the default model's real weights: the parts that scripts/gpu_model_parts.sh cut
#           (.gpu-model/{a,b,c}, one carried by each of three consecutive calls, e.g. with
#           GPU_STEPS=none for the first two) are joined and verified by sha256,
#           then `lift-serve eval` runs on CUDA (retrieval and head-and-tail over the eval split;
#           lift, lift:head_tail, rag, icl on its first 1K-token document), the same commands whose
#           CPU results are in docs/retrieval.md
# A bench binary named NAME-old.xz beside NAME.xz (another build, carried for a comparison) runs
# alternately with it, two rounds each (the absorb and batch steps).
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=gpu-logs
[ -n "${OUT:-}" ] && LOGS=/tmp/gpu-logs
mkdir -p "$LOGS"
# The archive is written however the script ends (a step past its limit included).
if [ -n "${OUT:-}" ]; then
    trap 'tar czf "$OUT/gpu-logs.tgz" -C "$LOGS" .' EXIT
    trap 'exit 124' TERM INT
fi
STEPS="${GPU_STEPS:-tests,runtime,absorb,batch,rows}"
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
    [ -x "$BIN/$n" ] && [ "$BIN/$n" -nt "$f" ] && continue
    xz -dc "$f" > "$BIN/$n" && chmod +x "$BIN/$n"
done
ls "$BIN"
[ -x "$BIN/cuda-tests" ] && { ldd "$BIN/cuda-tests" | grep -E "not found|cublas|nvrtc|curand|cudart|libcuda" || true; }

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
# Benches first, the test suite last: with the device's time short, the figures come back first.
want runtime && ab runtime 90 BENCH_RUNS=5 BENCH_ONLY="${GPU_RUNTIME_ONLY:-prefill,decode,decode_adapter,train}" BENCH_TRAIN_SEQS=512,2048
want absorb && ab absorb 120 BENCH_LENGTHS="${GPU_ABSORB_LENGTHS:-1024,4096}" BENCH_PREPARED_BASE=none
want batch && ab batch_steps 75 BENCH_GATED_MEMORY=1
# Training rows batched into one step (`TrainOptions::batch_rows`): 1 and 16 rows of 512 tokens.
if want rows; then
    for n in 1 16; do
        run "rows-$n" 60 env BENCH_RUNS=5 BENCH_ONLY=train BENCH_TRAIN_SEQS=512 BENCH_TRAIN_ROWS="$n" "$BIN/runtime"
    done
    # A whole 4K absorb at 8 rows a step, one batched forward/backward (the recipe search's
    # `paper-rows8`: the default schedule in an eighth of the steps), beside the absorb step's
    # one row a step.
    run "absorb-rows8" 120 env BENCH_LENGTHS=4096 BENCH_PREPARED_BASE=none BENCH_OPTIONS=scripts/recipe-options/rows8.json "$BIN/absorb"
fi
if want shapes; then
    for m in random-qwen2.5-0.5b random-llama-3.2-1b; do
        run "runtime-$m" 75 env BENCH_MODEL="$m" BENCH_RUNS=3 BENCH_ONLY=train BENCH_TRAIN_SEQS=512,2048 "$BIN/runtime"
    done
fi
want tests && run cuda-tests "${GPU_TESTS_LIMIT:-180}" "$BIN/cuda-tests" --test-threads=1
# The model's parts: each call carries one (.gpu-model/a, b or c) and this keeps it in /tmp/parts,
# which lasts while the machine stays warm (a carried path replaces the ignored ones of earlier
# calls in the working tree).
PARTS=/tmp/parts
mkdir -p "$PARTS"
for x in a b c; do [ -f ".gpu-model/$x/part" ] && cp ".gpu-model/$x/part" "$PARTS/$x"; done
[ -f .gpu-model/a/sha256 ] && cp .gpu-model/a/sha256 "$PARTS/sha256"
ls -l "$PARTS"
if want real; then
    MODEL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "$PARTS/a" "$PARTS/b" "$PARTS/c" > "$MODEL"
    if [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" != "$(cat "$PARTS/sha256")" ]; then
        echo "=== real: the joined model's sha256 does not match (a part is missing: $(ls -l "$PARTS" 2>&1 | tr '\n' ' '))"
    else
        echo "=== real: model joined, sha256 ok"
        export LIFT_MODEL="$MODEL" LIFT_DATA_DIR=data RUST_LOG=info
        Q=(--depths 0.1,0.3,0.5,0.7,0.9 --needles-per-depth 2 --context-tokens 128 --device cuda --quiet)
        # The filter's re-rank (`retrieved`), as the CPU figures these are compared with were measured.
        run real-rag "${GPU_REAL_RAG_LIMIT:-80}" "$BIN/lift-serve" eval --split eval --methods rag:retrieved,icl \
            --lengths 1024,2048,4096,8192 --docs-per-length 4 "${Q[@]}" --out /tmp/real-rag
        run real-lift "${GPU_REAL_LIFT_LIMIT:-140}" "$BIN/lift-serve" eval --split eval \
            --methods rag:retrieved,lift:retrieved,lift:head_tail,icl --lengths 1024 --docs-per-length 1 "${Q[@]}" --out /tmp/real-lift
        for r in real-rag real-lift; do
            for f in results.json results.md; do [ -f "/tmp/$r/$f" ] && cp "/tmp/$r/$f" "$LOGS/$r-$f"; done
        done
        tail -n 40 /tmp/real-rag/results.md /tmp/real-lift/results.md 2>/dev/null
    fi
fi
exit 0
