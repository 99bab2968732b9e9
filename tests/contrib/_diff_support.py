"""Differential harness: drive Agent-Lightning's ``InMemoryLightningStore`` and our bridge in lockstep.

Both stores receive the same calls at the same (fake) time and their results are normalised and
compared:

* generated ids (``ro-``/``at-``/``rs-``) are replaced by per-store aliases assigned in the order in
  which each store first shows them (``ro#0``, ``at#3``, ...), in results and in error messages; a
  call refers to "the i-th rollout this store returned" with :class:`R`, :class:`A`, :class:`S`;
* timestamps written by a store read ``T+<k>``: both stores read one fake clock that the driver
  sets before every call (upstream through its modules' ``time``, ours through ``clock=``), so the
  absolute epoch is ignored but None-ness, order and which call stamped a value are compared;
* models keep their exact class (module + qualified name), every field and extra field;
* an exception becomes ``("raise", <exception class>, <message>)``; warnings and ERROR log records
  whose text the contract fixes (duplicate spans) are part of the outcome.

This module imports ``agentlightning``: import it only after the skip guard of the test module.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time as _real_time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import agentlightning as agl
from agentlightning.store import collection_based as agl_collection_based
from agentlightning.store import utils as agl_store_utils
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from pydantic import BaseModel

# The fake epoch: every timestamp a store writes is T0 + <whole seconds set by the driver>.
T0 = 1_000_000_000.0
_STAMP_WINDOW = 1_000_000.0
_ID_RE = re.compile(r"\b(ro|at|rs)-[0-9a-f]{8,12}\b")


class TickClock:
    """The one fake clock both stores read; the driver moves it between calls."""

    def __init__(self) -> None:
        self.value = T0

    def __call__(self) -> float:
        return self.value

    def advance(self, seconds: float) -> float:
        self.value += seconds
        return self.value


class _TimeShim:
    """Stands in for the ``time`` module inside upstream's store modules: ``time()`` is the fake clock."""

    def __init__(self, clock: TickClock) -> None:
        self._clock = clock

    def time(self) -> float:
        return self._clock()

    def __getattr__(self, name: str) -> Any:
        return getattr(_real_time, name)


def patch_upstream_clock(monkeypatch: Any, clock: TickClock) -> None:
    """Make upstream's store (collection_based.py and utils.py read ``time.time()``) use ``clock``."""
    shim = _TimeShim(clock)
    monkeypatch.setattr(agl_collection_based, "time", shim)
    monkeypatch.setattr(agl_store_utils, "time", shim)


# --- references to generated ids -----------------------------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """The ``index``-th id of ``prefix`` that a store has shown (negative indexes count from the end)."""

    prefix: str
    index: int


def R(index: int) -> Ref:  # noqa: N802 - reads like the alias it stands for
    return Ref("ro", index)


def A(index: int) -> Ref:  # noqa: N802
    return Ref("at", index)


def S(index: int) -> Ref:  # noqa: N802
    return Ref("rs", index)


@dataclass(frozen=True)
class Per:
    """An argument built per store (``build(side)``), e.g. a span carrying that store's ids."""

    build: Callable[[Side], Any]


@dataclass
class Side:
    """One store under test and its id aliases."""

    name: str
    store: Any
    aliases: dict[str, str] = field(default_factory=dict)
    seen: dict[str, list[str]] = field(default_factory=lambda: {"ro": [], "at": [], "rs": []})

    def alias(self, real: str) -> str:
        if real not in self.aliases:
            prefix = real[:2]
            self.aliases[real] = f"{prefix}#{len(self.seen[prefix])}"
            self.seen[prefix].append(real)
        return self.aliases[real]

    def resolve(self, value: Any) -> Any:
        if isinstance(value, Ref):
            ids = self.seen[value.prefix]
            try:
                return ids[value.index]
            except IndexError:
                raise AssertionError(f"{self.name} has shown no {value.prefix} id #{value.index}") from None
        if isinstance(value, Per):
            return value.build(self)
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items()}
        return value

    # --- normalisation -------------------------------------------------------------------------------

    def norm_str(self, text: str) -> str:
        return _ID_RE.sub(lambda m: self.alias(m.group(0)), text)

    def norm(self, value: Any) -> Any:
        if isinstance(value, BaseModel):
            cls = type(value)
            fields = {name: self.norm(getattr(value, name)) for name in cls.model_fields}
            for name, extra in (value.model_extra or {}).items():
                fields[name] = self.norm(extra)
            return (f"{cls.__module__}.{cls.__qualname__}", fields)
        if isinstance(value, bool) or value is None or isinstance(value, int):
            return value
        if isinstance(value, float):
            if abs(value - T0) < _STAMP_WINDOW:
                return f"T+{value - T0:g}"
            return value
        if isinstance(value, str):
            return self.norm_str(value)
        if isinstance(value, list):
            return ("list", [self.norm(v) for v in value])
        if isinstance(value, tuple):
            return ("tuple", [self.norm(v) for v in value])
        if isinstance(value, dict):
            return ("dict", {self.norm_str(str(k)): self.norm(v) for k, v in value.items()})
        return (type(value).__qualname__, self.norm_str(repr(value)))


