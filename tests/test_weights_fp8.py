"""fp8 (float8 e4m3) checkpoints: tiny random-weight Llama and Qwen3 models made in bfloat16, their projections
quantized to fp8 by a writer written here from the published formats, in the three scale layouts users download:

- "ct-tensor": compressed-tensors, strategy "tensor" (llm-compressor's FP8 scheme: a float32 weight_scale [1] and a
  static input_scale [1] per Linear);
- "ct-channel": compressed-tensors, strategy "channel" (FP8_DYNAMIC: a bfloat16 weight_scale [out, 1], activations
  quantized per token at run time, so no input_scale);
- "fp8-block": quant_method "fp8" with weight_block_size [128, 128] (DeepSeek-V3/R1, Qwen3-FP8: a float32
  weight_scale_inv [out / 128, in / 128]).

References: for "fp8-block", transformers' own loader (``FineGrainedFP8Config(dequantize=True)``, which dequantizes
on CPU); for the compressed-tensors layouts, whose transformers loader needs the compressed-tensors package (not a
dependency of lmport), compressed-tensors' documented ``dequantize`` (``x_q.to(scale.dtype) * scale``, then the
model's dtype), written out here, and transformers' model holding those weights.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lmport
from lmport import EngineConfig
from lmport.config import ConfigError
from lmport.weights import fp8
from support.greedy import lmport_greedy, prompts
from support.model_helpers import _tiny_config, tiny_model_dir

E4M3_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYOUTS = ("ct-tensor", "ct-channel", "fp8-block")


def quantize_for(layout: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a quantizer writes for one Linear's weight ``w`` [out, in] (bfloat16): the e4m3 codes under
    "weight" and its scale (and, for a static scheme, the activation scale) under their published names."""
    w = w.float()
    n, k = w.shape
    if layout == "fp8-block":
        blocks = w.reshape(n // 128, 128, k // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
        codes = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"weight": codes.reshape(n, k), "weight_scale_inv": scale}
    if layout == "ct-tensor":
        scale = (w.abs().amax() / E4M3_MAX).reshape(1)
        return {"weight": (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), "weight_scale": scale,
                "input_scale": torch.tensor([0.02])}
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(torch.bfloat16)     # ct-channel
    return {"weight": (w / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), "weight_scale": scale}


