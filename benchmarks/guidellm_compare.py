"""guidellm against `lmport serve` and llama-server, one after the other, on the same model and machine.

For each server: start it fresh, run guidellm synchronous and then at --concurrency streams (default 16; POST
/v1/completions, streamed, synthetic prompts of --prompt-tokens tokens, --output-tokens out, a fixed seed a
profile, so that the concurrent run's prompts are not the synchronous run's), then the same two runs again with the
same prompts, so that a prefix cache (lmport's, on by default in `lmport serve`; llama-server's prompt reuse) can
answer; stop it. With --rounds N the servers take turns N times (the first to go alternating), each round on
fresh servers. Prints output tok/s and time-to-first-token p50 side by side (medians (min-max) over the rounds)
with the lmport / llama-server ratios of each round's pair, and writes JSON.

guidellm lives in its own environment (its dependencies are not lmport's):

    python3 -m venv /root/.venvs/guidellm
    /root/.venvs/guidellm/bin/pip install torch==2.13.0 && /root/.venvs/guidellm/bin/pip install guidellm==0.8.1
    .venv/bin/python benchmarks/guidellm_compare.py --llama-server /root/.cache/llamacpp/build/bin/llama-server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmport.bench import machine  # noqa: E402
from lmport.bench.client import LLAMA_SERVING, served_url, wait_ready  # noqa: E402
from serve_load import start_server  # noqa: E402
from serve_throughput import start_llama_server, stop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ("synchronous", "concurrent")


def profile_of(label: str, concurrency: int) -> tuple[str, dict]:
    if label == "synchronous":
        return label, {"kind": "synchronous"}
    return f"concurrency {concurrency}", {"kind": "concurrent", "streams": [concurrency]}


def scenario(url: str, model: str, tokenizer_dir: str, profile: dict, seed: int, args, out: Path) -> dict:
    return {
        "metadata": {"name": "lmport-compare", "description": "benchmarks/guidellm_compare.py"},
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
                        "stream": True, "max_tokens": args.output_tokens, "timeout": 600},
            "profile": profile,
            "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                      "output_tokens": args.output_tokens}],
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer_dir},
            "constraints": [{"kind": "max_requests", "count": args.requests}],
            "seed": {"kind": "static", "value": seed},
            "outputs": [{"kind": "json", "path": str(out)}],
        },
        "benchmarks": [None],
    }


def run_guidellm(args, url: str, model: str, tokenizer_dir: str, profile: dict, seed: int, work: Path,
                 name: str) -> dict:
    out = work / f"{name}.json"
    config = work / f"{name}.scenario.json"
    config.write_text(json.dumps(scenario(url, model, tokenizer_dir, profile, seed, args, out), indent=2))
    cmd = [args.guidellm, "run", "--scenario", str(config), "--disable-console-interactive"]
    with (work / f"{name}.log").open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"guidellm exited {proc.returncode}; see {work / (name + '.log')}"}
    return read_report(json.loads(out.read_text()))


def read_report(report: dict) -> dict:
    """Output tok/s (mean over the run) and TTFT p50 (ms) of the report's one benchmark."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]

    def stat(name: str, field: str):
        entry = metrics[name]["successful"]
        return entry["percentiles"]["p50"] if field == "p50" else entry[field]
    return {"output_tokens_per_s": stat("output_tokens_per_second", "mean"),
            "ttft_p50_ms": stat("time_to_first_token_ms", "p50"),
            "itl_p50_ms": stat("inter_token_latency_ms", "p50"),
            "requests": metrics["request_totals"]["successful"], "errored": metrics["request_totals"]["errored"]}


async def ready(url: str, proc: subprocess.Popen) -> None:
    await wait_ready(url, proc, time.monotonic() + 600)


