"""Ray, an optional extra (``pip install 'lmport[ray]'``): joining a cluster and reserving devices on it.

Everything Ray-specific that the Ray executor (``lmport.executor.ray_executor``) and the data-parallel replicas
(``lmport.dp``) share: importing Ray with a clear error where it is missing, connecting to an existing
cluster or starting a local one, and the placement-group bundle of one tensor-parallel rank, whose device
resource is the backend's ``Capabilities.ray_resource`` ("GPU", "NPU", "MLU", or "CPU").
"""
from __future__ import annotations

import logging
import os

from lmport.errors import ConfigError

log = logging.getLogger(__name__)

# Ray narrows a device actor's visible devices to the ones it was given unless told not to; the ranks of one
# engine pick their device by their index among the ranks of their node (Backend.setup_rank), so they must
# see the whole node.
NO_VISIBILITY_ENV = {"GPU": "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
                     "NPU": "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"}


def require_ray():
    """The ``ray`` module, or a ConfigError that says how to install it."""
    try:
        import ray  # pyright: ignore[reportMissingImports] - an optional extra; `make lint` runs without it
    except ImportError as exc:
        raise ConfigError("this needs Ray (executor='ray' or --dp > 1), which is not installed here: "
                          "pip install 'lmport[ray]'") from exc
    return ray


def connect(address: str | None, num_cpus: int = 1):
    """Joins the Ray cluster at ``address`` ("auto", HOST:PORT, ray://...; None: $RAY_ADDRESS when set), else
    starts a local one with at least ``num_cpus`` logical CPUs. A process already connected stays as it is."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise ConfigError(f"cannot join the Ray cluster at {address!r} ({exc}); start it with "
                              f"`ray start --head` on one node, or leave --ray-address out to start a local one") \
                from exc
    else:
        ray.init(num_cpus=max(num_cpus, os.cpu_count() or 1), include_dashboard=False,
                 logging_level=logging.WARNING)
        log.info("started a local Ray cluster (%s)", ray.cluster_resources())
    return ray


def rank_bundle(resource: str) -> dict[str, float]:
    """One tensor-parallel rank's placement-group bundle: one device, or one CPU for host-memory backends."""
    return {resource: 1.0} if resource == "CPU" else {resource: 1.0, "CPU": 1.0}


def actor_options(resource: str, pg, bundle: int) -> dict:
    """Ray ``.options()`` that put an actor in bundle ``bundle`` of ``pg``, holding that bundle's resources."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # pyright: ignore[reportMissingImports]
    resources = {"num_cpus": 1.0}
    if resource == "GPU":
        resources["num_gpus"] = 1.0
    elif resource != "CPU":
        resources["resources"] = {resource: 1.0}
    env = {NO_VISIBILITY_ENV[resource]: "1"} if resource in NO_VISIBILITY_ENV else {}
    return dict(resources, runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle))


def reserve(ray, bundles: list[dict[str, float]], what: str, timeout: float):
    """A placement group of ``bundles``, ready; a ConfigError saying what is missing when the cluster cannot
    hold it within ``timeout`` seconds."""
    pg = ray.util.placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        release(pg)
        raise ConfigError(f"the Ray cluster cannot place {what}: it needs {bundles} and has "
                          f"{ray.available_resources()} free of {ray.cluster_resources()} (waited {timeout:g}s); "
                          f"add nodes with those resources, or ask for fewer ranks")
    return pg


def release(pg) -> None:
    """Gives a placement group's resources back to the cluster."""
    require_ray().util.remove_placement_group(pg)


def current_group():
    """The placement group this process (a Ray actor) was placed in, or None."""
    return require_ray().util.get_current_placement_group()


def node_id() -> str:
    return require_ray().get_runtime_context().get_node_id()
