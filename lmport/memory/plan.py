"""The memory plan of a model on a backend, from the model's config alone (`lmport plan MODEL`; its text:
``lmport.memory.plan_format``).

No weight is read or converted: a GGUF's config comes from its metadata, the
parameter count from the engine's model built on the meta device. The cache
is sized by ``lmport.memory.budget.plan_cache``, the function the engine itself uses.
"""
from __future__ import annotations

import dataclasses

import torch

from lmport.platform import registry
from lmport.platform.backend import Backend
from lmport.config import EngineConfig
from lmport.dtypes import torch_dtype
from lmport.errors import ConfigError
from lmport.kv.layout import KVLayout
from lmport.memory.budget import (CacheDoesNotFit, MemoryInputs, activation_reserve, draft_bytes_per_block,
                                  encoder_cache_reserve, encoder_reserve, kv_layout, model_limit, plan_cache,
                                  vision_weight_bytes)
from lmport.models.architectures import attention_variants, model_class, recurrent_state
from lmport.models.dims import head_dim_of
from lmport.models.loader import read_model_config, resolve_model_path
from lmport.models.lora import lora_bytes
from lmport.models.moe import Experts
from lmport.models.parameters import count_parameters
from lmport.models.windows import layer_windows
from lmport.parallel import TPGroup, check_fp8_expert_split
from lmport.platform.resolution import check_model, resolve_config
from lmport.weights import fp8, gguf
from lmport.weights.checkpoint import check_backend, check_tensor_parallel