def run_server(args, name: str, work: Path, tokenizer_dir: str) -> dict:
    if name == "lmport":
        proc = start_server(args.model, args.serve_args.split(), work / "lmport.log", args.threads)
        url = served_url(proc, work / "lmport.log", time.monotonic() + 600)
        model = args.model
    else:
        from lmport.models.loader import resolve_model_path
        gguf = str(resolve_model_path(args.model))
        proc = start_llama_server(args.llama_server, gguf, args.threads, 16, work / "llama-server.log")
        url = served_url(proc, work / "llama-server.log", time.monotonic() + 600, LLAMA_SERVING)
        model = Path(gguf).name
    results = {}
    try:
        asyncio.run(ready(url, proc))
        for setting in args.settings:
            for index, kind in enumerate(PROFILES):
                if kind not in args.profiles:
                    continue
                label, profile = profile_of(kind, args.concurrency)
                key = f"{setting}, {label}"
                print(f"{name}: {key}", file=sys.stderr)
                results[key] = run_guidellm(args, url, model, tokenizer_dir, profile, args.seed + index, work,
                                            f"{name}-{setting}-{label.replace(' ', '')}")
    finally:
        stop(proc)
    return results


def table(rounds: dict[str, list[dict]]) -> str:
    """Each run's output tok/s and TTFT p50 as median (min-max) over the rounds, and the median (min-max) of each
    round's lmport / llama-server ratio; a run that errored in any round shows its first error."""
    names = list(rounds)
    keys = list(rounds[names[0]][0])
    pair = len(names) == 2
    lines = ["| run | " + " | ".join(f"{n} tok/s | {n} TTFT p50 ms" for n in names) +
             (" | lmport / llama-server tok/s |" if pair else " |"),
             "|---|" + "---|---|" * len(names) + ("---|" if pair else "")]
    for key in keys:
        cells, rates = [], {}
        for n in names:
            runs = [r[key] for r in rounds[n]]
            error = next((r["error"] for r in runs if "error" in r), None)
            if error:
                cells += [error, "-"]
                continue
            rates[n] = [r["output_tokens_per_s"] for r in runs]
            cells += [machine.spread(rates[n], ".1f"), machine.spread([r["ttft_p50_ms"] for r in runs], ".0f")]
        ratio = ""
        if pair and len(rates) == 2:
            ours, theirs = (rates[n] for n in names)
            ratio = " | " + machine.spread([a / b for a, b in zip(ours, theirs)], ".2f")
        lines.append(f"| {key} | " + " | ".join(cells) + ratio + " |")
    return "\n".join(lines)


def rounds_count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of rounds, at least 1")
    return int(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--guidellm", default="/root/.venvs/guidellm/bin/guidellm")
    p.add_argument("--llama-server", default=None, help="llama-server binary: adds its column")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=64, help="requests per guidellm run")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=2, help="torch threads of lmport serve; llama-server -t")
    p.add_argument("--serve-args", default="", help="more `lmport serve` flags")
    p.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES,
                   help="guidellm profiles to run (default: both)")
    p.add_argument("--concurrency", type=int, default=16, help="streams of the concurrent profile")
    p.add_argument("--settings", nargs="+", default=["fresh", "repeated"], choices=["fresh", "repeated"],
                   help="fresh prompts, then the same again (default: both)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one guidellm run may take")
    p.add_argument("--rounds", type=rounds_count, default=1, help="rounds of fresh servers, taking turns")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "guidellm_compare.json"))
    args = p.parse_args()

    from lmport.models.loader import load_tokenizer
    work = Path(tempfile.mkdtemp(prefix="lmport-guidellm-"))
    print(f"work directory: {work}", file=sys.stderr)
    tokenizer_dir = str(work / "tokenizer")
    load_tokenizer(args.model).save_pretrained(tokenizer_dir)   # guidellm counts synthetic prompts with it

    names = ["lmport", "llama-server"] if args.llama_server else ["lmport"]
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for index in range(args.rounds):
        round_work = work / f"round-{index + 1}"
        round_work.mkdir()
        print(f"round {index + 1} of {args.rounds}", file=sys.stderr)
        for name in names if index % 2 == 0 else names[::-1]:
            rounds[name].append(run_server(args, name, round_work, tokenizer_dir))
    info = machine.describe()
    print(f"\nguidellm, /v1/completions streamed, {args.prompt_tokens} prompt tokens, {args.output_tokens} output, "
          f"{args.requests} requests a run, {args.rounds} rounds; {machine.line(info)}\n")
    print(table(rounds))
    machine.write_result(args.out, {"rounds": rounds, "machine": info, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
