"""The node link (--nnodes > 1): one TCP connection between node 0's launcher and each other
node's launcher, for two things torch.distributed does not give the launchers:

- Agreement: node r's first frame is a NodeHello (its flags, device, and the model's facts
  and fingerprint: config.json and the weight files' names and sizes); node 0 answers
  NodeReply, not ok when they differ, so a mismatch is a one-line startup error on both
  nodes instead of a hang in the rendezvous or wrong outputs. (Two checkpoints with the
  same config and file sizes but other weights would pass: it is a sanity check.)
  A connection that sends no hello within 10 s is dropped (a port scan, a probe).
- Liveness: the connection then stays open and silent. A launcher that dies closes it (the
  kernel does, whatever killed it), and a host that vanishes is found by TCP keepalive
  (KEEPALIVE_* below, ~11 s). Each launcher waits on it next to its children's sentinels:
  node 0 takes the server down when a node's link closes; node r stops its ranks and exits,
  0 after a NodeBye (node 0 shut down on purpose), else 1.

Frames are a 4-byte big-endian length and a wire message (wire/codec.py, NODE_LINK decoder).
Node 0 listens on the --dist-init-addr port + 1 (the port itself is torch.distributed's).
"""

from __future__ import annotations

import socket
import struct
import time

from wire.codec import NODE_LINK, DecodeError, encode

KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 5, 2, 3     # seconds, seconds, probes
MAX_FRAME = 1 << 16
CONNECT_RETRY = 0.5             # seconds between attempts while node 0 is not listening yet


class LinkError(ConnectionError):
    """The link closed, timed out, or carried something that is not a node-link message."""


def link_port(dist_port: int) -> int:
    return dist_port + 1


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def send(sock: socket.socket, msg) -> None:
    frame = encode(msg)
    sock.sendall(struct.pack(">I", len(frame)) + frame)


def recv(sock: socket.socket, timeout: float | None = None):
    """The next message; LinkError if the link closed or the frame is not a message."""
    sock.settimeout(timeout)
    try:
        (n,) = struct.unpack(">I", _exactly(sock, 4))
        if n > MAX_FRAME:
            raise LinkError(f"a {n}-byte frame on the node link")
        return NODE_LINK.decode(_exactly(sock, n))
    except DecodeError as e:
        raise LinkError(f"not a node-link message: {e}") from None
    except OSError as e:            # socket.timeout included
        raise LinkError(str(e) or type(e).__name__) from None
    finally:
        sock.settimeout(None)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise LinkError("the other node closed the link")
        buf += chunk
    return buf


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, port))
    server.listen()
    return server


def accept(server: socket.socket, deadline: float) -> socket.socket:
    server.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        sock, _ = server.accept()
    except OSError as e:
        raise LinkError(f"no node connected in time ({e})") from None
    _keepalive(sock)
    return sock


def connect(host: str, port: int, deadline: float) -> socket.socket:
    """Connect to node 0, retrying until it listens or the deadline passes."""
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
        except OSError as e:
            if time.monotonic() + CONNECT_RETRY > deadline:
                raise LinkError(f"cannot reach node 0 at {host}:{port} ({e})") from None
            time.sleep(CONNECT_RETRY)
            continue
        sock.settimeout(None)
        _keepalive(sock)
        return sock
