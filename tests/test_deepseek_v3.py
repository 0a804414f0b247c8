"""DeepSeek-V3 (multi-head latent attention over a paged latent cache, shared and routed experts) against transformers.

Two tiny random-weight models from transformers' DeepseekV3Config (3 layers, hidden 64, the first dense, 8 experts in
4 groups, top 3 of the best 2 groups, a shared expert): "q-lora" takes q through a low rank (q_lora_rank), rotates
interleaved pairs (rope_interleave) under a yarn rope whose mscale changes the softmax scale; "q-proj" has a plain
q_proj, rotary in halves, a default rope and attention biases.

- the attention layer alone: lmport's MLA module over a paged latent cache (a prefill in chunks, then decode steps
  with the weights absorbed) gives transformers' DeepseekV3Attention outputs for every position;
- the engine: greedy tokens identical to transformers' generate (float32) for five prompts of 1 to 200 tokens, 24
  new tokens each, batched, prefilled in 40-token chunks (across block boundaries), with block sizes 16 and 64,
  after preemptions, and with prefix caching (a repeated prompt gives the same tokens, its blocks found cached);
- quant_policy=8 keeps the latent as codes: the MLA op over the quantized cache equals it over a float cache
  holding the dequantized latents, and a prompt prefilled at once gives transformers' first token;
- the cache is sized by its kind: a latent layer caches kv_lora_rank + qk_rope_head_dim values a token (576 for
  DeepSeek-V3), and `lmport plan` on DeepSeek-V3's own config.json (tests/data/deepseek_v3) shows
  61 x 576 x 2 = 70,272 bytes a token in bfloat16;
- a backend without the "latent" attention variant (ascend, camb) refuses the model before any weight loads, naming
  it; cpu (the reference ops) and cuda (its Triton MLA kernels: tests/conformance/test_cuda_mla.py) plan it
  (tensor parallelism: tests/test_moe_tp.py).
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig, ops
from lmport.errors import ConfigError
from lmport.kv.layout import CacheKind, KVLayout
from support.model_helpers import saved_model
from support.tiny_float_models import randomize_constants

VOCAB = 49152
NEW_TOKENS = 24
CHUNK = 40   # prefill tokens a step: chunks end inside blocks of 16 and of 64
ARCHS = ("q-lora", "q-proj")
REAL_CONFIG_DIR = Path(__file__).parent / "data" / "deepseek_v3"


def tiny_config(arch: str):
    import transformers
    if arch == "q-lora":
        variant = dict(q_lora_rank=24, rope_interleave=True, attention_bias=False,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                        "original_max_position_embeddings": 256})
    elif arch == "q-proj":
        variant = dict(q_lora_rank=None, rope_interleave=False, attention_bias=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(arch)
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
        initializer_range=0.2,   # weights large enough for attention to be sharp
        **variant)


def tiny_model(arch: str):
    """A seeded float32 model of ``tiny_config(arch)`` (eval)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(2061 + ARCHS.index(arch))
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    randomize_constants(model)
    return model


@functools.cache
def tiny_model_dir(arch: str) -> str:
    """``tiny_model(arch)`` saved with the default model's tokenizer."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:10]
    return saved_model(f"float-tiny-deepseek-v3-{arch}-{digest}", lambda: tiny_model(arch))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 33, 64, 200)]


@functools.cache
def reference(arch: str) -> tuple[list[int], ...]:
    from support.model_helpers import hf_greedy
    return tuple(hf_greedy(tiny_model_dir(arch), prompts(), NEW_TOKENS))


def run(arch: str, prompt_ids: list[list[int]], max_new_tokens: int = NEW_TOKENS,
        **config) -> tuple[list[list[int]], dict]:
    """Greedy tokens of the prompts, submitted together (one batch), and the engine's usage once they finished."""
    config = dict(device_type="cpu", dtype="float32", max_prefill_token_num=CHUNK) | config
    with lmport.pipeline(tiny_model_dir(arch), backend_config=EngineConfig(**config)) as pipe:
        out = pipe.generate(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True))
        usage = pipe.engine.usage()
    assert usage["blocks_used"] == 0, "every block must be free once all requests finished"
    return [r.token_ids for r in out], usage


# -- the attention layer ----------------------------------------------------------------------------------------

