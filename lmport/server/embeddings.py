"""POST /v1/embeddings (OpenAI's shape; docs/embeddings.md).

Each input becomes one engine request with a pooling task: it is prefilled in the same steps as the
generation requests (paged, chunked, batched), generates nothing, and its blocks are freed as soon as its
last position is computed. The engine returns the pooled hidden state; the model's pooling configuration
(lmport.engine.pooling) says mean or last token and whether to L2-normalize. ``encoding_format`` "base64" is the
little-endian float32 bytes, as OpenAI's clients decode them.
"""
from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import ConfigDict

from lmport.config import GenerationConfig
from lmport.engine.outputs import RequestError
from lmport.engine.messages import EngineRequest
from lmport.engine.pooling import PoolingConfig, finish, pooling_config
from lmport.server.protocol import APIError, Unimplemented, _Request, bounded_int, brief
from lmport.server import jsonbody, streaming
from lmport.server.auth import AUTH
from lmport.server.frontend import Job
from lmport.server.shapes import Embedding, EmbeddingList

Input = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Request):
    model_config = ConfigDict(extra="allow")
    ROUTE = "/v1/embeddings"
    # vLLM's embedding fields that change the vectors (normalize is checked against the model's pooling).
    UNIMPLEMENTED = {
        "truncate_prompt_tokens": Unimplemented("vLLM's input truncation", fix="shorten the input"),
        "add_special_tokens": Unimplemented("leaving out the tokenizer's special tokens", harmless=(True,)),
        "embed_dtype": Unimplemented("vLLM's embedding dtypes", harmless=("float32",),
                                     fix="leave it out (float32, or encoding_format base64 for its bytes)"),
    }
    input: Input
    model: str
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = bounded_int(None, ge=1)
    user: str | None = None
    normalize: bool | None = None   # vLLM's: must be what the model's pooling does


def _inputs(value: Input) -> list:
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


async def embed(frontend, pooling: PoolingConfig, request: Request):
    received = time.perf_counter()
    req = await jsonbody.read(request, EmbeddingRequest)
    if req.model != frontend.model_name:
        raise APIError(404, f"model: {brief(req.model)} does not exist for embeddings; this server embeds with "
                            f"{frontend.model_name!r} (LoRA adapters do not embed)", param="model",
                       code="model_not_found")
    if (problem := req.unknown_field_problem()) is not None:
        raise problem
    if req.normalize is not None and req.normalize != pooling.normalize:
        raise APIError(400, f"normalize: this model's embeddings are {'' if pooling.normalize else 'not '}"
                            f"L2-normalized, as its sentence-transformers configuration says; leave normalize out",
                       param="normalize")
    width = frontend.info.hidden_size
    if req.dimensions is not None and req.dimensions != width:
        raise APIError(400, f"dimensions: {req.dimensions} is not supported; this model's embeddings have {width} "
                            f"dimensions and are not truncated (leave dimensions out)", param="dimensions")
    inputs = _inputs(req.input)
    if not inputs:
        raise APIError(400, "input: the list is empty; give a string, strings or token ids", param="input")
    if len(inputs) > frontend.limits.max_engine_requests:
        raise APIError(400, f"input: {len(inputs)} inputs; the server embeds at most "
                            f"{frontend.limits.max_engine_requests} per request (--max-engine-requests-per-request)",
                       param="input")
    for text in inputs:
        if isinstance(text, str) and len(text) > frontend.max_prompt_chars:
            raise APIError(400, f"input: {len(text)} characters is longer than the server's limit of "
                                f"{frontend.max_prompt_chars}", param="input", code="context_length_exceeded")
    prompts = await frontend.tokenize(lambda: [frontend.tokenizer.encode(t) if isinstance(t, str) else list(t)
                                               for t in inputs])
    for i, ids in enumerate(prompts):
        try:
            frontend.check_prompt(ids)
        except RequestError as exc:
            code = "context_length_exceeded" if len(ids) >= frontend.info.session_len else None
            raise APIError(400, f"input.{i}: {exc}", param="input", code=code) from None
    job = Job(uuid.uuid4().hex, int(time.time()), prompts, [GenerationConfig(max_new_tokens=1)] * len(prompts), 1,
              received)
    frontend.admit(job)
    try:
        vectors = await streaming.unless_gone(request, _run(frontend, job, pooling.mode))
    finally:
        job.release()
    if vectors is None:   # the client went away; its requests were aborted
        return None
    data: list[Embedding] = []
    for i, vector in enumerate(vectors):
        vector = finish(vector, pooling)
        encoded = (base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
                   if req.encoding_format == "base64" else vector)
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    tokens = sum(len(p) for p in prompts)
    answer: EmbeddingList = {"object": "list", "data": data, "model": req.model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return answer


async def _run(frontend, job: Job, mode: str) -> list[list[float]]:
    async def one(i: int, ids: list[int]) -> list[float]:
        request = EngineRequest(f"emb-{job.id}-{i}", ids, job.configs[i], pooling=mode)
        async for out in frontend.core.generate(request):
            if out.finished:
                if out.embedding is None:
                    raise APIError(500, f"input.{i}: embedding failed: {out.error or out.finish_reason}",
                                   type="server_error")
                return out.embedding
        raise APIError(500, f"input.{i}: the engine ended the request without an embedding", type="server_error")

    return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(job.prompts))))


def model_pooling(frontend) -> PoolingConfig:
    """How this server's model pools an embedding, read once at start (the app keeps it as ``state.pooling``)."""
    from lmport.models.loader import resolve_model_path   # here only: the front end imports no model code
    return pooling_config(resolve_model_path(frontend.info.model_name))


router = APIRouter(dependencies=AUTH)


@router.post("/v1/embeddings")
async def embeddings_route(request: Request):
    return await embed(request.app.state.frontend, request.app.state.pooling, request)
