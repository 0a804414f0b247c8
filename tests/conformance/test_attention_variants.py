"""Attention sinks (gpt-oss), chunked attention (Llama 4's local layers) and bidirectional spans (Gemma 3's images):
the reference op against transformers' own attention, then every backend that declares the variant against the
reference op.

The reference: transformers' gpt-oss ``eager_attention_forward`` (sinks in the softmax's denominator) and
Llama 4's chunked mask (``transformers.masking_utils.chunked_overlay`` on a causal mask) over the same
q, k and v held dense, for a prefill over history, a decode batch and a mixed batch. The backends: the same
batches with block sizes 16 and 64, chunks of 8 and 40 tokens (ending inside blocks), sinks alone and with a
sliding window, float32 (cuda's Triton kernels under the interpreter here). A backend that declares neither
variant is checked to be refused such a model (lmport.platform.resolution.check_model); a backend that hands the variant
to the reference op is skipped as not applicable. The cpu backend's compiled kernel over every cache form it reads
(float32, float16, 8- and 4-bit codes with the step's own rows as computed), head dims 32 and 64 with GQA groups 2
and 4 (its AVX-512 path takes three query heads at a time at 64: 4 leaves one over), one thread and four (a decode
token's keys then split into parts merged by their softmax statistics, some parts empty). Slow-marked: the tiny
gpt-oss and Llama 4 models (tests/support/tiny_float_models.py) on each backend that declares their variant, greedy
tokens equal to transformers'.
"""
from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the cuda kernels are first imported

import pytest  # noqa: E402

from harness import op_backend, own_result  # noqa: E402
from lmport import ops  # noqa: E402
from lmport.errors import ConfigError  # noqa: E402
from lmport.kv.layout import KVLayout  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM = 2, 2, 32
BATCHES = {"prefill": ([37], [100]), "decode": ([1, 1, 1], [5, 70, 130]), "mixed": ([40, 1], [110, 90])}
VARIANTS = {   # name: (window, chunk, sinks)
    "sinks": (None, None, True), "sinks-window": (7, None, True), "chunk8": (None, 8, False),
    "chunk40": (None, 40, False), "chunk40-sinks": (None, 40, True)}


