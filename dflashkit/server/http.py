"""The HTTP/1.1 protocol `dflashkit serve` runs uvicorn with: uvicorn's h11 protocol, bounded for clients that send
too much or too slowly.

- A request line and headers larger than uvicorn's ``h11_max_incomplete_event_size`` (:data:`MAX_HEAD_BYTES` in
  :func:`uvicorn_options`) are answered 431, not 400.
- A request whose line and headers have not all arrived :attr:`GuardedH11Protocol.header_timeout` seconds after
  they began (after the connection opened, for its first request) is answered 408 and its connection closed; a
  connection that sent nothing by then is closed.
- Each write is sent at once (TCP_NODELAY), on sockets asyncio did not make too.
- A connection closed while its client is still sending (a refused body, an oversized head) is closed
  lingeringly: the answer goes out, then what the client still sends is read and dropped, for up to
  :data:`LINGER_S` seconds, so that it reads the answer rather than a reset.

Bodies are bounded by the app itself (:class:`dflashkit.server.guards.BodyLimit`). With uvicorn directly:
``uvicorn --http dflashkit.server.http:GuardedH11Protocol --h11-max-incomplete-event-size 65536 ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import TYPE_CHECKING, Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from dflashkit.server.errors import error_body

if TYPE_CHECKING:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from dflashkit.server.service import ServerSettings

MAX_HEAD_BYTES = 64 * 2**10  # a request line and headers, at most
LINGER_S = 10.0  # how long a closing connection reads what its client still sends, at most
LINGER_QUIET_S = 2.0  # ... and how long it waits for more of it


def _no_delay(transport: asyncio.Transport) -> None:
    """Send each write at once (TCP_NODELAY): asyncio sets it only on sockets it made itself, and with Nagle's
    algorithm an answer written in two parts (headers, then body; each streamed event) waits out the client's
    delayed acknowledgement, ~40 ms, on a socket handed over (``uvicorn --fd``, a socket made by a test)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Connection(h11.Connection):
    """h11's connection, remembering the status its last refused request calls for (431: a head too large).

    h11 bounds a request head only while it is incomplete: one that arrives whole in a single read passes
    however large; here, a parsed head larger than the bound is refused too."""

    def __init__(self, max_head: int) -> None:
        super().__init__(h11.SERVER, max_head)
        self.max_head, self.error_status = max_head, 400

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint
            raise
        if isinstance(event, h11.Request) and _head_size(event) > self.max_head:
            self.error_status = 431
            raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
        return event


def _head_size(request: h11.Request) -> int:
    """The bytes of a request's line and headers (as sent, give or take the spaces around each value)."""
    line = len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


class _Transport:
    """The connection's transport as uvicorn's protocol sees it: its close() is the protocol's lingering close."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self.raw, self.protocol, self.closing = transport, protocol, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)

    def is_closing(self) -> bool:
        return self.closing or self.raw.is_closing()

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.protocol.close_lingering()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering an oversized request head 431, a slow one 408, and closing lingeringly
    (see the module's description). ``header_timeout``: seconds; :func:`protocol` makes a subclass with another."""

    header_timeout: float = 10.0

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        size = config.h11_max_incomplete_event_size
        self.max_head = size if size is not None else DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = _Connection(self.max_head)
        self.head_timer: asyncio.TimerHandle | None = None
        self.linger_timer: asyncio.TimerHandle | None = None
        self.lingering = False
        self.linger_until = 0.0
        self.draining = False  # the server shuts down: close at once

    # ---- the request head's deadline ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        _no_delay(transport)
        super().connection_made(_Transport(transport, self))  # type: ignore[arg-type]
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # dropped: the connection is closing
            self._rearm_linger()
            return
        if self.conn.their_state is h11.IDLE:  # a request head begins (or goes on)
            self._arm_head_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()

    def _arm_head_timer(self) -> None:
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self.conn.trailing_data[0]:  # nothing of a request yet: an idle connection, closed quietly
            self.transport.close()
            return
        self.logger.warning("Request head not received within %g s.", self.header_timeout)
        self._send_error(
            408,
            f"the request line and headers did not arrive within {self.header_timeout:g} s",
            "request_timeout",
        )

    # ---- answers uvicorn's own ---------------------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """An invalid request, as uvicorn answers it; one whose head is too large: 431."""
        if self.conn.error_status == 431:
            self._send_error(
                431,
                f"the request line and headers are larger than this server accepts ({self.max_head} bytes)",
                "request_header_fields_too_large",
            )
        else:
            self._send_error(400, msg, "invalid_request")

    def _send_error(self, status: int, message: str, code: str) -> None:
        """Answer `status` with an OpenAI-style error body and close the connection."""
        body = json.dumps(error_body(message, "invalid_request_error", code=code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            output = self.conn.send(h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]))
            output += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # an answer is already under way: nothing more can be said
            output = b""
        self.transport.write(output)
        self.transport.close()

    # ---- closing ------------------------------------------------------------------------------------------

    def close_lingering(self) -> None:
        """Close the connection: at once when its client has nothing more to send, else after sending what is
        written, reading and dropping what the client still sends until it stops (or :data:`LINGER_S` passes)."""
        self._cancel_head_timer()
        raw = self.transport.raw  # type: ignore[attr-defined]
        sent_all = self.conn.their_state in (h11.IDLE, h11.DONE, h11.MUST_CLOSE, h11.CLOSED)
        idle = sent_all and not self.conn.trailing_data[0]
        if idle or self.draining or raw.is_closing() or not raw.can_write_eof():
            raw.close()
            return
        self.lingering = True
        raw.write_eof()  # the answer, then the end of what we send
        self.flow.resume_reading()
        self.linger_until = self.loop.time() + LINGER_S
        self._rearm_linger()

    def _rearm_linger(self) -> None:
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        delay = min(LINGER_QUIET_S, self.linger_until - self.loop.time())
        self.linger_timer = self.loop.call_later(max(0.0, delay), self.transport.raw.close)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self.linger_timer is not None:
            self.linger_timer.cancel()
            self.linger_timer = None
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self.transport = self.transport.raw  # type: ignore[attr-defined]  # the connection is the WebSocket's now
        super().handle_websocket_upgrade(event)

    def shutdown(self) -> None:
        self.draining = True
        super().shutdown()


def protocol(header_timeout: float = GuardedH11Protocol.header_timeout) -> type[GuardedH11Protocol]:
    """:class:`GuardedH11Protocol` with another header timeout (seconds)."""
    if header_timeout == GuardedH11Protocol.header_timeout:
        return GuardedH11Protocol
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments serving with the settings' header limits: this module's protocol and
    the size of a request head."""
    return {"http": protocol(settings.header_timeout), "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
