"""The block manager's usage report: pool gauges, prefix-cache lookups, evictions, preemptions, host copies.

``BlockManager.usage()`` returns it; ``Engine.usage()`` adds it to its own, which the server's /metrics reads.
"""
from __future__ import annotations

from collections import Counter

from lmport.kv.allocator import BlockAllocator
from lmport.kv.host_tier import CopyQueue
from lmport.kv.prefix_cache import PrefixCache


def usage(allocator: BlockAllocator, cache: PrefixCache | None, host: BlockAllocator | None, copies: CopyQueue,
          stats: Counter[str], bytes_per_block: int) -> dict:
    """The report over a block manager's pools, prefix cache, copy queue and counters."""
    s = stats
    queried = s["lookup_device"] + s["lookup_host"] + s["lookup_miss"]

    def rate(n):
        return n / queried if queried else 0.0
    return {
        "prefix_caching": cache is not None,
        "device_blocks_cached": allocator.num_cached,
        "host_blocks_total": host.num_blocks if host else 0,
        "host_blocks_cached": host.num_cached if host else 0,
        "host_blocks_swapped": host.num_used if host else 0,
        "prefix_cache_queried_blocks": queried,
        "prefix_cache_hit_blocks_device": s["lookup_device"],
        "prefix_cache_hit_blocks_host": s["lookup_host"],
        "prefix_cache_miss_blocks": s["lookup_miss"],
        "prefix_cache_hit_rate": rate(s["lookup_device"] + s["lookup_host"]),
        "prefix_cache_device_hit_rate": rate(s["lookup_device"]),
        "prefix_cache_host_hit_rate": rate(s["lookup_host"]),
        "device_cache_evictions": s["device_evictions"],
        "host_cache_evictions": s["host_evictions"],
        "hash_collisions": s["hash_collisions"],
        "preempt_swap": s["preempt_swap"],
        "preempt_recompute": s["preempt_recompute"],
        "blocks_to_host": copies.blocks_to_host,
        "blocks_from_host": copies.blocks_from_host,
        "bytes_to_host": copies.blocks_to_host * bytes_per_block,
        "bytes_from_host": copies.blocks_from_host * bytes_per_block,
    }
