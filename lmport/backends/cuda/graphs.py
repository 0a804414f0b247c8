"""CUDA graphs for the decode step (EngineConfig.eager_mode=False), eager as the fallback.

A decode step of a small batch is dominated by kernel-launch overhead; a
captured graph replays all of its launches at once. Graphs fix every shape and
every host-side number, so the step is captured once per batch size in
``batch_sizes``, on static input buffers, with metadata whose host ints are
fixed bounds (``max_kv_len = max_blocks_per_seq * block_size``; the kernels
size their grids from it and read the real lengths from ``kv_lens``). A batch
is padded up to the next captured size: padded rows have slot -1 (the fill
kernel skips them), a KV length of 1 and block 0 (they read one finite value
and their output is dropped).

The engine reaches it through ``CudaBackend.decode_graphs`` (``Backend.decode_graphs``), which the model
runner (``lmport.worker.runner``) calls once the KV cache is allocated when the resolved config has
``eager_mode=False``; each step that ``takes`` replays, any other (prefill, a larger batch, a longer block
table) runs eagerly::

    runner = DecodeGraphRunner(step, max_blocks_per_seq, block_size, device, graph_batch_sizes(max_batch_size))
    runner.capture()                      # after the model and the KV cache exist
    if runner.takes(n, max_blocks):
        out = runner.run(input_ids, meta)  # meta: a decode AttentionMetadata of n sequences
    else:
        out = step(input_ids, meta)       # eager

``step(input_ids [B] int64, meta) -> Tensor [B, ...]`` is the model's decode
forward (embedding to logits or hidden states). It must only read its inputs
through these arguments (no host syncs, no tensors created from host data),
as any captured function.

Without a GPU (``device`` "cpu", the interpreter) there is nothing to capture:
``run`` calls ``step`` eagerly on the same padded static buffers, which lets
the padding be tested here.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from lmport.ops.metadata import AttentionMetadata

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)

Step = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The batch sizes captured for an engine of ``max_batch_size``: the defaults up to it, and it."""
    return tuple(sorted({b for b in DEFAULT_BATCH_SIZES if b < max_batch_size} | {max_batch_size}))


class DecodeGraphRunner:
    def __init__(self, step: Step, max_blocks_per_seq: int, block_size: int,
                 device: torch.device | str, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> None:
        self.step = step
        self.block_size = block_size
        self.device = torch.device(device)
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        n = self.batch_sizes[-1]
        i32 = dict(dtype=torch.int32, device=self.device)
        # Static inputs, sized for the largest batch; a batch of b uses the first b rows.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        self.kv_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)
        self.q_start_loc = torch.arange(n + 1, **i32)
        self.q_lens = torch.ones(n, **i32)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_kv_len = max_blocks_per_seq * block_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.runs = 0   # batches run through ``run`` (replayed, or padded and run eagerly off a GPU)
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            q_start_loc=self.q_start_loc[:b + 1], q_lens=self.q_lens[:b], kv_lens=self.kv_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
            positions=self.positions[:b], block_size=self.block_size, max_q_len=1,
            max_kv_len=self.max_kv_len, is_decode=True)

    def capture(self) -> None:
        """Capture the step for every batch size, largest first so the smaller graphs reuse its memory."""
        if self.device.type != "cuda":
            return
        pool = None
        for b in reversed(self.batch_sizes):
            meta = self._meta(b)
            # Warm up outside the graph (Triton compiles, allocator settles) on a side stream.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.step(self.input_ids[:b], meta)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.step(self.input_ids[:b], meta)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def batch_size_for(self, n: int) -> int | None:
        """The captured size a batch of n runs as (None: too large, run eagerly)."""
        return next((b for b in self.batch_sizes if b >= n), None)

    def takes(self, num_seqs: int, max_blocks: int) -> bool:
        """Whether a decode batch of ``num_seqs`` sequences whose longest block table has ``max_blocks``
        blocks runs here (else the caller runs it eagerly)."""
        return self.batch_size_for(num_seqs) is not None and max_blocks <= self.max_blocks_per_seq

    @property
    def captured(self) -> tuple[int, ...]:
        """The batch sizes with a captured graph (none off a GPU, where ``run`` pads and runs eagerly)."""
        return tuple(sorted(self.graphs))

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = meta.num_seqs
        b = self.batch_size_for(n)
        if b is None or not meta.is_decode:
            raise ValueError(f"DecodeGraphRunner runs decode batches of at most {self.batch_sizes[-1]} "
                             f"sequences, got {n} (is_decode={meta.is_decode}); run the step eagerly")
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block tables of {width} blocks exceed the captured {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.kv_lens[:n].copy_(meta.kv_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        # Padding rows: nothing written, one finite key read, output dropped.
        self.slot_mapping[n:b].fill_(-1)
        self.kv_lens[n:b].fill_(1)
        self.block_tables[n:b].zero_()
        self.positions[n:b].zero_()
        self.runs += 1
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self.step(self.input_ids[:b], self._meta(b))[:n]
