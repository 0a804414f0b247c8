"""fp8 mixture-of-experts checkpoints: the routed experts stay float8 e4m3 with their 128 x 128 block scales (the
bytes the file has), stacked over the experts (lmport.weights.fp8.stack_quantized_experts) and run expert by expert
through the backend's fp8 linear (Backend.quantized_moe).

The checkpoint is a tiny random-weight Qwen3-MoE made in bfloat16 and quantized as Qwen3-30B-A3B-FP8 and
DeepSeek-V3 are published (``quant_method: "fp8"``, ``weight_block_size: [128, 128]``, float32 ``weight_scale_inv``
beside each e4m3 weight, the experts one by one): tests/test_weights_fp8.py's writer. The reference is transformers'
own fp8 loader, which dequantizes on CPU (``FineGrainedFP8Config(dequantize=True)``).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import lmport
from lmport import EngineConfig, ops
from lmport.config import ConfigError
from lmport.models.quantized import QuantExperts
from lmport.weights import fp8
from support.greedy import lmport_greedy, prompts
from test_weights_fp8 import NEW_TOKENS, build, transformers_greedy, transformers_reference

EXPERTS, INTER, HIDDEN = 8, 128, 256   # whole 128 x 128 blocks (build's hidden size)


def fp8_qwen3_moe(tmp_path):
    return build(tmp_path, "qwen3-moe", "fp8-block", moe_intermediate_size=INTER)


def test_stacked_experts_keep_the_files_bytes_and_dequantize_to_transformers_weights(tmp_path):
    """Loaded (cuda's backend class on CPU tensors: nothing runs), layer 1's experts are one fp8 weight each for
    gate, up and down, [8 x rows, inputs] float8_e4m3fn with the files' float32 scales beside them: exactly the
    file's expert bytes, and dequantized exactly transformers' experts."""
    from lmport.backends.cuda import CudaBackend
    from lmport.models.loader import load_model
    directory, written = fp8_qwen3_moe(tmp_path)
    hf = transformers_reference(directory, "fp8-block", written, torch.float32)
    loaded = load_model(str(directory), CudaBackend(device="cpu"), torch.float32)
    experts = loaded.model.model.layers[1].mlp.experts
    assert isinstance(experts, QuantExperts)
    # the other fp8 weights load in the compute dtype (q, k and v merged at load, as float projections are)
    assert loaded.model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float32
    gate, up, down = (m.quantized for m in (experts.gate_proj, experts.up_proj, experts.down_proj))
    for w, rows, inputs in ((gate, INTER, HIDDEN), (up, INTER, HIDDEN), (down, HIDDEN, INTER)):
        assert isinstance(w, fp8.Fp8Weight) and w.qweight.dtype == torch.float8_e4m3fn
        assert tuple(w.qweight.shape) == (EXPERTS * rows, inputs)
        assert w.scale.dtype == torch.float32 and tuple(w.scale.shape) == (EXPERTS * rows // 128, inputs // 128)
    prefix = "model.layers.1.mlp.experts."
    file_bytes = sum(t.numel() * t.element_size() for name, t in written.items() if name.startswith(prefix))
    assert sum(w.nbytes() for w in (gate, up, down)) == file_bytes == EXPERTS * 3 * (INTER * HIDDEN + 2 * 4)
    want = hf.model.layers[1].mlp.experts
    stacked = torch.cat([fp8.dequantize(gate, torch.float32).unflatten(0, (EXPERTS, INTER)),
                         fp8.dequantize(up, torch.float32).unflatten(0, (EXPERTS, INTER))], dim=1)
    assert torch.equal(stacked, want.gate_up_proj)
    assert torch.equal(fp8.dequantize(down, torch.float32).unflatten(0, (EXPERTS, HIDDEN)), want.down_proj)

    # The default Backend path (the reference ops: each expert's fp8 weight dequantized as it runs) against
    # transformers' experts on the dequantized weights.
    from lmport.platform.backend import Backend
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, HIDDEN, generator=g)
    weights, ids = ops.route(torch.randn(9, EXPERTS, generator=g), 2, renormalize=False)
    got = Backend("cpu").quantized_moe(x, experts.described(), weights, ids)
    torch.testing.assert_close(got, ops.fused_moe(x, want.gate_up_proj, want.down_proj, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_greedy_tokens_with_fp8_experts_equal_transformers(tmp_path):
    """The cuda backend (its Triton fp8 kernel under the interpreter on CPU tensors, float32) with the routed experts
    kept fp8 (the other projections dequantized at load): the greedy tokens are transformers' on the dequantized
    checkpoint."""
    from lmport.backends.cuda import CudaBackend
    directory, written = fp8_qwen3_moe(tmp_path)
    hf = transformers_reference(directory, "fp8-block", written, torch.float32)
    ids = prompts(2, seed=5, lengths=(5, 17))
    config = EngineConfig(device_type="cuda", dtype="float32", cache_max_entry_count=64, eager_mode=True)
    with lmport.pipeline(str(directory), backend_config=config, backend=CudaBackend(device="cpu")) as pipe:
        experts = pipe.engine.model.model.layers[1].mlp.experts
        assert isinstance(experts, QuantExperts) and experts.down_proj.quantized.qweight.dtype == torch.float8_e4m3fn
        got = lmport_greedy(pipe, ids, NEW_TOKENS)
    assert got == transformers_greedy(hf, ids)


def test_experts_whose_rows_end_inside_a_block_are_refused_stacked():
    """An expert of 200 rows in 128-row blocks ends in a short block: stacked, the next expert's rows would share
    it; refused, naming weight_format='dequantize'. Rows inside one block (a short single block) stack."""
    g = torch.Generator().manual_seed(5)

    def weight(rows: int) -> fp8.Fp8Weight:
        return fp8.quantize(torch.randn(rows, 64, generator=g), 128, 128)

    experts = {f"m.experts.{e}.{part}.weight": weight(200) for e in range(2) for part in ("gate_proj", "up_proj")}
    experts |= {f"m.experts.{e}.down_proj.weight": weight(96) for e in range(2)}
    with pytest.raises(ValueError, match="m.experts.gate_proj: an expert's 200 rows.*weight_format='dequantize'"):
        fp8.stack_quantized_experts(experts)
    small = {name: weight(96) for name in experts}
    down = fp8.stack_quantized_experts(small)["m.experts.down_proj"]
    assert (down.block_out, tuple(down.scale.shape)) == (96, (2, 1))
    assert torch.equal(fp8.dequantize(down.row_range(96, 192), torch.float32),
                       fp8.dequantize(small["m.experts.1.down_proj.weight"], torch.float32))


def test_experts_missing_one_or_a_part_are_named():
    """A block whose experts skip a number, or whose expert lacks a projection, is refused naming the block, in fp8
    and in float alike."""
    w = fp8.quantize(torch.ones(128, 128), 128, 128)
    parts = ("gate_proj", "up_proj", "down_proj")
    skipped = {f"m.experts.{e}.{part}.weight": w for e in (0, 2) for part in parts}
    lacking = {f"m.experts.0.{part}.weight": w for part in parts[:2]}
    for experts in (skipped, lacking):
        with pytest.raises(ValueError, match=r"m\.experts: experts \[0.*numbered from 0.*down_proj"):
            fp8.stack_quantized_experts(experts)
        with pytest.raises(ValueError, match=r"m\.experts: experts \[0.*numbered from 0.*down_proj"):
            fp8.stack_experts({name: torch.ones(128, 128) for name in experts})


def test_a_tp_slice_of_the_experts_is_whole_scale_blocks():
    """Under tp each rank keeps a slice of every expert's intermediate rows (gate and up by rows, down by inputs);
    fp8 experts are cut in whole 128 x 128 blocks (or a piece inside one block, which keeps its scale), their scales
    with them, and a tp whose slices would cut blocks otherwise is named before any weight loads."""
    checkpoint = fp8.Fp8Checkpoint("fp8", frozenset({"block"}), (128, 128), "weight_scale_inv")
    assert fp8.expert_split_problem(checkpoint, 2048, 8) is None   # DeepSeek-V3: 256 rows a rank, 2 blocks
    assert fp8.expert_split_problem(checkpoint, 2048, 32) is None  # 64 rows a rank, inside one block
    # Qwen3-30B-A3B (768 intermediate rows) at tp=4: 192 rows a rank, one block and a half
    assert "192 of every routed expert's 768" in (fp8.expert_split_problem(checkpoint, 768, 4) or "")
    g = torch.Generator().manual_seed(4)
    gates = [torch.randn(256, 384, generator=g) for _ in range(3)]
    downs = [torch.randn(384, 256, generator=g) for _ in range(3)]
    gate = fp8.stack_quantized_experts({f"b.experts.{e}.{p}.weight": fp8.quantize(w, 128, 128) for e in range(3)
                                        for p, w in (("gate_proj", gates[e]), ("up_proj", gates[e]),
                                                     ("down_proj", downs[e]))})
    piece = fp8.expert_slice(gate["b.experts.gate_proj"], 3, 128, 256, by_inputs=False)
    full = fp8.dequantize(gate["b.experts.gate_proj"], torch.float32).unflatten(0, (3, 256))
    assert torch.equal(fp8.dequantize(piece, torch.float32).unflatten(0, (3, 128)), full[:, 128:])
    down = fp8.expert_slice(gate["b.experts.down_proj"], 3, 128, 256, by_inputs=True)
    assert torch.equal(fp8.dequantize(down, torch.float32),
                       fp8.dequantize(gate["b.experts.down_proj"], torch.float32)[:, 128:])
    with pytest.raises(ValueError, match="rows 64:192 of each expert cut"):
        fp8.expert_slice(gate["b.experts.gate_proj"], 3, 64, 192, by_inputs=False)


# -- the plan of the released DeepSeek-V3 checkpoint ---------------------------------------------------------------

DEEPSEEK_V3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}   # its config.json's quantization_config


def deepseek_v3_fp8_config(tmp_path, **change) -> str:
    """tests/test_deepseek_v3.py's REAL_CONFIG_DIR config.json with the released quantization_config."""
    from test_deepseek_v3 import REAL_CONFIG_DIR
    config = json.loads((REAL_CONFIG_DIR / "config.json").read_text()) | {"quantization_config": DEEPSEEK_V3_FP8}
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    return str(tmp_path)


def deepseek_v3_rank_bytes(tp: int) -> dict[str, int]:
    """A rank's weights, by hand (hidden h = 7168, 128 / tp heads, bfloat16 but the routed experts):

        attention   q_a 1536 h + q_b heads x 192 x 1536 + kv_a 576 h + k_b heads x 512 x 128
                    + v_b heads x 128 x 512 + o heads x 128 x h + norms 1536 + 512 + 2 h      (61 layers)
        dense MLP   3 x h x 18432 / tp                                                      (3 layers)
        MoE         router 256 h + shared expert 3 x h x 2048 / tp                          (58 layers)
        vocabulary  embedding and LM head, 129280 / tp rows each, and the final norm
    at 2 B; the routed experts, 58 layers x 256 x 3 x h x 2048 / tp, at 1 B, and a float32 scale per 128 x 128 block
    of each expert's gate and up (2048 / tp / 128 x 56 blocks each) and down (56 x 2048 / tp / 128)."""
    h, heads, inter = 7168, 128 // tp, 2048 // tp
    attention = (1536 * h + heads * 192 * 1536 + 576 * h + heads * 512 * 128 + heads * 128 * 512 + heads * 128 * h
                 + 1536 + 512 + 2 * h)
    other = 61 * attention + 3 * (3 * h * 18432 // tp) + 58 * (256 * h + 3 * h * 2048 // tp) + 2 * 129280 // tp * h + h
    blocks = math.ceil(h / 128)
    return {"bfloat16": 2 * other, "fp8 e4m3": 58 * 256 * 3 * h * inter,
            "fp8 scales": 58 * 256 * (2 * math.ceil(inter / 128) * blocks + blocks * math.ceil(inter / 128)) * 4}


def test_plan_counts_deepseek_v3s_routed_experts_in_fp8(tmp_path):
    """The whole model on one device: 17,117,633,536 parameters at 2 B and 653,908,770,816 routed-expert weights at
    1 B with 159,645,696 B of block scales: 688,303,683,584 B (671,026,404,352 parameters); the latent cache
    70,272 B a token as in bfloat16."""
    from lmport.memory.plan import build_plan
    report = build_plan(deepseek_v3_fp8_config(tmp_path), EngineConfig(device_type="cuda", dtype="bfloat16"),
                        device_memory=2 << 40)
    want = deepseek_v3_rank_bytes(1)
    assert want == {"bfloat16": 2 * 17_117_633_536, "fp8 e4m3": 653_908_770_816, "fp8 scales": 159_645_696}
    assert report["weights"]["bytes_by_dtype"] == want
    assert report["weights"]["bytes"] == 688_303_683_584
    assert report["weights"]["parameters"] == 17_117_633_536 + 653_908_770_816
    assert report["kv"]["bytes_per_token"] == 61 * 576 * 2 == 70272


# -- DeepSeek-V3 -------------------------------------------------------------------------------------------------

def block_quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's weight quantization, written here: ``w`` padded to whole 128 x 128 blocks, a float32 scale a block
    (its largest magnitude / 448), the codes e4m3, the padding cropped."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
    padded[:n, :k] = w.float()
    blocks = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))   # [row blocks, 128, input blocks, 128]
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    codes = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.flatten(2, 3).flatten(0, 1)[:n, :k].contiguous(), scale


