"""GGUF blocks with rows interleaved in groups of 16 (lmport.weights.interleaved): the same bytes, relaid
so the file's come back exactly, and a model's linears held so on the cpu backend where its kernels read
them."""
from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "conformance"))
from ggml_cases import copied, random_blocks  # noqa: E402

from lmport import ops  # noqa: E402
from lmport.weights import tensors  # noqa: E402
from lmport.weights import interleaved, residency  # noqa: E402
from lmport.weights.interleaved import GROUP, SEGMENTS, file_layout, file_rows, interleave  # noqa: E402
from support.smaps import mapped_bytes  # noqa: E402


@pytest.mark.parametrize("rows", [16, 35, 48])
@pytest.mark.parametrize("type_name", sorted(SEGMENTS))
def test_interleaving_keeps_the_bytes_and_gives_the_files_back(type_name, rows):
    weight = random_blocks(type_name, rows, 32 * 9 if type_name == "q5_0" else 512, seed=rows)
    held = interleave(weight)
    whole = rows // GROUP * GROUP
    assert held.row_group == GROUP and held.blocks.shape == weight.blocks.shape
    assert not torch.equal(held.blocks[:whole], weight.blocks[:whole])
    assert torch.equal(held.blocks[whole:], weight.blocks[whole:])   # the rows after the last group stay
    assert torch.equal(file_layout(held).blocks, weight.blocks)
    assert torch.equal(ops.dequantize_ggml(held), ops.dequantize_ggml(weight))


@pytest.mark.parametrize("rows", [16, 35])
@pytest.mark.parametrize("bits", [4, 8])
def test_int4_and_int8_weights_interleave_and_come_back(bits, rows):
    from lmport.weights.format import from_codes
    g = torch.Generator().manual_seed(rows)
    low, high = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(low, high, (rows, 128), generator=g)
    weight = from_codes(codes, torch.rand(rows, 4, generator=g), torch.rand(rows, 4, generator=g), bits, 32)
    held = interleave(weight)
    assert held.row_group == GROUP and held.qweight.dtype == weight.qweight.dtype
    # the kernel reads row r's bytes 4 k .. 4 k + 3 at lane r of vector k, and group g's scales as vector g
    raw = held.qweight.view(torch.uint8).reshape(-1)
    assert torch.equal(raw[(3 * GROUP + 5) * 4:(3 * GROUP + 5) * 4 + 4], weight.qweight.view(torch.uint8)[5, 12:16])
    assert torch.equal(held.scales[:GROUP].reshape(-1)[2 * GROUP:3 * GROUP], weight.scales[:GROUP, 2])
    back = file_layout(held)
    assert all(torch.equal(getattr(back, f), getattr(weight, f)) for f in ("qweight", "scales", "mins"))
    assert torch.equal(ops.dequantize(held), ops.dequantize(weight))
    with pytest.raises(ValueError, match="groups of 16: take them with lmport.weights.interleaved.file_rows"):
        held.rows(torch.tensor([0]))


