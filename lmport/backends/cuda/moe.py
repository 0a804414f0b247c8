"""Mixture of experts as a Triton grouped GEMM (matches ``lmport.ops.fused_moe``).

The (token, expert) pairs are sorted by expert on the device and each expert's run
is padded to BLOCK_M rows, so every BLOCK_M tile of the sorted order belongs to one
expert (``_align``, torch ops, no host sync: the tile count is an upper bound and the
tiles past the last expert exit at once). One kernel then runs both GEMMs of the
experts' gated MLPs, a launch each: gate_up over x's rows (row = pair // top_k) into
[pairs, 2 * inter], silu(gate) * up in torch, then down over the pairs' rows, each
scaled by its routing weight, into [pairs, hidden]; the k pairs of a token are summed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmport.backends.cuda.launch import INTERPRETED, dot_args


@triton.jit
def _grouped_gemm(a, b, c, sorted_pairs, tile_expert, weights, num_pairs, N, K,
                  s_am, s_ak, s_be, s_bn, s_bk, s_cm, s_cn,
                  A_ROW_DIV: tl.constexpr, SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """c[pair] = a[pair // A_ROW_DIV] @ b[expert]^T (x weights[pair] when SCALE) for the tile's pairs."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert + tile)
    if expert >= 0:
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_pairs + offs_m)
        valid = pairs < num_pairs                         # the padding of an expert's run
        rows = tl.where(valid, pairs, 0) // A_ROW_DIV
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        b_expert = b + expert.to(tl.int64) * s_be
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            at = tl.load(a + rows[:, None].to(tl.int64) * s_am + offs_k[None, :] * s_ak,
                         mask=valid[:, None] & mask_k[None, :], other=0.0).to(DOT_DTYPE)
            bt = tl.load(b_expert + offs_n[None, :] * s_bn + offs_k[:, None] * s_bk,
                         mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(DOT_DTYPE)
            acc += tl.dot(at, bt, input_precision=DOT_PREC)
        if SCALE:
            acc = acc * tl.load(weights + pairs, mask=valid, other=0.0)[:, None]
        tl.store(c + pairs[:, None].to(tl.int64) * s_cm + offs_n[None, :] * s_cn, acc.to(c.dtype.element_ty),
                 mask=valid[:, None] & mask_n[None, :])


def _align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, tile_expert): the pair indices grouped by expert, each group padded with
    ``pairs`` (an invalid index) to a multiple of block_m; the expert of each block_m tile (-1 past
    the last group). Sized by the upper bound pairs + experts * (block_m - 1), so nothing syncs."""
    flat = ids.flatten()
    pairs = flat.numel()
    # Not bincount: on CUDA it reads the largest id back to the host, which a graph capture refuses.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    first_of_expert = torch.cumsum(counts, 0) - counts
    experts_sorted = flat[order]
    position = starts[experts_sorted] + torch.arange(pairs, device=flat.device) - first_of_expert[experts_sorted]
    num_tiles = triton.cdiv(pairs + num_experts * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_tiles * block_m,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[position] = order
    tile_start = torch.arange(num_tiles, device=flat.device) * block_m
    tile_expert = torch.searchsorted(ends, tile_start, right=True)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
    return sorted_pairs, tile_expert


def _gemm(a, b, c, sorted_pairs, tile_expert, weights, num_pairs, a_row_div, scale, block_m):
    n, k = b.shape[1], b.shape[2]
    block_n = 32 if INTERPRETED else 64
    block_k = 32 if INTERPRETED else 64
    dot_dtype, dot_prec = dot_args(a.dtype)
    grid = (tile_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm[grid](a, b, c, sorted_pairs, tile_expert, weights, num_pairs, n, k,
                        *a.stride(), *b.stride(), *c.stride(),
                        A_ROW_DIV=a_row_div, SCALE=scale, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec, num_warps=4)


class _Routing:
    """The (token, expert) pairs of ``ids`` [tokens, top_k] grouped by expert into tiles (``_align``), and the
    two grouped GEMMs of an expert MLP over them."""

    def __init__(self, ids: torch.Tensor, num_experts: int, weights: torch.Tensor):
        self.tokens, self.top_k = ids.shape
        self.pairs = self.tokens * self.top_k
        self.block_m = 16 if INTERPRETED or self.pairs <= 64 else 64
        self.sorted_pairs, self.tile_expert = _align(ids, num_experts, self.block_m)
        self.weights = weights.reshape(-1).float().contiguous()

    def up(self, x: torch.Tensor, gate_up: torch.Tensor, rows_per_token: bool) -> torch.Tensor:
        """[pairs, N]: each pair's input row (x's row of its token, or x's own row when not ``rows_per_token``)
        times its expert's ``gate_up`` [experts, N, K], in x's dtype."""
        h = torch.empty(self.pairs, gate_up.shape[1], dtype=x.dtype, device=x.device)
        _gemm(x, gate_up, h, self.sorted_pairs, self.tile_expert, self.weights, self.pairs,
              self.top_k if rows_per_token else 1, False, self.block_m)
        return h

    def down(self, act: torch.Tensor, down: torch.Tensor, scale: bool) -> torch.Tensor:
        """[pairs, hidden] in float32: each pair's activation row times its expert's ``down`` [experts, hidden,
        inter], times the pair's routing weight when ``scale``."""
        y = torch.empty(self.pairs, down.shape[1], dtype=torch.float32, device=act.device)
        _gemm(act.contiguous(), down, y, self.sorted_pairs, self.tile_expert, self.weights, self.pairs, 1, scale,
              self.block_m)
        return y

    def summed(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The k pairs of each token summed: [tokens, hidden] in ``dtype``."""
        return y.view(self.tokens, self.top_k, -1).sum(1).to(dtype)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    routing = _Routing(ids, gate_up.shape[0], weights)
    gate, up = routing.up(x, gate_up, True).chunk(2, dim=-1)
    return routing.summed(routing.down(torch.nn.functional.silu(gate) * up, down, True), x.dtype)


def clamped_swiglu_moe(x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                       down_bias: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, alpha: float,
                       limit: float) -> torch.Tensor:
    """gpt-oss's experts (``lmport.ops.clamped_swiglu_moe``: transformers' [experts, in, out] layout, gate and up
    columns interleaved, biases): the same two grouped GEMMs over the transposed views, the clamped activation
    and the biases in torch between and after them."""
    routing = _Routing(ids, gate_up.shape[0], weights)
    experts = ids.reshape(-1)
    h = routing.up(x, gate_up.transpose(1, 2), True) + gate_up_bias[experts]
    gate, up = h[:, ::2].clamp(max=limit), h[:, 1::2].clamp(min=-limit, max=limit)
    y = routing.down((up + 1) * (gate * torch.sigmoid(gate * alpha)), down.transpose(1, 2), True)
    return routing.summed(y + down_bias[experts].float() * routing.weights[:, None], x.dtype)


def input_scaled_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts (``lmport.ops.input_scaled_moe``: transformers' layout, the routing weight scaling each
    expert's input): each pair's scaled row made first, then the two grouped GEMMs unscaled."""
    routing = _Routing(ids, gate_up.shape[0], weights)
    scaled = (x.repeat_interleave(routing.top_k, 0) * weights.reshape(-1, 1)).to(x.dtype)
    gate, up = routing.up(scaled, gate_up.transpose(1, 2), False).chunk(2, dim=-1)
    return routing.summed(routing.down(up * torch.nn.functional.silu(gate), down.transpose(1, 2), False), x.dtype)
