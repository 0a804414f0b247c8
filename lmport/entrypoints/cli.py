"""The `lmport` command: one entry point, a subcommand per task.

Every EngineConfig and GenerationConfig field is a flag (``--quant-policy``,
``--max-new-tokens``, ...), generated from the dataclasses by ``lmport.entrypoints.flags``.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from lmport.platform import registry
from lmport.config import SERVE_DECODE_PREFILL_TOKENS, EngineConfig, GenerationConfig
from lmport.errors import ConfigError
from lmport.multimodal.images import ImageLimits
from lmport.entrypoints.flags import add_dataclass_flags, engine_config, gen_config
from lmport.reasoning import NAMES as REASONING_PARSERS
from lmport.tool_parsers import NAMES as TOOL_PARSERS
from lmport.units import parse_bytes


def cmd_backends(args) -> int:
    rows = [("backend", "available", "quant policies", "weight formats", "block size", "torch device", "dist",
             "origin")]
    reasons = []
    for r in registry.describe_backends():
        caps = r.capabilities
        rows.append((
            r.name, "yes" if r.probe.available else "no",
            caps.kv_policies_text() if caps else "-",
            caps.weight_formats_text() if caps else "-",
            f"{caps.block_size_rule()} (default {caps.default_block_size})" if caps else "-",
            caps.torch_device if caps else "-", caps.dist_backend if caps else "-", r.origin))
        reasons.append(f"  {r.name}: {r.probe.reason}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("\nwhy:")
    print("\n".join(reasons))
    return 0


def cmd_generate(args) -> int:
    import lmport
    cfg = gen_config(args)
    with lmport.pipeline(args.model, backend_config=engine_config(args)) as pipe:
        if args.raw:
            response = pipe.generate([pipe.tokenizer.encode(args.prompt)], cfg)[0]
        else:
            response = pipe(args.prompt, cfg)
    if response.error:
        print(f"error: {response.error}", file=sys.stderr)
        return 1
    print(response.text)
    print(f"[{response.input_token_len} prompt tokens, {response.generate_token_len} generated, "
          f"finish: {response.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from lmport.entrypoints.chat import chat
    return chat(args)


def cmd_serve(args) -> int:
    from lmport.server.app import serve
    return serve(args)


def cmd_plan(args) -> int:
    from lmport.models.loader import ModelNotFound
    from lmport.memory.plan import build_plan
    from lmport.memory.plan_format import format_plan
    device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    try:
        report = build_plan(args.model, engine_config(args), device_memory, dp=args.dp)
    except ModelNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    return 2 if report["error"] else 0


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    """`lmport serve`'s limits, timeouts and cross-site settings (docs/server.md)."""
    g = p.add_argument_group("limits")
    g.add_argument("--max-engine-requests-per-request", type=int, default=256, metavar="N",
                   help="most generations (prompts x n) one HTTP request may start (default: 256)")
    g.add_argument("--max-answer-entries", type=int, default=2**20, metavar="N",
                   help="largest non-streamed answer, in token entries: choices x max_tokens x (1 + top logprobs); "
                        "a request that could go beyond gets 400 (stream it instead) (default: 1048576)")
    g.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help="longest prompt in characters, checked before tokenizing (default: 16 x session_len)")
    g.add_argument("--max-waiting-requests", type=int, default=None, metavar="N",
                   help="engine requests queued beyond the running batch; more get 503 + Retry-After "
                        "(default: 4 x max_batch_size)")
    g.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a request not finished this long after it arrived (default: none)")
    g.add_argument("--engine-stall-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="/health answers 503 while the engine core has had requests pending and finished no step "
                        "for this long (default: 10)")
    g.add_argument("--cache-salt-by-api-key", action="store_true",
                   help="share prefix-cache blocks only between requests sent with the same API key")
    g = p.add_argument_group("connections")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="close a connection whose request headers are incomplete after this long (default: 10)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="answer 408 when a request body takes longer than this to arrive (default: 30)")
    g.add_argument("--send-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="close a stream whose client has not taken a write for this long, or has left more than "
                        "--max-unsent-bytes untaken this long (default: 30)")
    g.add_argument("--max-unsent-bytes", type=int, default=2**20, metavar="N",
                   help="output written and not yet taken by the client beyond which --send-timeout runs "
                        "(default: 1048576)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="close idle keep-alive connections after this long (default: 5)")
    g.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="open connections beyond which new ones get 503 (default: 1024)")
    g.add_argument("--max-connections-per-address", type=int, default=256, metavar="N",
                   help="open connections one client address may hold; beyond it (or --max-connections) the oldest "
                        "one without a running request is closed (default: 256; 0: no cap)")
    g = p.add_argument_group("lifecycle")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, let in-flight requests finish for this long, then abort them "
                        "(default: 30)")
    g.add_argument("--exit-on-engine-failure", action=argparse.BooleanOptionalAction, default=True,
                   help="exit non-zero when the engine thread stops, for a supervisor to restart (default: on)")
    g = p.add_argument_group("data parallelism (docs/distributed.md)")
    g.add_argument("--dp", type=int, default=1, metavar="N",
                   help="engine replicas, each with --tp ranks, as Ray actors behind one front end (default: 1, "
                        "one engine in this process; > 1 needs `pip install 'lmport[ray]'`)")
    g.add_argument("--dp-routing", choices=("prefix", "round_robin"), default="prefix",
                   help="prefix: a request goes to the replica that got its first blocks before, else to the "
                        "least loaded; round_robin: in turn (default: prefix)")
    g.add_argument("--dp-balance-threshold", type=int, default=16, metavar="N",
                   help="leave prefix affinity when that replica has N more requests in flight than the least "
                        "loaded one (default: 16)")
    g = p.add_argument_group("cross-site")
    g.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                   help="Host header names to accept besides the bound address and localhost (always checked "
                        "on loopback; '*' accepts any)")
    g.add_argument("--cors-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="origins browsers may call the API from (default: none)")
    g.add_argument("--docs", action=argparse.BooleanOptionalAction, default=True,
                   help="serve /docs, /redoc and /openapi.json (behind the API key when one is set)")
    g = p.add_argument_group("logging")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="one stderr line per request: method, route, status, latency, tokens in/out, request id, "
                        "client address; never prompt text (default: on; --no-access-log turns it off)")
    g.add_argument("--access-log-format", choices=("plain", "json"), default="plain",
                   help="plain text, or one JSON object a line (default: plain)")
    g = p.add_argument_group("chat format (docs/server.md)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template's text) to use instead of the model's; "
                        "a model without one needs it for chat requests")
    g.add_argument("--reasoning-parser", default=None, choices=(*REASONING_PARSERS, "none"),
                   help="how the reply's thinking is told apart from its answer (default: from the chat template; "
                        "none: no separation)")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="the format tool calls are taught and parsed in (default: from the chat template)")
    g = p.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument("--lora", nargs="+", default=[], metavar="NAME=PATH",
                   help="peft adapter directories to serve from the start, each chosen by requests whose model is "
                        "NAME (max_loras defaults to their number)")
    g.add_argument("--enable-lora-loading", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read paths on this "
                        "machine: use with --api-key; max_loras defaults to at least 1)")
    g.add_argument("--expose-adapter-paths", action="store_true",
                   help="show clients adapters' server paths (in /v1/models) and why an adapter failed to load "
                        "(default: only the server's log does)")
    limits = ImageLimits()
    g = p.add_argument_group("images, for a model that takes them (docs/vision.md)")
    g.add_argument("--max-images-per-request", type=int, default=limits.max_images, metavar="N",
                   help=f"most images one request may send (vLLM: --limit-mm-per-prompt '{{\"image\": N}}') "
                        f"(default: {limits.max_images})")
    g.add_argument("--max-image-bytes", default="10MiB", metavar="SIZE",
                   help="largest encoded image (before base64), e.g. 10MiB or a byte count; the request body's "
                        "limit grows by --max-images-per-request of these (default: 10MiB)")
    g.add_argument("--max-image-pixels", type=int, default=limits.max_pixels, metavar="N",
                   help=f"most pixels (width x height) of one image, read from its header before it is decoded "
                        f"(default: {limits.max_pixels}, 4096 x 4096)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="host names whose http(s) image URLs the server fetches (exact names, any port; redirects "
                        "must stay among them) (default: none, image URLs are refused: send data: URLs)")
    g.add_argument("--image-fetch-timeout", type=float, default=limits.fetch_timeout, metavar="SECONDS",
                   help=f"longest one image fetch may take (default: {limits.fetch_timeout:g})")


def cmd_worker(args) -> int:
    """This node's tensor-parallel ranks for an engine on node 0 (docs/distributed.md); runs until it stops."""
    import signal

    from lmport.executor.local import ranks_per_node, start_workers, stop_workers
    from lmport.models.loader import read_model_config
    from lmport.parallel import check_tp
    from lmport.platform.resolution import resolve_config
    config = resolve_config(engine_config(args))
    if config.node_rank == 0 or not config.dist_init_addr:
        raise ConfigError("`lmport worker` runs the ranks of nodes 1..nnodes-1: give --node-rank >= 1 and "
                          "--dist-init-addr HOST:PORT of node 0 (node 0 runs generate/chat/serve itself)")
    check_tp(read_model_config(args.model), config.tp)
    first = config.node_rank * ranks_per_node(config)
    procs = start_workers(args.model, config, config.backend_class(), config.dist_init_addr,
                          range(first, first + ranks_per_node(config)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        codes = [p.wait() for p in procs.values()]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        stop_workers(procs, grace=5.0)
    return max(codes, key=abs) if any(codes) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmport", description="A pluggable multi-device LLM inference engine")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list installed backends, their capabilities and availability")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("prompt")
    p.add_argument("--model", default="smollm2", help="smollm2, a local HF directory or a .gguf file")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt is plain text")
    add_dataclass_flags(p, EngineConfig, "engine")
    add_dataclass_flags(p, GenerationConfig, "generation")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive streaming chat, locally or with a server (--url)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--url", default=None, help="talk to a running `lmport serve` instead of loading the model")
    p.add_argument("--api-key", default=None)
    add_dataclass_flags(p, EngineConfig, "engine")
    add_dataclass_flags(p, GenerationConfig, "generation")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible API server")
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=23333)
    p.add_argument("--api-key", default=None, action="append",
                   help="require `Authorization: Bearer KEY` (or set LMPORT_API_KEY); repeat for several keys")
    _add_server_flags(p)
    add_dataclass_flags(p, EngineConfig, "engine")
    # A server sees the same system prompts and chat histories again and again: prefix caching is on unless
    # --no-enable-prefix-caching (docs/server.md, "Prefix caching by default"). Its clients watch each stream: a
    # step's prompt tokens are bounded so that none waits long between two tokens ("Steady streams").
    p.set_defaults(func=cmd_serve, **{"EngineConfig.enable_prefix_caching": True,
                                      "EngineConfig.decode_prefill_tokens": SERVE_DECODE_PREFILL_TOKENS})

    p = sub.add_parser("worker", help="the tensor-parallel ranks of one more node for an engine on node 0")
    p.add_argument("model", nargs="?", default="smollm2")
    add_dataclass_flags(p, EngineConfig, "engine")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("plan", help="memory plan for a model on a backend, without loading weights")
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--device-memory", default=None, help="plan for a device of this size, e.g. 24GiB")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dp", type=int, default=1, metavar="N",
                   help="plan N data-parallel replicas (each with --tp ranks and its own cache), as `serve --dp`")
    add_dataclass_flags(p, EngineConfig, "engine")
    p.set_defaults(func=cmd_plan)

    from lmport.bench.cli import add_parser as add_bench_parser
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
