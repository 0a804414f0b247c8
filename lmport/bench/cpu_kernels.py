"""The cpu backend's compiled linear and paged attention against what they replace, at a model's shapes.

Shapes come from the model's config (default SmolLM2-135M: 30 layers, hidden
576, MLP 1536, 9 query / 3 KV heads of 64, vocabulary 49152); the weights and
caches are random, as only their shapes matter for time. Every timing is one
pass over all layers, each with its own weights or cache, so the data comes
from memory as in a real step; the best of five passes is kept.

- linear: the decode step's projections and LM head (q, k, v, o, gate, up,
  down per layer) for 1-128 tokens: the backend's ``linear`` against
  ``F.linear`` (the BLAS torch ships, MKL on x86).
- ggml_linear: the same projections (q/k/v and gate/up merged, as the model runs them) over
  GGUF block weights of each type the backend runs, for 1, 16 and 64 tokens, in GB/s of blocks read,
  against the int4 kernel (quant_linear, group 32) on the same shapes; for the types the backend holds
  a model's linears otherwise (rows interleaved in groups of 16), again as held. The inputs are rounded up to
  the type's block (SmolLM2's 576 to 768 for the 256-input K-quants), for both.
- gemv: single-stream decode's linears (one row of x) in each weight format the benchmark GGUF files
  hold (int4 for Q4_1, int8 for Q8_0 and every file's LM head, q5_0 / q4_k / q6_k for Q4_K_M), each
  also "held" (the layers): as the backend holds a model's linears, rows interleaved in groups of 16
  where its build reads them so, at the model's shapes over all layers, and the LM head alone: GB/s
  of weight read, each interleaved with a plain streaming read of as many bytes (torch.sum over
  float32) in the same rounds, so the ratio
  kernel / stream survives a loaded machine better than either figure. Run it with --threads 1 to
  see each kernel's inner loop; with more threads, how it scales.
- prefill: a prefill step's GEMMs over quantized weights once expanded to float32 (all layers' q/k/v,
  o, gate/up, down for 64, 256 and 512 tokens): the backend's ``prefill_gemm`` (oneDNN where torch
  has it) against ``F.linear`` (MKL), interleaved passes.
- held: each format the backend holds a model's linears in another layout (rows interleaved in groups of
  16: int4, int8, Q5_0, Q4_K, Q6_K, on the AVX-512 and the AVX2 path alike) against the same weight with its rows
  in order, at the model's gate/up and down shapes (and int8 at the LM head's, a Q8_0 file's tied table),
  for 1, 8, 16, 64 and 128 rows of x (a decode step's rows) and 256 and 512 (a prefill's: held, the integer
  kernels; in order, the weight expanded to float32 for the GEMM), 16 weights a pass (the LM head 2), the
  layouts alternating.
- paged attention: decode batches and a prefill step over 16-token blocks in
  shuffled order: the backend's kernel against the reference op.

Prints a markdown table; ``--out DIR`` writes the JSON there.

    lmport bench kernels cpu [--only held] [--threads 1] [--out DIR]
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from lmport import ops
from lmport.backends.cpu import CpuBackend, kernels
from lmport.kv.layout import KVLayout
from lmport.weights import tensors
from lmport.weights.format import from_codes
from lmport.weights.ggml import BLOCK_TYPES, GGMLWeight
from lmport.bench.machine import describe

BLOCK_SIZE = 16
TOKENS = (1, 16, 32, 64, 128)
GGML_TOKENS = (1, 16, 64)
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


def best_passes(fns, passes: int = 7) -> list[float]:
    """best_pass of each of ``fns``, their passes interleaved: on a shared machine both see the same load."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(passes):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
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


def prefill_rows(cfg, backend: CpuBackend, gen) -> list[dict]:
    from lmport.backends.cpu import prefill_gemm
    h, i = cfg.hidden_size, cfg.intermediate_size
    q_out = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    kv_out = q_out // cfg.num_attention_heads * cfg.num_key_value_heads
    per_layer = [(q_out + 2 * kv_out, h), (h, q_out), (2 * i, h), (h, i)]
    weights = [torch.randn(*s, generator=gen) for _ in range(cfg.num_hidden_layers) for s in per_layer]
    flops = 2 * sum(w.numel() for w in weights)
    rows = []
    for tokens in (64, 256, 512):
        xs = {k: torch.randn(tokens, k, generator=gen) for k in {w.shape[1] for w in weights}}
        err = max((prefill_gemm(xs[w.shape[1]], w, None) - F.linear(xs[w.shape[1]], w)).abs().max().item()
                  for w in weights[:len(per_layer)])
        ours, peer = best_passes([lambda: [prefill_gemm(xs[w.shape[1]], w, None) for w in weights],
                                  lambda: [F.linear(xs[w.shape[1]], w) for w in weights]])
        rows.append({"kernel": "prefill GEMM", "case": f"{tokens} tokens, all layers", "ms": ours * 1e3,
                     "peer": "F.linear", "peer_ms": peer * 1e3, "speedup": peer / ours,
                     "gflops": flops * tokens / ours / 1e9, "peer_gflops": flops * tokens / peer / 1e9,
                     "max_abs_diff": err})
    return rows


