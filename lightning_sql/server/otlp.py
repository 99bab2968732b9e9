"""OTLP/HTTP trace ingestion: ``POST /v1/traces`` (protobuf or JSON, gzip or not).

A span reaches its rollout and attempt through Agent-Lightning's ``agentlightning.rollout_id`` /
``agentlightning.attempt_id`` attributes (span-level wins over resource-level), and its run through
``lightning_sql.run`` (span, then resource), the ``X-Lightning-SQL-Run`` header, then the server's
run.  Spans without ``agentlightning.span_sequence_id`` get sequence ids from the store, as
``add_otel_span`` gives them.  Spans that cannot be stored (no attribution, unknown rollout or
attempt, malformed ids) are counted and reported in ``partial_success``; a malformed request is a
400 with nothing stored; an unsupported content type or encoding is a 415 (OTLP/HTTP spec).
"""

from __future__ import annotations

import base64
import logging
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from lightning_sql.server.config import RUN_ATTRIBUTE, RUN_HEADER
from lightning_sql.server.limits import too_large_message

if TYPE_CHECKING:
    from lightning_sql.server.metrics import ServerMetrics
    from lightning_sql.server.stores import StorePool

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
ROLLOUT_ID = "agentlightning.rollout_id"
ATTEMPT_ID = "agentlightning.attempt_id"
SEQUENCE_ID = "agentlightning.span_sequence_id"
_STATUS_CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}
# How many distinct reasons a partial_success message lists before summarising.
_MAX_REASONS = 5


class OtlpError(Exception):
    """A request answered with an OTLP Status body (400 malformed, 413 too large, 415 unsupported)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class _Outcome:
    stored: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)

    def reject(self, count: int, kind: str, reason: str) -> None:
        """``kind`` labels the metric (a few fixed values); ``reason`` is told to the client."""
        self.rejected += count
        self.reasons[reason] = self.reasons.get(reason, 0) + count
        self.kinds[kind] = self.kinds.get(kind, 0) + count

    def message(self) -> str:
        parts = [f"{count} span(s): {reason}" for reason, count in list(self.reasons.items())[:_MAX_REASONS]]
        if len(self.reasons) > _MAX_REASONS:
            parts.append(f"and {len(self.reasons) - _MAX_REASONS} other reason(s)")
        return "; ".join(parts)


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding != "gzip":
        raise OtlpError(415, f"unsupported Content-Encoding {encoding!r}: send gzip or no encoding")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise OtlpError(400, f"the gzip body cannot be decompressed: {exc}") from None
    if len(data) > limit:
        raise OtlpError(413, too_large_message(limit) + " (after decompression)")
    if not inflater.eof:
        raise OtlpError(400, "the gzip body is truncated")
    return data


def _hex_to_base64(holder: dict[str, Any], *names: str) -> None:
    """OTLP/JSON writes ids as hex; protobuf's JSON mapping reads bytes as base64."""
    for name in names:
        value = holder.get(name)
        if isinstance(value, str) and value:
            try:
                holder[name] = base64.b64encode(bytes.fromhex(value)).decode()
            except ValueError:
                raise OtlpError(400, f"{name} {value[:64]!r} is not a hex string") from None


def _listed(holder: Any, *names: str) -> list[Any]:
    if not isinstance(holder, dict):
        return []
    for name in names:
        value = holder.get(name)
        if isinstance(value, list):
            return value
    return []


