#!/usr/bin/env bash
# Peer benchmark: lift-serve against llama.cpp (llama-cpp-python, native CPU build) on the same
# GGUF, same threads, same token ids.
#   1. batch 1: prefill 512 / 2048 and greedy decode, alternating fresh processes per run;
#   2. server: streamed /v1/chat/completions with 1, 4 and 16 concurrent clients, short prompts
#      and ~1,500-token document prompts, against llama.cpp's C++ `llama-server` (built from the
#      llama.cpp that llama-cpp-python's source distribution vendors, with parallel slots equal
#      to our --max-batch) and, as a second row, llama-cpp-python's serial server.
# Results: target/peers/results.md and results.json.
#
#   benches/peers.sh
# Env: PEERS_THREADS (2), PEERS_RUNS (5), PEERS_REQUESTS (3 per client), PEERS_SERVER (1),
#      PEERS_ROUNDS (2: server rounds, alternating which goes first), PEERS_MAX_TOKENS (64),
#      PEERS_MAX_BATCH (16: our --max-batch and llama-server's -np), PEERS_PYTHON_SERVER (1),
#      PEERS_DOC_REQUESTS (1 per client in the document case), PEERS_BATCH1 (1: the batch-1 section),
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
ROUNDS=${PEERS_ROUNDS:-2}
MAX_TOKENS=${PEERS_MAX_TOKENS:-64}
MAX_BATCH=${PEERS_MAX_BATCH:-16}
PYTHON_SERVER=${PEERS_PYTHON_SERVER:-1}
DOC_REQUESTS=${PEERS_DOC_REQUESTS:-1}
DOC=tests/fixtures/kestrel_observatory.txt
MODELS_DIR=$(realpath "${LIFT_MODELS_DIR:-models}")
MODEL=$MODELS_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
TARGET=${CARGO_TARGET_DIR:-target}
mkdir -p "$OUT"
[ -f "$MODEL" ] || { echo "missing $MODEL (lift-serve fetch-model)" >&2; exit 1; }

# --- llama-cpp-python in a throwaway venv, built from source for this CPU (for the batch-1
# section and the serial Python server; the load generator itself needs only the stdlib) ---
PY=$VENV/bin/python
NEED_PY=0
{ [ "${PEERS_BATCH1:-1}" = 1 ] || { [ "$SERVER" = 1 ] && [ "$PYTHON_SERVER" = 1 ]; }; } && NEED_PY=1
if [ "$NEED_PY" = 1 ] && ! "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON_VERSION')" 2>/dev/null; then
  echo "== installing llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (native build, several minutes)"
  [ -x "$PY" ] || python3 -m venv "$VENV"
  CMAKE_ARGS="-DGGML_NATIVE=ON" nice -n 19 "$PY" -m pip install --no-cache-dir -q \
    "llama-cpp-python[server]==$LLAMA_CPP_PYTHON_VERSION"
fi
[ "$NEED_PY" = 1 ] || PY=python3

# --- llama.cpp's own server, built once from the same llama.cpp version ---
LLAMA_SERVER=$OUT/llama-server
if [ "$SERVER" = 1 ]; then benches/peers/build_llama_server.sh "$LLAMA_CPP_PYTHON_VERSION" "$OUT"; fi

# --- our binaries ---
if [ "${PEERS_BATCH1:-1}" != 1 ]; then
  :
elif [ -z "${PEER_OURS_BIN:-}" ]; then
  cargo bench --bench peer_ours --no-run
  # Newest executable: older builds of the bench linger in deps/.
  PEER_OURS_BIN=$(find "$TARGET/release/deps" -maxdepth 1 -type f -name 'peer_ours-*' -executable \
    -printf '%T@ %p\n' | sort -rn | head -1 | cut -d' ' -f2-)
fi
[ "${PEERS_BATCH1:-1}" != 1 ] || [ -x "$PEER_OURS_BIN" ] || { echo "no peer_ours binary ($PEER_OURS_BIN)" >&2; exit 1; }
if [ "$SERVER" = 1 ]; then
  if [ -z "${LIFT_BIN:-}" ]; then
    cargo build --release --bin lift-serve
    LIFT_BIN=$TARGET/release/lift-serve
  fi
  [ -x "$LIFT_BIN" ] || { echo "no lift-serve binary ($LIFT_BIN)" >&2; exit 1; }
fi

# --- the shared token ids: both fixture texts (English prose), llama.cpp's tokenizer on the same GGUF ---
IDS=$OUT/ids.json
if [ "${PEERS_BATCH1:-1}" = 1 ]; then
  "$PY" benches/peers/llama_side.py --model "$MODEL" --write-ids "$IDS" \
    --text tests/fixtures/harbor_history.txt --text tests/fixtures/kestrel_observatory.txt
fi

