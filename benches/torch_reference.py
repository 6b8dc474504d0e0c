#!/usr/bin/env python3
"""PyTorch-eager reference for lift-serve's training-step benchmark.

Why: the Rust/candle training step is only meaningful next to a baseline measured on the same
machine in the same run. This script times the *same* step in PyTorch:

  SmolLM2-135M architecture (Llama decoder, 30 layers, hidden 576, MLP 1536, 9 query heads,
  3 KV heads, head_dim 64, vocab 49152, tied embeddings, RMSNorm eps 1e-5, rotate-half RoPE
  theta 100000, f32), base weights frozen and random (timing only, nothing is loaded),
  plus a Gated Memory adapter on every layer (layout of the LIFT authors' code, mirrored by
  src/adapters/gated_memory.rs):
      per layer, per query head, on the head's PRE-RoPE query q (d = 64):
      memory m(q) = W2 . SiLU(W1 . q)                      W1 [H, d, 2d], W2 [H, 2d, d]
      gate   g(q) = sigmoid(3 . (G2 . SiLU(G1 . q) - 1))   G1 [H, d, 8],  G2 [H, 8, 1]
      head output = (1 - g) . attn + g . m, before o_proj.

One step = embedding lookup of T random tokens (batch 1) -> forward -> logits at every position
-> mean cross-entropy against the next tokens -> backward -> global grad-norm clip 1.0 ->
AdamW(1e-3, (0.9, 0.98), 1e-8, wd 1e-4) step -> zero_grad.

Two attention variants: "torch-eager" (explicit q.k^T/sqrt(d) + causal mask, softmax, .v, as
the Rust code does it) and "torch-sdpa" (F.scaled_dot_product_attention(is_causal=True), i.e.
PyTorch's best built-in CPU kernel).

Each (variant, T) runs in its own child process so that ru_maxrss (a lifetime peak) is that
configuration's own peak and not left over from a larger one run before it.

Output: a header (torch version, threads), one JSON line per configuration (the only stdout
lines starting with '{', for the Rust bench script to parse), then a summary table.
Run it through torch_reference.sh, which owns the venv and the thread environment.
"""

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

# numpy is deliberately not installed (nothing here needs it); recent torch warns about that at
# import time, which would only clutter the output.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# Peak RSS right after `import torch`. A CUDA build of torch maps several hundred MB of libraries
# before any tensor exists; reporting it lets a comparison with Rust subtract that fixed cost.
IMPORT_RSS_MB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json).
LAYERS = 30
HIDDEN = 576
INTERMEDIATE = 1536
HEADS = 9
KV_HEADS = 3
HEAD_DIM = 64
VOCAB = 49152
RMS_EPS = 1e-5
ROPE_THETA = 100000.0

IMPLS = ("torch-eager", "torch-sdpa")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def frozen_linear(out_f, in_f):
    # Base weights are random (timing only); std 0.02 keeps activations in a sane range so the
    # softmax/exp work is representative. [out, in] layout as nn.Linear, used via F.linear.
    return torch.randn(out_f, in_f) * 0.02


def kaiming_uniform(shape, fan_in):
    # Same rule as torch's nn.Linear default and the Rust adapter: U(-1/sqrt(fan_in), +...).
    bound = 1.0 / math.sqrt(fan_in)
    return torch.nn.Parameter(torch.empty(shape).uniform_(-bound, bound))


class GatedMemory(torch.nn.Module):
    """One layer's adapter. Weights grouped per head ([H, in, out]) so a single batched matmul
    serves all heads; no biases because SmolLM2's attention has none."""

    def __init__(self, heads, d):
        super().__init__()
        s = math.isqrt(d)  # floor(sqrt(d)) = 8 for d = 64
        self.mem_w1 = kaiming_uniform((heads, d, 2 * d), d)
        self.mem_w2 = kaiming_uniform((heads, 2 * d, d), 2 * d)
        self.gate_w1 = kaiming_uniform((heads, d, s), d)
        self.gate_w2 = kaiming_uniform((heads, s, 1), s)

    def forward(self, q_pre_rope, attn):
        # q_pre_rope, attn: [b, H, T, d]
        b, h, t, d = q_pre_rope.shape
        x = q_pre_rope.transpose(0, 1).reshape(h, b * t, d)  # [H, b*T, d]
        m = torch.bmm(F.silu(torch.bmm(x, self.mem_w1)), self.mem_w2)  # [H, b*T, d]
        g = torch.bmm(F.silu(torch.bmm(x, self.gate_w1)), self.gate_w2)  # [H, b*T, 1]
        g = torch.sigmoid(3.0 * (g - 1.0))
        m = m.reshape(h, b, t, d).transpose(0, 1)
        g = g.reshape(h, b, t, 1).transpose(0, 1)
        return (1.0 - g) * attn + g * m


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * w


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(t):
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
    return emb.cos(), emb.sin()


class Layer:
    def __init__(self):
        self.attn_norm = torch.ones(HIDDEN)
        self.q = frozen_linear(HEADS * HEAD_DIM, HIDDEN)
        self.k = frozen_linear(KV_HEADS * HEAD_DIM, HIDDEN)
        self.v = frozen_linear(KV_HEADS * HEAD_DIM, HIDDEN)
        self.o = frozen_linear(HIDDEN, HEADS * HEAD_DIM)
        self.ffn_norm = torch.ones(HIDDEN)
        self.gate = frozen_linear(INTERMEDIATE, HIDDEN)
        self.up = frozen_linear(INTERMEDIATE, HIDDEN)
        self.down = frozen_linear(HIDDEN, INTERMEDIATE)


