#!/usr/bin/env python3
"""llama.cpp side of the peer benchmark (benches/peers.sh), through llama-cpp-python.

  llama_side.py --model M.gguf --write-ids ids.json --text a.txt [--text b.txt]
      tokenizes the texts (repeated until 2048 ids) once, for both sides
  llama_side.py --model M.gguf --ids ids.json --threads T
      prefill of 512 and 2048 ids (fresh context each) and 64 greedy decode steps after a
      128-id prompt; prints one JSON line

llama.cpp's own perf counters (t_p_eval / t_eval) time the C++ work without the Python around
it; the wall-clock figures include llama-cpp-python's per-call overhead.
"""
import argparse
import json
import sys
import time

import numpy as np
import llama_cpp
from llama_cpp import Llama

N_IDS = 2048
DECODE_PROMPT = 128
DECODE_STEPS = 64


def write_ids(a):
    llm = Llama(model_path=a.model, vocab_only=True, verbose=False)
    ids = []
    for path in a.text:
        with open(path, "rb") as f:
            ids += llm.tokenize(f.read(), add_bos=False, special=False)
    if not ids:
        sys.exit("no tokens")
    ids = (ids * (N_IDS // len(ids) + 1))[:N_IDS]
    with open(a.write_ids, "w") as f:
        json.dump({"source": a.text, "tokenizer": "llama.cpp (same GGUF)", "ids": ids}, f)


def perf(llm):
    if not hasattr(llama_cpp, "llama_perf_context"):
        return None
    return llama_cpp.llama_perf_context(llm.ctx)


def sync(llm):
    # llama.cpp books a decode into its perf counters only at the next synchronize (which
    # llama-cpp-python never calls when it keeps no logits), so sync right after each eval.
    if hasattr(llama_cpp, "llama_synchronize"):
        llama_cpp.llama_synchronize(llm.ctx)


def perf_reset(llm):
    if hasattr(llama_cpp, "llama_perf_context_reset"):
        llama_cpp.llama_perf_context_reset(llm.ctx)


def measure(a):
    with open(a.ids) as f:
        ids = json.load(f)["ids"]
    assert len(ids) >= N_IDS, f"need {N_IDS} ids"
    t_load = time.perf_counter()
    llm = Llama(
        model_path=a.model,
        n_ctx=4096,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_batch=512,
        verbose=False,
        logits_all=False,
    )
    load_s = time.perf_counter() - t_load
    n_vocab = llm.n_vocab()

    def prefill(n):
        # reset() + eval: eval removes every cached position from n_tokens (0) on, so this is a
        # fresh context, as on our side.
        llm.reset()
        perf_reset(llm)
        t = time.perf_counter()
        llm.eval(ids[:n])
        sync(llm)
        wall = time.perf_counter() - t
        p = perf(llm)
        return wall, p

    def decode(steps):
        llm.reset()
        llm.eval(ids[:DECODE_PROMPT])
        sync(llm)
        perf_reset(llm)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
            llm.eval([int(np.argmax(logits))])
            sync(llm)
            times.append(time.perf_counter() - t)
        return times, perf(llm)

    # Warm-up, as on our side.
    prefill(512)
    decode(4)

    used_perf = []
    out = {"side": "llama", "threads": a.threads, "model": a.model, "load_s": load_s,
           "llama_cpp_python": llama_cpp.__version__}
    for n in (512, 2048):
        wall, p = prefill(n)
        out[f"prefill_{n}_wall_ms"] = wall * 1e3
        if p is not None and p.t_p_eval_ms > 0 and p.n_p_eval == n:
            out[f"prefill_{n}_ms"] = p.t_p_eval_ms
            out[f"prefill_{n}_n_p_eval"] = p.n_p_eval
            used_perf.append(f"prefill_{n}")
        else:
            out[f"prefill_{n}_ms"] = wall * 1e3
        out[f"prefill_{n}_tok_s"] = n / (out[f"prefill_{n}_ms"] / 1e3)
    times, p = decode(DECODE_STEPS)
    out["decode_wall_ms_per_tok"] = sum(times) / len(times) * 1e3
    out["decode_wall_median_ms_per_tok"] = sorted(times)[len(times) // 2] * 1e3
    if p is not None and p.t_eval_ms > 0 and p.n_eval == DECODE_STEPS:
        out["decode_ms_per_tok"] = p.t_eval_ms / p.n_eval
        out["decode_n_eval"] = p.n_eval
        used_perf.append("decode")
    else:
        out["decode_ms_per_tok"] = out["decode_wall_ms_per_tok"]
    # Which figures come from the perf counters (the others fell back to wall-clock).
    out["perf_counters"] = used_perf
    out["decode_steps"] = DECODE_STEPS
    out["decode_prompt"] = DECODE_PROMPT
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ids")
    ap.add_argument("--write-ids")
    ap.add_argument("--text", action="append", default=[])
    a = ap.parse_args()
    if a.write_ids:
        write_ids(a)
    elif a.ids:
        measure(a)
    else:
        ap.error("--ids or --write-ids")


if __name__ == "__main__":
    main()
