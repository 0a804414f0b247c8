"""The cpu backend's decoder runner (lmport/backends/cpu/decoder_runner.py) against the model's modules, which
stay the reference: the same steps give the same hidden states, bit for bit (the runner makes the same
kernel calls), for float and quantized layers (the int4 / int8 format, and GGUF blocks: a Q4_K_M file's mix of
block types within one merged projection among them); steps and models it does not cover go to the modules."""
from __future__ import annotations

import pytest
import torch

import lmport
from lmport import ops
from lmport.config import EngineConfig, GenerationConfig
from lmport.models.fusion import ConcatLinear
from lmport.models.quantized import GGMLLinear, QuantLinear, hold_for_backend
from lmport.weights.format import from_codes
from lmport.weights.ggml import GGMLWeight
from support.model_helpers import tiny_model_dir
from support import ggml_quantize


def engine_for(arch: str, **config):
    engine = lmport.pipeline(tiny_model_dir(arch), backend_config=EngineConfig(device_type="cpu", **config)).engine
    with torch.no_grad():   # transformers starts biases (Qwen2's q/k/v) at zero, which would hide a lost one
        for name, p in engine.model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return engine


def quantized(linear: torch.nn.Module, bits: int, group: int) -> QuantLinear:
    """``linear`` rounded to ``bits`` per group of ``group`` inputs (asymmetric: a scale and a min)."""
    w = linear.weight.detach().unflatten(1, (-1, group))
    lo, hi = w.amin(-1), w.amax(-1)
    scales = (hi - lo).clamp_min(1e-6) / (2 ** bits - 1)
    codes = ((w - lo[..., None]) / scales[..., None]).round()
    mins = lo if bits == 4 else lo + 128 * scales     # 8-bit codes are signed: -128 .. 127
    weight = from_codes((codes if bits == 4 else codes - 128).flatten(1).int(), scales, mins, bits, group)
    return QuantLinear(weight, linear.bias, linear.backend)


def quantize_layers(model, bits: int, group: int) -> None:
    for layer in model.model.layers:
        for parent, name in [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                             (layer.mlp, "down_proj")]:
            setattr(parent, name, quantized(getattr(parent, name), bits, group))
    model._runner = None   # the runner binds the weights: built again over the new ones


def ggml_blocks(weight: torch.Tensor, bias, type_name: str, backend) -> GGMLLinear:
    """``weight`` [out, in] as GGUF blocks of ``type_name`` (tests/support/ggml_quantize.py)."""
    blocks = torch.from_numpy(ggml_quantize.quantize(weight.detach().numpy(), type_name))
    return GGMLLinear(GGMLWeight(blocks, type_name, weight.shape[1]), bias, backend)


