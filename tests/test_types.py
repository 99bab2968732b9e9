"""Unit tests of the pydantic models and helpers in `lightning_sql.types` (no database)."""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime
from enum import Enum, IntEnum
from typing import Any

import pytest
from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from pydantic import BaseModel, ValidationError

from lightning_sql.types import (
    AGL_ANNOTATION,
    AGL_VIRTUAL,
    FINISHED_STATUSES,
    IN_FLIGHT_STATUSES,
    LLM,
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    QUEUED_STATUSES,
    RESOURCE_ATTEMPT_ID,
    RESOURCE_ROLLOUT_ID,
    RESOURCE_SPAN_SEQUENCE_ID,
    UNSET,
    Attempt,
    AttemptedRollout,
    EnqueueRolloutRequest,
    Event,
    LightningStoreCapabilities,
    LightningStoreStatistics,
    Link,
    OtelResource,
    PaginatedResult,
    PromptTemplate,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Run,
    Span,
    SpanContext,
    SpanCoreFields,
    TraceStatus,
    Triplet,
    Unset,
    Worker,
    check_text,
    convert_timestamp,
    encode_json,
    generate_id,
    new_attempt_id,
    new_resources_id,
    new_rollout_id,
    reward_name_key,
    reward_value_key,
    rollout_status_from_attempt,
)
from lightning_sql.types.core import _UnsetType

# ----------------------------------------------------------------------------------------------- models


def test_rollout_config_defaults() -> None:
    config = RolloutConfig()
    assert config.timeout_seconds is None
    assert config.unresponsive_seconds is None
    assert config.max_attempts == 1
    assert config.retry_condition == []
    assert RolloutConfig().retry_condition is not config.retry_condition


@pytest.mark.parametrize("max_attempts", [0, -1])
def test_rollout_config_max_attempts_at_least_one(max_attempts: int) -> None:
    with pytest.raises(ValidationError):
        RolloutConfig(max_attempts=max_attempts)


def test_rollout_config_retry_condition_is_attempt_statuses() -> None:
    assert RolloutConfig(retry_condition=["failed", "timeout", "unresponsive"]).retry_condition == [
        "failed",
        "timeout",
        "unresponsive",
    ]
    with pytest.raises(ValidationError):
        RolloutConfig(retry_condition=["cancelled"])  # type: ignore[list-item]


def test_rollout_defaults() -> None:
    rollout = Rollout(rollout_id="ro-1", input=None, start_time=1.0)
    assert rollout.input is None
    assert rollout.end_time is None
    assert rollout.mode is None
    assert rollout.resources_id is None
    assert rollout.status == "queuing"
    assert rollout.config == RolloutConfig()
    assert rollout.metadata is None
    assert rollout.resources_version is None
    assert rollout.idempotency_key is None
    assert Rollout(rollout_id="ro-2", input=1, start_time=1.0).config is not rollout.config


def test_rollout_input_is_required() -> None:
    with pytest.raises(ValidationError):
        Rollout(rollout_id="ro-1", start_time=1.0)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "field, value",
    [("status", "bogus"), ("status", None), ("mode", "training"), ("config", None)],
)
def test_rollout_rejects_invalid_literals(field: str, value: Any) -> None:
    with pytest.raises(ValidationError):
        Rollout(rollout_id="ro-1", input=None, start_time=1.0, **{field: value})


def test_rollout_accepts_every_status_and_mode() -> None:
    for status in ("queuing", "preparing", "running", "failed", "succeeded", "cancelled", "requeuing"):
        assert Rollout(rollout_id="r", input=None, start_time=0, status=status).status == status
    for mode in ("train", "val", "test"):
        assert Rollout(rollout_id="r", input=None, start_time=0, mode=mode).mode == mode


def test_attempt_defaults_and_literals() -> None:
    attempt = Attempt(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, start_time=2.0)
    assert attempt.end_time is None
    assert attempt.status == "preparing"
    assert attempt.worker_id is None
    assert attempt.last_heartbeat_time is None
    assert attempt.metadata is None
    assert Attempt(rollout_id="r", attempt_id="a", sequence_id=1, start_time=0, worker_id="").worker_id == ""
    for status in ("preparing", "running", "failed", "succeeded", "unresponsive", "timeout"):
        assert (
            Attempt(rollout_id="r", attempt_id="a", sequence_id=1, start_time=0, status=status).status
            == status
        )
    for bad in ("cancelled", "queuing", "requeuing", "bogus"):
        with pytest.raises(ValidationError):
            Attempt(rollout_id="r", attempt_id="a", sequence_id=1, start_time=0, status=bad)


