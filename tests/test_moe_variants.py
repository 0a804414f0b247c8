"""The reference routing and expert ops of GLM-4.5, gpt-oss and Llama 4 (lmport.ops.moe) against transformers' own
router and expert modules, on random weights and tokens (float32): the same experts chosen, weights and outputs
within float32 rounding."""
from __future__ import annotations

import pytest
import torch

from lmport import ops
from support import tiny_float_models

TOKENS = 37


def _randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*module.parameters(), *module.buffers()]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module.eval()


def _tokens(hidden: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(TOKENS, hidden, generator=torch.Generator().manual_seed(seed))


def _same_choice(ids, weights, want_ids, want_weights):
    """Same experts per token with the same weights, in any order within a token."""
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n_group,topk_group,renormalize", [(4, 2, True), (1, 1, False), (2, 1, True)])
def test_grouped_routing_is_glm4_moes(n_group, topk_group, renormalize):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    cfg = tiny_float_models.tiny_config("glm4-moe")
    cfg.n_group, cfg.topk_group, cfg.norm_topk_prob = n_group, topk_group, renormalize
    router = _randomized(Glm4MoeTopkRouter(cfg), 3)
    x = _tokens(cfg.hidden_size)
    with torch.no_grad():
        logits, want_weights, want_ids = router(x)
    weights, ids = ops.route_grouped(logits, router.e_score_correction_bias, cfg.num_experts_per_tok, n_group,
                                     topk_group, renormalize, cfg.routed_scaling_factor)
    _same_choice(ids, weights, want_ids, want_weights)


def test_gpt_oss_router_and_experts():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter
    cfg = tiny_float_models.tiny_config("gpt-oss")
    router, experts = _randomized(GptOssTopKRouter(cfg), 4), _randomized(GptOssExperts(cfg), 5)
    x = _tokens(cfg.hidden_size) * 4   # large enough that the SwiGLU's clamps bite
    with torch.no_grad():
        logits, want_weights, want_ids = router(x)
        want = experts(x, want_ids, want_weights)
    weights, ids = ops.route_top_k_softmax(logits, cfg.num_experts_per_tok)
    _same_choice(ids, weights, want_ids, want_weights)
    got = ops.clamped_swiglu_moe(x, experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                                 experts.down_proj_bias, weights, ids, cfg.swiglu_alpha, cfg.swiglu_limit)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_moe(top_k):
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    cfg = tiny_float_models.tiny_config("llama4")
    cfg.num_experts_per_tok = top_k
    moe = _randomized(Llama4TextMoe(cfg), 6)
    x = _tokens(cfg.hidden_size)
    with torch.no_grad():
        want, _ = moe(x)
        logits = moe.router(x)[1]
        shared = moe.shared_expert(x)
    weights, ids = ops.route_top_k_sigmoid(logits, top_k)
    got = shared + ops.input_scaled_moe(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
