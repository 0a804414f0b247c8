"""gpt-oss GGUF files made by llama.cpp's converter and llama-quantize (tests/support/llama_cpp_families.py), loaded
by lmport against transformers holding the same file's dequantized tensors.

The tiny model (tests/support/tiny_float_models.py): 4 layers, sliding (24 tokens) and full attention alternating,
sinks, 4 biased experts with the clamped SwiGLU, yarn rope. Its files: ``MXFP4_MOE`` (the experts MXFP4, the rest
Q8_0: what the released gpt-oss GGUFs hold), ``Q8_0`` and ``Q4_K_M``. MXFP4 experts stay MXFP4 in lmport (held as
the file's blocks, run on the reference op); the weight bytes it holds are at most 1.1x the file's tensor bytes.

Default run: the MXFP4 file's experts of a layer within 1e-5 of transformers' on the same routing, its prompt
logits (prefilled in chunks of 16 across the window) within 0.3% of their range (the cpu kernels' Q8_0 projections);
lmport's MXFP4 dequantizer bit for bit gguf's. Slow: each file, 16 prompts x 32 tokens, decoded together
and each alone, at least 15 of 16 identical either way.
"""
from __future__ import annotations

import pytest
import torch

from support import greedy
from support.gguf_files import tensor_bytes
from support.llama_cpp_families import gguf_file, hf_prompt_logits, lmport_prompt_logits, reference_model

ARCH = "gpt-oss"


def _pipeline(path, weight_format: str = "auto"):
    import lmport
    from lmport import EngineConfig
    return lmport.pipeline(str(path), backend_config=EngineConfig(device_type="cpu", dtype="float32",
                                                                  cache_max_entry_count=256,
                                                                  weight_format=weight_format))


