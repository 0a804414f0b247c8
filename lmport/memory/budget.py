"""Memory planning: weights, activation reserve and KV cache (the advice when it does not fit:
lmport.memory.oom_advisor).

``plan_cache`` sizes the cache from a ``MemoryInputs`` for both the engine (free
memory measured once the weights are loaded) and ``lmport plan`` (free memory
computed from a device size, no weights loaded), so the two always agree.
The semantics are documented in docs/memory.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from lmport.platform.backend import Capabilities
from lmport.config import EngineConfig
from lmport.dtypes import torch_dtype
from lmport.errors import CacheDoesNotFit
from lmport.kv.layout import KVLayout
from lmport.models.architectures import cache_kinds, recurrent_state
from lmport.models.dims import head_dim_of
from lmport.models.loader import read_model_config
from lmport.models.windows import kv_window
from lmport.memory.oom_advisor import advise
from lmport.kv.window import blocks_bound
from lmport.parallel import check_tp
from lmport.units import ceil_div, fmt_bytes



def model_limit(model_cfg) -> int:
    """The longest sequence the engine runs: the model's context. A sliding attention window does not
    cap it: the attention ops honour each layer's window (lmport.models.windows)."""
    return getattr(model_cfg, "max_position_embeddings", None) or 1 << 30


def window_blocks(model_cfg, config: EngineConfig) -> int | None:
    """Most blocks one sequence holds however long it grows, when every layer slides and the blocks
    behind the window are freed (lmport.kv.window); None when some layer reads the whole history."""
    window = kv_window(model_cfg)
    if window is None:
        return None
    return blocks_bound(window, config.block_size, config.max_prefill_token_num)


def kv_layout(model_cfg, config: EngineConfig, axis_order: str = "bshd") -> KVLayout:
    """The KV layout of one device: tensor parallelism splits the KV heads over ``config.tp`` devices
    (and replicates them where tp exceeds the KV heads)."""
    check_tp(model_cfg, config.tp)
    kinds = cache_kinds(model_cfg, config.tp)   # what each layer caches, as its model declares it
    return KVLayout(num_layers=len(kinds), num_kv_heads=kinds[0].num_heads,
                    head_dim=kinds[0].head_dim, block_size=config.block_size,
                    dtype=torch_dtype(config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype),
                    quant_policy=config.quant_policy, axis_order=axis_order, layer_kinds=kinds)


def state_bytes(model_cfg, config: EngineConfig) -> int:
    """Bytes of the recurrent-state slots of a model whose linear-attention layers keep one (Qwen3-Next;
    lmport.kv.state_pool): one slot for each of ``max_batch_size`` running sequences; 0 for other models."""
    spec = recurrent_state(model_cfg, torch_dtype(config.dtype))
    return 0 if spec is None else config.max_batch_size * spec.bytes_per_sequence


def draft_bytes_per_block(config: EngineConfig) -> int:
    """Bytes of one block of a speculative draft model's cache (lmport.speculative.draft; 0 without a draft),
    from the draft's config alone. The draft runs whole (tp=1) on rank 0; under tensor parallelism every rank
    plans with this cost, so the block count all ranks share (the smallest any plans) leaves rank 0 room for it."""
    spec = config.speculative
    if spec is None or spec.method != "draft" or spec.model is None:
        return 0
    return kv_layout(read_model_config(spec.model), dataclasses.replace(config, tp=1)).bytes_per_block


# The config fields that size an MLP: a dense one, Llama 4's dense layers, a routed expert, the shared expert.
MLP_WIDTH_FIELDS = ("intermediate_size", "intermediate_size_mlp", "moe_intermediate_size",
                    "shared_expert_intermediate_size")


def mlp_width(model_cfg) -> int:
    """The widest MLP a layer runs on a token. Experts run one at a time over their tokens (lmport.ops.moe), so a
    routed expert counts once whatever the top k; a model with experts only has no ``intermediate_size``."""
    return max(getattr(model_cfg, f, None) or 0 for f in MLP_WIDTH_FIELDS)


