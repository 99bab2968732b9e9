"""Request bodies are size-limited: a larger one gets a 413 with a message, before it is read whole."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lightning_sql.server.errors import ApiError, error_response


def too_large_message(limit: int) -> str:
    return f"request body larger than the server's limit of {limit} bytes (lightning-sql serve --max-body-mb)"


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


class BodyLimitMiddleware:
    """Refuses a declared ``Content-Length`` over the limit at once, and stops reading a streamed
    body at the limit (the app's read raises ``BodyTooLarge``, answered as 413)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await error_response(400, "Content-Length is not a number")(scope, receive, send)
                    return
                if declared > self.limit:
                    await error_response(413, too_large_message(self.limit))(scope, receive, send)
                    return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)
