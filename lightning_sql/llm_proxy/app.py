"""The proxy's ASGI app (Starlette): OpenAI-compatible routes, bare and under a rollout attempt.

Routes: ``POST /chat/completions``, ``POST /completions``, ``GET /models``, each also under ``/v1`` and
under ``/rollout/<rid>/attempt/<aid>`` (with or without ``/v1``), plus ``GET /health``.

In front of the routes: the ``Host``, ``Origin`` and ``Content-Type`` rules of
``lightning_sql.server.guard`` (a web page cannot inject calls), a body limit (413), and the token
when one is set (401).  A call: its body is validated (a malformed one gets 400 and nothing is stored); its attribution
(``SpanRecorder.attribute``) runs while the upstream is asked, except when unknown attempts are refused,
where it comes first; the upstream's answer, error or stream reaches the client unchanged; the span is
stored before the response ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from lightning_sql.llm_proxy.config import ModelRouter, ProxySettings, Upstream
from lightning_sql.llm_proxy.recorder import SpanRecorder
from lightning_sql.llm_proxy.spans import Attribution, CallRecord
from lightning_sql.llm_proxy.streaming import CallKind, StreamAssembler
from lightning_sql.llm_proxy.upstream import Forwarded, UpstreamClient, UpstreamFailure
from lightning_sql.server.limits import BodyTooLarge

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = ["ProxyApp"]

logger = logging.getLogger(__name__)

_ERROR_BODY_LIMIT = 4000  # characters of an upstream error body kept on the span


def _error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status
    )


def _trace_parent(header: str | None) -> tuple[str, str] | None:
    """(trace id, span id) of a W3C ``traceparent`` header, or None."""
    if not header:
        return None
    parts = header.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    trace_id, span_id = parts[1].lower(), parts[2].lower()
    try:
        if int(trace_id, 16) == 0 or int(span_id, 16) == 0:
            return None
    except ValueError:
        return None
    return trace_id, span_id


def _validate(kind: CallKind, body: Any) -> str | None:
    """Why the body is not a valid call, or None."""
    if not isinstance(body, dict):
        return "The request body must be a JSON object"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "'model' must be a non-empty string"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "'stream' must be a boolean"
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return "'messages' must be a non-empty list of message objects"
        if not all(isinstance(m.get("role"), str) for m in messages):
            return "every message needs a 'role' string"
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            return "'prompt' must be a string or a non-empty list"
    return None


class _TokenMiddleware:
    """Every call but ``/health`` carries ``Authorization: Bearer <token>`` (an OpenAI client's api_key)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") != "/health":
            given = dict(scope.get("headers", [])).get(b"authorization", b"")
            scheme, _, value = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(value.strip(), self.token):
                answer = _error(401, "This proxy needs its token: send 'Authorization: Bearer <token>' "
                                "(the api_key of an OpenAI client)", "authentication_error")
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _middleware(settings: ProxySettings) -> list[Middleware]:
    """Outermost first: the Host/Origin/Content-Type rules, the body limit, the token."""
    from lightning_sql.server.guard import JSON_TYPE, BrowserGuardMiddleware, HostPolicy
    from lightning_sql.server.limits import BodyLimitMiddleware

    stack = [
        Middleware(
            BrowserGuardMiddleware,
            hosts=HostPolicy(settings.host, settings.allowed_hosts),
            body_types=lambda path: (JSON_TYPE,),
        ),
        Middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes),
    ]
    if settings.token is not None:
        stack.append(Middleware(_TokenMiddleware, token=settings.token))
    return stack