def test_mxfp4_reference_equals_gguf_dequantizer():
    """lmport's torch MXFP4 dequantizer against gguf-py's (llama.cpp's reference, ported), bit for bit: random
    blocks, and every scale byte (the two subnormal ones among them) with every code."""
    import gguf
    import numpy as np

    from lmport.weights.ggml import GGMLWeight, dequantize_mxfp4
    random_blocks = torch.randint(0, 256, (9, 6 * 17), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    every_scale = torch.arange(256, dtype=torch.uint8)[:, None]
    every_code = (torch.arange(16, dtype=torch.uint8) * 17)[None].expand(256, 16)   # 0x00, 0x11, ... 0xff
    for blocks in (random_blocks, torch.cat([every_scale, every_code], dim=1)):
        want = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.MXFP4).astype(np.float32)
        got = dequantize_mxfp4(GGMLWeight(blocks, "mxfp4", blocks.shape[1] // 17 * 32))
        assert torch.equal(got, torch.from_numpy(want).reshape(got.shape))


def test_mxfp4_experts_stay_mxfp4_and_match_transformers():
    from lmport.models.gpt_oss import QuantBiasedExperts
    from lmport.weights.ggml import GGMLWeight
    path = gguf_file(ARCH, "MXFP4_MOE")
    ref = reference_model(ARCH, path)
    (long_ids,) = greedy.prompts(1, seed=5, lengths=(40,))   # past the 24-token window, in chunks of 16
    with _pipeline(path) as pipe:
        experts = pipe.engine.model.model.layers[0].mlp.experts
        assert isinstance(experts, QuantBiasedExperts)
        held = [m.quantized for m in (experts.gate_proj, experts.up_proj, experts.down_proj)]
        assert all(isinstance(w, GGMLWeight) and w.type_name == "mxfp4" for w in held)
        assert pipe.engine.weight_bytes <= 1.1 * tensor_bytes(path)
        # the experts alone, on the cpu kernel: transformers' experts of layer 0 on the same routing
        x = torch.randn(9, experts.gate_proj.quantized.in_features)
        ids_, weights = torch.randint(0, 4, (9, 2)), torch.rand(9, 2)
        hf_experts = ref.model.layers[0].mlp.experts
        with torch.inference_mode():
            want_moe = torch.zeros_like(x)
            for k in range(2):   # transformers' experts module, one routed expert a token at a time
                for t in range(9):
                    e = int(ids_[t, k])
                    h = x[t] @ hf_experts.gate_up_proj[e] + hf_experts.gate_up_proj_bias[e]
                    gate, up = h[::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
                    y = ((up + 1) * gate * torch.sigmoid(gate * 1.702)) @ hf_experts.down_proj[e]
                    want_moe[t] += weights[t, k] * (y + hf_experts.down_proj_bias[e])
            got_moe = experts.forward(x, weights, ids_, 1.702, 7.0)
        # The kernel holds x as int16 codes per run of 32 (ggml_linear.h): within 0.02% of the outputs' range, where
        # a misplaced block, nibble or scale moves them by whole units.
        torch.testing.assert_close(got_moe, want_moe, atol=2e-4 * float(want_moe.abs().max()), rtol=0)
        got_logits = lmport_prompt_logits(pipe.engine, long_ids, 16)
    # The cpu kernels run the Q8_0 projections with x held as int8 codes as fine as int16 (docs/weight-quantization
    # .md): logits within 0.3% of their range, not float32's rounding; a misplaced tensor moves them by whole units.
    want_logits = hf_prompt_logits(ref, long_ids)
    torch.testing.assert_close(got_logits, want_logits, atol=3e-3 * float(want_logits.abs().max()), rtol=0)


def test_a_gpt_oss_file_holds_the_config_of_its_source():
    """The config lmport reads from the file's metadata is the source directory's where the model uses it."""
    from lmport.weights.gguf import transformers_config
    from support.llama_cpp_families import tiny_config
    got, want = transformers_config(gguf_file(ARCH, "MXFP4_MOE")), tiny_config(ARCH)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types",
                  "attention_bias", "rms_norm_eps", "swiglu_alpha", "swiglu_limit", "vocab_size"):
        assert getattr(got, field) == pytest.approx(getattr(want, field)), field
    assert {k: v for k, v in got.rope_parameters.items()} == pytest.approx(dict(want.rope_parameters))


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "weight_format"), [("MXFP4_MOE", "auto"), ("MXFP4_MOE", "dequantize"),
                                                     ("Q8_0", "auto"), ("Q4_K_M", "auto"),
                                                     ("Q4_K_M", "dequantize")])
def test_gpt_oss_files_converted_by_llama_cpp(kind, weight_format):
    """Kept quantized (the experts as the file's blocks), or every tensor dequantized at load (the float experts
    put back into transformers' layout)."""
    path = gguf_file(ARCH, kind)
    ids = greedy.prompts(16)
    want = greedy.hf_greedy(reference_model(ARCH, path), ids, 32)
    with _pipeline(path, weight_format) as pipe:
        greedy.check_file(pipe, path, ids, want, 32, held_bound=1.1 if weight_format == "auto" else None)


DAMAGED = [("gpt-oss.block_count", 5, r"gpt-oss\.block_count is 5, should be 4"),
           ("gpt-oss.expert_count", 1000, r"gpt-oss\.expert_count is 1000, should be 4"),
           ("gpt-oss.attention.head_count", 8, r"gpt-oss\.attention\.head_count is 8, should be 4")]


@pytest.mark.parametrize(("key", "value", "message"), DAMAGED, ids=[f"{k}={v}" for k, v, _ in DAMAGED])
def test_a_damaged_header_is_refused_by_name(tmp_path, key, value, message):
    from lmport.errors import ConfigError
    from support.gguf_files import with_value
    path = with_value(gguf_file(ARCH, "MXFP4_MOE"), key, value, tmp_path / "damaged.gguf")
    with pytest.raises(ConfigError, match=message):
        _pipeline(path)
