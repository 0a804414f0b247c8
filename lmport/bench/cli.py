"""The `lmport bench` subcommand: its parsers, and each benchmark's run, report and JSON (``--out DIR``)."""
from __future__ import annotations

import argparse

from lmport.config import EngineConfig


def add_parser(sub) -> None:
    """`lmport bench {latency,throughput,serve,kernels}` under the `lmport` command's subparsers ``sub``."""
    from lmport.bench import latency, serve, throughput
    from lmport.entrypoints.flags import add_dataclass_flags
    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve, kernels",
                           description="lmport's benchmarks: medians (min-max) over interleaved rounds")
    kinds = bench.add_subparsers(dest="benchmark", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", metavar="DIR", default=None,
                       help="write the result's JSON into DIR (as NAME-<UTC time>.json); default: print only")
        p.set_defaults(func=cmd_bench)

    p = kinds.add_parser("latency", help="single-stream prefill and decode of a model",
                         description=latency.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    latency.add_arguments(p)
    add_dataclass_flags(p, EngineConfig, "engine")
    common(p)
    p = kinds.add_parser("throughput", help="offline batch throughput on a fixed mixed workload",
                         description=throughput.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    throughput.add_arguments(p)
    add_dataclass_flags(p, EngineConfig, "engine")
    common(p)
    p = kinds.add_parser("serve", help="a streamed load against an OpenAI-compatible server (--url)",
                         description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_arguments(p)
    common(p)
    p = kinds.add_parser("kernels", help="the cpu or cuda backend's kernels against what they replace")
    backends = p.add_subparsers(dest="kernels_backend", required=True)
    q = backends.add_parser("cpu", help="the cpu backend's compiled kernels (builds them first)")
    _cpu_kernels_arguments(q)
    common(q)
    q = backends.add_parser("cuda", help="the cuda backend's Triton kernels (--check: on the interpreter)")
    _cuda_kernels_arguments(q)
    common(q)


# The kernel modules import their backend (and, for cuda, set up the Triton interpreter) when loaded: their
# arguments are declared here so that `lmport --help` loads neither.
def _cpu_kernels_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="the model whose shapes are measured (default smollm2)")
    p.add_argument("--only", choices=["linear", "prefill", "ggml", "gemv", "held", "attention"],
                   help="run one group of cases")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")


def _cuda_kernels_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="check the shape set (scaled down) against the reference op")
    p.add_argument("--quick", action="store_true", help="a few shapes of each kind")
    p.add_argument("--tilings", action="store_true", help="decode attention under each tiling (GPU only)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")


def run(args) -> tuple[str, dict, str | None, int]:
    """The benchmark ``args`` name: its name for the JSON file, its result, its report (None where it printed
    its own) and the exit status."""
    from lmport.entrypoints.flags import engine_config
    if args.benchmark == "latency":
        from lmport.bench import latency
        result = latency.run(args, engine_config(args))
        return "latency", result, latency.report(result), 0
    if args.benchmark == "throughput":
        from lmport.bench import throughput
        result = throughput.run(args, engine_config(args))
        return "throughput", result, throughput.report(result), 0
    if args.benchmark == "serve":
        from lmport.bench import serve
        result = serve.run(args)
        return "serve", result, serve.report(result), 1 if serve.failures(result) else 0
    if args.kernels_backend == "cpu":
        from lmport.bench import cpu_kernels as module
    else:
        from lmport.bench import cuda_kernels as module
    result, status = module.run(args)
    return f"kernels-{args.kernels_backend}", result, None, status


def cmd_bench(args) -> int:
    from lmport.bench.machine import write_to_directory
    name, result, text, status = run(args)
    if text is not None:
        print("\n" + text)
    if args.out and result:
        write_to_directory(args.out, name, result)
    return status
