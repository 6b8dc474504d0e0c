#!/usr/bin/env bash
# Peer benchmark: lift-serve against llama.cpp (llama-cpp-python, native CPU build) on the same
# GGUF, same threads, same token ids.
#   1. batch 1: prefill 512 / 2048 and greedy decode, alternating fresh processes per run;
#   2. server: streamed /v1/chat/completions with 1, 4 and 16 concurrent clients.
# Results: target/peers/results.md and results.json.
#
#   benches/peers.sh
# Env: PEERS_THREADS (2), PEERS_RUNS (5), PEERS_REQUESTS (3 per client), PEERS_SERVER (1),
#      LIFT_MODELS_DIR (models), LIFT_BIN (target/release/lift-serve, built if default),
#      PEER_OURS_BIN (the peer_ours bench binary; built if unset).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON_VERSION=0.3.36
OUT=target/peers
VENV=$OUT/venv
THREADS=${PEERS_THREADS:-2}
RUNS=${PEERS_RUNS:-5}
REQUESTS=${PEERS_REQUESTS:-3}
SERVER=${PEERS_SERVER:-1}
MODELS_DIR=$(realpath "${LIFT_MODELS_DIR:-models}")
MODEL=$MODELS_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
TARGET=${CARGO_TARGET_DIR:-target}
mkdir -p "$OUT"
[ -f "$MODEL" ] || { echo "missing $MODEL (lift-serve fetch-model)" >&2; exit 1; }

# --- llama-cpp-python in a throwaway venv, built from source for this CPU ---
PY=$VENV/bin/python
if ! "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON_VERSION')" 2>/dev/null; then
  echo "== installing llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (native build, several minutes)"
  [ -x "$PY" ] || python3 -m venv "$VENV"
  CMAKE_ARGS="-DGGML_NATIVE=ON" nice -n 19 "$PY" -m pip install --no-cache-dir -q \
    "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION"
fi

# --- our binaries ---
if [ -z "${PEER_OURS_BIN:-}" ]; then
  cargo bench --bench peer_ours --no-run
  # Newest executable: older builds of the bench linger in deps/.
  PEER_OURS_BIN=$(find "$TARGET/release/deps" -maxdepth 1 -type f -name 'peer_ours-*' -executable \
    -printf '%T@ %p\n' | sort -rn | head -1 | cut -d' ' -f2-)
fi
[ -x "$PEER_OURS_BIN" ] || { echo "no peer_ours binary ($PEER_OURS_BIN)" >&2; exit 1; }
if [ "$SERVER" = 1 ]; then
  if [ -z "${LIFT_BIN:-}" ]; then
    cargo build --release --bin lift-serve
    LIFT_BIN=$TARGET/release/lift-serve
  fi
  [ -x "$LIFT_BIN" ] || { echo "no lift-serve binary ($LIFT_BIN)" >&2; exit 1; }
fi

# --- the shared token ids: both fixture texts (English prose), llama.cpp's tokenizer on the same GGUF ---
IDS=$OUT/ids.json
"$PY" benches/peers/llama_side.py --model "$MODEL" --write-ids "$IDS" \
  --text tests/fixtures/harbor_history.txt --text tests/fixtures/kestrel_observatory.txt

# --- batch 1: alternate which side goes first, one fresh process each ---
B1=$OUT/batch1.jsonl
: > "$B1"
ours() { PEERS_IDS=$IDS LIFT_MODELS_DIR=$MODELS_DIR RAYON_NUM_THREADS=$THREADS "$PEER_OURS_BIN" | tail -1 >> "$B1"; }
llama() { "$PY" benches/peers/llama_side.py --model "$MODEL" --ids "$IDS" --threads "$THREADS" >> "$B1"; }
for run in $(seq 1 "$RUNS"); do
  if [ $((run % 2)) = 1 ]; then order="ours llama"; else order="llama ours"; fi
  for side in $order; do
    echo "== batch 1: run $run/$RUNS, $side"
    $side
    tail -1 "$B1"
  done
done

