"""Typed ZeroMQ endpoints: an Inbox (PULL, bound by its owner) and an Outbox (PUSH, connects).

Receivers never see raw frames: each inbox decodes with its process's decoder
(wire.codec.SCHEDULER_INBOX, ...), so it yields only the messages that process receives. A
frame that fails to decode (or that the codec fails on in any other way) is logged and
counted in `Inbox.bad_frames`, then skipped; a peer sending
garbage costs a log line, never the receiving process. High-water marks are unlimited so a
slow consumer applies back-pressure through memory rather than by dropping or blocking a step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import zmq

from wire.codec import DecodeError, InboxDecoder, encode

log = logging.getLogger(__name__)


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


class _PullSocket:
    """A bound PULL socket that decodes frames, dropping (and counting) bad ones."""

    def __init__(self, ctx: zmq.Context, address: str, decoder: InboxDecoder):
        self.sock = _socket(ctx, zmq.PULL)
        self.sock.bind(address)
        self.decoder = decoder
        self.bad_frames = 0

    def _decode(self, frame: bytes):
        try:
            return self.decoder.decode(frame)
        except DecodeError as e:
            self.bad_frames += 1
            log.error("dropped a bad frame (%d so far): %s", self.bad_frames, e)
        except Exception:   # a codec bug must not take the process down either
            self.bad_frames += 1
            log.exception("dropped a frame the codec failed on (%d bad so far)",
                          self.bad_frames)
        return None


class Inbox(_PullSocket):
    """The owner's PULL socket. `recv(timeout_ms)` blocks up to timeout (None: forever) for
    the first message, then drains whatever else is already queued without blocking."""

    def __init__(self, ctx: zmq.Context, address: str, decoder: InboxDecoder):
        super().__init__(ctx, address, decoder)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def recv(self, timeout_ms: int | None) -> list:
        if not self.poller.poll(timeout_ms):
            return []
        out = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = self._decode(frame)
            if msg is not None:
                out.append(msg)


class AsyncInbox(_PullSocket):
    """Inbox for an asyncio process (the API): `await recv_one()` is the next good message."""

    async def recv_one(self):
        while True:
            msg = self._decode(await self.sock.recv())
            if msg is not None:
                return msg


class Outbox:
    """A PUSH socket connected to another process's inbox, or to several workers' inboxes
    (a sequence of addresses): ZeroMQ then hands each message to the next worker in turn
    (round-robin over the connected peers), which is all the load balancing they get."""

    def __init__(self, ctx: zmq.Context, address: str | Sequence[str]):
        self.sock = _socket(ctx, zmq.PUSH)
        for a in [address] if isinstance(address, str) else address:
            self.sock.connect(a)

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def send_frame(self, frame: bytes) -> None:
        """Send a frame already made by codec.encode (e.g. to check it could be made)."""
        self.sock.send(frame)