def ggml_rows(cfg, backend: CpuBackend, gen) -> list[dict]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    q_out = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    kv_out = q_out // cfg.num_attention_heads * cfg.num_key_value_heads
    per_layer = [(q_out + 2 * kv_out, h), (h, q_out), (2 * i, h), (h, i)]
    rows = []
    for name in sorted(backend.capabilities.ggml_types, key=list(BLOCK_TYPES).index):
        t = BLOCK_TYPES[name]
        shapes = [(n, -(-k // t.elements) * t.elements) for n, k in per_layer] * cfg.num_hidden_layers
        # Random bytes are valid blocks once the float16 fields are finite: every byte below 0x78 keeps them so.
        files = [GGMLWeight(torch.randint(0, 0x78, (n, k // t.elements * t.nbytes), generator=gen,
                                          dtype=torch.uint8), name, k) for n, k in shapes]
        held = [backend.hold_quantized(GGMLWeight(w.blocks.clone(), name, k), torch.float32)   # may relay in place
                for w, (_, k) in zip(files, shapes, strict=True)]
        int4 = [from_codes(torch.randint(0, 16, (n, k), generator=gen), torch.rand(n, k // 32, generator=gen) * 0.01,
                           torch.zeros(n, k // 32), 4, 32) for n, k in shapes]
        ggml_bytes = sum(w.blocks.numel() for w in files)
        int4_bytes = sum(q.qweight.numel() + 2 * q.scales.numel() + 2 * q.mins.numel() for q in int4)
        # as the file lays the rows out, and (where the backend holds a model's linears otherwise) as held
        for layout, weights in [("", files)] + ([(" held", held)] if held[0] is not files[0] else []):
            for tokens in GGML_TOKENS:
                xs = {k: torch.randn(tokens, k, generator=gen) for k in {k for _, k in shapes}}
                err = max(((backend.ggml_linear(xs[w.in_features], w) - ops.ggml_linear(xs[w.in_features], w))
                           .abs().max() / ops.ggml_linear(xs[w.in_features], w).abs().max()).item()
                          for w in weights[:4])
                ours, peer = best_passes([lambda: [backend.ggml_linear(xs[w.in_features], w) for w in weights],
                                          lambda: [backend.quant_linear(xs[q.in_features], q) for q in int4]])
                rows.append({"kernel": "ggml_linear", "case": f"{name}{layout}, {tokens} tokens, all layers",
                             "ms": ours * 1e3, "peer": "int4 g32 quant_linear", "peer_ms": peer * 1e3,
                             "speedup": peer / ours, "gbs": ggml_bytes / ours / 1e9,
                             "peer_gbs": int4_bytes / peer / 1e9, "bytes": ggml_bytes, "peer_bytes": int4_bytes,
                             "max_abs_diff": err})
    return rows


def gemv_rows(cfg, backend: CpuBackend, gen) -> list[dict]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    q_out = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    kv_out = q_out // cfg.num_attention_heads * cfg.num_key_value_heads
    layers = [(q_out + 2 * kv_out, h), (h, q_out), (2 * i, h), (h, i)] * cfg.num_hidden_layers
    cases = {"layers": layers, "LM head": [(cfg.vocab_size, h)]}
    formats = ["int4", "int4 held", "int8", "int8 held", "q5_0", "q5_0 held", "q4_k", "q4_k held", "q6_k", "q6_k held"]
    rows = []
    for case, shapes in cases.items():
        for fmt in formats if case == "layers" else ["int8", "int4"]:
            block_type = fmt.removesuffix(" held")
            if block_type in BLOCK_TYPES:
                t = BLOCK_TYPES[block_type]
                weights = [GGMLWeight(torch.randint(0, 0x78, (n, -(-k // t.elements) * t.nbytes), generator=gen,
                                                    dtype=torch.uint8), block_type, -(-k // t.elements) * t.elements)
                           for n, k in shapes]
                if fmt.endswith(" held"):   # in the layout the backend holds a model's linears in
                    weights = [backend.hold_quantized(w, torch.float32) for w in weights]
                calls = [(w, w.in_features, backend.ggml_linear) for w in weights]
                nbytes = sum(w.blocks.numel() for w in weights)
            else:
                bits = int(block_type[3:])
                low, high = (0, 16) if bits == 4 else (-128, 128)
                weights = [from_codes(torch.randint(low, high, (n, k), generator=gen),
                                      torch.rand(n, k // 32, generator=gen) * 0.01, torch.zeros(n, k // 32), bits, 32)
                           for n, k in shapes]
                if fmt.endswith(" held"):
                    weights = [backend.hold_quantized(q, torch.float32) for q in weights]
                calls = [(q, q.in_features, backend.quant_linear) for q in weights]
                nbytes = sum(q.nbytes() for q in weights)
            xs = {k: torch.randn(1, k, generator=gen) for _, k, _ in calls}
            stream = torch.ones(nbytes // 4)
            ours, peer = best_passes([lambda: [fn(xs[k], w) for w, k, fn in calls], lambda: stream.sum()], passes=9)
            rows.append({"kernel": "gemv", "case": f"{fmt}, 1 token, {case}", "ms": ours * 1e3,
                         "peer": "streaming read", "peer_ms": peer * 1e3, "speedup": peer / ours,
                         "gbs": nbytes / ours / 1e9, "peer_gbs": nbytes / peer / 1e9, "bytes": nbytes,
                         "max_abs_diff": float("nan")})
    return rows


def held_rows(cfg, backend: CpuBackend, gen) -> list[dict]:
    """Each held format's kernel against the same weight with its rows in order, at one gate/up and one down
    shape of the model (16 weights a pass) and, int8 as a Q8_0 file's tied table, the LM head (2 a pass), 1 to
    512 rows of x, the two layouts alternating pass by pass."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    rows = []
    for fmt in ("q5_0", "q4_k", "q6_k", "int4", "int8"):
        lm_head = ((cfg.vocab_size, h, 2),) if fmt == "int8" else ()
        for n, k, count in ((2 * i, h, 16), (h, i, 16), *lm_head):
            if fmt in BLOCK_TYPES:
                t = BLOCK_TYPES[fmt]
                k = -(-k // t.elements) * t.elements
                weights = [GGMLWeight(torch.randint(0, 0x78, (n, k // t.elements * t.nbytes), generator=gen,
                                                    dtype=torch.uint8), fmt, k) for _ in range(count)]
            else:
                bits = int(fmt[3:])
                low, high = (0, 16) if bits == 4 else (-128, 128)
                weights = [from_codes(torch.randint(low, high, (n, k), generator=gen),
                                      torch.rand(n, k // 32, generator=gen) * 0.01,
                                      torch.rand(n, k // 32, generator=gen) * 0.01, bits, 32) for _ in range(count)]
            # hold_quantized may relay in place: it gets copies, the rows in order stay for the peer
            copies = [dataclasses.replace(w, **{name: t.clone() for name, t in tensors(w).items()}) for w in weights]
            held = [backend.hold_quantized(w, torch.float32) for w in copies]
            if held[0].row_group == 1:
                continue
            run = backend.ggml_linear if fmt in BLOCK_TYPES else backend.quant_linear
            for tokens in (1, 8, 16, 64, 128, 256, 512):
                x = torch.randn(tokens, k, generator=gen)
                ours, peer = best_passes([lambda: [run(x, w) for w in held], lambda: [run(x, w) for w in weights]])
                rows.append({"kernel": "held", "case": f"{fmt} {n} x {k}, {tokens} tokens", "ms": ours * 1e3,
                             "peer": "rows in order", "peer_ms": peer * 1e3, "speedup": peer / ours,
                             "max_abs_diff": (run(x, held[0]) - run(x, weights[0])).abs().max().item()})
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


def run(args) -> tuple[dict, int]:
    """The rows measured, printed as a table as they come; the result for its JSON, and the exit status."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.load() is None:
        raise SystemExit("the cpu kernels did not build (see the warning above); nothing to measure")

    from lmport.models.loader import read_model_config
    cfg = read_model_config(args.model)
    backend, gen = CpuBackend(), torch.Generator().manual_seed(0)
    groups = {"linear": linear_rows, "prefill": prefill_rows, "ggml": ggml_rows, "gemv": gemv_rows,
              "held": held_rows, "attention": attention_rows}
    rows = [r for name, fn in groups.items() if args.only in (None, name) for r in fn(cfg, backend, gen)]

    print(f"\n{args.model}: {cfg.num_hidden_layers} layers; one pass over all of them; "
          f"torch threads {torch.get_num_threads()}\n")
    print("| kernel | case | lmport ms | peer | peer ms | speedup | GFLOP/s or GB/s lmport / peer | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = (f"{r['gflops']:.0f} / {r['peer_gflops']:.0f} GFLOP/s" if "gflops" in r
                else f"{r['gbs']:.1f} / {r['peer_gbs']:.1f} GB/s" if "gbs" in r else "-")
        print(f"| {r['kernel']} | {r['case']} | {r['ms']:.3g} | {r['peer']} | {r['peer_ms']:.3g} | "
              f"{r['speedup']:.2f}x | {rate} | {r['max_abs_diff']:.1e} |")
    return {"benchmark": "kernels", "backend": "cpu", "machine": describe(torch.get_num_threads()),
            "model": args.model, "threads": torch.get_num_threads(), "results": rows}, 0