class ProxyApp:
    """The proxy's state and its Starlette app; one per server (thread, task or process)."""

    def __init__(
        self,
        settings: ProxySettings,
        get_store: Callable[[], LightningStore | None],
        unattributed_target: tuple[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.router = ModelRouter(settings.upstreams)
        self.recorder = SpanRecorder(get_store, settings.unattributed, unattributed_target)
        self._client: UpstreamClient | None = None
        routes: list[Route] = [Route("/health", self.health, methods=["GET"])]
        for prefix in ("", "/rollout/{rollout_id}/attempt/{attempt_id}"):
            for version in ("", "/v1"):
                base = prefix + version
                routes.append(Route(base + "/chat/completions", self.chat, methods=["POST"]))
                routes.append(Route(base + "/completions", self.completion, methods=["POST"]))
                routes.append(Route(base + "/models", self.models, methods=["GET"]))
        self.app = Starlette(routes=routes, lifespan=self._lifespan, middleware=_middleware(settings))

    def update_upstreams(self, upstreams: list[Upstream]) -> None:
        """Serve a new model list from the next call on (calls in flight finish on the old one)."""
        self.router = ModelRouter(upstreams)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._client = UpstreamClient(self.settings)
        try:
            yield
        finally:
            await self.recorder.drain()
            await self.recorder.close_unattributed()
            await self._client.aclose()

    @property
    def client(self) -> UpstreamClient:
        if self._client is None:  # served without its lifespan (e.g. a bare ASGI test client)
            self._client = UpstreamClient(self.settings)
        return self._client

    # --- routes ----------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "lightning_sql"}
            for name in self.router.model_names
        ]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        return await self._call(request, "chat")

    async def completion(self, request: Request) -> Response:
        return await self._call(request, "completion")

    # --- one call --------------------------------------------------------------------------------

    async def _call(self, request: Request, kind: CallKind) -> Response:
        start = time.time()
        params = request.path_params
        requested = (params["rollout_id"], params["attempt_id"]) if "rollout_id" in params else None
        try:
            raw = await request.body()
        except BodyTooLarge as exc:
            return _error(413, str(exc.detail), "invalid_request_error", "request_too_large")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return _error(400, f"The request body is not valid JSON: {exc}", "invalid_request_error")
        problem = _validate(kind, body)
        if problem is not None:
            return _error(400, problem, "invalid_request_error")
        router = self.router
        if not router.upstreams(body["model"]):
            return _error(
                404, f"The model {body['model']!r} is not served here (served: {router.model_names})",
                "invalid_request_error", "model_not_found",
            )
        stream = bool(body.get("stream", False))
        record = CallRecord(
            kind=kind, request=body, stream=stream, start_time=start,
            trace_parent=_trace_parent(request.headers.get("traceparent")),
        )
        attribution = asyncio.ensure_future(self.recorder.attribute(requested))
        if self.settings.unattributed == "refuse":
            try:
                target = await attribution
            except Exception as exc:  # noqa: BLE001 - the store could not say: refuse rather than guess
                logger.warning("LLM proxy: cannot check rollout %s: %r", requested, exc)
                return _error(503, f"The store cannot attribute this call: {exc}", "store_unavailable")
            if target is None:
                where = f"rollout {requested[0]!r} attempt {requested[1]!r}" if requested else "no rollout attempt"
                return _error(404, f"Refused: {where} is not known to the store", "invalid_request_error",
                              "unknown_rollout_attempt")
        try:
            forwarded = await self.client.send(router, kind, body, stream)
        except UpstreamFailure as exc:
            record.upstream, record.tries = exc.upstream, exc.tries
            record.error_type, record.error_message = exc.kind, str(exc)
            await self._store(record, attribution)
            return _error(exc.status, str(exc), "upstream_error", exc.kind)
        record.upstream, record.tries = forwarded.upstream, forwarded.tries
        record.status_code = forwarded.response.status_code
        content_type = forwarded.response.headers.get("content-type", "")
        if stream and record.status_code == 200 and content_type.startswith("text/event-stream"):
            return StreamingResponse(
                self._relay(forwarded, record, attribution),
                status_code=200,
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        return await self._answer(forwarded, record, attribution)

    async def _answer(
        self, forwarded: Forwarded, record: CallRecord, attribution: asyncio.Future[Attribution | None]
    ) -> Response:
        """A whole (non-streamed or failed) upstream response, recorded, then returned unchanged."""
        response = forwarded.response
        try:
            content = await response.aread()
        except httpx.TimeoutException as exc:
            record.error_type, record.error_message = type(exc).__name__, f"Upstream timed out: {exc}"
            await forwarded.close()
            await self._store(record, attribution)
            return _error(504, record.error_message, "upstream_error", record.error_type)
        except httpx.HTTPError as exc:
            record.error_type, record.error_message = type(exc).__name__, f"Upstream failed: {exc}"
            await forwarded.close()
            await self._store(record, attribution)
            return _error(502, record.error_message, "upstream_error", record.error_type)
        await forwarded.close()
        if 200 <= response.status_code < 300:
            try:
                parsed = orjson.loads(content)
            except orjson.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                if record.stream:  # an upstream that ignored stream=true: the JSON answer is what it sent
                    record.stream = False
                record.response = parsed
            else:
                record.error_type, record.error_message = "invalid_response", content[:_ERROR_BODY_LIMIT].decode(
                    "utf-8", "replace"
                )
        else:
            record.error_type = str(response.status_code)
            record.error_message = content[:_ERROR_BODY_LIMIT].decode("utf-8", "replace")
        await self._store(record, attribution)
        return Response(
            content, status_code=response.status_code,
            media_type=response.headers.get("content-type", "application/json"),
        )

    async def _relay(
        self, forwarded: Forwarded, record: CallRecord, attribution: asyncio.Future[Attribution | None]
    ) -> AsyncIterator[bytes]:
        """Pass the upstream's stream through chunk by chunk; record the assembled call at its end.

        The span is stored before the ``[DONE]`` event goes out (or, without one, before the response
        ends): clients stop reading at ``[DONE]``, and by then the call is in the store.  A stream the
        client leaves, or the upstream breaks, is recorded all the same, marked cancelled or failed.
        """
        assembler = StreamAssembler(record.kind)
        recording: asyncio.Task[None] | None = None
        try:
            async for chunk in forwarded.response.aiter_raw():
                if record.first_chunk_time is None:
                    record.first_chunk_time = time.time()
                if recording is not None:
                    yield chunk
                    continue
                assembler.feed(chunk)
                if not assembler.done:
                    yield chunk
                    continue
                # Hold back the [DONE] event (or, when it began in an earlier chunk, the rest of it).
                done_at = chunk.find(b"[DONE]")
                cut = chunk.rfind(b"data:", 0, done_at) if done_at >= 0 else -1
                head, tail = (chunk[:cut], chunk[cut:]) if cut >= 0 else (b"", chunk)
                if head:
                    yield head
                self._finish_stream(record, assembler)
                recording = self.recorder.record_task(record, attribution)
                await asyncio.shield(recording)
                if tail:
                    yield tail
            if recording is None:
                assembler.close()
                self._finish_stream(record, assembler)
                recording = self.recorder.record_task(record, attribution)
                await asyncio.shield(recording)
        except httpx.HTTPError as exc:
            if recording is None:
                record.error_type, record.error_message = type(exc).__name__, f"Upstream stream broke: {exc}"
        finally:
            if recording is None:
                if record.error_type is None:
                    record.cancelled = True
                    record.error_type, record.error_message = "cancelled", "The client closed the stream"
                self._finish_stream(record, assembler)
                self.recorder.record_task(record, attribution)
            self._close_in_background(forwarded)

    @staticmethod
    def _finish_stream(record: CallRecord, assembler: StreamAssembler) -> None:
        record.response = assembler.result()
        record.finish()
        if assembler.error is not None and record.error_type is None:
            record.error_type = "stream_error"
            record.error_message = orjson.dumps(assembler.error).decode()[:_ERROR_BODY_LIMIT]

    def _close_in_background(self, forwarded: Forwarded) -> None:
        task = asyncio.get_running_loop().create_task(forwarded.close())
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _store(self, record: CallRecord, attribution: asyncio.Future[Attribution | None]) -> None:
        await asyncio.shield(self.recorder.record_task(record, attribution))
