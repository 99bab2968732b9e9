"""Forwarding to the model servers: pooled ``httpx.AsyncClient`` connections, per proxy event loop.

``UpstreamClient.send`` picks an upstream for the model name (``ModelRouter``), rewrites the body for
it (its model name, its default parameters, ``return_token_ids`` for vLLM, ``logprobs`` when asked),
and opens the response as a stream.  Connection errors and 5xx answers are retried ``num_retries``
times on another upstream of the same name when there is one, after ``retry_backoff`` seconds, doubled
each time.  A read timeout is not retried: the upstream may still be generating.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from lightning_sql.llm_proxy.config import ModelRouter, ProxySettings, Upstream
from lightning_sql.llm_proxy.streaming import CallKind

__all__ = ["UpstreamClient", "Forwarded", "UpstreamFailure", "ROUTES"]

logger = logging.getLogger(__name__)

ROUTES: dict[CallKind, str] = {"chat": "/chat/completions", "completion": "/completions"}
_MAX_BACKOFF_S = 5.0
# httpcore's pool looks at every one of its connections whenever a request starts or ends (an
# expiry check that asks the socket whether it is readable), so a call's cost grows with the pool's
# size. Calls are spread round-robin over this many smaller pools instead of one large one.
POOL_SHARDS = 8


@dataclass
class Forwarded:
    """An upstream's open response; the caller reads or streams it, then calls ``close()``."""

    upstream: Upstream
    response: httpx.Response
    tries: int
    router: ModelRouter
    closed: bool = False

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self.response.aclose()
        finally:
            self.router.release(self.upstream)


class UpstreamFailure(Exception):
    """No upstream answered: connection errors (after the retries) or a timeout."""

    def __init__(self, upstream: Upstream | None, tries: int, kind: str, message: str, status: int) -> None:
        super().__init__(message)
        self.upstream = upstream
        self.tries = tries
        self.kind = kind
        """``error.type`` recorded on the span."""
        self.status = status
        """The status the client gets: 502 (unreachable) or 504 (timeout)."""


def upstream_body(body: dict[str, Any], upstream: Upstream, kind: CallKind, logprobs: bool) -> dict[str, Any]:
    """The request body as this upstream receives it."""
    out = dict(body)
    out["model"] = upstream.upstream_model
    for key, value in upstream.defaults.items():
        out.setdefault(key, value)
    if upstream.wants_token_ids:
        out["return_token_ids"] = True
    if logprobs and "logprobs" not in out:
        out["logprobs"] = True if kind == "chat" else 1
    return out


class UpstreamClient:
    """Sends proxied calls upstream with pooling, timeouts and retries.

    Requests go straight to pooled ``httpx.AsyncHTTPTransport``s: a proxy needs none of
    ``AsyncClient``'s per-request layers (cookie jar, redirects, auth, URL merging), which cost more
    CPU than the rest of the forwarding.
    """

    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        per_shard = max(-(-settings.max_connections // POOL_SHARDS), 1)
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        self._transports = [httpx.AsyncHTTPTransport(limits=limits, trust_env=False) for _ in range(POOL_SHARDS)]
        self._turn = itertools.cycle(self._transports)
        self._urls: dict[tuple[str, CallKind], httpx.URL] = {}
        self._timeouts: dict[float, dict[str, float | None]] = {}

    async def aclose(self) -> None:
        await asyncio.gather(*(transport.aclose() for transport in self._transports))

    def _request(self, upstream: Upstream, kind: CallKind, body: dict[str, Any], stream: bool) -> httpx.Request:
        url = self._urls.get((upstream.api_base, kind))
        if url is None:
            url = self._urls[(upstream.api_base, kind)] = httpx.URL(upstream.api_base + ROUTES[kind])
        headers = {"content-type": "application/json", "accept": "text/event-stream" if stream else "application/json"}
        if upstream.api_key:
            headers["authorization"] = f"Bearer {upstream.api_key}"
        headers.update(upstream.extra_headers)
        read = (upstream.stream_timeout if stream else None) or upstream.timeout or self.settings.request_timeout
        timeout = self._timeouts.get(read)
        if timeout is None:
            timeout = self._timeouts[read] = httpx.Timeout(read, connect=self.settings.connect_timeout).as_dict()
        return httpx.Request(
            "POST",
            url,
            content=orjson.dumps(upstream_body(body, upstream, kind, self.settings.logprobs)),
            headers=headers,
            extensions={"timeout": timeout},
        )

    async def send(self, router: ModelRouter, kind: CallKind, body: dict[str, Any], stream: bool) -> Forwarded:
        """Open the upstream's response (headers received, body not read).

        Raises:
            UpstreamFailure: every try failed to connect, or the upstream timed out.
        """
        model_name = str(body["model"])
        tried: list[Upstream] = []
        attempts = self.settings.num_retries + 1
        for attempt in range(attempts):
            upstream = router.pick(model_name, avoid=tried)
            if upstream is None:
                raise UpstreamFailure(None, attempt, "model_not_found", f"No upstream serves {model_name!r}", 404)
            tried.append(upstream)
            last = attempt == attempts - 1
            try:
                transport = next(self._turn)
                response = await transport.handle_async_request(self._request(upstream, kind, body, stream))
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.WriteError) as exc:
                router.release(upstream)
                if last:
                    raise UpstreamFailure(
                        upstream, attempt + 1, type(exc).__name__, f"Upstream {upstream.name} unreachable: {exc}", 502
                    ) from exc
                logger.info("LLM proxy: %s failed (%r), retrying", upstream.name, exc)
            except httpx.TimeoutException as exc:
                router.release(upstream)
                raise UpstreamFailure(
                    upstream, attempt + 1, type(exc).__name__, f"Upstream {upstream.name} timed out: {exc}", 504
                ) from exc
            except httpx.HTTPError as exc:
                router.release(upstream)
                raise UpstreamFailure(
                    upstream, attempt + 1, type(exc).__name__, f"Upstream {upstream.name} failed: {exc}", 502
                ) from exc
            else:
                if response.status_code < 500 or last:
                    return Forwarded(upstream, response, attempt + 1, router)
                logger.info("LLM proxy: %s answered %d, retrying", upstream.name, response.status_code)
                await response.aclose()
                router.release(upstream)
            await asyncio.sleep(min(self.settings.retry_backoff * (2**attempt), _MAX_BACKOFF_S))
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises
