#!/usr/bin/env bash
# The recipe search's one protocol (docs/recipe-search.md): each recipe absorbs the same
# planted-fact documents (1K tokens, 15 questions each: three per depth, every kind) and answers
# them with the adapter on the retrieved passages (`lift`, the default context of 128 tokens);
# `rag` (the passages alone) is answered in every run. The runs are merged into one report,
# every method paired by question against the first recipe's `lift`.
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
    # The first shipped schedule: 3 + 5 epochs, questions behind the head and tail, at most 64
    # questions per 1,000 tokens (the default until the lean recipe).
    paper) echo "--recipe paper" ;;
    # The same with the fixed cap of 256 questions it was measured with before the questions grew
    # with the length (~200 at 1K tokens: four wordings of every fact).
    paper-q256) echo "--recipe paper --aux-qa 256" ;;
    paper-q256-upper) echo "--recipe paper --aux-qa 256 --layers 15-29" ;;
    lean) echo "--recipe lean" ;;
    # LoRA (r = 128 on all seven projections of every layer, lr 5e-5: the LIFT authors' later
    # adapter) in place of Gated Memory.
    lean-lora) echo "--recipe lean --adapter lora" ;;
    paper-lora) echo "--recipe paper --adapter lora" ;;
    # Four rows per optimizer step as one batched forward/backward (a quarter of the steps), at
    # the same learning rate and at twice it with a warm-up (scripts/recipe-options/).
    lean-rows4) echo "--recipe lean --options scripts/recipe-options/rows4.json" ;;
    lean-rows4-lr2x) echo "--recipe lean --options scripts/recipe-options/rows4-lr2x.json" ;;
    paper-rows4) echo "--recipe paper --options scripts/recipe-options/rows4.json" ;;
    paper-rows8) echo "--recipe paper --options scripts/recipe-options/rows8.json" ;;
    # The questions trained closed-book (no document tokens before them: `plan.qa_context_tokens`
    # 0): recall without the head and tail's 128 tokens a question.
    paper-closed) echo "--recipe paper --options scripts/recipe-options/closed.json" ;;
    e12-passages) echo "--recipe paper --epochs 1,2 --qa-layout passages" ;;
    e01-q256) echo "--recipe paper --epochs 0,1 --aux-qa 256" ;;
    e01-q256-passages) echo "--recipe paper --epochs 0,1 --aux-qa 256 --qa-layout passages" ;;
    # The rejected recipes (paper-select30, e01-q256-recall-distill, e02-q256-mixed*) need the code
    # removed after commit 6843605 (docs/recipe-search.md): run them from that commit.
    *) echo "unknown recipe '$1'" >&2; exit 2 ;;
  esac
}
runs=()
for r in "$@"; do
  flags=$(recipe_flags "$r")
  mkdir -p "$out/$r"
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$bin" eval --split "$split" --seed "$seed" --methods lift,rag --lengths 1024 \
    --depths 0.1,0.3,0.5,0.7,0.9 --needles-per-depth 3 --docs-per-length "$docs" \
    --context-tokens 128 --quiet --out "$out/$r" $flags > "$out/$r/log.txt" 2>&1
  echo "$r: $(($(date +%s) - start)) s"
  runs+=("$out/$r/results.json")
done
if [ ${#runs[@]} -gt 1 ]; then
  "$bin" eval --merge "$(IFS=,; echo "${runs[*]}")" --out "$out/merged" > "$out/merged.md"
fi
