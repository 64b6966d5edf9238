"""Checks each HTTP request passes before the app reads it: its Host and Origin, its body's size and time, its API key.

Pure ASGI middlewares (streamed answers go through unbuffered), applied by ``create_app`` in this order, from the
outside in: :class:`HostGuard` (a DNS-rebinding page cannot drive a server on localhost), :class:`BodyLimit` (a
body too large is refused from its Content-Length, before it is read, or as it arrives; a body too slow to arrive
is refused), :class:`KeyGuard` (the API key, from the headers alone, so that a client without it makes the server
read nothing). Their refusals are the app's own errors: OpenAI's shape, Anthropic's on /v1/messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dflashkit.server.errors import APIError, Renderer, error_response

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# what the key guards: the API and the pages that describe it
GUARDED_PREFIXES = ("/v1/", "/docs/")
GUARDED_PATHS = ("/v1", "/docs", "/redoc", "/openapi.json")
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _has_body(headers: Headers) -> bool:
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() not in ("", "0")


async def refuse(scope: Scope, send: Send, error: APIError, renderers: dict[str, Renderer] | None) -> None:
    """Answer `error` in the shape of the request's API. A request whose body was not read is answered with
    ``Connection: close``: the server then reads no more of that body (the connection ends instead)."""
    if _has_body(Headers(scope=scope)):
        error.headers = {**(error.headers or {}), "Connection": "close"}
    response = error_response(scope.get("path", ""), error, renderers)
    await response(scope, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def host_name(value: str) -> str:
    """The host part of a Host header's value ("[::1]:8000" → "::1", "LocalHost." → "localhost")."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 address, maybe with a port
        return value[1 : value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _host_port(value: str, default_port: int | None) -> tuple[str, int | None]:
    """A Host header's (or an origin's netloc's) host name and port, the port defaulting to `default_port`."""
    name = host_name(value)
    rest = value.strip()
    rest = rest[rest.find("]") + 1 :] if rest.startswith("[") else rest if rest.count(":") == 1 else ""
    port = rest.rsplit(":", 1)[1] if ":" in rest else ""
    return name, int(port) if port.isdigit() else default_port


class HostGuard:
    """Refuses a request whose Host is not one this server is known by (400, ``host_not_allowed``), and a
    browser's request from another origin that is not allowed (403, ``origin_not_allowed``).

    ``allowed_hosts``: host names (a port in the Host header is ignored; ``*.example.com`` matches its subdomains);
    None: the loopback names only (localhost, 127.0.0.1, ::1), so that a page whose own name resolves to this
    machine (DNS rebinding) cannot call it; ``["*"]``: any. An Origin header is allowed when it is the page the
    server serves itself (its host and port are the Host header's) or is listed in ``allowed_origins`` (CORS's
    list; ``*``: any)."""

    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: list[str] | None = None,
        allowed_origins: list[str] | None = None,
        renderers: dict[str, Renderer] | None = None,
    ) -> None:
        self.app, self.renderers = app, renderers
        names = [host_name(h) for h in (allowed_hosts if allowed_hosts is not None else LOOPBACK_HOSTS)]
        self.any_host = "*" in names
        self.hosts = {h for h in names if not h.startswith("*.")}
        self.domains = tuple(h[1:] for h in names if h.startswith("*."))  # ".example.com"
        origins = [o.strip().rstrip("/").lower() for o in allowed_origins or []]
        self.any_origin = "*" in origins
        self.origins = set(origins)

    def host_allowed(self, host: str) -> bool:
        name = host_name(host)
        return self.any_host or name in self.hosts or (bool(name) and name.endswith(self.domains))

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in DEFAULT_PORTS or not parts.netloc:  # "null" (a sandboxed page, a file), junk
            return False
        default = DEFAULT_PORTS[parts.scheme]
        return _host_port(parts.netloc, default) == _host_port(host, default)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(Headers(scope=scope))
        if error is not None:
            await refuse(scope, send, error, self.renderers)
            return
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers) -> APIError | None:
        """Why a request with these headers is refused (its Host, then its Origin), or None."""
        host, origin = headers.get("host", ""), headers.get("origin")
        if not self.host_allowed(host):
            return APIError(
                400,
                f"Host {host!r} is not one this server answers to: start it with --allowed-hosts naming it (or "
                "'*' for any; by default only localhost, 127.0.0.1 and ::1)",
                code="host_not_allowed",
            )
        if origin is not None and not self.origin_allowed(origin, host):
            return APIError(
                403,
                f"Requests from pages at {origin!r} are not allowed: start the server with --allowed-origins "
                "naming that origin",
                code="origin_not_allowed",
            )
        return None


