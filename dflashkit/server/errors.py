"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a fitting HTTP status.

Every failure a client can cause (bad JSON, wrong types, unknown model, too-long prompt, full queue) is an
`APIError` or is turned into one by the handlers installed with `install_error_handlers`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflashkit.errors import DFlashError
from dflashkit.server.scheduler import JobCancelled, ServerShuttingDown

log = logging.getLogger("dflashkit.server")


class APIError(Exception):
    """An error answered to the client as OpenAI does."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_exception(exc: BaseException) -> APIError:
    """An APIError for an exception raised while serving: dflashkit's input errors are the client's (400)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, DFlashError):
        return bad_request(str(exc))
    if isinstance(exc, ServerShuttingDown):
        return APIError(
            503, str(exc), type="server_error", code="shutting_down", headers={"Retry-After": str(exc.retry_after)}
        )
    if isinstance(exc, JobCancelled):  # its client left or timed out: nobody reads this
        if exc.reason == "timeout":
            return APIError(504, str(exc), type="timeout_error", code="timeout")
        return APIError(499, str(exc), code="cancelled")
    log.error("generation failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
            code="invalid_json",
        )
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None  # the top-level field, as OpenAI names it; the message has the full path
    message = first.get("msg", "invalid value")
    if loc:
        message = f"{'.'.join(loc)}: {message}"
        if "input" in first and first.get("type") != "missing":
            message += f" (got {first['input']!r:.80})"
    more = len(errors) - 1
    if more:
        message += f"; and {more} more problem{'s' if more > 1 else ''}"
    return bad_request(message, param=param, code="missing" if first.get("type") == "missing" else "invalid_value")


Renderer = Callable[[APIError], dict[str, Any]]


def error_response(path: str, error: APIError, renderers: dict[str, Renderer] | None = None) -> JSONResponse:
    """The error answered on `path`: OpenAI's body, or, where the path begins with a key of `renderers`, the body
    that renderer makes (another API's error shape)."""
    for prefix, render in (renderers or {}).items():
        if path.startswith(prefix):
            return JSONResponse(render(error), status_code=error.status, headers=error.headers)
    return error.response()


def install_error_handlers(app: FastAPI, renderers: dict[str, Renderer] | None = None) -> None:
    """Answer every error with an OpenAI-style JSON body, or, for paths that begin with a key of `renderers`, the
    body that renderer makes (another API's error shape)."""

    def respond(request: Request, error: APIError) -> JSONResponse:
        return error_response(request.url.path, error, renderers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(request, APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, from_exception(exc))