class Model:
    """Frozen base as plain tensors (requires_grad=False by construction); only the adapters
    are nn.Parameters, exactly like LIFT's Gated Memory fine-tuning."""

    def __init__(self, impl):
        self.impl = impl
        self.embed = torch.randn(VOCAB, HIDDEN) * 0.02  # tied: also the LM head
        self.layers = [Layer() for _ in range(LAYERS)]
        self.final_norm = torch.ones(HIDDEN)
        self.adapters = torch.nn.ModuleList(GatedMemory(HEADS, HEAD_DIM) for _ in range(LAYERS))
        self.groups = HEADS // KV_HEADS

    def attention(self, q, k, v, mask):
        if self.impl == "torch-sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(HEAD_DIM)) + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    def forward(self, tokens, cos, sin, mask):
        b, t = tokens.shape
        x = F.embedding(tokens, self.embed)
        for layer, adapter in zip(self.layers, self.adapters):
            h = rms_norm(x, layer.attn_norm)
            q = F.linear(h, layer.q).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
            k = F.linear(h, layer.k).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
            v = F.linear(h, layer.v).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
            q_rot = q * cos + rotate_half(q) * sin
            k_rot = k * cos + rotate_half(k) * sin
            # GQA: query head i reads KV head i // groups. Expanded identically for both variants
            # so that they differ only in the attention kernel itself.
            k_rot = k_rot.repeat_interleave(self.groups, dim=1)
            v_rep = v.repeat_interleave(self.groups, dim=1)
            attn = self.attention(q_rot, k_rot, v_rep, mask)
            attn = adapter(q, attn)  # memory/gate read the PRE-RoPE query
            attn = attn.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM)
            x = x + F.linear(attn, layer.o)
            h = rms_norm(x, layer.ffn_norm)
            x = x + F.linear(F.silu(F.linear(h, layer.gate)) * F.linear(h, layer.up), layer.down)
        x = rms_norm(x, self.final_norm)
        return F.linear(x, self.embed)  # logits at every position, [b, T, vocab]


# ---------------------------------------------------------------------------------------------
# One configuration (child process)
# ---------------------------------------------------------------------------------------------

def run_one(impl, seq, warmup, steps, seed, threads):
    torch.manual_seed(seed)  # same weights for both variants and every T
    model = Model(impl)
    params = list(model.adapters.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=1e-4)

    gen = torch.Generator().manual_seed(seed + 1)
    seqs = torch.randint(0, VOCAB, (1, seq + 1), generator=gen)
    inputs, targets = seqs[:, :-1], seqs[:, 1:]
    cos, sin = rope_tables(seq)
    mask = torch.full((seq, seq), float("-inf")).triu(1)  # additive causal mask (eager only)

    losses = []

    def step():
        logits = model.forward(inputs, cos, sin, mask)
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    # Sanity once, untimed: gradients must reach every adapter tensor, including layer 0's
    # (which means backward runs through the whole frozen stack, as in the Rust step).
    logits = model.forward(inputs, cos, sin, mask)
    F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1)).backward()
    missing = [i for i, p in enumerate(params) if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"adapter tensors without a finite gradient: {missing}"
    opt.zero_grad(set_to_none=True)
    del logits

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)

    assert all(math.isfinite(l) for l in losses), losses
    median = statistics.median(times)
    return {
        "impl": impl,
        "seq": seq,
        "median_s": round(median, 4),
        "min_s": round(min(times), 4),
        "max_s": round(max(times), 4),
        "tokens_per_s": round(seq / median, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # KiB on Linux
        "import_rss_mb": round(IMPORT_RSS_MB, 1),
        "steps": steps,
        "threads": threads,
        "first_loss": round(losses[0], 4),  # same seed -> both variants should agree closely
        # 1-minute load average at the end: on a 2-core box anything well above `threads` means
        # another process competed for the cores and the times are inflated.
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("THREADS", "2")))
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS))
    ap.add_argument("--seqs", default="256,512", help="comma list of sequence lengths")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)

    if args.child:
        impl, seq = args.child[0], int(args.child[1])
        print(json.dumps(run_one(impl, seq, args.warmup, args.steps, args.seed, args.threads)), flush=True)
        return

    impls = [s for s in args.impls.split(",") if s]
    for impl in impls:
        if impl not in IMPLS:
            sys.exit(f"unknown impl {impl!r}; expected one of {IMPLS}")
    seqs = [int(s) for s in args.seqs.split(",") if s]

    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()} "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
          f"cpu cores {os.cpu_count()}, warmup {args.warmup}, timed steps {args.steps}", flush=True)

    results = []
    for seq in seqs:
        for impl in impls:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, str(seq),
                   "--threads", str(args.threads), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--seed", str(args.seed)]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            line = [l for l in out.splitlines() if l.startswith("{")][-1]
            print(line, flush=True)
            results.append(json.loads(line))

    print()
    print(f"{'impl':<12} {'seq':>5} {'median s':>9} {'min s':>8} {'max s':>8} {'tok/s':>8} {'peak RSS MB':>12}")
    for r in results:
        print(f"{r['impl']:<12} {r['seq']:>5} {r['median_s']:>9.3f} {r['min_s']:>8.3f} "
              f"{r['max_s']:>8.3f} {r['tokens_per_s']:>8.1f} {r['peak_rss_mb']:>12.1f}")


if __name__ == "__main__":
    main()