def _attention_pair(arch: str):
    """transformers' DeepseekV3Attention with random weights and lmport's MLA module holding the same weights (as
    the loader gives them), with transformers' rotary module."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from lmport.models.deepseek_v3 import DeepseekV3CausalLM, MlaAttention
    from lmport.platform.backend import Backend
    cfg = tiny_config(arch)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(5)
    hf = DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) * 0.3)
    ours = MlaAttention(cfg, Backend("cpu"))   # the reference ops
    full = {f"model.layers.0.self_attn.{k}": v for k, v in hf.state_dict().items()}
    with torch.device("meta"):
        model = DeepseekV3CausalLM(cfg, None, None)   # its state-dict hook (rope_interleave's reordering)
    turned = model.shard_state_dict(full)
    ours.load_state_dict({k.removeprefix("model.layers.0.self_attn."): v for k, v in turned.items()}, strict=True)
    return cfg, hf, ours, DeepseekV3RotaryEmbedding(cfg)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_mla_layer_matches_transformers_in_chunks_then_decode(arch, block_size):
    """One sequence of 23 tokens: prefilled in chunks of 9, 7 (with history), then 7 decode steps (absorbed weights),
    its blocks scattered in the cache; every position's output is transformers' over the whole sequence."""
    cfg, hf, ours, rotary = _attention_pair(arch)
    n = 23
    x = torch.randn(1, n, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(n)
    with torch.no_grad():
        cos, sin = rotary(x, positions[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        want = hf(x, (cos, sin), mask)[0][0]
    cos, sin = cos[0], sin[0]
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    layout = KVLayout(1, 1, width, block_size, torch.float32, layer_kinds=(CacheKind("latent", 1, width),))
    blocks = -(-n // block_size)
    cache = layout.allocate(2 * blocks + 1, "cpu")[0]
    table = [2 * b + 1 for b in range(blocks)]   # every other block: a gather that ignored the table would differ
    got, done = [], 0
    with torch.no_grad():
        for step in (9, 7, 1, 1, 1, 1, 1, 1, 1):
            meta = ops.build_attention_metadata([step], [done + step], [table], block_size)
            rows = slice(done, done + step)
            got.append(ours.forward(x[0, rows], cos[rows], sin[rows], cache, meta))
            done += step
    torch.testing.assert_close(torch.cat(got), want, atol=2e-5, rtol=1e-5)


def test_mla_op_batches_decodes_beside_a_prefill():
    """Three sequences in one step: two decoding (different history lengths), one prefilling a chunk with history;
    each sequence's rows equal the op run on that sequence alone."""
    cfg = tiny_config("q-proj")
    heads, rope, rank = 4, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    g = torch.Generator().manual_seed(9)
    width, bs = rank + rope, 8
    layout = KVLayout(1, 1, width, bs, torch.float32, layer_kinds=(CacheKind("latent", 1, width),))
    cache = layout.allocate(16, "cpu")[0]
    tables = [[3, 5, 7], [0, 2], [9, 11, 13, 15]]
    kv_lens, q_lens = [17, 9, 30], [1, 1, 6]
    for table, kv_len in zip(tables, kv_lens):
        meta = ops.build_attention_metadata([kv_len], [kv_len], [table], bs)
        ops.fill_latent_cache(torch.randn(kv_len, width, generator=g), cache, meta.slot_mapping)
    t = sum(q_lens)
    q_lat, q_rope = torch.randn(t, heads, rank, generator=g), torch.randn(t, heads, rope, generator=g)
    batch = ops.latent_attention(q_lat, q_rope, cache, ops.build_attention_metadata(q_lens, kv_lens, tables, bs), 0.2)
    start = 0
    for table, q_len, kv_len in zip(tables, q_lens, kv_lens):
        rows = slice(start, start + q_len)
        alone = ops.latent_attention(q_lat[rows], q_rope[rows], cache,
                                     ops.build_attention_metadata([q_len], [kv_len], [table], bs), 0.2)
        torch.testing.assert_close(batch[rows], alone, atol=1e-5, rtol=1e-5)
        start += q_len
    assert batch.shape == (t, heads, rank)


