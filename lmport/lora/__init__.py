"""LoRA adapters served over the base model (docs/lora.md): reading peft directories (``peft``) and the
engine's table of loaded adapters (``table``); the layers that run them are in lmport.models.lora."""
from __future__ import annotations


class AdapterError(ValueError):
    """An adapter that cannot be loaded or used; the message names the problem and the fix.

    ``param`` is the request field it concerns ("lora_path", "lora_name", "model"); ``status`` the HTTP
    status a server answers with (400: bad input, 404: no such adapter, 409: no room or a name in use).
    """

    def __init__(self, message: str, param: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status
