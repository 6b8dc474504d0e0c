#!/usr/bin/env bash
# The pre-registered comparison of docs/prepared-base.md: trains each arm on the same examples for
# the same steps (scripts/prepared_base/<arm>.json; only the filter, CDT and truncate switches differ), then
# answers the same held-out reading set with every arm and the untrained model.
#
#   ./scripts/prepare_base_arms.sh                 # all arms (hours on 2 CPU cores)
#   ARMS="both" ./scripts/prepare_base_arms.sh     # some arms; the eval covers those trained
#   BIN=/tmp/lift-serve ./scripts/prepare_base_arms.sh   # run a copied binary, build nothing
#
# Output: target/arms/<arm>/ (a prepared base each), target/eval-base/ (answers, results.md).
# An interrupted arm resumes from its checkpoint when run again.
set -euo pipefail
cd "$(dirname "$0")/.."
ARMS="${ARMS:-lora filter cdt both trunc}"
EXAMPLES="${EXAMPLES:-150}"
PER_LENGTH="${PER_LENGTH:-100}"
# BIN: a copy of the binary to run, so that rebuilding the tree meanwhile does not change it.
if [ -z "${BIN:-}" ]; then cargo build --release --bins --features research; fi
bin="${BIN:-./target/release/lift-serve}"
$bin fetch-model >/dev/null
$bin fetch-data >/dev/null
for arm in $ARMS; do
  out="target/arms/$arm"
  if [ -f "$out/manifest.json" ]; then
    echo "== $arm: already trained ($out)"
    continue
  fi
  resume=()
  [ -f "$out/checkpoint/state.json" ] && resume=(--resume)
  echo "== training $arm"
  $bin prepare-base --options "scripts/prepared_base/$arm.json" --examples "$EXAMPLES" --validation 40 \
    --output "$out" "${resume[@]}"
done
eval_arms=(--arm untrained=none)
for arm in $ARMS; do eval_arms+=(--arm "$arm=target/arms/$arm"); done
$bin eval-base "${eval_arms[@]}" --per-length "$PER_LENGTH" --output target/eval-base