def test_attempted_rollout_requires_matching_rollout_id() -> None:
    attempt = Attempt(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, start_time=0)
    attempted = AttemptedRollout(rollout_id="ro-1", input={"q": 1}, start_time=0, attempt=attempt)
    assert isinstance(attempted, Rollout)
    assert attempted.attempt == attempt
    with pytest.raises(ValidationError, match="Inconsistent rollout_id between Rollout and Attempt"):
        AttemptedRollout(rollout_id="ro-2", input=None, start_time=0, attempt=attempt)
    assert not hasattr(Rollout(rollout_id="ro-1", input=None, start_time=0), "attempt")


def test_enqueue_rollout_request_defaults() -> None:
    request = EnqueueRolloutRequest(input={"x": 1})
    assert request.mode is None
    assert request.resources_id is None
    assert request.config is None
    assert request.metadata is None
    assert request.idempotency_key is None
    assert EnqueueRolloutRequest(input=None, idempotency_key="k").idempotency_key == "k"
    with pytest.raises(ValidationError):
        EnqueueRolloutRequest()  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        EnqueueRolloutRequest(input=None, mode="bogus")  # type: ignore[arg-type]


def test_worker_defaults() -> None:
    worker = Worker(worker_id="Worker-0")
    assert worker.status == "unknown"
    for name in (
        "heartbeat_stats",
        "last_heartbeat_time",
        "last_dequeue_time",
        "last_busy_time",
        "last_idle_time",
        "current_rollout_id",
        "current_attempt_id",
    ):
        assert getattr(worker, name) is None
    with pytest.raises(ValidationError):
        Worker(worker_id="w", status="running")  # type: ignore[arg-type]


def test_run_model() -> None:
    run = Run(name="run-1", created_at=5.0)
    assert run.status == "active"
    assert run.finished_at is None
    assert run.metadata is None
    assert Run(name="r", status="finished", created_at=1, finished_at=2).status == "finished"
    with pytest.raises(ValidationError):
        Run(name="r", status="paused", created_at=1)  # type: ignore[arg-type]


def test_triplet_defaults() -> None:
    triplet = Triplet(prompt="p", response="r")
    assert triplet.reward is None
    assert triplet.metadata == {}


def test_status_groups() -> None:
    assert QUEUED_STATUSES == ("queuing", "requeuing")
    assert IN_FLIGHT_STATUSES == ("preparing", "running")
    assert FINISHED_STATUSES == ("failed", "succeeded", "cancelled")


def test_typed_dicts_are_total_false() -> None:
    capabilities: LightningStoreCapabilities = {"async_safe": True}
    statistics: LightningStoreStatistics = {"name": "SqlLightningStore", "queue_depth": 3}
    assert capabilities.get("thread_safe", False) is False
    assert LightningStoreCapabilities.__total__ is False
    assert LightningStoreStatistics.__total__ is False
    assert "queue_depth" in LightningStoreStatistics.__annotations__
    assert statistics["queue_depth"] == 3


# ----------------------------------------------------------------------------------------- ids, UNSET

HEX = "[0-9a-f]"


def test_generate_id_length_and_alphabet() -> None:
    for n in (1, 8, 12, 40):
        assert re.fullmatch(f"{HEX}{{{n}}}", generate_id(n))
    assert len({generate_id(12) for _ in range(1000)}) == 1000


def test_generate_id_hashes_the_bytes_of_a_uuid4(monkeypatch: pytest.MonkeyPatch) -> None:
    """Contract §0.5: SHA-1 over the 16 bytes of a random UUID4 (version and variant bits set as
    ``uuid.UUID(bytes=..., version=4)`` sets them), whatever the random bytes are."""
    import hashlib
    import uuid

    from lightning_sql.types import core

    for random_bytes in (bytes(16), b"\xff" * 16, bytes(range(16)), bytes(range(200, 216))):
        monkeypatch.setattr(core, "_urandom", lambda n, b=random_bytes: b[:n])
        expected = hashlib.sha1(uuid.UUID(bytes=random_bytes, version=4).bytes).hexdigest()
        assert generate_id(40) == expected
        assert generate_id(12) == expected[:12]


def test_id_formats() -> None:
    assert re.fullmatch(f"ro-{HEX}{{12}}", new_rollout_id())
    assert re.fullmatch(f"at-{HEX}{{8}}", new_attempt_id())
    assert re.fullmatch(f"rs-{HEX}{{12}}", new_resources_id())
    assert len(new_rollout_id()) == 15
    assert len(new_attempt_id()) == 11
    assert len(new_resources_id()) == 15


