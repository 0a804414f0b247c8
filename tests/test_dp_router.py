"""The data-parallel router's rule (lmport.dp.router), without Ray or an engine: prefix affinity over the prefix
cache's chained block hashes, the least-loaded fallback, balance, health and round robin."""
from __future__ import annotations

import pytest

from lmport.dp.router import PrefixRouter
from lmport.kv.prefix_cache import PrefixCache

BS = 4


def prompt(prefix: int, tail: int, blocks: int = 3) -> list[int]:
    """``blocks`` full blocks shared by every prompt of ``prefix``, then a tail of its own."""
    return [1000 * prefix + i for i in range(blocks * BS)] + [7, 8, tail]


def test_the_chain_is_the_prefix_cache_chain():
    router = PrefixRouter(2, BS, seed=b"model", max_blocks=8)
    ids = list(range(30))
    cache = PrefixCache(BS, seed=b"model")
    assert router.chain(ids, "salt") == cache.chain(ids, (("cache_salt", "salt"),), [], len(ids) // BS)
    assert router.chain(ids) == cache.chain(ids, (), [], len(ids) // BS)
    assert len(PrefixRouter(2, BS, max_blocks=3).chain(ids)) == 3   # only the first blocks count


def test_new_prefixes_spread_by_load_and_repeat_prefixes_stick():
    router = PrefixRouter(2, BS)
    first = []
    for p in range(4):
        first.append(router.choose(prompt(p, 0)).replica)
        router.started(first[-1])
    assert sorted(first) == [0, 0, 1, 1]              # each new prefix to the least loaded replica
    for p in range(4):
        route = router.choose(prompt(p, 99))
        assert route.replica == first[p] and route.matched_blocks == 3


def test_one_at_a_time_new_prefixes_still_spread():
    """Every request finishes before the next arrives (equal load): a new prefix goes to the replica that
    owns the fewest, not always to the first."""
    router = PrefixRouter(3, BS)
    assert [router.choose(prompt(p, 0)).replica for p in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [router.choose(prompt(p, 1)).replica for p in range(6)] == [0, 1, 2, 0, 1, 2]


def test_the_longest_known_prefix_wins():
    router = PrefixRouter(2, BS)
    short = [5] * BS + [6] * BS
    router.started(router.choose(short + [1]).replica)          # replica 0 holds 2 blocks
    router.started(router.choose([9] * (3 * BS)).replica)        # replica 1, another prefix
    longer = short + [4] * BS + [3]
    route = router.choose(longer)
    assert (route.replica, route.matched_blocks) == (0, 2)


def test_salted_requests_do_not_share_a_prefix():
    router = PrefixRouter(2, BS)
    router.started(router.choose(prompt(1, 0), "a").replica)
    assert router.choose(prompt(1, 1), "b").matched_blocks == 0
    assert router.choose(prompt(1, 2), "a").matched_blocks == 3


def test_a_busy_owner_loses_its_affinity_to_the_least_loaded():
    router = PrefixRouter(2, BS, balance_threshold=2)
    owner = router.choose(prompt(1, 0)).replica
    for _ in range(3):
        router.started(owner)
    route = router.choose(prompt(1, 1))
    assert route.replica != owner and route.matched_blocks == 0
    router.finished(owner)                                        # within the threshold again...
    for _ in range(3):
        router.finished(owner)
    # ...but the prefix now also belongs to the other replica: the latest route wins
    assert router.choose(prompt(1, 2)).replica == route.replica


def test_an_unhealthy_replica_gets_nothing_and_is_forgotten():
    router = PrefixRouter(3, BS)
    owner = router.choose(prompt(1, 0)).replica
    router.set_healthy(owner, False)
    for t in range(6):
        assert router.choose(prompt(t % 2 + 1, t)).replica != owner
    router.set_healthy(owner, True)
    assert all(r != owner for r in router.owner.values())         # its prefixes were dropped when it failed
    for r in range(3):
        router.set_healthy(r, False)
    with pytest.raises(ValueError, match="no data-parallel replica is healthy"):
        router.choose(prompt(1, 0))


def test_round_robin_ignores_prefixes_and_skips_unhealthy_replicas():
    router = PrefixRouter(3, BS, policy="round_robin")
    assert [router.choose(prompt(1, t)).replica for t in range(4)] == [0, 1, 2, 0]
    router.set_healthy(2, False)
    assert [router.choose(prompt(1, t)).replica for t in range(4)] == [1, 0, 1, 0]


def test_the_table_is_bounded():
    router = PrefixRouter(2, BS, capacity=5)
    for p in range(10):
        router.choose(prompt(p, 0))
    assert len(router.owner) == 5 and sum(router.owned) == 5


@pytest.mark.parametrize("kwargs", [dict(num_replicas=0), dict(block_size=0), dict(policy="random"),
                                    dict(balance_threshold=-1)])
def test_bad_settings_are_refused(kwargs):
    args = dict(num_replicas=2, block_size=BS) | kwargs
    with pytest.raises(ValueError):
        PrefixRouter(**args)
