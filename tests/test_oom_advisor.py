"""The OOM advisor: a cache that does not fit is a ConfigError whose message gives the steps, with numbers."""
from __future__ import annotations

import math
import re

import pytest
import torch

from lmport import units

from lmport.entrypoints import cli

from lmport.memory import budget as memory, plan
from lmport.models import parameters
from lmport.backends.cpu import CpuBackend
from lmport.config import ConfigError, EngineConfig
from lmport.engine.engine import Engine
from lmport.kv.layout import KVLayout
from lmport.platform.resolution import resolve_config
from support.model_helpers import tiny_model_dir

FREE = 128 << 20
# The tiny Llama (tests/models.py) on cpu in float32: 2 layers x K and V x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4


@pytest.fixture
def free_memory(monkeypatch):
    """The cpu backend reports FREE bytes free (and total): the same plan on every machine."""
    monkeypatch.setattr(CpuBackend, "memory_info", lambda self: (FREE, FREE))


def tiny():
    return tiny_model_dir("llama")


def steps(message: str) -> list[str]:
    return [line for line in message.splitlines() if re.match(r"\d\. ", line)]


def test_too_small_cache_max_entry_count_gives_advice_with_numbers(free_memory):
    config = EngineConfig(device_type="cpu", cache_max_entry_count=0.001, session_len=1024)
    with pytest.raises(memory.CacheDoesNotFit) as err:
        Engine(tiny(), config)
    message = str(err.value)

    reserve = memory.activation_reserve(plan.read_model_config(tiny()), resolve_config(config))
    usable = FREE - reserve
    blocks = int(usable * 0.001) // BYTES_PER_BLOCK
    need = 1024 // 16
    raise_to = math.ceil(need * BYTES_PER_BLOCK / usable * 1000) / 1000
    assert message.startswith(f"session_len=1024 does not fit in the KV cache: {blocks} blocks x 16 = "
                              f"{blocks * 16} tokens.")
    assert f"{units.fmt_bytes(usable)} left for the KV cache" in message
    assert f"activation reserve {units.fmt_bytes(reserve)} (estimated)" in message
    s = steps(message)
    assert [line[:3] for line in s] == ["1. ", "2. ", "3. ", "4. ", "5. ", "6. "]
    assert s[0] == f"1. cache_max_entry_count: raise it from 0.001 to {raise_to} (session_len 1024)"
    # fp8 first (the cpu backend keeps it): 16 one-byte values a head a token, a quarter of float32's 64 bytes.
    assert s[1].startswith(f"2. quant_policy='fp8': {64 / 16:.2f}x the tokens: ")
    # INT8: 16 values + fp32 scale/zero (8 bytes) a head a token, instead of 64 bytes.
    assert f"; quant_policy=8: {64 / 24:.2f}x the tokens: " in s[1]
    assert f"holds {blocks * BYTES_PER_BLOCK // (BYTES_PER_BLOCK * 24 // 64)} blocks" in s[1]
    assert "quant_policy=4: " in s[1]
    assert s[2].startswith("3. max_prefill_token_num: lower it from 4096 to ")
    assert s[3] == f"4. session_len: lower it to <= {blocks * 16} (what {blocks} blocks hold)"
    assert s[4].startswith("5. tp=2 (2 devices like this one): each holds ")
    # The tiny model is float32 (4 bytes a parameter); int4 with its scales and mins takes 0.625.
    params = parameters.count_parameters(plan.read_model_config(tiny()))
    assert s[5].startswith(f"6. weights: a 4-bit checkpoint (a Q4_0 / Q4_1 GGUF) holds them in "
                           f"{units.fmt_bytes(params * 5 // 8)} instead of {units.fmt_bytes(params * 4)} (float32)")

    # Step 1's number is enough on its own.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CpuBackend, "memory_info", lambda self: (FREE, FREE))
        engine = Engine(tiny(), EngineConfig(device_type="cpu", cache_max_entry_count=raise_to, session_len=1024))
    assert engine.session_len == 1024 and engine.plan.num_blocks >= need


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                                   RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                                                "allocate 21474836480 bytes.")])
def test_a_failed_allocation_gives_advice_not_a_traceback(free_memory, monkeypatch, error):
    def fail(self, num_blocks, device, pin_memory=False):
        raise error

    monkeypatch.setattr(KVLayout, "allocate", fail)
    with pytest.raises(memory.CacheDoesNotFit) as err:
        Engine(tiny(), EngineConfig(device_type="cpu", cache_max_entry_count=0.9))
    message = str(err.value)
    assert message.startswith("allocating the KV cache (")
    assert str(error).splitlines()[0] in message
    # Advice aims at 90% of what is free after the failure (FREE here) less the reserve, and below what failed.
    config = resolve_config(EngineConfig(device_type="cpu", cache_max_entry_count=0.9))
    usable = FREE - memory.activation_reserve(plan.read_model_config(tiny()), config)
    failed = int(usable * 0.9) // BYTES_PER_BLOCK
    fit = min(int(0.9 * usable) // BYTES_PER_BLOCK, int(0.9 * failed))
    share = math.floor(fit * BYTES_PER_BLOCK / usable * 1000) / 1000
    assert message.startswith(f"allocating the KV cache ({failed} blocks, ")
    assert steps(message)[0] == f"1. cache_max_entry_count: lower it from 0.9 to {share} (the share that fits)"
    assert err.value.__cause__ is None and err.value.__context__ is None   # no allocator traceback chained


def test_the_activation_forward_running_out_of_memory_gives_advice(free_memory, monkeypatch):
    def oom(self, fn):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(CpuBackend, "measure_peak_memory", oom)
    with pytest.raises(memory.CacheDoesNotFit, match=r"one forward of max_prefill_token_num=4096 tokens does not "
                                                     r"fit .* lower max_prefill_token_num \(to 1024, say\)"):
        Engine(tiny(), EngineConfig(device_type="cpu"))


def test_cli_prints_the_advice_and_exits_2(capsys):
    code = cli.main(["plan", tiny(), "--device", "cuda", "--device-memory", "70MiB"])
    out = capsys.readouterr().out
    assert code == 2
    assert "error: the KV cache does not fit: the KV cache gets no block" in out
    assert "Try, in order:" in out and "5. tp=2" in out
    assert "weights" in out and "KV cache" in out       # the plan is shown up to where it fails


def test_unsupported_quant_policy_is_named_in_the_advice():
    report = plan.build_plan(tiny(), EngineConfig(device_type="camb", session_len=2048, cache_max_entry_count=10),
                             device_memory=1 << 30)
    assert "quant_policy=8 is not supported on camb (it supports [0])" in report["error"]


# -- every ConfigError of memory planning --------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -1, -0.5, 0.0, 1.5, True, "0.5", None.__class__])
def test_cache_max_entry_count_must_be_a_share_or_a_block_count(value):
    with pytest.raises(ConfigError, match=r"cache_max_entry_count must be a float in \(0, 1\] \(share of free "
                                          r"memory\) or an int >= 1 \(exact number of blocks\)"):
        EngineConfig(cache_max_entry_count=value)


PLAN_ERRORS = [
    # (config fields, device memory, the error's start)
    (dict(cache_max_entry_count=0.8), 40 << 20, "the KV cache gets no block: cache_max_entry_count=0.8 of 0 B"),
    (dict(cache_max_entry_count=10**6), 1 << 30, "cache_max_entry_count=1000000 blocks need 7.63 GiB, more than"),
    (dict(cache_max_entry_count=0.001, session_len=2048), 1 << 30, "session_len=2048 does not fit in the KV cache"),
    (dict(cache_max_entry_count=4, session_len=100), 1 << 30, "session_len=100 does not fit in the KV cache: "
                                                              "4 blocks x 16 = 64 tokens"),
]


@pytest.mark.parametrize("fields, device_memory, start", PLAN_ERRORS)
def test_a_cache_that_does_not_fit_is_planned_as_an_error(fields, device_memory, start):
    report = plan.build_plan(tiny(), EngineConfig(device_type="cpu", **fields), device_memory=device_memory)
    assert report["cache"] is None and report["error"].startswith(start)
    assert "Try, in order:" in report["error"]
    with pytest.raises(memory.CacheDoesNotFit):
        memory.plan_cache(memory.MemoryInputs(
            plan.read_model_config(tiny()), resolve_config(EngineConfig(device_type="cpu", **fields)),
            CpuBackend.capabilities, report["weights"]["bytes"], report["free_after_weights_bytes"],
            report["activation_reserve"]["bytes"], False))


def test_tp_must_divide_the_heads():
    # tp > 1 itself runs (tests/test_tensor_parallel.py); a tp that cannot split the heads is refused.
    with pytest.raises(ConfigError, match=r"tp=3 cannot split this model: its 4 attention heads are not divisible "
                                          r"by tp=3; this model supports tp in \[1, 2, 4\]"):
        plan.build_plan(tiny(), EngineConfig(device_type="cpu", tp=3), device_memory=1 << 30)


def test_quant_policy_the_backend_lacks():
    with pytest.raises(ConfigError, match="quant_policy=8 is not supported on device 'camb'"):
        resolve_config(EngineConfig(device_type="camb", quant_policy=8))


@pytest.mark.parametrize("text", ["lots", "0GiB", "-1G", "24 parsecs", ""])
def test_device_memory_must_be_a_size(text):
    with pytest.raises(ConfigError, match="give a size such as 24GiB"):
        units.parse_bytes(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the plan uses its free memory")
def test_an_absent_device_needs_device_memory():
    with pytest.raises(ConfigError, match=r"device 'cuda' is not available here .* --device-memory 24GiB"):
        plan.build_plan(tiny(), EngineConfig(device_type="cuda"))


def test_tp_advice_follows_the_checkpoint_not_only_the_config():
    """A GGUF's weights decide which tp splits it: the tiny Qwen3-MoE's config splits over 2 and 4 ranks, but its
    quantized experts' down projection (768 inputs in 256-value K-quant blocks) splits into whole blocks over 3 only,
    which its heads refuse; so the advice proposes no tp and says why (the config alone would propose tp=2). The
    same model from its transformers directory is advised tp=2."""
    from support.tiny_hf_models import gguf_file, tiny_model_dir as gguf_source_dir
    config = EngineConfig(device_type="cpu", cache_max_entry_count=0.001, session_len=2048)
    gguf = plan.build_plan(str(gguf_file("qwen3-moe")), config, device_memory=1 << 30)["error"]
    advice = next(line for line in steps(gguf) if line.startswith("5. "))
    assert advice.startswith("5. tp: no tp above 1 splits this checkpoint (tp=2: ")
    assert "whole number of blocks" in advice
    directory = plan.build_plan(gguf_source_dir("qwen3-moe"), config, device_memory=1 << 30)["error"]
    assert next(line for line in steps(directory) if line.startswith("5. ")).startswith("5. tp=2 (2 devices")
