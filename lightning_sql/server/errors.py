"""Errors as JSON: every failure the server answers is ``{"detail": message}`` with a 4xx or 5xx status.

Bad input (the store's ``ValueError``/``TypeError``, pydantic's validation errors, malformed bodies)
is a 400 with the reason, as is a value the database refuses (a number out of range); writing through a read-only server is a 403; an unreachable database is a
503 (clients retry it).  Anything else is a 500 whose body names only the exception type: the
traceback goes to the server's log, never to the client.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class JsonResponse(Response):
    """JSON rendered with orjson (pydantic's ``mode="json"`` dumps go straight in)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(status: int, detail: str, *, headers: dict[str, str] | None = None, **extra: Any) -> JsonResponse:
    return JsonResponse({"detail": detail, **extra}, status_code=status, headers=headers)


class ApiError(HTTPException):
    """A request the server refuses, with the status and message the client gets."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(status_code=status_code, detail=detail)


def _is_refused_value(exc: BaseException) -> bool:
    """A value the database cannot hold (a number out of range): bad input, not an outage."""
    from sqlalchemy.exc import DataError

    return isinstance(exc, DataError | OverflowError)


def _is_database_error(exc: BaseException) -> bool:
    from sqlalchemy.exc import DBAPIError, OperationalError

    from lightning_sql.store import StoreUnavailableError

    return isinstance(exc, StoreUnavailableError | OperationalError | DBAPIError | ConnectionError)


class ErrorHandlers:
    """The app's exception handlers; ``on_database_error`` is told of each database failure."""

    def __init__(self, on_database_error: Any = None) -> None:
        self._on_database_error = on_database_error

    def mapping(self) -> dict[Any, Any]:
        return {
            HTTPException: self.http_error,
            ValueError: self.bad_request,
            TypeError: self.bad_request,
            LookupError: self.bad_request,
            PermissionError: self.forbidden,
        }

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, str(exc.detail), headers=headers)

    async def bad_request(self, request: Request, exc: Exception) -> Response:
        return error_response(400, _message(exc), error_type=type(exc).__name__)

    async def forbidden(self, request: Request, exc: Exception) -> Response:
        return error_response(403, _message(exc), error_type=type(exc).__name__)

    async def unexpected(self, request: Request, exc: Exception) -> Response:
        if _is_refused_value(exc):
            logger.warning("The database refused a value on %s %s: %s", request.method, request.url.path, exc)
            message = "a value in the request cannot be stored (out of range for its column)"
            return error_response(400, message, error_type=type(exc).__name__)
        if _is_database_error(exc):
            if self._on_database_error is not None:
                self._on_database_error(exc)
            logger.warning("Database error on %s %s: %s", request.method, request.url.path, exc)
            return error_response(503, "the database is not answering; retry later", error_type=type(exc).__name__)
        logger.error("Unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error (details in the server log)", error_type=type(exc).__name__)


class CatchAllMiddleware:
    """Turns an exception no handler took into ``ErrorHandlers.unexpected``'s JSON answer.

    Starlette's own last-resort handler answers and then re-raises; this one answers and stops.
    """

    def __init__(self, app: ASGIApp, handlers: ErrorHandlers) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            response = await self.handlers.unexpected(Request(scope), exc)
            await response(scope, receive, send)


def _message(exc: BaseException) -> str:
    """The exception's message, for pydantic errors without the URL lines pointing at its docs."""
    text = str(exc) or type(exc).__name__
    lines = [line for line in text.splitlines() if "errors.pydantic.dev" not in line]
    return "\n".join(lines).strip()
