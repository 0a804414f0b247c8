"""Paging: block allocator, prefix cache, host tier, block manager."""
