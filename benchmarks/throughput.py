"""Throughput of lmport vs transformers on one fixed mixed workload, side by side in one run.

Workload: N requests (default 64), prompts of 8-256 tokens cut from a fixed
text, output lengths from {16, 32, 64, 128} (EOS ignored so every engine
produces exactly the requested tokens), fixed seed, all arriving at t=0.

- lmport: every request at once through the engine (continuous batching, per-request lengths),
  with the GGUF's weights kept int4/int8, and again with them dequantized to float32 at load
  (`weight_format="dequantize"`, the path before quantized weights; skip with --skip dequantized).
- transformers generate: padded batches of --hf-batch requests of one output length.
- transformers generate_batch: its continuous batching, one call per output length
  (it takes a single max_new_tokens per call).

Same model, dtype (float32) and machine. Prints a markdown table, writes JSON.
Run: python benchmarks/throughput.py [--requests 64] [--out benchmarks/results/throughput.json]
(lmport alone, with its rounds' medians: `lmport bench throughput`.)
"""
from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from lmport.bench.datasets import OUTPUT_LENGTHS, workload
from lmport.bench.machine import write_result
from lmport.bench.throughput import summarize


def run_lmport(model: str, requests, args, weight_format: str = "auto") -> dict:
    import lmport
    from lmport import EngineConfig, GenerationConfig
    pipe = lmport.pipeline(model, backend_config=EngineConfig(
        device_type="cpu", dtype="float32", max_batch_size=args.max_batch_size, cache_max_entry_count=args.blocks,
        weight_format=weight_format))
    engine = pipe.engine
    engine.add_request([1, 2, 3], GenerationConfig(max_new_tokens=2, ignore_eos=True))  # warm-up
    while engine.has_unfinished():
        engine.step()
    start = time.perf_counter()
    done = {}
    for i, (ids, n) in enumerate(requests):
        engine.add_request(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True), request_id=str(i))
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert len(out.token_ids) == requests[int(out.request_id)][1], out
                done[out.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    result = summarize("lmport", wall, list(done.values()), requests)
    result["preemptions"] = engine.usage()["preemptions"]
    pipe.close()
    return result


def by_length(requests):
    groups = {}
    for i, (_, n) in enumerate(requests):
        groups.setdefault(n, []).append(i)
    return groups


def run_hf_generate(hf, tokenizer, requests, batch: int) -> dict:
    start = time.perf_counter()
    latencies = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for n, idx in by_length(requests).items():
        for b in range(0, len(idx), batch):
            chunk = [requests[i][0] for i in idx[b:b + batch]]
            width = max(map(len, chunk))
            # Left padding, as generation needs the last position to be a real token.
            ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
            mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=pad)
            assert out.shape[1] - width == n
            latencies += [time.perf_counter() - start] * len(chunk)
    return summarize("transformers generate", time.perf_counter() - start, latencies, requests)


def run_hf_generate_batch(hf, requests) -> dict:
    from transformers import GenerationConfig as HFGenerationConfig
    start = time.perf_counter()
    latencies = []
    for n, idx in by_length(requests).items():
        cfg = HFGenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        # No inference_mode here: generate_batch updates its cache tensors in place from its own thread.
        outs = hf.generate_batch([requests[i][0] for i in idx], generation_config=cfg, progress_bar=False)
        assert all(len(o.generated_tokens) == n for o in outs.values())
        latencies += [time.perf_counter() - start] * len(idx)
    return summarize("transformers generate_batch", time.perf_counter() - start, latencies, requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2400, help="KV blocks of 16 tokens for lmport")
    parser.add_argument("--skip", nargs="*", default=[], help="generate, generate_batch, dequantized")
    parser.add_argument("--out", default="benchmarks/results/throughput.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from lmport.models.loader import load_tokenizer, resolve_model_path
    tokenizer = load_tokenizer(args.model)
    requests = workload(tokenizer, args.requests, args.seed)
    results = [run_lmport(args.model, requests, args)]
    if "dequantized" not in args.skip:   # the same GGUF dequantized to float32 at load (the path before int4/int8)
        results.append(run_lmport(args.model, requests, args, "dequantize") | {"engine": "lmport (float32 weights)"})
    path = resolve_model_path(args.model)   # transformers dequantizes a GGUF to float32
    hf = (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) if path.is_dir() else
          AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)).eval()
    if "generate" not in args.skip:
        results.append(run_hf_generate(hf, tokenizer, requests, args.hf_batch))
    if "generate_batch" not in args.skip:
        try:
            results.append(run_hf_generate_batch(hf, requests))
        except Exception as exc:  # report, don't hide, a peer that cannot run here
            results.append({"engine": "transformers generate_batch", "error": f"{type(exc).__name__}: {exc}"})

    cols = ["engine", "requests_per_s", "output_tokens_per_s", "mean_latency_s", "p99_latency_s", "wall_s"]
    print(f"\n{args.requests} requests, prompts 8-256 tokens, outputs {OUTPUT_LENGTHS}, "
          f"torch threads {torch.get_num_threads()}\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r.get(c, r.get("error", "-"))) for c in cols) + " |")
    base = next((r for r in results if r["engine"] == "transformers generate" and "wall_s" in r), None)
    if base:
        print(f"\nlmport / transformers generate, output tokens/s: "
              f"{results[0]['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x")
    write_result(args.out, {"machine": platform.platform(), "cpus": os.cpu_count(), "model": args.model,
                            "results": results})


if __name__ == "__main__":
    main()