def test_unset_singleton() -> None:
    assert repr(UNSET) == "UNSET"
    assert isinstance(UNSET, Unset)
    assert Unset is _UnsetType
    assert not isinstance(None, Unset)
    assert pickle.loads(pickle.dumps(UNSET)) is UNSET
    assert pickle.loads(pickle.dumps({"value": UNSET}))["value"] is UNSET


# -------------------------------------------------------------------------- rollout_status_from_attempt


@pytest.mark.parametrize("status", ["preparing", "running", "succeeded"])
def test_rollout_status_from_attempt_direct(status: str) -> None:
    config = RolloutConfig(max_attempts=3, retry_condition=["failed", "timeout", "unresponsive"])
    assert rollout_status_from_attempt(status, 1, config) == status
    assert rollout_status_from_attempt(status, 5, RolloutConfig()) == status


@pytest.mark.parametrize("status", ["failed", "timeout", "unresponsive"])
def test_rollout_status_from_attempt_retry_table(status: str) -> None:
    retry_all = RolloutConfig(max_attempts=3, retry_condition=["failed", "timeout", "unresponsive"])
    assert rollout_status_from_attempt(status, 1, retry_all) == "requeuing"
    assert rollout_status_from_attempt(status, 2, retry_all) == "requeuing"
    assert rollout_status_from_attempt(status, 3, retry_all) == "failed"  # attempts exhausted
    assert rollout_status_from_attempt(status, 4, retry_all) == "failed"
    others = [s for s in ("failed", "timeout", "unresponsive") if s != status]
    not_retried = RolloutConfig(max_attempts=3, retry_condition=others)
    assert rollout_status_from_attempt(status, 1, not_retried) == "failed"
    assert rollout_status_from_attempt(status, 1, RolloutConfig()) == "failed"
    single = RolloutConfig(max_attempts=1, retry_condition=[status])
    assert rollout_status_from_attempt(status, 1, single) == "failed"


@pytest.mark.parametrize("status", ["queuing", "requeuing", "cancelled", "bogus", ""])
def test_rollout_status_from_attempt_rejects_other_values(status: str) -> None:
    with pytest.raises(ValueError, match="Invalid attempt status"):
        rollout_status_from_attempt(status, 1, RolloutConfig())


# ----------------------------------------------------------------------------------- PaginatedResult


def test_paginated_result_is_a_sequence() -> None:
    result = PaginatedResult[int](items=[10, 20, 30], limit=3, offset=0, total=7)
    assert isinstance(result, Sequence)
    assert len(result) == 3  # items, not total
    assert result.total == 7
    assert result[0] == 10
    assert result[-1] == 30
    assert result[1:] == [20, 30]
    assert isinstance(result[0:2], list)
    assert list(result) == [10, 20, 30]
    assert [x for x in result] == [10, 20, 30]
    assert 20 in result
    assert result.index(30) == 2
    with pytest.raises(IndexError):
        result[3]


def test_paginated_result_slice_of_tuple_items_is_list() -> None:
    result = PaginatedResult[int](items=(1, 2, 3), limit=-1, offset=0, total=3)
    assert result[:2] == [1, 2]


def test_paginated_result_validates_items() -> None:
    attempt = {"rollout_id": "r", "attempt_id": "a", "sequence_id": 1, "start_time": 0}
    result = PaginatedResult[Attempt](items=[attempt], limit=-1, offset=0, total=1)
    assert type(result[0]) is Attempt
    with pytest.raises(ValidationError):
        PaginatedResult[int](items=["x"], limit=-1, offset=0, total=1)


@pytest.mark.parametrize(
    "items, limit, offset, total, expected",
    [
        ([], 10, 0, 0, "<PaginatedResult (0:10 of 0) empty>"),
        ([], -1, 5, 3, "<PaginatedResult (5: of 3) empty>"),
        (["a"], 10, 20, 21, "<PaginatedResult (20:30 of 21) 'a'>"),
        (["a"], -1, 0, 1, "<PaginatedResult (0: of 1) 'a'>"),
        (["a", "b"], 2, 4, 9, "<PaginatedResult (4:6 of 9) ['a', ...]>"),
        (["a", "b", "c"], -1, 1, 4, "<PaginatedResult (1: of 4) ['a', ...]>"),
    ],
)
def test_paginated_result_repr(items: list[str], limit: int, offset: int, total: int, expected: str) -> None:
    result = PaginatedResult[str](items=items, limit=limit, offset=offset, total=total)
    assert repr(result) == expected


def test_paginated_result_repr_uses_item_repr() -> None:
    worker = Worker(worker_id="w")
    result = PaginatedResult[Worker](items=[worker, worker], limit=-1, offset=0, total=2)
    assert repr(result) == f"<PaginatedResult (0: of 2) [{worker!r}, ...]>"


