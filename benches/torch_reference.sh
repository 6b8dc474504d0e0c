#!/usr/bin/env bash
# PyTorch-eager reference for the Rust training-step benchmark.
#
# Why this exists: a Rust/candle step time means little on its own; running the same
# SmolLM2-135M + Gated Memory training step in PyTorch on the same machine, in the same run,
# gives a baseline to compare against (same cores, same thermal/noise conditions).
#
# Why a throwaway venv: the project must never depend on torch. Torch lives only in a venv
# outside the repository, created on first use and reused afterwards (idempotent: if torch
# already imports there, nothing is installed).
#
# Usage:
#   bash benches/torch_reference.sh [extra args for torch_reference.py]
# Environment:
#   TORCH_VENV          venv path (default /tmp/lift-torch-venv)
#   THREADS             intra-op threads for torch and OpenMP (default 2 = the whole machine)
#   PYTHON              interpreter used to create the venv (default python3)
#   TORCH_INSTALL_ONLY  if 1, only prepare the venv (e.g. to warm it up before timing anything)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${TORCH_VENV:-/tmp/lift-torch-venv}"
threads="${THREADS:-2}"
python="${PYTHON:-python3}"
# Recent torch wheels warn at import when numpy is absent; numpy is not needed here, so the
# warning is silenced instead of installing it.
quiet="ignore:Failed to initialize NumPy"

if ! "$venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
    echo "[torch_reference] preparing venv at $venv" >&2
    "$python" -m venv "$venv"
    # Plain `torch` from whatever index pip is configured with. On x86_64 Linux that may be
    # the CUDA build (large download); only its CPU kernels are used here. numpy is not
    # needed: the benchmark is pure torch.
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet torch
    "$venv/bin/python" -W "$quiet" -c 'import torch' # fail loudly here, not in the benchmark
fi

if [[ "${TORCH_INSTALL_ONLY:-0}" == 1 ]]; then
    echo "[torch_reference] venv ready: $("$venv/bin/python" -W "$quiet" -c 'import torch; print(torch.__version__)')" >&2
    exit 0
fi

# OpenMP/MKL read their thread counts at load time, so they are set in the environment too;
# the Python script additionally calls torch.set_num_threads with the same value.
export OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"
exec "$venv/bin/python" "$here/torch_reference.py" --threads "$threads" "$@"
