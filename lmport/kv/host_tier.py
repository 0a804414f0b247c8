"""Host-memory tier: a KV pool in host memory and the block copies to and from it.

The host pool has the device pool's KVLayout (same block shapes, qparams
included), so a block moves with one ``Backend.copy_blocks`` call. Its blocks
are tracked by a ``BlockAllocator``: cached = a prefix-cache block evicted from
the device, used = a block of a swapped-out (preempted) sequence.

The block manager queues copies while it schedules a step; the engine runs
them before the step's forward. Order matters (a host block read back this
step may be reused as a destination later in the same step), so the queue
keeps it, and batches consecutive copies in one direction into one call. A device block is also copied
into another device block (a prompt whose every block is cached goes on in a copy of its last one).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lmport.kv.layout import KVLayout, LayerCache
from lmport.units import GiB


def host_pool_blocks(layout: KVLayout, host_cache_gib: float) -> int:
    return layout.blocks_in(host_cache_gib * GiB)


def allocate_host_pool(layout: KVLayout, num_blocks: int, *, pin_memory: bool) -> list[LayerCache]:
    """Host KV pool; pinned when the backend says so (faster, asynchronous-capable copies)."""
    return layout.allocate(num_blocks, "cpu", pin_memory=pin_memory)


@dataclass
class CopyBatch:
    source: str         # the pool the blocks are read from: "device" or "host"
    target: str         # the pool they are written to
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    written: set[int] = field(default_factory=set, repr=False)


class CopyQueue:
    def __init__(self):
        self._batches: list[CopyBatch] = []
        self.blocks_to_host = 0
        self.blocks_from_host = 0

    def add(self, src: int, dst: int, *, to_host: bool) -> None:
        """A copy between the pools: device -> host when ``to_host``, host -> device otherwise."""
        self._queue(src, dst, *(("device", "host") if to_host else ("host", "device")))
        if to_host:
            self.blocks_to_host += 1
        else:
            self.blocks_from_host += 1

    def add_on_device(self, src: int, dst: int) -> None:
        """A copy of one device block into another (a cached block a sequence goes on writing in)."""
        self._queue(src, dst, "device", "device")

    def _queue(self, src: int, dst: int, source: str, target: str) -> None:
        last = self._batches[-1] if self._batches else None
        # A second write to the same block must not share a batch with the first (index_copy_ order is undefined),
        # nor, within one pool, a read of a block the batch writes (a batch reads all before it writes).
        if (last is None or (last.source, last.target) != (source, target) or dst in last.written
                or (source == target and src in last.written)):
            last = CopyBatch(source, target)
            self._batches.append(last)
        last.src.append(src)
        last.dst.append(dst)
        last.written.add(dst)

    def take(self) -> list[CopyBatch]:
        batches, self._batches = self._batches, []
        return batches

    def __len__(self) -> int:
        return sum(len(b.src) for b in self._batches)
