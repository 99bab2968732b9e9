"""Rows to models and models to rows.

Rows the store wrote itself are trusted: every stored value passed the models' validation on its way
in, so rollouts, attempts, workers and spans are rebuilt with pydantic's ``model_construct`` (no
validation) on the read paths; resources go through ``model_validate`` because their concrete
classes (resource kinds) must be re-materialised.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from sqlalchemy import Row

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.executor import EncodedJson
from lightning_sql.types import (
    Attempt,
    AttemptedRollout,
    Event,
    Link,
    OtelResource,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Run,
    Span,
    SpanContext,
    TraceStatus,
    Worker,
    check_json,
    check_text,
    encode_json,
)

R, A, W, S = s.rollouts, s.attempts, s.workers, s.spans

# What each result column becomes: every field of a model, with the column it is read from, in ONE
# place (tests/contract/test_row_mapping.py checks these against the models and the tables, so a
# new column or field cannot silently take a default).
ROLLOUT_FIELDS = {
    name: R.c[name]
    for name in (
        "rollout_id",
        "input",
        "start_time",
        "end_time",
        "mode",
        "resources_id",
        "status",
        "metadata",
        "resources_version",
        "idempotency_key",
        "priority",
        "not_before",
    )
}
CONFIG_FIELDS = {
    name: R.c[name]
    for name in (
        "timeout_seconds",
        "unresponsive_seconds",
        "max_attempts",
        "retry_condition",
        "retry_backoff_seconds",
        "retry_backoff_factor",
        "retry_backoff_max_seconds",
    )
}
ATTEMPT_FIELDS = {
    name: A.c[name]
    for name in (
        "rollout_id",
        "attempt_id",
        "sequence_id",
        "start_time",
        "end_time",
        "status",
        "worker_id",
        "last_heartbeat_time",
        "metadata",
    )
}
WORKER_FIELDS = {
    name: W.c[name]
    for name in (
        "worker_id",
        "status",
        "heartbeat_stats",
        "last_heartbeat_time",
        "last_dequeue_time",
        "last_busy_time",
        "last_idle_time",
        "current_rollout_id",
        "current_attempt_id",
    )
}
# A span's plain fields; its status, context, parent and extra fields live in ``extra`` (JSON).
SPAN_FIELDS = {
    name: S.c[name]
    for name in (
        "rollout_id",
        "attempt_id",
        "sequence_id",
        "trace_id",
        "span_id",
        "parent_id",
        "name",
        "start_time",
        "end_time",
        "attributes",
        "events",
        "links",
        "resource",
    )
}
SPAN_EXTRA_FIELDS = ("status", "context", "parent")  # kept in the ``extra`` column
# Columns that are no model field: positions, counters, keys of the run.
NOT_FIELDS = {
    "rollouts": ("run_id", "queue_seq", "span_seq", "create_seq", "attempt_count"),
    "attempts": ("run_id",),
    "workers": ("run_id", "create_seq"),
    "spans": ("id", "run_id", "status_code", "extra"),
}

ROLLOUT_COLUMNS = [*ROLLOUT_FIELDS.values(), *CONFIG_FIELDS.values()]
SPAN_COLUMNS = [*SPAN_FIELDS.values(), S.c.extra]


def json_deserializer(text: str | bytes) -> Any:
    """The engines' and the batches' JSON parser: pydantic-core's, which reads integers of any size
    and floats back exactly as they were written (as the standard library does, at twice its speed)."""
    return from_json(text)


def encoded(value: Any, field: str, *, allow_models: bool = False) -> EncodedJson | None:
    """Validate and encode a JSON value once; the engine passes the text through unchanged."""
    text = encode_json(value, field, allow_models=allow_models)
    return None if text is None else EncodedJson(text)


def as_mapping(row: Any) -> Any:
    """A row as a mapping: SQLAlchemy's ``Row._mapping`` and a named tuple's ``_asdict()`` (both
    public, underscored only to stay clear of column names); dicts are one."""
    mapping = getattr(row, "_mapping", None)
    if mapping is not None:
        return mapping
    if isinstance(row, tuple):
        return row._asdict()  # type: ignore[attr-defined]
    return row


def config_from(row: Any) -> RolloutConfig:
    m = as_mapping(row)
    fields = {name: m[name] for name in CONFIG_FIELDS}
    fields["retry_condition"] = list(fields["retry_condition"] or [])
    return RolloutConfig.model_construct(**fields)


def config_copy(config: RolloutConfig) -> RolloutConfig:
    return config.model_copy(deep=True)


def rollout_fields(m: Any) -> dict[str, Any]:
    fields = {name: m[name] for name in ROLLOUT_FIELDS}
    fields["config"] = config_from(m)
    return fields


def rollout_from_row(row: Row[Any] | Any) -> Rollout:
    return attempted(row, None)  # type: ignore[return-value]


def attempt_from_row(row: Row[Any] | Any) -> Attempt:
    m = as_mapping(row)
    return Attempt.model_construct(**{name: m[name] for name in ATTEMPT_FIELDS})


def attempted(rollout_row: Any, attempt: Attempt | None) -> Rollout | AttemptedRollout:
    """The rollout of a row (with ``attempt_count`` or not) and, if given, its attempt."""
    fields = rollout_fields(as_mapping(rollout_row))
    if attempt is None:
        return Rollout.model_construct(**fields)
    return AttemptedRollout.model_construct(**fields, attempt=attempt)


def worker_from_row(row: Row[Any] | Any) -> Worker:
    m = as_mapping(row)
    return Worker.model_construct(**{name: m[name] for name in WORKER_FIELDS})


def resources_from_row(row: Row[Any] | Any) -> ResourcesUpdate:
    m = as_mapping(row)
    return ResourcesUpdate.model_validate(
        {
            "resources_id": m["resources_id"],
            "create_time": m["create_time"],
            "update_time": m["update_time"],
            "version": m["version"],
            "resources": m["resources"],
        }
    )


def run_from_row(row: Row[Any] | Any) -> Run:
    m = as_mapping(row)
    return Run(
        name=m["name"],
        status=m["status"],
        created_at=m["created_at"],
        finished_at=m["finished_at"],
        metadata=m["metadata"],
        paused=bool(m["paused"]),
    )


# --- spans ------------------------------------------------------------------------------------



def _checked_id(value: Any, field: str) -> None:
    """``check_text(value, field)``, with plain ASCII ids (nearly all) settled inline."""
    if not _plain_text(value) or len(value) > MAX_PLAIN_ID_CHARS:
        check_text(value, field)


MAX_PLAIN_ID_CHARS = 1024  # an ASCII id this long is within MAX_ID_BYTES: check_text has nothing to add


def _plain_text(value: Any) -> bool:
    """A str that ``check_text`` passes without looking further (ASCII, no NUL), whatever its length."""
    return type(value) is str and value.isascii() and "\x00" not in value


def _dumped(model: Any, cls: type[BaseModel]) -> Any:
    """``model.model_dump()`` for encoding only: an instance of exactly ``cls`` without extras is its
    fields' values as they are (read, never changed, by the encoder); anything else is dumped."""
    if model is None:
        return None
    if type(model) is cls and not model.model_extra:
        return dict(model)
    return model.model_dump()


