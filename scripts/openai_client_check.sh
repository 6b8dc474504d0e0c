#!/usr/bin/env bash
# Runs the official `openai` Python client (from PyPI, in a throwaway venv) against lift-serve on
# the real default model: start the server on a free port with short absorb options, absorb a
# short document, then models.list(), a chat completion and a streamed one with the document as
# model. Expects a release build and the fetched default model.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(./scripts/openai_venv.sh)
work=$(mktemp -d)
trap 'kill "$server" 2>/dev/null || true; rm -rf "$work"' EXIT
cat > "$work/options.json" <<'JSON'
{"plan": {"window": 64, "context_tokens": 64}, "train": {"epochs": [1, 1]},
 "qa": {"use_model": false, "max_pairs": 4, "min_pairs": 2}}
JSON
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
head -c 700 tests/fixtures/harbor_history.txt > "$work/doc.txt"
./target/release/lift-serve serve --port "$port" --adapters-dir "$work/adapters" \
  --absorb-options "$work/options.json" > "$work/server.log" 2>&1 &
server=$!
for _ in $(seq 1 120); do
  python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1])" \
    "http://127.0.0.1:$port/health" 2>/dev/null && break
  sleep 0.5
done
if ! LIFT_URL="http://127.0.0.1:$port" "$venv/bin/python" scripts/openai_client_check.py "$work/doc.txt"; then
  tail -n 30 "$work/server.log"
  exit 1
fi