def test_q5_0_layout_puts_each_part_where_the_kernel_reads_it():
    """Row 3's block 5: its d at 2 r, its fifth bit of input 4 k + b at bit 4 r + b of mask k, its qs bytes
    4 j .. 4 j + 3 at 4 r of nibble vector j (csrc/interleaved_rows.h reads them there)."""
    weight = random_blocks("q5_0", 16, 32 * 9)
    block = interleave(weight).blocks.reshape(-1)[5 * 352:6 * 352]
    row = weight.blocks[3, 5 * 22:6 * 22]
    assert torch.equal(block[6:8], row[0:2])
    qh = int.from_bytes(bytes(row[2:6].tolist()), "little")
    masks = int.from_bytes(bytes(block[32:96].tolist()), "little")
    for k in range(32):
        assert (masks >> (64 * (k // 4) + 4 * 3 + k % 4)) & 1 == (qh >> k) & 1
    for j in range(4):
        assert torch.equal(block[96 + 64 * j + 12:96 + 64 * j + 16], row[6 + 4 * j:10 + 4 * j])


def test_k_quant_layouts_put_each_segment_where_the_kernels_read_it():
    """Q4_K's scale byte q of row r at 64 + 16 q + r and qs bytes 4 j .. at 256 + 64 j + 4 r; Q5_K's the same
    first 256 bytes, qh bytes 4 j .. at 256 + 64 j + 4 r and qs bytes 4 j .. at 768 + 64 j + 4 r; Q6_K's qh bytes
    4 j .. at 2048 + 64 j + 4 r, its scale s at 3072 + 16 s + r and d at 3328 + 2 r."""
    q4 = random_blocks("q4_k", 16, 512)
    block, row = interleave(q4).blocks.reshape(-1)[2304:4608], q4.blocks[7, 144:288]
    assert all(block[64 + 16 * q + 7] == row[4 + q] for q in range(12))
    assert all(torch.equal(block[256 + 64 * j + 28:256 + 64 * j + 32], row[16 + 4 * j:20 + 4 * j]) for j in range(32))
    q5 = random_blocks("q5_k", 16, 512)
    block, row = interleave(q5).blocks.reshape(-1)[2816:5632], q5.blocks[11, 176:352]
    assert torch.equal(block[22:24], row[0:2]) and torch.equal(block[32 + 22:32 + 24], row[2:4])
    assert all(block[64 + 16 * q + 11] == row[4 + q] for q in range(12))
    assert all(torch.equal(block[256 + 64 * j + 44:256 + 64 * j + 48], row[16 + 4 * j:20 + 4 * j]) for j in range(8))
    assert all(torch.equal(block[768 + 64 * j + 44:768 + 64 * j + 48], row[48 + 4 * j:52 + 4 * j]) for j in range(32))
    q6 = random_blocks("q6_k", 16, 256)
    block, row = interleave(q6).blocks.reshape(-1), q6.blocks[9]
    assert all(torch.equal(block[2048 + 64 * j + 36:2048 + 64 * j + 40], row[128 + 4 * j:132 + 4 * j])
               for j in range(16))
    assert all(block[3072 + 16 * s + 9] == row[192 + s] for s in range(16))
    assert torch.equal(block[3328 + 18:3328 + 20], row[208:210])


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpu kernel"])
@pytest.mark.parametrize("in_place", [False, True])
def test_in_place_relays_what_torch_owns_and_copies_a_mapped_files_view(tmp_path, monkeypatch, in_place, kernel):
    """In place (a model's own copy), the same memory holds the interleaved rows, a few groups at a time; a
    tensor over a mapped file (not torch's to write) goes to a new tensor either way, and in place (the weight
    not used after) the file's pages under each chunk are handed back as it is copied; the weight is then the
    same as one interleaved into new tensors."""
    relay = _compiled().interleave_groups if kernel else None
    # More groups than a chunk, and rows after them. A chunk of 1.7 MiB: far more than the pages the OS maps
    # around a fault (which may map a handed-back neighbour again), as a load's chunks are.
    weight = random_blocks("q4_k", 16 * 70 + 3, 256 * 32, seed=9)
    monkeypatch.setattr(interleaved, "CHUNK_BYTES", 24 * GROUP * weight.blocks.shape[1])   # 3 chunks
    want = interleave(copied(weight))
    owned = copied(weight)
    held = interleave(owned, in_place=in_place, kernel=relay)
    assert torch.equal(held.blocks, want.blocks)
    assert (held.blocks.data_ptr() == owned.blocks.data_ptr()) == in_place
    path = tmp_path / "blocks"
    weight.blocks.numpy().tofile(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch's warning on a non-writable array
        view = torch.from_numpy(residency.map_file(path)).view(weight.blocks.shape)   # as a GGUF is mapped
    mapped = dataclasses.replace(weight, blocks=view)
    assert mapped_bytes(view, "Rss:") == 0   # nothing read yet
    held = interleave(mapped, in_place=in_place, kernel=relay)
    assert torch.equal(held.blocks, want.blocks) and held.blocks.data_ptr() != mapped.blocks.data_ptr()
    # every page but those a chunk shares with the next, or with the rows after the groups, handed back
    assert (mapped_bytes(view, "Rss:") < view.numel() // 4) == in_place


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("kind", ["int4", "int8", *sorted(SEGMENTS)])
def test_the_cpu_relay_kernel_gives_torchs_bytes(kind, in_place):
    """The cpu backend relays a weight at load in one pass of its own (its interleave_groups): the bytes torch's
    relay gives, in place or into new tensors, the rows past the last whole group kept."""
    compiled = _compiled()
    rows = 16 * 70 + 3
    weight = int_weight(int(kind[3:]), rows) if kind.startswith("int") else random_blocks(kind, rows, 512, seed=3)
    want = interleave(copied(weight))
    owned = copied(weight)
    held = interleave(owned, in_place=in_place, kernel=compiled.interleave_groups)
    assert held.row_group == GROUP
    for name, t in tensors(held).items():
        assert torch.equal(t, tensors(want)[name]), name
        assert (t.data_ptr() == tensors(owned)[name].data_ptr()) == in_place


def test_the_cpu_relay_kernel_refuses_what_it_cannot_relay():
    relay = _compiled().interleave_groups
    rows = torch.zeros(32, 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="segments follow each other from 0"):
        relay(rows, rows.clone(), [(0, 2, 2), (4, 140, 4)], 144)
    with pytest.raises(RuntimeError, match="the segments make up the 144-byte block"):
        relay(rows, rows.clone(), [(0, 2, 2), (2, 2, 2)], 144)
    with pytest.raises(RuntimeError, match="rows in whole groups of 16"):
        relay(rows[:20], rows[:20].clone(), [(0, 144, 4)], 144)
    with pytest.raises(RuntimeError, match="dst is src itself or apart from it"):
        relay(rows[:16], rows[8:24], [(0, 144, 4)], 144)


def _compiled():
    from lmport.backends.cpu import kernels
    compiled = kernels.load()
    if compiled is None:
        pytest.skip("no cpu kernels here (no compiler, or LMPORT_CPU_KERNELS=0)")
    return compiled


def test_interleaved_rows_refuse_what_needs_the_files_rows():
    held = interleave(random_blocks("q5_0", 32, 64))
    with pytest.raises(ValueError, match="interleaved already"):
        interleave(held)
    with pytest.raises(ValueError, match="groups of 16: take them with lmport.weights.interleaved.file_rows"):
        held.rows(torch.tensor([0]))


def int_weight(bits: int, rows: int, seed: int = 0):
    from lmport.weights.format import from_codes
    g = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if bits == 4 else (-128, 128)
    return from_codes(torch.randint(low, high, (rows, 128), generator=g), torch.rand(rows, 4, generator=g),
                      torch.rand(rows, 4, generator=g), bits, 32)


# Rows of whole groups (first, last lanes), past the last whole group, repeated, out of order.
LOOKUP = torch.tensor([[0, 15, 16, 17, 3], [111, 112, 116, 3, 50]])


@pytest.mark.parametrize("kind", ["int4", "int8", *sorted(SEGMENTS)])
def test_file_rows_are_the_files_rows(kind):
    """An embedding lookup in an interleaved table reads each row out of its group: the file's rows."""
    weight = int_weight(int(kind[3:]), 117) if kind.startswith("int") else random_blocks(kind, 117, 512)
    got, want = file_rows(interleave(weight), LOOKUP.reshape(-1)), weight.rows(LOOKUP.reshape(-1))
    assert got.row_group == 1
    assert all(torch.equal(t, tensors(got)[name]) for name, t in tensors(want).items())


@pytest.mark.parametrize("layout", ["file", "held"])
@pytest.mark.parametrize("kind", ["int4", "int8", "q5_0", "q4_k", "q5_k", "q6_k", "q2_k", "iq4_xs"])
def test_the_cpu_backends_embedding_is_the_reference(kind, layout):
    """The cpu backend's lookup (its dequantize kernel over the rows asked for) against the reference op, rows
    in order and as the backend holds a tied LM head's table."""
    from lmport.backends.cpu import CpuBackend
    backend = CpuBackend()
    weight = int_weight(int(kind[3:]), 117) if kind.startswith("int") else random_blocks(kind, 117, 512)
    held = backend.hold_quantized(copied(weight), torch.float32) if layout == "held" else weight
    if layout == "held" and held.row_group == 1:
        pytest.skip(f"the cpu backend holds {kind} as it is")
    lookup, reference = ((backend.quant_embedding, ops.quant_embedding) if kind.startswith("int")
                         else (backend.ggml_embedding, ops.ggml_embedding))
    got, want = lookup(LOOKUP, held, torch.float32), reference(LOOKUP, weight, torch.float32)
    if kind.startswith("int"):   # as test_cpu_dequantize_kernel_is_the_reference
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(got, want)
    assert got.shape == (*LOOKUP.shape, weight.in_features)
    assert torch.equal(reference(LOOKUP, held, torch.float32), want)   # the reference over any layout


def test_the_cpu_backend_holds_only_what_its_kernels_read_interleaved():
    from lmport.backends.cpu import CpuBackend, kernels
    backend = CpuBackend()
    weight = random_blocks("q5_0", 32, 64)
    types = kernels.load().ggml_interleaved_types() if kernels.load() is not None else []
    assert (backend.hold_quantized(copied(weight), torch.float32).row_group == GROUP) == ("q5_0" in types)
    assert backend.hold_quantized(weight, torch.bfloat16) is weight    # the kernels take float32 activations only
    assert backend.hold_quantized(random_blocks("q5_0", 15, 64), torch.float32).row_group == 1   # no whole group
    assert backend.hold_quantized(random_blocks("q2_k", 32, 256), torch.float32).row_group == 1   # no layout


def test_the_cpu_dequantize_kernels_name_a_row_they_do_not_have():
    """A lookup of a row past the table, or indices that are not 1-d: an error naming the row or the shape."""
    from lmport.backends.cpu import kernels
    compiled = kernels.load()
    if compiled is None:
        pytest.skip("no cpu kernels here (no compiler, or LMPORT_CPU_KERNELS=0)")
    w, blocks = int_weight(8, 117), random_blocks("q4_k", 117, 512)
    with pytest.raises(RuntimeError, match="quant_dequantize: row 117 of a weight with 117 rows"):
        compiled.quant_dequantize(w.qweight, w.scales, w.mins, 8, 32, rows=torch.tensor([3, 117]))
    with pytest.raises(RuntimeError, match="ggml_dequantize: row -1 of a weight with 117 rows"):
        compiled.ggml_dequantize(blocks.blocks, "q4_k", 512, rows=torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="ggml_dequantize: rows must be 1-d indices"):
        compiled.ggml_dequantize(blocks.blocks, "q4_k", 512, rows=torch.tensor([[0, 1]]))
