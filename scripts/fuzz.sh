#!/usr/bin/env bash
# Fuzzes lift-serve's parsers of untrusted input (fuzz/: cargo-fuzz, libFuzzer): each target runs
# SECONDS (default 30) from the seed corpus scripts/fuzz_corpus.py writes. A crash is saved under
# fuzz/artifacts/<target>/; make it a regression test (see docs/fuzzing.md). cargo-fuzz needs a
# nightly compiler: on a stable toolchain RUSTC_BOOTSTRAP=1 unlocks its flags.
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]   (FUZZ_SEED=N: libFuzzer's seed, as CI sets it;
# BUILD_ONLY=1: build the targets and stop, as CI does beside its tests; the run then finds them built)
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(extract_text extract_markdown extract_html extract_pdf extract_zipped multipart request_bodies)
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
python3 scripts/fuzz_corpus.py fuzz/corpus >/dev/null
export RUSTC_BOOTSTRAP=1
for t in "${targets[@]}"; do
  start=$(date +%s)
  if [ "${BUILD_ONLY:-0}" = 1 ]; then
    extra=()
    [ "$t" = request_bodies ] && extra=(--features server)
    cargo fuzz build --fuzz-dir fuzz "${extra[@]}" "$t"
    echo "fuzz build $t: $(($(date +%s) - start)) s"
    continue
  fi
  # The server's budgets in libFuzzer's terms: 20 s an input, 2 GiB of memory.
  # request_bodies reads bodies as the server does: it needs the whole crate (a long first build).
  features=()
  [ "$t" = request_bodies ] && features=(--features server)
  cargo fuzz run --fuzz-dir fuzz "${features[@]}" "$t" "fuzz/corpus/$t" -- \
    -max_total_time="$secs" -timeout=20 -rss_limit_mb=2048 -max_len=8388608 ${FUZZ_SEED:+-seed=$FUZZ_SEED}
  echo "fuzz $t: $(($(date +%s) - start)) s"
done