# ---------------------------------------------------------------------------------------- resources


@pytest.mark.parametrize(
    "endpoint, expected",
    [
        ("http://localhost:8000", "http://localhost:8000/rollout/ro-1/attempt/at-1"),
        ("http://localhost:8000/", "http://localhost:8000/rollout/ro-1/attempt/at-1"),
        ("http://localhost:8000/v1", "http://localhost:8000/rollout/ro-1/attempt/at-1/v1"),
        ("http://localhost:8000/v1/", "http://localhost:8000/rollout/ro-1/attempt/at-1/v1"),
        ("http://host/api/v1", "http://host/api/rollout/ro-1/attempt/at-1/v1"),
        ("http://host/v2", "http://host/v2/rollout/ro-1/attempt/at-1"),
    ],
)
def test_proxy_llm_get_base_url(endpoint: str, expected: str) -> None:
    llm = ProxyLLM(endpoint=endpoint, model="m")
    assert llm.get_base_url("ro-1", "at-1") == expected


def test_proxy_llm_get_base_url_without_ids() -> None:
    llm = ProxyLLM(endpoint="http://localhost:8000/v1/", model="m")
    assert llm.get_base_url(None, None) == "http://localhost:8000/v1/"
    with pytest.raises(ValueError):
        llm.get_base_url("ro-1", None)
    with pytest.raises(ValueError):
        llm.get_base_url(None, "at-1")


def test_llm_get_base_url_returns_endpoint() -> None:
    llm = LLM(endpoint="http://x/v1", model="m")
    assert llm.resource_type == "llm"
    assert llm.api_key is None
    assert llm.sampling_parameters == {}
    assert llm.get_base_url() == "http://x/v1"
    assert llm.get_base_url("ro-1", "at-1") == "http://x/v1"


def test_proxy_llm_with_attempted_rollout() -> None:
    proxy = ProxyLLM(endpoint="http://h/v1", model="m", api_key="k", sampling_parameters={"temperature": 0.5})
    attempt = Attempt(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, start_time=0)
    llm = proxy.with_attempted_rollout(
        AttemptedRollout(rollout_id="ro-1", input=None, start_time=0, attempt=attempt)
    )
    assert type(llm) is LLM
    assert llm.endpoint == "http://h/rollout/ro-1/attempt/at-1/v1"
    assert llm.model == "m"
    assert llm.api_key == "k"
    assert llm.sampling_parameters == {"temperature": 0.5}


def test_proxy_llm_warns_only_on_direct_endpoint_read(caplog: pytest.LogCaptureFixture) -> None:
    proxy = ProxyLLM(endpoint="http://h/v1", model="m")
    attempt = Attempt(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, start_time=0)
    with caplog.at_level(logging.WARNING, logger="lightning_sql.types.resources"):
        dumped = proxy.model_dump()
        proxy.model_dump_json()
        repr(proxy)
        copied = pickle.loads(pickle.dumps(proxy))
        proxy.model_copy()
        proxy.get_base_url("ro-1", "at-1")
        proxy.with_attempted_rollout(
            AttemptedRollout(rollout_id="ro-1", input=None, start_time=0, attempt=attempt)
        )
        assert copied == proxy
        assert type(copied) is ProxyLLM
        assert caplog.records == []
        assert proxy.endpoint == "http://h/v1"
    assert dumped["endpoint"] == "http://h/v1"
    assert dumped["resource_type"] == "proxy_llm"
    assert any("get_base_url" in record.getMessage() for record in caplog.records)


def test_prompt_template_format() -> None:
    template = PromptTemplate(template="Hello {name}!", engine="f-string")
    assert template.resource_type == "prompt_template"
    assert template.format(name="world") == "Hello world!"
    for engine in ("jinja", "poml"):
        with pytest.raises(NotImplementedError):
            PromptTemplate(template="Hello {{ name }}", engine=engine).format(name="x")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        PromptTemplate(template="x", engine="mustache")  # type: ignore[arg-type]


