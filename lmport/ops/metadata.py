"""Attention metadata: built once a step, by a pure function, read by every layer."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's new tokens are and where its KV lives.

    Sequence ``i`` has ``q_lens[i]`` new tokens (rows ``q_start_loc[i]`` to
    ``q_start_loc[i + 1]`` of q) and ``kv_lens[i]`` tokens in the cache once
    they are written (history + new). New token ``j`` sits at absolute
    position ``kv_lens[i] - q_lens[i] + j`` and attends to positions <= that
    (and, under a sliding ``window``, > that - window).

    A negative id in a block table names a block freed because it lies wholly
    outside the window of every layer (lmport.kv.window); it is stored as
    block 0, which no windowed read reaches.
    """

    q_start_loc: torch.Tensor    # [B + 1] int32, cumulative q_lens
    q_lens: torch.Tensor         # [B] int32
    kv_lens: torch.Tensor        # [B] int32
    block_tables: torch.Tensor   # [B, max_blocks] int32, padded with block 0
    slot_mapping: torch.Tensor   # [T] int64, cache slot (block * block_size + offset) of each new token
    positions: torch.Tensor      # [T] int64, absolute position of each new token
    block_size: int
    max_q_len: int               # host ints, so ops never sync to size their work
    max_kv_len: int
    is_decode: bool              # every sequence has exactly one new token
    q_lens_host: tuple[int, ...] = ()    # q_lens and kv_lens on the host, for vendor ops that take lists
    kv_lens_host: tuple[int, ...] = ()
    # Per layer (the model sets them with ``for_layer``): the sliding window, a token at position p
    # seeing keys at positions > p - window (transformers' rule), None for full causal attention;
    # and the attention-logit soft cap, scores -> softcap * tanh(scores / softcap) before the
    # softmax (Gemma 2), None for none.
    window: int | None = None
    softcap: float | None = None
    # Attention variants a backend declares in Capabilities.attention_variants, per layer too:
    # ``sinks`` [Hq] float32, a learned logit per query head that joins each row's softmax denominator
    # and weighs no value (gpt-oss: out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j))), None for none;
    # ``chunk``, a token at position p seeing only keys in its own chunk of ``chunk`` positions
    # (p // chunk == j // chunk; Llama 4's local layers), None for none.
    sinks: torch.Tensor | None = None
    chunk: int | None = None
    # "bidirectional", per step: for each sequence, the [start, end) absolute position spans whose tokens also see
    # the tokens after them in the span (an image's tokens in Gemma 3: transformers' ``blockwise_overlay``, or-ed
    # with causal, then and-ed with the layer's window); each span computed whole in the step, or its start in
    # the cache; None (or a sequence's empty tuple): causal only.
    bidirectional: tuple[tuple[tuple[int, int], ...], ...] | None = None

    def for_layer(self, window: int | None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                  chunk: int | None = None) -> AttentionMetadata:
        """This step's metadata as a layer with this attention window, soft cap, sinks and chunk reads it."""
        if window == self.window and softcap == self.softcap and sinks is self.sinks and chunk == self.chunk:
            return self
        return dataclasses.replace(self, window=window, softcap=softcap, sinks=sinks, chunk=chunk)

    @property
    def num_seqs(self) -> int:
        return self.q_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of a list (or equal-length lists) of ints, made through numpy: torch.tensor() of a
    short list costs several times as much, and a step makes several."""
    return torch.from_numpy(np.array(values, dtype=NUMPY_DTYPES[dtype]))


def build_attention_metadata(q_lens: list[int], kv_lens: list[int], block_tables: list[list[int]],
                             block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    if not (len(q_lens) == len(kv_lens) == len(block_tables)) or not q_lens:
        raise ValueError("q_lens, kv_lens and block_tables need one entry per sequence (at least one)")
    positions, slots = [], []
    for q_len, kv_len, table in zip(q_lens, kv_lens, block_tables):
        if not 0 < q_len <= kv_len or len(table) * block_size < kv_len:
            raise ValueError(f"bad sequence shape: q_len={q_len}, kv_len={kv_len}, blocks={len(table)}")
        for pos in range(kv_len - q_len, kv_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in block_tables)
    tables = [[max(b, 0) for b in t] + [0] * (width - len(t)) for t in block_tables]
    start = [0]
    for n in q_lens:
        start.append(start[-1] + n)

    def tensor(values, dtype):
        return host_tensor(values, dtype).to(device, non_blocking=True)

    return AttentionMetadata(
        q_start_loc=tensor(start, torch.int32),
        q_lens=tensor(q_lens, torch.int32),
        kv_lens=tensor(kv_lens, torch.int32),
        block_tables=tensor(tables, torch.int32),
        slot_mapping=tensor(slots, torch.int64),
        positions=tensor(positions, torch.int64),
        block_size=block_size,
        max_q_len=max(q_lens),
        max_kv_len=max(kv_lens),
        is_decode=max(q_lens) == 1,
        q_lens_host=tuple(q_lens),
        kv_lens_host=tuple(kv_lens),
    )
