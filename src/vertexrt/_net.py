"""Free loopback TCP ports, for rendezvous addresses and local servers.

Example:
    >>> from vertexrt._net import free_port, free_ports
    >>> 0 < free_port() < 65536 and len(set(free_ports(3))) == 3
    True
"""

from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now (held open together, so never repeated)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    return free_ports(1)[0]