def reference_dequantized(layout: str, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' dequantize: the codes in the scale's dtype times the scale (broadcast per tensor or per
    row), then ``dtype``. (fp8-block's reference is transformers' loader itself.)"""
    scale = t["weight_scale"]
    return (t["weight"].to(scale.dtype) * scale).to(dtype)


def quantization_config(layout: str) -> dict:
    if layout == "fp8-block":   # as DeepSeek-V3's config.json
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    static = layout == "ct-tensor"
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor" if static else "token",
                   "dynamic": not static, "group_size": None, "block_structure": None, "observer": None}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": layout.removeprefix("ct-"),
               "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None}


def build(tmp_path: Path, arch: str, layout: str, **dims) -> tuple[Path, dict]:
    """The fp8 checkpoint of a tiny bfloat16 ``arch`` model; returns it and what the writer wrote. The writer
    quantizes the bfloat16 checkpoint's tensors as transformers saves them (experts one by one)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    cfg = _tiny_config(arch)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 256, 384, 64   # whole 128 x 128 blocks
    for key, value in dims.items():
        setattr(cfg, key, value)
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    saved = {}
    for file in sorted((tmp_path / "bf16").glob("*.safetensors")):
        saved |= load_file(str(file))
    tensors = {}
    for name, t in saved.items():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and module.rsplit(".", 1)[-1] in PROJECTIONS:
            tensors |= {f"{module}.{k}": v.contiguous() for k, v in quantize_for(layout, t).items()}
        else:
            tensors[name] = t
    directory = tmp_path / f"{arch}-{layout}"
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    config = cfg.to_dict() | {"quantization_config": quantization_config(layout), "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config))
    for f in Path(tiny_model_dir(arch)).glob("*token*"):
        shutil.copy(f, directory / f.name)
    return directory, tensors


def transformers_reference(directory: Path, layout: str, written: dict, dtype: torch.dtype):
    """transformers' model over the checkpoint's dequantized weights (see the module's docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    if layout == "fp8-block":
        return AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype, quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    cfg = AutoConfig.from_pretrained(directory)
    del cfg.quantization_config
    hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    state = {}
    for name in hf.state_dict():
        module = name.removesuffix(".weight")
        if f"{module}.weight_scale" in written:
            group = {k: written[f"{module}.{k}"] for k in ("weight", "weight_scale")}
            state[name] = reference_dequantized(layout, group, dtype)
        elif name in written:
            state[name] = written[name].to(dtype)
    hf.load_state_dict(state, strict=False)
    tied = [n for n in hf.state_dict() if n not in state]
    assert tied in ([], ["lm_head.weight"]), tied
    return hf


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dequantized_weights_equal_the_reference_exactly(tmp_path, layout):
    directory, written = build(tmp_path, "llama", layout)
    checkpoint = fp8.read_checkpoint(directory)
    assert checkpoint is not None
    quantized, floats = fp8.load_tensors(directory, checkpoint, torch.bfloat16)
    assert len(quantized) == 2 * len(PROJECTIONS)
    assert not any(name.endswith(("scale", "scale_inv")) for name in floats)   # input_scale is read past
    layouts = {w.layout for w in quantized.values()}
    assert layouts == {{"ct-tensor": "tensor", "ct-channel": "channel", "fp8-block": "block"}[layout]}
    if layout == "fp8-block":
        want = transformers_reference(directory, layout, written, torch.bfloat16).state_dict()
    for name, weight in quantized.items():
        got = fp8.dequantize(weight, torch.bfloat16)
        if layout == "fp8-block":
            reference = want[name]
        else:
            module = name.removesuffix(".weight")
            reference = reference_dequantized(
                layout, {k: written[f"{module}.{k}"] for k in ("weight", "weight_scale")}, torch.bfloat16)
        assert torch.equal(got, reference), name


NEW_TOKENS = 8
# One case of each architecture runs by default (about 15 s each on two loaded cores); the rest are slow.
DEFAULT_CASES = {("llama", "fp8-block"), ("qwen3", "ct-channel")}
CASES = [pytest.param(arch, layout, id=f"{arch}-{layout}",
                      marks=() if (arch, layout) in DEFAULT_CASES else pytest.mark.slow)
         for arch in ("llama", "qwen3") for layout in LAYOUTS]


def transformers_greedy(hf, ids: list[list[int]]) -> list[list[int]]:
    want = []
    with torch.inference_mode():
        for p in ids:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)
            want.append(out[0, len(p):].tolist())
    return want


@pytest.mark.parametrize("arch,layout", CASES)
def test_greedy_tokens_equal_transformers_on_the_dequantized_checkpoint(tmp_path, arch, layout):
    """cpu, weight_format='dequantize', float32: lmport's tokens against transformers' generate over the same
    dequantized weights, and the weights lmport computes with are those weights."""
    directory, written = build(tmp_path, arch, layout)
    hf = transformers_reference(directory, layout, written, torch.float32)
    ids = prompts(3, seed=5, lengths=(5, 17, 40))
    with lmport.pipeline(str(directory), backend_config=EngineConfig(
            device_type="cpu", dtype="float32", weight_format="dequantize", cache_max_entry_count=64)) as pipe:
        qkv = pipe.engine.model.model.layers[1].self_attn.qkv_proj.weight   # q, k and v merged at load
        hf_attn = hf.model.layers[1].self_attn
        assert torch.equal(qkv, torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight]))
        got = lmport_greedy(pipe, ids, NEW_TOKENS)
    assert got == transformers_greedy(hf, ids)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_keeps_fp8_weights_and_its_tokens_equal_transformers(tmp_path, layout):
    """The cuda backend (its Triton kernels under the interpreter on CPU tensors, float32): the projections stay
    fp8 (Fp8Linear, run by the fp8 kernel) and the greedy tokens are transformers' on the dequantized weights."""
    from lmport.backends.cuda import CudaBackend
    from lmport.models.quantized import Fp8Linear
    directory, written = build(tmp_path, "llama", layout)
    hf = transformers_reference(directory, layout, written, torch.float32)
    ids = prompts(2, seed=5, lengths=(5, 17))
    config = EngineConfig(device_type="cuda", dtype="float32", cache_max_entry_count=64, eager_mode=True)
    with lmport.pipeline(str(directory), backend_config=config, backend=CudaBackend(device="cpu")) as pipe:
        layer = pipe.engine.model.model.layers[0]
        assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
        got = lmport_greedy(pipe, ids, NEW_TOKENS)
    assert got == transformers_greedy(hf, ids)


def test_cpu_refuses_fp8_weights_without_the_option_before_loading(tmp_path, monkeypatch):
    directory, _ = build(tmp_path, "llama", "fp8-block")
    from lmport.engine.engine import Engine
    from lmport.worker import runner

    def no_load(*args, **kwargs):
        raise AssertionError("refused only after loading weights")
    monkeypatch.setattr(runner, "load_model", no_load)
    with pytest.raises(ConfigError) as err:
        Engine(str(directory), EngineConfig(device_type="cpu"))
    message = str(err.value)
    assert "'cpu'" in message and "block" in message and "cuda" in message
    assert "weight_format='dequantize'" in message and "--weight-format dequantize" in message


@pytest.mark.parametrize("change,words", [
    ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"weight_block_size": [128]}, "weight_block_size"),
])
def test_unsupported_fp8_configs_are_refused_even_when_dequantizing(tmp_path, change, words):
    directory, _ = build(tmp_path, "llama", "fp8-block")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] |= change
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=words):
        lmport.pipeline(str(directory), backend_config=EngineConfig(device_type="cpu", weight_format="dequantize"))


