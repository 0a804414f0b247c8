"""The HTTP front end's state, shared by every route: the engine handle, the tokenizer and the compile threads,
limits, admission, metrics and the jobs in flight.

One object, so that a route (``lmport.server.routes``) is a straight sequence of steps over it and shutdown
(``lmport.server.shutdown``) finds every job in one place.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from fastapi import Request
from prometheus_client import Gauge

from lmport.config import ConfigError, GenerationConfig
from lmport.engine.outputs import check_prompt
from lmport.engine.client import EngineHandle
from lmport.multimodal.images import ImageLimits
from lmport.multimodal import loading
from lmport.multimodal.processor import ImageProcessor
from lmport.structured_output.grammar import Grammars
from lmport.reasoning import Parser, Reasoning
from lmport.server import access_log, adapters, jsonbody
from lmport.server.limits import Admission, Limits
from lmport.server.metrics import Metrics
from lmport.server.protocol import APIError, brief

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 2 * 2**20   # a request body's bytes besides its images (a model that takes images adds theirs)


@dataclass
class Job:
    """One HTTP generation request: its prompts and one GenerationConfig per choice."""
    id: str
    created: int
    prompts: list[list[int]]
    configs: list[GenerationConfig]   # len(prompts) * n, choice index = prompt index * n + sample index
    n: int
    received: float                   # perf_counter() when the request arrived, for time to first token
    # The start of every chunk and answer of a chat or text completion (shapes.ChatHeader, .CompletionHeader).
    header: Mapping[str, object] = field(default_factory=dict)
    include_usage: bool = False       # stream_options.include_usage: a last chunk with usage
    continuous_usage: bool = False    # stream_options.continuous_usage_stats (vLLM's): usage on every chunk
    release: object = None            # gives its engine requests back to Admission (idempotent)
    cache_salt: str | None = None     # prefix-cache isolation: the request's cache_salt and/or its API key's
    adapter: str | None = None        # the LoRA adapter its model names (lmport.server.adapters), None: the base
    images: list | None = None        # its prompt's images (lmport.multimodal.inputs.ImageInput), None: none

    def stream_usage(self, options) -> None:
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(options.continuous_usage_stats)

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]


class Frontend:
    def __init__(self, core: EngineHandle, tokenizer, grammars: Grammars, model_name: str | None = None,
                 api_key: str | list[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 limits: Limits | None = None, cache_salt_by_api_key: bool = False,
                 expose_adapter_paths: bool = False, image_limits: ImageLimits | None = None):
        """``core``: what runs the requests, an engine core's client or, with data-parallel replicas, their front
        end (``lmport.dp.frontend.DataParallel``); ``tokenizer``: the front end's own (tokenizing and chat
        templates run here, never in the core); ``grammars``: compiles structured-output formats to check them
        before a request is queued; ``image_limits``: what a request may send of images (docs/vision.md)."""
        self.core = core
        self.info = info = core.info
        self.grammars = grammars
        self.model_name = model_name or info.model_name
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        if any(not k.strip() for k in keys):
            raise ConfigError("the API key is empty: give a key, or leave it out to serve without one")
        self.api_keys = tuple(keys)   # any of them is accepted
        self.api_key = keys[0] if keys else None
        # Prefix-cache blocks are shared only between requests sent with the same key (and cache_salt).
        self.cache_salt_by_api_key = cache_salt_by_api_key
        self.text_body_bytes = max_body_bytes
        self.image_limits = image_limits or ImageLimits()
        self.takes_images = loading.takes_images(info.model_name, info.mmproj)
        self.expose_adapter_paths = expose_adapter_paths   # clients see adapters' server paths
        self.limits = limits or Limits()
        self.max_prompt_chars = self.limits.prompt_chars(info.session_len)
        self.admission = Admission(info.max_batch_size + self.limits.waiting(info.max_batch_size))
        # Tokenizing and chat templates run in this one worker thread (in order), never in the event loop.
        self.tokenizer = tokenizer
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="lmport-tokenize")
        # Grammar compiles (structured outputs, forced tool calls), off the event loop (lmport.server.structured).
        self.compile_pool = ThreadPoolExecutor(2, thread_name_prefix="lmport-compile")
        # /metrics reads what the engine core publishes after each step: a scrape never waits for a step.
        self.metrics = Metrics(lambda: self.core.snapshot)
        Gauge("lmport_requests_admitted", "Engine requests admitted by the server and not yet finished",
              registry=self.metrics.registry).set_function(lambda: self.admission.active)
        self.created = int(time.time())
        # Identifies the configuration answering (OpenAI's system_fingerprint): lmport's version and the engine's
        # settings that change outputs.
        self.fingerprint = "fp_lmport_" + hashlib.sha256(repr((
            lmport_version(), self.model_name, info.device_type, info.dtype,
            info.quant_policy, info.kv_cache_dtype)).encode()).hexdigest()[:12]
        self.live: set[asyncio.Queue] = set()   # the output queues of jobs in flight (see abort_all)

    # The chat format (lmport.server.app.create_app sets them): the reasoning parser, the tool-call format.
    reasoning_parser: Parser | None = None
    tool_parser: str | None = None

    _image_processor: tuple[ImageProcessor | None] | None = None

    def image_processor(self) -> ImageProcessor | None:
        """The model's image processor (loaded at the first request with images; call it on the tokenize thread),
        None for a model that takes no images."""
        if self._image_processor is None:
            self._image_processor = (loading.image_processor(self.info.model_name, self.info.mmproj),)
        return self._image_processor[0]

    @property
    def max_body_bytes(self) -> int:
        """The request body's limit: the text allowance, and for a model that takes images as many images as a
        request may send at the per-image limit, in base64 (so an image under that limit meets the per-image check,
        not the body's)."""
        return self.text_body_bytes + (self.image_limits.body_bytes() if self.takes_images else 0)

    def reasoning_of(self, prompt: str) -> Reasoning | None:
        """Where a reply to the rendered chat ``prompt`` thinks, or None without a reasoning parser."""
        parser = self.reasoning_parser
        return None if parser is None else Reasoning(parser, parser.starts_inside(prompt))

    def engine_problem(self) -> str | None:
        """Why no request can be served now, or None."""
        return self.core.problem()

    def check_prompt(self, prompt_ids) -> None:
        """RequestError when the engine cannot take these prompt token ids."""
        check_prompt(prompt_ids, self.info.vocab_size, self.info.session_len)

    async def tokenize(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def admit(self, job: Job) -> None:
        problem = self.engine_problem()
        if problem is not None:
            raise APIError(503, f"the server cannot generate: {problem}", type="server_error", code="engine_stopped")
        job.release = self.admission.admit(len(job.configs))
        access_log.note_prompts(job.prompts)

    def abort_all(self, error: APIError) -> None:
        """End every job in flight with ``error`` (streams: a final error event and [DONE])."""
        for queue in list(self.live):
            queue.put_nowait((None, error))

    async def drain(self, timeout: float) -> None:
        """Shutdown: admit nothing more, give jobs in flight ``timeout`` seconds, then abort the rest."""
        self.admission.closed = "the server is shutting down; retry on another instance or after the restart"
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live:
            log.warning("aborting %d request(s) still running after the %.0f s shutdown timeout",
                        len(self.live), timeout)
            self.abort_all(APIError(503, "the server is shutting down: the request was aborted",
                                    type="server_error", code="shutting_down"))

    # -- request parsing ------------------------------------------------------------------------
    async def parse(self, request: Request, cls):
        """Read the body and validate it into ``cls``; lmport.server.bodies bounds the read (413, 408)."""
        body = await request.body()
        req = jsonbody.validate(cls, body)   # with the JSON depth limit, as on every route
        adapters.adapter_for(self, req.model)   # the base model or a loaded LoRA adapter, else a 404
        for problem in (req.unknown_field_problem(), req.unsupported_problem(), req.stop_problem()):
            if problem is not None:
                raise problem
        vocab = self.info.vocab_size
        req.token_bias(vocab)
        if req.top_k > vocab:
            raise APIError(400, f"top_k: {brief(req.top_k)} is more than the vocabulary ({vocab} tokens); give "
                                f"at most {vocab}, or 0 for no top-k", param="top_k")
        return req

    def job(self, prompts: list[list[int]], configs: list[GenerationConfig], n: int, received: float, *,
            model: str, cache_salt: str | None = None, key: str | None = None) -> Job:
        """A job of checked prompts and their configs (``n`` a prompt); ``model`` names the base model or an
        adapter, ``key`` is the API key the request came with (for the prefix-cache salt)."""
        job = Job(uuid.uuid4().hex, int(time.time()), prompts, configs, n, received)
        job.cache_salt = self.cache_salt(cache_salt, key)
        job.adapter = adapters.adapter_for(self, model)
        return job

    def cache_salt(self, salt: str | None, key: str | None) -> str | None:
        """The prefix-cache salt: the request's ``cache_salt``, under a digest of its API key when the server
        salts by key (so one key's requests can never hit, or time, another key's cached prefixes)."""
        if not self.cache_salt_by_api_key or key is None:
            return salt
        digest = hashlib.sha256(b"lmport-cache-salt:" + key.encode()).hexdigest()[:32]
        return digest if salt is None else f"{digest}:{salt}"


def lmport_version() -> str:
    try:
        return version("lmport")
    except PackageNotFoundError:
        return "unknown"