def test_resources_update_rematerialises_concrete_classes() -> None:
    update = ResourcesUpdate(
        resources_id="rs-1",
        create_time=1.0,
        update_time=2.0,
        version=3,
        resources={
            "llm": LLM(endpoint="http://a", model="m"),
            "proxy": ProxyLLM(endpoint="http://b/v1", model="n"),
            "prompt": PromptTemplate(template="{x}", engine="f-string"),
        },
    )
    stored = json.loads(update.model_dump_json())
    restored = ResourcesUpdate.model_validate(stored)
    assert type(restored.resources["llm"]) is LLM
    assert type(restored.resources["proxy"]) is ProxyLLM
    assert type(restored.resources["prompt"]) is PromptTemplate
    assert restored == update
    from_dicts = ResourcesUpdate.model_validate(
        {
            "resources_id": "v1",
            "create_time": 0,
            "update_time": 0,
            "version": 1,
            "resources": {"p": {"resource_type": "proxy_llm", "endpoint": "http://c", "model": "z"}},
        }
    )
    assert type(from_dicts.resources["p"]) is ProxyLLM
    with pytest.raises(ValidationError):
        ResourcesUpdate.model_validate(
            {
                "resources_id": "v1",
                "create_time": 0,
                "update_time": 0,
                "version": 1,
                "resources": {"p": {"resource_type": "unknown", "endpoint": "http://c", "model": "z"}},
            }
        )


# --------------------------------------------------------------------------------------------- spans


def _finished_sdk_spans() -> tuple[ReadableSpan, ReadableSpan]:
    provider = TracerProvider()
    tracer = provider.get_tracer("tests.types")
    with tracer.start_as_current_span("parent") as parent:
        link = trace_api.Link(parent.get_span_context(), {"link.attr": "l"})
        with tracer.start_as_current_span("child", links=[link], attributes={"answer": 42}) as child:
            child.set_attribute("tags", ["a", "b"])
            child.add_event("thinking", {"step": 1})
            child.set_status(trace_api.Status(trace_api.StatusCode.ERROR, "boom"))
    assert isinstance(parent, ReadableSpan) and isinstance(child, ReadableSpan)
    return parent, child


def test_convert_timestamp() -> None:
    assert convert_timestamp(None) is None
    assert convert_timestamp(0) is None
    assert convert_timestamp(1_700_000_000_123_456_789) == pytest.approx(1_700_000_000.123456789)
    assert convert_timestamp(1_700_000_000) == 1_700_000_000


def test_span_from_opentelemetry() -> None:
    parent, child = _finished_sdk_spans()
    span = Span.from_opentelemetry(child, "ro-1", "at-1", 7)
    context = child.get_span_context()
    assert context is not None
    assert span.rollout_id == "ro-1"
    assert span.attempt_id == "at-1"
    assert span.sequence_id == 7
    assert re.fullmatch(f"{HEX}{{32}}", span.trace_id)
    assert re.fullmatch(f"{HEX}{{16}}", span.span_id)
    assert span.trace_id == trace_api.format_trace_id(context.trace_id)
    assert span.span_id == trace_api.format_span_id(context.span_id)
    parent_context = parent.get_span_context()
    assert parent_context is not None
    assert span.parent_id == trace_api.format_span_id(parent_context.span_id)
    assert span.parent is not None and span.parent.span_id == span.parent_id
    assert span.context == SpanContext(
        trace_id=span.trace_id, span_id=span.span_id, is_remote=False, trace_state={}
    )
    assert span.name == "child"
    assert span.status == TraceStatus(status_code="ERROR", description="boom")
    assert span.model_dump(mode="json")["attributes"] == {"answer": 42, "tags": ["a", "b"]}
    assert span.start_time is not None and span.end_time is not None
    assert child.start_time is not None and child.end_time is not None
    assert span.start_time == pytest.approx(child.start_time / 1e9)
    assert span.end_time == pytest.approx(child.end_time / 1e9)
    assert 1e9 < span.start_time <= span.end_time < 1e11  # seconds, not nanoseconds
    assert len(span.events) == 1
    assert span.events[0].name == "thinking"
    assert span.events[0].attributes == {"step": 1}
    assert span.events[0].timestamp is not None and span.events[0].timestamp < 1e11
    assert len(span.links) == 1
    assert span.links[0].context.span_id == span.parent_id
    assert span.links[0].attributes == {"link.attr": "l"}
    assert span.resource.attributes["telemetry.sdk.name"] == "opentelemetry"
    assert isinstance(span.resource.schema_url, str)

    extras = span.model_extra
    assert extras is not None
    assert extras["kind"] == "SpanKind.INTERNAL"
    for key in ("instrumentation_scope", "limits", "lock"):
        assert isinstance(extras[key], str)
    # Mapped fields and private/class attributes never leak into the extras.
    for key in ("name", "context", "parent", "resource", "attributes", "events", "links", "status"):
        assert key not in extras
    assert "span_processor" not in extras
    assert not any(key.startswith("_") for key in extras)

    root = Span.from_opentelemetry(parent, "ro-1", "at-1", 6)
    assert root.parent_id is None
    assert root.parent is None
    assert root.status.status_code == "UNSET"

    # The whole span survives a JSON round trip, extras included.
    encoded = encode_json(span.model_dump(mode="json"), "span")
    assert encoded is not None
    assert Span.model_validate(json.loads(encoded)) == Span.model_validate(span.model_dump(mode="json"))


