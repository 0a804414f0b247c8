"""Prefix cache index: full KV blocks found by a chained hash, verified before use.

A full block's hash is blake2b over a length-prefixed encoding of its parent's
hash, its token ids and tagged extra keys (e.g. ``cache_salt``); the first
block's parent is a seed made from a model fingerprint. blake2b, not Python's
``hash()``, so hashes are stable across processes and runs.

A hash is only an index. A hit is used when the entry's token ids and extra
keys equal the request's and its parent is the very entry matched for the
previous block; by induction the whole prefix is then identical, so a hash
collision can only cost a miss, never return another prefix's KV.

This module keeps the index (hash -> entry, pool block -> entry) and the
prefix tree; which blocks are free, used or cached is the allocators' business
(see block_manager.py).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

ExtraKeys = tuple[tuple[str, str], ...]   # (tag, value) pairs, e.g. (("cache_salt", "tenant-a"),)


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def model_fingerprint(*parts: object) -> bytes:
    """Seed of every hash chain: the model and anything that changes its KV (dtype, quant_policy...)."""
    return hashlib.blake2b(_field(repr(parts).encode()), digest_size=16, person=b"lmport-prefix").digest()


def block_hash(parent: bytes, tokens: Sequence[int], extra: ExtraKeys = ()) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=b"lmport-block")
    h.update(_field(parent))
    h.update(_field(struct.pack(f"<{len(tokens)}q", *tokens)))
    for tag, value in extra:
        h.update(_field(tag.encode()) + _field(value.encode()))
    return h.digest()


@dataclass(eq=False)
class CachedBlock:
    """One full block's KV, on the device or on the host."""

    hash: bytes
    tokens: tuple[int, ...]
    extra: ExtraKeys
    parent: CachedBlock | None
    on_host: bool
    block: int                      # block id in its pool
    children: set[CachedBlock] = field(default_factory=set)
    alive: bool = True

    def __repr__(self):
        return f"CachedBlock({'host' if self.on_host else 'device'}:{self.block}, {self.hash.hex()[:8]})"


class PrefixCache:
    def __init__(self, block_size: int, seed: bytes = b""):
        self.block_size = block_size
        self.seed = seed
        self.hash_fn = block_hash          # tests swap in a colliding one
        self.by_hash: dict[bytes, CachedBlock] = {}
        self.device: dict[int, CachedBlock] = {}   # device block id -> entry
        self.host: dict[int, CachedBlock] = {}     # host block id -> entry

    def chain(self, tokens: Sequence[int], extra: ExtraKeys, hashes: list[bytes], num_blocks: int) -> list[bytes]:
        """Extend ``hashes`` (the chain so far) to ``num_blocks`` full blocks of ``tokens``."""
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else self.seed
            hashes.append(self.hash_fn(parent, tokens[i * bs:(i + 1) * bs], extra))
        return hashes

    def get(self, h: bytes, tokens: Sequence[int], extra: ExtraKeys, parent: CachedBlock | None) -> CachedBlock | None:
        """The entry for this block, only if it verifies (same tokens, extra keys and parent entry)."""
        e = self.by_hash.get(h)
        if e is not None and e.parent is parent and e.extra == extra and e.tokens == tuple(tokens):
            return e
        return None

    def match(self, tokens: Sequence[int], extra: ExtraKeys, hashes: list[bytes]) -> list[CachedBlock]:
        """Longest verified chain of cached blocks for the blocks ``hashes`` describe."""
        bs, hits, parent = self.block_size, [], None
        for i, h in enumerate(hashes):
            e = self.get(h, tokens[i * bs:(i + 1) * bs], extra, parent)
            if e is None:
                break
            hits.append(e)
            parent = e
        return hits

    def add(self, h: bytes, tokens: Sequence[int], extra: ExtraKeys, parent: CachedBlock | None,
            block: int) -> CachedBlock:
        """Index device ``block`` (just computed) under ``h``; the caller checked ``h`` is not taken."""
        e = CachedBlock(h, tuple(tokens), extra, parent, on_host=False, block=block)
        self.by_hash[h] = e
        self.device[block] = e
        if parent is not None:
            parent.children.add(e)
        return e

    def move(self, e: CachedBlock, block: int, *, on_host: bool) -> None:
        """The entry's KV now lives in ``block`` of the device or host pool."""
        del (self.host if e.on_host else self.device)[e.block]
        e.on_host, e.block = on_host, block
        (self.host if on_host else self.device)[block] = e

    def drop(self, e: CachedBlock) -> None:
        del self.by_hash[e.hash]
        del (self.host if e.on_host else self.device)[e.block]
        if e.parent is not None:
            e.parent.children.discard(e)
        e.alive = False

    def check_invariants(self) -> None:
        entries = list(self.device.values()) + list(self.host.values())
        if len(entries) != len(self.by_hash) or {id(e) for e in entries} != {id(e) for e in self.by_hash.values()}:
            raise AssertionError("prefix cache broken: hash index and pool maps disagree")
        for e in entries:
            if not e.alive or self.by_hash[e.hash] is not e:
                raise AssertionError(f"prefix cache broken: {e} indexed but dead")
            if (self.host if e.on_host else self.device).get(e.block) is not e:
                raise AssertionError(f"prefix cache broken: {e} not where it says")
            if e.parent is not None and e not in e.parent.children:
                raise AssertionError(f"prefix cache broken: {e} missing from its parent's children")
            if any(c.parent is not e or not c.alive for c in e.children):
                raise AssertionError(f"prefix cache broken: {e} has a stale child")