def build_plan(model: str, config: EngineConfig, device_memory: int | None = None, dp: int = 1) -> dict:
    """The plan as a JSON-ready dict; ``device_memory``: plan for a device with this much memory free
    before the weights load (default: the chosen device's free memory on this machine); ``dp``: data-parallel
    replicas, each with its own tp devices and its own cache (``lmport serve --dp``)."""
    if not isinstance(dp, int) or dp < 1:
        raise ConfigError(f"dp must be an int >= 1 (engine replicas), got {dp!r}")
    resolved = resolve_config(config)
    backend_cls = resolved.backend_class()
    caps = backend_cls.capabilities
    model_cfg = read_model_config(model)
    if resolved.mmproj is not None:   # a GGUF text model with its vision tower: the pair's config, as the engine's
        from pathlib import Path

        from lmport.multimodal.mmproj import model_config
        model_cfg = model_config(resolve_model_path(model), Path(resolved.mmproj).expanduser(), model_cfg)
    check_model(model_cfg.model_type, attention_variants(model_cfg), caps)   # as the engine checks it at load
    layout = kv_layout(model_cfg, resolved, caps.kv_axis_order)
    params = count_parameters(model_cfg)
    dtype = torch_dtype(resolved.dtype)
    # Each rank's own shard (vocabulary and MLP pieces may differ by a row between ranks).
    rank_bytes = [count_parameters(model_cfg, TPGroup(r, resolved.tp)) * dtype.itemsize for r in range(resolved.tp)]
    weight_bytes = max(rank_bytes)
    bytes_by_format = {resolved.dtype: weight_bytes}
    path = resolve_model_path(model)
    check_tensor_parallel(path, resolved.tp, resolved.weight_format)
    keeps_quantized = check_backend(path, caps, resolved.weight_format)
    quantized_gguf = keeps_quantized and path.suffix == ".gguf"
    fp8_checkpoint = fp8.read_checkpoint(path) if keeps_quantized and path.is_dir() else None
    if quantized_gguf and resolved.tp == 1:
        # Kept quantized: the bytes of its format, from the GGUF header.
        bytes_by_format = gguf.planned_bytes(path, dtype)
        weight_bytes = sum(bytes_by_format.values())
        rank_bytes = [weight_bytes]
    elif quantized_gguf:
        # A mixture-of-experts GGUF under tp: each rank a slice of the quantized experts, the rest in the compute
        # dtype (lmport.models.moe.shard_quantized_experts).
        expert_params, expert_bytes = gguf.split_experts_per_rank(path, resolved.tp)
        rank_bytes = [b - expert_params * dtype.itemsize + sum(expert_bytes.values()) for b in rank_bytes]
        weight_bytes = max(rank_bytes)
        bytes_by_format = {resolved.dtype: weight_bytes - sum(expert_bytes.values())} | expert_bytes
    elif fp8_checkpoint is not None and (fp8_experts := fp8_expert_bytes(model_cfg, fp8_checkpoint, resolved.tp)):
        # An fp8 mixture of experts: each rank's slice of the routed experts in fp8 with their scales, the rest in
        # the compute dtype, as lmport.weights.fp8.load_tensors loads it.
        expert_params, expert_bytes = fp8_experts
        rank_bytes = [b - expert_params * dtype.itemsize + sum(expert_bytes.values()) for b in rank_bytes]
        weight_bytes = max(rank_bytes)
        bytes_by_format = {resolved.dtype: weight_bytes - sum(expert_bytes.values())} | expert_bytes

    if device_memory is None:
        probe = registry.safe_probe(backend_cls)
        if not probe.available:
            raise ConfigError(f"device {caps.device_type!r} is not available here ({probe.reason}); plan for one "
                              f"with --device-memory, e.g. --device-memory 24GiB")
        device_memory, _ = backend_cls().memory_info()
        source = "free on this machine now"
    else:
        source = "--device-memory"
    # The vision tower and projector (the directory's or the mmproj's), whole on every rank beside the text weights.
    vision_bytes = vision_weight_bytes(path, resolved)
    draft = draft_plan(model, resolved, caps, dtype)
    draft_weights = draft["weight_bytes"] if draft else 0
    measures = backend_cls.measure_peak_memory is not Backend.measure_peak_memory
    # The LoRA adapters' slots sit beside the weights (lmport.models.lora), allocated whether or not one is loaded.
    adapter_bytes = lora_bytes(model_cfg, resolved.max_loras, resolved.max_lora_rank, dtype)
    # A draft model sits beside the weights too (whole, on rank 0; counted on every rank, as the engine plans it),
    # and its cache mirrors the target's blocks.
    rank_inputs = [MemoryInputs(model_cfg, resolved, caps, w + vision_bytes + adapter_bytes + draft_weights,
                                max(0, device_memory - w - vision_bytes - adapter_bytes - draft_weights),
                                activation_reserve(model_cfg, resolved), reserve_measured=False,
                                draft_bytes_per_block=draft["bytes_per_block"] if draft else 0, checkpoint=path)
                   for w in rank_bytes]
    inputs = rank_inputs[rank_bytes.index(weight_bytes)]   # the rank with the least room decides

    report = {
        "model": {"name": model, "model_type": model_cfg.model_type, "layers": model_cfg.num_hidden_layers,
                  "hidden_size": model_cfg.hidden_size, "attention_heads": model_cfg.num_attention_heads,
                  "kv_heads": model_cfg.num_key_value_heads, "head_dim": head_dim_of(model_cfg),
                  "vocab_size": model_cfg.vocab_size, "max_position_embeddings": model_limit(model_cfg),
                  "sliding_window": getattr(model_cfg, "sliding_window", None),
                  "layer_windows": list(layer_windows(model_cfg))},
        "device": {"type": caps.device_type, "memory_bytes": device_memory, "memory_source": source},
        "weights": {"parameters": params, "bytes": weight_bytes, "bytes_by_dtype": bytes_by_format},
        "vision": vision_summary(model_cfg, resolved, vision_bytes),
        "lora": {"max_loras": resolved.max_loras, "max_lora_rank": resolved.max_lora_rank, "bytes": adapter_bytes},
        "draft": draft,
        "activation_reserve": {
            "bytes": inputs.reserve_bytes, "max_prefill_token_num": resolved.max_prefill_token_num,
            "source": "estimate",
            "note": (f"the {caps.device_type} engine measures it with one forward at start-up" if measures else
                     f"{caps.device_type} cannot measure peak memory: the engine uses this estimate too")},
        "free_after_weights_bytes": inputs.free_bytes,
        "usable_for_cache_bytes": inputs.usable_bytes,
        "kv": {"quant_policy": resolved.quant_policy, "block_size": layout.block_size,
               "bytes_per_block": layout.bytes_per_block, "bytes_per_token": layout.bytes_per_token,
               "kinds": kinds_summary(layout)},
        "state": state_summary(model_cfg, resolved, dtype),
        "cache": None,
        "ranks": None,
        "placement": None,
        "config": {f.name: getattr(resolved, f.name) for f in dataclasses.fields(resolved)
                   if f.name not in ("adjustments", "resolved_backend")},
        "adjustments": [a._asdict() for a in resolved.adjustments],
        "error": None,
    }
    try:
        plan = plan_cache(inputs)
    except CacheDoesNotFit as exc:
        report["error"] = str(exc)
        return report
    report["ranks"] = [{"rank": r, "weight_bytes": inp.weight_bytes, "reserve_bytes": inp.reserve_bytes,
                        "free_after_weights_bytes": inp.free_bytes, "num_blocks": plan.num_blocks,
                        "cache_bytes": plan.cache_bytes} for r, inp in enumerate(rank_inputs)]
    if draft:
        draft.update(num_blocks=plan.num_blocks, cache_bytes=plan.draft_cache_bytes)
    report["placement"] = placement(resolved, caps, dp, plan.num_blocks, plan.cache_bytes, plan.num_tokens)
    report["cache"] = {
        "cache_max_entry_count": resolved.cache_max_entry_count,
        "meaning": ("exact number of blocks" if isinstance(resolved.cache_max_entry_count, int)
                    else "share of the memory left after weights and activation reserve"),
        "bytes": plan.cache_bytes, "num_blocks": plan.num_blocks, "num_tokens": plan.num_tokens,
        "session_len": plan.session_len, "blocks_per_sequence": plan.blocks_per_sequence,
        "window_blocks": plan.window_blocks,
        "sequences_that_fit": plan.max_sequences,
        "max_concurrent_sequences": min(plan.max_sequences, resolved.max_batch_size),
    }
    return report