def test_span_from_opentelemetry_extras_are_json_round_tripped() -> None:
    class Custom:
        def __repr__(self) -> str:
            return "<custom>"

    _, child = _finished_sdk_spans()
    child.__dict__["_my_field"] = Custom()
    child.__dict__["plain"] = {"nested": (1, 2)}
    span = Span.from_opentelemetry(child, "ro", "at", 1)
    assert span.model_extra is not None
    assert span.model_extra["my_field"] == "<custom>"
    assert span.model_extra["plain"] == {"nested": [1, 2]}


def test_span_fields_are_required() -> None:
    with pytest.raises(ValidationError):
        Span(rollout_id="r", attempt_id="a", sequence_id=1)  # type: ignore[call-arg]


def test_span_from_attributes_defaults() -> None:
    span = Span.from_attributes(attributes={"k": "v"})
    assert span.rollout_id == ""
    assert span.attempt_id == ""
    assert span.sequence_id == 0
    assert span.name == AGL_VIRTUAL == "agentlightning.virtual"
    assert re.fullmatch(f"{HEX}{{32}}", span.trace_id)
    assert re.fullmatch(f"{HEX}{{16}}", span.span_id)
    assert span.parent_id is None
    assert span.parent is None
    assert span.status == TraceStatus(status_code="OK")
    assert span.resource == OtelResource(attributes={}, schema_url="")
    assert span.context == SpanContext(
        trace_id=span.trace_id, span_id=span.span_id, is_remote=False, trace_state={}
    )
    assert span.events == [] and span.links == []
    assert span.start_time is None and span.end_time is None
    assert span.attributes == {"k": "v"}


def test_span_from_attributes_explicit_values() -> None:
    span = Span.from_attributes(
        attributes={reward_name_key(0): "primary", reward_value_key(0): 1.5},
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=4,
        name=AGL_ANNOTATION,
        trace_id="a" * 32,
        span_id="b" * 16,
        parent_id="c" * 16,
        start_time=1.0,
        end_time=2.0,
        status=TraceStatus(status_code="ERROR", description="x"),
    )
    assert span.name == "agentlightning.annotation"
    assert span.attributes == {
        "agentlightning.reward.0.name": "primary",
        "agentlightning.reward.0.value": 1.5,
    }
    assert (span.trace_id, span.span_id, span.parent_id) == ("a" * 32, "b" * 16, "c" * 16)
    assert span.parent == SpanContext(trace_id="a" * 32, span_id="c" * 16, is_remote=False, trace_state={})
    assert (span.start_time, span.end_time, span.sequence_id) == (1.0, 2.0, 4)
    assert span.status.status_code == "ERROR"


def test_span_from_core_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    core = SpanCoreFields(
        name="op", status=TraceStatus(status_code="OK"), attributes={"a": 1}, start_time=None, end_time=9.0
    )
    monkeypatch.setattr("time.time", lambda: 123.0)
    span = Span.from_core_fields(core, rollout_id="ro-1", attempt_id="at-1", sequence_id=2)
    assert span.start_time == 123.0
    assert span.end_time == 9.0
    assert span.name == "op"
    assert span.attributes == {"a": 1}
    assert (span.rollout_id, span.attempt_id, span.sequence_id) == ("ro-1", "at-1", 2)
    timed = SpanCoreFields(
        name="op", status=TraceStatus(status_code="OK"), attributes={}, start_time=5.0, end_time=6.0
    )
    assert Span.from_core_fields(timed).start_time == 5.0
    with pytest.raises(ValidationError):
        SpanCoreFields(name="op", status=TraceStatus(status_code="OK"), attributes={})  # type: ignore[call-arg]


def test_span_parts_allow_extras() -> None:
    assert TraceStatus(status_code="OK", extra=1).model_extra == {"extra": 1}  # type: ignore[call-arg]
    assert Event(name="e", attributes={}, more="x").model_extra == {"more": "x"}  # type: ignore[call-arg]
    context = SpanContext(trace_id="t", span_id="s", is_remote=False, trace_state={}, x=1)  # type: ignore[call-arg]
    assert Link(context=context, y=2).model_extra == {"y": 2}  # type: ignore[call-arg]
    assert "z" not in OtelResource(attributes={}, schema_url="", z=3).model_dump()  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        TraceStatus(status_code="FINE")  # type: ignore[arg-type]


