"""The HTTP server around the app: uvicorn, with the two limits uvicorn lacks.

- Header timeout: a connection must deliver a request's complete headers within
  `--read-timeout` seconds of its first byte (or of connecting), else it is closed. uvicorn
  only times out idle keep-alive connections, so 500 clients sending half a header line
  would otherwise hold 500 sockets forever. (The body's own timeout is in boundary.py.)
- Keep-alive: an idle connection stays open `--keep-alive-timeout` seconds (uvicorn's
  default is 5 s). Clients drop their idle connections after their own limit (httpx 5 s,
  aiohttp 15 s); a server that closes first races with the request the client sends on
  the connection at that moment, which then fails with a reset and no answer.
- Shutdown deadline: on SIGTERM/SIGINT uvicorn stops accepting and waits for in-flight
  requests; after `--shutdown-timeout` seconds the dispatcher ends whatever is still
  running with a 503 (streams get an error event and `data: [DONE]`), so every client gets
  an answer before the connections close.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from wire.server_args import ServerArgs

SHUTDOWN_GRACE = 5.0    # seconds past --shutdown-timeout for the 503s to be written


def header_timeout_protocol(timeout: float) -> type[H11Protocol]:
    class HeaderTimeoutProtocol(H11Protocol):
        """h11 with a deadline on each request's headers."""

        def connection_made(self, transport) -> None:   # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._arm()            # bytes of a new request: its headers are due in time
            super().data_received(data)
            if not self._between_requests():
                self._disarm()         # the headers are complete: the request is running

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
                self.transport.close()

    return HeaderTimeoutProtocol


class Server(uvicorn.Server):
    """uvicorn.Server that ends in-flight requests `shutdown_timeout` seconds into a
    graceful shutdown (`on_deadline`), then lets their answers be written."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float,
                 on_deadline: Callable[[], None]):
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.on_deadline = on_deadline
        self.on_shutdown: Callable[[], None] | None = None   # called as shutdown begins

    async def shutdown(self, sockets=None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        deadline = asyncio.get_running_loop().call_later(self.shutdown_timeout,
                                                         self.on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


SHUTTING_DOWN = "The server is shutting down."


def make_server(app, args: ServerArgs, dispatcher) -> Server:
    """The uvicorn server of an API process: at the shutdown deadline `dispatcher` (its
    state.Dispatcher) ends what is still in flight with a 503."""
    config = uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop",
                            log_level=args.log_level, access_log=False,
                            http=header_timeout_protocol(args.read_timeout),
                            timeout_keep_alive=args.keep_alive_timeout,
                            timeout_graceful_shutdown=int(args.shutdown_timeout +
                                                          SHUTDOWN_GRACE))
    return Server(config, args.shutdown_timeout, lambda: dispatcher.end_all(SHUTTING_DOWN))