def block_dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    padded = torch.zeros(scale.shape[0] * 128, scale.shape[1] * 128)
    padded[:n, :k] = codes.float()
    blocks = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)) * scale[:, None, :, None]
    return blocks.flatten(2, 3).flatten(0, 1)[:n, :k].contiguous()


def fp8_deepseek_v3(tmp_path: Path, arch: str = "q-lora") -> tuple[Path, Path]:
    """tests/test_deepseek_v3.py's tiny model written as DeepSeek-V3 is published: every linear weight of its layers
    (attention, the dense and shared-expert MLPs, each routed expert one by one) as e4m3 codes with a float32
    weight_scale_inv per 128 x 128 block (one short block: the tiny weights are smaller than a block), the router,
    norms, embeddings and head as they were; and the float32 checkpoint of the weights those codes dequantize to, the
    reference transformers loads."""
    from safetensors.torch import load_file, save_file
    from test_deepseek_v3 import tiny_model_dir as deepseek_dir
    source = Path(deepseek_dir(arch))
    saved = {}
    for file in sorted(source.glob("*.safetensors")):
        saved |= load_file(str(file))
    written, reference = {}, {}
    for name, t in saved.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and t.dim() == 2 and ".layers." in name and not module.endswith("mlp.gate"):
            codes, scale = block_quantized(t)
            written |= {name: codes, f"{module}.weight_scale_inv": scale}
            reference[name] = block_dequantized(codes, scale)
        else:
            written[name] = reference[name] = t
    assert "model.layers.2.mlp.experts.7.down_proj.weight_scale_inv" in written
    config = json.loads((source / "config.json").read_text())
    directories = []
    for kind, tensors, extra in (("fp8", written, {"quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}),
            ("dequantized", reference, {})):
        directory = tmp_path / f"deepseek-v3-{arch}-{kind}"
        shutil.copytree(source, directory, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        save_file(tensors, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(config | extra))
        directories.append(directory)
    return directories[0], directories[1]


def test_deepseek_v3_fp8_experts_load_fp8_and_each_tp_rank_holds_its_slice(tmp_path):
    """Loaded whole (tp=1) the routed experts are fp8 (the rest, turned at load as DeepSeek-V3's attention is, in
    float32); loaded as either of two ranks, each keeps its half of every expert's intermediate rows in fp8 (inside
    the one short scale block, with its scale), and the two ranks' partial outputs (the default Backend path) sum to
    the whole experts' output."""
    from lmport.backends.cuda import CudaBackend
    from lmport.models.loader import load_model
    from lmport.parallel import TPGroup
    from lmport.platform.backend import Backend
    directory, _ = fp8_deepseek_v3(tmp_path)
    cpu = Backend("cpu")   # the reference ops
    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, 64, generator=g)
    weights, ids = ops.route(torch.randn(7, 8, generator=g), 3, renormalize=True)

    def experts_of(tp: TPGroup | None):
        loaded = load_model(str(directory), CudaBackend(device="cpu"), torch.float32, tp=tp)
        return loaded.model.model.layers[1].mlp.experts

    whole = experts_of(None)
    assert isinstance(whole, QuantExperts) and whole.gate_proj.quantized.qweight.dtype == torch.float8_e4m3fn
    assert tuple(whole.gate_proj.quantized.qweight.shape) == (8 * 32, 64)
    want = cpu.quantized_moe(x, whole.described(), weights, ids)
    halves = [experts_of(TPGroup(rank, 2)) for rank in (0, 1)]
    for half in halves:
        gate, down = half.gate_proj.quantized, half.down_proj.quantized
        assert gate.qweight.dtype == torch.float8_e4m3fn and tuple(gate.qweight.shape) == (8 * 16, 64)
        assert tuple(down.qweight.shape) == (8 * 64, 16)
    got = sum(cpu.quantized_moe(x, half.described(), weights, ids) for half in halves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deepseek_v3_greedy_tokens_with_fp8_experts_equal_transformers(tmp_path):
    """The cuda backend on CPU tensors (its Triton kernels under the interpreter, float32), the routed experts kept
    fp8: the greedy tokens are transformers' on the weights the fp8 checkpoint dequantizes to."""
    from transformers import AutoModelForCausalLM

    from lmport.backends.cuda import CudaBackend
    directory, dequantized = fp8_deepseek_v3(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    ids = prompts(2, seed=5, lengths=(5, 17))
    config = EngineConfig(device_type="cuda", dtype="float32", cache_max_entry_count=64, eager_mode=True)
    with lmport.pipeline(str(directory), backend_config=config, backend=CudaBackend(device="cpu")) as pipe:
        assert isinstance(pipe.engine.model.model.layers[1].mlp.experts, QuantExperts)
        got = lmport_greedy(pipe, ids, NEW_TOKENS)
    assert got == transformers_greedy(hf, ids)


def test_plan_of_deepseek_v3_fp8_on_eight_141_gb_devices(tmp_path):
    """tp=8 on devices of 141 GB (``deepseek_v3_rank_bytes(8)``, docs/engine.md): each device holds 3,041,745,920
    parameters at 2 B (6,083,491,840 B) and its slice of the routed experts, 256 of each one's 2048 intermediate rows
    (two 128-row blocks): 81,738,596,352 B of codes and 19,955,712 B of scales; 87,842,043,904 B in all. The latent
    cache is whole on every device (every head reads it): 61 x 576 x 2 = 70,272 B a token."""
    from lmport.memory.plan import build_plan
    from lmport.memory.plan_format import format_plan
    report = build_plan(deepseek_v3_fp8_config(tmp_path), EngineConfig(device_type="cuda", dtype="bfloat16", tp=8),
                        device_memory=141 * 10**9)
    want = deepseek_v3_rank_bytes(8)
    assert want == {"bfloat16": 6_083_491_840, "fp8 e4m3": 81_738_596_352, "fp8 scales": 19_955_712}
    assert report["weights"]["bytes_by_dtype"] == want
    assert [r["weight_bytes"] for r in report["ranks"]] == [sum(want.values())] * 8 == [87_842_043_904] * 8
    assert report["kv"]["bytes_per_token"] == 70272
    assert report["free_after_weights_bytes"] == 141 * 10**9 - 87_842_043_904
    usable = report["free_after_weights_bytes"] - report["activation_reserve"]["bytes"]
    assert report["usable_for_cache_bytes"] == usable
    share = report["config"]["cache_max_entry_count"]
    assert report["cache"]["num_blocks"] == int(usable * share) // (70272 * report["kv"]["block_size"]) > 0
    assert "fp8 e4m3" in format_plan(report)


def test_a_tp_that_cuts_the_experts_scale_blocks_is_refused_before_loading(tmp_path):
    """768 intermediate rows (Qwen3-30B-A3B's width) at tp=4: 192 rows a rank, a block and a half; the tp values
    whose slices are whole blocks or inside one are named."""
    from lmport.memory.plan import build_plan
    with pytest.raises(ConfigError, match=r"tp=4: each of tp=4 ranks would hold 192 of every routed expert's 768 .*"
                                          r"use tp in \[1, 2\].*weight_format='dequantize'"):
        build_plan(deepseek_v3_fp8_config(tmp_path, moe_intermediate_size=768),
                   EngineConfig(device_type="cuda", dtype="bfloat16", tp=4), device_memory=141 * 10**9)
