"""Mixture-of-experts models under tensor parallelism on the cpu backend over gloo.

Each routed and shared expert is split by its intermediate dimension over the ranks (lmport.models.moe), the
router replicated. At tp=2 the greedy tokens of tiny random-weight float32 models equal transformers'
generate: Qwen3-MoE (a dense layer, then 8 experts; the default run's case), Mixtral, GLM-4.5 (grouped routing, a shared
expert), gpt-oss (biased experts, whose down bias must be added once; attention sinks split with their heads)
and DeepSeek-V3 (multi-head latent attention split by heads, shared and routed experts); the others are slow.
At tp=3 (slow: three processes) Qwen3-MoE, gpt-oss and DeepSeek-V3 variants whose heads, KV heads and expert
intermediate sizes 3 divides give transformers' tokens too.

A GGUF's quantized experts split in their blocks (lmport.models.moe.shard_quantized_experts): a tiny Qwen3-MoE
converted by llama.cpp's convert_hf_to_gguf.py and quantized to Q4_K_M by llama-quantize (Q4_K gate and up, Q6_K
and Q4_K down) gives at tp=2 tp=1's greedy tokens on the same file (slow), each rank holding exactly half the
experts' bytes, which at tp=1 are the file's; the ranks' partial expert outputs sum to tp=1's. A tp whose slices
would cut a down projection's 256-value blocks is refused before any worker starts, naming the tensor.

The refusals come from the plan check (lmport.parallel.check_tp), before any worker starts: an expert
intermediate size or a head count that tp does not divide, and the families whose experts are not split (Llama 4,
Qwen3-Next); the tp choices the OOM advisor proposes from leave those out.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.model_helpers import hf_greedy
from support.saved_dirs import own_tmp

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
from lmport.errors import ConfigError
from lmport.parallel import check_tp, tp_choices

PROMPTS = [[1] + list(range(100 + 7 * i, 120 + 13 * i)) for i in range(3)]
NEW_TOKENS = 10


def engine_config(tp: int, **config) -> EngineConfig:
    return EngineConfig(device_type="cpu", dtype="float32", tp=tp, cache_max_entry_count=64, **config)


def greedy(model_dir: str, tp: int, **config) -> list[list[int]]:
    engine = Engine(model_dir, engine_config(tp, **config))
    try:
        return generate(engine)
    finally:
        engine.close()


def generate(engine: Engine) -> list[list[int]]:
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, gen) for p in PROMPTS]
    done: dict = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                done[out.request_id] = out.token_ids
    return [done[i] for i in ids]


def qwen3_moe_dir() -> str:
    from support.model_helpers import tiny_model_dir
    return tiny_model_dir("qwen3-moe")


def mixtral_dir() -> str:
    from support.model_helpers import tiny_model_dir
    return tiny_model_dir("mixtral")


def float_family_dir(arch: str):
    def build() -> str:
        from support.tiny_float_models import tiny_model_dir
        return tiny_model_dir(arch)
    return build


def gpt_oss_biased_dir() -> str:
    """The tiny gpt-oss model (tests/support/tiny_float_models.py) with random expert biases (transformers
    initializes them to zeros): a down bias added on every rank instead of once would change the tokens."""
    import hashlib
    import os
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from lmport.models.loader import cache_root
    source = float_family_dir("gpt-oss")()
    digest = hashlib.sha256(Path(__file__).read_bytes() + source.encode()).hexdigest()[:10]
    target = cache_root() / "test-models" / f"float-tiny-gpt-oss-biased-{digest}"
    if not (target / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        torch.manual_seed(61)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                    p.copy_(torch.randn_like(p) * 0.5)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        for f in Path(source).iterdir():   # the tokenizer's files
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(f, tmp / f.name)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def deepseek_v3_dir() -> str:
    from test_deepseek_v3 import tiny_model_dir
    return tiny_model_dir("q-lora")


def tp3_model_dir(family: str) -> str:
    """The family's tiny model with 6 attention heads, 3 KV heads (DeepSeek-V3's MLA: 6) and an expert
    intermediate size of 48, which 3 divides; norms, routing biases (DeepSeek-V3) and expert biases (gpt-oss)
    random, so that a rank adding them twice or dropping them would change the tokens."""
    import hashlib

    from transformers import AutoModelForCausalLM

    from support.model_helpers import _tiny_config, saved_model
    from support.tiny_float_models import randomize_constants, tiny_config as float_config
    from test_deepseek_v3 import tiny_config as deepseek_config
    base, split = {"qwen3-moe": (lambda: _tiny_config("qwen3-moe"), {"moe_intermediate_size": 48}),
                   "gpt-oss": (lambda: float_config("gpt-oss"), {"intermediate_size": 48}),
                   "deepseek-v3": (lambda: deepseek_config("q-lora"), {"moe_intermediate_size": 48})}[family]
    cfg = base()
    kv_heads = 6 if family == "deepseek-v3" else 3
    cfg = type(cfg)(**(cfg.to_dict() | split | {"num_attention_heads": 6, "num_key_value_heads": kv_heads}))

    def make():
        torch.manual_seed(6103)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        randomize_constants(model, biases=("e_score_correction_bias",))   # norms and routing biases
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                    p.copy_(torch.randn_like(p) * 0.5)
        return model
    digest = hashlib.sha256(cfg.to_json_string().encode()).hexdigest()[:10]
    return saved_model(f"tp3-tiny-{family}-{digest}", make)


FAMILIES = {
    "qwen3-moe": qwen3_moe_dir,
    "mixtral": mixtral_dir,
    "glm4-moe": float_family_dir("glm4-moe"),
    "gpt-oss": gpt_oss_biased_dir,
    "deepseek-v3": deepseek_v3_dir,
}


@pytest.mark.parametrize("family", [
    "qwen3-moe",
    pytest.param("mixtral", marks=pytest.mark.slow),
    pytest.param("glm4-moe", marks=pytest.mark.slow),
    pytest.param("gpt-oss", marks=pytest.mark.slow),
    pytest.param("deepseek-v3", marks=pytest.mark.slow),
])
def test_tp2_greedy_matches_transformers(family):
    model_dir = FAMILIES[family]()
    engine_tokens = greedy(model_dir, tp=2)
    assert engine_tokens == hf_greedy(model_dir, PROMPTS, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss", "deepseek-v3"])
def test_tp3_greedy_matches_transformers(family):
    model_dir = tp3_model_dir(family)
    check_tp(plan_config(model_dir), 3)
    assert greedy(model_dir, tp=3) == hf_greedy(model_dir, PROMPTS, NEW_TOKENS)


def plan_config(model: str):
    from lmport.models.loader import read_model_config
    return read_model_config(model)


def test_a_dimension_3_does_not_divide_is_refused_by_name():
    from support.model_helpers import _tiny_config
    cfg = _tiny_config("qwen3-moe")   # 4 attention heads, 2 KV heads
    with pytest.raises(ConfigError, match=r"tp=3 cannot split this model: its 4 attention heads are not divisible "
                                          r"by tp=3; this model supports tp in \[1, 2, 4\]"):
        check_tp(cfg, 3)
    six_heads = type(cfg)(**(cfg.to_dict() | {"num_attention_heads": 6, "num_key_value_heads": 2}))
    with pytest.raises(ConfigError, match="its 2 KV heads neither divide among nor replicate evenly over 3 ranks"):
        check_tp(six_heads, 3)
    six_heads.num_key_value_heads = 3
    six_heads.moe_intermediate_size = 32
    with pytest.raises(ConfigError, match=r"moe_intermediate_size=32\) is not divisible by tp=3"):
        check_tp(six_heads, 3)
    six_heads.moe_intermediate_size = 48
    check_tp(six_heads, 3)


def test_experts_are_split_by_their_intermediate_dimension():
    """Each rank builds its slice of every expert (gate and up by output, down by input); the router whole."""
    from transformers import AutoConfig

    from lmport.models.architectures import model_class
    from lmport.parallel import TPGroup
    cfg = AutoConfig.from_pretrained(qwen3_moe_dir())
    with torch.device("meta"):
        model = model_class(cfg)(cfg, None, None, TPGroup(1, 2))
    block = model.model.layers[1].mlp
    inter = cfg.moe_intermediate_size
    assert tuple(block.experts.gate_up_proj.shape) == (cfg.num_experts, inter, cfg.hidden_size)
    assert tuple(block.experts.down_proj.shape) == (cfg.num_experts, cfg.hidden_size, inter // 2)
    assert tuple(block.gate.weight.shape) == (cfg.num_experts, cfg.hidden_size)


def test_expert_size_not_divisible_by_tp_is_refused_before_workers_start():
    from support.tiny_float_models import tiny_config
    cfg = tiny_config("gpt-oss")
    cfg.intermediate_size = 30
    with pytest.raises(ConfigError, match=r"intermediate_size=30\) is not divisible by tp=4"):
        check_tp(cfg, 4)
    assert tp_choices(cfg) == [1, 2]   # what the OOM advisor proposes from

    glm = tiny_config("glm4-moe")
    glm.moe_intermediate_size = 34
    with pytest.raises(ConfigError, match=r"moe_intermediate_size=34\) is not divisible by tp=4"):
        check_tp(glm, 4)


def test_a_family_whose_experts_are_not_split_is_refused_before_workers_start(monkeypatch):
    from support.tiny_float_models import tiny_config, tiny_model_dir
    assert tp_choices(tiny_config("llama4")) == [1]
    monkeypatch.setattr("lmport.engine.core.make_executor",
                        lambda *a, **k: pytest.fail("workers started before the tp check"))
    with pytest.raises(ConfigError, match="llama4_text's experts are not split over ranks"):
        Engine(tiny_model_dir("llama4"), EngineConfig(device_type="cpu", tp=2))


# -- a GGUF's quantized experts, split in their blocks ------------------------------------------------------------

def llama_cpp_gguf(name: str, cfg, preset: str) -> Path:
    """A seeded random-weight model of ``cfg`` (norms, and gpt-oss's expert biases, random too) through llama.cpp's
    convert_hf_to_gguf.py (F16) and llama-quantize to ``preset``. Skipped without llama.cpp."""
    import hashlib
    import sys

    from transformers import AutoModelForCausalLM

    from support.llama_cpp_families import _CONVERT_WITH_OWN_TOKENIZER
    from support.model_helpers import saved_model
    from test_gguf_llama_cpp import _out_dir, _run, _tool, quantized

    def make():
        torch.manual_seed(6161)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for parameter_name, p in model.named_parameters():
                if parameter_name.endswith("norm.weight"):
                    p.add_(torch.randn_like(p) * 0.1)
                elif parameter_name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                    p.copy_(torch.randn_like(p) * 0.5)
        return model
    digest = hashlib.sha256(cfg.to_json_string().encode()).hexdigest()[:10]
    source = Path(saved_model(f"gguf-source-{name}-{digest}", make))
    f16 = _out_dir() / f"{source.name}-F16.gguf"
    if not f16.exists():
        tmp = own_tmp(f16)
        _run([sys.executable, "-c", _CONVERT_WITH_OWN_TOKENIZER, _tool("convert_hf_to_gguf.py"), source,
              "--outtype", "f16", "--outfile", tmp, "--model-name", "tiny-random"])
        tmp.replace(f16)
    return quantized(f16, preset)


def quantized_moe_gguf(preset: str = "Q4_K_M") -> Path:
    """A tiny Qwen3-MoE (hidden 256, two layers of 8 experts whose intermediate size is 512: at tp=2 each rank's
    down projection takes 256 inputs, one K-quant block) quantized to ``preset`` (Q4_K_M: gate and up Q4_K, down
    Q4_K on layer 0 and Q6_K on layer 1; Q4_0: lmport's int4 format, blocks of 32)."""
    from transformers import Qwen3MoeConfig
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=512, mlp_only_layers=[], norm_topk_prob=True,
                         initializer_range=0.1)
    return llama_cpp_gguf("qwen3-moe-wide", cfg, preset)


def mxfp4_gpt_oss_gguf() -> Path:
    """The tiny gpt-oss (tests/support/tiny_float_models.py) with an expert intermediate size of 64 (at tp=2 one
    32-value MXFP4 block a rank) and random expert biases, quantized to MXFP4_MOE (experts MXFP4, the rest Q8_0)."""
    from support.tiny_float_models import tiny_config
    cfg = tiny_config("gpt-oss")
    return llama_cpp_gguf("gpt-oss-wide", type(cfg)(**(cfg.to_dict() | {"intermediate_size": 64})), "MXFP4_MOE")


def expert_modules(path: Path, rank: int, tp: int) -> list:
    """Rank ``rank`` of ``tp``'s quantized experts (lmport.models.quantized.QuantExperts), loaded in this process."""
    from lmport.backends.cpu import CpuBackend
    from lmport.models.loader import load_model
    from lmport.models.quantized import QuantExperts
    from lmport.parallel import TPGroup
    model = load_model(str(path), CpuBackend(), torch.float32, TPGroup(rank, tp)).model
    return [m for m in model.modules() if isinstance(m, QuantExperts)]


def held_bytes(experts) -> int:
    return sum(b.numel() * b.element_size() for m in experts for b in m.buffers())


@pytest.mark.parametrize("preset", ["Q4_K_M", "Q4_0"])
def test_quantized_experts_split_in_their_blocks_at_tp2(preset):
    """Each rank holds half of every expert, still quantized: exactly half tp=1's bytes (which, for blocks held as
    the file stores them, are the file's own); and the two ranks' partial outputs sum to the whole experts'
    output. Q4_0 loads into lmport's int4 format, whose codes, scales and mins are cut in runs of 32 inputs."""
    from lmport.weights import gguf
    path = quantized_moe_gguf(preset)
    whole = expert_modules(path, 0, 1)
    ranks = [expert_modules(path, r, 2) for r in range(2)]
    assert [2 * held_bytes(r) for r in ranks] == [held_bytes(whole)] * 2
    kinds = {getattr(m.quantized, "type_name", f"int{getattr(m.quantized, 'bits', None)}")
             for experts in [whole, *ranks] for layer in experts for m in (layer.gate_proj, layer.up_proj,
                                                                             layer.down_proj)}
    if preset == "Q4_K_M":
        assert held_bytes(whole) == sum(t.nbytes for t in gguf.quantized_stacked_experts(path))
        assert kinds == {"q4_k", "q6_k"}
    else:
        assert kinds == {"int4"}
    torch.manual_seed(0)
    x = torch.randn(5, 256)
    weights, ids = torch.rand(5, 2), torch.tensor([[0, 3], [1, 7], [2, 5], [6, 4], [7, 0]])
    for layer, parts in zip(whole, zip(*ranks, strict=True), strict=True):
        summed = sum(part.forward(x, weights, ids) for part in parts)
        torch.testing.assert_close(summed, layer.forward(x, weights, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_quantized_experts_at_tp2_give_tp1_tokens_holding_what_plan_says():
    """The engine at tp=2 over the Q4_K_M file: tp=1's greedy tokens, and each rank's weight bytes (its experts'
    blocks, the rest float32) what `lmport plan --tp 2` prints for it."""
    from lmport.memory import plan
    path = str(quantized_moe_gguf())
    tp1 = greedy(path, tp=1)
    engine = Engine(path, engine_config(2))
    try:
        tp2 = generate(engine)
        held = [rank["weight_bytes"] for rank in engine.executor.run_all("allocation")]
    finally:
        engine.close()
    assert tp2 == tp1
    report = plan.build_plan(path, engine_config(2), device_memory=8 << 30)
    assert [rank["weight_bytes"] for rank in report["ranks"]] == held
    assert {"q4_k", "q6_k", "float32"} <= set(report["weights"]["bytes_by_dtype"])


@pytest.mark.slow
def test_mxfp4_biased_experts_at_tp2_give_tp1_tokens():
    """gpt-oss's MXFP4 experts split at tp=2: each rank's gate and up biases go with its rows, the down bias is
    added once. Compared with tp=1 on the file dequantized: at tp=2 the Q8_0 attention loads float as there (the
    int8 kernel's results differ from a float GEMM's in the last bits, enough to flip a near tie of this random
    model), and MXFP4's values are exact
    floats, so both runs compute with the same weights."""
    path = str(mxfp4_gpt_oss_gguf())
    assert greedy(path, tp=2) == greedy(path, tp=1, weight_format="dequantize")


def test_a_tp_that_cuts_a_quantized_block_is_refused_before_workers_start(monkeypatch):
    """tp=4 would give each rank 128 of the down projections' 512 inputs, half a 256-value K-quant block: refused
    by name, by the engine and by `lmport plan`, though the config's heads and sizes allow tp=4."""
    from lmport.memory import plan
    path = str(quantized_moe_gguf())
    check_tp(plan_config(path), 4)
    monkeypatch.setattr("lmport.engine.core.make_executor",
                        lambda *a, **k: pytest.fail("workers started before the quantized-experts check"))
    refusal = (r"tp=4: .*Q4_K_M.gguf's blk\.0\.ffn_down_exps\.weight \(Q4_K, 256-value blocks\) would give each rank "
               r"128 of its 512 inputs .*not a whole number of blocks; use a tp that splits it into whole blocks, or "
               r"weight_format='dequantize' .*\(tp in \[1, 2\] splits")
    with pytest.raises(ConfigError, match=refusal):
        Engine(path, EngineConfig(device_type="cpu", tp=4))
    with pytest.raises(ConfigError, match=refusal):
        plan.build_plan(path, EngineConfig(device_type="cpu", tp=4), device_memory=8 << 30)


@pytest.mark.slow
def test_a_dequantized_moe_gguf_splits_its_experts_at_tp2():
    """weight_format="dequantize" loads the file's stacked experts in float32, which split like a checkpoint's."""
    from support.tiny_hf_models import gguf_file
    path = str(gguf_file("qwen3-moe"))
    assert greedy(path, tp=2, weight_format="dequantize") == greedy(path, tp=1, weight_format="dequantize")


def test_the_oom_advisor_proposes_no_tp_the_model_refuses(capsys):
    """`lmport plan` on too little memory: the advice's tp step says why no larger tp helps (it proposes tp=2 for a
    dense model: tests/test_oom_advisor.py)."""
    from support.tiny_float_models import tiny_model_dir

    from lmport.entrypoints import cli
    assert cli.main(["plan", tiny_model_dir("llama4"), "--device", "cpu", "--device-memory", "30MiB"]) == 2
    step = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("5. "))
    assert step == ("5. tp: no tp above 1 splits this model (tp=2: llama4_text's experts are not split over ranks "
                    "(it runs at tp=1 only))")