def test_semconv_constants() -> None:
    assert AGL_ANNOTATION == "agentlightning.annotation"
    assert reward_name_key(2) == "agentlightning.reward.2.name"
    assert reward_value_key(2) == "agentlightning.reward.2.value"
    assert RESOURCE_ROLLOUT_ID == "agentlightning.rollout_id"
    assert RESOURCE_ATTEMPT_ID == "agentlightning.attempt_id"
    assert RESOURCE_SPAN_SEQUENCE_ID == "agentlightning.span_sequence_id"


# ----------------------------------------------------------------------------------------- JSON values


class Color(Enum):
    RED = "red"


class Level(IntEnum):
    HIGH = 3


class Payload(BaseModel):
    name: str
    score: float = 1.0


def test_encode_json_none_is_sql_null() -> None:
    assert encode_json(None, "metadata") is None


@pytest.mark.parametrize(
    "value, expected",
    [
        ({}, "{}"),
        ([], "[]"),
        ("", '""'),
        (0, "0"),
        (False, "false"),
        (1.5, "1.5"),
        ({"a": [1, 2.5, None, True, "x"]}, '{"a":[1,2.5,null,true,"x"]}'),
        ((1, (2, 3)), "[1,[2,3]]"),
        ({"ü": "日本"}, '{"ü":"日本"}'),
        ({"nested": {"none": None}}, '{"nested":{"none":null}}'),
        (OrderedDict(a=1), '{"a":1}'),
        (Level.HIGH, "3"),
        ("\U0001f600", '"\U0001f600"'),
        (2**63 - 1, str(2**63 - 1)),
        (-(2**63), str(-(2**63))),
    ],
)
def test_encode_json_accepts(value: Any, expected: str) -> None:
    assert encode_json(value, "input") == expected


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 10**30, [1, {"n": 2**70}]])
def test_encode_json_refuses_integers_past_64_bits(value: Any) -> None:
    # A reader (SQLite's JSON functions, orjson, JavaScript) would give it back as a float, or not at all.
    with pytest.raises(ValueError, match=r"^input.*: integer .* is outside the signed 64-bit range"):
        encode_json(value, "input")


def test_encode_json_models_only_when_allowed() -> None:
    with pytest.raises(TypeError, match=r"^input: value of type Payload is not JSON-serialisable"):
        encode_json(Payload(name="x"), "input")
    with pytest.raises(TypeError, match=r"^metadata\['p'\]: value of type Payload"):
        encode_json({"p": Payload(name="x")}, "metadata")
    assert encode_json(Payload(name="x"), "config", allow_models=True) == '{"name":"x","score":1.0}'
    assert encode_json([Payload(name="y")], "events", allow_models=True) == '[{"name":"y","score":1.0}]'
    assert encode_json(RolloutConfig(), "config", allow_models=True) == (
        '{"timeout_seconds":null,"unresponsive_seconds":null,"max_attempts":1,"retry_condition":[],'
        '"retry_backoff_seconds":null,"retry_backoff_factor":2.0,"retry_backoff_max_seconds":null}'
    )
    with pytest.raises(ValueError, match=r"^config\['score'\]: NaN is not allowed"):
        encode_json(Payload(name="x", score=math.nan), "config", allow_models=True)
    with pytest.raises(ValueError, match=r"^config\[0\]\['name'\]: NUL"):
        encode_json([Payload(name="a\x00")], "config", allow_models=True)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("input", {"tags": {"a"}}, "input['tags']: value of type set is not JSON-serialisable"),
        ("input", b"raw", "input: value of type bytes is not JSON-serialisable"),
        ("input", bytearray(b"x"), "input: value of type bytearray is not JSON-serialisable"),
        ("metadata", {"when": datetime(2020, 1, 1)}, "metadata['when']: value of type datetime is not"),
        ("metadata", {"a": [1, object()]}, "metadata['a'][1]: value of type object is not JSON-serialisable"),
        ("input", Color.RED, "input: value of type Color is not JSON-serialisable"),
        ("input", 1 + 2j, "input: value of type complex is not JSON-serialisable"),
        ("input", frozenset(), "input: value of type frozenset is not JSON-serialisable"),
        ("metadata", {1: "x"}, "metadata: dict key 1 of type int is not allowed"),
        ("metadata", {"a": {None: 1}}, "metadata['a']: dict key None of type NoneType is not allowed"),
        ("metadata", {"a": {(1, 2): 1}}, "metadata['a']: dict key (1, 2) of type tuple is not allowed"),
    ],
)
def test_encode_json_rejects_types(field: str, value: Any, message: str) -> None:
    with pytest.raises(TypeError) as info:
        encode_json(value, field)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("metadata", {"a": [math.nan]}, "metadata['a'][0]: NaN is not allowed"),
        ("input", math.inf, "input: Infinity is not allowed"),
        ("input", [1, [2, -math.inf]], "input[1][1]: -Infinity is not allowed"),
        ("input", "a\x00b", "input: NUL character (\\x00) is not allowed in a string"),
        ("input", {"k": ["ok", "x\x00"]}, "input['k'][1]: NUL character (\\x00) is not allowed in a string"),
        ("input", {"a\x00": 1}, "input: dict key 'a\\x00': NUL character (\\x00) is not allowed"),
        ("input", "\ud800", "input: lone surrogate U+D800 is not allowed in a string"),
        ("input", ["ok", "é\udfff"], "input[1]: lone surrogate U+DFFF is not allowed in a string"),
        (
            "input",
            {"x": {"\udc80": 1}},
            "input['x']: dict key '\\udc80': lone surrogate U+DC80 is not allowed",
        ),
    ],
)
def test_encode_json_rejects_values(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        encode_json(value, field)
    assert str(info.value).startswith(message)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_encode_json_depth_limit() -> None:
    assert encode_json(_nested(MAX_JSON_DEPTH), "input") == "[" * 64 + "1" + "]" * 64
    with pytest.raises(ValueError) as info:
        encode_json(_nested(MAX_JSON_DEPTH + 1), "input")
    assert (
        str(info.value) == "input" + "[0]" * 64 + f": nesting exceeds the maximum depth of {MAX_JSON_DEPTH}"
    )
    nested_dicts: Any = {}
    for _ in range(MAX_JSON_DEPTH):
        nested_dicts = {"k": nested_dicts}
    with pytest.raises(ValueError, match=r"^metadata(\['k'\]){64}: nesting exceeds"):
        encode_json(nested_dicts, "metadata")


def test_encode_json_cycle_is_rejected_by_depth() -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="nesting exceeds the maximum depth"):
        encode_json(cycle, "input")


