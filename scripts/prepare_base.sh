#!/usr/bin/env bash
# Rebuilds the shipped prepared base (base/) from nothing: the default model, the essays, the
# options of the shipped arm (scripts/prepared_base/trunc.json: LoRA + filter, half the training
# examples shown truncated as LIFT's answers see a document, no CDT) and the same example count;
# the manifest records the command, options, seed, data hash and held-out figures. Deterministic
# for the seed on the same machine type. About 25 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --bins --features research
bin=./target/release/lift-serve
$bin fetch-model >/dev/null
$bin fetch-data >/dev/null
$bin prepare-base --options scripts/prepared_base/trunc.json --examples 150 --validation 40 --output "${1:-base}"
