"""`lmport plan --dp N --tp M`: the placement (a bundle a rank of the backend's device resource) and each replica's
own cache, from the config alone (no Ray needed)."""
from __future__ import annotations

import pytest

from support.model_helpers import tiny_model_dir

from lmport.memory import plan, plan_format
from lmport.entrypoints.cli import main
from lmport.config import ConfigError, EngineConfig

MEMORY = 2 * 2**30


def test_each_replica_holds_its_own_cache_and_every_rank_a_bundle():
    config = EngineConfig(device_type="cpu", tp=2, cache_max_entry_count=100)
    report = plan.build_plan(tiny_model_dir("llama"), config, MEMORY, dp=3)
    place = report["placement"]
    assert (place["dp"], place["tp"], place["devices"], place["executor"]) == (3, 2, 6, "ray")
    assert place["bundles"] == [{"CPU": 1.0}] * 6
    assert [r["num_blocks"] for r in place["replicas"]] == [100] * 3 == [report["cache"]["num_blocks"]] * 3
    assert [x["runs_in"] for x in place["replicas"][1]["ranks"]] == ["the replica's actor", "a Ray actor"]
    text = plan_format.format_plan(report)
    assert "3 replica(s) x tp=2 = 6 devices" in text and text.count("cache 100 blocks") == 3 + 2   # + rank rows


def test_one_replica_without_ray_says_where_its_ranks_run():
    report = plan.build_plan(tiny_model_dir("llama"), EngineConfig(device_type="cpu", tp=2), MEMORY)
    place = report["placement"]
    assert place["executor"] == "mp" and place["bundles"] is None
    assert [x["runs_in"] for x in place["replicas"][0]["ranks"]] == ["the engine's process", "a worker process"]
    assert "placement" not in plan_format.format_plan(report)


def test_the_device_resource_is_the_backends():
    from lmport.backends.cuda import CudaBackend
    assert CudaBackend.capabilities.ray_resource == "GPU"
    report = plan.placement(EngineConfig(device_type="cpu", tp=2), CudaBackend.capabilities, 2, 10, 1000, 160)
    assert report["bundles"] == [{"GPU": 1.0, "CPU": 1.0}] * 4


def test_the_command(capsys):
    assert main(["plan", tiny_model_dir("llama"), "--device", "cpu", "--dp", "2", "--tp", "2",
                 "--device-memory", "2GiB"]) == 0
    assert "replica 1" in capsys.readouterr().out
    assert main(["plan", tiny_model_dir("llama"), "--device", "cpu", "--dp", "0"]) == 2
    assert "dp must be an int >= 1" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="leave nnodes at 1"):
        EngineConfig(device_type="cpu", tp=2, nnodes=2, dist_init_addr="h:1", executor="ray")
