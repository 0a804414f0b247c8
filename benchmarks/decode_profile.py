"""Where a single-stream decode token's time goes on the cpu backend, op by op, against the byte limit.

One engine on one GGUF file of the default model (weights kept as the file has them), one sequence
decoding after a prompt of --depth tokens. Each kernel the decoder runner calls, each part of the
forward around it (embedding, rotary table, final norm, LM head, step inputs) and the engine's step
around the forward (scheduling, sampling, detokenizing) is timed with a clock around the call; the
time in the layer loop not inside a kernel is Python between the ops. The clocks cost a little: the
untimed step (same engine, clocks off, measured before them) is printed beside their sum.

The engine runs a step's layers in one C++ call (lmport/backends/cpu/decoder_runner.py); the op by op times
come from the runner's Python loop, which makes the same kernel calls one by one. Both loops' untimed
steps are printed, and the step without a runner (the model's modules calling the backend op by op),
each the median (min-max) over --rounds interleaved rounds: their differences are what the Python
between the ops costs.

On a machine others are loading, --clock cpu with --threads 1 counts the thread's own CPU time
(time.thread_time) instead of the wall clock: with one thread every kernel runs on the calling
thread, so the time it was descheduled drops out (memory traffic from others still counts).

The byte limit of an op is the bytes it must read from memory (its weight; attention its K and V at
this depth) over the machine's read bandwidth measured in the same run with the same threads: no
decode can beat it, and the gap to it is what is left to win.

    .venv/bin/python benchmarks/decode_profile.py [--file Q4_1|Q8_0|Q4_K_M|PATH] [--depth 0] [--threads 2]

A before / after table of two commits: run this script in each checkout (each builds its own kernels).

Prints a markdown table, writes JSON (default benchmarks/results/decode_profile_<file>_d<depth>.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from gguf_files import DEFAULT_DIR, DEFAULT_LLAMA_BIN, TYPES, add_kv_cache_dtype_argument, gguf_file
from lmport.bench.machine import cpu_info, memory_bandwidth

LINEAR_KERNELS = ("quant_linear", "ggml_linear", "small_linear")


def weight_name(w) -> str:
    from lmport import ops
    if isinstance(w, ops.GGMLWeight):
        return w.type_name
    if isinstance(w, ops.QuantizedWeight):
        return f"int{w.bits}"
    return str(w.dtype).removeprefix("torch.")


def weight_tensor_and_bytes(w) -> tuple[torch.Tensor, int]:
    """The tensor a kernel call passes second (what identifies the weight), and the bytes it reads."""
    from lmport import ops
    if isinstance(w, ops.GGMLWeight):
        return w.blocks, w.blocks.numel()
    if isinstance(w, ops.QuantizedWeight):   # the mins only where the kernels read them (kernel_mins)
        from lmport.backends.cpu.kernels import kernel_mins
        mins = kernel_mins(w)
        read = (w.qweight, w.scales) if mins is None else (w.qweight, w.scales, mins)
        return w.qweight, sum(t.numel() * t.element_size() for t in read)
    return w, w.numel() * w.element_size()


class Clock:
    """Seconds and calls per label, while on; bytes read per label where known."""

    def __init__(self, now=time.perf_counter):
        self.on, self.now = False, now
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def wrap(self, label, fn, nbytes=None):
        """fn timed under ``label`` (a string, or a function of the call's arguments giving one)."""
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start = self.now()
            out = fn(*args, **kwargs)
            elapsed = self.now() - start
            name = label if isinstance(label, str) else label(args)
            self.seconds[name] += elapsed
            self.calls[name] += 1
            if nbytes is not None:
                self.bytes[name] += nbytes(args)
            return out
        return timed


class TimedKernels:
    """The compiled module with each kernel timed; a linear is labelled with the layer's projection and
    its weight's format ("gate_up q5_0"), attention counts the K and V bytes it reads."""

    def __init__(self, compiled, clock: Clock, roles: dict[int, tuple[str, int]]):
        self._compiled, self._clock, self._roles = compiled, clock, roles

    def __getattr__(self, name):
        fn = getattr(self._compiled, name)
        if name in LINEAR_KERNELS:
            return self._clock.wrap(lambda a: self._roles[a[1].data_ptr()][0], fn,
                                    lambda a: self._roles[a[1].data_ptr()][1])
        if name == "paged_attention":   # (q, k_cache, v_cache, block_tables, q_start_loc, kv_lens, ...)
            return self._clock.wrap("attention", fn,
                                    lambda a: 2 * int(a[5].sum()) * a[1].shape[2] * a[1].shape[3] * a[1].element_size())
        return self._clock.wrap({"rms_norm": "rms_norm", "apply_rotary": "rotary", "fill_kv_cache": "kv fill",
                                 "silu_and_mul": "silu_and_mul"}.get(name, name), fn)


def linear_roles(specs) -> dict[int, tuple[str, int]]:
    """Each layer weight's first tensor (by address) -> (its projection and format, its bytes)."""
    from lmport import ops
    roles = {}
    for spec in specs:
        for role in ("qkv", "o", "gate_up", "down"):
            linears = getattr(spec, role)
            for part in linears if isinstance(linears, tuple) else (linears,):
                tensor, nbytes = weight_tensor_and_bytes(part.weight)
                roles[tensor.data_ptr()] = (f"{role} {weight_name(part.weight)}", nbytes)
    assert all(isinstance(s, ops.DecoderLayerSpec) for s in specs)
    return roles


def instrument(engine, clock: Clock) -> None:
    """Clocks around the step, the forward's parts and every kernel of the decoder runner."""
    import lmport.worker.runner as runner_module
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, kernels
    from lmport.backends.cpu.decoder_runner import build
    model, runner = engine.model, engine.runner
    specs = [layer.spec() for layer in model.model.layers]
    layers = build(specs, TimedKernels(kernels.load(), clock, linear_roles(specs)), SMALL_BATCH_TOKENS, "python")
    assert layers is not None, "the decoder runner does not cover this model"
    model._runner = (clock.wrap("layers (all)", layers),)
    lm_head = model.lm_head.quantized if hasattr(model.lm_head, "quantized") else model.lm_head.weight
    head_bytes = weight_tensor_and_bytes(lm_head)[1]
    model.logits = clock.wrap(f"LM head {weight_name(lm_head)}", model.logits, lambda a: head_bytes)
    model.model.embed_tokens.forward = clock.wrap("embedding", model.model.embed_tokens.forward)
    # called, not modules
    model.rope_tables = {kind: clock.wrap("rotary table", table) for kind, table in model.rope_tables.items()}
    model.model.norm.forward = clock.wrap("final norm", model.model.norm.forward)
    model.forward = clock.wrap("model forward (all)", model.forward)
    runner_module.build_attention_metadata = clock.wrap("attention metadata", runner_module.build_attention_metadata)
    runner.execute = clock.wrap("runner execute (all)", runner.execute)
    engine.step = clock.wrap("engine step (all)", engine.step)


def decode(engine, prompt: list[int], tokens: int, clock: Clock | None = None, now=time.perf_counter) -> list[float]:
    """Seconds of each decode step of ``tokens`` tokens after ``prompt`` (its prefill step left out,
    and ``clock`` on for the decode steps only)."""
    from lmport.config import GenerationConfig
    engine.add_request(prompt, GenerationConfig(max_new_tokens=tokens + 1, ignore_eos=True))
    engine.step()
    steps = []
    if clock is not None:
        clock.on = True
    while engine.has_unfinished():
        start = now()
        engine.step()
        steps.append(now() - start)
    if clock is not None:
        clock.on = False
    return steps


def python_loop(engine) -> None:
    """The engine's decoder runner replaced by its Python loop (no clocks)."""
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, kernels
    from lmport.backends.cpu.decoder_runner import build
    model = engine.model
    model._runner = (build([layer.spec() for layer in model.model.layers], kernels.load(), SMALL_BATCH_TOKENS,
                           "python"),)


def table(clock: Clock, tokens: int, untimed: dict[str, float], gbs: float) -> list[dict]:
    ms = {k: v * 1e3 / tokens for k, v in clock.seconds.items()}
    kernel_labels = [k for k in ms if not k.endswith("(all)") and k not in
                     ("embedding", "rotary table", "final norm", "attention metadata") and not k.startswith("LM head")]
    head = next(k for k in ms if k.startswith("LM head"))
    forward_parts = ["embedding", "rotary table", "layers (all)", "final norm"]
    rows = [(k, ms[k], clock.calls[k] / tokens, clock.bytes.get(k, 0) / tokens)
            for k in sorted(kernel_labels, key=lambda k: -ms[k])]
    rows.append(("Python between the ops (layer loop)", ms["layers (all)"] - sum(ms[k] for k in kernel_labels), 0, 0))
    rows += [(k, ms[k], clock.calls[k] / tokens, clock.bytes.get(k, 0) / tokens)
             for k in ("embedding", "rotary table", "final norm", head, "attention metadata")]
    rows.append(("model forward, rest (Python)", ms["model forward (all)"] - sum(ms[k] for k in forward_parts), 0, 0))
    rows.append(("runner step, rest (step inputs)",
                 ms["runner execute (all)"] - ms["model forward (all)"] - ms[head] - ms["attention metadata"], 0, 0))
    rows.append(("engine around the forward (schedule, sample, detokenize)",
                 ms["engine step (all)"] - ms["runner execute (all)"], 0, 0))
    out = [{"part": k, "ms": v, "calls": c, "mb": b / 1e6, "limit_ms": b / (gbs * 1e9) * 1e3} for k, v, c, b in rows]
    out.append({"part": "total (clocked)", "ms": ms["engine step (all)"], "calls": 0,
                "mb": sum(r["mb"] for r in out), "limit_ms": sum(r["limit_ms"] for r in out)})
    for loop, ms_step in untimed.items():
        out.append({"part": f"total (no clocks, {loop} layer loop)", "ms": ms_step, "calls": 0, "mb": out[-1]["mb"],
                    "limit_ms": out[-1]["limit_ms"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="Q4_1", help=f"one of {', '.join(TYPES)}, or a GGUF path")
    ap.add_argument("--files-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--llama-bin", type=Path, default=DEFAULT_LLAMA_BIN,
                    help="llama.cpp's bin directory, for llama-quantize when a file is missing")
    ap.add_argument("--depth", type=int, default=0, help="context tokens before the decode")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    ap.add_argument("--threads", type=int, default=2)
    add_kv_cache_dtype_argument(ap)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the untimed steps")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the thread's CPU time, for --threads 1 on a loaded machine")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu counts the calling thread's time only: use it with --threads 1")
    torch.set_num_threads(args.threads)
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    from lmport.backends.cpu import kernels
    from lmport.config import EngineConfig
    from lmport.engine.engine import Engine
    path = Path(args.file) if args.file.endswith(".gguf") else gguf_file(args.file, args.files_dir, args.llama_bin)
    engine = Engine(str(path), EngineConfig(device_type="cpu", cache_max_entry_count=64,
                                            max_prefill_token_num=max(256, args.depth),
                                            kv_cache_dtype=args.kv_cache_dtype))
    prompt = (engine.tokenizer.encode("Paged attention keeps keys and values in fixed-size blocks. " * 60)
              * 8)[:max(args.depth, 1)]
    bandwidth = memory_bandwidth(args.threads, now=now)
    decode(engine, prompt, 8)   # warm-up, which builds the engine's runner
    loops = {"C++": engine.model._runner}
    python_loop(engine)
    loops["Python"] = engine.model._runner
    loops["no runner (the modules')"] = (None,)   # the model's modules call the backend op by op
    steps = {loop: [] for loop in loops}
    for _ in range(args.rounds):   # the loops in turn, each round's median step
        for loop, runner in loops.items():
            engine.model._runner = runner
            steps[loop].append(statistics.median(decode(engine, prompt, args.tokens, now=now)) * 1e3)
    clock = Clock(now)
    instrument(engine, clock)
    decode(engine, prompt, args.tokens, clock, now)
    untimed = {loop: statistics.median(ms) for loop, ms in steps.items()}
    untimed_ms = untimed["C++"]
    rows = table(clock, args.tokens, untimed, bandwidth["best_gbs"])
    machine = cpu_info()
    kernel_isa = os.environ.get("LMPORT_CPU_ISA", "native")
    print(f"\n{path.name}, decode at depth {args.depth}, {args.tokens} tokens, {args.threads} threads, "
          f"K/V {args.kv_cache_dtype}; "
          f"{machine['model']} ({' '.join(machine['kernel_flags'])}); kernels {kernel_isa}; "
          f"read bandwidth {bandwidth['best_gbs']:.1f} GB/s (best of {bandwidth['method']}); "
          f"load average {machine['load_average']}; untimed step {untimed_ms:.2f} ms "
          f"({1e3 / untimed_ms:.1f} tok/s)\n")
    print("| part | calls / token | ms / token | share | MB read / token | byte limit ms | limit / time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    total = next(r["ms"] for r in rows if r["part"] == "total (clocked)")
    for r in rows:
        share = "" if r["part"].startswith("total") else f"{r['ms'] / total:.1%}"
        ratio = f"{r['limit_ms'] / r['ms']:.0%}" if r["limit_ms"] and r["ms"] > 0 else ""
        print(f"| {r['part']} | {r['calls']:.0f} | {r['ms']:.3f} | {share} | {r['mb']:.2f} | "
              f"{r['limit_ms']:.3f} | {ratio} |")
    print(f"\nuntimed step, ms, median (min-max) of {args.rounds} interleaved rounds: " + "; ".join(
        f"{loop} {untimed[loop]:.2f} ({min(ms):.2f}-{max(ms):.2f})" for loop, ms in steps.items()))
    out = Path(args.out or f"benchmarks/results/decode_profile_{path.stem}_d{args.depth}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"file": str(path), "depth": args.depth, "tokens": args.tokens, "threads": args.threads,
                               "kv_cache_dtype": args.kv_cache_dtype,
                               "clock": args.clock,
                               "kernels": kernel_isa, "machine": machine, "bandwidth": bandwidth,
                               "untimed_step_ms": untimed, "untimed_round_ms": steps,
                               "kernel_build": kernels.load().__name__, "rows": rows},
                              indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