# --- batch 1: alternate which side goes first, one fresh process each ---
B1=$OUT/batch1.jsonl
: > "$B1"
ours() { PEERS_IDS=$IDS LIFT_MODELS_DIR=$MODELS_DIR RAYON_NUM_THREADS=$THREADS "$PEER_OURS_BIN" | tail -1 >> "$B1"; }
llama() { "$PY" benches/peers/llama_side.py --model "$MODEL" --ids "$IDS" --threads "$THREADS" >> "$B1"; }
[ "${PEERS_BATCH1:-1}" = 1 ] || RUNS=0
for run in $(seq 1 "$RUNS"); do
  if [ $((run % 2)) = 1 ]; then order="ours llama"; else order="llama ours"; fi
  for side in $order; do
    echo "== batch 1: run $run/$RUNS, $side"
    $side
    tail -1 "$B1"
  done
done

# --- server throughput: one server at a time, same GGUF, same threads, same requests ---
# llama.cpp's C++ server with as many parallel slots as our --max-batch, rounds alternating
# which server goes first; llama-cpp-python's server (one request at a time) once, as a second row.
# Two cases: a short prompt (decode dominates) and ~1,500 tokens of document before each question
# (prompt processing dominates).
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
  for _ in $(seq 1 600); do
    curl -sf "$1/v1/models" > /dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server exited; log:" >&2; tail -20 "$3" >&2; return 1; }
    sleep 0.5
  done
  echo "server did not come up" >&2; return 1
}
first_model() { curl -sf "$1/v1/models" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])'; }
load_levels() {  # label, url, round
  local model; model=$(first_model "$2")
  # Warm-up request, not counted.
  "$PY" benches/peers/load.py --url "$2" --model "$model" --clients 1 --requests 1 --max-tokens 8 > /dev/null
  for c in 1 4 16; do
    for case in short document; do
      local doc=() n=$REQUESTS
      [ "$case" = document ] && doc=(--document "$DOC") && n=$DOC_REQUESTS
      echo "== server: $1 (round $3), $case prompt, $c clients x $n requests"
      "$PY" benches/peers/load.py --url "$2" --model "$model" --clients "$c" --requests "$n" \
        --max-tokens "$MAX_TOKENS" --label "$1" --round "$3" "${doc[@]}" | tee -a "$SRV"
    done
  done
}
stop() { kill "$1"; wait "$1" 2>/dev/null || true; PIDS=(); }
serve_ours() {  # round
  local port; port=$(free_port)
  RAYON_NUM_THREADS=$THREADS "$LIFT_BIN" serve --port "$port" --model "$MODEL" --max-batch "$MAX_BATCH" \
    --adapters-dir "$TMP/adapters-$1" --prepared-base none > "$OUT/ours-server.log" 2>&1 &
  local pid=$!; PIDS+=("$pid")
  wait_up "http://127.0.0.1:$port" "$pid" "$OUT/ours-server.log"
  load_levels ours "http://127.0.0.1:$port" "$1"
  stop "$pid"
}
serve_llama_server() {  # round
  local port; port=$(free_port)
  # One slot per sequence of our batch, each with room for the document case (2,048 tokens).
  "$LLAMA_SERVER" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -np "$MAX_BATCH" -c $((MAX_BATCH * 2048)) \
    --host 127.0.0.1 --port "$port" > "$OUT/llama-server.log" 2>&1 &
  local pid=$!; PIDS+=("$pid")
  wait_up "http://127.0.0.1:$port" "$pid" "$OUT/llama-server.log"
  load_levels llama-server "http://127.0.0.1:$port" "$1"
  stop "$pid"
}
serve_python() {
  local port; port=$(free_port)
  # interrupt_requests defaults to true there: a queued request would cut the streaming one short.
  "$PY" -m llama_cpp.server --model "$MODEL" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
    --n_ctx 4096 --n_batch 512 --interrupt_requests false --host 127.0.0.1 --port "$port" \
    > "$OUT/llama-python-server.log" 2>&1 &
  local pid=$!; PIDS+=("$pid")
  wait_up "http://127.0.0.1:$port" "$pid" "$OUT/llama-python-server.log"
  load_levels llama-cpp-python "http://127.0.0.1:$port" 1
  stop "$pid"
}

if [ "$SERVER" = 1 ]; then
  for round in $(seq 1 "$ROUNDS"); do
    if [ $((round % 2)) = 1 ]; then serve_ours "$round"; serve_llama_server "$round"
    else serve_llama_server "$round"; serve_ours "$round"; fi
  done
  if [ "$PYTHON_SERVER" = 1 ]; then serve_python; fi
fi