def test_encode_json_size_limit() -> None:
    assert MAX_JSON_BYTES == 16 * 1024 * 1024
    text = "x" * (MAX_JSON_BYTES - 2)  # plus two quotes: exactly at the limit
    encoded = encode_json(text, "input")
    assert encoded is not None and len(encoded) == MAX_JSON_BYTES
    with pytest.raises(ValueError) as info:
        encode_json("x" * 16_999_998, "attributes")
    assert str(info.value) == "attributes: encoded size 17000000 bytes exceeds the limit of 16777216 bytes"
    # The limit counts UTF-8 bytes, not characters: 6 MiB of a 3-byte character is 18 MiB.
    with pytest.raises(ValueError, match=r"^input: encoded size 18874370 bytes exceeds the limit"):
        encode_json("日" * (6 * 1024 * 1024), "input")


def test_encode_json_output_round_trips() -> None:
    value = {"a": [1, 2.0, "s", None, {"b": False}], "c": (3, 4), "d": {}, "e": ""}
    encoded = encode_json(value, "input")
    assert encoded is not None
    assert json.loads(encoded) == {"a": [1, 2.0, "s", None, {"b": False}], "c": [3, 4], "d": {}, "e": ""}
    assert isinstance(json.loads(encoded)["a"][1], float)


def test_encode_json_large_span_batch_is_correct() -> None:
    # The hot path: many spans with typical attributes. Correctness only; no timing assertions.
    attributes = {f"attr.{i}": ("value", i, float(i), True, ["a", "b"]) for i in range(50)}
    expected = {f"attr.{i}": ["value", i, float(i), True, ["a", "b"]] for i in range(50)}
    for i in range(2000):
        encoded = encode_json(attributes, f"spans[{i}].attributes")
        assert isinstance(encoded, str) and json.loads(encoded) == expected, i
    bad: dict[str, Any] = dict(attributes)
    bad["attr.bad"] = ("v", math.nan)
    with pytest.raises(ValueError, match=r"^attributes\['attr.bad'\]\[1\]: NaN is not allowed"):
        encode_json(bad, "attributes")


@pytest.mark.parametrize("value", ["ro-1", "", "Worker-0", "日本", "\U0001f600"])
def test_check_text_accepts(value: str) -> None:
    check_text(value, "rollout_id")


@pytest.mark.parametrize(
    "value, message",
    [
        ("ro\x001", "worker_id: NUL character (\\x00) is not allowed"),
        ("\ud83d", "worker_id: lone surrogate U+D83D is not allowed"),
    ],
)
def test_check_text_rejects(value: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_text(value, "worker_id")
    assert str(info.value).startswith(message)


def test_check_text_rejects_non_str() -> None:
    with pytest.raises(TypeError, match="idempotency_key"):
        check_text(5, "idempotency_key")  # type: ignore[arg-type]
