"""`lmport serve`: an OpenAI-compatible HTTP API over one engine core (FastAPI + uvicorn).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(``stream: true`` gives server-sent events ending in ``data: [DONE]``),
Anthropic's POST /v1/messages and /v1/messages/count_tokens (``lmport.server.anthropic``),
OpenAI's POST /v1/responses and /v1/responses/input_tokens (``lmport.server.responses``),
GET /health (never needs the API key) and GET /metrics (Prometheus).

The engine core runs in its own process under `lmport serve` (``lmport.engine.core_process``), joined to this
front end by a request queue and an output queue (``lmport.engine.client``); tests may run it in a thread
over an engine core they built. Each HTTP request becomes one engine request per choice (``n``). A client that
goes away, streaming or not, aborts its engine requests, which frees their KV blocks at once. Bad input is
refused before anything is queued, with an OpenAI-style error that names the field; see docs/server.md. The
completion routes are in ``lmport.server.routes``; each request's access-log line is written by
``lmport.server.access_log``.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import sys
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmport.config import ConfigError
from lmport.engine.client import EngineClient, EngineHandle
from lmport.multimodal.images import ImageLimits
from lmport.structured_output.grammar import Grammars
from lmport.server import adapters, embeddings, tokenize
from lmport.server import anthropic, chat_format, responses, routes, service
from lmport.server import access_log
from lmport.server.bodies import BodyLimit
from lmport.server.guards import Guards
from lmport.server.limits import Limits
from lmport.server.metrics import ReplicaCollector
from lmport.server.protocol import APIError, brief
from lmport.server.quiet_log import Throttled
from lmport.server.shapes import AnthropicError, ErrorResponse
from lmport.server.frontend import MAX_BODY_BYTES, Frontend

if TYPE_CHECKING:
    from lmport.engine.core import EngineCore
    from lmport.engine.llm import LLM

log = logging.getLogger(__name__)

HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed"}


def create_app(engine: EngineCore | LLM | EngineHandle, model_name: str | None = None,
               api_key: str | list[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               limits: Limits | None = None, allowed_hosts: set[str] | None = None,
               cors_origins: list[str] | None = None,
               docs: bool = True, cache_salt_by_api_key: bool = False, enable_lora_loading: bool = False,
               tokenizer=None, expose_adapter_paths: bool = False, chat_template: str | None = None,
               reasoning_parser: str | None = None, tool_call_parser: str | None = None,
               access_log_format: str | None = "plain", image_limits: ImageLimits | None = None) -> FastAPI:
    """The app; wrapped in the cross-site Guards when ``allowed_hosts`` (Host names) is given, and in CORS
    for ``cors_origins``. The returned object is the FastAPI app either way (``app.state.frontend``).
    ``engine``: what runs the requests, already started (an engine core's client, or data-parallel replicas'
    front end, ``lmport.dp.frontend.DataParallel``, whose replicas /health and /metrics then report; with
    either, ``tokenizer`` is the model's), or an engine core (or an in-process LLM: its core), which then runs
    in a thread of this process.
    ``api_key``: one key or several (any is accepted); ``cache_salt_by_api_key``: prefix-cache blocks are
    shared only between requests sent with the same key; ``enable_lora_loading``: the LoRA load/unload routes
    answer (lmport.server.adapters); ``expose_adapter_paths``: clients see adapters' server paths and why one
    failed to load (else only the server's log does); ``access_log_format``: "plain" or "json" lines on the
    ``lmport.access`` logger (lmport.server.access_log), None for none; ``image_limits``: what a request may send of
    images, and the hosts image URLs are fetched from (docs/vision.md): for a model that takes images, the body
    limit grows by the images' allowance."""
    if hasattr(engine, "step"):   # an engine core (or an LLM over one), not a handle on one already started
        # A private tokenizer: the engine's is used on the core's thread, the client's copy on its reader thread.
        core, tokenizer, grammars = EngineClient.start_thread(engine), copy.deepcopy(engine.tokenizer), engine.grammars
    else:
        if tokenizer is None:
            raise TypeError("create_app: give the model's tokenizer with an engine core client")
        core = engine
        grammars = Grammars(tokenizer, core.info.vocab_size, core.info.eos_token_ids)
    frontend = Frontend(core, tokenizer, grammars, model_name, api_key, max_body_bytes, limits, cache_salt_by_api_key,
                        expose_adapter_paths, image_limits)
    # The chat template, reasoning parser and tool-call format (lmport.server.chat_format): given, or the template's.
    chat = chat_format.configure(frontend.tokenizer, chat_template, reasoning_parser, tool_call_parser)
    frontend.reasoning_parser, frontend.tool_parser = chat.reasoning_parser, chat.tool_parser
    replicas = getattr(core, "status", None)   # data-parallel replicas, each with its health and usage
    if replicas is not None:
        frontend.metrics.registry.register(ReplicaCollector(replicas))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        frontend.core.shutdown()
        frontend.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        frontend.compile_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="lmport", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # What the routes read (each route module's APIRouter takes the front end from the request's app).
    app.state.frontend, app.state.chat, app.state.replicas = frontend, chat, replicas
    app.state.pooling, app.state.lora_loading = embeddings.model_pooling(frontend), enable_lora_loading
    app.state.faults = Throttled(log)   # a fault a client can repeat at will must not flood the log
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(Exception, unexpected_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for router in (service.health_router, service.router, *([service.docs_router] if docs else []), routes.router,
                   anthropic.router, responses.router, embeddings.router, adapters.router, tokenize.router):
        app.include_router(router)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    # Every body read bounded in bytes and time (413, 408), whichever route reads it.
    app.add_middleware(BodyLimit, max_bytes=lambda: frontend.max_body_bytes, timeout=frontend.limits.body_timeout)
    app.add_middleware(Guards, allowed_hosts=allowed_hosts, error_body=error_body,
                       json_paths=frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                             "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/responses",
                                             "/v1/responses/input_tokens", "/tokenize", "/detokenize",
                                             *anthropic.PATHS}))
    if access_log_format is not None:   # outermost: it times and logs every answer, refusals included
        app.add_middleware(access_log.AccessLog, fmt=access_log_format)
    return app


async def api_error(request: Request, exc: APIError):
    request.app.state.frontend.metrics.rejected.labels(str(exc.status)).inc()
    return JSONResponse(error_body(request.url.path, exc), status_code=exc.status, headers=exc.headers)


async def unexpected_error(request: Request, exc: Exception):
    # A bug must still answer in OpenAI's shape (JSON, not Starlette's plain text), and leave a traceback.
    request.app.state.faults.log(logging.ERROR, type(exc).__name__, "%s %s failed", request.method,
                                 request.url.path[:100], exc_info=exc)
    return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {brief(str(exc), 200)}",
                                             type="server_error", code="internal_error"))