@pytest.mark.parametrize("change,words", [
    ({"strategy": "group", "group_size": 128}, "strategy='group'"),
    ({"num_bits": 4, "type": "int"}, "num_bits=4"),
    ({"dynamic": True}, "static weight scales"),
])
def test_compressed_tensors_schemes_other_than_fp8_weights_are_refused(tmp_path, change, words):
    directory, _ = build(tmp_path, "llama", "ct-channel")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"] |= change
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=words):
        fp8.read_checkpoint(directory)


def test_a_scale_of_the_wrong_shape_is_named(tmp_path):
    directory, written = build(tmp_path, "llama", "fp8-block")
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    written[name] = written[name][:, :1].contiguous()
    save_file(written, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        lmport.pipeline(str(directory), backend_config=EngineConfig(device_type="cpu", weight_format="dequantize"))


def test_mixture_of_experts_loads_dequantized_and_its_tokens_equal_transformers(tmp_path):
    """Qwen3-MoE with 128 x 128 block-scaled experts (stored one by one, as Qwen3-30B-A3B-FP8): cuda keeps them fp8
    (tests/test_fp8_experts.py), and with weight_format='dequantize' the experts are stacked as lmport holds them and
    the greedy tokens are transformers' on the same checkpoint."""
    from lmport.backends.cuda import CudaBackend
    from lmport.weights.checkpoint import check_backend
    directory, written = build(tmp_path, "qwen3-moe", "fp8-block", moe_intermediate_size=128)
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" in written
    assert check_backend(directory, CudaBackend.capabilities)   # kept fp8
    hf = transformers_reference(directory, "fp8-block", written, torch.float32)
    ids = prompts(3, seed=5, lengths=(5, 17, 40))
    with lmport.pipeline(str(directory), backend_config=EngineConfig(
            device_type="cpu", dtype="float32", weight_format="dequantize", cache_max_entry_count=64)) as pipe:
        experts = pipe.engine.model.model.layers[1].mlp.experts
        assert torch.equal(experts.gate_up_proj, hf.model.layers[1].mlp.experts.gate_up_proj)
        assert torch.equal(experts.down_proj, hf.model.layers[1].mlp.experts.down_proj)
        got = lmport_greedy(pipe, ids, NEW_TOKENS)
    assert got == transformers_greedy(hf, ids)


def test_short_edge_blocks_dequantize_as_compressed_tensors_pads_them():
    """A [200, 320] weight in 128 x 128 blocks (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: 4.5 blocks):
    compressed-tensors' block strategy pads the weight to whole blocks, scales each block and crops the padding;
    lmport's dequantization is the same, bit for bit."""
    g = torch.Generator().manual_seed(2)
    codes = (torch.randn(200, 320, generator=g) * 100).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=g) + 0.01
    padded = torch.zeros(256, 384)
    padded[:200, :320] = codes.float()
    blocks = padded.reshape(2, 128, 3, 128).transpose(1, 2) * scale[:, :, None, None]
    want = blocks.transpose(1, 2).reshape(256, 384)[:200, :320].to(torch.bfloat16)
    got = fp8.dequantize(fp8.Fp8Weight(codes, scale, 128, 128).check(), torch.bfloat16)
    assert torch.equal(got, want)
