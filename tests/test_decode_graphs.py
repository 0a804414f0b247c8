"""eager_mode=False: honoured where the backend captures decode steps (cuda), recorded as an Adjustment elsewhere;
the graph runner's bookkeeping and padding, and the model runner's use of it, on CPU (the replay itself needs a
GPU: tools/gpu/run.py's graphs step)."""
from __future__ import annotations

import os

import pytest
import torch

from lmport import EngineConfig

from lmport.platform import registry
from lmport.backends.cuda.graphs import DEFAULT_BATCH_SIZES, DecodeGraphRunner, graph_batch_sizes
from lmport.ops import build_attention_metadata
from lmport.platform.resolution import resolve_config


@pytest.mark.parametrize("name", registry.backend_names())
def test_eager_mode_false_is_honoured_or_adjusted(name):
    caps = registry.load_backend_class(name).capabilities
    resolved = resolve_config(EngineConfig(device_type=name, eager_mode=False))
    adjusted = [a for a in resolved.adjustments if a.field == "eager_mode"]
    if caps.decode_graphs:
        assert resolved.eager_mode is False and adjusted == []
    else:
        assert resolved.eager_mode is True
        assert [(a.asked, a.used) for a in adjusted] == [(False, True)]
        assert "does not capture" in adjusted[0].reason
    # Resolution runs once (a resolved config passes through); eager_mode=True is never adjusted.
    assert resolve_config(resolved) is resolved
    eager = resolve_config(EngineConfig(device_type=name, eager_mode=True))
    assert eager.eager_mode is True and not [a for a in eager.adjustments if a.field == "eager_mode"]


@pytest.mark.parametrize("name", registry.backend_names())
def test_by_default_graphs_where_the_backend_captures_them(name):
    resolved = resolve_config(EngineConfig(device_type=name))
    assert resolved.eager_mode is (not registry.load_backend_class(name).capabilities.decode_graphs)
    assert not [a for a in resolved.adjustments if a.field == "eager_mode"]   # nobody asked: nothing to report
    if name == "cuda":
        assert resolve_config(EngineConfig(device_type="cuda", tp=2)).eager_mode is True
        assert resolve_config(EngineConfig(device_type="cuda", max_loras=1)).eager_mode is True


def test_cuda_captures_cpu_does_not():
    assert registry.load_backend_class("cuda").capabilities.decode_graphs
    assert not registry.load_backend_class("cpu").capabilities.decode_graphs


def test_tensor_parallel_runs_eagerly():
    resolved = resolve_config(EngineConfig(device_type="cuda", eager_mode=False, tp=2))
    assert resolved.eager_mode is True
    assert "tp=1 only" in resolved.adjustments[0].reason


def test_eager_mode_must_be_a_bool_or_none():
    from lmport.config import ConfigError
    with pytest.raises(ConfigError, match="eager_mode"):
        EngineConfig(eager_mode="no")


def test_batch_sizes_up_to_max_batch_size():
    assert graph_batch_sizes(64) == tuple(b for b in DEFAULT_BATCH_SIZES if b <= 64)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(1000)[-1] == 1000


