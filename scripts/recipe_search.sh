#!/usr/bin/env bash
# The recipe search's one protocol (docs/recipe-search.md): each recipe absorbs the same
# planted-fact documents (1K tokens, 15 questions each: three per depth, every kind) and answers
# them with the adapter on the retrieved passages (`lift`, the default context of 128 tokens);
# `rag` (the passages alone) is answered in every run. The runs are merged into one report,
# every recipe paired by question against the first.
#
#   scripts/recipe_search.sh SPLIT SEED DOCS OUT RECIPE...
#
# SPLIT: validation (to choose) or eval (to report); RECIPE: a name from the table below.
# Training cost per recipe: `absorb s` and the training tokens in OUT/<recipe>/results.json.
set -euo pipefail
cd "$(dirname "$0")/.."
split=$1 seed=$2 docs=$3 out=$4
shift 4
bin=${LIFT_BIN:-./target/release/lift-serve}
export RAYON_NUM_THREADS="${RAYON_NUM_THREADS:-2}"
recipe_flags() {
  case $1 in
    default) echo "" ;;                                              # today's default: [3, 5], head and tail
    passages) echo "--qa-layout passages" ;;                          # the same, QA in the answer's layout
    e12) echo "--epochs 1,2" ;;
    e12-passages) echo "--epochs 1,2 --qa-layout passages" ;;
    e02-passages) echo "--epochs 0,2 --qa-layout passages" ;;
    e01-passages) echo "--epochs 0,1 --qa-layout passages" ;;
    e12-passages-upper) echo "--epochs 1,2 --qa-layout passages --layers 15-29" ;;
    *) echo "unknown recipe '$1'" >&2; exit 2 ;;
  esac
}
runs=()
for r in "$@"; do
  flags=$(recipe_flags "$r")
  mkdir -p "$out/$r"
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$bin" eval --split "$split" --seed "$seed" --methods rag,lift --lengths 1024 \
    --depths 0.1,0.3,0.5,0.7,0.9 --needles-per-depth 3 --docs-per-length "$docs" \
    --context-tokens 128 --quiet --out "$out/$r" $flags > "$out/$r/log.txt" 2>&1
  echo "$r: $(($(date +%s) - start)) s"
  runs+=("$out/$r/results.json")
done
if [ ${#runs[@]} -gt 1 ]; then
  "$bin" eval --merge "$(IFS=,; echo "${runs[*]}")" --out "$out/merged" > "$out/merged.md"
fi
