#!/usr/bin/env bash
# nvcc as `cargo check` of the CUDA build uses it (scripts/cuda_compile_check.sh, CHECK_ONLY=1):
# our kernels (kernels/*.cu, compiled by build.rs) go to the real nvcc ($REAL_NVCC); candle's own
# kernels, compiled by candle-kernels' build script, are stood in for by empty outputs of the
# same names. Those are upstream sources pinned by Cargo.lock that no change of ours touches, and
# they are most of the check's time (the quantized matmul instances alone take many minutes on 2
# cores); `cargo check` never links, and the full build (CHECK_ONLY unset) compiles them all.
set -euo pipefail
case "$PWD" in
  */candle-kernels-*) ;;
  *) exec "$REAL_NVCC" "$@" ;;
esac
orig=("$@") out="" outdir="" mode="" sources=() objects=()
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    --output-directory) outdir="$2"; shift ;;
    --ptx|-ptx) mode=ptx ;;
    -c) mode=object ;;
    --lib|-lib) mode=lib ;;
    *.cu) sources+=("$1") ;;
    *.o) objects+=("$1") ;;
  esac
  shift
done
case "$mode" in
  ptx)
    for s in "${sources[@]}"; do
      f="${outdir:-.}/$(basename "${s%.cu}").ptx"
      printf '// %s: not compiled by the CUDA check (scripts/nvcc_for_check.sh)\n' "$s" > "$f"
    done ;;
  object) cc -c -x c /dev/null -o "$out" ;;
  lib) rm -f "$out"; ar crs "$out" "${objects[@]}" ;;
  *) exec "$REAL_NVCC" "${orig[@]}" ;;
esac
