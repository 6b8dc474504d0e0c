#!/usr/bin/env bash
# Rebuilds the shipped prepared base (base/) from nothing: the default model, the essays, the
# options of the shipped arm (scripts/prepared_base/both.json) and the same example count; the
# manifest records the command, seed, data hash and held-out figures. Deterministic for the seed
# on the same machine type. About 50 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins
bin=./target/release/lift-serve
$bin fetch-model >/dev/null
$bin fetch-data >/dev/null
$bin prepare-base --options scripts/prepared_base/both.json --examples 150 --validation 40 --output "${1:-base}"
