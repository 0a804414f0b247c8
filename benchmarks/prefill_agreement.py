"""How far a prefill's precision moves greedy tokens: lmport under each LMPORT_CPU_PREFILL and llama.cpp against
transformers' float32 forward on the file's dequantized weights.

For each GGUF file: --prompts prompts of random token ids (lengths cycling 5, 12, 40, 100; a fixed seed), each
--new-tokens greedy tokens (end of sequence ignored) from

- transformers (``from_pretrained(dir, gguf_file=name)``, float32, its KV cache), the reference;
- lmport under each of --precisions (one process each: the variable is read once a process), the prompts
  together, so that their prefill is one step of more than 128 rows (float32 compute and cache);
- llama-server (--llama-server; 2 threads, one slot, its KV cache in --llama-cache-type: f16 by default, as
  llama.cpp's; f32 as lmport's here), each prompt sent as token ids, top-k 1.

Prints, per engine, the prompts whose tokens are all transformers' and the tokens before the first that is not,
and writes JSON. Files as users have them: e.g. the default model requantized by llama.cpp,

    llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf OUT.gguf Q6_K
    .venv/bin/python benchmarks/prefill_agreement.py --files OUT.gguf --llama-server BUILD/bin/llama-server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmport.bench import machine  # noqa: E402
from lmport.bench.client import LLAMA_SERVING, served_url, wait_ready  # noqa: E402
from serve_throughput import start_llama_server, stop  # noqa: E402

LENGTHS, SEED = (5, 12, 40, 100), 17

LMPORT_WORKER = """
import json, sys
import lmport
from lmport import EngineConfig, GenerationConfig
path, ids, new = json.loads(sys.argv[1])
cfg = EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=256)
with lmport.pipeline(path, backend_config=cfg) as pipe:
    out = pipe.generate(ids, GenerationConfig(max_new_tokens=new, ignore_eos=True))
print(json.dumps([r.token_ids for r in out]))
"""


def prompts(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(3, vocab, (LENGTHS[i % len(LENGTHS)],), generator=g).tolist() for i in range(count)]


def transformers_greedy(path: Path, ids: list[list[int]], new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.greedy import hf_greedy   # the tests' argmax loop over transformers' forward
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return hf_greedy(model, ids, new)


def lmport_greedy(path: Path, ids: list[list[int]], new: int, precision: str) -> list[list[int]]:
    env = dict(os.environ, LMPORT_CPU_PREFILL=precision)
    proc = subprocess.run([sys.executable, "-c", LMPORT_WORKER, json.dumps([str(path), ids, new])], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llama_greedy(binary: str, path: Path, ids: list[list[int]], new: int, cache_type: str) -> list[list[int]]:
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    proc = start_llama_server(binary, str(path), threads=2, slots=1, log=log,
                              extra=["--cache-type-k", cache_type, "--cache-type-v", cache_type])
    try:
        deadline = time.monotonic() + 300
        url = served_url(proc, log, deadline, LLAMA_SERVING)
        asyncio.run(wait_ready(url, proc, deadline))
        with httpx.Client(timeout=600) as http:
            body = {"n_predict": new, "top_k": 1, "samplers": ["top_k"], "ignore_eos": True, "cache_prompt": False,
                    "return_tokens": True}
            return [http.post(url + "/completion", json={**body, "prompt": p}).raise_for_status().json()["tokens"]
                    for p in ids]
    finally:
        stop(proc)


def agreement(got: list[list[int]], want: list[list[int]]) -> dict:
    before = [next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
    return {"identical_prompts": sum(g == w for g, w in zip(got, want)), "prompts": len(want),
            "tokens_before_divergence": sum(before), "tokens": sum(len(w) for w in want)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", required=True, help="comma-separated GGUF files")
    ap.add_argument("--llama-server", help="llama-server binary (left out: lmport only)")
    ap.add_argument("--llama-cache-type", default="f16", help="llama-server's KV cache type (f16, f32)")
    ap.add_argument("--precisions", default="exact,auto,bf16",
                    help="LMPORT_CPU_PREFILL values, comma-separated (empty: llama.cpp only)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/prefill_agreement.json")
    args = ap.parse_args()
    from gguf import GGUFReader
    results = {"machine": machine.describe(), "files": {}}
    for name in args.files.split(","):
        path = Path(name).expanduser()
        vocab = len(GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
        ids = prompts(args.prompts, vocab)
        want = transformers_greedy(path, ids, args.new_tokens)
        engines = {f"lmport {p}": lmport_greedy(path, ids, args.new_tokens, p)
                   for p in filter(None, args.precisions.split(","))}
        if args.llama_server:
            engines[f"llama.cpp, {args.llama_cache_type} cache"] = llama_greedy(
                args.llama_server, path, ids, args.new_tokens, args.llama_cache_type)
        results["files"][path.name] = {engine: agreement(got, want) for engine, got in engines.items()}
        for engine, a in results["files"][path.name].items():
            print(f"{path.name} | {engine} | identical prompts {a['identical_prompts']}/{a['prompts']} | tokens "
                  f"before divergence {a['tokens_before_divergence']}/{a['tokens']}", flush=True)
        machine.write_result(args.out, results)   # each file's as it is done


if __name__ == "__main__":
    main()
