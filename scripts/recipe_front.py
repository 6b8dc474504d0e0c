#!/usr/bin/env python3
"""The recipe search's front: `lift` answers right against training tokens per document, one
point per recipe run of scripts/recipe_search.sh, and the passages alone (`rag`) as a line.

    scripts/recipe_front.py OUT.png [--split eval] [--cost steps] NAME=RUN/results.json ...

--split names the split the runs answered in the title (default: validation). --cost steps puts
optimizer steps per document on the x axis in place of training tokens: a GPU step costs about
the same at one row or sixteen (docs/cuda.md), so there the steps are the price.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def point(path, cost):
    r = json.load(open(path))
    absorbs = r["absorbs"] if isinstance(r["absorbs"], list) else list(r["absorbs"].values())
    if cost == "steps":
        tokens = sum(a["steps"] for a in absorbs) / len(absorbs)
    else:
        tokens = sum(a["tokens_per_s"] * a["train_seconds"] for a in absorbs) / len(absorbs)
    right = {m: 0 for m in ("lift", "rag")}
    total = 0
    for a in r["answers"]:
        if a["method"] in right:
            right[a["method"]] += a["scores"]["contains"] > 0
            total += a["method"] == "lift"
    return tokens, right["lift"], right["rag"], total


def main():
    out, args = sys.argv[1], sys.argv[2:]
    split, cost = "validation", "tokens"
    while args[:1] in (["--split"], ["--cost"]):
        if args[0] == "--split":
            split = args[1]
        else:
            cost = args[1]
        args = args[2:]
    runs = [a.split("=", 1) for a in args]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rag, total = None, None
    pts = []
    for name, path in runs:
        tokens, lift, rag, total = point(path, cost)
        pts.append((tokens, lift, name))
        ax.scatter(tokens, lift, color="tab:blue")
        ax.annotate(name, (tokens, lift), textcoords="offset points", xytext=(5, 4), fontsize=8)
    # The front: the points no other point matches in answers at fewer or as many tokens.
    front = sorted(
        (t, l) for t, l, _ in pts
        if not any((t2 <= t and l2 >= l) and (t2, l2) != (t, l) for t2, l2, _ in pts)
    )
    ax.plot([t for t, _ in front], [l for _, l in front], color="tab:blue", alpha=0.4)
    ax.axhline(rag, color="tab:orange", linestyle="--", label=f"rag (the passages alone): {rag}")
    ax.set_xscale("log")
    ax.set_xlabel(
        "optimizer steps per 1K-token document" if cost == "steps"
        else "training tokens per 1K-token document (teacher passes included)"
    )
    ax.set_ylabel(f"lift right of {total}")
    ax.set_title(f"Absorb recipes: answers against training cost ({split} split)")
    ax.legend(loc="lower right", fontsize=8)
    ax.margins(y=0.12)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
