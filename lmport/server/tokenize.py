"""POST /tokenize and POST /detokenize, in vLLM's shape (docs/server.md, "Tokenizing").

/tokenize takes a ``prompt`` (text; ``add_special_tokens`` true by default: the BOS / EOS the model's
tokenizer adds) or chat ``messages`` (rendered by the chat template as /v1/chat/completions renders them,
with ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` and ``tools``;
``add_special_tokens`` false by default, as the template writes its own), and answers ``{"tokens",
"count", "max_model_len", "token_strs"}`` (``token_strs``: each token's text, with ``return_token_strs``).
/detokenize takes ``tokens`` and answers ``{"prompt"}``: their text, special tokens included. The token ids
are the ones the completion routes generate from: the same tokenizer, for a GGUF llama.cpp's ids.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import ConfigDict

from lmport.server import adapters, jsonbody, routes
from lmport.server.auth import AUTH
from lmport.server.protocol import APIError, ChatCompletionRequest, ChatMessage, Unimplemented, _Request, brief
from lmport.server.shapes import DetokenizeResponse, TokenizeResponse


class TokenizeRequest(_Request):
    model_config = ConfigDict(extra="allow")
    ROUTE = "/tokenize"
    UNIMPLEMENTED = {
        "chat_template": Unimplemented("a chat template of the request's own"),
        "mm_processor_kwargs": Unimplemented("multimodal inputs"),
    }
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None        # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model_config = ConfigDict(extra="allow")
    ROUTE = "/detokenize"
    model: str | None = None
    tokens: list[int]


def _check_model(frontend, model: str | None) -> None:
    if model is not None:
        adapters.adapter_for(frontend, model)   # the base model or a loaded LoRA adapter (one tokenizer), else 404


def _with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """``ids`` with the BOS / EOS the tokenizer adds to a text (what it adds around an empty one)."""
    marks = tokenizer.encode("", add_special_tokens=True)
    bos = tokenizer.bos_token_id
    prefix = marks[:1] if bos is not None and marks[:1] == [bos] else []
    return prefix + ids + marks[len(prefix):]


async def tokenize(frontend, request: Request) -> TokenizeResponse:
    req = await jsonbody.read(request, TokenizeRequest)
    if (problem := req.unknown_field_problem()) is not None:
        raise problem
    _check_model(frontend, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either prompt (text) or messages (a chat), not both and not neither")
    tokenizer = frontend.tokenizer
    if req.prompt is not None:
        if len(req.prompt) > frontend.max_prompt_chars:
            raise APIError(400, f"prompt: {len(req.prompt)} characters is longer than the server's limit of "
                                f"{frontend.max_prompt_chars}", param="prompt", code="context_length_exceeded")
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await frontend.tokenize(lambda: tokenizer.encode(req.prompt, add_special_tokens=add))
    else:
        chat = ChatCompletionRequest(model=frontend.model_name, messages=req.messages or [], tools=req.tools,
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template_kwargs=req.chat_template_kwargs)
        ids = list((await routes.chat_prompt(frontend, chat)).ids)
        if req.add_special_tokens:
            ids = await frontend.tokenize(_with_special_tokens, tokenizer, ids)
    strs = await frontend.tokenize(tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": frontend.info.session_len, "tokens": ids, "token_strs": strs}


async def detokenize(frontend, request: Request) -> DetokenizeResponse:
    req = await jsonbody.read(request, DetokenizeRequest)
    if (problem := req.unknown_field_problem()) is not None:
        raise problem
    _check_model(frontend, req.model)
    vocab = frontend.info.vocab_size
    for i, token in enumerate(req.tokens):
        if not 0 <= token < vocab:
            raise APIError(400, f"tokens.{i}: {brief(token)} is not a token id of this model; give ids in "
                                f"[0, {vocab})", param=f"tokens.{i}")
    text = await frontend.tokenize(lambda: frontend.tokenizer.decode(req.tokens, skip_special_tokens=False))
    return {"prompt": text}


router = APIRouter(dependencies=AUTH)   # bodies and replies: lmport.server.openapi


@router.post("/tokenize")
async def tokenize_route(request: Request):
    return await tokenize(request.app.state.frontend, request)


@router.post("/detokenize")
async def detokenize_route(request: Request):
    return await detokenize(request.app.state.frontend, request)
