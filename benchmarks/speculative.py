"""Speculative decoding: single-stream decode tok/s and acceptance, speculation off vs n-gram vs a draft model.

Two workloads of a few chat prompts each, on the default model (its Q4_1 GGUF, weights kept quantized,
cpu backend, greedy, each answer ending at its end-of-turn token or --tokens, as a user gets it; greedy
speculation emits the same tokens as plain decoding, so every column decodes the same answers):

- free: open-ended generation (stories, explanations), where the output rarely repeats its prompt;
- repeat: the answer repeats the prompt (rewrite a given function with type hints, copy a list, fix
  a typo in a paragraph): what prompt lookup is for.

Columns: lmport without speculation, lmport with n-gram speculation (EngineConfig.speculative =
{"method": "ngram"}, defaults otherwise), and the draft-model method, which needs a target larger than its
draft: the default model's float32 form (its GGUF dequantized by transformers into the cache once) without
speculation ("f32 off") and drafted by the Q4_1 file ("f32 + Q4_1 draft", {"method": "draft", "model":
"smollm2"}, defaults otherwise). Decode tok/s is (generated tokens - 1) / (time from the first generated
token to the last), one request at a time. The four engines alternate request by request for --rounds
rounds (at least 5), so all see the same machine load; each figure is the median over rounds with its
min-max, and every round is kept in the JSON.

A second table: the time of one sequence's forward by the tokens it computes (1, a plain decode step, up
to num_speculative_tokens + 1, a verification), at a context of 256 tokens, medians of the rounds: a
proposal accepted to a mean length L gains at most L over that ratio.

--batch also runs the `make bench` workload (benchmarks/throughput.py: 64 requests at once) with
speculation off and on, alternating, and reports output tok/s: speculation is to back off as the
batch fills (disable_by_batch_size), so on should be no slower than off.

llama.cpp peer: its `llama-lookup` (n-gram speculation from the context, drafting up to the same
num_speculative_tokens as lmport's n-gram column, 8) from --llama-bin (default
/root/.cache/llamacpp/build/bin) on the same Q4_1 file and the same chat-formatted prompts, greedy, run
twice a prompt in the same rounds: with no drafts (`--spec-draft-n-max 0`, its plain decode) and with
drafts; decode tok/s and acceptance are the ones it prints; it too stops at the end of the answer. Compare
each engine's speedup over its own plain decode. Without the binary the JSON says where it was looked for and
the columns are left out.

--ignore-eos decodes --tokens tokens for every prompt instead (llama-lookup with its --ignore-eos, which bans
end-of-generation tokens where lmport only generates past them, so the two engines' texts part after the
first turn). Past the answer the model starts a new, unrelated turn: the repeat workload is then mostly free
generation.

The header gives the CPU model and flags, the thread count and a measured read bandwidth
(lmport/bench/machine.py). On a shared machine, say so beside any figure: other processes change every
column, which is why the rounds interleave.

Run: python benchmarks/speculative.py [--rounds 5] [--tokens 128] [--ignore-eos] [--batch]
     [--out benchmarks/results/speculative.json]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from gguf_files import gguf_file
from lmport.bench.machine import write_result

FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, for a ten-year-old.",
    "Describe a walk through a forest in autumn.",
]
REPEAT = [
    "Rewrite this Python function with type hints and keep everything else the same:\n\n"
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n        else:\n"
    "            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n    return result\n",
    "Copy this list exactly, one item per line: apples, pears, plums, cherries, figs, dates, limes, lemons, "
    "oranges, grapes, melons, kiwis, mangos, papayas, peaches, apricots.",
    "Fix the spelling in this paragraph and repeat it otherwise unchanged: The quick brown fox jumpd over the "
    "lazy dog. Paged atention stores the key-value cache in fixed-size blocks that need not be contigous, so "
    "many requests of diferent lengths can share one pool without fragmentation.",
]
LOOKUP = "llama-lookup"


def machine() -> dict:
    """CPU model and kernel flags, threads, load and measured read bandwidth (lmport/bench/machine.py)."""
    from lmport.bench.machine import cpu_info, memory_bandwidth
    threads = torch.get_num_threads()
    return {**cpu_info(), "threads": threads, "bandwidth": memory_bandwidth(threads), "torch": torch.__version__}


def chat_text(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(chat_text(tokenizer, text), add_special_tokens=False)


def decode_rate(engine, prompt: list[int], tokens: int, ignore_eos: bool) -> tuple[float, dict]:
    """Decode tok/s of one request alone, and the engine's speculation counters it moved."""
    from lmport import GenerationConfig
    before = engine.usage()
    engine.add_request(prompt, GenerationConfig(max_new_tokens=tokens, ignore_eos=ignore_eos))
    first = last = None
    generated = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.delta_token_ids:
                generated += len(o.delta_token_ids)
                first = first or now
                last = now
    if generated < 2:
        raise SystemExit(f"a prompt of {len(prompt)} tokens was answered in {generated} token: no decode to time")
    after = engine.usage()
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                                             "spec_verifications")}
    return (generated - 1) / (last - first), moved


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "rounds": [round(v, 2) for v in values]}