def test_a_long_prefill_attends_in_runs_of_tokens(monkeypatch):
    """A prefill whose scores would pass PREFILL_SCORES attends a run of its tokens at a time: runs of 3 tokens
    (the last one shorter) give what one run gives."""
    from lmport.ops import mla
    heads, rope, rank, bs = 4, 8, 32, 8
    width = rank + rope
    cache = KVLayout(1, 1, width, bs, torch.float32, layer_kinds=(CacheKind("latent", 1, width),)).allocate(8, "cpu")[0]
    g = torch.Generator().manual_seed(12)
    table, kv_len, q_len = [6, 2, 4, 1], 30, 20
    meta = ops.build_attention_metadata([kv_len], [kv_len], [table], bs)
    ops.fill_latent_cache(torch.randn(kv_len, width, generator=g), cache, meta.slot_mapping)
    meta = ops.build_attention_metadata([q_len], [kv_len], [table], bs)
    q_lat, q_rope = torch.randn(q_len, heads, rank, generator=g), torch.randn(q_len, heads, rope, generator=g)
    whole = ops.latent_attention(q_lat, q_rope, cache, meta, 0.2)
    monkeypatch.setattr(mla, "PREFILL_SCORES", 3 * heads * kv_len)
    torch.testing.assert_close(ops.latent_attention(q_lat, q_rope, cache, meta, 0.2), whole)


@pytest.mark.parametrize("q_lens", [[1, 1], [5]], ids=["decode", "prefill"])
@pytest.mark.parametrize("policy", [8, 4, "fp8"])
def test_quantized_latent_cache_reads_its_dequantized_values(policy, q_lens):
    """MLA over a quantized latent cache == MLA over a float cache holding the dequantized latents (the schemes of
    lmport.kv.quant, one head of kv_lora_rank + rope values a token: codes with a scale and zero a token, or fp8
    codes with the head's scale)."""
    from lmport.kv import quant
    heads, rope, rank, bs = 4, 8, 32, 8
    width = rank + rope
    kinds = (CacheKind("latent", 1, width),)
    qcache = KVLayout(1, 1, width, bs, torch.float32, policy, layer_kinds=kinds).allocate(8, "cpu")[0]
    fcache = KVLayout(1, 1, width, bs, torch.float32, layer_kinds=kinds).allocate(8, "cpu")[0]
    assert qcache.v is None and qcache.v_qparams is None
    g = torch.Generator().manual_seed(11)
    tables, kv_lens = [[1, 4, 6], [2, 7]][:len(q_lens)], [21, 12][:len(q_lens)]
    for table, kv_len in zip(tables, kv_lens):
        meta = ops.build_attention_metadata([kv_len], [kv_len], [table], bs)
        ops.fill_latent_cache(torch.randn(kv_len, width, generator=g), qcache, meta.slot_mapping)
    if policy == "fp8":
        fcache.k.copy_(quant.dequantize_fp8(qcache.k, qcache.k_scale, torch.float32))
    else:
        assert qcache.k.dtype == torch.uint8 and qcache.k_qparams is not None
        fcache.k.copy_(quant.dequantize(qcache.k, qcache.k_qparams, policy, torch.float32))
    meta = ops.build_attention_metadata(q_lens, kv_lens, tables, bs)
    t = sum(q_lens)
    q_lat, q_rope = torch.randn(t, heads, rank, generator=g), torch.randn(t, heads, rope, generator=g)
    torch.testing.assert_close(ops.latent_attention(q_lat, q_rope, qcache, meta, 0.2),
                               ops.latent_attention(q_lat, q_rope, fcache, meta, 0.2), atol=1e-5, rtol=1e-5)


# -- the engine against transformers' generate ------------------------------------------------------------------