def ggml_layers(model) -> None:
    """Every layer's projections as GGUF blocks (the tiny models' 64-wide rows take the 32-weight types): q in
    Q5_0 beside k and v in Q5_1 as one ConcatLinear (as a Q4_K_M file mixes types within qkv), o Q5_1, gate/up
    Q5_0, down Q5_1."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        q = attn.num_heads * attn.head_dim
        attn.qkv_proj = ConcatLinear([ggml_blocks(w[:q], None if b is None else b[:q], "q5_0", model.backend),
                                      ggml_blocks(w[q:], None if b is None else b[q:], "q5_1", model.backend)])
        for parent, name, kind in [(attn, "o_proj", "q5_1"), (mlp, "gate_up_proj", "q5_0"), (mlp, "down_proj", "q5_1")]:
            linear = getattr(parent, name)
            setattr(parent, name, ggml_blocks(linear.weight, linear.bias, kind, model.backend))
    model._runner = None   # the runner binds the weights: built again over the new ones


def mixed_layers(model) -> None:
    """As a Q4_K_M file mixes formats within qkv: q in Q5_0 beside k and v in lmport's int8, the other
    projections in Q5_0."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        q = attn.num_heads * attn.head_dim
        kv = torch.nn.Linear(w.shape[1], w.shape[0] - q, bias=b is not None)
        kv.weight.data, kv.backend = w[q:].detach().clone(), model.backend
        if b is not None:
            kv.bias.data = b[q:].detach().clone()
        attn.qkv_proj = ConcatLinear([ggml_blocks(w[:q], None if b is None else b[:q], "q5_0", model.backend),
                                      quantized(kv, 8, 32)])
        for parent, name in [(attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")]:
            linear = getattr(parent, name)
            setattr(parent, name, ggml_blocks(linear.weight, linear.bias, "q5_0", model.backend))
    model._runner = None


def k_quant_layers(model) -> None:
    """As a Q4_K_M file holds a layer: q and k in Q4_K beside v in Q6_K within qkv, o in Q5_K, gate/up in Q4_K,
    down in Q6_K."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w = attn.qkv_proj.weight
        qk = (attn.num_heads + attn.num_kv_heads) * attn.head_dim
        attn.qkv_proj = ConcatLinear([ggml_blocks(w[:qk], None, "q4_k", model.backend),
                                      ggml_blocks(w[qk:], None, "q6_k", model.backend)])
        for parent, name, kind in [(attn, "o_proj", "q5_k"), (mlp, "gate_up_proj", "q4_k"), (mlp, "down_proj", "q6_k")]:
            linear = getattr(parent, name)
            setattr(parent, name, ggml_blocks(linear.weight, linear.bias, kind, model.backend))
    model._runner = None


def interleave_layers(model) -> None:
    """Every quantized projection's rows interleaved where the kernels read them so, as a model loads."""
    hold_for_backend(model, model.backend, torch.float32)
    model._runner = None


def hidden_states(engine, prompts: list[list[int]], decode_steps: int, use_runner: bool) -> list[torch.Tensor]:
    """Each prompt's prefill, then ``decode_steps`` steps decoding one token of every prompt together."""
    model = engine.model
    runner = model.decoder_runner()
    assert runner is not None
    covered = []

    def counting(*args):
        out = runner(*args)
        covered.append(out is not None)
        return out

    model._runner = (counting if use_runner else None,)
    seqs = [engine.seqs[engine.add_request(p, GenerationConfig(max_new_tokens=decode_steps + 1))] for p in prompts]
    engine.scheduler.schedule()
    size = engine.layout.block_size
    out = []
    for seq, p in zip(seqs, prompts):
        meta = ops.build_attention_metadata([len(p)], [len(p)], [seq.block_table], size)
        out.append(model(torch.tensor(p), meta, engine.caches))
    for step in range(decode_steps):
        lens = [len(p) + step + 1 for p in prompts]
        meta = ops.build_attention_metadata([1] * len(prompts), lens, [s.block_table for s in seqs], size)
        out.append(model(torch.tensor([p[step] for p in prompts]), meta, engine.caches))
    for seq in seqs:
        engine.abort(seq.request_id)
    model._runner = (runner,)
    if use_runner:
        assert covered and all(covered)
    return out


PROMPTS = [list(range(5, 45)), list(range(100, 120))]   # 40 tokens: past mistral-sw32's window


# GGUF blocks on two architectures (Qwen2's q/k/v biases split with the rows): the runner binds them as it binds
# int4 / int8 weights, so the other two add nothing but time.
CASES = [(arch, weights) for arch in ("llama", "qwen2", "mistral-sw32", "phi3")
         for weights in ("float32", "int4", "int8")]
CASES += [("llama", "ggml"), ("qwen2", "ggml")]
# Qwen3's q/k norms; Gemma's four (1 + weight) norms a layer, gelu-tanh MLP, soft caps (2), q/k norms and a
# rope base for each of its two layer kinds (3).
CASES += [(arch, weights) for arch in ("qwen3", "gemma2", "gemma3") for weights in ("float32", "int4")]


# An 8- and a 4-bit KV cache (codes and their float32 params, filled and read by the same kernels), and a float16
# one (kv_cache_dtype).
CASES += [("llama", "float32, kv 8"), ("gemma2", "int4, kv 4"), ("qwen2", "float32, kv float16")]


def kv_config(kv: str) -> dict:
    """The EngineConfig fields a case's ", kv ..." names: a quant_policy (8, 4) or a kv_cache_dtype."""
    return {} if not kv else {"quant_policy": int(kv)} if kv.isdigit() else {"kv_cache_dtype": kv}


@pytest.mark.parametrize(("arch", "weights"), CASES)
def test_runner_gives_the_modules_hidden_states(arch, weights):
    weights, _, kv = weights.partition(", kv ")
    engine = engine_for(arch, cache_max_entry_count=16, **kv_config(kv))
    if weights == "ggml":
        ggml_layers(engine.model)
        assert isinstance(engine.model.model.layers[0].self_attn.qkv_proj, ConcatLinear)
    elif weights != "float32":
        quantize_layers(engine.model, int(weights[3]), 32)
    want = hidden_states(engine, PROMPTS, 4, use_runner=False)
    got = hidden_states(engine, PROMPTS, 4, use_runner=True)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_layers_the_spec_does_not_describe_get_no_runner():
    engine = engine_for("qwen3-moe")    # layer 1's MLP is a mixture of experts
    specs = [layer.spec() for layer in engine.model.model.layers]
    assert specs[0] is not None and specs[1] is None and engine.model.decoder_runner() is None


def test_steps_the_kernels_do_not_cover_go_to_the_modules():
    pipe = lmport.pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(device_type="cpu", quant_policy=8))
    engine = pipe.engine
    model = engine.model
    runner = model.decoder_runner()
    assert runner is not None
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    meta = ops.build_attention_metadata([1], [1], [[1]], engine.layout.block_size)
    metas = [meta] * cfg.num_hidden_layers
    ropes = [(torch.ones(1, d), torch.zeros(1, d))] * cfg.num_hidden_layers
    # An int8 KV cache with float32 params: the kernels read it.
    assert runner(torch.zeros(1, cfg.hidden_size), ropes, engine.caches, metas) is not None
    # More tokens than a decode step: the backend's methods (tests/test_prefill_slices.py).
    # And the engine still generates.
    assert pipe("hello", GenerationConfig(max_new_tokens=3, ignore_eos=True)).generate_token_len == 3


@pytest.mark.parametrize(("arch", "weights"), [("mistral-sw32", "float32"), ("mistral-sw32", "int4"),
                                               ("gemma3", "float32")])
def test_python_loop_gives_the_native_loops_hidden_states(arch, weights):
    """The Python loop over the kernels (what benchmarks/decode_profile.py times op by op) and the C++
    loop (what the engine runs) make the same calls: the same hidden states, bit for bit."""
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, kernels
    from lmport.backends.cpu.decoder_runner import build
    engine = engine_for(arch, cache_max_entry_count=16)
    if weights != "float32":
        quantize_layers(engine.model, 4, 32)
    model = engine.model
    native = hidden_states(engine, PROMPTS, 4, use_runner=True)
    specs = [layer.spec() for layer in model.model.layers]
    model._runner = (build(specs, kernels.load(), SMALL_BATCH_TOKENS, loop="python"),)
    python = hidden_states(engine, PROMPTS, 4, use_runner=True)
    for a, b in zip(python, native, strict=True):
        assert torch.equal(a, b)


# Interleaved weights: decode steps run as one parallel region (csrc/decoder_layers.h's team). Qwen2's biases,
# a sliding window (mistral-sw32), Qwen3's q/k norms, a projection of two formats (q5_0+int8), a Q4_K_M file's
# K-quants (rows of whole 256-input blocks), and Gemma's gelu-tanh MLP, output norms and soft caps (gemma2) and rope
# bases (gemma3). A float16 cache (kv_cache_dtype) too.
TEAM_CASES = [("llama", "int8"), ("qwen2", "int4"), ("mistral-sw32", "int4"), ("qwen3", "int8"), ("llama", "q5_0+int8"),
              ("llama-256", "k-quants"), ("gemma2", "int4"), ("gemma3", "int8"), ("llama", "int8, kv float16"),
              ("gemma3", "int4, kv float16")]


@pytest.mark.parametrize("sequences", [1, 2])
@pytest.mark.parametrize(("arch", "weights"), TEAM_CASES)
def test_a_team_gives_the_modules_hidden_states(arch, weights, sequences):
    """Each thread of the team takes its share of every op; the hidden states are the modules' kernel calls',
    bit for bit, for one sequence (on two threads, attention's keys split between them, then merged) and for
    two (a token a thread)."""
    assert_team_matches_modules(arch, weights, sequences)


def test_more_threads_than_cpus_still_give_the_modules_hidden_states():
    """More threads than CPUs would have team members spinning at a barrier for one without a core: such a
    step calls the kernels one at a time instead, to the same hidden states."""
    import os
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)) + 1)
    try:
        assert_team_matches_modules("llama", "int8", 1)
    finally:
        torch.set_num_threads(threads)


