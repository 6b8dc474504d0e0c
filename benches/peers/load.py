#!/usr/bin/env python3
"""Concurrent streamed /v1/chat/completions load against one OpenAI-compatible server.

Each of --clients threads sends --requests requests one after another; prints one JSON line with
requests/s, aggregate completion tokens/s, p50/p95 time to first token and p50 latency.
With --document, each request carries the first --document-words words of that text before its
question, as a document QA client does: prompt processing then dominates.
Python stdlib only, so it runs from any interpreter.
"""
import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse
import uuid

# Asks for a long answer so that both sides run to max_tokens: their greedy outputs differ
# (dequantized f32 vs llama.cpp's quantized dot products) and would stop at different lengths.
QUESTION = "Write a long, detailed story about a lighthouse keeper and a storm."
DOC_QUESTION = "Retell the text above in detail, in your own words, section by section."


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def one_request(host, port, model, max_tokens, timeout, document=None):
    question = QUESTION if document is None else f"{document}\n\n{DOC_QUESTION}"
    body = json.dumps({
        "model": model,
        # A fresh system line per request: llama-cpp-python reuses the KV cache of the previous
        # prompt's longest common prefix, which would skip the prefill of a repeated prompt
        # (lift-serve keeps no such cache). The same text shape on both sides.
        "messages": [
            {"role": "system", "content": f"Conversation {uuid.uuid4().hex[:12]}. You are a helpful assistant."},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    usage = None
    prompt_tokens = None
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if ev.get("usage"):
                usage = ev["usage"]
                prompt_tokens = usage.get("prompt_tokens")
            for choice in ev.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    finally:
        conn.close()
    latency = time.perf_counter() - t0
    tokens = usage.get("completion_tokens") if usage else None
    return {"ttft": ttft, "latency": latency, "chunks": chunks, "usage_tokens": tokens, "prompt_tokens": prompt_tokens}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="http://127.0.0.1:PORT")
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--requests", type=int, default=3, help="per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--label", default="")
    ap.add_argument("--document", help="a text file whose first words precede each question")
    ap.add_argument("--document-words", type=int, default=1250)
    ap.add_argument("--round", type=int, default=1, help="recorded in the output line")
    a = ap.parse_args()
    u = urllib.parse.urlparse(a.url)
    document = None
    if a.document:
        document = " ".join(open(a.document, encoding="utf-8").read().split()[: a.document_words])

    results, errors = [], []
    lock = threading.Lock()

    def client():
        for _ in range(a.requests):
            try:
                r = one_request(u.hostname, u.port, a.model, a.max_tokens, a.timeout, document)
                with lock:
                    results.append(r)
            except Exception as e:  # counted and reported, so one failure does not hide the rest
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    # Usage when every answer carried it; otherwise one token per content chunk.
    with_usage = results and all(r["usage_tokens"] is not None for r in results)
    tokens = sum(r["usage_tokens"] if with_usage else r["chunks"] for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    prompts = [r["prompt_tokens"] for r in results if r["prompt_tokens"] is not None]
    out = {
        "label": a.label,
        "case": "document" if document else "short",
        "round": a.round,
        "prompt_tokens_mean": sum(prompts) / len(prompts) if prompts else None,
        "clients": a.clients,
        "requests": len(results),
        "errors": len(errors),
        "wall_s": wall,
        "req_s": len(results) / wall,
        "completion_tokens": tokens,
        "tokens_source": "usage" if with_usage else "chunks",
        "content_chunks": sum(r["chunks"] for r in results),
        "tok_s": tokens / wall,
        "ttft_p50_ms": (percentile(ttfts, 0.5) or 0) * 1e3,
        "ttft_p95_ms": (percentile(ttfts, 0.95) or 0) * 1e3,
        "latency_p50_ms": percentile([r["latency"] for r in results], 0.5) * 1e3 if results else None,
    }
    if errors:
        out["first_error"] = errors[0]
    print(json.dumps(out))
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
