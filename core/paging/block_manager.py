"""Per-sequence block tables over the reference-counted allocator."""
from __future__ import annotations

from lmport.paging.allocator import BlockAllocator
from lmport.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _missing(self, seq: Sequence, num_new: int) -> int:
        return max(0, self.blocks_for(seq.num_computed + num_new) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new: int) -> bool:
        """Whether ``num_new`` more tokens of ``seq`` fit in the free blocks."""
        return self._missing(seq, num_new) <= self.num_free

    def allocate(self, seq: Sequence, num_new: int) -> None:
        seq.block_table.extend(self.allocator.allocate(self._missing(seq, num_new)))

    def free(self, seq: Sequence) -> None:
        # Tail first, so a block freed later is a prefix block: useful for prefix caching.
        for block in reversed(seq.block_table):
            self.allocator.decref(block)
        seq.block_table.clear()

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
