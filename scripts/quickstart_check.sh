#!/usr/bin/env bash
# Runs README.md's Quickstart as a user would: the server started by its first command, then every
# other shell block of the section in order (upload with curl, follow the progress events, ask,
# ask with other modes and streamed), then its Python block with the official `openai` client.
# The blocks are read from README.md itself, so the README cannot drift from what works; only the
# port is changed (a free one instead of 8080) and the adapters go to a throwaway directory.
# Expects a release build and the fetched default model (scripts/test.sh runs it after them).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(./scripts/openai_venv.sh)
work=$(mktemp -d)
server=""
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$work"' EXIT
fail() {
  [ -f "$work/blocks.out" ] && cp "$work/blocks.out" /tmp/quickstart-blocks.out
  echo "quickstart check FAILED: $1" >&2
  [ -f "$work/server.log" ] && tail -n 30 "$work/server.log" >&2
  exit 1
}

# The Quickstart section's fenced blocks, each to its own file: bash-1.sh, bash-2.sh, …, python-1.py.
python3 - "$work" <<'EOF'
import re, sys
work = sys.argv[1]
text = open("README.md", encoding="utf-8").read()
section = re.search(r"^## Quickstart\n(.*?)^## ", text, re.S | re.M)
if not section:
    sys.exit("README.md has no '## Quickstart' section")
count = {}
for lang, body in re.findall(r"^```(\w+)\n(.*?)^```", section.group(1), re.S | re.M):
    count[lang] = count.get(lang, 0) + 1
    ext = {"bash": "sh", "python": "py"}.get(lang, lang)
    open(f"{work}/{lang}-{count[lang]}.{ext}", "w", encoding="utf-8").write(body)
print("quickstart blocks:", ", ".join(f"{n} {lang}" for lang, n in count.items()))
EOF
[ "$(cat "$work/bash-1.sh")" = "./scripts/run.sh" ] || fail "the first Quickstart block is not ./scripts/run.sh: $(cat "$work/bash-1.sh")"
[ -f "$work/bash-2.sh" ] && [ -f "$work/python-1.py" ] || fail "the Quickstart has no upload block or no Python block"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for f in "$work"/bash-*.sh "$work"/python-*.py; do
  sed -i "s/127\.0\.0\.1:8080/127.0.0.1:$port/g; s/localhost:8080/localhost:$port/g" "$f"
done
# The first block, with a throwaway adapters directory and the free port.
# LIFT_NO_BUILD: scripts/test.sh has just built the binaries (with the tests' feature).
LIFT_NO_BUILD="${LIFT_NO_BUILD:-1}" ./scripts/run.sh serve --port "$port" --adapters-dir "$work/adapters" > "$work/server.log" 2>&1 &
server=$!
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 "$server" 2>/dev/null || fail "the server exited"
  sleep 0.5
done
curl -sf "http://127.0.0.1:$port/health" > /dev/null || fail "the server did not come up"

# The shell blocks in one shell (the upload block exports DOC for the others), each output kept.
{
  echo 'set -euo pipefail'
  for f in $(ls "$work"/bash-*.sh | sort -V | tail -n +2); do
    echo "echo; echo '>>> $(basename "$f")'"
    cat "$f"
  done
  echo 'echo "DOC=$DOC" > '"$work/doc.env"
} > "$work/blocks.sh"
start=$(date +%s)
( cd "$PWD" && timeout 900 bash "$work/blocks.sh" ) > "$work/blocks.out" 2>&1 || { cat "$work/blocks.out" >&2; fail "a shell block failed"; }
echo "shell blocks: $(($(date +%s) - start)) s"
# shellcheck disable=SC1091
. "$work/doc.env"
out=$(cat "$work/blocks.out")
[[ "$DOC" =~ ^doc_[0-9a-f]{32}$ ]] || fail "the upload block gave no document id: '$DOC'"
grep -q '^event: done' <<< "$out" || fail "the progress events did not end with 'event: done'"
grep -q '"status":"ready"' <<< "$out" || fail "the document did not end ready"
# The first /ask: the founder's name is in the answer (the fact is in the document's text).
first_answer=$(awk '/^>>> bash-4.sh/{f=1; next} f && /^\{/{print; exit}' "$work/blocks.out")
python3 -c 'import json, sys; a = json.loads(sys.argv[1]); sys.exit(0 if "Wren" in a["answer"] else "no Tobias Wren in: " + a["answer"])' "$first_answer" ||
  fail "the first /ask did not name the founder"
grep -q '^event: answer' <<< "$out" || fail "the streamed /ask sent no 'event: answer'"
echo "shell blocks: ok (document $DOC)"

# The Python block with the official client.
DOC="$DOC" timeout 300 "$venv/bin/python" "$work/python-1.py" > "$work/python.out" 2>&1 || { cat "$work/python.out" >&2; fail "the Python block failed"; }
[ -s "$work/python.out" ] || fail "the Python block printed nothing"
grep -q "Wren" "$work/python.out" || { cat "$work/python.out" >&2; fail "the openai client's answers do not name the founder"; }
echo "python block: ok"
echo "quickstart check: ok"
