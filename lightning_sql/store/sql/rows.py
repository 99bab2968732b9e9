"""Rows to models and models to rows.

Rows the store wrote itself are trusted: every stored value passed the models' validation on its way
in, so rollouts, attempts, workers and spans are rebuilt without validation (``construct``, or
pydantic's ``model_construct``) on the read hot paths; resources go through ``model_validate``
because their concrete classes (resource kinds) must be re-materialised.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import Row, Text, cast, type_coerce

from lightning_sql.store.sql import schema as s
from lightning_sql.store.sql.engine import EncodedJson
from lightning_sql.store.sql.fastexec import _FAST_REFUSES, _parse_json, loads_json
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
    check_text,
    encode_json,
)
from lightning_sql.types.jsonvalue import MAX_ID_CHARS, json_text

ROLLOUT_COLUMNS = [c for c in s.rollouts.c if c.name not in ("run_id", "queue_seq", "span_seq", "attempt_count")]
ATTEMPT_COLUMNS = [c for c in s.attempts.c if c.name != "run_id"]
WORKER_COLUMNS = [c for c in s.workers.c if c.name not in ("run_id",)]
SPAN_COLUMNS = [c for c in s.spans.c if c.name not in ("run_id", "id")]
RESOURCES_COLUMNS = [c for c in s.resources.c if c.name not in ("run_id",)]


M = TypeVar("M", bound=BaseModel)


class _Constructor:
    """``cls.model_construct(**values)`` for one model class, without its per-field alias look-ups
    when ``values`` holds every field: the same ``__dict__`` (fields in definition order), fields set,
    extras and private state, for about a third of the cost (span read-back builds 6 models per span).
    Anything else (a missing field, aliases, private attributes, ``model_post_init``) goes to
    ``model_construct`` itself."""

    def __init__(self, cls: type[BaseModel]) -> None:
        fields = cls.__pydantic_fields__
        self.cls = cls
        self.names = tuple(fields)
        self.name_set = frozenset(fields)
        self.allow_extra = cls.model_config.get("extra") == "allow"
        self.fast = not (
            cls.__pydantic_post_init__
            or cls.__pydantic_root_model__
            or cls.__private_attributes__
            or any(f.alias is not None or f.validation_alias is not None for f in fields.values())
        )

    def empty_extra(self) -> dict[str, Any] | None:
        """A new object's extras when it has none: a dict of its own where extras are allowed."""
        return {} if self.allow_extra else None

    def __call__(self, values: dict[str, Any]) -> Any:
        if not self.fast or not self.name_set <= values.keys():
            return self.cls.model_construct(**values)
        data = {name: values[name] for name in self.names}
        extra: dict[str, Any] | None = None
        if self.allow_extra:
            extra = {k: v for k, v in values.items() if k not in self.name_set} if len(values) != len(data) else {}
        return _bare(self.cls, data, self.name_set, extra)


_constructors: dict[type[BaseModel], _Constructor] = {}
_constructors_lock = threading.Lock()


def _constructor(cls: type[BaseModel]) -> _Constructor:
    try:
        return _constructors[cls]
    except KeyError:
        with _constructors_lock:
            return _constructors.setdefault(cls, _Constructor(cls))


def construct(cls: type[M], values: dict[str, Any]) -> M:
    """``cls.model_construct(**values)``, faster (see ``_Constructor``); ``values`` is not modified."""
    return _constructor(cls)(values)  # type: ignore[no-any-return]