def parse_request(body: bytes, media_type: str) -> Any:
    """The ``ExportTraceServiceRequest`` of a body, or ``OtlpError(400)`` saying what is wrong."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    message = ExportTraceServiceRequest()
    if not body:
        return message
    if media_type == PROTOBUF:
        try:
            message.ParseFromString(body)
        except (DecodeError, ValueError, RuntimeError) as exc:
            raise OtlpError(400, f"the body is not an OTLP ExportTraceServiceRequest (protobuf): {exc}") from None
        return message
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise OtlpError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OtlpError(400, "the body is not an OTLP ExportTraceServiceRequest (a JSON object)")
    for resource_spans in _listed(data, "resourceSpans", "resource_spans"):
        for scope_spans in _listed(resource_spans, "scopeSpans", "scope_spans"):
            for span in _listed(scope_spans, "spans"):
                if isinstance(span, dict):
                    _hex_to_base64(span, "traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id")
                    for link in _listed(span, "links"):
                        if isinstance(link, dict):
                            _hex_to_base64(link, "traceId", "trace_id", "spanId", "span_id")
    try:
        json_format.ParseDict(data, message, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError) as exc:
        raise OtlpError(400, f"the body is not an OTLP ExportTraceServiceRequest (JSON): {exc}") from None
    return message


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    if kind == "bytes_value":
        return any_value.bytes_value.hex()
    return getattr(any_value, kind)


def _attribute(value: Any) -> Any:
    """An OTel attribute value: scalars and homogeneous scalar lists as they are, the rest as JSON text."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str | bool | int | float) for v in value):
        if len({type(v) for v in value}) == 1:
            return value
    return orjson.dumps(value).decode()


def attributes(kvs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in kvs:
        converted = _attribute(_value(kv.value))
        if converted is not None:
            out[kv.key] = converted
    return out


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, list):
        return None
    text = str(value)
    return text or None


def _sequence(value: Any) -> int | None:
    try:
        number = int(str(value))
    except (TypeError, ValueError):
        return None
    return number if number >= 0 else None


def _trace_state(text: str) -> dict[str, str]:
    state: dict[str, str] = {}
    for member in text.split(","):
        key, sep, value = member.strip().partition("=")
        if sep and key:
            state[key] = value
    return state


def _seconds(nanos: int) -> float | None:
    return nanos / 1e9 if nanos else None


@dataclass
class _Pending:
    run: str
    rollout_id: str
    attempt_id: str
    sequence_id: int | None
    fields: dict[str, Any]


def collect(message: Any, header_run: str | None, default_run: str, outcome: _Outcome) -> Iterator[_Pending]:
    """Each attributed span of the request as the fields of a store ``Span``; the others rejected."""
    for resource_spans in message.resource_spans:
        resource_attrs = attributes(resource_spans.resource.attributes)
        resource = {"attributes": resource_attrs, "schema_url": resource_spans.schema_url or ""}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attrs = attributes(span.attributes)
                rollout_id = _text(attrs.get(ROLLOUT_ID, resource_attrs.get(ROLLOUT_ID)))
                attempt_id = _text(attrs.get(ATTEMPT_ID, resource_attrs.get(ATTEMPT_ID)))
                if rollout_id is None or attempt_id is None:
                    outcome.reject(1, "unattributed", f"no {ROLLOUT_ID} / {ATTEMPT_ID} attribute (span or resource)")
                    continue
                if len(span.trace_id) != 16 or len(span.span_id) != 8 or len(span.parent_span_id) not in (0, 8):
                    outcome.reject(1, "bad_ids", "trace_id must be 16 bytes, span_id and parent_span_id 8 bytes")
                    continue
                run = _text(attrs.get(RUN_ATTRIBUTE, resource_attrs.get(RUN_ATTRIBUTE))) or header_run or default_run
                trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
                parent_id = span.parent_span_id.hex() if span.parent_span_id else None
                context = {"trace_id": trace_id, "span_id": span_id, "is_remote": False}
                yield _Pending(
                    run=run,
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                    sequence_id=_sequence(attrs.get(SEQUENCE_ID, resource_attrs.get(SEQUENCE_ID))),
                    fields={
                        "trace_id": trace_id,
                        "span_id": span_id,
                        "parent_id": parent_id,
                        "name": span.name,
                        "status": {
                            "status_code": _STATUS_CODES.get(span.status.code, "UNSET"),
                            "description": span.status.message or None,
                        },
                        "attributes": attrs,
                        "events": [
                            {"name": e.name, "attributes": attributes(e.attributes), "timestamp": _seconds(e.time_unix_nano)}
                            for e in span.events
                        ],
                        "links": [
                            {
                                "context": {
                                    "trace_id": link.trace_id.hex(),
                                    "span_id": link.span_id.hex(),
                                    "is_remote": False,
                                    "trace_state": _trace_state(link.trace_state),
                                },
                                "attributes": attributes(link.attributes) or None,
                            }
                            for link in span.links
                        ],
                        "start_time": _seconds(span.start_time_unix_nano),
                        "end_time": _seconds(span.end_time_unix_nano),
                        "context": {**context, "trace_state": _trace_state(span.trace_state)},
                        "parent": (
                            {"trace_id": trace_id, "span_id": parent_id, "is_remote": False, "trace_state": {}}
                            if parent_id
                            else None
                        ),
                        "resource": resource,
                    },
                )


