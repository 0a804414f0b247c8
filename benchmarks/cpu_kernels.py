"""The cpu backend's compiled linear and paged attention against what they replace, at a model's shapes.

Shapes come from the model's config (default SmolLM2-135M: 30 layers, hidden
576, MLP 1536, 9 query / 3 KV heads of 64, vocabulary 49152); the weights and
caches are random, as only their shapes matter for time. Every timing is one
pass over all layers, each with its own weights or cache, so the data comes
from memory as in a real step; the best of five passes is kept.

- linear: the decode step's projections and LM head (q, k, v, o, gate, up,
  down per layer) for 1-128 tokens: the backend's ``linear`` against
  ``F.linear`` (the BLAS torch ships, MKL on x86).
- paged attention: decode batches and a prefill step over 16-token blocks in
  shuffled order: the backend's kernel against the reference op.

Prints a markdown table, writes JSON (default benchmarks/results/cpu_kernels.json).

    .venv/bin/python benchmarks/cpu_kernels.py
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lmport import ops
from lmport.backends.cpu import CpuBackend, kernels
from lmport.kv.layout import KVLayout

BLOCK_SIZE = 16
TOKENS = (1, 16, 32, 64, 128)
# name: (query lengths, context lengths) for one step's sequences.
ATTENTION_BATCHES = {
    "decode 64 seqs, context 140-300": lambda g: ([1] * 64, torch.randint(140, 300, (64,), generator=g).tolist()),
    "decode 16 seqs, context 270-390": lambda g: ([1] * 16, torch.randint(270, 390, (16,), generator=g).tolist()),
    "prefill 28 seqs of 146 tokens": lambda g: ([146] * 28, [146] * 28),
}


def best_pass(fn, passes: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def linear_rows(cfg, backend: CpuBackend, gen) -> list[dict]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    q_out = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    kv_out = q_out // cfg.num_attention_heads * cfg.num_key_value_heads
    per_layer = [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out), (i, h), (i, h), (h, i)]
    weights = [torch.randn(*s, generator=gen) for _ in range(cfg.num_hidden_layers) for s in per_layer]
    weights.append(torch.randn(cfg.vocab_size, h, generator=gen))
    flops = 2 * sum(w.numel() for w in weights)
    rows = []
    for tokens in TOKENS:
        xs = {k: torch.randn(tokens, k, generator=gen) for k in {w.shape[1] for w in weights}}
        err = max((backend.linear(xs[w.shape[1]], w) - F.linear(xs[w.shape[1]], w)).abs().max().item()
                  for w in weights[:len(per_layer)])
        ours = best_pass(lambda: [backend.linear(xs[w.shape[1]], w) for w in weights])
        peer = best_pass(lambda: [F.linear(xs[w.shape[1]], w) for w in weights])
        rows.append({"kernel": "linear", "case": f"{tokens} tokens, all layers + LM head", "ms": ours * 1e3,
                     "peer": "F.linear", "peer_ms": peer * 1e3, "speedup": peer / ours,
                     "gflops": flops * tokens / ours / 1e9, "peer_gflops": flops * tokens / peer / 1e9,
                     "max_abs_diff": err})
    return rows


def attention_rows(cfg, backend: CpuBackend, gen) -> list[dict]:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layout = KVLayout(1, cfg.num_key_value_heads, head_dim, BLOCK_SIZE, torch.float32, 0)
    scale = head_dim ** -0.5
    rows = []
    for name, batch in ATTENTION_BATCHES.items():
        q_lens, kv_lens = batch(gen)
        counts = [-(-n // BLOCK_SIZE) for n in kv_lens]
        ids = (torch.randperm(sum(counts), generator=gen) + 1).tolist()  # shuffled, as after churn
        tables = [ids[sum(counts[:s]):sum(counts[:s + 1])] for s in range(len(counts))]
        meta = ops.build_attention_metadata(q_lens, kv_lens, tables, BLOCK_SIZE)
        caches = []
        for _ in range(cfg.num_hidden_layers):
            cache = layout.allocate(sum(counts) + 1, "cpu")[0]
            cache.k.normal_(generator=gen)
            cache.v.normal_(generator=gen)
            caches.append(cache)
        q = torch.randn(sum(q_lens), cfg.num_attention_heads, head_dim, generator=gen)
        err = (backend.paged_attention(q, caches[0], meta, scale)
               - ops.paged_attention(q, caches[0], meta, scale)).abs().max().item()
        ours = best_pass(lambda: [backend.paged_attention(q, c, meta, scale) for c in caches])
        peer = best_pass(lambda: [ops.paged_attention(q, c, meta, scale) for c in caches], passes=2)
        rows.append({"kernel": "paged_attention", "case": name, "ms": ours * 1e3, "peer": "reference op",
                     "peer_ms": peer * 1e3, "speedup": peer / ours, "max_abs_diff": err})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", default="benchmarks/results/cpu_kernels.json")
    args = parser.parse_args()
    if kernels.load() is None:
        raise SystemExit("the cpu kernels did not build (see the warning above); nothing to measure")

    from transformers import AutoConfig

    from lmport.models.loader import hf_directory
    cfg = AutoConfig.from_pretrained(hf_directory(args.model))
    backend, gen = CpuBackend(), torch.Generator().manual_seed(0)
    rows = linear_rows(cfg, backend, gen) + attention_rows(cfg, backend, gen)

    print(f"\n{args.model}: {cfg.num_hidden_layers} layers; one pass over all of them; "
          f"torch threads {torch.get_num_threads()}\n")
    print("| kernel | case | lmport ms | peer | peer ms | speedup | GFLOP/s lmport / peer | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['gflops']:.0f} / {r['peer_gflops']:.0f}" if "gflops" in r else "-"
        print(f"| {r['kernel']} | {r['case']} | {r['ms']:.1f} | {r['peer']} | {r['peer_ms']:.1f} | "
              f"{r['speedup']:.2f}x | {rate} | {r['max_abs_diff']:.1e} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "cpus": os.cpu_count(), "model": args.model,
                               "threads": torch.get_num_threads(), "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
