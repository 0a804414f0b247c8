"""Mixture-of-experts models under tensor parallelism on the cpu backend over gloo.

Each routed and shared expert is split by its intermediate dimension over the ranks (lmport.models.moe), the
router replicated. At tp=2 the greedy tokens of tiny random-weight float32 models equal transformers'
generate: Qwen3-MoE (a dense layer, then 8 experts; the default run's case), Mixtral, GLM-4.5 (grouped routing, a shared
expert), gpt-oss (biased experts, whose down bias must be added once; attention sinks split with their heads)
and DeepSeek-V3 (multi-head latent attention split by heads, shared and routed experts); the others are slow.

The refusals come from the plan check (lmport.parallel.check_tp), before any worker starts: an expert
intermediate size that tp does not divide, and the families whose experts are not split (Llama 4, Qwen3-Next);
the tp choices the OOM advisor proposes from leave those out. A GGUF's quantized experts are not split (the file
is refused at tp>1 unless dequantized, whose float experts split and give tp=1's tokens).
"""
from __future__ import annotations

import pytest
import torch

from support.model_helpers import hf_greedy

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
from lmport.errors import ConfigError
from lmport.parallel import check_tp, tp_choices

PROMPTS = [[1] + list(range(100 + 7 * i, 120 + 13 * i)) for i in range(3)]
NEW_TOKENS = 10


def greedy(model_dir: str, tp: int, **config) -> list[list[int]]:
    engine = Engine(model_dir, EngineConfig(device_type="cpu", dtype="float32", tp=tp, cache_max_entry_count=64,
                                            **config))
    try:
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        ids = [engine.add_request(p, gen) for p in PROMPTS]
        done: dict = {}
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    assert out.error is None, out.error
                    done[out.request_id] = out.token_ids
        return [done[i] for i in ids]
    finally:
        engine.close()


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


def test_a_quantized_moe_gguf_is_refused_at_tp2_before_workers_start(monkeypatch):
    """Quantized expert weights are not split: a Q4_K_M file's stacked experts run at tp=1."""
    from support.tiny_hf_models import gguf_file
    monkeypatch.setattr("lmport.engine.core.make_executor",
                        lambda *a, **k: pytest.fail("workers started before the quantized-weights check"))
    with pytest.raises(ConfigError, match="holds quantized weights, which lmport does not shard"):
        Engine(str(gguf_file("qwen3-moe")), EngineConfig(device_type="cpu", tp=2))


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