def assert_team_matches_modules(arch: str, weights: str, sequences: int) -> None:
    from lmport.backends.cpu import kernels
    from lmport.backends.cpu.decoder_runner import _bind_layer_native
    compiled = kernels.load()
    if compiled is None or not compiled.quant_interleaved_bits():
        pytest.skip("this build reads no interleaved rows")
    weights, _, kv = weights.partition(", kv ")
    engine = engine_for(arch, cache_max_entry_count=16, **kv_config(kv))
    assert engine.caches[0].k.dtype == (torch.float16 if kv == "float16" else torch.float32)
    if weights == "q5_0+int8":
        mixed_layers(engine.model)
    elif weights == "k-quants":
        k_quant_layers(engine.model)
    else:
        quantize_layers(engine.model, int(weights[3]), 32)
    interleave_layers(engine.model)
    if weights == "k-quants":   # held interleaved as the kernels read them, every type of the mix
        held = {m.quantized.type_name: m.quantized.row_group for m in engine.model.model.layers.modules()
                if isinstance(m, GGMLLinear)}
        assert held == {"q4_k": 16, "q5_k": 16, "q6_k": 16}, held
    specs = [layer.spec() for layer in engine.model.model.layers]
    assert compiled.DecoderLayers([_bind_layer_native(spec, compiled) for spec in specs]).runs_as_team()
    want = hidden_states(engine, PROMPTS[:sequences], 4, use_runner=False)
    got = hidden_states(engine, PROMPTS[:sequences], 4, use_runner=True)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)