def adopter(cls: type[M]) -> Callable[[dict[str, Any]], M]:
    """``construct(cls, values)`` for a dict that nothing else holds (a decoded JSON column): when
    its keys are the model's fields in their order (what the store wrote), the dict itself becomes
    the model's ``__dict__`` instead of a copy; when they are the fields in another order (JSONB
    keeps keys sorted by length, then bytes), a copy in field order does.  One function per class
    with its checks worked out here (``_bare`` inlined): span read-back adopts three or four dicts
    per span."""
    constructor = _constructor(cls)
    if not constructor.fast:
        return constructor  # type: ignore[return-value]
    names, name_set, count, allow_extra = (
        constructor.names,
        constructor.name_set,
        len(constructor.names),
        constructor.allow_extra,
    )

    def adopt(values: dict[str, Any]) -> M:
        if len(values) == count:
            if tuple(values) != names:
                if not values.keys() <= name_set:
                    return constructor(values)  # type: ignore[no-any-return]
                values = {name: values[name] for name in names}
            obj = _new(cls)
            _set_dict(obj, "__dict__", values)
            _set_fields_set(obj, set(name_set))
            _set_extra(obj, {} if allow_extra else None)
            _set_private(obj, None)
            return obj  # type: ignore[no-any-return]
        return constructor(values)  # type: ignore[no-any-return]

    return adopt


_new = object.__new__
_set_dict = object.__setattr__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


def _bare(
    cls: type[BaseModel], data: dict[str, Any], names: frozenset[str], extra: dict[str, Any] | None
) -> Any:
    """A model with ``data`` as its ``__dict__`` (the fields, in definition order), every field set,
    ``extra`` as its extras (a dict of its own, or None) and no private state."""
    obj = _new(cls)
    _set_dict(obj, "__dict__", data)
    _set_fields_set(obj, set(names))
    _set_extra(obj, extra)
    _set_private(obj, None)
    return obj


def encoded(value: Any, field: str, *, allow_models: bool = False) -> EncodedJson | None:
    """Validate and encode a JSON value once; the engine passes the text through unchanged."""
    text = encode_json(value, field, allow_models=allow_models)
    return None if text is None else EncodedJson(text)


def _mapping(row: Any) -> Any:
    """A row as a mapping: SQLAlchemy's Row and fastexec's rows have ``_mapping``; dicts are one."""
    return getattr(row, "_mapping", row)


def config_from(m: Any) -> RolloutConfig:
    return construct(
        RolloutConfig,
        {
            "timeout_seconds": m["timeout_seconds"],
            "unresponsive_seconds": m["unresponsive_seconds"],
            "max_attempts": m["max_attempts"],
            "retry_condition": list(m["retry_condition"] or []),
        },
    )


def config_copy(config: RolloutConfig) -> RolloutConfig:
    """``config.model_copy(deep=True)``; a plain ``RolloutConfig`` (numbers and a list of str) is
    copied field by field, for a tenth of the cost (every enqueued rollout copies one)."""
    if type(config) is not RolloutConfig or config.__pydantic_extra__ or config.__pydantic_private__:
        return config.model_copy(deep=True)
    data = dict(config.__dict__)
    data["retry_condition"] = list(data["retry_condition"])
    copied = _bare(RolloutConfig, data, _CONFIG.name_set, _CONFIG.empty_extra())
    _set_fields_set(copied, set(config.__pydantic_fields_set__))
    return copied  # type: ignore[no-any-return]


def rollout_fields(m: Any) -> dict[str, Any]:
    return {
        "rollout_id": m["rollout_id"],
        "input": m["input"],
        "start_time": m["start_time"],
        "end_time": m["end_time"],
        "mode": m["mode"],
        "resources_id": m["resources_id"],
        "status": m["status"],
        "config": config_from(m),
        "metadata": m["metadata"],
        "resources_version": m["resources_version"],
        "idempotency_key": m["idempotency_key"],
    }


def rollout_from_row(row: Row[Any] | Any) -> Rollout:
    return attempted(row, None)  # type: ignore[return-value]


# Every field of these models is a column of its table (a new field without one fails loudly here).
_ATTEMPT_FIELDS = tuple(Attempt.model_fields)
_attempt_columns = operator.attrgetter(*_ATTEMPT_FIELDS)
_ATTEMPT = _constructor(Attempt)


