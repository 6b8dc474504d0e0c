#!/usr/bin/env bash
# Cuts the default model's file into parts that the device tool can carry one per call (a call
# carries at most 64 MiB with the working tree): .gpu-model/a, .gpu-model/b, .gpu-model/c, each
# a folder with `part` (and `a` also the whole file's sha256). Carried by three consecutive calls
# while the GPU machine stays warm (ignored files already there are kept between calls), they are
# joined and verified there by `GPU_STEPS=real scripts/gpu_checks.sh`.
#
#   scripts/gpu_model_parts.sh [SIZE_A SIZE_B]   # bytes of the first two parts (default 20 MB, 48 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${LIFT_MODELS_DIR:-models}/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$MODEL" ] || { echo "no $MODEL: run lift-serve fetch-model first" >&2; exit 1; }
A="${1:-20000000}" B="${2:-48000000}"
grep -qx '/.gpu-model/' .git/info/exclude 2>/dev/null || echo '/.gpu-model/' >> .git/info/exclude
rm -rf .gpu-model && mkdir -p .gpu-model/a .gpu-model/b .gpu-model/c
cut_part() { dd if="$MODEL" of="$1" bs=1M iflag=skip_bytes,count_bytes status=none skip="$2" ${3:+count=$3}; }
cut_part .gpu-model/a/part 0 "$A"
cut_part .gpu-model/b/part "$A" "$B"
cut_part .gpu-model/c/part "$((A + B))"
sha256sum "$MODEL" | cut -d' ' -f1 > .gpu-model/a/sha256
cat .gpu-model/a/part .gpu-model/b/part .gpu-model/c/part | sha256sum | cut -d' ' -f1 | cmp - .gpu-model/a/sha256
du -b .gpu-model/*/part
