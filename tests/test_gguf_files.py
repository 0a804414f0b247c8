"""The test inputs for GGUF loading are real GGUF files (tests/support).

- Every quantizer round-trips through gguf-py's reference dequantizer with each weight within what its
  type's step allows (``ggml_quantize.step_bound``: half a sub-block step for the K-quants, plus the
  rounding of their 6-/8-bit sub-scales against the float16 super-scale).
- Each tiny model written as a Q4_K_M file (``write_gguf``, as llama.cpp's converter and llama-quantize
  write it) loads in transformers (``from_pretrained(dir, gguf_file=...)``) with the config values it was
  written from and weights equal to the file's dequantized blocks with the converter's changes undone;
  those weights are the original ones within the quantization step.

What transformers does not read from a GGUF is stated, not hidden: a "llama" file is a Llama to it
(Mistral without a window computes the same), and it does not map Mixtral's experts (architecture
"llama" with ``ffn_*_exps``), so for Mixtral the reference is transformers' Mixtral holding the file's
dequantized tensors (``gguf_files.hf_state_dict_from_gguf``), checked here against the original model.

The files are cached under lmport's cache directory, keyed by these helpers' sources: the first run
writes them (about 5 s each), later runs read them.
"""
from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from support import ggml_quantize, gguf_files
from support.tiny_hf_models import ARCHS, gguf_file, tiny_model

CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "sliding_window",
               "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters",
               "layer_types", "bos_token_id", "eos_token_id")
# The model_type transformers gives each file.
LOADS_AS = {"mistral": "llama", "mixtral": "llama"}


