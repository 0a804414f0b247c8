"""Engine-level conformance: a tiny random-weight model gives the same greedy tokens on every backend as on the
reference ops (lmport.ops, run by the cpu backend with none of its own kernels).

cuda runs its Triton kernels under the interpreter on CPU tensors; ascend and camb run against their simulated
SDKs (mode "simulated", never a hardware result). A backend with no op of its own (example) would be the
reference compared with itself: not applicable.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig
from lmport.platform.backend import Backend
from lmport.backends.cpu import CpuBackend
from lmport.platform.resolution import resolve_config
from support.model_helpers import tiny_model_dir

from harness import op_backend

NEW_TOKENS = 6
# Backend's methods that are ops (the reference implementations), not its memory and lifecycle hooks.
OPS = [name for name, fn in vars(Backend).items() if inspect.isfunction(fn) and not name.startswith("_")
       and name not in ("memory_info", "measure_peak_memory", "prepare", "pin_host_memory", "synchronize")]


class ReferenceBackend(CpuBackend):
    """The cpu backend (host memory, its capabilities) with every op the reference one: the independent
    reference each backend's tokens are held to, the cpu backend's kernels included."""


for _op in OPS:
    setattr(ReferenceBackend, _op, getattr(Backend, _op))


def runs_only_reference_ops(backend) -> bool:
    return all(getattr(type(backend), op) is getattr(Backend, op) for op in OPS)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    # Lengths 1, a block multiple (16, 32) and odd ones, decoded together in one batch.
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 7, 16, 32, 45)]


def config_for(caps, quant_policy: int) -> EngineConfig:
    # The backend's own dtype, so vendor fast paths run; bfloat16's 8-bit mantissa lets greedy
    # tokens of a random model drift between op implementations, so cuda compares at float32.
    dtype = "float32" if caps.default_dtype == "bfloat16" else caps.default_dtype
    return EngineConfig(device_type=caps.device_type, dtype=dtype, quant_policy=quant_policy,
                        cache_max_entry_count=48, max_prefill_token_num=64)


def greedy(backend, config: EngineConfig, arch: str = "llama") -> list[list[int]]:
    with lmport.pipeline(tiny_model_dir(arch), backend_config=config, backend=backend) as pipe:
        out = pipe.generate(prompts(), GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        assert pipe.engine.usage()["blocks_used"] == 0
    return [r.token_ids for r in out]


@functools.cache
def reference_tokens(quant_policy: int, dtype: str, block_size: int, arch: str = "llama") -> list[list[int]]:
    cfg = EngineConfig(device_type="cpu", dtype=dtype, quant_policy=quant_policy, block_size=block_size,
                       cache_max_entry_count=48 * 128 // block_size, max_prefill_token_num=64)
    return greedy(ReferenceBackend(), cfg, arch)


def test_the_reference_backend_runs_no_kernel_of_its_own():
    assert runs_only_reference_ops(ReferenceBackend()) and not runs_only_reference_ops(CpuBackend())


@pytest.mark.parametrize("quant_policy", [0, 8])
def test_tiny_model_greedy_matches_the_reference_ops(backend_name, quant_policy, record_property):
    backend, mode = op_backend(backend_name)
    caps = backend.capabilities
    if quant_policy not in caps.kv_quant_policies:
        pytest.skip(f"{backend_name} declares no quant_policy={quant_policy}")
    if runs_only_reference_ops(backend):
        pytest.skip(f"n/a: {backend_name} runs only the reference ops (comparing them with themselves tests nothing)")
    record_property("mode", mode)
    config = resolve_config(config_for(caps, quant_policy))
    got = greedy(backend, config)
    # The reference with the same block size, dtype and policy: only the ops differ.
    assert got == reference_tokens(quant_policy, config.dtype, config.block_size), f"mode={mode}"


# Sliding windows of 32 tokens (every layer; alternating with global ones in Gemma), soft caps (Gemma 2),
# fused checkpoint projections and longrope (Phi-3), experts (Mixtral, Qwen3-MoE): the 45-token prompt
# crosses the window. In float32
# where the backend declares it: at float16 a random model's near-ties flip tokens between op
# implementations (the Gemma models' scaled embeddings make them tighter); the vendors' float16 paths are
# held to the reference by the Llama case above.
@pytest.mark.parametrize("arch", ["gemma2", "qwen3-moe", *(pytest.param(a, marks=pytest.mark.slow)
                                                          for a in ("mistral-sw32", "gemma3", "phi3", "mixtral"))])
def test_architectures_greedy_match_the_reference_ops(backend_name, arch, record_property):
    backend, mode = op_backend(backend_name)
    if runs_only_reference_ops(backend):
        pytest.skip(f"n/a: {backend_name} runs only the reference ops (comparing them with themselves tests nothing)")
    record_property("mode", mode)
    caps = backend.capabilities
    config = dataclasses.replace(config_for(caps, 0), dtype="float32" if "float32" in caps.dtypes else None)
    config = resolve_config(config)
    got = greedy(backend, config, arch)
    assert got == reference_tokens(0, config.dtype, config.block_size, arch), f"mode={mode}"
