"""``POST /v1/traces``: OTLP spans stored under their rollout's run, in bounded chunks.

Which run: the one a span or the request names (``lightning_sql.run`` attribute, ``X-Lightning-SQL-Run``
header), which must hold the span's rollout; otherwise the run that holds the rollout, looked up
across the database (``catalog.py``).  A rollout id found in several runs goes to the server's
``--run`` when that is one of them, else its spans are rejected as ``ambiguous_rollout``.  Nothing
here creates a run: a span whose rollout is in no run is rejected.

Memory stays a small multiple of the body: the request is decoded once, then its spans are turned
into store spans and stored ``CHUNK_SPANS`` at a time; a request of more than ``MAX_SPANS_PER_REQUEST``
spans gets a 413, and while ``MAX_INGEST_BYTES`` of bodies are being stored further requests get a
429 with ``Retry-After`` (exporters retry both 429 and 503).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from lightning_sql.server.config import RUN_HEADER
from lightning_sql.server.otlp import (
    JSON,
    PROTOBUF,
    OtlpError,
    Outcome,
    Pending,
    collect,
    decompress,
    parse_request,
    span_count,
)

if TYPE_CHECKING:
    from lightning_sql.server.catalog import Catalog
    from lightning_sql.server.metrics import ServerMetrics
    from lightning_sql.server.stores import StorePool

logger = logging.getLogger(__name__)

# Spans one request may carry (the OpenTelemetry SDK exports 512 at a time; Phoenix queues 10,000).
MAX_SPANS_PER_REQUEST = 10_000
# Spans turned into store spans and written at a time: bounds what one request holds beyond its
# decoded message.
CHUNK_SPANS = 500
# Request bodies (decompressed) being stored at once, across requests, before a 429.
MAX_INGEST_BYTES = 64 * 1024 * 1024
RETRY_AFTER_S = 1


def _chunks(items: Iterator[Pending], size: int) -> Iterator[list[Pending]]:
    while True:
        chunk = list(itertools.islice(items, size))
        if not chunk:
            return
        yield chunk


async def resolve_runs(chunk: list[Pending], catalog: Catalog, default_run: str, outcome: Outcome) -> list[Pending]:
    """The spans of ``chunk`` with their run decided (see the module's docstring); the others rejected."""
    holders = await catalog.runs_of_rollouts([item.rollout_id for item in chunk])
    kept = []
    for item in chunk:
        runs = holders.get(item.rollout_id, ())
        if item.run is not None:
            if item.run not in runs:
                outcome.reject(1, "unknown_target", f"run {item.run!r}: Rollout {item.rollout_id} not found")
                continue
        elif len(runs) == 1:
            item.run = runs[0]
        elif default_run in runs:
            item.run = default_run
        elif runs:
            shown = ", ".join(repr(r) for r in runs[:5])
            outcome.reject(
                1, "ambiguous_rollout", f"Rollout {item.rollout_id} is in runs {shown}: name one (lightning_sql.run)"
            )
            continue
        else:
            outcome.reject(1, "unknown_target", f"Rollout {item.rollout_id} not found in any run")
            continue
        kept.append(item)
    return kept


async def store_spans(pending: list[Pending], pool: StorePool, outcome: Outcome) -> None:
    """Store the spans attempt by attempt; an unknown attempt rejects its group only."""
    from pydantic import ValidationError

    from lightning_sql.types import Span

    groups: dict[tuple[str, str, str], list[Pending]] = {}
    for item in pending:
        assert item.run is not None
        groups.setdefault((item.run, item.rollout_id, item.attempt_id), []).append(item)
    for (run, rollout_id, attempt_id), items in groups.items():
        spans = []
        for item in items:
            try:
                spans.append(
                    Span.model_validate(
                        {"rollout_id": rollout_id, "attempt_id": attempt_id, "sequence_id": item.sequence_id or 0, **item.fields}
                    )
                )
            except ValidationError as exc:
                outcome.reject(1, "invalid_span", f"not a valid span: {exc.errors()[0].get('msg', 'invalid')}")
                continue
        if not spans:
            continue
        try:
            store = pool.store(run)
            missing = [i for i, item in enumerate(items) if item.sequence_id is None]
            if missing:
                issued = await store.get_many_span_sequence_ids([(rollout_id, attempt_id)] * len(missing))
                numbered = dict(zip(missing, issued, strict=True))
                spans = [
                    span.model_copy(update={"sequence_id": numbered[i]}) if i in numbered else span
                    for i, span in enumerate(spans)
                ]
            stored = await store.add_many_spans(spans)
        except (ValueError, TypeError) as exc:
            outcome.reject(len(spans), "unknown_target", f"run {run!r}: {exc}")
            continue
        outcome.stored += len(stored)
        if len(stored) < len(spans):
            outcome.reject(len(spans) - len(stored), "duplicate", "already stored (same span id in the attempt)")


def _encode(message: Any, media_type: str) -> bytes:
    if media_type == PROTOBUF:
        return bytes(message.SerializeToString())
    from google.protobuf import json_format

    return json_format.MessageToJson(message, indent=None).encode()


def _status_response(status: int, text: str, media_type: str, headers: dict[str, str] | None = None) -> Response:
    from google.rpc.status_pb2 import Status

    answer_type = media_type if media_type in (PROTOBUF, JSON) else JSON
    return Response(
        _encode(Status(message=text), answer_type), status_code=status, media_type=answer_type, headers=headers
    )


class _Capacity:
    """Bytes of request bodies being stored now, across requests."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int) -> bool:
        if self.used and self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size


def traces_endpoint(
    pool: StorePool, metrics: ServerMetrics, catalog: Callable[[], Catalog | None], max_body_bytes: int
) -> Callable[[Request], Any]:
    capacity = _Capacity(MAX_INGEST_BYTES)

    async def traces(request: Request) -> Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        declared = int(request.headers.get("content-length") or 0)
        if not capacity.take(declared):
            busy = f"the server is storing {capacity.used} bytes of spans: retry in {RETRY_AFTER_S} s"
            return _status_response(429, busy, media_type, {"Retry-After": str(RETRY_AFTER_S)})
        try:
            return await _export(request, media_type, ExportTraceServiceResponse())
        finally:
            capacity.give(declared)

    async def _export(request: Request, media_type: str, answer: Any) -> Response:
        try:
            if media_type not in (PROTOBUF, JSON):
                raise OtlpError(415, f"unsupported Content-Type {media_type!r}: send {PROTOBUF} or {JSON}")
            encoding = request.headers.get("content-encoding", "").strip().lower()
            raw = b"".join([part async for part in request.stream()])  # not kept by the request
            body = decompress(raw, encoding, max_body_bytes)
            del raw
            message = parse_request(body, media_type)
            del body
            count = span_count(message)
            if count > MAX_SPANS_PER_REQUEST:
                raise OtlpError(413, f"{count} spans in one request: send at most {MAX_SPANS_PER_REQUEST} per request")
        except OtlpError as exc:
            return _status_response(exc.status, exc.message, media_type)
        target = catalog()
        if target is None:
            return _status_response(503, "the server is starting", media_type, {"Retry-After": str(RETRY_AFTER_S)})
        outcome = Outcome()
        for chunk in _chunks(collect(message, request.headers.get(RUN_HEADER), outcome), CHUNK_SPANS):
            await store_spans(await resolve_runs(chunk, target, pool.config.run, outcome), pool, outcome)
        metrics.spans_ingested.labels(source="otlp").inc(outcome.stored)
        for kind, n in outcome.kinds.items():
            metrics.spans_rejected.labels(reason=kind).inc(n)
        if outcome.rejected:
            logger.info("OTLP export: stored %d span(s), rejected %s", outcome.stored, outcome.message())
            answer.partial_success.rejected_spans = outcome.rejected
            answer.partial_success.error_message = outcome.message()
        return Response(_encode(answer, media_type), media_type=media_type)

    return traces
