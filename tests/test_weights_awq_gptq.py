"""AWQ and GPTQ checkpoints: tiny random-weight Llama and Qwen2 models quantized by a packer
written here from the formats' documented layouts (AutoAWQ's GEMM packing, AutoGPTQ/GPTQModel's
v1 format), loaded by lmport with the weights kept quantized, against transformers running the
same model with every quantized Linear replaced by its dequantized float32 weight.

Tolerance, stated: lmport stores min = -scale * zero rounded once to float16 (relative error
<= 2**-11 of scale * zero) and the decode kernel rounds activations to int16 per run of 32, so
logits agree within 2e-3 absolute (tiny random models' logits are about +-1; measured ~1e-4).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lmport
from lmport import EngineConfig, GenerationConfig, ops
from lmport.config import ConfigError
from lmport.models.quantized import QuantLinear
from support.model_helpers import tiny_model_dir

LOGIT_ATOL = 2e-3
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # AutoAWQ's GEMM nibble order (awq/utils/packing_utils.py)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool):
    """Round-to-nearest per group: codes [out, in] (unsigned), float16 scales and int zeros [out, groups]."""
    maxq = 2 ** bits - 1
    g = w.reshape(w.shape[0], -1, group)
    if sym:
        scales = (g.abs().amax(-1) / ((maxq + 1) / 2 - 1)).clamp(min=1e-8)
        zeros = torch.full_like(scales, (maxq + 1) // 2, dtype=torch.long)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((hi - lo) / maxq).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, maxq).long()
    scales = scales.half()
    codes = torch.clamp(torch.round(g / scales.float()[..., None]) + zeros[..., None], 0, maxq).long()
    return codes.reshape(w.shape), scales, zeros


def dequantized(codes, scales, zeros, group):
    s = scales.float().repeat_interleave(group, dim=1)
    return (codes - zeros.repeat_interleave(group, dim=1)).float() * s


def int32_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., 32/bits * w] codes -> [..., w] int32, value j of each word at bits j*bits (wrapping to int32)."""
    per = 32 // bits
    v = values.reshape(*values.shape[:-1], -1, per).long()
    words = sum(v[..., j] << (bits * j) for j in range(per))
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def pack_awq(codes, scales, zeros, group):
    """AutoAWQ GEMM: qweight [in, out/8] and qzeros [in/group, out/8], nibble i = column 8c + AWQ_ORDER[i]."""
    def pack(m):   # m [rows, out]
        cols = m.reshape(m.shape[0], -1, 8)[..., list(AWQ_ORDER)]
        return int32_words(cols.flatten(1), 4)
    return {"qweight": pack(codes.T), "qzeros": pack(zeros.T), "scales": scales.T.contiguous()}