def test_greedy_matches_transformers_chunked_preempted_and_prefix_cached():
    """One run: the five prompts and the 200-token one again, in 40-token chunks, in 24 blocks of 16 tokens (fewer
    than the six sequences need: the scheduler preempts, swapping latent blocks to the host tier and back), with
    prefix caching (the repeat's blocks are found)."""
    ps, want = prompts(), list(reference("q-lora"))
    tokens, usage = run("q-lora", [*ps, ps[-1]], block_size=16, cache_max_entry_count=24, enable_prefix_caching=True,
                        host_cache_gib=0.01)
    assert usage["preemptions"] > 0 and usage["blocks_from_host"] > 0
    assert usage["prefix_cache_hit_blocks_device"] > 0
    # a block: 3 layers x 16 tokens x one latent of 40 float32 values (no separate V)
    assert usage["bytes_to_host"] == usage["blocks_to_host"] * 3 * 16 * 40 * 4
    assert tokens == [*want, want[-1]]


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_in_chunks(arch, block_size):
    tokens, usage = run(arch, prompts(), block_size=block_size, cache_max_entry_count=4096 // block_size)
    assert usage["preemptions"] == 0
    assert tokens == list(reference(arch))


@pytest.mark.slow
@pytest.mark.parametrize("block_size,blocks", [(16, 20), (64, 6)])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_after_preemption(arch, block_size, blocks):
    # Too few blocks for the five sequences (about 420 tokens): the scheduler preempts.
    tokens, usage = run(arch, prompts(), block_size=block_size, cache_max_entry_count=blocks)
    assert usage["preemptions"] > 0
    assert tokens == list(reference(arch))


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_repeats_the_tokens(arch, block_size):
    """The 200-token prompt again after the others: its full blocks come from the prefix cache."""
    ps, want = prompts(), list(reference(arch))
    tokens, usage = run(arch, [*ps, ps[-1]], block_size=block_size, cache_max_entry_count=4096 // block_size,
                        enable_prefix_caching=True)
    assert usage["prefix_cache_hit_blocks_device"] > 0
    assert tokens == [*want, want[-1]]


def test_quant_policy_8_first_token_is_transformers():
    """A prompt prefilled in one step attends to its own latents as computed (not their codes): its first token is
    the unquantized model's; the cache holds uint8 codes, a latent a token."""
    ps, want = prompts()[:4], reference("q-lora")[:4]   # up to 64 tokens: one prefill step each
    config = dict(device_type="cpu", dtype="float32", quant_policy=8, max_prefill_token_num=256, block_size=16,
                  cache_max_entry_count=64)
    with lmport.pipeline(tiny_model_dir("q-lora"), backend_config=EngineConfig(**config)) as pipe:
        out = pipe.generate(ps, GenerationConfig(max_new_tokens=4, ignore_eos=True))
        caches = pipe.engine.caches
    assert [r.token_ids[0] for r in out] == [w[0] for w in want]
    assert all(c.kind == "latent" and c.k.dtype == torch.uint8 and c.v is None for c in caches)


# -- the cache kind, the plan and the refusals ------------------------------------------------------------------

def test_latent_layout_bytes_by_hand():
    """3 latent layers of 32 + 8 = 40 values, blocks of 16: float32 40 * 4 = 160 B a token a layer (one tensor, not
    K and V); quant_policy 8: 40 codes + a float32 scale and zero (8 B) = 48 B a token a layer."""
    from lmport.memory.budget import kv_layout
    cfg = tiny_config("q-lora")
    for policy, per_token in ((0, 3 * 160), (8, 3 * 48)):
        layout = kv_layout(cfg, EngineConfig(device_type="cpu", dtype="float32", block_size=16, quant_policy=policy))
        assert layout.kinds == (CacheKind("latent", 1, 40),) * 3
        assert layout.bytes_per_block == per_token * 16 and layout.bytes_per_token == per_token
        cache = layout.allocate(2, "cpu")
        assert len(cache) == 3 and cache[0].k.shape == (2, 16, 1, 40) and cache[0].v is None
        assert sum(t.nbytes for c in cache for t in (c.k, c.k_qparams) if t is not None) == 2 * layout.bytes_per_block


def test_plan_of_deepseek_v3_real_config():
    """DeepSeek-V3's config.json: 61 layers caching 512 + 64 = 576 values a token, bfloat16: 61 * 576 * 2 = 70,272 B
    a token, 4,497,408 B a block of 64 (a K/V cache of its 128 heads would need 61 * 128 * (192 + 128) * 2 B)."""
    from lmport.memory.plan import build_plan
    from lmport.memory.plan_format import format_plan
    report = build_plan(str(REAL_CONFIG_DIR), EngineConfig(device_type="cpu", dtype="bfloat16", block_size=64,
                                                           cache_max_entry_count=0.9), device_memory=2 << 40)
    kv = report["kv"]
    assert kv["bytes_per_token"] == 61 * 576 * 2 == 70272
    assert kv["bytes_per_block"] == 70272 * 64
    assert kv["kinds"] == [{"kind": "latent", "heads": 1, "head_dim": 576, "layers": 61, "tensors": 1,
                            "bytes_per_token": 70272.0}]
    assert report["cache"]["num_blocks"] == int(report["usable_for_cache_bytes"] * 0.9) // (70272 * 64)
    text = format_plan(report)
    assert "70,272 B a token; paged latent (MLA) on 61 layers, 576 values a token a layer" in text
    # 671B parameters without the multi-token-prediction layer (as DeepSeek-V3's report counts its main model)
    assert 670e9 < report["weights"]["parameters"] < 672e9
    # quant_policy 8: 576 one-byte codes and a float16 scale and zero (4 B) a token a layer
    int8 = build_plan(str(REAL_CONFIG_DIR), EngineConfig(device_type="cpu", dtype="bfloat16", block_size=64,
                                                         quant_policy=8), device_memory=2 << 40)
    assert int8["kv"]["bytes_per_token"] == 61 * (576 + 4) == 35380


def test_plan_on_a_backend_without_latent_attention_is_refused():
    from lmport.memory.plan import build_plan
    with pytest.raises(ConfigError, match="'deepseek_v3' needs attention latent, which device 'ascend' does not run"
                                          r".*attention latent run on cpu, cuda;"):
        build_plan(str(REAL_CONFIG_DIR), EngineConfig(device_type="ascend"), device_memory=2 << 40)


def test_plan_on_cuda_sizes_the_latent_cache():
    """cuda runs the latent variant (lmport/backends/cuda/mla.py): its plan is the cpu one's, 61 x 576 x 2 B a
    token in its default bfloat16."""
    from lmport.memory.plan import build_plan
    report = build_plan(str(REAL_CONFIG_DIR), EngineConfig(device_type="cuda"), device_memory=2 << 40)
    assert report["kv"]["bytes_per_token"] == 61 * 576 * 2


def test_backends_declare_whether_they_run_latent_attention():
    from lmport.backends.ascend import AscendBackend
    from lmport.backends.camb import CambBackend
    from lmport.backends.cpu import CpuBackend
    from lmport.backends.cuda import CudaBackend
    assert "latent" in CpuBackend.capabilities.attention_variants
    assert "latent" in CudaBackend.capabilities.attention_variants
    for backend in (AscendBackend, CambBackend):
        assert "latent" not in backend.capabilities.attention_variants


def test_a_backend_without_latent_attention_refuses_before_loading(monkeypatch):
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("weights loaded before the capability check"))
    with pytest.raises(ConfigError, match="'deepseek_v3' needs attention latent, which device 'example' does not run"):
        lmport.pipeline(tiny_model_dir("q-lora"), backend_config=EngineConfig(device_type="example"))


