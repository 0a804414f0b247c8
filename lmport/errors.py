"""The errors a user's configuration can raise, in a module that imports nothing of lmport, so any module can
raise them without importing the config or the registry."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot work; the message says what to do instead."""


class BackendError(ValueError):
    """A backend cannot be found, loaded or used."""


class CacheDoesNotFit(ConfigError):
    """The KV cache does not fit on the device; the message lists what to change, with numbers."""
