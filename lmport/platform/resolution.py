"""An EngineConfig resolved against its backend, in one step before anything loads: the backend class is loaded
(``device_type="auto"``: the best available one), the config is checked against its Capabilities, and the
backend's defaults fill the fields left open. An impossible request is a ConfigError that says what to use
instead; a setting the backend must override is changed in the result and recorded as an Adjustment. The
user's object is left unchanged."""
from __future__ import annotations

import dataclasses
import logging

from lmport.platform import registry
from lmport.platform.backend import Capabilities
from lmport.config import Adjustment, EngineConfig
from lmport.errors import BackendError, ConfigError

log = logging.getLogger(__name__)


def resolve_config(config: EngineConfig) -> EngineConfig:
    """The effective config on the chosen backend; a config already resolved is returned as it is."""
    if config.resolved_backend is not None:
        return config
    backend_cls = _backend_class(config.device_type)
    caps = backend_cls.capabilities
    check_against(config, caps)
    adjustments = []
    block_size = config.block_size or caps.default_block_size
    if caps.block_size_forced is not None and block_size != caps.block_size_forced:
        if config.block_size is not None:
            adjustments.append(Adjustment("block_size", config.block_size, caps.block_size_forced,
                                          f"{caps.device_type} requires block size {caps.block_size_forced}"))
        block_size = caps.block_size_forced
    no_graphs = _why_no_graphs(config, caps)
    eager_mode = config.eager_mode
    if eager_mode is None:   # the backend's choice: graphs where they run
        eager_mode = no_graphs is not None
    elif not eager_mode and no_graphs is not None:
        adjustments.append(Adjustment("eager_mode", False, True, no_graphs + "; every step runs eagerly"))
        eager_mode = True
    for a in adjustments:
        log.warning("config adjusted: %s %r -> %r (%s)", *a)
    dtype = _model_dtype(config, caps)
    return dataclasses.replace(
        config, device_type=caps.device_type, block_size=block_size, eager_mode=eager_mode, dtype=dtype,
        kv_cache_dtype=dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
        cache_max_entry_count=(caps.default_cache_max_entry_count if config.cache_max_entry_count is None
                               else config.cache_max_entry_count),
        adjustments=tuple(adjustments), resolved_backend=backend_cls)


def _why_no_graphs(config: EngineConfig, caps: Capabilities) -> str | None:
    """Why decode steps cannot be captured as graphs with ``config`` on ``caps``; None where they can."""
    if not caps.decode_graphs:
        return f"{caps.device_type} does not capture decode steps"
    if config.tp > 1:
        return f"decode steps are captured at tp=1 only (tp={config.tp})"
    if config.max_loras:
        return f"captured decode steps take no LoRA adapters (max_loras={config.max_loras})"
    return None


def check_against(config: EngineConfig, caps: Capabilities) -> None:
    """A ConfigError when ``caps`` cannot run ``config``, naming the installed devices that can."""
    if config.quant_policy == "fp8" and not caps.runs_kv_policy("fp8"):
        where = _devices(lambda c: c.runs_kv_policy("fp8"))
        instead = "quant_policy=8 (INT8, about the same capacity)" if 8 in caps.kv_quant_policies else "quant_policy=0"
        raise ConfigError(
            f"quant_policy='fp8' (a float8 e4m3 KV cache; vLLM's kv_cache_dtype='fp8') is not supported on device "
            f"{caps.device_type!r}: its capabilities declare no fp8 KV format (kv_fp8_formats; it keeps KV caches "
            f"under quant_policy {caps.kv_policies_text()}); fp8 KV caches run on "
            f"{', '.join(where) or 'no installed device'}; use {instead} on {caps.device_type}")
    if config.quant_policy != "fp8" and config.quant_policy not in caps.kv_quant_policies:
        where = _devices(lambda c: config.quant_policy in c.kv_quant_policies)
        raise ConfigError(
            f"quant_policy={config.quant_policy} is not supported on device {caps.device_type!r} "
            f"(it supports {sorted(caps.kv_quant_policies)}); KV quantization {config.quant_policy} is "
            f"supported on {', '.join(where) or 'no installed device'}; use quant_policy=0 on {caps.device_type}")
    if config.block_size is not None:
        problem = caps.block_size_problem(config.block_size)
        if problem is not None:
            raise ConfigError(f"block_size={config.block_size} on device {caps.device_type!r}: {problem} "
                              f"(rule: {caps.block_size_rule()}; default {caps.default_block_size})")
    if config.max_loras and not caps.lora:
        raise ConfigError(
            f"max_loras={config.max_loras}: device {caps.device_type!r} does not run LoRA adapters; they run on "
            f"{', '.join(_devices(lambda c: c.lora)) or 'no installed device'}; use max_loras=0 on {caps.device_type}")
    if config.dtype != "auto" and config.dtype not in caps.dtypes:
        raise ConfigError(f"dtype={config.dtype!r} is not supported on device {caps.device_type!r}; use one of "
                          f"{', '.join(caps.dtypes)}")
    dtype, kv_dtype = _model_dtype(config, caps), config.kv_cache_dtype
    if kv_dtype not in ("auto", dtype) and config.quant_policy:
        raise ConfigError(f"kv_cache_dtype={kv_dtype!r} with quant_policy={config.quant_policy}: a quantized cache "
                          f"keeps codes, not values of a dtype; use kv_cache_dtype='auto' or quant_policy=0")
    if kv_dtype not in ("auto", dtype) and kv_dtype not in caps.kv_cache_dtypes:
        others = f" or {', '.join(sorted(caps.kv_cache_dtypes))}" if caps.kv_cache_dtypes else ""
        raise ConfigError(
            f"kv_cache_dtype={kv_dtype!r} with dtype={dtype!r} is not supported on device {caps.device_type!r} "
            f"(it keeps K/V in the model's dtype{others}); a {kv_dtype} cache is kept on "
            f"{', '.join(_devices(lambda c: kv_dtype in c.kv_cache_dtypes)) or 'no installed device'}; "
            f"use kv_cache_dtype='auto' on {caps.device_type}")


def check_model(model_type: str, attention_variants: set[str], caps: Capabilities) -> None:
    """A ConfigError when ``caps`` lacks an attention variant the model needs (``attention_variants``: what
    lmport.models.architectures.attention_variants gives for its config), naming the installed devices that
    run them; called before any weight loads."""
    missing = sorted(attention_variants - caps.attention_variants)
    if missing:
        names = ", ".join(f"attention {v}" for v in missing)
        runs = ", ".join(sorted(caps.attention_variants)) or "no attention variant beyond windows and soft caps"
        where = ", ".join(_devices(lambda c: set(missing) <= c.attention_variants)) or "no installed device"
        raise ConfigError(f"model type {model_type!r} needs {names}, which device {caps.device_type!r} does not run "
                          f"(it runs {runs}); {names} run on {where}; use one of those devices")


def _model_dtype(config: EngineConfig, caps: Capabilities) -> str:
    """The dtype the model runs in on ``caps``: the asked one, or the backend's default for "auto"."""
    return caps.default_dtype if config.dtype == "auto" else config.dtype


def _backend_class(device_type: str):
    if device_type == "auto":
        return registry.select_auto()
    try:
        return registry.load_backend_class(device_type)
    except BackendError as exc:
        raise ConfigError(f"device_type={device_type!r}: {exc}") from exc


def _devices(runs) -> list[str]:
    """The installed backends whose capabilities satisfy ``runs``."""
    return [r.name for r in registry.describe_backends() if r.capabilities and runs(r.capabilities)]
