"""The HTTP listening socket, bound before anything else starts so a busy port is found at
once. Kept free of heavy imports: the launcher binds it before loading the API's modules.

With --api-server-count N > 1 every API process binds its own socket to the same host and
port with SO_REUSEPORT: the kernel spreads incoming connections over them (by a hash of the
connection's addresses), so each connection, and every request sent on it, is served by one
process. Linux lets only processes of the same user join a SO_REUSEPORT group.

Connections get a send buffer of SEND_BUFFER bytes (accepted sockets inherit it from the
listener; Linux doubles the value for its bookkeeping): left to autotuning it grows to
megabytes (net.ipv4.tcp_wmem), which a client that never reads fills with tens of thousands
of small incremental-stream frames before any write blocks, so --send-timeout never saw the
stall. A non-reading client now stalls its stream after this buffer, asyncio's transport
buffer (64 KiB) and its own receive buffer (which does not grow while it reads nothing).
"""

from __future__ import annotations

import errno
import socket

from wire.model_path import StartupError

SEND_BUFFER = 64 * 1024


def bind_listener(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound " \
            f"({e.strerror})"
        raise StartupError(f"--host {host} --port {port}: the address {reason}") from None
    sock.set_inheritable(False)
    return sock