class _BodyRefused(Exception):
    """The request's body was refused (too large, too slow): its answer is sent."""


class BodyLimit:
    """Refuses a request body larger than ``max_bytes`` (413, ``request_too_large``): from its Content-Length
    before any of it is read, or, sent in chunks, once it has passed the limit; and a body that has not arrived
    ``timeout`` seconds after its request's headers did (408, ``request_timeout``). The app's reads of the body
    then fail and its own answer, if any, is dropped."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, timeout: float, renderers: dict[str, Renderer] | None = None
    ) -> None:
        self.app, self.max_bytes, self.timeout, self.renderers = app, max_bytes, timeout, renderers

    def too_large(self, size: int | None = None) -> APIError:
        """The refusal of a body of `size` bytes (None: sent in chunks, refused once past the limit)."""
        size_text = f"{size} bytes" if size is not None else "larger than that"
        return APIError(
            413,
            f"This server accepts request bodies of up to {self.max_bytes} bytes (--max-body-bytes), and this one "
            f"is {size_text}",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            await refuse(scope, send, self.too_large(int(length)), self.renderers)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        received, ended, started, answered = 0, False, False, False

        async def answer(error: APIError) -> None:
            nonlocal answered
            if not started:
                answered = True
                await refuse(scope, send, error, self.renderers)
            raise _BodyRefused(error.message)

        async def limited_receive() -> Message:
            nonlocal received, ended
            if ended:  # the body is in: what follows is the disconnect the app may wait for
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await answer(
                    APIError(
                        408,
                        f"The request body did not arrive within {self.timeout:g} s (--body-timeout)",
                        code="request_timeout",
                    )
                )
            if message["type"] != "http.request":
                ended = True
                return message
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await answer(self.too_large())
            ended = not message.get("more_body", False)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if answered:  # the app's answer to a body it could not read: ours went out instead
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyRefused:
            if not answered:
                raise


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_id(key: str) -> str:
    """A short, stable id of an API key that does not give the key away: its sha256's first 16 hex digits."""
    return _digest(key).hex()[:16]


class KeyGuard:
    """Checks the API key from the request's headers alone (``Authorization: Bearer KEY`` or ``x-api-key: KEY``,
    compared in constant time with each of ``keys``) and refuses a request to the API or its docs (/v1/*, /docs,
    /redoc, /openapi.json) that does not carry one (401, ``invalid_api_key``) before anything of its body is
    read; /health, /metrics and the playground page stay open.

    Sets, on every request, ``scope["state"]["tenant"]`` (``request.state.tenant``: "" when the server has no
    keys, else the :func:`key_id` of the valid key sent, "" for none) and ``scope["state"]["authenticated"]``
    (True when the server has no keys or a valid key was sent)."""

    def __init__(
        self, app: ASGIApp, keys: list[str] | None = None, renderers: dict[str, Renderer] | None = None
    ) -> None:
        self.app, self.renderers = app, renderers
        self.digests = [_digest(k) for k in keys or []]

    def check(self, headers: Headers) -> tuple[str, bool]:
        """(tenant, authenticated) of a request with these headers."""
        if not self.digests:
            return "", True
        bearer = headers.get("authorization", "")
        sent = bearer[7:] if bearer[:7].lower() == "bearer " else headers.get("x-api-key", "")
        digest = _digest(sent.strip())
        valid = False
        for expected in self.digests:  # every key compared, in constant time: no timing tells which nearly matched
            valid |= secrets.compare_digest(digest, expected)
        return (key_id(sent.strip()), True) if valid else ("", False)

    @staticmethod
    def guarded(path: str) -> bool:
        return path in GUARDED_PATHS or path.startswith(GUARDED_PREFIXES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant, authenticated = self.check(Headers(scope=scope))
        state = scope.setdefault("state", {})
        state["tenant"], state["authenticated"] = tenant, authenticated
        if not authenticated and self.guarded(scope.get("path", "")):
            error = APIError(
                401,
                "Invalid or missing API key: this server needs 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await refuse(scope, send, error, self.renderers)
            return
        await self.app(scope, receive, send)