def test_real_config_is_transformers_defaults():
    """The fixture is DeepSeek-V3's: transformers' DeepseekV3Config defaults are its dimensions."""
    import transformers
    ours, defaults = json.loads((REAL_CONFIG_DIR / "config.json").read_text()), transformers.DeepseekV3Config()
    for key in ("num_hidden_layers", "hidden_size", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                "v_head_dim", "q_lora_rank", "num_attention_heads", "n_routed_experts", "n_group", "topk_group",
                "num_experts_per_tok", "first_k_dense_replace", "routed_scaling_factor", "moe_intermediate_size",
                "intermediate_size", "vocab_size"):
        assert ours[key] == getattr(defaults, key), key


def test_a_gguf_s_quantized_rotary_rows_are_reordered_as_the_model_reorders_float_ones():
    """A deepseek2 GGUF holds q_b_proj and kv_a_proj_with_mqa with interleaved rotary rows; the model reorders float
    ones itself (shard_state_dict), the GGUF loader quantized ones by whole rows (lmport.weights.gguf._rope_halves):
    the two orders agree."""
    from lmport.models.deepseek_v3 import DeepseekV3CausalLM
    from lmport.weights.gguf import _rope_halves
    cfg = tiny_config("q-lora")
    with torch.device("meta"):
        model = DeepseekV3CausalLM(cfg, backend=None, rotary=None)   # pyright: ignore[reportArgumentType]
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    weights = {"model.layers.0.self_attn.q_b_proj.weight": torch.randn(cfg.num_attention_heads * qk, 24),
               "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": torch.randn(cfg.kv_lora_rank + 8, 64)}
    turned = model.shard_state_dict(weights)
    for name, w in weights.items():
        assert torch.equal(w[_rope_halves(w.shape[0], cfg, "kv_a" in name)], turned[name]), name
