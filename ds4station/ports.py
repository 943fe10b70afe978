"""TCP ports on this host: one the OS has free now, and whether `serve` could listen on a given one. Plain
sockets only, so the TUI's launcher, the server and the bench share it without importing each other."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server can listen on the port: bound as uvicorn binds (SO_REUSEADDR), so the closed connections
    of a server that just stopped (TIME_WAIT, up to a minute) do not count, and a socket listening there does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
