"""OTLP/HTTP trace requests decoded: ``POST /v1/traces`` bodies (protobuf or JSON, gzip or not) into
the fields of store spans (``ingest.py`` stores them).

A span reaches its rollout and attempt through Agent-Lightning's ``agentlightning.rollout_id`` /
``agentlightning.attempt_id`` attributes (span-level wins over resource-level), and names its run
through ``lightning_sql.run`` (span, then resource) or the request's ``X-Lightning-SQL-Run`` header.
Spans that cannot be stored (no attribution, malformed ids, a sequence id past 64 bits) are counted
in the ``Outcome``; a malformed request is an ``OtlpError(400)``; an unsupported encoding a 415.
"""

from __future__ import annotations

import base64
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from lightning_sql.server.config import RUN_ATTRIBUTE
from lightning_sql.server.limits import too_large_message

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
ROLLOUT_ID = "agentlightning.rollout_id"
ATTEMPT_ID = "agentlightning.attempt_id"
SEQUENCE_ID = "agentlightning.span_sequence_id"
_STATUS_CODES = {0: "UNSET", 1: "OK", 2: "ERROR"}
# How many distinct reasons a partial_success message lists before summarising.
_MAX_REASONS = 5
_GZIP_MAGIC = b"\x1f\x8b"


class OtlpError(Exception):
    """A request answered with an OTLP Status body (400 malformed, 413 too large, 415 unsupported)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Outcome:
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


def decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The body, gunzipped when ``encoding`` says so: every gzip member of it (RFC 1952), up to
    ``limit`` bytes; anything after the last member is a 400."""
    if encoding in ("", "identity"):
        return body
    if encoding != "gzip":
        raise OtlpError(415, f"unsupported Content-Encoding {encoding!r}: send gzip or no encoding")
    parts: list[bytes] = []
    size = 0
    rest = body
    while True:
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            data = inflater.decompress(rest, limit + 1 - size)
        except zlib.error as exc:
            raise OtlpError(400, f"the gzip body cannot be decompressed: {exc}") from None
        size += len(data)
        if size > limit:
            raise OtlpError(413, too_large_message(limit) + " (after decompression)")
        parts.append(data)
        if not inflater.eof:
            raise OtlpError(400, "the gzip body is truncated")
        rest = inflater.unused_data
        if not rest:
            return b"".join(parts)
        if not rest.startswith(_GZIP_MAGIC):
            raise OtlpError(400, f"the gzip body has {len(rest)} byte(s) of trailing data after its end")


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


class _BadSequence(ValueError):
    """A span's sequence id that no column can hold."""


def _sequence(value: Any) -> int | None:
    """The span's own sequence id; None when it has none (the store issues one)."""
    from lightning_sql.types import MAX_INT64

    try:
        number = int(str(value))
    except (TypeError, ValueError):
        return None
    if number > MAX_INT64:
        raise _BadSequence(f"{SEQUENCE_ID} {str(value)[:40]} is outside the signed 64-bit range")
    return number if number >= 0 else None


def span_count(message: Any) -> int:
    return sum(len(scope_spans.spans) for rs in message.resource_spans for scope_spans in rs.scope_spans)


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
class Pending:
    """One span to store: its target (the run only when the span or request names one) and fields."""

    run: str | None
    rollout_id: str
    attempt_id: str
    sequence_id: int | None
    fields: dict[str, Any]


def collect(message: Any, header_run: str | None, outcome: Outcome) -> Iterator[Pending]:
    """Each attributed span of the request as the fields of a store ``Span``, one at a time (the
    caller stores them in chunks); the others rejected."""
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
                try:
                    sequence_id = _sequence(attrs.get(SEQUENCE_ID, resource_attrs.get(SEQUENCE_ID)))
                except _BadSequence as exc:
                    outcome.reject(1, "bad_sequence_id", str(exc))
                    continue
                run = _text(attrs.get(RUN_ATTRIBUTE, resource_attrs.get(RUN_ATTRIBUTE))) or header_run
                trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
                parent_id = span.parent_span_id.hex() if span.parent_span_id else None
                context = {"trace_id": trace_id, "span_id": span_id, "is_remote": False}
                yield Pending(
                    run=run,
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                    sequence_id=sequence_id,
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


