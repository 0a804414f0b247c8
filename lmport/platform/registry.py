"""Backend discovery (entry points, listed without importing) and selection (stevedore)."""
from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from importlib import metadata

from stevedore import DriverManager

from lmport.platform.backend import Backend, Capabilities, ProbeResult
from lmport.errors import BackendError

NAMESPACE = "lmport.backends"
log = logging.getLogger(__name__)


def _entry_points() -> dict[str, list[metadata.EntryPoint]]:
    found: dict[str, list[metadata.EntryPoint]] = {}
    seen = set()
    for ep in metadata.entry_points(group=NAMESPACE):
        # One distribution seen twice on sys.path is one registration; the same
        # name from two distributions is a duplicate even when the values agree.
        key = (ep.name, ep.value, ep.dist.name if ep.dist else None)
        if key in seen:
            continue
        seen.add(key)
        found.setdefault(ep.name, []).append(ep)
    return found


def backend_names() -> list[str]:
    """Installed backend names, without importing any backend module."""
    return sorted(_entry_points())


def backend_origin(name: str) -> str:
    eps = _entry_points().get(name, [])
    return ", ".join(sorted({ep.dist.name if ep.dist else "?" for ep in eps})) or "?"


def load_backend_class(name: str) -> type[Backend]:
    """The backend class registered as ``name``; a clear error when there is none."""
    eps = _entry_points()
    if name not in eps:
        raise BackendError(f"no backend named {name!r} is installed; installed backends: "
                           f"{', '.join(sorted(eps)) or 'none'}")
    if len(eps[name]) > 1:
        where = "; ".join(f"{ep.value} ({ep.dist.name if ep.dist else '?'})" for ep in eps[name])
        raise BackendError(f"backend name {name!r} is registered more than once: {where}; "
                           f"uninstall one of the distributions")
    try:
        cls = DriverManager(NAMESPACE, name, invoke_on_load=False, on_load_failure_callback=_reraise).driver
    except Exception as exc:
        raise BackendError(f"backend {name!r} failed to load: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Backend) and isinstance(cls.capabilities, Capabilities)):
        raise BackendError(f"backend {name!r} ({eps[name][0].value}) is not a lmport Backend with Capabilities")
    if cls.capabilities.device_type != name:
        raise BackendError(f"backend {name!r} declares device_type {cls.capabilities.device_type!r}; they must match")
    return cls


def _reraise(manager, entrypoint, exc):
    raise exc


def safe_probe(cls: type[Backend]) -> ProbeResult:
    try:
        result = cls.probe()
    except Exception as exc:  # a probe must not raise; report it instead of failing
        return ProbeResult(False, f"probe raised {type(exc).__name__}: {exc}")
    if not isinstance(result, ProbeResult):
        return ProbeResult(False, f"probe returned {result!r}, not a ProbeResult")
    return result


@dataclass(frozen=True)
class BackendReport:
    name: str
    origin: str
    capabilities: Capabilities | None
    probe: ProbeResult


def describe_backends() -> list[BackendReport]:
    """Every installed backend with its capabilities and whether it runs here."""
    reports = []
    for name in backend_names():
        try:
            cls = load_backend_class(name)
        except BackendError as exc:
            cause = exc.__cause__ or exc
            summary = traceback.format_exception_only(type(cause), cause)[-1].strip()
            reports.append(BackendReport(name, backend_origin(name), None,
                                         ProbeResult(False, f"failed to load: {summary}")))
            continue
        reports.append(BackendReport(name, backend_origin(name), cls.capabilities, safe_probe(cls)))
    return reports


def select_auto() -> type[Backend]:
    """The highest-priority available backend; logs why the others were passed over."""
    candidates = []
    for report in describe_backends():
        if report.capabilities is None or not report.probe.available:
            log.info("device auto: passing over %s: %s", report.name, report.probe.reason)
            continue
        candidates.append(report)
    if not candidates:
        raise BackendError("device_type='auto' found no available backend; run `lmport backends` to see why")
    best = max(candidates, key=lambda r: r.capabilities.priority)
    for other in candidates:
        if other is not best:
            log.info("device auto: passing over %s: priority %d < %s's %d", other.name,
                     other.capabilities.priority, best.name, best.capabilities.priority)
    return load_backend_class(best.name)
