"""The engine's table of loaded LoRA adapters: names, ids and device slots.

An adapter gets a new id at each load (never reused, so a prefix-cache key of an unloaded adapter
matches no later one) and one of the ``max_loras`` slots of the LoRA layers. Requests hold a
reference to their adapter's id; unloading removes the name at once (new requests are refused) and
frees the slot when the last request using it ends, so no request in flight loses its adapter.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from lmport.lora import AdapterError


@dataclass
class LoadedAdapter:
    name: str
    id: int
    slot: int
    path: str
    rank: int
    created: int = field(default_factory=lambda: int(time.time()))


class AdapterTable:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.by_name: dict[str, LoadedAdapter] = {}
        self._slots: dict[int, int] = {}       # adapter id -> slot, for adapters loaded or still in use
        self._refs: dict[int, int] = {}        # adapter id -> requests using it
        self._removed: set[int] = set()        # unloaded ids whose slot waits for their last request
        self._ids = itertools.count(1)

    def check_name(self, name: str) -> None:
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise AdapterError(f"lora_name: {name!r} is not a name; give a non-empty name without surrounding "
                               f"spaces", param="lora_name")
        if name in self.by_name:
            raise AdapterError(f"lora_name: an adapter named {name!r} is already loaded; unload it first "
                               f"(POST /v1/unload_lora_adapter) or choose another name", param="lora_name",
                               status=409)

    def free_slot(self) -> int:
        if self.max_loras == 0:
            raise AdapterError("LoRA adapters are off (max_loras=0): start the engine with max_loras >= 1",
                               param="lora_name")
        used = set(self._slots.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if not free:
            draining = len(self._removed)
            raise AdapterError(f"all max_loras={self.max_loras} adapter slots are in use ({len(self.by_name)} "
                               f"loaded, {draining} unloaded but still serving requests): unload one or "
                               f"restart with a larger max_loras", param="lora_name", status=409)
        return free[0]

    def add(self, name: str, slot: int, path: str, rank: int) -> LoadedAdapter:
        self.check_name(name)
        adapter = LoadedAdapter(name, next(self._ids), slot, path, rank)
        self.by_name[name] = adapter
        self._slots[adapter.id] = slot
        self._refs[adapter.id] = 0
        return adapter

    def remove(self, name: str) -> LoadedAdapter:
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise AdapterError(f"lora_name: no adapter named {name!r} is loaded (loaded: "
                               f"{', '.join(sorted(self.by_name)) or 'none'})", param="lora_name", status=404)
        self._removed.add(adapter.id)
        self._maybe_free(adapter.id)
        return adapter

    def acquire(self, name: str) -> LoadedAdapter:
        """The adapter a new request uses, counted until ``release``."""
        adapter = self.by_name.get(name)
        if adapter is None:
            raise AdapterError(f"model: no adapter named {name!r} is loaded", param="model", status=404)
        self._refs[adapter.id] += 1
        return adapter

    def release(self, adapter_id: int) -> None:
        if adapter_id in self._refs:
            self._refs[adapter_id] -= 1
            self._maybe_free(adapter_id)

    def slot(self, adapter_id: int) -> int:
        """The slot of a request's adapter (-1 for the base model: id 0)."""
        return self._slots[adapter_id] if adapter_id else -1

    def in_use(self, adapter_id: int) -> int:
        return self._refs.get(adapter_id, 0)

    def _maybe_free(self, adapter_id: int) -> None:
        if adapter_id in self._removed and self._refs[adapter_id] == 0:
            self._removed.discard(adapter_id)
            del self._slots[adapter_id], self._refs[adapter_id]