async def http_error(request: Request, exc: StarletteHTTPException):
    # 405 keeps Starlette's Allow header (RFC 9110); the code is a name, as in every other error.
    code = HTTP_ERROR_CODES.get(exc.status_code, "_".join(str(exc.detail).lower().split()) or None)
    path = request.url.path if len(request.url.path) <= 100 else request.url.path[:97] + "..."
    return await api_error(request, APIError(exc.status_code, f"{request.method} {path}: {exc.detail}",
                                             code=code, headers=exc.headers))


def error_body(path: str, exc: APIError) -> ErrorResponse | AnthropicError:
    """An error in the shape of the API the route belongs to: Anthropic's on its routes, else OpenAI's."""
    return anthropic.error_body(exc) if path in anthropic.PATHS else exc.body()


def serve(args) -> int:
    """`lmport serve MODEL` with the server flags (see docs/server.md) and every EngineConfig flag."""
    import uvicorn

    from lmport.entrypoints.flags import engine_config
    from lmport.models.loader import load_tokenizer
    from lmport.server.connections import ConnectionLimits
    from lmport.server.guards import allowed_host_names, is_loopback
    from lmport.server.listen import ADDRESS_IN_USE_EXIT_CODE, AddressInUse, listen
    from lmport.server.shutdown import GracefulServer
    from lmport.units import parse_bytes

    access_log_format = args.access_log_format if args.access_log else None
    access_log.configure(access_log_format)   # its lines go to stderr whatever --log-level says
    api_key = args.api_key if args.api_key is not None else os.environ.get("LMPORT_API_KEY")
    if isinstance(api_key, str):
        api_key = [api_key]
    if api_key is not None and any(not key.strip() for key in api_key):
        raise ConfigError("the API key is empty (--api-key or LMPORT_API_KEY): give a key, or leave both out "
                          "to serve without one")
    if args.cache_salt_by_api_key and not api_key:
        raise ConfigError("--cache-salt-by-api-key needs --api-key (or LMPORT_API_KEY)")
    limits = Limits(max_engine_requests=args.max_engine_requests_per_request, max_prompt_chars=args.max_prompt_chars,
                    max_answer_entries=args.max_answer_entries,
                    max_waiting_requests=args.max_waiting_requests, request_timeout=args.request_timeout,
                    body_timeout=args.body_timeout, send_timeout=args.send_timeout,
                    engine_stall_timeout=args.engine_stall_timeout)
    image_limits = ImageLimits(max_bytes=parse_bytes(args.max_image_bytes, "--max-image-bytes"),
                               max_pixels=args.max_image_pixels, max_images=args.max_images_per_request,
                               allowed_media_domains=frozenset(args.allowed_media_domains or ()),
                               fetch_timeout=args.image_fetch_timeout)
    connections = ConnectionLimits(header_timeout=args.header_timeout, keep_alive_timeout=args.keep_alive_timeout,
                                   max_connections=args.max_connections, max_unsent_bytes=args.max_unsent_bytes,
                                   send_timeout=args.send_timeout,
                                   max_connections_per_address=args.max_connections_per_address)
    if args.dp < 1:
        raise ConfigError(f"--dp must be >= 1 (engine replicas), got {args.dp}")
    loras = adapters.parse_loras(args.lora)
    # The chat format's flags checked before the model loads (a template file that cannot be read, a typo).
    chat_template = chat_format.load_template(args.chat_template)
    settings = engine_config(args)
    settings = dataclasses.replace(settings, max_loras=adapters.max_loras_for(settings.max_loras, loras,
                                                                              args.enable_lora_loading))
    # The port first: one already taken is reported at once, not after the model has loaded.
    try:
        sock = listen(args.host, args.port)
    except AddressInUse as exc:
        print(f"lmport serve: {exc}", file=sys.stderr, flush=True)
        return ADDRESS_IN_USE_EXIT_CODE
    # The engine core in its own process (started first, before this process starts a thread), or data-parallel
    # replicas as Ray actors behind a routing front end (docs/distributed.md); the tokenizer here.
    core: EngineHandle
    if args.dp > 1:
        if settings.max_loras:
            raise ConfigError("LoRA adapters (--lora, --enable-lora-loading) run with --dp 1 only")
        from lmport.dp import cluster
        tokenizer = load_tokenizer(args.model)
        core = cluster.start(args.model, settings, args.dp, policy=args.dp_routing,
                             balance_threshold=args.dp_balance_threshold)
        where = f"KV blocks on each of {args.dp} replicas ({args.dp_routing} routing)"
    else:
        core = EngineClient.start_process(args.model, settings, loras)
        tokenizer = core.tokenizer   # loaded while the core loaded the model
        where = "KV blocks"
    try:
        app = create_app(core, model_name=args.model, api_key=api_key, limits=limits,
                         allowed_hosts=allowed_host_names(args.host, args.allowed_hosts),
                         cors_origins=args.cors_origins, docs=args.docs,
                         cache_salt_by_api_key=args.cache_salt_by_api_key,
                         enable_lora_loading=args.enable_lora_loading, tokenizer=tokenizer,
                         expose_adapter_paths=args.expose_adapter_paths, access_log_format=access_log_format,
                         chat_template=chat_template, reasoning_parser=args.reasoning_parser,
                         tool_call_parser=args.tool_call_parser, image_limits=image_limits)
    except BaseException:
        core.shutdown()
        raise
    if args.enable_lora_loading and api_key is None:
        log.warning("--enable-lora-loading without an API key: anyone who can reach the server can make it read "
                    "adapter directories on this machine")
    if not is_loopback(args.host) and api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach it can use it", args.host)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=logging.getLevelName(
        logging.getLogger().level).lower(), **connections.uvicorn_kwargs())
    # Listening since before the model loaded; the line below names the port bound (--port 0: one the OS picks):
    # a client that reads it may connect at once, and is answered once uvicorn starts.
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"lmport serve: {args.model} on http://{host}:{sock.getsockname()[1]} (session_len "
          f"{core.info.session_len}, {core.info.num_blocks} {where}){'; API key required' if api_key else ''}",
          file=sys.stderr, flush=True)
    server = GracefulServer(config, app.state.frontend, shutdown_timeout=args.shutdown_timeout,
                            exit_on_engine_failure=args.exit_on_engine_failure)
    server.run(sockets=[sock])
    return server.exit_code
