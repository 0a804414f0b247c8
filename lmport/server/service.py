"""The routes about the server itself: /health (never behind the key), /metrics, the model list, the API's
own documents (/openapi.json, /docs, /redoc)."""
from __future__ import annotations

import datetime

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lmport.server import adapters, liveness
from lmport.server import openapi as openapi_doc
from lmport.server.auth import AUTH
from lmport.server.chat_format import ChatFormat
from lmport.server.protocol import APIError, brief
from lmport.server.shapes import Health, ModelCard, ModelList, OpenAICard

health_router = APIRouter()
router = APIRouter(dependencies=AUTH)
docs_router = APIRouter(dependencies=AUTH, include_in_schema=False)


# The routes' answers are annotated variables: a route's return annotation would become FastAPI's response model.

@health_router.get("/health")
async def health(request: Request):
    frontend, replicas = request.app.state.frontend, request.app.state.replicas
    problem = frontend.engine_problem()
    answer: Health
    if problem is not None:
        answer = {"status": "engine stopped", "reason": problem}
        return JSONResponse(answer, status_code=503)
    if frontend.admission.closed:
        answer = {"status": "shutting down"}
        return JSONResponse(answer, status_code=503)
    if (stalled := liveness.stall(frontend.core, frontend.limits.engine_stall_timeout)) is not None:
        return JSONResponse(stalled, status_code=503)
    if replicas is not None:
        answer = {"status": "ok", "replicas": [{k: v for k, v in r.items() if k != "usage"} for r in replicas()]}
        return answer
    answer = {"status": "ok"}
    return answer


@router.get("/metrics")
async def metrics(request: Request):
    return Response(generate_latest(request.app.state.frontend.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _model_card(request: Request) -> OpenAICard:
    frontend = request.app.state.frontend
    chat: ChatFormat = request.app.state.chat
    return {"id": frontend.model_name, "object": "model", "created": frontend.created, "owned_by": "lmport",
            "max_model_len": frontend.info.session_len, **chat.card()}


@router.get("/v1/models")
async def models(request: Request):
    cards = [with_anthropic_fields(card) for card in [_model_card(request),
                                                      *adapters.model_cards(request.app.state.frontend)]]
    # Anthropic's list shape beside OpenAI's: one page holds every model.
    answer: ModelList = {"object": "list", "data": cards, "has_more": False, "first_id": cards[0]["id"],
                         "last_id": cards[-1]["id"]}
    return answer


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    frontend = request.app.state.frontend
    if model_id != frontend.model_name:
        if (card := next((c for c in adapters.model_cards(frontend) if c["id"] == model_id), None)) is not None:
            return with_anthropic_fields(card)
        raise APIError(404, f"model: {brief(model_id)} does not exist; this server serves "
                            f"{frontend.model_name!r} (see GET /v1/models)", param="model", code="model_not_found")
    return with_anthropic_fields(_model_card(request))


def with_anthropic_fields(card: OpenAICard) -> ModelCard:
    """An OpenAI model card with the fields Anthropic's model object has too (type, display_name, created_at as
    RFC 3339), so both APIs' clients read it."""
    created = datetime.datetime.fromtimestamp(card["created"], datetime.timezone.utc)
    return {**card, "type": "model", "display_name": card["id"],
            "created_at": created.isoformat().replace("+00:00", "Z")}


@docs_router.get("/openapi.json")
async def openapi(request: Request):
    app, frontend = request.app, request.app.state.frontend
    if app.openapi_schema is None:
        app.openapi_schema = openapi_doc.build(app, frontend.model_name, frontend.api_key is not None,
                                               frontend.info.vocab_size)
    return app.openapi_schema


@docs_router.get("/docs")
async def swagger():
    return get_swagger_ui_html(openapi_url="/openapi.json", title="lmport")


@docs_router.get("/redoc")
async def redoc():
    return get_redoc_html(openapi_url="/openapi.json", title="lmport")
