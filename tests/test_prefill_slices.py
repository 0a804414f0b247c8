"""A prefill step's MLP on slices of rows (lmport/backends/cpu/decoder_runner.py, MLP_SLICE_TOKENS): the hidden
states are the model's modules', bit for bit, and the MLP's intermediate is never allocated for the whole step,
counted from torch's own record of its allocations (the profiler's memory events), not from the process's RSS."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lmport import ops
from lmport.config import GenerationConfig
from lmport.backends.cpu import decoder_runner
from lmport.backends.cpu.decoder_runner import MLP_SLICE_TOKENS, slices
from test_decoder_runner import engine_for, ggml_layers, hidden_states, kv_config, quantize_layers

# Two prompts whose steps are cut into 3 slices (1100 rows) and 2 (700); the tiny models take 2048 positions.
LONG_PROMPTS = [[5 + (7 * i) % 4000 for i in range(1100)], [100 + (3 * i) % 900 for i in range(700)]]


def test_slices_cover_the_rows_in_near_equal_parts():
    for rows in (129, 512, 513, 700, 1100, 4096, 4097):
        parts = slices(rows, MLP_SLICE_TOKENS)
        lengths = [end - start for start, end in parts]
        assert parts[0][0] == 0 and parts[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert max(lengths) <= MLP_SLICE_TOKENS and max(lengths) - min(lengths) <= 1
        assert len(parts) == -(-rows // MLP_SLICE_TOKENS)


@pytest.mark.parametrize(("arch", "weights"), [("llama", "float32"), ("llama", "int4"), ("qwen2", "ggml"),
                                               ("qwen3", "int8"), ("gemma2", "float32"), ("gemma3", "int4"),
                                               ("llama", "float32, kv 8")])
def test_sliced_prefill_gives_the_modules_hidden_states(arch, weights):
    weights, _, kv = weights.partition(", kv ")
    engine = engine_for(arch, cache_max_entry_count=160, **kv_config(kv))
    if weights == "ggml":
        ggml_layers(engine.model)
    elif weights != "float32":
        quantize_layers(engine.model, int(weights[3]), 32)
    want = hidden_states(engine, LONG_PROMPTS, 2, use_runner=False)
    got = hidden_states(engine, LONG_PROMPTS, 2, use_runner=True)
    for g, w in zip(got, want, strict=True):
        # Equal on the machines tried; a BLAS may block the sums of another row count differently, so rounding's
        # worth of difference is allowed (a slice placed at other rows, or a row left out, is far beyond it).
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def allocations(engine, prompt: list[int], use_runner: bool) -> tuple[list[int], int]:
    """The sizes of the CPU allocations torch makes during one prefill forward of ``prompt``, in order, and the
    most bytes live at once among them."""
    model = engine.model
    runner = model.decoder_runner()
    model._runner = (runner if use_runner else None,)
    seq = engine.seqs[engine.add_request(prompt, GenerationConfig(max_new_tokens=1))]
    engine.scheduler.schedule()
    meta = ops.build_attention_metadata([len(prompt)], [len(prompt)], [seq.block_table], engine.layout.block_size)
    ids = torch.tensor(prompt)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(ids, meta, engine.caches)
    finally:
        engine.abort(seq.request_id)
        model._runner = (runner,)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return [size for _, size in events if size > 0], peak


def test_a_prefill_step_never_allocates_the_whole_mlp_intermediate():
    engine = engine_for("llama", cache_max_entry_count=160)
    cfg = engine.model.config
    rows = 2000
    whole = rows * 2 * cfg.intermediate_size * 4      # gate and up of every row, float32
    longest = max(end - start for start, end in slices(rows, MLP_SLICE_TOKENS))
    sliced = longest * 2 * cfg.intermediate_size * 4
    prompt = [5 + (7 * i) % 4000 for i in range(rows)]
    modules, modules_peak = allocations(engine, prompt, use_runner=False)
    assert max(modules) >= whole   # the measure sees the modules' whole intermediate
    runner, runner_peak = allocations(engine, prompt, use_runner=True)
    assert max(runner) < whole
    assert sliced in runner   # one slice's gate and up
    assert runner_peak < modules_peak


def test_without_the_backend_long_steps_go_to_the_modules():
    from lmport.backends.cpu import SMALL_BATCH_TOKENS, kernels
    engine = engine_for("llama", cache_max_entry_count=160)
    specs = [layer.spec() for layer in engine.model.model.layers]
    runner = decoder_runner.build(specs, kernels.load(), SMALL_BATCH_TOKENS)
    assert runner is not None
    cfg = engine.model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    many = SMALL_BATCH_TOKENS + 1
    meta = ops.build_attention_metadata([many], [many], [list(range(9))], engine.layout.block_size)
    ropes = [(torch.ones(many, d), torch.zeros(many, d))] * cfg.num_hidden_layers
    assert runner(torch.zeros(many, cfg.hidden_size), ropes, engine.caches, [meta] * cfg.num_hidden_layers) is None
