"""KV-cache quantization on the default model: accuracy and capacity for quant_policy 0, 8 and 4.

For each policy, through the pipeline API (``lmport.pipeline`` + ``EngineConfig``):

- perplexity on a fixed English text that ships in benchmarks/data/ (Alice's
  Adventures in Wonderland, public domain; see benchmarks/data/README.md),
  cut into chunks of --chunk tokens so each chunk fills a long stretch of cache;
- greedy agreement with policy 0: --prompts prompts taken from the same text,
  --new-tokens tokens each; the share of tokens identical up to the first
  divergence, and the share identical position by position overall;
- bytes per token of KV cache (values + scale/zero, from the engine's KVLayout)
  and how many concurrent --seq-len-token sequences fit in a 1 GiB cache, for
  the run's cache dtype and for a 16-bit cache.

Prints a markdown table and writes JSON (default benchmarks/results/kv_quant_eval.json).

    .venv/bin/python benchmarks/kv_quant_eval.py            # full run (2 CPU cores: ~12 CPU-min a policy)
    .venv/bin/python benchmarks/kv_quant_eval.py --quick    # a smoke run of the script

    # One process per policy, then the table from their saved runs:
    for p in 0 8 4; do .venv/bin/python benchmarks/kv_quant_eval.py --only --policies $p & done; wait
    .venv/bin/python benchmarks/kv_quant_eval.py --reuse
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import re
import sys
import time
from pathlib import Path

import torch

import lmport
from lmport import EngineConfig, GenerationConfig
from lmport.bench.machine import write_result

ROOT = Path(__file__).resolve().parents[1]
TEXT_FILE = ROOT / "benchmarks" / "data" / "alice29.txt"
TEXT_SOURCE = ("Lewis Carroll, Alice's Adventures in Wonderland (1865), public domain; Project Gutenberg "
               "etext 'Millennium Fulcrum Edition 2.9' as the Canterbury Corpus file alice29.txt, "
               "taken from the PyPI sdist brotli-1.2.1 (tests/testdata/alice29.txt)")
GIB = 2 ** 30
POLICY_NAMES = {0: "off", 8: "INT8", 4: "INT4", "fp8": "fp8 e4m3"}


def load_text(path: Path = TEXT_FILE) -> str:
    """The book (or another text file of the Canterbury corpus) with its hard line wraps undone: one line per
    paragraph, single spaces."""
    raw = path.read_text(encoding="ascii")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", raw) if p.strip()]
    return "\n\n".join(paragraphs)


def perplexity(pipe, chunks: list[list[int]], group: int = 4) -> float:
    """Perplexity over all chunks together: exp(total NLL / predicted tokens)."""
    ppls = []
    for i in range(0, len(chunks), group):  # a few chunks at a time, to show progress
        ppls += pipe.get_ppl(chunks[i:i + group])
        print(f"  {len(ppls)}/{len(chunks)} chunks", flush=True)
    # Each chunk's perplexity is exp(mean NLL over its len - 1 predicted tokens).
    nll = sum(math.log(p) * (len(c) - 1) for p, c in zip(ppls, chunks))
    return math.exp(nll / sum(len(c) - 1 for c in chunks))


def agreement(base: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """(share of tokens identical up to each sequence's first divergence, share identical by position)."""
    total = prefix = same = 0
    for a, b in zip(base, other):
        total += len(a)
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix += n
        same += sum(x == y for x, y in zip(a, b))
    return prefix / total, same / total


def capacity(layout, seq_len: int) -> dict:
    per_seq = -(-seq_len // layout.block_size)
    return {"bytes_per_token": layout.bytes_per_token,
            "bytes_per_block": layout.bytes_per_block,
            "tokens_in_1gib": layout.blocks_in(GIB) * layout.block_size,
            f"seqs_of_{seq_len}_in_1gib": layout.blocks_in(GIB) // per_seq}


def run_policy(args, policy: int | str, chunks, prompts) -> dict:
    cfg = EngineConfig(device_type=args.device_type, dtype=args.dtype, quant_policy=policy,
                       cache_max_entry_count=args.cache_max_entry_count)
    started = time.perf_counter()
    pipe = lmport.pipeline(args.model, backend_config=cfg)
    try:
        eng = pipe.engine
        t0 = time.perf_counter()
        ppl = perplexity(pipe, chunks)
        t_ppl = time.perf_counter() - t0
        gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, ignore_eos=True)
        t0 = time.perf_counter()
        responses = pipe.generate(prompts, gen)
        t_gen = time.perf_counter() - t0
        errors = [r.error for r in responses if r.error]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}")
        layout16 = dataclasses.replace(eng.layout, dtype=torch.float16)
        return {
            "policy": policy,
            "device_type": eng.config.device_type,
            "dtype": eng.config.dtype,
            "block_size": eng.layout.block_size,
            "perplexity": ppl,
            "outputs": [list(r.token_ids) for r in responses],
            "capacity": capacity(eng.layout, args.seq_len),
            "capacity_16bit": capacity(layout16, args.seq_len),
            "seconds": {"load": t0 - started - t_ppl, "ppl": t_ppl, "generate": t_gen},
        }
    finally:
        pipe.close()


def _fraction_or_blocks(text: str) -> float | int:
    return float(text) if any(c in text for c in ".eE") else int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device-type", default="auto")
    ap.add_argument("--dtype", default="auto", help="auto: the backend's default (cpu: float32)")
    ap.add_argument("--cache-max-entry-count", type=_fraction_or_blocks, default=None,
                    help="a fraction of free memory in (0, 1] or an exact number of blocks (default: the backend's)")
    ap.add_argument("--policies", type=lambda p: int(p) if p.isdigit() else p, nargs="+", default=[0, 8, 4],
                    help="quant_policy values: 0, 8, 4, fp8")
    ap.add_argument("--chunk", type=int, default=2048, help="tokens per perplexity chunk")
    ap.add_argument("--min-text-tokens", type=int, default=20000)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048, help="sequence length for the 1 GiB capacity")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_quant_eval.json")
    ap.add_argument("--quick", action="store_true", help="2 chunks of 256, 4 prompts x 8 tokens")
    ap.add_argument("--only", action="store_true",
                    help="run --policies and save each one's run, without the table: for one process per policy")
    ap.add_argument("--reuse", action="store_true",
                    help="take a policy's saved run (from --only) when its settings match, instead of running it")
    args = ap.parse_args(argv)
    if args.quick:
        args.chunk, args.min_text_tokens, args.prompts, args.new_tokens = 256, 0, 4, 8
    if not args.only and 0 not in args.policies:
        ap.error("policy 0 is needed: agreement and the changes are measured against it")

    # Tokenize with the model's tokenizer (the same for every policy); no BOS, as SmolLM2 has none.
    from lmport.models.loader import load_tokenizer
    tokenizer = load_tokenizer(args.model)
    ids = tokenizer.encode(load_text(), add_special_tokens=False)
    n_chunks = len(ids) // args.chunk
    if args.quick:
        n_chunks = min(n_chunks, 2)
    chunks = [ids[i * args.chunk:(i + 1) * args.chunk] for i in range(n_chunks)]
    scored = sum(len(c) - 1 for c in chunks)
    if scored < args.min_text_tokens:
        sys.exit(f"only {scored} tokens to score; need {args.min_text_tokens}")
    # Prompts: windows spread evenly over the text.
    stride = (len(ids) - args.prompt_tokens) // args.prompts
    prompts = [ids[i * stride:i * stride + args.prompt_tokens] for i in range(args.prompts)]

    print(f"text: {TEXT_FILE.relative_to(ROOT)}: {len(ids)} tokens; {n_chunks} chunks x {args.chunk} "
          f"({scored} scored); {args.prompts} prompts x {args.prompt_tokens} -> {args.new_tokens} greedy tokens",
          flush=True)
    # What makes a saved run comparable: everything but the policy.
    settings = {k: str(v) for k, v in vars(args).items() if k not in ("policies", "out", "only", "reuse")}
    runs = []
    for policy in args.policies:
        saved = args.out.with_name(f"{args.out.stem}.policy{policy}.json")
        if args.reuse and saved.exists() and json.loads(saved.read_text())["settings"] == settings:
            runs.append(json.loads(saved.read_text())["run"])
            print(f"quant_policy={policy}: reusing {saved.name}", flush=True)
        else:
            print(f"quant_policy={policy} ...", flush=True)
            runs.append(run_policy(args, policy, chunks, prompts))
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps({"settings": settings, "run": runs[-1]}) + "\n")
        r = runs[-1]
        print(f"  ppl {r['perplexity']:.4f}  ({r['seconds']['ppl']:.0f} s ppl, "
              f"{r['seconds']['generate']:.0f} s generate)", flush=True)
    if args.only:
        return 0

    runs.sort(key=lambda r: r["policy"] != 0)  # policy 0 first: the baseline
    base = runs[0]
    rows = []
    for r in runs:
        prefix, overall = agreement(base["outputs"], r["outputs"])
        r["ppl_change_rel"] = r["perplexity"] / base["perplexity"] - 1
        r["agreement_to_first_divergence"] = prefix
        r["agreement_overall"] = overall
        r["capacity_ratio_16bit"] = (base["capacity_16bit"]["bytes_per_token"]
                                     / r["capacity_16bit"]["bytes_per_token"])
        rows.append(r)

    key = f"seqs_of_{args.seq_len}_in_1gib"
    dtype = base["dtype"]
    print()
    print(f"model {args.model} on {base['device_type']}, cache dtype {dtype}, block size {base['block_size']}")
    print()
    print(f"| quant_policy | perplexity | change | greedy agreement to 1st divergence | overall | "
          f"bytes/token ({dtype}) | {args.seq_len}-token seqs in 1 GiB ({dtype}) | "
          f"bytes/token (16-bit) | seqs in 1 GiB (16-bit) | x tokens vs 16-bit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, c16 = r["capacity"], r["capacity_16bit"]
        print(f"| {r['policy']} ({POLICY_NAMES.get(r['policy'], '?')}) | {r['perplexity']:.4f} | "
              f"{100 * r['ppl_change_rel']:+.2f}% | {100 * r['agreement_to_first_divergence']:.1f}% | "
              f"{100 * r['agreement_overall']:.1f}% | {c['bytes_per_token']:.0f} | {c[key]} | "
              f"{c16['bytes_per_token']:.0f} | {c16[key]} | {r['capacity_ratio_16bit']:.3f} |")

    result = {
        "benchmark": "kv_quant_eval",
        "model": args.model,
        "text": {"file": str(TEXT_FILE.relative_to(ROOT)), "source": TEXT_SOURCE, "tokens": len(ids),
                 "chunk_tokens": args.chunk, "chunks": n_chunks, "scored_tokens": scored},
        "generation": {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens, "greedy": True, "ignore_eos": True},
        "quick": args.quick,
        "host": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                 "lmport": lmport.__version__},
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