def fp8_expert_bytes(model_cfg, checkpoint: fp8.Fp8Checkpoint, tp: int) -> tuple[int, dict[str, int]] | None:
    """(parameters, bytes by format: "fp8 e4m3" codes, "fp8 scales" at 4 B) of the routed experts one of ``tp`` ranks
    holds from an fp8 checkpoint (lmport.models.moe.Experts' shapes on the meta device; every rank's slice is
    equal); None for a model without them. ConfigError where ``tp`` cuts the experts' scale blocks."""
    check_fp8_expert_split(checkpoint, model_cfg, tp)
    with torch.device("meta"):
        model = model_class(model_cfg)(model_cfg, backend=None, rotary=None, tp=TPGroup(0, tp))
    params = scales = 0
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        experts, gate_up_rows, hidden = module.gate_up_proj.shape
        piece = gate_up_rows // 2
        params += module.gate_up_proj.numel() + module.down_proj.numel()
        scales += experts * (2 * fp8.scale_count(checkpoint, piece, hidden)
                             + fp8.scale_count(checkpoint, hidden, piece))
    return (params, {"fp8 e4m3": params, "fp8 scales": 4 * scales}) if params else None


def vision_summary(model_cfg, config: EngineConfig, weight_bytes: int) -> dict | None:
    """A model with images: its vision tower's weights (counted in the weights above), the encoder's activation
    reserve for the largest image batch one call runs (lmport.memory.budget.encoder_reserve) and the encoder cache at
    its most (``encoder_cache_reserve``), both set aside before the cache is sized; None for a text model."""
    reserve, cache = encoder_reserve(model_cfg, config), encoder_cache_reserve(model_cfg, config)
    if reserve is None or cache is None:
        return None
    return {"weight_bytes": weight_bytes, "source": "mmproj" if config.mmproj else "checkpoint",
            "largest_image_patches": reserve.largest_image_patches, "patches_per_call": reserve.patches_per_call,
            "encoder_reserve_bytes": reserve.bytes, "encoder_cache_rows": cache.rows,
            "encoder_cache_bytes": cache.bytes}