async def store_spans(pending: list[_Pending], pool: StorePool, outcome: _Outcome) -> None:
    """Store the spans attempt by attempt; an unknown run, rollout or attempt rejects its group only."""
    from pydantic import ValidationError

    from lightning_sql.types import Span

    groups: dict[tuple[str, str, str], list[_Pending]] = {}
    for item in pending:
        groups.setdefault((item.run, item.rollout_id, item.attempt_id), []).append(item)
    for (run, rollout_id, attempt_id), items in groups.items():
        try:
            store = pool.store(run)
            missing = [item for item in items if item.sequence_id is None]
            if missing:
                issued = await store.get_many_span_sequence_ids([(rollout_id, attempt_id)] * len(missing))
                for item, sequence_id in zip(missing, issued, strict=True):
                    item.sequence_id = sequence_id
            spans = []
            for item in items:
                try:
                    spans.append(
                        Span.model_validate(
                            {"rollout_id": rollout_id, "attempt_id": attempt_id, "sequence_id": item.sequence_id, **item.fields}
                        )
                    )
                except ValidationError as exc:
                    outcome.reject(1, "invalid_span", f"not a valid span: {exc.errors()[0].get('msg', 'invalid')}")
            if spans:
                stored = await store.add_many_spans(spans)
                outcome.stored += len(stored)
                if len(stored) < len(spans):
                    outcome.reject(len(spans) - len(stored), "duplicate", "already stored (same span id in the attempt)")
        except (ValueError, TypeError) as exc:
            outcome.reject(len(items), "unknown_target", f"run {run!r}: {exc}")


def _encode(message: Any, media_type: str) -> bytes:
    if media_type == PROTOBUF:
        return bytes(message.SerializeToString())
    from google.protobuf import json_format

    return json_format.MessageToJson(message, indent=None).encode()


def _status_response(status: int, text: str, media_type: str) -> Response:
    from google.rpc.status_pb2 import Status

    answer_type = media_type if media_type in (PROTOBUF, JSON) else JSON
    return Response(_encode(Status(message=text), answer_type), status_code=status, media_type=answer_type)


def traces_endpoint(pool: StorePool, metrics: ServerMetrics, max_body_bytes: int) -> Callable[[Request], Any]:
    async def traces(request: Request) -> Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        media_type = _media_type(request)
        try:
            if media_type not in (PROTOBUF, JSON):
                raise OtlpError(415, f"unsupported Content-Type {media_type!r}: send {PROTOBUF} or {JSON}")
            encoding = request.headers.get("content-encoding", "").strip().lower()
            body = _decompress(await request.body(), encoding, max_body_bytes)
            message = parse_request(body, media_type)
        except OtlpError as exc:
            return _status_response(exc.status, exc.message, media_type)
        outcome = _Outcome()
        pending = list(collect(message, request.headers.get(RUN_HEADER), pool.config.run, outcome))
        await store_spans(pending, pool, outcome)
        metrics.spans_ingested.labels(source="otlp").inc(outcome.stored)
        for kind, count in outcome.kinds.items():
            metrics.spans_rejected.labels(reason=kind).inc(count)
        answer = ExportTraceServiceResponse()
        if outcome.rejected:
            logger.info("OTLP export: stored %d span(s), rejected %s", outcome.stored, outcome.message())
            answer.partial_success.rejected_spans = outcome.rejected
            answer.partial_success.error_message = outcome.message()
        return Response(_encode(answer, media_type), media_type=media_type)

    return traces