# --- summary ---
# Our server logs its configuration at start; older builds had no max_batch (one at a time).
MAX_BATCH=$(grep -o 'max_batch=[0-9]*' "$OUT/ours-server.log" 2>/dev/null | head -1 | cut -d= -f2 || true)
"$PY" - "$B1" "$SRV" "$OUT" "$THREADS" "${MAX_BATCH:-1}" "$LLAMA_CPP_PYTHON_VERSION" <<'EOF'
import json, statistics, sys, platform
b1, srv, out, threads, max_batch, version = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
rows = [json.loads(l) for l in open(b1) if l.strip()]
side = {s: [r for r in rows if r["side"] == s] for s in ("ours", "llama")}
med = lambda s, k: statistics.median(r[k] for r in side[s]) if side[s] and all(k in r for r in side[s]) else None
res = {"threads": int(threads), "runs": len(side["ours"]),
       "llama_cpp_python": side["llama"][0].get("llama_cpp_python") if side["llama"] else None,
       "batch1": {}, "server": []}
md = [f"# lift-serve vs llama.cpp (the llama.cpp of llama-cpp-python {version}), {threads} threads"]
def fmt(x, d=1): return "-" if x is None else f"{x:.{d}f}"
def ratio(a, b): return None if a is None or b is None else a / b
if rows:
    md += ["", f"Batch 1: median of {res['runs']} alternating runs, fresh processes.", "",
           "| batch 1 | ours | llama.cpp (perf counters) | llama.cpp (wall) | speed ours/llama (perf) | (wall) |",
           "|---|---|---|---|---|---|"]
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
    res["server"] = srows
    res["ours_max_batch"] = max_batch
    groups = {}
    for r in srows:
        groups.setdefault((r.get("case", "short"), r["clients"], r["label"]), []).append(r)
    def rounds(case, c, label, key):
        return [r[key] for r in sorted(groups.get((case, c, label), []), key=lambda r: r.get("round", 1)) if r.get(key) is not None]
    def both(xs, d=0):
        return " / ".join(fmt(x, d) for x in xs) if xs else "-"
    def median(xs):
        return statistics.median(xs) if xs else None
    per_client = {case: next((r["requests"] // max(r["clients"], 1) for r in srows if r.get("case", "short") == case), 0) for case in ("short", "document")}
    md += ["", f"Server: streamed /v1/chat/completions, {srows[0].get('completion_tokens', 0) // max(srows[0]['requests'], 1)} completion tokens a request, "
           f"requests per client: {per_client['short']} (short), {per_client['document']} (document); greedy; each cell of ours and "
           "llama-server one value per round (rounds alternate which server goes first).",
           "", "| prompt | clients | ours tok/s | llama-server tok/s | ours / llama-server | TTFT p50 ms: ours | llama-server | llama-cpp-python (serial): tok/s | TTFT p50 ms | prompt tokens |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for case in ("short", "document"):
        for c in sorted({k[1] for k in groups if k[0] == case}):
            o, l = rounds(case, c, "ours", "tok_s"), rounds(case, c, "llama-server", "tok_s")
            p = rounds(case, c, "llama-cpp-python", "tok_s")
            pt = rounds(case, c, "ours", "prompt_tokens_mean") or rounds(case, c, "llama-server", "prompt_tokens_mean")
            md.append(f"| {case} | {c} | {both(o)} | {both(l)} | {fmt(ratio(median(o), median(l)), 2)}x | "
                      f"{both(rounds(case, c, 'ours', 'ttft_p50_ms'))} | {both(rounds(case, c, 'llama-server', 'ttft_p50_ms'))} | "
                      f"{both(p)} | {both(rounds(case, c, 'llama-cpp-python', 'ttft_p50_ms'))} | {fmt(median(pt), 0)} |")
    errors = sum(r["errors"] for r in srows)
    sources = sorted({f"{r['label']}: {r['tokens_source']}" for r in srows})
    md += ["", f"Errors: {errors}. Completion tokens counted from: {', '.join(sources)}.",
           f"lift-serve batches up to {max_batch} generations (continuous batching, --max-batch); llama-server runs "
           f"{max_batch} parallel slots (-np {max_batch}, continuous batching); llama-cpp-python's server answers one request "
           "at a time (a global lock around its one `Llama`, run with --interrupt_requests false)."]
    try:
        info = open("/proc/cpuinfo").read()
        name = next(l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name"))
        flags = next(l.split(":", 1)[1].split() for l in info.splitlines() if l.startswith("flags"))
        want = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
        res["cpu"] = {"model": name, "flags": want}
        md += ["", f"CPU: {name}; {threads} threads; flags: {' '.join(want)}."]
    except (OSError, StopIteration):
        pass
res["machine"] = platform.processor() or platform.machine()
text = "\n".join(md) + "\n"
open(f"{out}/results.md", "w").write(text)
json.dump(res, open(f"{out}/results.json", "w"), indent=1)
print(text)
EOF