class RecordingStep:
    """A decode 'model': returns each row's inputs, and records the batch it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, ids, meta):
        self.calls.append((ids.clone(), meta))
        return torch.stack([ids.float(), meta.positions.float(), meta.kv_lens.float(),
                            meta.slot_mapping.float()], dim=1)


def test_padding_to_the_next_captured_size():
    step = RecordingStep()
    runner = DecodeGraphRunner(step, max_blocks_per_seq=4, block_size=16, device="cpu", batch_sizes=(1, 4, 8))
    runner.capture()                       # nothing to capture off a GPU
    assert runner.captured == ()
    assert [runner.batch_size_for(n) for n in (1, 2, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]
    assert runner.takes(3, 4) and not runner.takes(3, 5) and not runner.takes(9, 1)
    meta = build_attention_metadata([1, 1, 1], [5, 17, 33], [[2], [3, 4], [5, 6, 7]], 16)
    out = runner.run(torch.tensor([11, 12, 13]), meta)
    ids, padded = step.calls[-1]
    assert ids.tolist() == [11, 12, 13, 0] and padded.num_seqs == 4 and padded.is_decode
    assert padded.max_kv_len == 4 * 16          # a fixed bound, whatever the batch's lengths
    assert padded.kv_lens.tolist() == [5, 17, 33, 1] and padded.slot_mapping.tolist()[3] == -1
    assert padded.block_tables[3].tolist() == [0, 0, 0, 0]
    assert out.shape[0] == 3 and out[:, 0].tolist() == [11, 12, 13]
    assert out[:, 3].tolist() == meta.slot_mapping.float().tolist()
    # A smaller batch after a larger one: the rows it leaves are padding again, not the last batch's.
    runner.run(torch.tensor([21]), build_attention_metadata([1], [2], [[1]], 16))
    ids, padded = step.calls[-1]
    assert padded.num_seqs == 1 and ids.tolist() == [21]
    runner.run(torch.tensor([31, 32]), build_attention_metadata([1, 1], [2, 3], [[1], [2]], 16))
    _, padded = step.calls[-1]
    assert padded.kv_lens.tolist() == [2, 3, 1, 1] and padded.slot_mapping.tolist()[2:] == [-1, -1]
    assert runner.runs == 3


def test_run_refuses_what_it_does_not_take():
    runner = DecodeGraphRunner(RecordingStep(), 2, 16, "cpu", batch_sizes=(1, 2))
    with pytest.raises(ValueError, match="at most 2"):
        runner.run(torch.tensor([1, 2, 3]), build_attention_metadata([1] * 3, [1] * 3, [[0]] * 3, 16))
    with pytest.raises(ValueError, match="is_decode=False"):
        runner.run(torch.tensor([1, 2]), build_attention_metadata([2], [2], [[0]], 16))
    with pytest.raises(ValueError, match="exceed"):
        runner.run(torch.tensor([1]), build_attention_metadata([1], [40], [[0, 1, 2]], 16))


def test_backends_without_capture_return_none():
    from lmport.backends.cpu import CpuBackend
    assert CpuBackend().decode_graphs(RecordingStep(), 8, 4, 16) is None


def test_model_runner_replays_decode_steps_only(monkeypatch):
    """The runner sends decode batches that fit through the backend's hook and everything else eagerly; the
    tokens are the same as with eager_mode=True (cuda on CPU: the runner pads and runs the step eagerly)."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the cuda backend off a GPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    import lmport
    from lmport import GenerationConfig
    from lmport.backends.cuda import CudaBackend
    from lmport.worker.runner import ModelRunner
    from support.model_helpers import tiny_model_dir
    sizes = []
    monkeypatch.setattr(DecodeGraphRunner, "run", lambda self, ids, meta, run=DecodeGraphRunner.run:
                        sizes.append((meta.num_seqs, self.batch_size_for(meta.num_seqs))) or run(self, ids, meta))
    eager_calls = []
    monkeypatch.setattr(ModelRunner, "forward", lambda self, step, caches, fwd=ModelRunner.forward:
                        eager_calls.append(len(step.q_lens)) or fwd(self, step, caches))
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 9, 20)]
    tokens = {}
    for eager in (True, False):
        cfg = EngineConfig(device_type="cuda", dtype="float32", cache_max_entry_count=16, max_prefill_token_num=64,
                           max_batch_size=4, eager_mode=eager)
        with lmport.pipeline(tiny_model_dir("llama"), backend_config=cfg, backend=CudaBackend(device="cpu")) as pipe:
            graphs = pipe.engine.runner.graphs
            assert (graphs is None) == eager
            if graphs is not None:
                assert graphs.batch_sizes == (1, 2, 4)
                assert graphs.max_blocks_per_seq * pipe.engine.layout.block_size >= pipe.engine.session_len
            out = pipe.generate(batch, GenerationConfig(max_new_tokens=4, ignore_eos=True))
            tokens[eager] = [r.token_ids for r in out]
    assert tokens[False] == tokens[True]
    # Three decode steps of three sequences, each padded to the captured size 4.
    assert sizes == [(3, 4)] * 3


def test_a_step_that_reads_device_values_on_the_host_runs_eagerly(caplog):
    """A GGUF mixture of experts keeps its experts quantized (lmport.models.quantized.QuantExperts), run expert by
    expert after reading each expert's token count on the host, which a captured step cannot do: with
    eager_mode=False the runner captures nothing, says why, and generates as eagerly."""
    import logging

    import lmport
    from lmport.backends.cuda import CudaBackend
    from support.tiny_hf_models import gguf_file
    cfg = EngineConfig(device_type="cuda", dtype="float32", cache_max_entry_count=16, max_batch_size=4,
                       eager_mode=False)
    backend = CudaBackend(device="cpu")
    with caplog.at_level(logging.WARNING, logger="lmport.worker.runner"):
        with lmport.pipeline(str(gguf_file("qwen3-moe")), backend_config=cfg, backend=backend) as pipe:
            assert pipe.engine.runner.graphs is None
    assert "QuantExperts reads device values on the host" in caplog.text
