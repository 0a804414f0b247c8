"""Gated DeltaNet (Qwen3-Next's linear-attention layers) as reference ops: the causal depthwise conv1d with a
carried window, and the gated delta rule, chunked (prefill) and token by token (decode).

One sequence's state is fixed in size, whatever its length: the conv window (the last ``kernel - 1`` inputs of
each channel, [channels, kernel - 1]) and the recurrent state matrix of each value head ([heads, Dk, Dv]). Each
op takes the state a sequence's previous tokens left (None: the sequence starts here) and returns the state
after its new tokens, so a prompt computed in several chunks, then decoded token by token, gives what one
whole pass gives. The rule, per value head, with q and k L2-normalized and q scaled by Dk^-1/2:

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - S_{t-1}^T k_t exp(g_t)))^T,   o_t = S_t^T q_t

The chunked form computes the same over chunks of ``chunk_size`` tokens with a few matmuls a chunk (the
WY / UT transform of the delta rule); it stays the reference the recurrent form is checked against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise convolution of one sequence's new inputs ``x`` [T, C] with ``weight`` [C, K],
    the inputs before them being ``window`` [C, K - 1] (None: zeros, the sequence starts here). Returns the
    output [T, C] (x's dtype) and the window after x [C, K - 1] (``window``'s dtype, or x's)."""
    channels, kernel = weight.shape
    if x.shape[-1] != channels:
        raise ValueError(f"conv1d input has {x.shape[-1]} channels, the weight {channels}")
    if window is None:
        window = x.new_zeros(channels, kernel - 1)
    full = torch.cat([window.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)   # [C, K - 1 + T]
    out = F.conv1d(full[None], weight[:, None, :], bias, groups=channels)[0]     # [C, T]
    return F.silu(out).t().to(x.dtype), full[:, full.shape[-1] - (kernel - 1):].to(window.dtype)


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor,
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: ``x`` [B, C], ``windows`` [B, C, K - 1]; the outputs [B, C] and the windows
    after them [B, C, K - 1] (a decode step's conv, batched over sequences)."""
    full = torch.cat([windows.to(weight.dtype), x[:, :, None].to(weight.dtype)], dim=-1)   # [B, C, K]
    out = (full * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out).to(x.dtype), full[:, :, 1:].to(windows.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def heads_first(q, k, v, g, beta):
    """float32 [B, Hv, T, ...] with q and k repeated to the value heads, L2-normalized, q scaled."""
    hk, hv = k.shape[-2], v.shape[-2]
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    if hk != hv:
        q, k = q.repeat_interleave(hv // hk, dim=-2), k.repeat_interleave(hv // hk, dim=-2)
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor | None = None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``T`` tokens of ``B`` sequences, ``chunk_size`` tokens a chunk: q, k [B, T, Hk, Dk],
    v [B, T, Hv, Dv], g (log decay, <= 0) and beta [B, T, Hv], ``state`` [B, Hv, Dk, Dv] before them (None: zeros).
    Returns the output [B, T, Hv, Dv] (v's dtype) and the float32 state after the T tokens."""
    b, t = q.shape[:2]
    hv, dv = v.shape[-2:]
    dtype = v.dtype
    q, k, v, g, beta = heads_first(q, k, v, g, beta)
    dk = k.shape[-1]
    s = q.new_zeros(b, hv, dk, dv) if state is None else state.float().clone()
    pad = (-t) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk_size
    q, k, v = (x.reshape(b, hv, n, chunk_size, -1) for x in (q, k, v))
    g, beta = g.reshape(b, hv, n, chunk_size), beta.reshape(b, hv, n, chunk_size)
    decay = g.cumsum(-1)                                    # log decay from the chunk's start to each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(decay_i - decay_j) for j <= i; zero above the diagonal (masked before exp: it would overflow)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb, vb = k * beta[..., None], v * beta[..., None]
    # The delta rule's corrections within a chunk solve (I + A) u = beta v, with A strictly lower:
    # A_ij = beta_i (k_i . k_j) exp(decay_i - decay_j), j < i.
    system = (kb @ k.transpose(-1, -2)) * pair
    system = system.masked_fill(~causal, 0.0).tril(-1) + torch.eye(chunk_size, device=q.device)
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * decay.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pair
    q_read = q * decay.exp()[..., None]                     # q reading the state as it was at the chunk's start
    k_write = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for i in range(n):
        corrected = u[:, :, i] - w[:, :, i] @ s             # what the state does not already predict
        out[:, :, i] = q_read[:, :, i] @ s + attn[:, :, i] @ corrected
        s = s * chunk_decay[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ corrected
    out = out.reshape(b, hv, n * chunk_size, dv)[:, :, :t].transpose(1, 2)
    return out.to(dtype).contiguous(), s


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token; the same arguments and results as ``chunk_gated_delta_rule``.
    A decode step is T = 1 over the batch's sequences."""
    b, t = q.shape[:2]
    hv, dv = v.shape[-2:]
    dtype = v.dtype
    q, k, v, g, beta = heads_first(q, k, v, g, beta)
    s = q.new_zeros(b, hv, k.shape[-1], dv) if state is None else state.float().clone()
    out = torch.empty_like(v)
    for i in range(t):
        s = s * g[:, :, i].exp()[..., None, None]
        kt = k[:, :, i]
        delta = (v[:, :, i] - (s * kt[..., None]).sum(-2)) * beta[:, :, i, None]
        s = s + kt[..., None] * delta[..., None, :]
        out[:, :, i] = (s * q[:, :, i, :, None]).sum(-2)
    return out.transpose(1, 2).to(dtype).contiguous(), s


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim scaled by ``weight``, times SiLU of ``gate`` (in float32; x's dtype out):
    the linear layers' output norm, gated per value head."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (weight * normed * F.silu(gate.float())).to(dtype)