def attempt_from_row(row: Row[Any] | Any) -> Attempt:
    if _ATTEMPT.fast:
        try:
            values = _attempt_columns(row)
        except AttributeError:
            pass
        else:
            data = dict(zip(_ATTEMPT_FIELDS, values, strict=True))
            built = _bare(Attempt, data, _ATTEMPT.name_set, _ATTEMPT.empty_extra())
            return built  # type: ignore[no-any-return]
    m = _mapping(row)
    return construct(Attempt, {name: m[name] for name in _ATTEMPT_FIELDS})


# ``attempted`` spells these fields out, in this order; it assembles rows directly only while the
# models have exactly them and nothing that needs pydantic's own construction (``_ROLLOUT_DIRECT``).
_ROLLOUT_ORDER = (
    "rollout_id",
    "input",
    "start_time",
    "end_time",
    "mode",
    "resources_id",
    "status",
    "config",
    "metadata",
    "resources_version",
    "idempotency_key",
)
_CONFIG_ORDER = ("timeout_seconds", "unresponsive_seconds", "max_attempts", "retry_condition")
# The rollout row's columns: the Rollout fields but ``config`` in order, then the config's four.
_rollout_columns = operator.attrgetter(*(name for name in _ROLLOUT_ORDER if name != "config"), *_CONFIG_ORDER)
_CONFIG = _constructor(RolloutConfig)
_ROLLOUT = _constructor(Rollout)
_ATTEMPTED = _constructor(AttemptedRollout)
_ROLLOUT_DIRECT = (
    _CONFIG.fast
    and _ROLLOUT.fast
    and _ATTEMPTED.fast
    and _CONFIG.names == _CONFIG_ORDER
    and _ROLLOUT.names == _ROLLOUT_ORDER
    and _ATTEMPTED.names == (*_ROLLOUT_ORDER, "attempt")
)


def attempted(rollout_row: Any, attempt: Attempt | None) -> Rollout | AttemptedRollout:
    """The rollout of a row (with ``attempt_count`` or not) and, if given, its attempt: what
    ``construct`` builds from ``rollout_fields``, assembled directly from a row with attribute
    access (query_rollouts builds thousands)."""
    if _ROLLOUT_DIRECT:
        try:
            columns = _rollout_columns(rollout_row)
            (rid, input_, start, end, mode, rsid, status, metadata, version, key) = columns[:10]
            (timeout, unresponsive, attempts, retry) = columns[10:]
        except AttributeError:
            pass
        else:
            config = _bare(
                RolloutConfig,
                {
                    "timeout_seconds": timeout,
                    "unresponsive_seconds": unresponsive,
                    "max_attempts": attempts,
                    "retry_condition": list(retry or []),
                },
                _CONFIG.name_set,
                _CONFIG.empty_extra(),
            )
            data = {
                "rollout_id": rid,
                "input": input_,
                "start_time": start,
                "end_time": end,
                "mode": mode,
                "resources_id": rsid,
                "status": status,
                "config": config,
                "metadata": metadata,
                "resources_version": version,
                "idempotency_key": key,
            }
            if attempt is None:
                plain = _bare(Rollout, data, _ROLLOUT.name_set, _ROLLOUT.empty_extra())
                return plain  # type: ignore[no-any-return]
            data["attempt"] = attempt
            built = _bare(AttemptedRollout, data, _ATTEMPTED.name_set, _ATTEMPTED.empty_extra())
            return built  # type: ignore[no-any-return]
    return _attempted_from_mapping(_mapping(rollout_row), attempt)


def _attempted_from_mapping(m: Any, attempt: Attempt | None) -> Rollout | AttemptedRollout:
    """``attempted`` for any row shape, through ``construct``."""
    fields = rollout_fields(m)
    if attempt is None:
        return construct(Rollout, fields)
    fields["attempt"] = attempt
    return construct(AttemptedRollout, fields)


_WORKER_FIELDS = tuple(Worker.model_fields)  # likewise


def worker_from_row(row: Row[Any] | Any) -> Worker:
    m = _mapping(row)
    return construct(Worker, {name: m[name] for name in _WORKER_FIELDS})


