"""Prompt lookup (n-gram) proposals: the tokens that followed an earlier occurrence of the last n tokens.

For n from ``max_n`` down to ``min_n``, the sequence's last n tokens (prompt and output so far) are
searched for earlier in the sequence; at the latest earlier occurrence, the up to ``k`` tokens that
followed it are the proposal. A continuation that reaches the end of the sequence goes on into the
proposal itself, as an overlapping copy does: a loop of period p is proposed k tokens ahead, not p.
Output that repeats spans of its prompt (extraction, editing, code rewrites) or of itself is proposed
whole; anything else finds no match and costs one search.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
    total = len(token_ids)
    if k < 1 or total <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        # Windows starting at 0 .. total - n - 1: each is followed by at least one token.
        windows = sliding_window_view(tokens[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            proposal = token_ids[start:start + k]
            while len(proposal) < k:   # position total + j holds proposal[j]
                proposal.append(proposal[start + len(proposal) - total])
            return proposal
    return []
