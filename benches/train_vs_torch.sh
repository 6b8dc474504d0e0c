#!/usr/bin/env bash
# Training step at T tokens: lift-serve (candle) vs PyTorch eager, in the same run.
#
# Why alternating rounds: this machine is shared and its speed drifts by 10-20% over minutes;
# running the two sides back to back, several times, and comparing per-round medians keeps a
# drift from landing on one side only. Prints each round and the median of the per-round ratios.
#
#   bash benches/train_vs_torch.sh            (ROUNDS=3 SEQ=512 RUNS=5 THREADS=2)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds="${ROUNDS:-3}" seq="${SEQ:-512}" runs="${RUNS:-5}" threads="${THREADS:-2}"

cargo bench --bench runtime --no-run >/dev/null 2>&1
bench="$(ls -t target/release/deps/runtime-* | grep -v '\.d$' | head -1)"
TORCH_INSTALL_ONLY=1 bash benches/torch_reference.sh

ratios=()
for r in $(seq 1 "$rounds"); do
    ours=$(RAYON_NUM_THREADS="$threads" BENCH_RUNS="$runs" BENCH_ONLY=train BENCH_TRAIN_SEQS="$seq" "$bench" --bench \
        | sed -n "s/^train step *$seq tokens.*: \([0-9.]*\) s .*/\1/p")
    theirs=$(THREADS="$threads" bash benches/torch_reference.sh --impls torch-eager --seqs "$seq" --steps "$runs" 2>/dev/null \
        | sed -n 's/^{.*"median_s": \([0-9.]*\),.*/\1/p')
    ratio=$(python3 -c "print(f'{$theirs / $ours:.3f}')")
    ratios+=("$ratio")
    echo "round $r: lift-serve ${ours} s/step, PyTorch eager ${theirs} s/step -> ${ratio}x (load $(cut -d' ' -f1 /proc/loadavg))"
done
python3 - "${ratios[@]}" <<'PY'
import statistics, sys
r = sorted(float(x) for x in sys.argv[1:])
print(f"median speed-up over PyTorch eager: {statistics.median(r):.3f}x (rounds: {', '.join(f'{x:.3f}' for x in r)})")
PY