@pytest.mark.parametrize("team", [True, False], ids=["team", "one call at a time"])
def test_a_slot_outside_the_cache_is_refused_before_anything_runs(team):
    """A step whose block table names a block past the cache is refused with the slot named, by the team as by
    the kernels called one at a time (cache of 16 blocks; block 99)."""
    from lmport.backends.cpu import kernels
    compiled = kernels.load()
    if compiled is None or (team and not compiled.quant_interleaved_bits()):
        pytest.skip("this build has no cpu kernels, or reads no interleaved rows")
    engine = engine_for("llama", cache_max_entry_count=16)
    quantize_layers(engine.model, 8, 32)
    if team:
        interleave_layers(engine.model)
    model, size = engine.model, engine.layout.block_size
    runner = model.decoder_runner()
    x = torch.randn(1, model.config.hidden_size)
    meta = ops.build_attention_metadata([1], [1], [[99]], size)
    ropes = {kind: table(model.rotary, x, meta.positions, meta.max_kv_len) for kind, table in model.rope_tables.items()}
    before = [c.k.clone() for c in engine.caches]
    where = "decoder layers" if team else "fill_kv_cache"
    with pytest.raises(RuntimeError, match=where + r": slot \d+ of token 0 is outside the \d+ slots of the cache"):
        runner(x, [ropes[kind] for kind in model.rope_kinds], engine.caches, [meta] * len(model.model.layers))
    assert all(torch.equal(b, c.k) for b, c in zip(before, engine.caches))
