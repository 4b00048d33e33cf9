"""uvicorn's h11 protocol with a request deadline: a slow client is dropped.

uvicorn times out idle keep-alive connections, but not a request that arrives slowly: a
client trickling its headers or body a byte at a time holds a connection for as long as it
likes. Here every request (headers and body) must arrive within `timeout` seconds of the
connection opening, or of the previous response on it; else the connection is closed.
Once a request has fully arrived, its deadline is off (the answer may take longer).
"""

from __future__ import annotations

from uvicorn.protocols.http.h11_impl import H11Protocol


class DeadlineProtocol(H11Protocol):
    request_timeout = 10.0
    _deadline = None
    _answered = (
        None  # the cycle of the last response sent (its request is not the one in hand)
    )

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not self._answered and not cycle.more_body:
            self._disarm()  # the request in hand has fully arrived

    def on_response_complete(self) -> None:
        self._answered = self.cycle
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets the same time (a pipelined one
        super().on_response_complete()  # that has fully arrived is handled here, and disarms it)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info(
                "dropping %s: no whole request within %.1fs",
                self.client,
                self.request_timeout,
            )
            self.transport.close()


def protocol_with_deadline(timeout: float) -> type[DeadlineProtocol]:
    return type("DeadlineProtocol", (DeadlineProtocol,), {"request_timeout": timeout})
