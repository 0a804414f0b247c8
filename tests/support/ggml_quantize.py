"""Plain numpy quantizers for the GGML block types lmport reads from GGUF files.

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are gguf-py's own quantizers (``gguf.quants.quantize``). gguf-py
cannot quantize the K-quants, so Q2_K, Q3_K, Q4_K, Q5_K and Q6_K are written here: one super-block
of 256 weights, cut into sub-blocks of 16 or 32, each sub-block with a small integer scale (and for
Q2_K / Q4_K / Q5_K a small integer min) that multiplies a float16 super-block scale (and min). The
byte layouts are llama.cpp's ``block_q2_K`` ... ``block_q6_K`` (ggml/src/ggml-common.h); gguf-py's
dequantizers read them (tests/test_gguf_files.py round-trips every type through them).

These are not llama.cpp's quantizers (which search for the scale that minimises the error): each
sub-block's range is covered by rounding its scale and min up, never down, so every weight lands
within half of its sub-block's step of its value. That is all the tests need: files whose blocks
use every field of the layout, with errors that the step bounds.
"""
from __future__ import annotations

import gguf
import numpy as np

QK_K = 256
TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
FLOAT_TYPES = ("f32", "f16")


def ggml_type(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name.upper()]


def block_elements(name: str) -> int:
    return gguf.GGML_QUANT_SIZES[ggml_type(name)][0]


def quantize(data: np.ndarray, name: str) -> np.ndarray:
    """``data`` (float, last axis a multiple of the type's block) as GGML blocks: uint8 [..., row bytes]
    (float32 / float16 for "f32" / "f16")."""
    qtype = ggml_type(name)
    data = np.ascontiguousarray(data, dtype=np.float32)
    if name in ("f32", "f16") or name not in _K_QUANTS:
        return gguf.quants.quantize(data, qtype)
    elements, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % elements:
        raise ValueError(f"{name}: rows of {data.shape[-1]} are not a multiple of {elements}")
    blocks = _K_QUANTS[name](data.reshape(-1, elements))
    assert blocks.dtype == np.uint8 and blocks.shape[1] == nbytes, (name, blocks.shape)
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // elements * nbytes)


def dequantize(blocks: np.ndarray, name: str) -> np.ndarray:
    """gguf-py's reference dequantizer (float32), the ground truth for every reader of the blocks."""
    return gguf.quants.dequantize(blocks, ggml_type(name))


# -- helpers -------------------------------------------------------------------------------------

