"""Quantized KV caches against the unquantized one on the default model: the first generated token of chat
prompts, and perplexity on a stretch of fixed text.

For each quant_policy (0, 8, 4, "fp8"), through the pipeline API:

- the first greedy token of each of 20 short chat requests (the model's chat template), and how many of them
  equal policy 0's: a prefill's attention is all a first token has seen, so this is where a cache that
  attends to the step's own tokens through their quantized copies loses most;
- perplexity over --chunks chunks of --chunk tokens of benchmarks/data/alice29.txt (kv_quant_eval.py's text),
  each prefilled in steps of --max-prefill-tokens: a step attends to its own tokens as computed and to the
  chunk's earlier steps through the cache, so a chunk prefilled in one step does not read the cache at all,
  and small steps measure it as decoding does.

``--through-cache`` measures what the engine did before the step's own keys and values were attended to in
full precision: every step reads them back from the cache, as the older engine did.

    .venv/bin/python benchmarks/kv_first_token.py --device-type cpu
    .venv/bin/python benchmarks/kv_first_token.py --device-type cpu --max-prefill-tokens 64
    .venv/bin/python benchmarks/kv_first_token.py --device-type cpu --through-cache
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import lmport
from lmport import EngineConfig, GenerationConfig
from kv_quant_eval import load_text

ROOT = Path(__file__).resolve().parents[1]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Give me three tips for sleeping better.",
    "What is 17 times 23?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Name a mammal that can fly.",
    "Why is the sky blue?",
    "Suggest a name for a pet goldfish.",
    "What is the boiling point of water at sea level?",
    "Summarize the plot of Romeo and Juliet.",
    "How many legs does a spider have?",
    "What is a prime number?",
    "Recommend a book for a long flight.",
    "What causes the seasons on Earth?",
    "Write a short greeting for a birthday card.",
    "What is the difference between weather and climate?",
]


def read_step_tokens_through_cache() -> None:
    """Drop the step's own K/V from every attention call, so each step reads them back from the cache; the cpu
    backend's layer loop, which hands them to its kernels itself, is left out so its steps go through those calls."""
    from lmport.platform.backend import Backend
    from lmport.backends.cpu import CpuBackend

    for cls in (Backend, CpuBackend):
        original = cls.paged_attention

        def without(self, q, cache, meta, softmax_scale, new_kv=None, _original=original):
            return _original(self, q, cache, meta, softmax_scale)
        cls.paged_attention = without
    CpuBackend.decoder_runner = lambda self, layers: None


def run(args, policy, prompts, chunks) -> dict:
    cfg = EngineConfig(device_type=args.device_type, dtype=args.dtype, quant_policy=policy,
                       cache_max_entry_count=args.cache_max_entry_count, max_prefill_token_num=args.max_prefill_tokens)
    pipe = lmport.pipeline(args.model, backend_config=cfg)
    try:
        out = pipe.generate(prompts, GenerationConfig(max_new_tokens=1, do_sample=False, ignore_eos=True))
        first = [r.token_ids[0] for r in out]
        ppls = pipe.get_ppl(chunks)
    finally:
        pipe.close()
    nll = sum(math.log(p) * (len(c) - 1) for p, c in zip(ppls, chunks))
    return {"policy": policy, "first_tokens": first, "perplexity": math.exp(nll / sum(len(c) - 1 for c in chunks))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device-type", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--cache-max-entry-count", type=int, default=512, help="cache blocks")
    ap.add_argument("--policies", nargs="+", default=["0", "8", "4", "fp8"])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--max-prefill-tokens", type=int, default=4096, help="prompt tokens a step (the engine's default)")
    ap.add_argument("--through-cache", action="store_true",
                    help="every step reads its own K/V back from the cache (the engine before this change)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_first_token.json")
    args = ap.parse_args(argv)
    if args.through_cache:
        read_step_tokens_through_cache()
    policies = [int(p) if p.isdigit() else p for p in args.policies]

    from lmport.models.loader import load_tokenizer
    tok = load_tokenizer(args.model)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for text in CHAT_PROMPTS]
    ids = tok.encode(load_text(), add_special_tokens=False)
    chunks = [ids[i * args.chunk:(i + 1) * args.chunk] for i in range(args.chunks)]

    runs = [run(args, p, prompts, chunks) for p in policies]
    base = next(r for r in runs if r["policy"] == 0)
    print(f"model {args.model}, {len(prompts)} chat prompts, perplexity over {args.chunks} x {args.chunk} tokens "
          f"prefilled {args.max_prefill_tokens} tokens a step"
          + (", the step's own K/V read through the cache" if args.through_cache else ""))
    print("| quant_policy | first tokens as policy 0 | perplexity | change |")
    print("|---|---|---|---|")
    for r in runs:
        r["first_token_agreement"] = sum(a == b for a, b in zip(base["first_tokens"], r["first_tokens"]))
        r["ppl_change_rel"] = r["perplexity"] / base["perplexity"] - 1
        print(f"| {r['policy']} | {r['first_token_agreement']}/{len(prompts)} | {r['perplexity']:.4f} | "
              f"{100 * r['ppl_change_rel']:+.2f}% |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out = args.out.with_name(f"{args.out.stem}_prefill{args.max_prefill_tokens}"
                             + ("_through_cache" if args.through_cache else "") + ".json")
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
