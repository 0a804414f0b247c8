"""Memory planning: how many KV blocks the cache gets, and why."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from lmport.config import ConfigError
from lmport.kv.layout import KVLayout

log = logging.getLogger(__name__)

GiB = 1 << 30


def activation_reserve(cfg, num_tokens: int, dtype_bytes: int) -> int:
    """Peak activation bytes of one forward over ``num_tokens`` tokens (an upper estimate).

    The widest live tensors in a layer are the MLP's gate, up and product
    ([T, intermediate] each) beside the residual stream and q/k/v; logits are
    computed only for the last token of each sequence, so vocab does not scale with T.
    """
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    per_token = 3 * cfg.intermediate_size + 4 * hidden + 3 * heads * head_dim
    return int(num_tokens * per_token * dtype_bytes * 1.25)


@dataclass(frozen=True)
class CachePlan:
    free_bytes: int          # device memory free after weights were loaded
    reserve_bytes: int       # activation reserve for one forward of max_prefill_token_num tokens
    cache_bytes: int
    bytes_per_block: int
    block_size: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def as_dict(self) -> dict:
        return {**asdict(self), "num_tokens": self.num_tokens}


def plan_cache(cache_max_entry_count: float | int, layout: KVLayout, free_bytes: int, reserve_bytes: int) -> CachePlan:
    """A float is the share of free memory left after the reserve; an int is an exact block count."""
    if isinstance(cache_max_entry_count, int):
        num_blocks = cache_max_entry_count
        cache_bytes = num_blocks * layout.bytes_per_block
    else:
        cache_bytes = int(max(0, free_bytes - reserve_bytes) * cache_max_entry_count)
        num_blocks = layout.blocks_in(cache_bytes)
    if num_blocks < 1:
        raise ConfigError(
            f"the KV cache gets no block: {free_bytes / GiB:.2f} GiB free, {reserve_bytes / GiB:.2f} GiB "
            f"activation reserve, cache_max_entry_count={cache_max_entry_count}, one block is "
            f"{layout.bytes_per_block} bytes; lower max_prefill_token_num, use quant_policy=8 or 4, or "
            f"give an exact block count (cache_max_entry_count=<int>)")
    return CachePlan(free_bytes, reserve_bytes, num_blocks * layout.bytes_per_block,
                     layout.bytes_per_block, layout.block_size, num_blocks)
