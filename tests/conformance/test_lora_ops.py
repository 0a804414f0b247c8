"""Every backend that declares LoRA (Capabilities.lora) against the reference ``lmport.ops.add_lora``,
and the reference against one adapter's update computed alone with plain matmuls.

Cases: a decode step (one row a sequence) and a mixed step (prefill runs of several rows beside
decode rows), 3 adapter slots and base-model rows interleaved, a slot no row uses, runs longer than
one tile (LORA_TILE) of the cuda grouped GEMM, float32 and bfloat16. cuda runs its Triton kernel
under the interpreter here. A backend that does not declare LoRA is refused by the config check.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from harness import op_backend  # noqa: E402
from lmport import ops  # noqa: E402
from lmport.config import ConfigError, EngineConfig  # noqa: E402
from lmport.platform.resolution import resolve_config  # noqa: E402

SLOTS, RANK, IN, OUT = 4, 24, 40, 72
# (new tokens, slot) of each sequence: -1 is the base model; slot 2 is loaded but unused.
DECODE = [(1, 0), (1, -1), (1, 3), (1, 0), (1, 1), (1, -1)]
MIXED = [(19, 1), (1, -1), (3, 0), (1, 1), (37, 3), (2, -1), (1, 0)]


def _case(seqs, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(n for n, _ in seqs)
    x = torch.randn(t, IN, generator=g).to(dtype)
    y = torch.randn(t, OUT, generator=g).to(dtype)
    a = (torch.randn(SLOTS, RANK, IN, generator=g) / 4).to(dtype)
    b = (torch.randn(SLOTS, OUT, RANK, generator=g) / 4).to(dtype)
    return x, y, a, b


@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_reference_matches_each_adapter_alone(seqs):
    x, y, a, b = _case(seqs)
    batch = ops.build_lora_batch([n for n, _ in seqs], [s for _, s in seqs])
    got = ops.add_lora(y, x, a, b, batch)
    start = 0
    for n, slot in seqs:
        rows = slice(start, start + n)
        want = y[rows] if slot < 0 else y[rows] + (x[rows] @ a[slot].T) @ b[slot].T
        torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=1e-5)
        start += n


def test_batch_layout():
    batch = ops.build_lora_batch([n for n, _ in MIXED], [s for _, s in MIXED])
    assert batch is not None
    slots = batch.slots.tolist()
    assert len(slots) == sum(n for n, _ in MIXED) and slots[:19] == [1] * 19 and slots[19] == -1
    rows = {s: r.tolist() for s, r in batch.rows_by_slot}
    assert sorted(rows) == [0, 1, 3] and rows[1] == list(range(19)) + [23]
    tiles = batch.tile_rows.view(-1, ops.lora.LORA_TILE)
    for slot, tile in zip(batch.tile_slots.tolist(), tiles.tolist()):
        assert all(r == -1 or slots[r] == slot for r in tile)
    assert sorted(r for r in batch.tile_rows.tolist() if r >= 0) == [i for i, s in enumerate(slots) if s >= 0]
    assert ops.build_lora_batch([3, 1], [-1, -1]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_backend_matches_reference(backend_name, seqs, dtype, record_property):
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    if not backend.capabilities.lora:
        with pytest.raises(ConfigError, match="does not run LoRA adapters"):
            resolve_config(EngineConfig(device_type=backend_name, max_loras=1))
        return
    x, y, a, b = (t.to(backend.device) for t in _case(seqs, dtype, seed=len(seqs)))
    batch = ops.build_lora_batch([n for n, _ in seqs], [s for _, s in seqs], backend.device)
    want = ops.add_lora(y, x, a, b, batch)
    got = backend.add_lora(y.clone(), x, a, b, batch)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