def attention_width(model_cfg) -> int:
    """Values a token's attention makes. Multi-head attention: q, k and v, ``heads x head_dim`` each. Latent
    attention (MLA: ``kv_lora_rank`` set; lmport.ops.mla, the projections absorbed) makes per head a query of
    nope + rope values, its latent (rank), that beside the rotary part (rank + rope), the weighted sum of latents
    (rank) and a value (v), beside the latent and the query's latent; its config's ``head_dim`` is the rotary
    part alone."""
    heads = model_cfg.num_attention_heads
    rank = getattr(model_cfg, "kv_lora_rank", None)
    if rank is None:
        return 3 * heads * head_dim_of(model_cfg)
    nope, rope, v = model_cfg.qk_nope_head_dim, model_cfg.qk_rope_head_dim, model_cfg.v_head_dim
    return heads * (nope + 2 * rope + 3 * rank + v) + rank + rope + (getattr(model_cfg, "q_lora_rank", None) or 0)


def activation_reserve(model_cfg, config: EngineConfig) -> int:
    """Estimated peak activation bytes of one forward over ``max_prefill_token_num`` tokens (an upper estimate).

    The widest live tensors in a layer are the MLP's gate, up and product ([T, mlp_width]
    each) beside the residual stream and the attention's (attention_width); tensor parallelism splits the MLP
    and the heads. Logits are computed only for the last token of each sequence (at most
    ``max_batch_size`` rows): the lm_head output, its float32 copy and sampling's copies.
    Attention kernels are assumed not to materialize [T, T] scores (flash-style).
    """
    dtype_bytes = torch_dtype(config.dtype).itemsize
    hidden = model_cfg.hidden_size
    per_token = (3 * mlp_width(model_cfg) + attention_width(model_cfg)) / config.tp + 4 * hidden
    tokens = config.max_prefill_token_num
    logits = min(config.max_batch_size, tokens) * model_cfg.vocab_size * (dtype_bytes + 3 * 4)
    return int((tokens * per_token * dtype_bytes + logits) * 1.25)


# Vision towers (docs/vision.md "Memory"). Pixels a Qwen image may have at most where the directory's
# processor settings say nothing: transformers' Qwen2-VL / Qwen3-VL image processors' default ``longest_edge``.
_QWEN_MAX_PIXELS = {"qwen2_5_vl": 12845056, "qwen3_vl": 16777216}
# Idefics3's tiles an image at most: SmolVLM's processors resize the longest side to 4 tiles, plus the global image.
_IDEFICS3_TILES = 4 * 4 + 1
_VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "mistral3", "idefics3", "llama4")


@dataclass(frozen=True)
class EncoderReserve:
    """The vision encoder's peak activations for the largest image batch the engine runs in one encoder call."""
    largest_image_patches: int   # patches of the largest image the processor makes
    patches_per_call: int        # patches of the largest batch of images one call encodes
    bytes: int


@dataclass(frozen=True)
class EncoderCacheReserve:
    """The encoder cache's rows at most (lmport.multimodal.encoder_cache), held on the engine's device."""
    rows: int
    row_bytes: int    # one row: the text model's width (Qwen3-VL's: with its deepstack sets) in the compute dtype

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes


