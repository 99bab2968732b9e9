"""OTLP/HTTP ingestion at ``POST /v1/traces``: the OpenTelemetry SDK's own exporter, hand-made
protobuf and JSON requests, partial success for spans without attribution, and malformed bodies
(a 400 and nothing stored), on SQLite files and PostgreSQL."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from lightning_sql import SqlLightningStore
from tests.required import SERVER, required_import
from tests.server.conftest import RunningServer

required_import("opentelemetry.exporter.otlp.proto.http", SERVER)

from google.rpc.status_pb2 import Status  # noqa: E402
from opentelemetry.exporter.otlp.proto.http import Compression  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _attempt(server: RunningServer, run: str | None = None) -> tuple[str, str]:
    headers = {"X-Lightning-SQL-Run": run} if run else {}
    started = httpx.post(server.url + "/v1/agl/rollouts", json={"input": {"task": 1}}, headers=headers, timeout=30)
    assert started.status_code == 201, started.text
    body = started.json()
    return body["rollout_id"], body["attempt"]["attempt_id"]


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _proto_span(index: int, **attributes: Any) -> ProtoSpan:
    return ProtoSpan(
        trace_id=bytes.fromhex("ab" * 16),
        span_id=(index + 1).to_bytes(8, "big"),
        name=f"span-{index}",
        start_time_unix_nano=1_700_000_000_000_000_000 + index,
        end_time_unix_nano=1_700_000_001_000_000_000 + index,
        attributes=[_kv(k.replace("__", "."), v) for k, v in attributes.items()],
    )


def _request(spans: list[ProtoSpan], **resource: Any) -> ExportTraceServiceRequest:
    message = ExportTraceServiceRequest()
    resource_spans = ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])
    resource_spans.resource.attributes.extend([_kv(k.replace("__", "."), v) for k, v in resource.items()])
    message.resource_spans.append(resource_spans)
    return message


def _post(server: RunningServer, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(server.url + "/v1/traces", content=body, headers=headers, timeout=30)


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
async def test_the_sdk_exporter_stores_spans_with_sequence_ids(
    server_factory: Callable[..., RunningServer],
    reader: Callable[..., SqlLightningStore],
    compression: Compression,
) -> None:
    server = server_factory(token="tok")
    rollout_id, attempt_id = _attempt_with_token(server, "tok")
    exporter = OTLPSpanExporter(
        endpoint=server.url + "/v1/traces", headers={"Authorization": "Bearer tok"}, compression=compression
    )
    resource = Resource.create(
        {"service.name": "agent", "agentlightning.rollout_id": rollout_id, "agentlightning.attempt_id": attempt_id}
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("agent-run") as root:
        root.set_attribute("task", "t1")
        with tracer.start_as_current_span("llm-call") as child:
            child.add_event("prompt", {"text": "hi <b>"})
            child.set_attribute("gen_ai.usage.prompt_tokens", 12)
            child.set_attribute("tokens", [1, 2, 3])
    provider.shutdown()

    spans = list(await reader().query_spans(rollout_id))
    assert [(s.name, s.sequence_id) for s in spans] == [("llm-call", 1), ("agent-run", 2)]
    llm, agent = spans
    assert llm.parent_id == agent.span_id and agent.parent_id is None
    assert llm.attempt_id == attempt_id and llm.trace_id == agent.trace_id and len(llm.trace_id) == 32
    assert llm.attributes["gen_ai.usage.prompt_tokens"] == 12 and llm.attributes["tokens"] == [1, 2, 3]
    assert llm.events[0].name == "prompt" and llm.events[0].attributes == {"text": "hi <b>"}
    assert llm.resource.attributes["service.name"] == "agent"
    assert llm.start_time is not None and llm.end_time is not None and llm.end_time >= llm.start_time

    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer tok"}, timeout=30).text
    assert server.metric(metrics, "lightning_sql_spans_ingested_total", source="otlp") == 2


def _attempt_with_token(server: RunningServer, token: str) -> tuple[str, str]:
    started = httpx.post(
        server.url + "/v1/agl/rollouts", json={"input": 1}, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    assert started.status_code == 201, started.text
    return started.json()["rollout_id"], started.json()["attempt"]["attempt_id"]


async def test_unattributed_and_unknown_spans_are_rejected_and_reported(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory()
    rollout_id, attempt_id = _attempt(server)
    message = _request(
        [
            _proto_span(0),
            _proto_span(1, agentlightning__rollout_id="ro-unknown", agentlightning__attempt_id="at-unknown"),
            _proto_span(2, agentlightning__span_sequence_id=40),
        ],
        agentlightning__rollout_id=rollout_id,
        agentlightning__attempt_id=attempt_id,
    )
    message.resource_spans.append(ResourceSpans(scope_spans=[ScopeSpans(spans=[_proto_span(3)])]))  # no attribution
    response = _post(server, message.SerializeToString(), PROTOBUF)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-protobuf"
    answer = ExportTraceServiceResponse.FromString(response.content)
    assert answer.partial_success.rejected_spans == 2
    assert "agentlightning.rollout_id" in answer.partial_success.error_message
    assert "ro-unknown" in answer.partial_success.error_message

    stored = list(await reader().query_spans(rollout_id))
    assert [(s.name, s.sequence_id) for s in stored] == [("span-0", 1), ("span-2", 40)]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert server.metric(metrics, "lightning_sql_spans_rejected_total", reason="unattributed") == 1
    assert server.metric(metrics, "lightning_sql_spans_rejected_total", reason="unknown_target") == 1
    assert server.metric(metrics, "lightning_sql_spans_ingested_total", source="otlp") == 2


async def test_json_encoding_with_hex_ids_and_span_level_run(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory()
    rollout_id, attempt_id = _attempt(server, run="other-run")
    body = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "js-agent"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "manual"},
                        "spans": [
                            {
                                "traceId": "5b8efff798038103d269b633813fc60c",
                                "spanId": "eee19b7ec3c1b174",
                                "parentSpanId": "eee19b7ec3c1b173",
                                "name": "tool <call> \u202e",
                                "kind": 2,
                                "startTimeUnixNano": "1544712660000000000",
                                "endTimeUnixNano": "1544712661000000000",
                                "attributes": [
                                    {"key": "agentlightning.rollout_id", "value": {"stringValue": rollout_id}},
                                    {"key": "agentlightning.attempt_id", "value": {"stringValue": attempt_id}},
                                    {"key": "lightning_sql.run", "value": {"stringValue": "other-run"}},
                                    {"key": "n", "value": {"intValue": "7"}},
                                ],
                                "status": {"code": 2, "message": "boom"},
                            }
                        ],
                    }
                ],
            }
        ]
    }
    response = _post(server, json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert "rejectedSpans" not in response.json().get("partialSuccess", {})
    (span,) = await reader("other-run").query_spans(rollout_id)
    assert span.trace_id == "5b8efff798038103d269b633813fc60c" and span.span_id == "eee19b7ec3c1b174"
    assert span.parent_id == "eee19b7ec3c1b173" and span.name == "tool <call> \u202e"
    assert span.attributes["n"] == 7 and span.status.status_code == "ERROR" and span.status.description == "boom"
    assert span.start_time == pytest.approx(1544712660.0) and span.sequence_id == 1
    assert [r.name for r in await reader("other-run").list_runs()] == ["other-run"]  # the server's run untouched


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"\xff\xff\xff\xff", PROTOBUF, 400),
        (b"{not json", {"Content-Type": "application/json"}, 400),
        (b"[1, 2]", {"Content-Type": "application/json"}, 400),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}', {"Content-Type": "application/json"}, 400),
        (b'{"resourceSpans": "many"}', {"Content-Type": "application/json"}, 400),
        (b"\x1f\x8b\x08 not really gzip", {**PROTOBUF, "Content-Encoding": "gzip"}, 400),
        (b"hello", {"Content-Type": "text/plain"}, 415),
        (b"hello", {**PROTOBUF, "Content-Encoding": "br"}, 415),
    ],
)
async def test_malformed_requests_store_nothing(
    server_factory: Callable[..., RunningServer],
    reader: Callable[..., SqlLightningStore],
    body: bytes,
    headers: dict[str, str],
    status: int,
) -> None:
    server = server_factory()
    rollout_id, attempt_id = _attempt(server)
    valid = _request([_proto_span(0)], agentlightning__rollout_id=rollout_id, agentlightning__attempt_id=attempt_id)
    # A good request with trailing garbage is malformed as a whole: its good span is not kept either.
    if body.startswith(b"\xff"):
        body = valid.SerializeToString() + body
    response = _post(server, body, headers)
    assert response.status_code == status, response.text
    error = Status()
    if response.headers["content-type"] == "application/x-protobuf":
        error.ParseFromString(response.content)
        message = error.message
    else:
        message = response.json()["message"]
    assert message and "Traceback" not in message
    assert list(await reader().query_spans(rollout_id)) == []


async def test_a_gzip_bomb_is_refused_after_decompression(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory(max_body_bytes=64 * 1024)
    rollout_id, attempt_id = _attempt(server)
    message = _request(
        [_proto_span(0, padding="x" * 200_000)], agentlightning__rollout_id=rollout_id, agentlightning__attempt_id=attempt_id
    )
    compressed = gzip.compress(message.SerializeToString())
    assert len(compressed) < 64 * 1024
    response = _post(server, compressed, {**PROTOBUF, "Content-Encoding": "gzip"})
    assert response.status_code == 413
    assert "limit" in Status.FromString(response.content).message
    assert list(await reader().query_spans(rollout_id)) == []


async def test_gzip_members_are_read_and_trailing_garbage_is_a_400(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory()
    rollout_id, attempt_id = _attempt(server)
    valid = _request([_proto_span(0)], agentlightning__rollout_id=rollout_id, agentlightning__attempt_id=attempt_id)
    packed = gzip.compress(valid.SerializeToString())
    garbage = _post(server, packed + b"trailing garbage", {**PROTOBUF, "Content-Encoding": "gzip"})
    assert garbage.status_code == 400 and "trailing" in Status.FromString(garbage.content).message
    assert list(await reader().query_spans(rollout_id)) == []
    data = valid.SerializeToString()
    members = gzip.compress(data[:10]) + gzip.compress(data[10:])  # RFC 1952: a gzip file may hold several
    assert _post(server, members, {**PROTOBUF, "Content-Encoding": "gzip"}).status_code == 200
    assert [s.name for s in await reader().query_spans(rollout_id)] == ["span-0"]


async def test_a_sequence_id_past_64_bits_rejects_its_span_only(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    server = server_factory()
    rollout_id, attempt_id = _attempt(server)
    message = _request(
        [
            _proto_span(0, agentlightning__span_sequence_id=str(2**64)),
            _proto_span(1, agentlightning__span_sequence_id=7),
            _proto_span(2),
        ],
        agentlightning__rollout_id=rollout_id,
        agentlightning__attempt_id=attempt_id,
    )
    response = _post(server, message.SerializeToString(), PROTOBUF)
    assert response.status_code == 200, response.text
    answer = ExportTraceServiceResponse.FromString(response.content)
    assert answer.partial_success.rejected_spans == 1 and str(2**64) in answer.partial_success.error_message
    assert sorted(s.name for s in await reader().query_spans(rollout_id)) == ["span-1", "span-2"]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert server.metric(metrics, "lightning_sql_spans_rejected_total", reason="bad_sequence_id") == 1
    assert "lightning_sql_database_errors_total{" not in metrics


async def test_spans_per_request_are_capped(
    server_factory: Callable[..., RunningServer], reader: Callable[..., SqlLightningStore]
) -> None:
    from lightning_sql.server.ingest import MAX_SPANS_PER_REQUEST

    server = server_factory()
    rollout_id, attempt_id = _attempt(server)
    ids = {"agentlightning__rollout_id": rollout_id, "agentlightning__attempt_id": attempt_id}
    over = _request([ProtoSpan(trace_id=b"\xab" * 16, span_id=(i + 1).to_bytes(8, "big"), name="s") for i in range(MAX_SPANS_PER_REQUEST + 1)], **ids)
    response = _post(server, over.SerializeToString(), PROTOBUF)
    assert response.status_code == 413 and str(MAX_SPANS_PER_REQUEST) in Status.FromString(response.content).message
    assert list(await reader().query_spans(rollout_id, limit=1)) == []
    # At the cap, stored in chunks: every span, sequence ids issued in order.
    full = _request([_proto_span(i) for i in range(1200)], **ids)
    assert _post(server, full.SerializeToString(), PROTOBUF).status_code == 200
    stored = list(await reader().query_spans(rollout_id))
    assert [s.sequence_id for s in stored] == list(range(1, 1201)) and stored[-1].name == "span-1199"