_EMPTY_LIST_JSON = "[]"


def _plain_status(status: Any) -> bool:
    return (
        type(status) is TraceStatus
        and not status.model_extra
        and _plain_text(status.status_code)
        and (status.description is None or _plain_text(status.description))
    )


def _plain_context(context: Any) -> bool:
    """None, or a ``SpanContext`` of plain texts (its trace state too), without extras."""
    return context is None or (
        type(context) is SpanContext
        and not context.model_extra
        and _plain_text(context.trace_id)
        and _plain_text(context.span_id)
        and type(context.is_remote) is bool
        and type(context.trace_state) is dict
        and all(_plain_text(key) and _plain_text(value) for key, value in context.trace_state.items())
    )


_IN_EXTRA: set[str] = set(SPAN_EXTRA_FIELDS)


def _extra_json(span: Span) -> str | None:
    """The ``extra`` column of a span: its status, context and parent, and its extra fields.  When
    every leaf of the first three is checked here (what a tracer's spans hold: plain texts, a
    bool) and there are no extra fields, pydantic-core encodes them (no walk of ``encode_json``)."""
    status, context, parent = span.status, span.context, span.parent
    if not span.model_extra and _plain_status(status) and _plain_context(context) and _plain_context(parent):
        return span.model_dump_json(include=_IN_EXTRA)
    extra: dict[str, Any] = {
        "status": _dumped(status, TraceStatus),
        "context": _dumped(context, SpanContext),
        "parent": _dumped(parent, SpanContext),
        **(span.model_extra or {}),
    }
    return encode_json(extra, "span.extra")