def largest_image_patches(model_cfg, config: EngineConfig) -> int | None:
    """Patches of the largest image the model's processor makes (None for a model without images): from the mmproj
    file's metadata where the engine runs one, else the family's fixed size (Gemma 3: one size; Mistral 3: the
    tower's ``image_size`` as the longest side; Idefics3: 17 tiles), Qwen's pixel limit from the directory's
    processor settings (``max_image_pixels``, lmport.models.loader.read_model_config) or its default. Llama 4: one
    tile and its class token (each tile is an image of its own to the encoder)."""
    vision = getattr(model_cfg, "vision_config", None)
    kind = getattr(model_cfg, "model_type", None)
    if vision is None or kind not in _VISION_MODEL_TYPES:
        return None
    patch = vision.patch_size
    if config.mmproj is not None:

        from lmport.multimodal.mmproj import largest_image_patches as mmproj_patches
        return mmproj_patches(Path(config.mmproj).expanduser())
    if kind in ("gemma3", "mistral3"):
        return (vision.image_size // patch) ** 2
    if kind == "llama4":
        return (vision.image_size // patch) ** 2 + 1
    if kind == "idefics3":
        return _IDEFICS3_TILES * (vision.image_size // patch) ** 2
    return ceil_div(getattr(model_cfg, "max_image_pixels", None) or _QWEN_MAX_PIXELS[kind], patch * patch)


def encoder_reserve(model_cfg, config: EngineConfig) -> EncoderReserve | None:
    """The vision encoder's peak activation bytes for the largest image batch one encoder call runs (None for a model
    without images), an upper estimate.

    Images per call: a prefill step computes at most ``max_prefill_token_num`` prompt tokens, and every image any of
    them falls in is encoded whole in that step, so a call takes the images of that many tokens and the two largest
    images cut at its ends (Gemma 3's images are never cut: the step's whole images), at least the largest image;
    Mistral 3 encodes a step's images in calls of at most ``ENCODE_PATCHES`` patches (lmport.models.mistral3);
    Llama 4 encodes by tile: a call takes the tiles whose tokens the step computes, the step's tokens over a tile's
    and the two tiles cut at its ends, each tile's patches and its class token.
    Per patch, the widest live tensors of a vision block: the residual stream and the block's input, q, k and v, the
    attention output and the MLP's two widths, and the float32 pixels; Pixtral's block-diagonal mask over the call's
    patches and the scores it makes the attention materialize. Flash-style attention is assumed elsewhere, as for the
    text model (``activation_reserve``). One quarter more for what is not modelled."""
    largest = largest_image_patches(model_cfg, config)
    if largest is None:
        return None
    vision, kind = model_cfg.vision_config, model_cfg.model_type
    dtype_bytes = torch_dtype(config.dtype).itemsize
    tokens = config.max_prefill_token_num
    patch = vision.patch_size
    heads = getattr(vision, "num_attention_heads", None) or vision.num_heads
    if kind == "gemma3":   # whole images only, one size: as many as a step's tokens hold
        per_call = max(1, tokens // model_cfg.mm_tokens_per_image) * largest
    elif kind == "llama4":   # by tile: a tile's patches pixel-shuffled into (patches x ratio^2) tokens
        tile_tokens = round((largest - 1) * vision.pixel_shuffle_ratio ** 2)
        per_call = (tokens // tile_tokens + 2) * largest
    else:
        merge = {"idefics3": getattr(model_cfg, "scale_factor", 2)}.get(kind, getattr(
            vision, "spatial_merge_size", None) or getattr(model_cfg, "spatial_merge_size", 1))
        per_call = max(largest, tokens * merge * merge + 2 * largest)
        if kind == "mistral3":
            from lmport.models.mistral3 import ENCODE_PATCHES
            per_call = min(per_call, max(ENCODE_PATCHES, largest))
    hidden, width = vision.hidden_size, vision.intermediate_size
    pixel_values = 3 * patch * patch * getattr(vision, "temporal_patch_size", 1)
    per_patch = (6 * hidden + 2 * width) * dtype_bytes + pixel_values * 4
    if kind == "llama4":   # its 2D rotary turns q and k in complex float32
        per_patch += 2 * hidden * 4
    attention = per_call * per_call * (dtype_bytes + heads * 4) if kind == "mistral3" else 0
    return EncoderReserve(largest, per_call, int((per_call * per_patch + attention) * 1.25))


def encoder_cache_reserve(model_cfg, config: EngineConfig) -> EncoderCacheReserve | None:
    """The encoder cache at its most (``ENCODER_CACHE_ROWS`` rows, each an image token's row of the text model's width
    in the compute dtype; Qwen3-VL's rows hold its deepstack sets beside it), held on the engine's device beside the
    KV cache; None for a model without images."""
    if getattr(model_cfg, "model_type", None) not in _VISION_MODEL_TYPES or \
            getattr(model_cfg, "vision_config", None) is None:
        return None
    from lmport.multimodal.encoder_cache import ENCODER_CACHE_ROWS
    width = model_cfg.hidden_size
    if model_cfg.model_type == "qwen3_vl":
        width *= 1 + len(getattr(model_cfg.vision_config, "deepstack_visual_indexes", None) or [])
    return EncoderCacheReserve(ENCODER_CACHE_ROWS, width * torch_dtype(config.dtype).itemsize)


def vision_weight_bytes(path, config: EngineConfig) -> int:
    """Bytes of the vision tower and projector in the compute dtype (0 for a text model): the mmproj file's tensors,
    or a transformers directory's vision tensors (``visual.``, ``vision_tower.``, ``vision_model.``,
    ``multi_modal_projector.``, ``connector.``), counted from the checkpoint's headers."""
    import re
    itemsize = torch_dtype(config.dtype).itemsize
    if config.mmproj is not None:
        from lmport.multimodal.mmproj import read_mmproj
        header = read_mmproj(Path(config.mmproj).expanduser())
        # the [IMG_BREAK] row llama.cpp keeps beside a Pixtral tower: lmport takes the text model's
        return sum(_elements(t.shape) for t in header.tensors if t.name != "v.token_embd.img_break") * itemsize
    path = Path(path)
    if not path.is_dir():
        return 0
    from safetensors import safe_open
    vision = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector|connector)\.")
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            total += sum(_elements(f.get_slice(k).get_shape()) for k in f.keys() if vision.search(k))
    return total * itemsize


def _elements(shape) -> int:
    count = 1
    for n in shape:
        count *= int(n)
    return count


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the cache size depends on, for one model, device and resolved config."""

    model_config: object        # the transformers config
    config: EngineConfig        # resolved: block_size, dtype and cache_max_entry_count are set
    capabilities: Capabilities
    weight_bytes: int           # on one device
    free_bytes: int             # device memory free once the weights are loaded
    reserve_bytes: int          # activation reserve for one forward of max_prefill_token_num tokens
    reserve_measured: bool
    # A speculative draft model's cache mirrors the target's blocks (lmport.speculative.draft): each block
    # costs these bytes more, so the usable memory is split between the two in proportion to their blocks.
    draft_bytes_per_block: int = 0
    # The model's files, for the advice: a GGUF's quantized weights decide which tp splits it, beside its config.
    checkpoint: Path | None = None

    @property
    def layout(self) -> KVLayout:
        return kv_layout(self.model_config, self.config)

    @property
    def state_bytes(self) -> int:
        """The recurrent-state slots' bytes (``state_bytes``), allocated beside the paged cache."""
        return state_bytes(self.model_config, self.config)

    @property
    def encoder_bytes(self) -> int:
        """The vision encoder's activation reserve (``encoder_reserve``; 0 for a model without images): beside the
        text model's, which a measured reserve does not include (its forward runs no image)."""
        reserve = encoder_reserve(self.model_config, self.config)
        return 0 if reserve is None else reserve.bytes

    @property
    def encoder_cache_bytes(self) -> int:
        """The encoder cache's bytes at its most (``encoder_cache_reserve``; 0 for a model without images)."""
        reserve = encoder_cache_reserve(self.model_config, self.config)
        return 0 if reserve is None else reserve.bytes

    @property
    def usable_bytes(self) -> int:
        """What the cache may take at most: free memory less the activation reserves (the text model's, the vision
        encoder's), the encoder cache and the recurrent-state slots."""
        return max(0, self.free_bytes - self.reserve_bytes - self.encoder_bytes - self.encoder_cache_bytes
                   - self.state_bytes)

    def changed(self, **fields) -> MemoryInputs:
        """These inputs with config fields changed; weights and reserve rescaled to match (for advice)."""
        new = dataclasses.replace(self.config, **fields)
        weights = self.weight_bytes * self.config.tp // new.tp
        scale = activation_reserve(self.model_config, new) / activation_reserve(self.model_config, self.config)
        return dataclasses.replace(self, config=new, weight_bytes=weights,
                                   free_bytes=self.free_bytes + self.weight_bytes - weights,
                                   reserve_bytes=int(self.reserve_bytes * scale))

    @property
    def block_bytes(self) -> int:
        """Bytes one block costs: the target's, and the draft model's mirror of it."""
        return self.layout.bytes_per_block + self.draft_bytes_per_block

    def blocks_in(self, num_bytes: float) -> int:
        return int(num_bytes // self.block_bytes)

    def cache_blocks(self) -> int:
        """Blocks the cache gets: a float is a share of the usable memory, an int an exact count."""
        count = self.config.cache_max_entry_count
        if isinstance(count, int):
            return count
        return self.blocks_in(int(self.usable_bytes * float(count)))

    def room_blocks(self) -> int:
        """Blocks that ``cache_max_entry_count`` can give: its share for a float, all the usable memory for an int."""
        if isinstance(self.config.cache_max_entry_count, int):
            return self.blocks_in(self.usable_bytes)
        return self.cache_blocks()

    @property
    def model_limit(self) -> int:
        """The longest sequence the engine runs for this model (``model_limit``)."""
        return model_limit(self.model_config)

    @property
    def window_blocks(self) -> int | None:
        """Most blocks one sequence holds when every layer slides (``window_blocks``), else None."""
        return window_blocks(self.model_config, self.config)


@dataclass(frozen=True)
class CachePlan:
    free_bytes: int             # device memory free once the weights are loaded
    reserve_bytes: int          # activation reserve for one forward of max_prefill_token_num tokens
    reserve_measured: bool      # False: the estimate (the backend cannot measure)
    cache_bytes: int
    bytes_per_block: int
    block_size: int
    num_blocks: int
    session_len: int
    window_blocks: int | None = None   # a sliding window bounds each sequence's blocks (window_blocks())
    draft_cache_bytes: int = 0         # the speculative draft model's cache, as many blocks as the target's

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_sequence(self) -> int:
        blocks = ceil_div(self.session_len, self.block_size)
        return blocks if self.window_blocks is None else min(blocks, self.window_blocks)

    @property
    def max_sequences(self) -> int:
        """Sequences of the full session length the cache holds at once."""
        return self.num_blocks // self.blocks_per_sequence


def plan_cache(inp: MemoryInputs) -> CachePlan:
    """The cache size and session length; raises CacheDoesNotFit (with advice) when the cache cannot work."""
    layout, config = inp.layout, inp.config
    num_blocks = inp.cache_blocks()
    count = config.cache_max_entry_count
    if num_blocks * inp.block_bytes > inp.usable_bytes:   # only an exact block count can get here
        draft = " with the draft model's" if inp.draft_bytes_per_block else ""
        raise CacheDoesNotFit(advise(inp, f"cache_max_entry_count={count} blocks{draft} need "
                                          f"{fmt_bytes(num_blocks * inp.block_bytes)}, more than the "
                                          f"{fmt_bytes(inp.usable_bytes)} left after weights and activation reserve"))
    if num_blocks < 1:
        raise CacheDoesNotFit(advise(inp, f"the KV cache gets no block: cache_max_entry_count={count} of "
                                          f"{fmt_bytes(inp.usable_bytes)} is less than one "
                                          f"{fmt_bytes(layout.bytes_per_block)} block"))
    capacity = num_blocks * layout.block_size
    limit, bounded = inp.model_limit, inp.window_blocks
    if bounded is not None and bounded <= num_blocks:   # a sequence of any length fits in its window's blocks
        capacity = limit
    if config.session_len is None:
        session_len = min(limit, capacity)
    else:
        session_len = min(config.session_len, limit)
        if session_len > capacity:
            raise CacheDoesNotFit(advise(inp, f"session_len={session_len} does not fit in the KV cache: "
                                              f"{num_blocks} blocks x {layout.block_size} = {capacity} tokens"))
    return CachePlan(inp.free_bytes, inp.reserve_bytes, inp.reserve_measured, num_blocks * layout.bytes_per_block,
                     layout.bytes_per_block, layout.block_size, num_blocks, session_len, bounded,
                     num_blocks * inp.draft_bytes_per_block)


def allocate_cache(inp: MemoryInputs, plan: CachePlan, layout: KVLayout, backend) -> list:
    """``layout.allocate`` for the plan; an allocator failure becomes CacheDoesNotFit with advice."""
    try:
        return layout.allocate(plan.num_blocks, backend.device)
    except RuntimeError as exc:  # torch.OutOfMemoryError, or the cpu allocator's "can't allocate memory"
        if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in str(exc).lower():
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        problem = f"allocating the KV cache ({plan.num_blocks} blocks, {fmt_bytes(plan.cache_bytes)}) failed: {reason}"
    available, _ = backend.memory_info()   # outside the except block: the partial allocation is freed by now
    raise CacheDoesNotFit(advise(inp, problem, available=available))
