"""LoRA adapters over HTTP (docs/lora.md): a request picks one by its ``model``; /v1/models lists them;
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change them at run time.

Loading reads a directory on the server's own disk, so the two routes are off unless the server starts
with ``--enable-lora-loading``, and sit behind the API key like every other route. The engine core reads,
checks and loads the adapter between two steps (``EngineClient.load_adapter``); its error comes back as the
route's. The front end answers /v1/models and checks a request's ``model`` against the adapters the core's
replies left (``EngineClient.adapters``).
"""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from pydantic import ConfigDict
from typing_extensions import TypedDict

from lmport.config import ConfigError
from lmport.lora import AdapterError
from lmport.server import jsonbody
from lmport.server.auth import AUTH
from lmport.server.protocol import APIError, Unimplemented, _Request, bounded_int, brief
from lmport.server.shapes import LoadedAdapter, OpenAICard, UnloadedAdapter

log = logging.getLogger(__name__)


class LoadLoraAdapter(_Request):
    model_config = ConfigDict(extra="allow")
    ROUTE = "/v1/load_lora_adapter"
    UNIMPLEMENTED = {"load_inplace": Unimplemented("replacing a loaded adapter in place", harmless=(False,),
                                                   fix="unload the adapter, then load it again")}
    lora_name: str
    lora_path: str


class UnloadLoraAdapter(_Request):
    model_config = ConfigDict(extra="allow")
    ROUTE = "/v1/unload_lora_adapter"
    lora_name: str
    lora_int_id: int | None = bounded_int(None)   # vLLM's clients send it; the name decides here


def parse_loras(specs: list[str]) -> dict[str, str]:
    loras: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora {spec!r}: give NAME=PATH (a name and a peft adapter directory)")
        if name in loras:
            raise ConfigError(f"--lora: the name {name!r} is given twice")
        loras[name] = path
    return loras


def max_loras_for(requested: int, loras: dict[str, str], loading: bool) -> int:
    """max_loras for the server: what was asked, or the number of --lora adapters (at least 1 with loading on)
    when it was left at 0; a number below the --lora count is refused."""
    if requested == 0:
        return max(len(loras), 1 if loading else 0)
    if requested < len(loras):
        raise ConfigError(f"--max-loras {requested} is less than the {len(loras)} --lora adapters; raise it")
    return requested


def adapter_error(exc: AdapterError, expose_paths: bool = False) -> APIError:
    """The client's error for ``exc``. A lora_path error tells what is on the server's disk (which directories
    exist, bytes of its files): unless ``expose_paths``, the client gets one message for all and the log the rest."""
    if exc.param == "lora_path" and exc.status == 400 and not expose_paths:
        log.warning("an adapter could not be loaded: %s", exc)
        return APIError(400, "lora_path: the adapter could not be loaded (the server's log says why)",
                        param="lora_path", code="lora_adapter_invalid")
    code = {404: "model_not_found" if exc.param == "model" else "lora_adapter_not_found", 409: "conflict"}
    return APIError(exc.status, str(exc), param=exc.param, code=code.get(exc.status))


def adapter_for(frontend, model: str) -> str | None:
    """The adapter a request's ``model`` names (None: the base model); a 404 naming ``model`` otherwise."""
    if model == frontend.model_name:
        return None
    if model in frontend.core.adapters:
        return model
    served = [frontend.model_name, *sorted(frontend.core.adapters)]
    raise APIError(404, f"model: {brief(model)} does not exist; this server serves {', '.join(map(repr, served))} "
                        f"(see GET /v1/models)", param="model", code="model_not_found")


class _Root(TypedDict, total=False):
    root: str   # an adapter's path on the server's disk, where the server shows paths


def model_cards(frontend) -> list[OpenAICard]:
    """/v1/models' entries for the loaded adapters (vLLM's shape: ``root`` the path, ``parent`` the base)."""
    cards: list[OpenAICard] = []
    for a in list(frontend.core.adapters.values()):
        root: _Root = {"root": a.path} if frontend.expose_adapter_paths else {}
        card: OpenAICard = {"id": a.name, "object": "model", "created": a.created, "owned_by": "lmport", **root,
                            "parent": frontend.model_name, "max_model_len": frontend.info.session_len}
        cards.append(card)
    return cards


def _loading_frontend(request: Request):
    """The app's front end, once loading at run time is known to be on (a 403 otherwise)."""
    if not request.app.state.lora_loading:
        raise APIError(403, "loading LoRA adapters at run time is off: start the server with "
                            "--enable-lora-loading (and an --api-key)", code="lora_loading_disabled")
    return request.app.state.frontend


router = APIRouter(dependencies=AUTH)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    frontend = _loading_frontend(request)
    req = await jsonbody.read(request, LoadLoraAdapter)
    if (problem := req.unknown_field_problem()) is not None:
        raise problem
    if req.lora_name == frontend.model_name:
        raise APIError(400, f"lora_name: {brief(req.lora_name)} is the base model's name; choose another",
                       param="lora_name")
    try:
        loaded = await frontend.core.load_adapter(req.lora_name, req.lora_path)
    except AdapterError as exc:
        raise adapter_error(exc, frontend.expose_adapter_paths) from None
    root: _Root = {"root": loaded.path} if frontend.expose_adapter_paths else {}
    answer: LoadedAdapter = {"id": loaded.name, "object": "model", "created": loaded.created, "owned_by": "lmport",
                             **root, "parent": frontend.model_name}
    return answer


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    frontend = _loading_frontend(request)
    req = await jsonbody.read(request, UnloadLoraAdapter)
    req.unknown_field_problem()   # notes unknown fields in the log; none here changes what is unloaded
    try:
        unloaded = await frontend.core.unload_adapter(req.lora_name)
    except AdapterError as exc:
        raise adapter_error(exc) from None
    answer: UnloadedAdapter = {"id": unloaded.name, "object": "model", "deleted": True}
    return answer