# --- server throughput: one server at a time ---
SRV=$OUT/server.jsonl
: > "$SRV"
PIDS=()
TMP=$(mktemp -d)
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() {  # url, pid, log
  for _ in $(seq 1 300); do
    curl -sf "$1/v1/models" > /dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited; log:" >&2; tail -20 "$3" >&2; return 1; }
    sleep 0.5
  done
  echo "server did not come up" >&2; return 1
}
first_model() { curl -sf "$1/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])'; }
load_levels() {  # label, url
  local model; model=$(first_model "$2")
  # Warm-up request, not counted.
  "$PY" benches/peers/load.py --url "$2" --model "$model" --clients 1 --requests 1 > /dev/null
  for c in 1 4 16; do
    echo "== server: $1, $c clients x $REQUESTS requests"
    "$PY" benches/peers/load.py --url "$2" --model "$model" --clients "$c" --requests "$REQUESTS" --label "$1" | tee -a "$SRV"
  done
}
stop() { kill "$1"; wait "$1" 2>/dev/null || true; PIDS=(); }

if [ "$SERVER" = 1 ]; then
  port=$(free_port)
  RAYON_NUM_THREADS=$THREADS "$LIFT_BIN" serve --port "$port" --model "$MODEL" \
    --adapters-dir "$TMP/adapters" --prepared-base none > "$OUT/ours-server.log" 2>&1 &
  pid=$!; PIDS+=("$pid")
  wait_up "http://127.0.0.1:$port" "$pid" "$OUT/ours-server.log"
  load_levels ours "http://127.0.0.1:$port"
  stop "$pid"

  port=$(free_port)
  # interrupt_requests defaults to true there: a queued request would cut the streaming one short.
  "$PY" -m llama_cpp.server --model "$MODEL" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
    --n_ctx 4096 --n_batch 512 --interrupt_requests false --host 127.0.0.1 --port "$port" \
    > "$OUT/llama-server.log" 2>&1 &
  pid=$!; PIDS+=("$pid")
  wait_up "http://127.0.0.1:$port" "$pid" "$OUT/llama-server.log"
  load_levels llama "http://127.0.0.1:$port"
  stop "$pid"
fi

# --- summary ---
# Our server logs its configuration at start; older builds had no max_batch (one at a time).
MAX_BATCH=$(grep -o 'max_batch=[0-9]*' "$OUT/ours-server.log" 2>/dev/null | head -1 | cut -d= -f2 || true)
"$PY" - "$B1" "$SRV" "$OUT" "$THREADS" "${MAX_BATCH:-1}" <<'EOF'
import json, statistics, sys, platform
b1, srv, out, threads, max_batch = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
rows = [json.loads(l) for l in open(b1) if l.strip()]
side = {s: [r for r in rows if r["side"] == s] for s in ("ours", "llama")}
med = lambda s, k: statistics.median(r[k] for r in side[s]) if side[s] and all(k in r for r in side[s]) else None
res = {"threads": int(threads), "runs": len(side["ours"]),
       "llama_cpp_python": side["llama"][0].get("llama_cpp_python") if side["llama"] else None,
       "batch1": {}, "server": []}
md = [f"# lift-serve vs llama.cpp (llama-cpp-python {res['llama_cpp_python']}), {threads} threads, "
      f"median of {res['runs']} alternating runs", "",
      "| batch 1 | ours | llama.cpp (perf counters) | llama.cpp (wall) | speed ours/llama (perf) | (wall) |",
      "|---|---|---|---|---|---|"]
def fmt(x, d=1): return "-" if x is None else f"{x:.{d}f}"
def ratio(a, b): return None if a is None or b is None else a / b
for label, key, llama_wall, unit in [
    ("prefill 512 (tok/s)", "prefill_512_tok_s", "prefill_512_wall_ms", "tok/s"),
    ("prefill 2048 (tok/s)", "prefill_2048_tok_s", "prefill_2048_wall_ms", "tok/s"),
    ("decode after 128 (ms/token)", "decode_ms_per_tok", "decode_wall_ms_per_tok", "ms")]:
    o, l, lw = med("ours", key), med("llama", key), med("llama", llama_wall)
    if unit == "tok/s":
        n = int(key.split("_")[1])
        lw = None if lw is None else n / (lw / 1e3)
        r, rw = ratio(o, l), ratio(o, lw)
    else:  # ms per token: speed ratio is the inverse
        r, rw = ratio(l, o), ratio(lw, o)
    res["batch1"][key] = {"ours": o, "llama_perf": l, "llama_wall": lw, "speed_ratio_perf": r, "speed_ratio_wall": rw}
    md.append(f"| {label} | {fmt(o)} | {fmt(l)} | {fmt(lw)} | {fmt(r, 2)}x | {fmt(rw, 2)}x |")
md += ["", "Speed ratio > 1: we are faster. Ours: wall-clock in process (`prefill`, then argmax + one",
       "forward per decode step); llama.cpp: its perf counters, and wall-clock around `Llama.eval`."]
srows = [json.loads(l) for l in open(srv) if l.strip()] if srv else []
if srows:
    md += ["", "| server | clients | requests | errors | req/s | completion tok/s | tokens/request | TTFT p50 ms | TTFT p95 ms | latency p50 ms | tokens from |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in srows:
        res["server"].append(r)
        md.append(f"| {r['label']} | {r['clients']} | {r['requests']} | {r['errors']} | {r['req_s']:.2f} | {r['tok_s']:.1f} | "
                  f"{r['completion_tokens'] / max(r['requests'], 1):.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | {r['latency_p50_ms']:.0f} | {r['tokens_source']} |")
    ours_mode = (f"lift-serve batches up to {max_batch} generations (continuous batching, --max-batch)"
                 if max_batch > 1 else "lift-serve serves one request at a time")
    md += ["", "llama-cpp-python's server answers one request at a time: a global lock around its one `Llama`,",
           f"no parallel-slot option (run with --interrupt_requests false); {ours_mode}.",
           "llama-cpp-python sends no `usage` in streams, so its tokens are counted as content chunks."]
    res["ours_max_batch"] = max_batch
res["machine"] = platform.processor() or platform.machine()
text = "\n".join(md) + "\n"
open(f"{out}/results.md", "w").write(text)
json.dump(res, open(f"{out}/results.json", "w"), indent=1)
print(text)
EOF
