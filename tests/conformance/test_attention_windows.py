"""Every backend's paged attention with a sliding window and a soft cap, against the reference op.

Batches: decodes of mixed lengths (one shorter than the window, others past it), and a
prefill chunk over history beside a decode, with block sizes 16 and 64; windows 1, 7 and
40 (not a multiple of any block size), with and without Gemma 2's soft cap. Freed blocks
(negative ids: lmport.kv.window) are read as block 0 and must not change the result.
cuda runs its Triton kernels under the interpreter here; ascend and camb, simulated, take
their stated fallback (the reference op) for windowed and soft-capped layers: those cells are skipped as not
applicable (the reference compared with itself tests nothing).
"""
from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the cuda kernels are first imported

import pytest  # noqa: E402

from harness import op_backend, own_result  # noqa: E402
from lmport import ops  # noqa: E402
from lmport.kv.layout import KVLayout  # noqa: E402
from lmport.kv.window import HOLE, first_kept_block  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM = 2, 2, 32
BATCHES = {"decode": ([1, 1, 1], [5, 70, 130]), "mixed": ([40, 1], [110, 90])}
TOL = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _case(backend, block_size, q_lens, kv_lens, window, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in kv_lens]
    ids = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
    tables = [ids[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
    layout = KVLayout(1, KV_HEADS, HEAD_DIM, block_size, dtype, 0, backend.capabilities.kv_axis_order)
    cache = layout.allocate(sum(counts) + 1, backend.device)[0]
    k, v = (torch.randn(sum(kv_lens), KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    history = ops.build_attention_metadata(kv_lens, kv_lens, tables, block_size, backend.device)
    backend.fill_kv_cache(k.to(backend.device), v.to(backend.device), cache, history.slot_mapping)
    # The blocks the window left behind are freed: holes in the tables, read as block 0.
    holed = [[HOLE if i < first_kept_block(n - q, window, block_size) else b for i, b in enumerate(t)]
             for t, q, n in zip(tables, q_lens, kv_lens)]
    meta = ops.build_attention_metadata(q_lens, kv_lens, holed, block_size, backend.device)
    q = torch.randn(sum(q_lens), KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype).to(backend.device)
    return cache, meta, q


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_windowed_attention_matches_reference(backend_name, batch, block_size, window, softcap, record_property):
    backend, mode = op_backend(backend_name)
    caps = backend.capabilities
    if caps.block_size_problem(block_size) or (caps.block_size_forced not in (None, block_size)):
        pytest.skip(f"{backend_name} does not take block size {block_size}")
    record_property("mode", mode)
    dtype = torch.float32 if "float32" in caps.dtypes and caps.device_type in ("cpu", "cuda") else torch.float16
    q_lens, kv_lens = BATCHES[batch]
    cache, meta, q = _case(backend, block_size, q_lens, kv_lens, window, dtype)
    meta = meta.for_layer(window, softcap)
    out = own_result(backend, "paged_attention", q, cache, meta, HEAD_DIM ** -0.5)
    if out is None:
        pytest.skip(f"n/a: {backend_name} runs the reference op for windowed or soft-capped layers")
    bshd = cache if caps.kv_axis_order == "bshd" else dataclasses.replace(
        cache, k=cache.k.transpose(1, 2), v=cache.v.transpose(1, 2), axis_order="bshd")   # the reference reads bshd
    ref = ops.paged_attention(q, bshd, meta, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out, ref, **TOL[dtype])
