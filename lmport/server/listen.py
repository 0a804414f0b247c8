"""The listening socket of `lmport serve`, bound before the model loads: a port another process holds is found at
once, not after the model has loaded, and ends the command with its own exit status."""
from __future__ import annotations

import errno
import socket

from lmport.errors import ConfigError

ADDRESS_IN_USE_EXIT_CODE = 4   # 2: a bad configuration, 3: the engine core failed (lmport.server.shutdown)


class AddressInUse(Exception):
    pass


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket listening on ``host``:``port`` (0: a port the OS picks), bound as uvicorn binds its own."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUse(f"{shown} is already in use (another server?): stop it or choose another --port") \
                from None
        raise ConfigError(f"cannot listen on {shown}: {exc.strerror or exc}") from None
    sock.listen(backlog)
    return sock
