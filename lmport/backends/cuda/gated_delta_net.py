"""The gated delta rule (Qwen3-Next's and Qwen3.5's linear-attention layers): the cuda backend's Triton kernels.

They match ``lmport.ops.gated_delta_net.recurrent_gated_delta_rule`` and ``chunk_gated_delta_rule``: per value head,
with q and k L2-normalized and q scaled by Dk^-1/2,

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - S_{t-1}^T k_t exp(g_t)))^T,   o_t = S_t^T q_t

In both, a program owns one sequence, one value head and a tile of BLOCK_V of its Dv state columns (the rule
updates each column of S on its own, so splitting them changes nothing; on a GPU it spreads a 128 x 128 state over
more programs), keeps its [Dk, BLOCK_V] slice of the state in float32 registers from the state a sequence's earlier
tokens left (or zeros), walks its tokens in order, stores each output in v's dtype, and writes the state once after
the last token. q and k are those of the value head's key head (GQA); inputs are read through their strides (views
split from the conv's output need no copy), in float16, bfloat16 or float32, with any head dims (masked to the next
power of two).

- ``_recurrent_kernel``: one token a step, its q, k, v, g and beta normalized and applied in registers. A decode
  step (one token for each of a batch of sequences) and short prefills.
- ``_chunk_kernel``: CHUNK tokens a step with float32 matmuls, the reference's chunked (WY) form: the corrections
  within a chunk from one triangular system, then the chunk's outputs and the state after it. Prefills of a chunk
  or more (``prefill_gated_delta_rule`` chooses).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmport.backends.cuda.launch import INTERPRETED, pow2, tl_dtype

L2_EPS = 1e-6   # the reference's _l2norm: x / sqrt(sum(x^2) + eps)
# Tokens a step of the chunked kernel: tl.dot's smallest tile, so its [CHUNK, Dk] tiles and its triangular solve's
# CHUNK - 1 substitution steps stay small (untuned on a GPU).
CHUNK = 16
GPU_BLOCK_V = 32   # state columns a program on a GPU (a [128, 32] float32 tile: 32 registers a thread at 4 warps)


@triton.jit
def _program_state(state_in, si_b, si_h, si_k, si_v, HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_STATE: tl.constexpr):
    """This program's sequence and value head, its state rows and columns, and its [BLOCK_K, BLOCK_V] slice of the
    state before the step's tokens (float32; zeros for a sequence that starts here)."""
    seq_head = tl.program_id(0)
    seq = (seq_head // HEADS).to(tl.int64)
    head = seq_head % HEADS
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    if HAS_STATE:
        s = tl.load(state_in + seq * si_b + head * si_h + dk[:, None] * si_k + dv[None, :] * si_v,
                    mask=(dk < DK)[:, None] & (dv < DV)[None, :], other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    return seq, head, dk, dv, s


@triton.jit
def _recurrent_kernel(q, k, v, g, beta, state_in, state_out, out, num_tokens, scale,
                      q_b, q_t, q_h, q_d, k_b, k_t, k_h, k_d, v_b, v_t, v_h, v_d,
                      g_b, g_t, g_h, be_b, be_t, be_h,
                      si_b, si_h, si_k, si_v, o_b, o_t, o_h, o_d,
                      HEADS: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_STATE: tl.constexpr, EPS: tl.constexpr,
                      OUT_DTYPE: tl.constexpr):
    seq, head, dk, dv, s = _program_state(state_in, si_b, si_h, si_k, si_v, HEADS, DK, DV, BLOCK_K, BLOCK_V,
                                          HAS_STATE)
    key_head = head // GROUP   # value head j reads key head j // (value heads / key heads)
    k_mask, v_mask = dk < DK, dv < DV
    tile_mask = k_mask[:, None] & v_mask[None, :]
    q_row = q + seq * q_b + key_head * q_h + dk * q_d
    k_row = k + seq * k_b + key_head * k_h + dk * k_d
    v_row = v + seq * v_b + head * v_h + dv * v_d
    o_row = out + seq * o_b + head * o_h + dv * o_d
    g_at = g + seq * g_b + head * g_h
    beta_at = beta + seq * be_b + head * be_h
    for _ in range(num_tokens):   # the pointers step a token at a time (64-bit: no offset overflows on long prompts)
        qt = tl.load(q_row, mask=k_mask, other=0.0).to(tl.float32)
        kt = tl.load(k_row, mask=k_mask, other=0.0).to(tl.float32)
        vt = tl.load(v_row, mask=v_mask, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_at).to(tl.float32))
        bt = tl.load(beta_at).to(tl.float32)
        qt = qt * (1.0 / tl.sqrt(tl.sum(qt * qt, 0) + EPS)) * scale
        kt = kt * (1.0 / tl.sqrt(tl.sum(kt * kt, 0) + EPS))
        s = s * decay
        delta = (vt - tl.sum(s * kt[:, None], 0)) * bt      # what the state does not yet predict of v
        s = s + kt[:, None] * delta[None, :]
        ot = tl.sum(s * qt[:, None], 0)
        tl.store(o_row, ot.to(OUT_DTYPE), mask=v_mask)
        q_row += q_t
        k_row += k_t
        v_row += v_t
        o_row += o_t
        g_at += g_t
        beta_at += be_t
    # state_out is contiguous [B, HEADS, DK, DV] float32
    tl.store(state_out + (seq * HEADS + head) * (DK * DV) + dk[:, None] * DV + dv[None, :], s, mask=tile_mask)


@triton.jit
def _chunk_kernel(q, k, v, g, beta, state_in, state_out, out, num_tokens, scale,
                  q_b, q_t, q_h, q_d, k_b, k_t, k_h, k_d, v_b, v_t, v_h, v_d,
                  g_b, g_t, g_h, be_b, be_t, be_h,
                  si_b, si_h, si_k, si_v, o_b, o_t, o_h, o_d,
                  HEADS: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_STATE: tl.constexpr, EPS: tl.constexpr,
                  OUT_DTYPE: tl.constexpr, CHUNK: tl.constexpr):
    """The reference's chunked form (``chunk_gated_delta_rule``), CHUNK tokens a step, every product a float32
    ``tl.dot``: within a chunk the delta rule's corrections solve (I + A) x = rhs with A strictly lower
    (A_ij = beta_i (k_i . k_j) exp(decay_i - decay_j)), through (I + A)^-1 by forward substitution, as the
    reference's triangular solve does. (Its power series (I - A)(I + A^2)(I + A^4)... needs no loop but is unstable:
    with nearly equal keys and beta near 1, A's powers grow like binomial coefficients and cancel in float32.)"""
    seq, head, dk, dv, s = _program_state(state_in, si_b, si_h, si_k, si_v, HEADS, DK, DV, BLOCK_K, BLOCK_V,
                                          HAS_STATE)
    key_head = head // GROUP   # value head j reads key head j // (value heads / key heads)
    k_mask, v_mask = dk < DK, dv < DV
    tile_mask = k_mask[:, None] & v_mask[None, :]
    rows = tl.arange(0, CHUNK)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    q_at = q + seq * q_b + key_head * q_h
    k_at = k + seq * k_b + key_head * k_h
    v_at = v + seq * v_b + head * v_h
    o_at = out + seq * o_b + head * o_h
    g_at = g + seq * g_b + head * g_h
    beta_at = beta + seq * be_b + head * be_h
    for start in range(0, num_tokens, CHUNK):
        live = rows < num_tokens - start   # the last chunk's rows past the end: zeros, as the reference pads
        qc = tl.load(q_at + rows[:, None] * q_t + dk[None, :] * q_d, mask=live[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)
        kc = tl.load(k_at + rows[:, None] * k_t + dk[None, :] * k_d, mask=live[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)
        vc = tl.load(v_at + rows[:, None] * v_t + dv[None, :] * v_d, mask=live[:, None] & v_mask[None, :],
                     other=0.0).to(tl.float32)
        gc = tl.load(g_at + rows * g_t, mask=live, other=0.0).to(tl.float32)
        bc = tl.load(beta_at + rows * be_t, mask=live, other=0.0).to(tl.float32)
        qc = qc * (1.0 / tl.sqrt(tl.sum(qc * qc, 1) + EPS))[:, None] * scale
        kc = kc * (1.0 / tl.sqrt(tl.sum(kc * kc, 1) + EPS))[:, None]
        decay = tl.cumsum(gc, 0)                             # log decay from the chunk's start to each token
        # exp(decay_i - decay_j) for j <= i; zero above the diagonal (masked before exp: it would overflow)
        pair = tl.exp(tl.where(causal, decay[:, None] - decay[None, :], float("-inf")))
        kt = tl.trans(kc)
        a = tl.where(strict, bc[:, None] * tl.dot(kc, kt, input_precision="ieee") * pair, 0.0)
        inverse = eye   # (I + A)^-1 by forward substitution, row i = e_i - sum_{j < i} A_ij row j
        for i in tl.static_range(1, CHUNK):   # pyright: ignore[reportGeneralTypeIssues] (Triton's stub)
            a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)
            inverse = tl.where(rows[:, None] == i, inverse - tl.sum(a_row[:, None] * inverse, 0)[None, :], inverse)
        u = tl.dot(inverse, vc * bc[:, None], input_precision="ieee")
        w = tl.dot(inverse, kc * (bc * tl.exp(decay))[:, None], input_precision="ieee")
        corrected = u - tl.dot(w, s, input_precision="ieee")  # what the state does not already predict
        attn = tl.where(causal, tl.dot(qc, kt, input_precision="ieee") * pair, 0.0)
        oc = tl.dot(qc * tl.exp(decay)[:, None], s, input_precision="ieee") \
            + tl.dot(attn, corrected, input_precision="ieee")
        tl.store(o_at + rows[:, None] * o_t + dv[None, :] * o_d, oc.to(OUT_DTYPE),
                 mask=live[:, None] & v_mask[None, :])
        last = tl.sum(tl.where(rows == CHUNK - 1, decay, 0.0), 0)   # the chunk's total (padded rows add 0)
        k_write = kc * tl.exp(last - decay)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(k_write), corrected, input_precision="ieee")
        q_at += CHUNK * q_t   # 64-bit pointers step a chunk at a time: no offset overflows on long prompts
        k_at += CHUNK * k_t
        v_at += CHUNK * v_t
        o_at += CHUNK * o_t
        g_at += CHUNK * g_t
        beta_at += CHUNK * be_t
    tl.store(state_out + (seq * HEADS + head) * (DK * DV) + dk[:, None] * DV + dv[None, :], s, mask=tile_mask)


def _check(q, k, v, g, beta, state) -> tuple[int, int, int, int, int, int]:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"the gated delta rule takes q, k [B, T, key heads, Dk] and v [B, T, value heads, Dv], "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, t, hk, dk = q.shape
    hv, dv = v.shape[-2:]
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"{name} must be [B, T, value heads] = {(b, t, hv)}, got {tuple(x.shape)}")
    if state is not None and state.shape != (b, hv, dk, dv):
        raise ValueError(f"the state must be [B, value heads, Dk, Dv] = {(b, hv, dk, dv)}, got {tuple(state.shape)}")
    return b, t, hk, hv, dk, dv


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None,
                               block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``T`` tokens of ``B`` sequences, token by token in one launch: q, k [B, T, Hk, Dk],
    v [B, T, Hv, Dv], g (log decay) and beta [B, T, Hv], ``state`` [B, Hv, Dk, Dv] before them (None: zeros).
    Returns the output [B, T, Hv, Dv] (v's dtype) and the float32 state after the T tokens, as the reference does.
    ``block_v``: state columns a program (a power of two; default: all of them under the interpreter, where fewer
    programs run faster, and GPU_BLOCK_V on a GPU)."""
    return _launch(_recurrent_kernel, q, k, v, g, beta, state, block_v, {})


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor | None = None, chunk_size: int = CHUNK,
                           block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``recurrent_gated_delta_rule``'s arguments and results, computed ``chunk_size`` tokens at a time with matmuls
    (a power of two >= 16: ``tl.dot``'s smallest tile)."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    return _launch(_chunk_kernel, q, k, v, g, beta, state, block_v, dict(CHUNK=chunk_size))


def prefill_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill (chunk) of ``T`` tokens: the chunked kernel from one chunk of tokens on, the token-by-token one
    below (a few tokens cost less one by one than as a padded chunk)."""
    if q.shape[1] >= CHUNK:
        return chunk_gated_delta_rule(q, k, v, g, beta, state)
    return recurrent_gated_delta_rule(q, k, v, g, beta, state)


def _launch(kernel, q, k, v, g, beta, state, block_v, extra) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, _, hv, dk, dv = _check(q, k, v, g, beta, state)
    out = v.new_empty(b, t, hv, dv)
    state_out = torch.empty(b, hv, dk, dv, dtype=torch.float32, device=v.device)
    if b == 0:
        return out, state_out
    chunked = kernel is _chunk_kernel
    block_k = max(pow2(dk), 16) if chunked else pow2(dk)   # tl.dot's tiles are at least 16 wide
    if block_v is None:
        block_v = pow2(dv) if INTERPRETED else min(pow2(dv), GPU_BLOCK_V)
    if block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if chunked:
        block_v = max(block_v, 16)
    state_in = state if state is not None else state_out   # a placeholder the kernel never reads (HAS_STATE False)
    grid = (b * hv, triton.cdiv(dv, block_v))
    kernel[grid](
        q, k, v, g, beta, state_in, state_out, out, t, dk ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *state_in.stride(), *out.stride(),
        HEADS=hv, GROUP=hv // q.shape[2], DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v,
        HAS_STATE=state is not None, EPS=L2_EPS, OUT_DTYPE=tl_dtype(out.dtype),
        num_warps=4 if block_k * block_v >= 2048 else 1, **extra)
    return out, state_out