@dataclass(frozen=True)
class Outcome:
    """A call's normalised result: ``ok`` + value, or ``raise`` + (exception class, message)."""

    kind: str
    value: Any
    warnings: tuple[tuple[str, str], ...] = ()
    errors_logged: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    def fields(self) -> dict[str, Any]:
        """The field dict of a model result (raises on anything else)."""
        assert self.ok and isinstance(self.value, tuple) and isinstance(self.value[1], dict), self
        return self.value[1]

    def items(self) -> list[Any]:
        """The normalised items of a PaginatedResult or list result."""
        assert self.ok, self
        if self.value[0] == "list":
            return list(self.value[1])
        return list(self.fields()["items"][1])


# ERROR log lines whose text the contract fixes (§2.9); other diagnostics (upstream's "Rollout <rid> is
# running but has no attempts" while sweeping, ...) are not behaviour and are not compared.
CONTRACT_LOG_PREFIXES = ("Duplicated span added for rollout=",)


class _ErrorLogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(CONTRACT_LOG_PREFIXES):
            self.messages.append(message)


async def call_side(side: Side, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Outcome:
    """Run one store call and normalise what it returned, raised, warned and logged at ERROR."""
    real_args = side.resolve(list(args))
    real_kwargs = side.resolve(dict(kwargs))
    capture = _ErrorLogCapture()
    root = logging.getLogger()
    root.addHandler(capture)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                target = getattr(side.store, method)
                result = target(*real_args, **real_kwargs)
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    result = await result
            except Exception as exc:  # noqa: BLE001 - every error is part of the outcome
                kind, value = (
                    "raise",
                    (f"{type(exc).__module__}.{type(exc).__qualname__}", side.norm_str(str(exc))),
                )
            else:
                kind, value = "ok", side.norm(result)
    finally:
        root.removeHandler(capture)
    warned = tuple(
        (w.category.__name__, side.norm_str(str(w.message)))
        for w in caught
        if not issubclass(w.category, ResourceWarning)
    )
    # Duplicate-span lines are compared as a multiset: upstream logs them in input order, we log a
    # batch's duplicates in the order the database reports them; which spans were skipped matters.
    return Outcome(kind, value, warned, tuple(sorted(side.norm_str(m) for m in capture.messages)))


def first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two normalised values first differ, as ``path: a != b``."""
    if isinstance(a, Outcome) and isinstance(b, Outcome):
        for name in ("kind", "value", "warnings", "errors_logged"):
            if getattr(a, name) != getattr(b, name):
                return first_difference(getattr(a, name), getattr(b, name), name)
        return "none"
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key, "<missing>") != b.get(key, "<missing>"):
                return first_difference(a.get(key, "<missing>"), b.get(key, "<missing>"), f"{path}.{key}")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return first_difference(x, y, f"{path}[{index}]")
    return f"{path}: {a!r} != {b!r}"


class Divergence(AssertionError):
    """The two stores disagreed where the contract says they behave alike."""


class Differ:
    """Drives the upstream store and ours through the same calls at the same fake time."""

    def __init__(self, upstream: Any, ours: Any, clock: TickClock, *, tick: float = 1.0) -> None:
        self.up = Side("upstream", upstream)
        self.ours = Side("ours", ours)
        self.clock = clock
        self.tick = tick
        self.history: list[str] = []

    def _describe(self, method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        return f"{method}({', '.join(parts)}) @T+{self.clock.value - T0:g}"

    async def both(self, method: str, *args: Any, **kwargs: Any) -> tuple[Outcome, Outcome]:
        """Call ``method`` on both stores at the next tick; return (upstream, ours)."""
        now = self.clock.advance(self.tick)
        self.history.append(self._describe(method, args, kwargs))
        upstream = await call_side(self.up, method, args, kwargs)
        self.clock.value = now  # both calls read the same time, however long the first took
        ours = await call_side(self.ours, method, args, kwargs)
        return upstream, ours

    async def same(self, method: str, *args: Any, **kwargs: Any) -> Outcome:
        """Call ``method`` on both stores and require identical normalised outcomes."""
        upstream, ours = await self.both(method, *args, **kwargs)
        self.require_same(upstream, ours)
        return upstream

    def require_same(self, upstream: Outcome, ours: Outcome, what: str | None = None) -> None:
        if upstream != ours:
            raise Divergence(self.report(upstream, ours, what))

    def report(self, upstream: Outcome, ours: Outcome, what: str | None = None) -> str:
        lines = [f"stores diverge at {what or self.history[-1]}", "history:"]
        lines += [f"  {i}: {h}" for i, h in enumerate(self.history)]
        lines += ["upstream:", f"  {upstream}", "ours:", f"  {ours}"]
        lines += ["first difference:", f"  {first_difference(upstream, ours)}"]
        return "\n".join(lines)

    async def snapshot(self, side: Side) -> dict[str, Outcome]:
        """Everything a client can read, through the public API (reads that sweep run the same on both)."""
        state: dict[str, Outcome] = {}

        async def read(key: str, method: str, *args: Any, **kwargs: Any) -> Outcome:
            state[key] = await call_side(side, method, args, kwargs)
            return state[key]

        rollouts = await read("rollouts", "query_rollouts")
        await read("workers", "query_workers")
        await read("resources", "query_resources")
        await read("latest_resources", "get_latest_resources")
        for index in range(len(side.seen["ro"])):
            attempts = await read(f"attempts[ro#{index}]", "query_attempts", R(index))
            # Spans attempt by attempt: their order across attempts is a known difference
            # (test_query_spans_order_across_attempts).
            for attempt in attempts.items() if attempts.ok else []:
                alias = attempt[1]["attempt_id"]
                await read(f"spans[ro#{index}][{alias}]", "query_spans", R(index), A(int(alias[3:])))
        stats = await call_side(side, "statistics", (), {})
        assert stats.ok, stats
        counts = {
            k: v for k, v in stats.value[1].items() if k.startswith("total_") and k != "total_span_bytes"
        }
        state["statistics"] = Outcome("ok", counts)
        assert rollouts.ok, rollouts
        return state

    async def same_state(self, *, advance: bool = True) -> None:
        """Require every public read of both stores to agree (at one tick: the next, or the current)."""
        now = self.clock.advance(self.tick if advance else 0.0)
        self.history.append(f"<state snapshot> @T+{now - T0:g}")
        upstream = await self.snapshot(self.up)
        self.clock.value = now
        ours = await self.snapshot(self.ours)
        for key in upstream:
            self.require_same(upstream[key], ours.get(key, Outcome("missing", None)), f"state[{key}]")


# --- building inputs -------------------------------------------------------------------------------------


def span(
    rollout: Any,
    attempt: Any,
    sequence_id: int,
    span_id: str,
    *,
    name: str = "op",
    trace_id: str = "a" * 32,
    parent_id: str | None = None,
    start_time: float | None = 10.0,
    end_time: float | None = 11.0,
    attributes: dict[str, Any] | None = None,
    **extra: Any,
) -> Per:
    """An ``agl.Span`` for the given (symbolic) rollout and attempt, built with each store's ids."""

    def build(side: Side) -> agl.Span:
        rid = side.resolve(rollout)
        aid = side.resolve(attempt)
        context = agl.SpanContext(trace_id=trace_id, span_id=span_id, is_remote=False, trace_state={})
        parent = (
            agl.SpanContext(trace_id=trace_id, span_id=parent_id, is_remote=False, trace_state={})
            if parent_id is not None
            else None
        )
        return agl.Span(
            rollout_id=rid,
            attempt_id=aid,
            sequence_id=sequence_id,
            trace_id=trace_id,
            span_id=span_id,
            parent_id=parent_id,
            name=name,
            status=agl.TraceStatus(status_code="OK"),
            attributes=attributes if attributes is not None else {"k": "v", "n": sequence_id},
            events=[agl.Event(name="ev", attributes={"e": 1}, timestamp=10.5)],
            links=[],
            start_time=start_time,
            end_time=end_time,
            context=context,
            parent=parent,
            resource=agl.OtelResource(attributes={"service.name": "diff"}, schema_url=""),
            **extra,
        )

    return Per(build)


_OTEL_PROVIDER = TracerProvider()


def otel_span(name: str = "otel-op", **attributes: Any) -> ReadableSpan:
    """A real, ended opentelemetry-sdk span; the very same object is given to both stores."""
    tracer = _OTEL_PROVIDER.get_tracer("lightning_sql.tests.differential")
    with tracer.start_as_current_span("parent"):
        otel = tracer.start_span(name, attributes=attributes or {"gen_ai.system": "test"})
        otel.add_event("ev", {"n": 1})
        otel.end()
    assert isinstance(otel, ReadableSpan)
    return otel