def resources_from_row(row: Row[Any] | Any) -> ResourcesUpdate:
    m = _mapping(row)
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
    m = _mapping(row)
    return Run(
        name=m["name"],
        status=m["status"],
        created_at=m["created_at"],
        finished_at=m["finished_at"],
        metadata=m["metadata"],
    )


# --- spans ------------------------------------------------------------------------------------

_SPAN_COLUMN_FIELDS = (
    "rollout_id",
    "attempt_id",
    "sequence_id",
    "trace_id",
    "span_id",
    "parent_id",
    "name",
    "start_time",
    "end_time",
)


def _checked_id(value: Any, field: str) -> None:
    """``check_text(value, field)``, with plain ASCII ids (nearly all) settled inline."""
    if not _plain_text(value) or len(value) > MAX_ID_CHARS:
        check_text(value, field)


def _plain_text(value: Any) -> bool:
    """A str that ``check_text`` passes without looking further (ASCII, no NUL), whatever its length."""
    return type(value) is str and value.isascii() and "\x00" not in value


def _dumped(model: Any, cls: type[BaseModel]) -> Any:
    """``model.model_dump()`` for encoding only: an instance of exactly ``cls`` without extras is its
    fields' dict itself (read, never changed, by ``encoded``); anything else is dumped."""
    if model is None:
        return None
    if type(model) is cls and not model.__pydantic_extra__:
        return model.__dict__
    return model.model_dump()


_EMPTY_LIST_JSON = "[]"


def _plain_status(status: Any) -> bool:
    return (
        type(status) is TraceStatus
        and not status.__pydantic_extra__
        and _plain_text(status.status_code)
        and (status.description is None or _plain_text(status.description))
    )


def _plain_context(context: Any) -> bool:
    """None, or a ``SpanContext`` of plain texts (its trace state too), without extras."""
    return context is None or (
        type(context) is SpanContext
        and not context.__pydantic_extra__
        and _plain_text(context.trace_id)
        and _plain_text(context.span_id)
        and type(context.is_remote) is bool
        and type(context.trace_state) is dict
        and all(_plain_text(key) and _plain_text(value) for key, value in context.trace_state.items())
    )


def _extra_json(span: Span) -> str | None:
    """The ``extra`` column of a span: its status, context and parent, and its extra fields.  When
    every leaf of the first three is checked here (what a tracer's spans hold: plain texts, a
    bool) and there are no extra fields, it is encoded without the walk of ``encode_json``."""
    status, context, parent = span.status, span.context, span.parent
    extra: dict[str, Any] = {
        "status": _dumped(status, TraceStatus),
        "context": _dumped(context, SpanContext),
        "parent": _dumped(parent, SpanContext),
    }
    if span.model_extra:
        extra.update(span.model_extra)
    elif _plain_status(status) and _plain_context(context) and _plain_context(parent):
        return json_text(extra, "span.extra")
    return encode_json(extra, "span.extra")


def span_values(span: Span, run_id: int) -> dict[str, Any]:
    """The row of one span; raises ``TypeError``/``ValueError`` for values JSON cannot hold (§0.4).
    Its JSON columns are plain ``str`` texts, not ``EncodedJson``: the collector does not track a
    ``str`` nor a dict that holds only such values, and rows wait in batches, where each tracked
    object made every young collection longer (``dialect.insert_new_spans`` marks them for the
    statements whose JSON columns take the engine's serializer)."""
    _checked_id(span.rollout_id, "span.rollout_id")
    _checked_id(span.attempt_id, "span.attempt_id")
    _checked_id(span.trace_id, "span.trace_id")
    _checked_id(span.span_id, "span.span_id")
    check_text(span.name, "span.name", max_chars=None)
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
        "resource": encode_json(_dumped(span.resource, OtelResource), "span.resource"),
        "extra": _extra_json(span),
    }