def lookup_rate(binary: Path, model_file: Path, text: str, tokens: int, draft: int,
                ignore_eos: bool) -> tuple[float, dict]:
    """llama-lookup's decode tok/s for one chat-formatted prompt, and its draft counters."""
    out = subprocess.run([str(binary), "-m", str(model_file), "-p", text, "-n", str(tokens), "--temp", "0",
                          "--spec-draft-n-max", str(draft), "-t", str(torch.get_num_threads())]
                         + (["--ignore-eos"] if ignore_eos else []), capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{binary} failed:\n{out.stderr[-2000:]}")
    speed = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", out.stderr)
    drafted, accepted = (re.search(rf"{key}\s+= (\d+)", out.stderr) for key in ("n_drafted", "n_accept"))
    if not (speed and drafted and accepted):
        raise SystemExit(f"{binary}: no decode speed or draft counters in its output:\n{out.stderr[-2000:]}")
    # lmport's counters; llama-lookup does not count its verifying steps, so its mean acceptance length is 0 (unknown).
    return float(speed.group(1)), {"spec_proposed_tokens": int(drafted.group(1)),
                                   "spec_accepted_tokens": int(accepted.group(1)), "spec_verifications": 0}


def ngram_tokens() -> int:
    """What lmport's n-gram column drafts at most a step (SpeculativeConfig's default), for llama-lookup too."""
    from lmport.config import SpeculativeConfig
    return SpeculativeConfig(method="ngram").num_speculative_tokens


def single_stream(rounds: int, tokens: int, ignore_eos: bool, lookup: Path | None) -> dict:
    import lmport
    from lmport import EngineConfig
    target = str(float_target())
    engines = {"off": ("smollm2", None), "ngram": ("smollm2", {"method": "ngram"}),
               "f32_off": (target, None), "f32_draft": (target, {"method": "draft", "model": "smollm2"})}
    pipes = {name: lmport.pipeline(model, backend_config=EngineConfig(device_type="cpu", speculative=spec))
             for name, (model, spec) in engines.items()}
    tok = pipes["off"].engine.tokenizer
    # Each column: (chat text, its token ids) -> (decode tok/s, speculation counters moved).
    runners = {name: (lambda text, ids, pipe=pipe: decode_rate(pipe.engine, ids, tokens, ignore_eos))
               for name, pipe in pipes.items()}
    if lookup is not None:
        model_file, draft = gguf_file("Q4_1"), ngram_tokens()   # the file the "off" and "ngram" columns run
        runners["llama_off"] = lambda text, ids: lookup_rate(lookup, model_file, text, tokens, 0, ignore_eos)
        runners["llama_lookup"] = lambda text, ids: lookup_rate(lookup, model_file, text, tokens, draft, ignore_eos)
    results = {}
    for workload, texts in (("free", FREE), ("repeat", REPEAT)):
        prompts = [(chat_text(tok, t), chat_ids(tok, t)) for t in texts]
        rates: dict[str, list[float]] = {name: [] for name in runners}
        counters = {name: {"spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "spec_verifications": 0}
                    for name in ("ngram", "f32_draft", "llama_lookup") if name in runners}
        for _ in range(rounds):
            per_round: dict[str, list[float]] = {name: [] for name in runners}
            for text, ids in prompts:
                for name, run in runners.items():   # interleaved request by request
                    rate, moved = run(text, ids)
                    per_round[name].append(rate)
                    for k in counters.get(name, {}):
                        counters[name][k] += moved[k]
            for name in runners:
                rates[name].append(statistics.mean(per_round[name]))
        results[workload] = {
            **{name: summary(r) for name, r in rates.items()},
            "speedup_median": round(statistics.median(rates["ngram"]) / statistics.median(rates["off"]), 2),
            "draft_speedup_median": round(statistics.median(rates["f32_draft"]) / statistics.median(rates["f32_off"]),
                                          2),
            **({"llama_lookup_speedup_median": round(statistics.median(rates["llama_lookup"])
                                                     / statistics.median(rates["llama_off"]), 2)}
               if lookup is not None else {}),
            **{f"{name}_{k}": v for name, c in counters.items() for k, v in acceptance(c).items()},
        }
    for pipe in pipes.values():
        pipe.close()
    return results


def acceptance(c: dict) -> dict:
    proposed, verifications = c["spec_proposed_tokens"], c["spec_verifications"]
    return {"acceptance_rate": round(c["spec_accepted_tokens"] / proposed, 3) if proposed else 0.0,
            "mean_acceptance_length": round(1 + c["spec_accepted_tokens"] / verifications, 2) if verifications
            else 0.0}


def float_target() -> Path:
    """The default model in float32 as a transformers directory (converted once, as the tests do)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from support.model_helpers import transformers_dir
    return transformers_dir("smollm2")


def batch(rounds: int) -> dict:
    """The `make bench` workload (benchmarks/throughput.py), speculation off and on, alternating."""
    from lmport.bench.datasets import workload

    import lmport
    from lmport import EngineConfig, GenerationConfig
    rates: dict[str, list[float]] = {"off": [], "ngram": []}
    for _ in range(rounds):
        for name, spec in (("off", None), ("ngram", {"method": "ngram"})):
            with lmport.pipeline("smollm2", backend_config=EngineConfig(device_type="cpu", speculative=spec)) as pipe:
                requests = workload(pipe.engine.tokenizer, 64, seed=0)
                start = time.perf_counter()
                for ids, n in requests:
                    pipe.engine.add_request(ids, GenerationConfig(max_new_tokens=n, ignore_eos=True))
                while pipe.engine.has_unfinished():
                    pipe.engine.step()
                rates[name].append(sum(n for _, n in requests) / (time.perf_counter() - start))
    return {name: summary(r) for name, r in rates.items()}


def verify_cost(rounds: int, depth: int = 256, reps: int = 10) -> dict:
    """What a forward of one sequence costs by the tokens it computes (1: a plain decode step; k + 1: verifying
    k proposals), at ``depth`` tokens of context, on the Q4_1 default model: the median ms of ``rounds`` rounds
    of ``reps`` forwards, the token counts interleaved. A proposal of k tokens accepted to a mean length L
    gains at most L / (cost of k + 1 tokens / cost of 1). The forwards write and read blocks no request holds
    (the engine is idle), so the values in them do not matter, only the work."""
    import lmport
    from lmport import EngineConfig
    from lmport.worker.runner import StepInput
    counts = sorted({1, 2, 3, ngram_tokens() + 1})
    with lmport.pipeline("smollm2", backend_config=EngineConfig(device_type="cpu")) as pipe:
        engine = pipe.engine
        bs = engine.layout.block_size
        table = list(range(-(-(depth + max(counts)) // bs)))

        def forward(n: int) -> float:
            step = StepInput([1] * n, [n], [depth + n], [table], list(range(n)))
            started = time.perf_counter()
            for _ in range(reps):
                engine.executor.execute(step)
            return (time.perf_counter() - started) / reps * 1000
        forward(1)   # warm-up
        ms: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(rounds):
            for n in counts:
                ms[n].append(forward(n))
    plain = statistics.median(ms[1])
    return {"depth": depth, "reps": reps,
            "tokens": {n: {**summary(v), "ratio": round(statistics.median(v) / plain, 2)} for n, v in ms.items()}}


def peer(bin_dir: Path) -> dict:
    binary = bin_dir / LOOKUP
    if not binary.exists():
        return {"ran": False, "looked_for": str(binary), "reason": f"no {LOOKUP} in {bin_dir}: its columns left out"}
    draft = ngram_tokens()
    return {"ran": True, "binary": str(binary), "draft_max": draft,
            "reason": f"{binary}, --spec-draft-n-max 0 and {draft}"}


def table(results: dict) -> str:
    def rate(x: dict) -> str:
        return f"{x['median']} ({x['min']}-{x['max']})"

    lines = ["| workload | off tok/s | n-gram tok/s | speedup | acceptance | mean acceptance length "
             "| f32 off tok/s | f32 + Q4_1 draft tok/s | speedup | acceptance | mean acceptance length |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for workload, r in results["single_stream"].items():
        lines.append(f"| {workload} | {rate(r['off'])} | {rate(r['ngram'])} | {r['speedup_median']}x | "
                     f"{r['ngram_acceptance_rate']} | {r['ngram_mean_acceptance_length']} | {rate(r['f32_off'])} | "
                     f"{rate(r['f32_draft'])} | {r['draft_speedup_median']}x | {r['f32_draft_acceptance_rate']} | "
                     f"{r['f32_draft_mean_acceptance_length']} |")
    if results["llama_cpp"]["ran"]:
        lines += ["", "| workload | llama.cpp off tok/s | llama-lookup tok/s | speedup | acceptance |",
                  "|---|---|---|---|---|"]
        for workload, r in results["single_stream"].items():
            lines.append(f"| {workload} | {rate(r['llama_off'])} | {rate(r['llama_lookup'])} | "
                         f"{r['llama_lookup_speedup_median']}x | {r['llama_lookup_acceptance_rate']} |")
    cost = results["verify_cost"]
    lines += ["", f"| tokens a forward computes (one sequence, depth {cost['depth']}) | ms | ratio to 1 token |",
              "|---|---|---|"]
    lines += [f"| {n} | {rate(c)} | {c['ratio']}x |" for n, c in cost["tokens"].items()]
    if "batch" in results:
        b = results["batch"]
        lines += ["", "| make bench workload | off tok/s | n-gram tok/s |", "|---|---|---|",
                  f"| 64 requests | {b['off']['median']} ({b['off']['min']}-{b['off']['max']}) | "
                  f"{b['ngram']['median']} ({b['ngram']['min']}-{b['ngram']['max']}) |"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true", help="decode --tokens tokens whatever the answer")
    parser.add_argument("--batch", action="store_true", help="also the make bench workload, off vs on")
    parser.add_argument("--llama-bin", type=Path, default=Path(os.environ.get(
        "LMPORT_LLAMA_CPP_BIN", "/root/.cache/llamacpp/build/bin")))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative.json"))
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5 (medians with min-max of interleaved rounds)")
    llama_cpp = peer(args.llama_bin)
    lookup = Path(llama_cpp["binary"]) if llama_cpp["ran"] else None
    results = {"machine": machine(), "tokens": args.tokens, "ignore_eos": args.ignore_eos, "rounds": args.rounds,
               "llama_cpp": llama_cpp}
    results["single_stream"] = single_stream(args.rounds, args.tokens, args.ignore_eos, lookup)
    results["verify_cost"] = verify_cost(args.rounds)
    if args.batch:
        results["batch"] = batch(args.rounds)
    results["machine"]["load_average_after"] = os.getloadavg()
    m = results["machine"]
    print(f"CPU: {m['model']} ({', '.join(m['kernel_flags'])}), {m['threads']} threads, read bandwidth "
          f"{m['bandwidth']['median_gbs']:.1f} GB/s (median), load average {m['load_average'][0]:.1f}")
    print(table(results))
    print(f"llama.cpp peer: {results['llama_cpp']['reason']}")
    write_result(args.out, results)


if __name__ == "__main__":
    main()