def pack_gptq(codes, scales, zeros, group, bits):
    """GPTQ v1: qweight [in*bits/32, out] packed along in; qzeros [in/group, out*bits/32] of zero - 1."""
    qweight = int32_words(codes, bits).T.contiguous()      # each output row's inputs, then [in*bits/32, out]
    return {"qweight": qweight, "qzeros": int32_words(zeros.T - 1, bits), "scales": scales.T.contiguous(),
            "g_idx": (torch.arange(codes.shape[1]) // group).to(torch.int32)}


def config_entry(method: str, bits: int, group: int, sym: bool) -> dict:
    if method == "awq":   # as AutoAWQ writes it
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": sym,  # GPTQModel
            "lm_head": False, "checkpoint_format": "gptq", "pack_dtype": "int32", "true_sequential": True,
            "meta": {"quantizer": ["gptqmodel:2.2.0"]}}


def build(tmp_path, arch, method, bits, group, sym):
    """Writes the quantized checkpoint; returns it and transformers' model over the dequantized weights."""
    from transformers import AutoModelForCausalLM
    from support import model_helpers as models
    cfg = models._tiny_config(arch)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 128, 256, 32
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tensors = {}
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        codes, scales, zeros = quantize(module.weight.data, bits, group, sym)
        packed = (pack_awq(codes, scales, zeros, group) if method == "awq"
                  else pack_gptq(codes, scales, zeros, group, bits))
        tensors |= {f"{name}.{k}": v for k, v in packed.items()}
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias.data.half()
        module.weight.data = dequantized(codes, scales, zeros, group)
    quantized_names = {f"{n}.weight" for n, m in hf.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS}
    for name, t in hf.state_dict().items():
        if name not in quantized_names and name not in tensors:
            tensors[name] = t.half() if t.is_floating_point() else t
    # Biases and norms are float16 in the checkpoint: the reference uses the same rounded values.
    for name, t in hf.state_dict().items():
        if name not in quantized_names:
            t.copy_(tensors[name].float())
    directory = tmp_path / f"{arch}-{method}-{bits}-{group}"
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    config = cfg.to_dict() | {"quantization_config": config_entry(method, bits, group, sym), "torch_dtype": "float16"}
    (directory / "config.json").write_text(json.dumps(config))
    for f in Path(tiny_model_dir(arch)).glob("*token*"):
        shutil.copy(f, directory / f.name)
    return directory, hf


CASES = [("llama", "awq", 4, 128, False), ("qwen2", "awq", 4, 64, False), ("llama", "gptq", 4, 128, True),
         ("qwen2", "gptq", 4, 64, False), ("llama", "gptq", 8, 128, True), ("qwen2", "gptq", 8, 32, False)]


@pytest.mark.parametrize("arch,method,bits,group,sym", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_quantized_checkpoint_matches_its_dequantized_model(tmp_path, arch, method, bits, group, sym):
    directory, hf = build(tmp_path, arch, method, bits, group, sym)
    pipe = lmport.pipeline(str(directory), backend_config=EngineConfig(device_type="cpu", cache_max_entry_count=64))
    engine = pipe.engine
    layer = engine.model.model.layers[0].self_attn.qkv_proj   # q, k and v, merged at load
    assert isinstance(layer, QuantLinear) and layer.bits == bits and layer.group_size == group
    ids = torch.randint(3, 49152, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
    # Prefill (dequantize + BLAS) of 20 tokens, then 4 decode steps (the integer kernel).
    seq = engine.seqs[engine.add_request(ids, GenerationConfig(max_new_tokens=1))]
    engine.scheduler.schedule()
    got = []
    for start, n in [(0, 20), (20, 1), (21, 1), (22, 1), (23, 1)]:
        meta = ops.build_attention_metadata([n], [start + n], [seq.block_table], engine.layout.block_size)
        got.append(engine.model.logits(engine.model(torch.tensor(ids[start:start + n]), meta, engine.caches)))
    diff = (torch.cat(got) - want).abs().max().item()
    assert diff < LOGIT_ATOL, diff
    pipe.close()


def test_unsupported_quantization_configs_are_refused_before_loading(tmp_path):
    directory, _ = build(tmp_path, "llama", "gptq", 4, 128, True)
    config = json.loads((directory / "config.json").read_text())
    for change, words in [({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
                          ({"bits": 3}, "bits=3 is not supported"), ({"group_size": -1}, "group_size=-1"),
                          ({"desc_act": True}, "desc_act=true")]:
        (directory / "config.json").write_text(json.dumps(
            config | {"quantization_config": config["quantization_config"] | change}))
        with pytest.raises(ConfigError, match=words):
            lmport.pipeline(str(directory), backend_config=EngineConfig(device_type="cpu"))


def test_corrupt_tensor_is_named(tmp_path):
    directory, _ = build(tmp_path, "llama", "awq", 4, 128, False)
    from safetensors.torch import load_file
    tensors = load_file(str(directory / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.scales"
    tensors[name] = tensors[name][:, :-8].contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj"):
        lmport.pipeline(str(directory), backend_config=EngineConfig(device_type="cpu"))
