#!/usr/bin/env bash
# Prints the path of a Python venv with the official `openai` client (from PyPI), made on first
# use: the openai client check and the Quickstart check share it. OPENAI_VENV overrides the path.
set -euo pipefail
venv="${OPENAI_VENV:-/tmp/lift-openai-venv}"
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet openai >&2
fi
echo "$venv"
