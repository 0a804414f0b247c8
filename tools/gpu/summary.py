"""The GPU kit's output folders -> the markdown tables docs/cuda.md holds.

    python tools/gpu/summary.py OUT [OUT ...] [--write summary.md]

Each OUT is a folder run.py wrote (run.json in it) or such a run.json itself, renamed. Several (one a device call)
merge: a step's latest result that ran wins over a skipped one. A step stopped at its limit shows what it kept
(its ``partial`` result). Prints the markdown.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(folders: list[Path]) -> tuple[dict, list[dict]]:
    steps: dict[str, dict] = {}
    runs = []
    for folder in folders:
        run = json.loads((folder / "run.json" if folder.is_dir() else folder).read_text())
        runs.append(run)
        for r in run["steps"]:
            if r["status"] == "timeout" and r.get("partial"):
                r = {**r, "data": r["partial"].get("data")}
            old = steps.get(r["step"])
            if old is None or r["status"] != "skipped" or old["status"] == "skipped":
                steps[r["step"]] = r
    return steps, runs


def md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join("-" if c is None else str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(out)


def pct(x) -> str | None:
    return None if x is None else f"{100 * x:.0f}%"


def render(steps: dict[str, dict], runs: list[dict]) -> str:
    parts = []
    env = steps.get("env", {}).get("data") or {}
    where = env.get("device_name") or "no GPU"
    parts.append(f"Measured on {where} (driver and clocks: {env.get('nvidia_smi', '-')}), torch {env.get('torch')}, "
                 f"Triton {env.get('triton')}, transformers {env.get('transformers')}, Python {env.get('python')}."
                 + (" Dry run: no figure below is a GPU measurement." if any(r.get("dry_run") for r in runs) else ""))
    parts.append(md_table(["step", "status", "seconds", "reason"],
                          [[r["step"], r["status"], r.get("seconds"), str(r.get("reason", ""))[:200]]
                           for r in steps.values()]))
    data = {name: r.get("data") or {} for name, r in steps.items()}
    c = data.get("conformance")
    if c:
        parts.append(f"**Conformance** ({c.get('mode')}): {c.get('passed')} passed, {c.get('failed')} failed, "
                     f"{c.get('skipped')} skipped (`{c.get('command')}`).")
        parts.append(md_table(["dtype", "passed", "failed", "skipped"],
                              [[d, v["passed"], v["failed"], v["skipped"]] for d, v in c.get("by_dtype", {}).items()]))
        if c.get("failures"):
            parts.append("Failures: " + ", ".join(f"`{f}`" for f in c["failures"][:40]))
    p = data.get("parity")
    if p:
        parts.append("**Greedy parity with transformers** (same device and dtype; identical prompts of the batch, "
                     "and where each diverging one first differs):")
        parts.append(md_table(["model", "dtype", "identical", "first divergence", "what"],
                              [[r["model"], r["dtype"], r.get("error") or f"{r.get('identical')}/{r.get('prompts')}",
                                ", ".join(str(d) for d in r.get("first_divergence", []) if d is not None) or None,
                                r.get("what")] for r in p.get("rows", [])]))
    g = data.get("graphs")
    if g:
        parts.append(md_table(["model", "dtype", "batch", "replay = eager", "captured sizes", "runs"],
                              [[r["model"], r["dtype"], r["batch"], r["identical"], r.get("graphs"),
                                r.get("graph_runs")] for r in g.get("identity", [])]))
        if g.get("timing"):
            parts.append("**Decode step, eager against CUDA graphs** (512 tokens of context, bfloat16, median):")
            parts.append(md_table(["model", "batch", "eager ms", "graphs ms", "speedup"],
                                  [[r["model"], r["batch"], r["eager_ms"], r["graphs_ms"], r["speedup"]]
                                   for r in g["timing"]]))
    k = data.get("kernels")
    if k and k.get("kernel_rows"):
        bw = k.get("copy_bytes_per_s")
        parts.append("**Kernels**" + (f" (device-to-device copy: {bw / 1e12:.2f} TB/s, read + write)" if bw else "")
                     + ":")
        parts.append(md_table(["shape", "triton ms", "reference ms", "sdpa ms", "of copy BW", "TFLOP/s"],
                              [[r.get("shape"), _ms(r.get("triton_ms")), _ms(r.get("reference_ms")),
                                _ms(r.get("sdpa_ms")), pct(r.get("copy_fraction")),
                                None if not r.get("tflops") else f"{r['tflops']:.0f}"]
                               for r in k["kernel_rows"]]))
    if k and k.get("quant_linear"):
        parts.append(md_table(["x @ W^T", "weights", "ms", "of copy BW"],
                              [[r["shape"], r["format"], _ms(r["ms"]), pct(r["copy_fraction"])]
                               for r in k["quant_linear"]]))
    if k and k.get("tilings"):
        parts.append("**Decode attention's tilings** (`cuda_kernels.py --tilings`; tiling: tokens a tile, warps, "
                     "stages, K scored from its codes):")
        parts.append(_tilings_table(k["tilings"]))
    t = data.get("throughput")
    if t:
        parts.append(f"**Engine throughput**: {t.get('model')}, {t.get('requests')} requests:")
        parts.append(_engine_table(t.get("rows", [])))
        by = {r["engine"]: r for r in t.get("rows", []) if "output_tokens_per_s" in r}
        base = by.get("transformers generate_batch")
        if base and "lmport" in by:
            parts.append(f"lmport / transformers generate_batch, output tokens/s: "
                         f"{by['lmport']['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x (target 3x)")
    q = data.get("quant")
    if q:
        parts.append(f"**KV quantization on a fixed cache** ({q.get('cache_bytes')} bytes):")
        parts.append(md_table(["quant_policy", "blocks", "peak running", "requests/s", "vs 0", "preemptions"],
                              [[r["quant_policy"], r.get("num_blocks"), r.get("peak_running"), r["requests_per_s"],
                                r.get("vs_policy_0"), r.get("preemptions")] for r in q.get("rows", [])]))
    pl = data.get("plan")
    if pl:
        parts.append(f"**`lmport plan` against the engine** ({pl.get('model')}):")
        parts.append(md_table(["", "plan", "engine", "engine / plan"],
                              [[key, pl["plan"][key], pl["engine"][key], pl["ratio"][key]] for key in pl["plan"]]
                              + [["reserve measured", "-", pl["engine"].get("reserve_measured"), None],
                                 ["allocated by torch", "-", pl["engine"].get("allocated_bytes"), None]]))
    if data.get("limits"):
        parts.append(_limits(data["limits"]))
    return "\n\n".join(parts) + "\n"


def _limits(lim: dict) -> str:
    """The limits step: its ceilings, the model step in each form against them, decode attention against torch's."""
    c = lim.get("ceilings", {})
    bw, peak = c.get("copy_bytes_per_s"), c.get("matmul_flops_per_s")
    parts = [f"**Against the card's limits** ({lim.get('device')}): device-to-device copy {bw / 1e12:.2f} TB/s (read + "
             f"write), bfloat16 matmul {peak / 1e12:.0f} TFLOP/s ({c.get('matmul')})." if bw and peak else
             "**Against the card's limits**:"]
    forms = [r for key in ("bfloat16", "fp8_kv", "fp8_weights") for r in lim.get(key) or []]
    decode = [r for r in forms if r["kind"] == "decode"]
    if decode:
        parts.append(md_table(["model step", "batch", "context", "ms", "tokens/s", "least GB read", "of copy BW"],
                              [[r["variant"], r["batch"], r["context"], _ms(r["ms"]), r["tokens_per_s"],
                                f"{r['least_bytes'] / 1e9:.2f}", pct(r["copy_fraction"])] for r in decode]))
    prefill = [r for r in forms if r["kind"] == "prefill"]
    if prefill:
        parts.append(md_table(["prefill", "sequences x tokens", "ms", "TFLOP/s", "of matmul"],
                              [[r["variant"], f"{r['batch']} x {r['tokens']}", _ms(r["ms"]), r["tflops"],
                                pct(r["matmul_fraction"])] for r in prefill]))
    if lim.get("attention"):
        parts.append(md_table(["decode attention", "batch", "context", "cache", "ms", "of copy BW"],
                              [[r["method"], r.get("batch"), r.get("context"), r.get("cache"),
                                _ms(r.get("ms")) or r.get("error"), pct(r.get("copy_fraction"))]
                               for r in lim["attention"]]))
    if lim.get("profile"):
        parts.append(md_table(["kernel (batch-1 decode, eager)", "calls a step", "ms a step"],
                              [[r["kernel"], r["calls_per_step"], r["ms_per_step"]] for r in lim["profile"][:15]]))
    return "\n\n".join(parts)


def _ms(x) -> str | None:
    return None if x is None else f"{x:.3f}"


def _tilings_table(rows: list[dict]) -> str:
    """Per shape: the kernel's first tiling (64, 4, 2, K dequantized), the fastest one and its ms."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape and "ms" in r]
        first = next((r for r in mine if tuple(r["tiling"].values()) == (64, 4, 2, False)), None)
        best = min(mine, key=lambda r: r["ms"], default=None)
        if first and best:
            out.append([shape, _ms(first["ms"]), pct(first["copy_fraction"]), str(tuple(best["tiling"].values())),
                        _ms(best["ms"]), pct(best["copy_fraction"]), f"{first['ms'] / best['ms']:.2f}x"])
    return md_table(["shape", "(64, 4, 2, no) ms", "of copy BW", "fastest tiling", "ms", "of copy BW", "speedup"],
                    out)


def _engine_table(rows: list[dict]) -> str:
    cols = ["requests_per_s", "output_tokens_per_s", "mean_latency_s", "p99_latency_s", "wall_s"]
    return md_table(["engine", *cols], [[r["engine"], *[r.get(c, r.get("error")) for c in cols]] for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    text = render(*load(args.folders))
    if args.write:
        args.write.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
