"""Which data-parallel replica serves a request: prefix affinity, then the least loaded.

A request's key is the chained hash of its first full blocks, the hash the prefix cache itself uses
(``lmport.kv.prefix_cache.block_hash``: parent hash, token ids, cache salt), so two requests share a key
prefix exactly when they share those blocks of KV. The router remembers, for every chain hash it has routed,
the replica it sent it to (a bounded LRU table). A new request goes to the replica that got the longest
prefix of its chain, unless that replica is unhealthy or busier than the least-loaded one by more than
``balance_threshold`` requests in flight; then, and for a request with no known prefix, it goes to the
least-loaded healthy replica (ties: the one owning the fewest remembered prefixes, so new prefixes spread
even when requests come one at a time; then the lowest index). Either way its chain is then recorded for the
chosen replica, so the replicas' caches partition the prefixes instead of each holding all of them.

The table is the router's belief, not the replicas' cache contents: a replica may have evicted a prefix,
and one that restarts starts empty (``forget`` drops its entries). A wrong belief costs a cache miss, never
a wrong answer.

``policy="round_robin"`` ignores prefixes and load (each request to the next healthy replica in turn): the
baseline prefix affinity is measured against (docs/distributed.md).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from lmport.kv.prefix_cache import block_hash

POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True)
class Route:
    replica: int
    matched_blocks: int   # leading blocks of the request's chain last sent to that replica (0: by load)


class PrefixRouter:
    def __init__(self, num_replicas: int, block_size: int, *, max_blocks: int = 32, balance_threshold: int = 16,
                 capacity: int = 1 << 16, seed: bytes = b"", policy: str = "prefix"):
        """``max_blocks``: leading full blocks of a prompt that count; ``capacity``: chain hashes remembered."""
        if num_replicas < 1 or block_size < 1 or max_blocks < 1 or balance_threshold < 0 or capacity < 1:
            raise ValueError("num_replicas, block_size, max_blocks and capacity must be >= 1, "
                             "balance_threshold >= 0")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.turn = 0   # round robin's next replica
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.balance_threshold = balance_threshold
        self.capacity = capacity
        self.seed = seed
        self.owner: OrderedDict[bytes, int] = OrderedDict()   # chain hash -> replica, least recently used first
        self.owned = [0] * num_replicas                      # chain hashes each replica owns in the table
        self.load = [0] * num_replicas                       # requests in flight on each replica
        self.healthy = [True] * num_replicas

    def chain(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The chained hashes of the prompt's first full blocks (at most ``max_blocks``)."""
        extra = (("cache_salt", cache_salt),) if cache_salt is not None else ()
        hashes: list[bytes] = []
        bs = self.block_size
        for i in range(min(len(prompt_ids) // bs, self.max_blocks)):
            hashes.append(block_hash(hashes[-1] if hashes else self.seed, prompt_ids[i * bs:(i + 1) * bs], extra))
        return hashes

    def choose(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> Route:
        """The replica for this request (it must then be passed to ``started``); ValueError when none is
        healthy."""
        up = [r for r in range(self.num_replicas) if self.healthy[r]]
        if not up:
            raise ValueError("no data-parallel replica is healthy")
        if self.policy == "round_robin":
            replica = next(r % self.num_replicas for r in range(self.turn, self.turn + self.num_replicas)
                           if self.healthy[r % self.num_replicas])
            self.turn = replica + 1
            return Route(replica, 0)
        least = min(up, key=lambda r: (self.load[r], self.owned[r], r))
        chain = self.chain(prompt_ids, cache_salt)
        route = Route(least, 0)
        for depth in range(len(chain), 0, -1):
            owner = self.owner.get(chain[depth - 1])
            if owner is not None and self.healthy[owner]:
                if self.load[owner] - self.load[least] <= self.balance_threshold:
                    route = Route(owner, depth)
                break
        self._remember(chain, route.replica)
        return route

    def _remember(self, chain: list[bytes], replica: int) -> None:
        for h in chain:
            previous = self.owner.get(h)
            if previous is not None:
                self.owned[previous] -= 1
            self.owner[h] = replica
            self.owned[replica] += 1
            self.owner.move_to_end(h)
        while len(self.owner) > self.capacity:
            self.owned[self.owner.popitem(last=False)[1]] -= 1

    def started(self, replica: int) -> None:
        self.load[replica] += 1

    def finished(self, replica: int) -> None:
        self.load[replica] = max(0, self.load[replica] - 1)

    def set_healthy(self, replica: int, healthy: bool) -> None:
        self.healthy[replica] = healthy
        if not healthy:
            self.forget(replica)

    def forget(self, replica: int) -> None:
        """Drops what the table says ``replica`` holds (it restarted, or was taken out of rotation)."""
        for h in [h for h, r in self.owner.items() if r == replica]:
            del self.owner[h]
        self.owned[replica] = 0