@pytest.mark.parametrize("name", ggml_quantize.TYPES)
def test_quantizers_round_trip_through_gguf_dequantize(name):
    rng = np.random.default_rng(ggml_quantize.TYPES.index(name))
    x = rng.standard_normal((48, 512)).astype(np.float32) * 0.02
    x[8:16] += 0.05                     # blocks all one sign (the mins matter)
    x[16:24, 7] = 1.5                   # an outlier per row (one sub-block's scale far above the rest)
    x[24:32] = 0                        # empty blocks
    x[32:40] *= 1e-3                    # scales in float16's subnormal range
    blocks = ggml_quantize.quantize(x, name)
    elements, nbytes = gguf.GGML_QUANT_SIZES[ggml_quantize.ggml_type(name)]
    assert blocks.dtype == np.uint8 and blocks.shape == (48, 512 // elements * nbytes)
    y = ggml_quantize.dequantize(blocks, name)
    err, bound = np.abs(y - x), ggml_quantize.step_bound(x, name)
    assert (err <= bound).all(), f"{name}: error {err.max():.3g} where the step allows {bound.flat[err.argmax()]:.3g}"
    assert (y[24:32] == 0).all()
    # and it is not trivially loose: on the plain Gaussian rows the relative RMS error is what the type's bits give
    plain = np.r_[0:8, 40:48]
    rms = np.sqrt(((y[plain] - x[plain]) ** 2).mean() / (x[plain] ** 2).mean())
    assert rms < {"q2_k": 0.4, "q3_k": 0.25, "q4_0": 0.1, "q4_1": 0.1, "q4_k": 0.1}.get(name, 0.05), rms


@pytest.mark.parametrize("name", ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k"))
def test_k_quants_use_every_field(name):
    """Sub-block scales differ within a super-block, and every code value appears: a layout mistake in
    any field shows as an error above the step in the round trip."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((4, 256)) * np.repeat(rng.uniform(0.1, 1, (4, 16)), 16, axis=1)).astype(np.float32)
    y = ggml_quantize.dequantize(ggml_quantize.quantize(x, name), name)
    assert (np.abs(y - x) <= ggml_quantize.step_bound(x, name)).all()
    levels = {"q2_k": 4, "q3_k": 8, "q4_k": 16, "q5_k": 32, "q6_k": 64}[name]
    assert len(np.unique(y[0])) > levels


@functools.cache
def _hf_from_gguf(arch: str):
    from transformers import AutoModelForCausalLM
    path = gguf_file(arch)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_q4_k_m_files_hold_the_types_llama_quantize_gives():
    """The per-tensor mix of a Q4_K_M file: Q4_K for most weights, Q6_K for the output and half of attn_v /
    ffn_down (llama-quantize's use_more_bits on 2 layers: the second), fallbacks where a row is 128 long."""
    types = {t.name: t.tensor_type.name for t in gguf_files.reader(gguf_file("llama")).tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert (types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]) == ("Q4_K", "Q6_K")
    assert (types["blk.0.ffn_down.weight"], types["blk.1.ffn_down.weight"]) == ("Q4_K", "Q6_K")
    assert types["blk.0.attn_norm.weight"] == "F32"
    mistral = {t.name: t.tensor_type.name for t in gguf_files.reader(gguf_file("mistral")).tensors}
    assert mistral["blk.0.attn_q.weight"] == "Q5_0" and mistral["blk.1.attn_v.weight"] == "Q8_0"   # rows of 128
    assert mistral["output.weight"] == "Q8_0" and mistral["blk.0.ffn_down.weight"] == "Q4_K"       # 512
    tied = {t.name: t.tensor_type.name for t in gguf_files.reader(gguf_file("gemma3")).tensors}
    assert "output.weight" not in tied and tied["token_embd.weight"] == "Q6_K"
    moe = {t.name: t.tensor_type.name for t in gguf_files.reader(gguf_file("qwen3-moe")).tensors}
    assert moe["blk.0.attn_k.weight"] == "Q8_0" and moe["blk.0.ffn_gate_inp.weight"] == "F32"   # 8 experts


@pytest.mark.parametrize("arch", ARCHS)
def test_file_metadata_is_the_converters(arch):
    reader = gguf_files.reader(gguf_file(arch))
    cfg = tiny_model(arch).config
    a = gguf_files.GGUF_ARCH[cfg.model_type]
    field = lambda key: reader.fields[key].contents()   # noqa: E731
    assert field("general.architecture") == a
    assert field(f"{a}.block_count") == cfg.num_hidden_layers
    assert field(f"{a}.embedding_length") == cfg.hidden_size
    assert field(f"{a}.attention.head_count_kv") == cfg.num_key_value_heads
    assert field(f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    assert field("tokenizer.ggml.model") == "gpt2" and len(reader.fields["tokenizer.ggml.tokens"].data) == 49152
    if a in ("gemma2", "gemma3"):
        assert field(f"{a}.attention.sliding_window") == cfg.sliding_window
        assert field(f"{a}.attention.key_length") == cfg.head_dim
    if cfg.model_type in ("mixtral", "qwen3_moe"):
        assert field(f"{a}.expert_count") == (getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        assert field(f"{a}.expert_used_count") == cfg.num_experts_per_tok
        assert ".ffn_gate_exps.weight" in {t.name[5:] for t in reader.tensors if t.name.startswith("blk.0")}
    if cfg.model_type == "phi3":
        assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= {t.name for t in reader.tensors}
        assert "blk.0.ffn_gate.weight" not in {t.name for t in reader.tensors}


# The default run loads one file in transformers here, one whose experts transformers does not map (mixtral); the
# others are slow. test_gguf_models' default cases load llama's, gemma3's (whose norms the converter shifts by 1),
# phi3's and qwen3-moe's files in transformers as their reference.
LOADED_BY_DEFAULT = ("mixtral",)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=() if a in LOADED_BY_DEFAULT else pytest.mark.slow)
                                  for a in ARCHS])
def test_transformers_loads_each_file(arch):
    ref = tiny_model(arch)
    hf = _hf_from_gguf(arch)
    assert hf.config.model_type == LOADS_AS.get(arch, ref.config.model_type)
    want_cfg, got_cfg = ref.config.to_dict(), hf.config.to_dict()
    skip = {"mixtral": {"num_experts_per_tok", "head_dim"}}.get(arch, set())
    for key in CONFIG_KEYS:
        if key in want_cfg and key not in skip and not (arch == "mistral" and key == "sliding_window"):
            assert got_cfg.get(key) == want_cfg[key], (key, got_cfg.get(key), want_cfg[key])
    assert hf.config.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps, rel=1e-6)   # a float32 in the file

    path = gguf_file(arch)
    dequantized = gguf_files.hf_state_dict_from_gguf(ref.config, path)
    want = dequantized
    got = hf.state_dict()
    if arch == "mixtral":   # transformers maps no ffn_*_exps for a "llama" file: only the rest is compared
        want = {k: v for k, v in want.items() if ".mlp." not in k}
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    # the converter's changes undone: the original weights within the quantization (a wrong row order or
    # a missing +1 would be off by the whole weight)
    original = ref.state_dict()
    for name, value in dequantized.items():
        scale = original[name].abs().max()
        assert (value - original[name]).abs().max() <= 0.1 * scale, name


@pytest.mark.parametrize("arch", ARCHS)
def test_file_blocks_are_the_weights_within_their_step(arch):
    ref = tiny_model(arch)
    written = gguf_files.gguf_tensors(ref.config, ref.state_dict())
    reader = gguf_files.reader(gguf_file(arch))
    for t in reader.tensors:
        x = written[t.name].numpy()
        assert tuple(reversed([int(d) for d in t.shape])) == x.shape, t.name
        y = gguf.quants.dequantize(t.data, t.tensor_type).reshape(x.shape)
        name = t.tensor_type.name.lower()
        if name == "f32":
            assert np.array_equal(y, x), t.name
        else:
            assert (np.abs(y - x) <= ggml_quantize.step_bound(x, name)).all(), t.name