def _f16_up(x: np.ndarray) -> np.ndarray:
    """``x`` (>= 0) as float16, rounded up: a scale that never shrinks the range it must cover."""
    h = np.asarray(x, dtype=np.float32).astype(np.float16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _bytes16(h: np.ndarray) -> np.ndarray:
    """float16 [n] -> its bytes [n, 2] (little-endian, as the files store it)."""
    return np.ascontiguousarray(h.astype("<f2")).view(np.uint8).reshape(-1, 2)


def _ratio_up(value: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """ceil(value / unit) as a code in 0..top (0 where the unit is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(unit > 0, np.ceil(value / unit), 0)
    return np.clip(r, 0, top).astype(np.uint8)


def _codes(x: np.ndarray, step: np.ndarray, offset: np.ndarray, low: int, high: int) -> np.ndarray:
    """round((x + offset) / step), clipped to low..high (``low`` where the step is 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((x + offset) / step), low)
    return np.clip(q, low, high).astype(np.int16)


def _asymmetric(sub: np.ndarray, levels: int, scale_top: int):
    """Scale-and-min quantization of sub-blocks ``sub`` [n, subs, size] (Q2_K, Q4_K, Q5_K):
    w = d * sc_j * q - dmin * m_j with q in 0..levels, sc_j and m_j in 0..scale_top.

    The min is rounded up first (the grid starts at or below the sub-block's smallest weight, and at or
    below 0 as llama.cpp's do), then the step is chosen to reach the largest weight from there, also
    rounded up: every weight is covered and lands within half a step of its value."""
    lowest = -np.minimum(sub.min(-1), 0)                                 # >= 0: the min to subtract
    dmin = _f16_up(lowest.max(-1) / scale_top)                           # [n]
    m = _ratio_up(lowest, dmin.astype(np.float32)[:, None], scale_top)   # [n, subs]
    offset = dmin.astype(np.float32)[:, None] * m
    need = (sub.max(-1) + offset) / levels                               # the step that reaches the top
    d = _f16_up(need.max(-1) / scale_top)
    sc = _ratio_up(need, d.astype(np.float32)[:, None], scale_top)
    step = d.astype(np.float32)[:, None] * sc
    q = _codes(sub, step[..., None], offset[..., None], 0, levels)
    return d, dmin, sc, m, q


def _symmetric(sub: np.ndarray, half: int, scale_top: int):
    """Scale-only quantization (Q3_K, Q6_K): w = d * sc_j * q, q in -half..half-1; sc_j in 0..scale_top
    (the formats allow negative sub-block scales; these never need one)."""
    need = np.abs(sub).max(-1) / (half - 1)          # |q| <= half - 1 covers every weight
    d = _f16_up(need.max(-1) / scale_top)
    sc = _ratio_up(need, d.astype(np.float32)[:, None], scale_top)
    step = d.astype(np.float32)[:, None] * sc
    q = _codes(sub, step[..., None], np.zeros_like(step)[..., None], -half, half - 1)
    return d, sc, q


def _pack_2bit_128(q: np.ndarray) -> np.ndarray:
    """2-bit codes [n, 256] -> 64 bytes: weight h*128 + k*32 + l sits at bits 2k of byte h*32 + l."""
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)
    return sum(q[:, :, k, :] << np.uint8(2 * k) for k in range(4)).astype(np.uint8).reshape(-1, 64)


def _pack_6bit_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: eight 6-bit scales and mins -> 12 bytes (llama.cpp's get_scale_min_k4 reads them):
    bytes 0-3 scale j and, in bits 6-7, scale j+4's bits 4-5; bytes 4-7 likewise the mins; bytes 8-11
    scale j+4's bits 0-3 and, in the high nibble, min j+4's."""
    lo = (sc[:, :4] | ((sc[:, 4:] >> 4) << 6)).astype(np.uint8)
    mid = (m[:, :4] | ((m[:, 4:] >> 4) << 6)).astype(np.uint8)
    hi = ((sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)).astype(np.uint8)
    return np.concatenate([lo, mid, hi], axis=1)


# -- the K-quants (block layouts: ggml-common.h) --------------------------------------------------

def _q2_k(x: np.ndarray) -> np.ndarray:
    """block_q2_K (84 bytes): scales[16] (low nibble: scale, high: min), qs[64] (2-bit), d, dmin (f16).
    16 sub-blocks of 16: w = d * (sc & 15) * q - dmin * (sc >> 4)."""
    d, dmin, sc, m, q = _asymmetric(x.reshape(-1, 16, 16), levels=3, scale_top=15)
    scales = (sc | (m << 4)).astype(np.uint8)
    return np.concatenate([scales, _pack_2bit_128(q), _bytes16(d), _bytes16(dmin)], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    """block_q3_K (110 bytes): hmask[32], qs[64], scales[12], d (f16). 16 sub-blocks of 16:
    w = d * (s_j - 32) * (q - 4), q = 2 low bits from qs and the high bit from hmask (weight k*32 + l
    at bit k of hmask[l]); s_j 6-bit, low nibbles in bytes 0-7 (j, then j+8 in the high nibble), the two
    high bits in bytes 8-11 (sub-block c + 4g at bits 2g of byte 8 + c)."""
    d, sc, q = _symmetric(x.reshape(-1, 16, 16), half=4, scale_top=31)
    u = (q + 4).astype(np.uint8).reshape(-1, QK_K)         # 0..7
    hbits = (u >> 2).reshape(-1, 8, 32)
    hmask = sum(hbits[:, k, :] << np.uint8(k) for k in range(8)).astype(np.uint8)
    s = (sc.astype(np.int16) + 32).astype(np.uint8)        # 32..63
    low = (s[:, :8] & 0xF) | ((s[:, 8:] & 0xF) << 4)
    high = sum(((s[:, 4 * g:4 * g + 4] >> 4) & 3) << np.uint8(2 * g) for g in range(4))
    scales = np.concatenate([low, high], axis=1).astype(np.uint8)
    return np.concatenate([hmask, _pack_2bit_128(u & 3), scales, _bytes16(d)], axis=1)


def _q4_k(x: np.ndarray) -> np.ndarray:
    """block_q4_K (144 bytes): d, dmin (f16), scales[12] (six bits each, _pack_6bit_scales), qs[128].
    8 sub-blocks of 32: w = d * sc_j * q - dmin * m_j; bytes c*32 + l hold sub-block 2c's weight l in
    their low nibble and 2c+1's in the high one."""
    d, dmin, sc, m, q = _asymmetric(x.reshape(-1, 8, 32), levels=15, scale_top=63)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    return np.concatenate([_bytes16(d), _bytes16(dmin), _pack_6bit_scales(sc, m), qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    """block_q5_K (176 bytes): d, dmin, scales[12] as Q4_K, qh[32], qs[128]. The low 4 bits as Q4_K's,
    the fifth bit of sub-block j's weight l at bit j of qh[l]."""
    d, dmin, sc, m, q = _asymmetric(x.reshape(-1, 8, 32), levels=31, scale_top=63)
    q = q.astype(np.uint8)
    low = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(-1, 128)
    qh = sum(((q[:, j, :] >> 4) & 1) << np.uint8(j) for j in range(8)).astype(np.uint8)
    return np.concatenate([_bytes16(d), _bytes16(dmin), _pack_6bit_scales(sc, m), qh, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """block_q6_K (210 bytes): ql[128], qh[64], scales[16] (int8), d (f16). 16 sub-blocks of 16:
    w = d * sc_j * (q - 32). Weight h*128 + p: low nibble in ql[h*64 + p % 64] (high nibble when
    p >= 64), top two bits at bits 2k of qh[h*32 + l] for p = k*32 + l."""
    d, sc, q = _symmetric(x.reshape(-1, 16, 16), half=32, scale_top=127)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 2, 64)    # 0..63
    ql = ((u[:, :, 0, :] & 0xF) | ((u[:, :, 1, :] & 0xF) << 4)).reshape(-1, 128)
    top = (u.reshape(-1, 2, 4, 32) >> 4) & 3
    qh = sum(top[:, :, k, :] << np.uint8(2 * k) for k in range(4)).astype(np.uint8).reshape(-1, 64)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, _bytes16(d)], axis=1)


_K_QUANTS = {"q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def step_bound(x: np.ndarray, name: str) -> np.ndarray:
    """The largest error each weight of ``x`` [..., elements] may have after ``quantize(x, name)``.

    32-weight types (gguf-py's quantizers): Q4_1 / Q5_1 half a step of the block's range at 15 / 31
    levels; Q8_0 half of max|x| / 127; Q4_0 / Q5_0 a whole step (max|x| / 8 or / 16: their scale puts the
    signed extreme at code -8 / -16, so the other extreme may clip by one step), each plus float16's
    rounding of the scale and min. K-quants (the quantizers above): half of the sub-block's step, the
    step of its range (from its min, rounded up to the min's unit) at the type's levels, rounded up to a
    whole multiple of the float16 super-block scale."""
    x = np.asarray(x, dtype=np.float32)
    amax_all = np.abs(x).max() if x.size else 0.0
    if name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        b = x.reshape(-1, 32)
        amax = np.abs(b).max(-1, keepdims=True)
        span = b.max(-1, keepdims=True) - b.min(-1, keepdims=True)
        step = {"q8_0": amax / 127 / 2, "q4_0": amax / 8, "q5_0": amax / 16,
                "q4_1": span / 15 / 2, "q5_1": span / 31 / 2}[name]
        bound = step + (span + amax) * 2 ** -10 + 2 ** -24 * 128   # float16 scale: 2^-25 a code
        return np.broadcast_to(bound, b.shape).reshape(x.shape)
    size, levels, scale_top, asym = {"q2_k": (16, 3, 15, True), "q3_k": (16, 3, 31, False),
                                     "q4_k": (32, 15, 63, True), "q5_k": (32, 31, 63, True),
                                     "q6_k": (16, 31, 127, False)}[name]
    sub = x.reshape(-1, QK_K // size, size)
    if asym:
        lowest = -np.minimum(sub.min(-1), 0)
        dmin = _f16_up(lowest.max(-1, keepdims=True) / scale_top).astype(np.float32)
        need = (sub.max(-1) + lowest + dmin) / levels        # the min may be rounded up by one unit
    else:
        need = np.abs(sub).max(-1) / levels
    d = _f16_up(need.max(-1, keepdims=True) / scale_top).astype(np.float32)
    step = need + d                                          # the step, rounded up to a multiple of d
    bound = step / 2 + amax_all * 1e-6
    return np.broadcast_to(bound[..., None], sub.shape).reshape(x.shape)
