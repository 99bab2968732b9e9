"""Span models that mirror OpenTelemetry spans, as Agent-Lightning v0.3 defines them.

Their fields and rules are specified in docs/store-contract.md §1.8.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from pydantic import BaseModel, ConfigDict, Field

from .jsonvalue import MAX_INT64, MIN_INT64

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource as OtelSdkResource
    from opentelemetry.sdk.trace import Event as OtelEvent
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace.status import Status as OtelStatus

__all__ = [
    "AGL_ANNOTATION",
    "AGL_VIRTUAL",
    "AGL_REWARD",
    "RESOURCE_ROLLOUT_ID",
    "RESOURCE_ATTEMPT_ID",
    "RESOURCE_SPAN_SEQUENCE_ID",
    "reward_name_key",
    "reward_value_key",
    "StatusCode",
    "AttributeValue",
    "Attributes",
    "TraceState",
    "SpanContext",
    "TraceStatus",
    "Event",
    "Link",
    "OtelResource",
    "SpanCoreFields",
    "Span",
    "convert_timestamp",
]

AGL_ANNOTATION = "agentlightning.annotation"
"""Span name of annotations (rewards, tags, metadata)."""
AGL_VIRTUAL = "agentlightning.virtual"
"""Span name of derived spans without a concrete operation (and the default of `Span.from_attributes`)."""
AGL_REWARD = "agentlightning.reward"
"""Attribute prefix of reward dimensions: `agentlightning.reward.<i>.name` / `.value`."""

RESOURCE_ROLLOUT_ID = "agentlightning.rollout_id"
RESOURCE_ATTEMPT_ID = "agentlightning.attempt_id"
RESOURCE_SPAN_SEQUENCE_ID = "agentlightning.span_sequence_id"


def reward_name_key(index: int) -> str:
    """Return the attribute key naming reward dimension `index`: `agentlightning.reward.<index>.name`."""
    return f"{AGL_REWARD}.{index}.name"


def reward_value_key(index: int) -> str:
    """Return the attribute key holding reward dimension `index`: `agentlightning.reward.<index>.value`."""
    return f"{AGL_REWARD}.{index}.value"


AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]
"""Possible values of OpenTelemetry attributes."""
Attributes = dict[str, AttributeValue]
"""Mapping from attribute names to their values (OpenTelemetry `Attributes`)."""
TraceState = dict[str, str]
"""Mapping from trace state key to its value (OpenTelemetry `TraceState`)."""
StatusCode = Literal["UNSET", "OK", "ERROR"]
"""The status code of a span."""


def convert_timestamp(timestamp: int | float | None) -> float | None:
    """Return an OpenTelemetry timestamp in seconds: values above 1e12 are nanoseconds; falsy values give None."""
    if not timestamp:
        return None
    return timestamp / 1_000_000_000 if timestamp > 1e12 else timestamp


def _extract_extra_fields(src: Any, excluded_fields: list[str]) -> dict[str, Any]:
    """Return the public attributes of `src.__dict__` not mapped to model fields, JSON round-tripped.

    Leading underscores are stripped from the attribute names; names of class attributes (methods,
    properties) are dropped; values JSON cannot hold are stringified.
    """
    excluded = set(excluded_fields) | {"_" + name for name in excluded_fields}
    excluded |= set(src.__class__.__dict__.keys())
    stripped = {key.lstrip("_"): value for key, value in src.__dict__.items()}
    candidates = {
        key: value for key, value in stripped.items() if key not in excluded and not key.startswith("_")
    }
    return json.loads(json.dumps(candidates, default=str))


def _extras_of(src: Any, excluded_fields: list[str]) -> dict[str, Any]:
    # Some OTel objects (slotted ones) have no __dict__ and therefore no extras.
    if not hasattr(src, "__dict__"):
        return {}
    return _extract_extra_fields(src, excluded_fields)


class SpanContext(BaseModel):
    """Pydantic representation of `opentelemetry.trace.SpanContext`."""

    model_config = ConfigDict(extra="allow")

    trace_id: str
    """The trace id, 32 lowercase hex characters."""
    span_id: str
    """The span id, 16 lowercase hex characters."""
    is_remote: bool
    """Whether the span is remote."""
    trace_state: TraceState
    """Mapping from trace state key to its value."""

    @classmethod
    def from_opentelemetry(cls, src: trace_api.SpanContext) -> SpanContext:
        """Return the model of an OpenTelemetry span context."""
        return cls(
            trace_id=trace_api.format_trace_id(src.trace_id),
            span_id=trace_api.format_span_id(src.span_id),
            is_remote=src.is_remote,
            trace_state={k: v for k, v in src.trace_state.items()} if src.trace_state else {},
            **_extras_of(src, ["trace_id", "span_id", "is_remote", "trace_state"]),
        )


class TraceStatus(BaseModel):
    """Serializable variant of `opentelemetry.trace.Status`."""

    model_config = ConfigDict(extra="allow")

    status_code: StatusCode
    """The status code of the span."""
    description: str | None = None
    """The description of the status."""

    @classmethod
    def from_opentelemetry(cls, src: OtelStatus) -> TraceStatus:
        """Return the model of an OpenTelemetry status."""
        return cls(
            status_code=src.status_code.name,  # type: ignore[arg-type]
            description=src.description,
            **_extras_of(src, ["status_code", "description"]),
        )


class Event(BaseModel):
    """Serializable representation of an OpenTelemetry span event."""

    model_config = ConfigDict(extra="allow")

    name: str
    """The name of the event."""
    attributes: Attributes
    """The attributes of the event."""
    timestamp: float | None = None
    """The timestamp of the event, in seconds."""

    @classmethod
    def from_opentelemetry(cls, src: OtelEvent) -> Event:
        """Return the model of an OpenTelemetry event."""
        return cls(
            name=src.name,
            attributes=dict(src.attributes) if src.attributes else {},
            timestamp=convert_timestamp(src.timestamp),
            **_extras_of(src, ["name", "attributes", "timestamp"]),
        )


class Link(BaseModel):
    """Serializable representation of an OpenTelemetry span link."""

    model_config = ConfigDict(extra="allow")

    context: SpanContext
    """The context of the linked span."""
    attributes: Attributes | None = None
    """Optional attributes of the link."""

    @classmethod
    def from_opentelemetry(cls, src: trace_api.Link) -> Link:
        """Return the model of an OpenTelemetry link."""
        return cls(
            context=SpanContext.from_opentelemetry(src.context),
            attributes=dict(src.attributes) if src.attributes else None,
            **_extras_of(src, ["context", "attributes"]),
        )


class OtelResource(BaseModel):
    """Serializable representation of an OpenTelemetry resource (not to be confused with `Resource`)."""

    attributes: Attributes
    """The attributes of the resource."""
    schema_url: str
    """The schema URL of the resource."""

    @classmethod
    def from_opentelemetry(cls, src: OtelSdkResource) -> OtelResource:
        """Return the model of an OpenTelemetry resource."""
        return cls(
            attributes=dict(src.attributes) if src.attributes else {},
            schema_url=src.schema_url if src.schema_url else "",
            **_extras_of(src, ["attributes", "schema_url"]),
        )


class SpanCoreFields(BaseModel):
    """The core fields of a span, for span creators that do not need the full model."""

    name: str
    """The name of the span."""
    status: TraceStatus
    """The status of the span."""
    attributes: Attributes
    """The attributes of the span."""
    start_time: float | None
    """The start time of the span, in seconds."""
    end_time: float | None
    """The end time of the span, in seconds."""


_SPAN_MAPPED_FIELDS = [
    "name",
    "context",
    "parent",
    "resource",
    "attributes",
    "events",
    "links",
    "start_time",
    "end_time",
    "status",
    "span_processor",
    "rollout_id",
    "attempt_id",
    "trace_id",
    "span_id",
    "parent_id",
]


class Span(BaseModel):
    """A stored span: the relevant fields of an OpenTelemetry `ReadableSpan`; other attributes kept as extras."""

    model_config = ConfigDict(extra="allow")

    rollout_id: str
    """The rollout this span belongs to."""
    attempt_id: str
    """The attempt this span belongs to."""
    sequence_id: int = Field(ge=MIN_INT64, le=MAX_INT64)
    """Orders spans within a rollout (not unique: a subtree may share one); a 64-bit integer."""
    trace_id: str
    """The trace id, 32 lowercase hex characters."""
    span_id: str
    """The span id, 16 lowercase hex characters."""
    parent_id: str | None
    """The parent span id, or None for a root span."""
    name: str
    """The name of the span."""
    status: TraceStatus
    """The status of the span."""
    attributes: Attributes
    """The attributes of the span."""
    events: list[Event]
    """The events of the span."""
    links: list[Link]
    """The links of the span."""
    start_time: float | None
    """The start time of the span, in seconds."""
    end_time: float | None
    """The end time of the span, in seconds."""
    context: SpanContext | None
    """The context of the span."""
    parent: SpanContext | None
    """The parent context of the span."""
    resource: OtelResource
    """The OpenTelemetry resource of the span."""

    @classmethod
    def from_opentelemetry(
        cls, src: ReadableSpan, rollout_id: str, attempt_id: str, sequence_id: int
    ) -> Span:
        """Return the stored form of an OpenTelemetry span (other public attributes become JSON extras)."""
        context = src.get_span_context()
        if context is None:
            trace_id = span_id = 0
        else:
            trace_id = context.trace_id
            span_id = context.span_id
        return cls(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=sequence_id,
            trace_id=trace_api.format_trace_id(trace_id),
            span_id=trace_api.format_span_id(span_id),
            parent_id=trace_api.format_span_id(src.parent.span_id) if src.parent else None,
            name=src.name,
            status=TraceStatus.from_opentelemetry(src.status),
            attributes=dict(src.attributes) if src.attributes else {},
            events=[Event.from_opentelemetry(event) for event in src.events] if src.events else [],
            links=[Link.from_opentelemetry(link) for link in src.links] if src.links else [],
            start_time=convert_timestamp(src.start_time),
            end_time=convert_timestamp(src.end_time),
            context=SpanContext.from_opentelemetry(context) if context else None,
            parent=SpanContext.from_opentelemetry(src.parent) if src.parent else None,
            resource=OtelResource.from_opentelemetry(src.resource),
            **_extras_of(src, _SPAN_MAPPED_FIELDS),
        )

    @classmethod
    def from_attributes(
        cls,
        *,
        attributes: Attributes,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        sequence_id: int | None = None,
        name: str | None = None,
        trace_id: str | None = None,
        span_id: str | None = None,
        parent_id: str | None = None,
        start_time: float | None = None,
        end_time: float | None = None,
        resource: OtelResource | None = None,
        status: TraceStatus | None = None,
    ) -> Span:
        """Return a synthetic span carrying `attributes`; missing ids are random, the status defaults to OK."""
        id_generator = RandomIdGenerator()
        trace_id = trace_id or trace_api.format_trace_id(id_generator.generate_trace_id())
        span_id = span_id or trace_api.format_span_id(id_generator.generate_span_id())
        return cls(
            rollout_id=rollout_id or "",
            attempt_id=attempt_id or "",
            sequence_id=sequence_id or 0,
            trace_id=trace_id,
            span_id=span_id,
            parent_id=parent_id,
            start_time=start_time,
            end_time=end_time,
            context=SpanContext(trace_id=trace_id, span_id=span_id, is_remote=False, trace_state={}),
            name=name or AGL_VIRTUAL,
            resource=resource or OtelResource(attributes={}, schema_url=""),
            attributes=attributes,
            status=status or TraceStatus(status_code="OK"),
            events=[],
            links=[],
            parent=(
                SpanContext(trace_id=trace_id, span_id=parent_id, is_remote=False, trace_state={})
                if parent_id
                else None
            ),
        )

    @classmethod
    def from_core_fields(
        cls,
        core: SpanCoreFields,
        *,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        sequence_id: int | None = None,
    ) -> Span:
        """Return a synthetic span built from core fields; the start time defaults to `time.time()`."""
        return cls.from_attributes(
            attributes=core.attributes,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=sequence_id,
            name=core.name,
            start_time=core.start_time or time.time(),
            end_time=core.end_time,
            status=core.status,
        )