def _resource_json(resource: Any) -> str | None:
    """The ``resource`` column: an ``OtelResource`` without extras is checked (its attributes
    walked, as ``encode_json`` does) and encoded by pydantic-core; anything else is dumped."""
    if type(resource) is OtelResource and not resource.model_extra and _plain_text(resource.schema_url):
        check_json(resource.attributes, "span.resource.attributes")
        return resource.model_dump_json()
    return encode_json(_dumped(resource, OtelResource), "span.resource")


def span_values(span: Span, run_id: int) -> dict[str, Any]:
    """The row of one span; raises ``TypeError``/``ValueError`` for values JSON cannot hold.  Its
    JSON columns are encoded texts, bound as they are by the span batches."""
    _checked_id(span.rollout_id, "span.rollout_id")
    _checked_id(span.attempt_id, "span.attempt_id")
    _checked_id(span.trace_id, "span.trace_id")
    _checked_id(span.span_id, "span.span_id")
    check_text(span.name, "span.name", max_bytes=None)
    if span.parent_id is not None:
        _checked_id(span.parent_id, "span.parent_id")
    events, links = span.events, span.links
    return {
        "run_id": run_id,
        "rollout_id": span.rollout_id,
        "attempt_id": span.attempt_id,
        "sequence_id": span.sequence_id,
        "trace_id": span.trace_id,
        "span_id": span.span_id,
        "parent_id": span.parent_id,
        "name": span.name,
        "status_code": span.status.status_code,
        "start_time": span.start_time,
        "end_time": span.end_time,
        "attributes": encode_json(span.attributes, "span.attributes"),
        "events": _EMPTY_LIST_JSON if events == [] else encode_json([e.model_dump() for e in events], "span.events"),
        "links": _EMPTY_LIST_JSON if links == [] else encode_json([link.model_dump() for link in links], "span.links"),
        "resource": _resource_json(span.resource),
        "extra": _extra_json(span),
    }


def span_from_row(row: Any) -> Span:
    """The span of a row of ``spans`` (its JSON columns decoded).

    Built by pydantic-core (``model_validate``, strict: no coercion but a list mixing ints and floats,
    which OpenTelemetry does not allow, reading back as floats), three times faster than
    ``model_construct`` for a span and its nested models.  A stored span the model rejects (one its
    writer built with ``model_construct``) is rebuilt as it was stored."""
    m = as_mapping(row)
    extra: dict[str, Any] = dict(m["extra"] or {})
    data: dict[str, Any] = {name: m[name] for name in SPAN_FIELDS}
    data["status"] = extra.pop("status", None) or {"status_code": "UNSET"}
    data["context"] = extra.pop("context", None)
    data["parent"] = extra.pop("parent", None)
    for name, empty in (("attributes", {}), ("events", []), ("links", [])):
        if data[name] is None:
            data[name] = empty
    data.update(extra)
    try:
        return Span.model_validate(data, strict=True)
    except ValidationError:
        return _span_as_stored(data)


def _span_as_stored(data: dict[str, Any]) -> Span:
    fields = dict(data)
    fields["status"] = TraceStatus.model_construct(**fields["status"])
    for name in ("context", "parent"):
        if fields[name] is not None:
            fields[name] = SpanContext.model_construct(**fields[name])
    fields["events"] = [Event.model_construct(**event) for event in fields["events"]]
    fields["links"] = [_link(link) for link in fields["links"]]
    fields["resource"] = OtelResource.model_construct(**fields["resource"])
    return Span.model_construct(**fields)


def _link(stored: dict[str, Any]) -> Link:
    fields = dict(stored)
    fields["context"] = SpanContext.model_construct(**fields["context"])
    return Link.model_construct(**fields)
