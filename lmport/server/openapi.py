"""The server's OpenAPI document: every route with its request body, its responses and their schemas.

The completion routes read their bodies themselves (size limit, body timeout, errors that name the
field), so FastAPI cannot see the request models; this module puts them, and the answers' shapes, into the
document. The answers' schemas are made from the TypedDicts the routes build their answers as
(``lmport.server.shapes``), so the document and the answers have one declaration. The ``model`` field lists
the one model this server serves, so a schema-driven client (or test generator) sends a name the server knows.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter

from lmport.structured_output.grammar import MAX_ENUM_VALUES
from lmport.server import shapes
from lmport.server.adapters import LoadLoraAdapter, UnloadLoraAdapter
from lmport.server.anthropic import CountTokensRequest, MessagesRequest
from lmport.server.embeddings import EmbeddingRequest
from lmport.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, ChatCompletionRequest, CompletionRequest
from lmport.server.responses import InputTokensRequest, ResponsesRequest
from lmport.server.tokenize import DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"


ERRORS = {
    400: "invalid request: the message names the field and the fix",
    401: "missing or wrong API key",
    404: "unknown model",
    408: "the request body did not arrive within --body-timeout",
    413: "the request body is larger than the server's limit",
    415: "the body is not application/json",
    421: "the Host header is not served here",
    403: "not allowed on this server (loading LoRA adapters is off)",
    409: "conflicts with the server's state (an adapter of that name is loaded, or in use)",
    500: "generation failed inside the engine for this request",
    503: "the server is busy (Retry-After), shutting down, or its engine has stopped",
    504: "not finished within --request-timeout",
}


def _stream(chunk: str) -> dict:
    """text/event-stream: OpenAPI before 3.2 has ``schema`` describe one event, as a client parses it."""
    return {"schema": {
        "type": "object", "required": ["data"],
        "description": "server-sent events: one `data: {chunk}` event per piece, an error object if the request "
                       "fails midway, then `data: [DONE]`",
        "properties": {
            "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
            "data": {"anyOf": [{"const": "[DONE]"}, {
                "type": "string", "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [{"$ref": REF.format(model=chunk)},
                                            {"$ref": REF.format(model="ErrorResponse")}]}}]}}}}


def _named_stream(event: str, error: str | None = None) -> dict:
    """text/event-stream of named events (``event: <type>``), as Anthropic's and the Responses API's streams."""
    data = {"$ref": REF.format(model=event)} if error is None else {
        "anyOf": [{"$ref": REF.format(model=event)}, {"$ref": REF.format(model=error)}]}
    return {"schema": {
        "type": "object", "required": ["event", "data"],
        "description": "server-sent events, each `event: <type>` with `data: {json}` whose `type` is the same",
        "properties": {"event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
                       "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": data}}}}


def _json(name: str) -> dict:
    return {"application/json": {"schema": {"$ref": REF.format(model=name)}}}


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": ERRORS[s], "content": _json("ErrorResponse")} for s in statuses}


def below(n: int) -> str:
    """A regex of the decimal numbers 0 .. n - 1, without leading zeros."""
    digits = str(n - 1)
    parts = [f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):   # numbers of len(digits) digits up to n - 1: a prefix, then a smaller digit
        low = "1" if i == 0 else "0"
        if int(d) > int(low):
            rest = len(digits) - i - 1
            parts.append(f"{digits[:i]}[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    parts.append(digits)
    return "^(0|" + "|".join(parts) + ")$"


# What the document names: the request models and the answers' shapes (with the shapes they hold).
DOCUMENTED = (ChatCompletionRequest, CompletionRequest, shapes.ErrorResponse, shapes.ModelCard, shapes.ModelList,
              shapes.Health, shapes.ChatCompletion, shapes.Completion, shapes.ChatCompletionChunk,
              shapes.CompletionChunk, MessagesRequest, CountTokensRequest, ResponsesRequest, shapes.AnthropicError,
              shapes.AnthropicMessage, shapes.MessageTokensCount, shapes.AnthropicStreamEvent, shapes.ResponseObject,
              shapes.ResponseStreamEvent, EmbeddingRequest, LoadLoraAdapter, UnloadLoraAdapter, TokenizeRequest,
              shapes.TokenizeResponse, DetokenizeRequest, shapes.DetokenizeResponse, InputTokensRequest,
              shapes.InputTokensCount, shapes.EmbeddingList, shapes.LoadedAdapter, shapes.UnloadedAdapter)


def build(app: FastAPI, model_name: str, api_key: bool, vocab: int) -> dict:
    """The OpenAPI document of ``app``."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="lmport's OpenAI-compatible API, Anthropic's Messages API and OpenAI's Responses API "
                                  "(docs/server.md)")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for documented in DOCUMENTED:
        schema = TypeAdapter(documented).json_schema(ref_template=REF)
        # Its name is its title: a model's or TypedDict's class name, or a union's Field(title=...).
        for name, definition in {**schema.pop("$defs", {}), schema["title"]: schema}.items():
            # One name, one schema: a request's model and an answer's may not share a name.
            if schemas.setdefault(name, definition) != definition:
                raise ValueError(f"two schemas are named {name}: rename one of the models")
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": [model_name], "description": "the served model (GET /v1/models)"}
        # What the routes check beyond the models' types (each a 400 naming the field).
        props["stop"]["anyOf"] = [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                                  {"type": "array", "maxItems": MAX_STOP_STRINGS,
                                   "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                                  {"type": "null"}]
        props["top_k"]["anyOf"][0]["maximum"] = vocab
        bias = props["logit_bias"]["anyOf"][0]
        bias["propertyNames"] = {"pattern": below(vocab)}
        # Refused unless absent (unsupported_problem): the document says so instead of offering any value.
        for name in ("functions", "function_call"):
            props[name] = {"type": "null", "description": "not supported; leave it out"}
        props["best_of"] = {"anyOf": [{"const": 1}, {"type": "null"}], "description": "only 1 (use n)"}
    schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] = 1
    # Only assistant messages carry tool_calls; a tool message names the call it answers.
    schemas["ChatMessage"]["anyOf"] = [
        {"properties": {"role": {"enum": ["system", "developer", "user"]}, "tool_calls": {"type": "null"}}},
        {"properties": {"role": {"const": "assistant"}}},
        {"properties": {"role": {"const": "tool"}, "tool_calls": {"type": "null"},
                        "tool_call_id": {"type": "string", "minLength": 1}},
         "required": ["tool_call_id"]}]
    props = schemas["CompletionRequest"]["properties"]
    token = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    props["prompt"]["anyOf"] = [{"type": "string", "minLength": 1},
                                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                                {"type": "array", "minItems": 1, "items": token},
                                {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                                                           "items": token}}]
    props["guided_grammar"]["anyOf"][0]["minLength"] = 1
    props["guided_choice"]["anyOf"][0].update(minItems=1, maxItems=MAX_ENUM_VALUES)
    props["guided_choice"]["anyOf"][0]["items"]["minLength"] = 1
    auth = (401,) if api_key else ()
    common = (*auth, 400, 404, 408, 413, 415, 421, 500, 503, 504)
    paths = doc["paths"]
    for path, request, response in (("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion"),
                                    ("/v1/completions", "CompletionRequest", "Completion")):
        op = paths[path]["post"]
        op["requestBody"] = {"required": True, "content": _json(request)}
        op["responses"] = {"200": {"description": "the completion, or with stream: true its chunks as events",
                                   "content": {**_json(response), "text/event-stream": _stream(response + "Chunk")}},
                           **_errors(*common)}
    for name in ("MessagesRequest", "CountTokensRequest", "ResponsesRequest", "EmbeddingRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [model_name],
                                                "description": "the served model (GET /v1/models)"}
    schemas["MessageItem"]["required"].remove("type")   # an input message may leave its type out
    props = schemas["ResponsesRequest"]["properties"]
    for name in ("previous_response_id", "conversation", "prompt"):   # refused: nothing is stored
        props[name] = {"type": "null", "description": "not supported (this server stores nothing); leave it out"}
    props["background"] = {"anyOf": [{"const": False}, {"type": "null"}], "description": "only false"}
    props["truncation"] = {"anyOf": [{"const": "disabled"}, {"type": "null"}], "description": "only disabled"}
    props["top_logprobs"] = {"anyOf": [{"const": 0}, {"type": "null"}], "description": "not supported"}
    anthropic_errors = {str(s): {"description": ERRORS[s], "content": _json("AnthropicError")} for s in common}
    paths["/v1/messages"]["post"].update(
        requestBody={"required": True, "content": _json("MessagesRequest")},
        responses={"200": {"description": "the message, or with stream: true its events",
                           "content": {**_json("AnthropicMessage"),
                                       "text/event-stream": _named_stream("AnthropicStreamEvent")}},
                   **anthropic_errors})
    paths["/v1/messages/count_tokens"]["post"].update(
        requestBody={"required": True, "content": _json("CountTokensRequest")},
        responses={"200": {"description": "the prompt's tokens", "content": _json("MessageTokensCount")},
                   **anthropic_errors})
    paths["/v1/responses"]["post"].update(
        requestBody={"required": True, "content": _json("ResponsesRequest")},
        responses={"200": {"description": "the response, or with stream: true its events",
                           "content": {**_json("ResponseObject"), "text/event-stream": _named_stream(
                               "ResponseStreamEvent")}},
                   **_errors(*common)})
    # A body is required (without one: 415) (docs/embeddings.md, docs/lora.md).
    for path, request, response, statuses in (
            ("/v1/embeddings", "EmbeddingRequest", "EmbeddingList", common),
            ("/v1/load_lora_adapter", "LoadLoraAdapter", "LoadedAdapter", (*common, 403, 409)),
            ("/v1/unload_lora_adapter", "UnloadLoraAdapter", "UnloadedAdapter", (*common, 403, 409))):
        if path in paths:
            paths[path]["post"].update(requestBody={"required": True, "content": _json(request)},
                                       responses={"200": {"description": "the result", "content": _json(response)},
                                                  **_errors(*statuses)})
    for path, request, response in (("/tokenize", "TokenizeRequest", "TokenizeResponse"),
                                    ("/detokenize", "DetokenizeRequest", "DetokenizeResponse"),
                                    ("/v1/responses/input_tokens", "InputTokensRequest", "InputTokensCount")):
        if path in paths:
            paths[path]["post"].update(requestBody={"required": True, "content": _json(request)},
                                       responses={"200": {"description": "the result", "content": _json(response)},
                                                  **_errors(*common)})
    paths["/v1/models"]["get"]["responses"] = {"200": {"description": "the served model",
                                                       "content": _json("ModelList")}, **_errors(*auth)}
    paths["/v1/models/{model_id}"]["get"]["responses"] = {"200": {"description": "the served model",
                                                                  "content": _json("ModelCard")},
                                                          **_errors(*auth, 404)}
    health = {"description": "ok; 503 with the reason when it cannot serve", "content": _json("Health")}
    paths["/health"]["get"]["responses"] = {"200": health, "503": health}
    paths["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors(*auth)}
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            if path != "/health":
                for op in item.values():
                    op["security"] = [{"bearer": []}]
    return doc