_SPAN_FIELDS = tuple(Span.__pydantic_fields__)
# The columns of a span row: the plain ones (``_SPAN_COLUMN_FIELDS``), then the JSON ones.
SPAN_JSON_FIELDS = ("attributes", "events", "links", "resource", "extra")
_span_columns = operator.attrgetter(*_SPAN_COLUMN_FIELDS, *SPAN_JSON_FIELDS)
_SPAN_EXTRA_FIELDS = frozenset(("status", "context", "parent"))
_SPAN_FAST = _constructor(Span).fast and Span.model_config.get("extra") == "allow"
_SPAN_NAMES = frozenset(_SPAN_FIELDS)
_adopt_status, _adopt_context, _adopt_resource = adopter(TraceStatus), adopter(SpanContext), adopter(OtelResource)


def _span_state(
    plain: tuple[Any, ...], attributes: Any, events: Any, links: Any, resource: Any, extra: Any
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A span's ``__dict__`` and extras, built without validation, from its plain columns
    (``_SPAN_COLUMN_FIELDS``' order) and its decoded JSON columns: every stored value passed the
    model's validation on its way in (``span_values``), so this rebuilds what ``model_construct``
    would build from the stored fields, for a fraction of ``model_validate``'s cost (read-back is a
    hot path: W1 and W6 of the benchmarks).  None when the row is not of the usual shape (the three
    model fields kept in ``extra`` present): ``_span_from_mapping`` builds those."""
    if not extra or not _SPAN_EXTRA_FIELDS <= extra.keys():
        return None
    rid, aid, seq, tid, sid, pid, name, start, end = plain
    context, parent = extra["context"], extra["parent"]
    data = {
        "rollout_id": rid,
        "attempt_id": aid,
        "sequence_id": seq,
        "trace_id": tid,
        "span_id": sid,
        "parent_id": pid,
        "name": name,
        "status": _adopt_status(extra["status"]),
        "attributes": attributes if attributes is not None else {},
        "events": [construct(Event, event) for event in events] if events else [],
        "links": [_link(link) for link in links] if links else [],
        "start_time": start,
        "end_time": end,
        "context": None if context is None else _adopt_context(context),
        "parent": None if parent is None else _adopt_context(parent),
        "resource": _adopt_resource(resource),
    }
    more = {k: v for k, v in extra.items() if k not in _SPAN_EXTRA_FIELDS} if len(extra) > 3 else {}
    return data, more


def _span_from_mapping(m: Any) -> Span:
    """A span of any row shape (a mapping of its columns, JSON decoded): the stored fields through
    ``construct``."""
    data: dict[str, Any] = dict(m["extra"] or {})
    for name in _SPAN_COLUMN_FIELDS:
        data[name] = m[name]
    data["status"] = construct(TraceStatus, data["status"])
    for name in ("context", "parent"):
        if data.get(name) is not None:
            data[name] = construct(SpanContext, data[name])
    data["attributes"] = m["attributes"] if m["attributes"] is not None else {}
    data["events"] = [construct(Event, event) for event in m["events"] or ()]
    data["links"] = [_link(link) for link in m["links"] or ()]
    data["resource"] = construct(OtelResource, m["resource"])
    return construct(Span, data)


def _link(stored: dict[str, Any]) -> Link:
    fields = dict(stored)
    fields["context"] = construct(SpanContext, fields["context"])
    return construct(Link, fields)


# --- spans read back with their JSON decoded on first use ---------------------------------------


def span_read_columns(dialect: str) -> list[Any]:
    """The columns of a span read-back, its JSON columns as text: on SQLite the stored text itself
    (no result processor), on PostgreSQL JSONB's text output (``CAST``: asyncpg's codec would
    decode JSONB)."""
    as_text = type_coerce if dialect == "sqlite" else cast
    return [
        as_text(c, Text).label(c.name) if c.name in SPAN_JSON_FIELDS else c for c in s.spans.c if c.name != "run_id"
    ]


# A deferred span's plain field -> its place in the span's columns (``_span_columns``' order).
_PLAIN_INDEX = {name: index for index, name in enumerate(_SPAN_COLUMN_FIELDS)}
_PLAIN_COUNT = len(_SPAN_COLUMN_FIELDS)
_get = object.__getattribute__
_realize_lock = threading.Lock()


class DeferredSpan(Span):
    """A span read back whose JSON columns are decoded when it is first used (ADR 0008).

    It holds its row's columns (``_span_columns``: the plain ones, ids, name and times, then the
    JSON texts) as a tuple in ``__pydantic_private__`` (which a span otherwise leaves None), and an
    empty ``__dict__``.  Reading a plain field answers from the tuple.  Any other attribute access
    (a JSON-held field, a method, ``__dict__``, ``__class__``; pydantic's serializer, ``==``, copy
    and pickle all read through attribute access) first decodes the texts, builds the span's state
    (``_span_state``) and turns the object into a plain ``Span`` (``__class__`` assignment: the
    same layout), which it then stays.  So a caller that only looks at ids, names and order (a
    trace's structure, the benchmarks' read-back checks) never pays for decoding, and one that
    reads everything pays what an eager read cost and 10-19% more (measured: ADR 0008).  Until then
    ``type(span)`` is this class (``isinstance(span, Span)`` holds throughout); a stored value that
    does not decode raises on first use instead of in ``query_spans``."""

    def __getattribute__(self, name: str) -> Any:
        index = _PLAIN_INDEX.get(name)
        if index is not None:
            columns = _get(self, "__pydantic_private__")
            if type(columns) is tuple:  # else realized meanwhile, or a copy pydantic made of a realized one
                return columns[index]
        _realize(self)
        return _get(self, name)


def _realize(span: Any) -> None:
    """Decode a ``DeferredSpan``'s JSON texts into its fields and make it a ``Span`` (once, whatever
    the threads; a copy made by pydantic of a realized one only needs its class)."""
    with _realize_lock:
        if type(span) is not DeferredSpan:
            return
        columns = _get(span, "__pydantic_private__")
        if type(columns) is tuple:
            plain = columns[:_PLAIN_COUNT]
            attributes, events, links, resource, extra = columns[_PLAIN_COUNT:]
            # ``loads_json`` inlined: five calls per span without its frame (0.2-0.3 µs of the ~8 µs a
            # realized span costs, measured against a comprehension of ``loads_json``).
            try:  # the fast parser straight, else the standard path for all five
                attributes = None if attributes is None else _parse_json(attributes)
                events = None if events is None else _parse_json(events)
                links = None if links is None else _parse_json(links)
                resource = None if resource is None else _parse_json(resource)
                extra = None if extra is None else _parse_json(extra)
            except _FAST_REFUSES:
                attributes, events, links, resource, extra = (
                    None if text is None else loads_json(text) for text in columns[_PLAIN_COUNT:]
                )
            state = _span_state(plain, attributes, events, links, resource, extra)
            if state is None:  # not the usual shape: the general path
                values = dict(zip(_SPAN_COLUMN_FIELDS, plain, strict=True))
                values.update(attributes=attributes, events=events, links=links, resource=resource, extra=extra)
                full = _span_from_mapping(values)
                state = (full.__dict__, full.__pydantic_extra__ or {})
            _set_dict(span, "__dict__", state[0])
            _set_fields_set(span, set(_SPAN_NAMES))
            _set_extra(span, state[1])
            _set_private(span, None)
        _set_dict(span, "__class__", Span)


def deferred_span_from_row(row: Any) -> Span:
    """The span of a row read through ``span_read_columns`` (its JSON columns as text): a
    ``DeferredSpan``; where spans are not assembled directly (``_SPAN_FAST``, a row without
    attribute access), the span ``_span_from_mapping`` builds from the decoded row."""
    try:
        columns = _span_columns(row) if _SPAN_FAST else None
    except AttributeError:
        columns = None
    if columns is None:
        values = dict(_mapping(row))
        for name in SPAN_JSON_FIELDS:
            if values[name] is not None:
                values[name] = loads_json(values[name])
        return _span_from_mapping(values)
    span = _new(DeferredSpan)
    _set_dict(span, "__dict__", {})
    _set_fields_set(span, set())
    _set_extra(span, None)
    _set_private(span, columns)
    return span  # type: ignore[no-any-return]