def kinds_summary(layout: KVLayout) -> list[dict]:
    """What the layers cache, one entry a kind (in layer order): paged K/V or a paged latent (MLA), its heads
    and width, its layers, and the bytes of those layers a token."""
    out: list[dict] = []
    for kind in layout.kinds:
        if out and (out[-1]["kind"], out[-1]["heads"], out[-1]["head_dim"]) == (kind.kind, kind.num_heads,
                                                                              kind.head_dim):
            out[-1]["layers"] += 1
        else:
            out.append({"kind": kind.kind, "heads": kind.num_heads, "head_dim": kind.head_dim, "layers": 1,
                        "tensors": kind.num_tensors, "bytes_per_token": 0.0})
        out[-1]["bytes_per_token"] += layout.kind_bytes_per_block(kind) / layout.block_size
    return out


def state_summary(model_cfg, config: EngineConfig, dtype) -> dict | None:
    """A model with linear-attention layers (Qwen3-Next): each sequence's fixed-size recurrent state
    (lmport.kv.state_pool), one slot for each of max_batch_size sequences, held beside the paged cache; None for
    a model that keeps only paged K/V."""
    spec = recurrent_state(model_cfg, dtype)
    if spec is None:
        return None
    return {"layers": spec.num_layers, "conv_bytes_per_layer": spec.conv_bytes_per_layer,
            "state_bytes_per_layer": spec.state_bytes_per_layer, "bytes_per_sequence": spec.bytes_per_sequence,
            "slots": config.max_batch_size, "bytes": config.max_batch_size * spec.bytes_per_sequence}


def draft_plan(model: str, config: EngineConfig, caps, dtype) -> dict | None:
    """A speculative draft model's weights and cache block (lmport.speculative.draft), checked as the engine
    checks it; None without one."""
    spec = config.speculative
    if spec is None or spec.method != "draft" or spec.model is None:
        return None
    from lmport.speculative.draft import check_draft
    check_draft(model, config)
    draft_cfg, path = read_model_config(spec.model), resolve_model_path(spec.model)
    params = count_parameters(draft_cfg)
    weight_bytes = params * dtype.itemsize
    if check_backend(path, caps, config.weight_format) and path.suffix == ".gguf":
        weight_bytes = sum(gguf.planned_bytes(path, dtype).values())
    return {"model": spec.model, "model_type": draft_cfg.model_type, "layers": draft_cfg.num_hidden_layers,
            "parameters": params, "weight_bytes": weight_bytes, "bytes_per_block": draft_bytes_per_block(config),
            "num_blocks": None, "cache_bytes": None,
            "runs_on": "rank 0's device, whole, in the engine's process"}


def placement(config: EngineConfig, caps, dp: int, num_blocks: int, cache_bytes: int, num_tokens: int) -> dict:
    """What runs where: dp replicas of tp ranks, each rank one placement-group bundle of the backend's device
    resource (docs/distributed.md); every replica plans and holds its own cache."""
    from lmport.executor.ray_cluster import rank_bundle
    ray = dp > 1 or config.executor == "ray"
    bundle = rank_bundle(caps.ray_resource)
    replicas = []
    for i in range(dp):
        ranks = [{"rank": r, "runs_in": ("the replica's actor" if dp > 1 else "the engine's process") if r == 0
                  else ("a Ray actor" if ray else "a worker process"), "bundle": bundle if ray else None}
                 for r in range(config.tp)]
        replicas.append({"replica": i, "ranks": ranks, "num_blocks": num_blocks, "cache_bytes": cache_bytes,
                         "num_tokens": num_tokens})
    return {"dp": dp, "tp": config.tp, "executor": "ray" if ray else config.executor,
            "devices": dp * config.tp, "bundles": [bundle] * (dp * config.tp) if ray else None,
            "router": "prefix affinity over the first blocks' chained hashes, then the least loaded" if dp > 1
            else None, "replicas": replicas}
