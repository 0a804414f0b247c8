"""Freeing the KV blocks a sliding window has left behind.

When every layer of a model attends through a window of at most ``window`` tokens
(lmport.models.windows.kv_window), the next token computed, at position
``num_computed``, and every later one, reads keys at positions >= num_computed -
window + 1 only. A block wholly before that is never read again: its block-table
entry becomes ``HOLE`` and the block goes back to the pool (or to the prefix
cache, which may still hand it to a sequence sharing the prefix). The entry keeps
its place, so block ``i`` still covers positions [i * block_size, (i + 1) *
block_size); the attention metadata reads a hole as block 0, behind the mask.

A sequence computing ``n`` tokens a step then holds at most ``blocks_bound(window,
block_size, n)`` blocks, however long it grows.
"""
from __future__ import annotations

HOLE = -1   # a block-table entry whose block was freed (outside the window)


def first_kept_block(num_computed: int, window: int, block_size: int) -> int:
    """Index of the first block the next token (at position ``num_computed``) may still read."""
    return max(0, num_computed - window + 1) // block_size


def blocks_bound(window: int, block_size: int, tokens_per_step: int) -> int:
    """Most blocks a sequence holds while computing ``tokens_per_step`` tokens a step: the tokens the
    step's first query sees (window - 1 before it) plus the step's own, over at most one partial
    block at each end."""
    return -(-(window - 1 + tokens_per_step) // block_size) + 1


def release_outside_window(allocator, prefix_cache, table: list[int], num_computed: int, window: int,
                           block_size: int) -> int:
    """Free the blocks of ``table`` that the next token can no longer read; returns how many.

    Holes always form a prefix of the table, so the walk goes back from the first kept block to the
    last hole; later blocks go first, as ``BlockManager.free`` orders them for the prefix cache's LRU.
    A block the prefix cache indexes stays cached there (reference dropped, block kept)."""
    i = min(first_kept_block(num_computed, window, block_size), len(table)) - 1
    freed = 0
    while i >= 0 and table[i] != HOLE:
        allocator.decref(table[i], keep=prefix_cache is not None and table[i] in prefix_cache.device)
        table[i] = HOLE
        freed += 1
        i -= 1
    return freed