def _case(device, block_size, q_lens, kv_lens, seed=0, head_dim=HEAD_DIM, group=GROUP, cache_dtype=torch.float32,
          policy=0):
    """A paged cache (``cache_dtype`` values, or ``policy``'s codes) holding each sequence's K and V, its metadata,
    q, and the dense K and V of each sequence."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in kv_lens]
    ids = (torch.randperm(sum(counts), generator=gen) + 1).tolist()
    tables = [ids[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
    layout = KVLayout(1, KV_HEADS, head_dim, block_size, cache_dtype, policy, "bshd")
    cache = layout.allocate(sum(counts) + 1, device)[0]
    k, v = (torch.randn(sum(kv_lens), KV_HEADS, head_dim, generator=gen) for _ in range(2))
    history = ops.build_attention_metadata(kv_lens, kv_lens, tables, block_size, device)
    ops.fill_kv_cache(k.to(device), v.to(device), cache, history.slot_mapping)
    meta = ops.build_attention_metadata(q_lens, kv_lens, tables, block_size, device)
    q = torch.randn(sum(q_lens), KV_HEADS * group, head_dim, generator=gen).to(device)
    sinks = torch.randn(KV_HEADS * group, generator=gen) * 2
    return cache, meta, q, sinks, k.split(kv_lens), v.split(kv_lens)


def _layer(meta, variant, sinks, device):
    window, chunk, with_sinks = VARIANTS[variant]
    return meta.for_layer(window, None, sinks.to(device) if with_sinks else None, chunk)


def _transformers_attention(q, k, v, q_pos, window, chunk, sinks, blocks=None):
    """One sequence's attention as transformers computes it: gpt-oss's eager attention with its sinks, or the
    eager softmax, under the causal mask (or-ed with Gemma 3's ``blockwise_overlay`` of ``blocks``, each position's
    block id, -1 for none) with the sliding-window and chunked overlays."""
    from transformers.masking_utils import (blockwise_overlay, causal_mask_function, chunked_overlay, or_masks,
                                            sliding_window_overlay)
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    kv_pos = torch.arange(k.shape[0])
    rules = [causal_mask_function if blocks is None else or_masks(causal_mask_function, blockwise_overlay(blocks))]
    if window is not None:
        rules.append(sliding_window_overlay(window))
    if chunk is not None:
        rules.append(chunked_overlay(chunk, torch.zeros(1, dtype=torch.long)))
    positions = [torch.tensor(int(p)) for p in q_pos]   # as tensors: or_masks calls .new_zeros on them
    allowed = torch.tensor([[all(bool(rule(0, 0, p, j)) for rule in rules) for j in kv_pos] for p in positions])
    mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = GROUP, False
    module.sinks = sinks if sinks is not None else torch.full((KV_HEADS * GROUP,), float("-inf"))
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, HEAD_DIM ** -0.5)
    return out[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_reference_matches_transformers(batch, variant):
    q_lens, kv_lens = BATCHES[batch]
    cache, meta, q, sinks, ks, vs = _case("cpu", 16, q_lens, kv_lens)
    layer = _layer(meta, variant, sinks, "cpu")
    window, chunk, with_sinks = VARIANTS[variant]
    out = ops.paged_attention(q, cache, layer, HEAD_DIM ** -0.5)
    rows = 0
    for n, total, k, v in zip(q_lens, kv_lens, ks, vs, strict=True):
        want = _transformers_attention(q[rows:rows + n], k, v, range(total - n, total), window, chunk,
                                       sinks if with_sinks else None)
        torch.testing.assert_close(out[rows:rows + n], want, atol=2e-5, rtol=2e-5)
        rows += n


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("batch", ["prefill", "mixed"])
def test_reference_bidirectional_spans_match_transformers(batch, window):
    """Gemma 3's image spans (AttentionMetadata.bidirectional): or-ed with causal, then and-ed with the window, as
    transformers' create_masks_for_vision_model composes them; a span may start in the cached history (a prefix-cache
    hit inside an image) and a sequence may have none."""
    q_lens, kv_lens = BATCHES[batch]
    spans = {"prefill": (((60, 70), (80, 96)),), "mixed": (((75, 90), (95, 110)), ())}[batch]
    cache, meta, q, _, ks, vs = _case("cpu", 16, q_lens, kv_lens)
    layer = dataclasses.replace(meta, bidirectional=spans).for_layer(window)
    out = ops.paged_attention(q, cache, layer, HEAD_DIM ** -0.5)
    rows = 0
    for n, total, k, v, own in zip(q_lens, kv_lens, ks, vs, spans, strict=True):
        blocks = torch.full((1, total), -1)
        for i, (start, end) in enumerate(own):
            blocks[0, start:end] = i
        want = _transformers_attention(q[rows:rows + n], k, v, range(total - n, total), window, None, None, blocks)
        torch.testing.assert_close(out[rows:rows + n], want, atol=2e-5, rtol=2e-5)
        rows += n
    causal = ops.paged_attention(q, cache, meta.for_layer(window), HEAD_DIM ** -0.5)
    assert not torch.allclose(out, causal, atol=1e-3)   # the spans change the answer


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_backend_matches_reference(backend_name, batch, block_size, variant, record_property):
    from lmport.platform import registry
    caps = registry.load_backend_class(backend_name).capabilities
    needs = {"sinks"} if VARIANTS[variant][2] else set()
    needs |= {"chunked"} if VARIANTS[variant][1] else set()
    if not needs <= caps.attention_variants:
        pytest.skip(f"n/a: {backend_name} does not declare {', '.join(sorted(needs))} (refused, as tested below)")
    if caps.block_size_problem(block_size) or (caps.block_size_forced not in (None, block_size)):
        pytest.skip(f"{backend_name} does not take block size {block_size}")
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    q_lens, kv_lens = BATCHES[batch]
    cache, meta, q, sinks, _, _ = _case(backend.device, block_size, q_lens, kv_lens)
    layer = _layer(meta, variant, sinks, backend.device)
    out = own_result(backend, "paged_attention", q, cache, layer, HEAD_DIM ** -0.5)
    if out is None:
        pytest.skip(f"n/a: {backend_name} runs the reference op for this variant")
    bshd = cache if caps.kv_axis_order == "bshd" else dataclasses.replace(
        cache, k=cache.k.transpose(1, 2), v=cache.v.transpose(1, 2), axis_order="bshd")
    ref = ops.paged_attention(q, bshd, layer, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out, ref, atol=3e-5, rtol=3e-5)


CPU_CACHES = {"float32": (torch.float32, 0), "float16": (torch.float16, 0), "int8": (torch.float32, 8),
              "int4": (torch.float32, 4)}


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("head_dim,group", [(32, 2), (64, 4)])
@pytest.mark.parametrize("cache_form", list(CPU_CACHES))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_cpu_kernel_matches_reference(batch, variant, cache_form, head_dim, group, threads):
    """The cpu backend keeps sinks and chunks on its compiled kernel, over every cache form it reads."""
    from lmport.backends.cpu import CpuBackend, kernels
    assert kernels.load() is not None, "the cpu kernels failed to build; see the warning logged by kernels.load"
    q_lens, kv_lens = BATCHES[batch]
    cache_dtype, policy = CPU_CACHES[cache_form]
    cache, meta, q, sinks, ks, vs = _case("cpu", 16, q_lens, kv_lens, head_dim=head_dim, group=group,
                                          cache_dtype=cache_dtype, policy=policy)
    layer = _layer(meta, variant, sinks, "cpu")
    # The step's own K and V as computed (the last q_len rows of each sequence): over codes they replace theirs.
    new_kv = tuple(torch.cat([x[len(x) - n:] for x, n in zip(xs, q_lens, strict=True)]) for xs in (ks, vs))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = own_result(CpuBackend(), "paged_attention", q, cache, layer, head_dim ** -0.5, new_kv)
    finally:
        torch.set_num_threads(before)
    assert out is not None, "the cpu backend handed the step to the reference op"
    torch.testing.assert_close(out, ops.paged_attention(q, cache, layer, head_dim ** -0.5, new_kv),
                               atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("variant", ["sinks", "chunked", "bidirectional"])
def test_a_backend_without_the_variant_refuses_the_model(backend_name, variant):
    from lmport.platform import registry
    from lmport.platform.resolution import check_model
    caps = registry.load_backend_class(backend_name).capabilities
    if variant in caps.attention_variants:
        check_model("m", {variant}, caps)   # no error where the backend runs it
        return
    runs = [n for n in registry.backend_names()
            if variant in registry.load_backend_class(n).capabilities.attention_variants]
    refusal = f"needs attention {variant}, which device '{caps.device_type}' does not"
    with pytest.raises(ConfigError, match=refusal) as e:
        check_model("m", {variant}, caps)
    assert f"run on {', '.join(runs)};" in str(e.value)


def test_declared_variants_are_known(capabilities):
    from lmport.platform.backend import ATTENTION_VARIANTS
    assert capabilities.attention_variants <= set(ATTENTION_VARIANTS)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt-oss", "llama4"])
def test_family_on_the_backend_matches_transformers(backend_name, arch, record_property):
    import lmport
    from lmport import EngineConfig, GenerationConfig
    from lmport.platform import registry
    from lmport.models.architectures import attention_variants
    from lmport.models.loader import read_model_config
    from support import tiny_float_models
    from support.model_helpers import hf_greedy
    model = tiny_float_models.tiny_model_dir(arch)
    caps = registry.load_backend_class(backend_name).capabilities
    if not attention_variants(read_model_config(model)) <= caps.attention_variants or "float32" not in caps.dtypes:
        pytest.skip(f"n/a: {backend_name} does not run {arch} in float32 (refused, as tested above)")
    backend, mode = op_backend(backend_name)
    record_property("mode", mode)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 30, 61)]   # past a 24-token chunk
    config = EngineConfig(device_type=caps.device_type, dtype="float32", block_size=16, cache_max_entry_count=32,
                          max_prefill_token_num=40)
    with lmport.pipeline(model, backend_config=config, backend=backend) as pipe:
        out = pipe.generate(prompts, GenerationConfig(max_new_tokens=6, ignore_eos=True))
    assert [r.token_ids for r in out] == hf_greedy(model, prompts, 6), f"mode={mode}"
