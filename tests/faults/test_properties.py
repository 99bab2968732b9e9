"""Property-based tests of the query methods against a pure-Python reference model (docs/operations.md).

For each generated data set (a fresh run per example, written through the store's API) and each
generated query, ``query_rollouts`` / ``query_spans`` / ``query_workers`` / ``query_resources`` must
return exactly what the reference computes from what was written: same items, same order, same
``total``.  The reference implements the contract's rules (§1.12 filters, §1.13 sorting, §2.10-2.14
pagination) directly in Python: code-point string order, NULL as +inf for ``*_time`` and as ``""``/``0``
(tied) otherwise, ties in insertion order in both directions, AND/OR pools.
Examples per test: LIGHTNING_SQL_FAULT_EXAMPLES (CI default 20).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_sql import SqlLightningStore
from tests.conftest import PG_URL, BackendSpec, require_postgres
from tests.faults.support import int_knob, make_span
from tests.helpers import pg_execute

pytestmark = pytest.mark.slow

SETTINGS = settings(
    max_examples=int_knob("LIGHTNING_SQL_FAULT_EXAMPLES", 20),
    deadline=None,
    database=None,  # no .hypothesis/ directory left in the working tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Ids and names mixing SQL/LIKE metacharacters, case, accents and non-BMP characters: code-point
# order differs from most locales' order on these.
ALPHABET = list("aAbB%_'\\ .é€😀z")
texts = st.text(alphabet=st.sampled_from(ALPHABET), min_size=1, max_size=4)
TIMES = [100.0, 200.0, 300.0]  # few values: ties are the interesting case
ROLLOUT_STATUSES = ["queuing", "preparing", "running", "failed", "succeeded", "cancelled", "requeuing"]
FINISHED = {"failed", "succeeded", "cancelled"}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Harness:
    backend: BackendSpec
    clock: Clock = field(default_factory=Clock)

    def store(self) -> SqlLightningStore:
        return self.backend.open(
            run=f"prop-{uuid.uuid4().hex[:10]}", clock=self.clock, clock_sync=False, scan_debounce_seconds=3600
        )


@pytest.fixture
def harness(mp_backend: BackendSpec) -> Iterator[Harness]:
    """One database per test; a keeper instance holds the I/O worker open across examples."""
    h = Harness(mp_backend)
    keeper = h.store()

    async def attach() -> None:
        await keeper.statistics()

    asyncio.run(attach())
    yield h
    asyncio.run(keeper.close())


def run(coro_factory: Callable[[], Any]) -> Any:
    return asyncio.run(coro_factory())


# --- the reference model -----------------------------------------------------------------------------

_NULL_AS = {"str": "", "int": 0}


def ref_sort(items: list[dict[str, Any]], sort_by: str | None, order: str, kinds: dict[str, str]) -> list[dict[str, Any]]:
    """Items are in insertion order; Python's sort is stable, also with reverse=True."""
    if sort_by is None:
        return list(items)
    kind = kinds[sort_by]
    if kind == "time":
        def key(item: dict[str, Any]) -> Any:
            value = item[sort_by]
            return (1, 0.0) if value is None else (0, value)
    else:
        def key(item: dict[str, Any]) -> Any:
            value = item[sort_by]
            return _NULL_AS[kind] if value is None else value
    return sorted(items, key=key, reverse=order == "desc")


def ref_page(items: list[Any], limit: int, offset: int) -> list[Any]:
    if limit == -1:
        return items[offset:]
    return items[offset : offset + limit]


def ref_pool(conditions: list[bool], logic: str) -> bool:
    return all(conditions) if logic == "and" else any(conditions)


def contains(value: str | None, needle: str) -> bool:
    return value is not None and needle in value


sorts = st.sampled_from(["asc", "desc"])
logics = st.sampled_from(["and", "or"])
limits = st.sampled_from([-1, 0, 1, 2, 3, 5])
offsets = st.sampled_from([0, 0, 1, 2, 4])


# --- rollouts ----------------------------------------------------------------------------------------

ROLLOUT_KINDS = {
    "rollout_id": "str", "start_time": "time", "end_time": "time", "mode": "str", "resources_id": "str",
    "status": "str", "resources_version": "int", "idempotency_key": "str",
}

rollout_specs = st.lists(
    st.fixed_dictionaries(
        {
            "mode": st.sampled_from([None, "train", "val", "test"]),
            "resources_id": st.one_of(st.none(), texts),
            "key": st.one_of(st.none(), texts),
            "start": st.sampled_from(TIMES),
            "status": st.sampled_from(ROLLOUT_STATUSES),
            "end": st.sampled_from(TIMES),
        }
    ),
    max_size=10,
    unique_by=lambda spec: spec["key"] if spec["key"] is not None else object(),
)


@st.composite
def rollout_queries(draw: st.DrawFn, ids: list[str], keys: list[str]) -> dict[str, Any]:
    pool_ids = st.sampled_from(ids + ["ro-missing0000", "ro-\x00nul"]) if ids else st.just("ro-missing0000")
    needles = st.one_of(texts, st.sampled_from([i[k : k + 3] for i in ids for k in (0, 5)] or ["ro-"]))
    return {
        "status_in": draw(st.one_of(st.none(), st.lists(st.sampled_from(ROLLOUT_STATUSES), max_size=3))),
        "rollout_id_in": draw(st.one_of(st.none(), st.lists(pool_ids, max_size=3))),
        "rollout_id_contains": draw(st.one_of(st.none(), needles)),
        "idempotency_key_in": draw(
            st.one_of(st.none(), st.lists(st.one_of(texts, st.sampled_from(keys or ["x"])), max_size=3))
        ),
        "filter_logic": draw(logics),
        "sort_by": draw(st.one_of(st.none(), st.sampled_from(sorted(ROLLOUT_KINDS)))),
        "sort_order": draw(sorts),
        "limit": draw(limits),
        "offset": draw(offsets),
    }


def ref_rollouts(data: list[dict[str, Any]], q: dict[str, Any]) -> tuple[list[str], int]:
    def match(r: dict[str, Any]) -> bool:
        conds = []
        if q["status_in"] is not None:
            conds.append(r["status"] in q["status_in"])
        if q["rollout_id_in"] is not None:
            conds.append(r["rollout_id"] in q["rollout_id_in"])
        if q["rollout_id_contains"] is not None:
            conds.append(contains(r["rollout_id"], q["rollout_id_contains"]))
        if q["idempotency_key_in"] is not None:
            conds.append(r["idempotency_key"] is not None and r["idempotency_key"] in q["idempotency_key_in"])
        return True if not conds else ref_pool(conds, q["filter_logic"])  # no conditions: everything

    hits = ref_sort([r for r in data if match(r)], q["sort_by"], q["sort_order"], ROLLOUT_KINDS)
    return [r["rollout_id"] for r in ref_page(hits, q["limit"], q["offset"])], len(hits)


@SETTINGS
@given(specs=rollout_specs, data=st.data())
def test_query_rollouts_matches_reference(harness: Harness, specs: list[dict[str, Any]], data: st.DataObject) -> None:
    async def example() -> None:
        store = harness.store()
        try:
            model: list[dict[str, Any]] = []
            for i, spec in enumerate(specs):
                harness.clock.t = spec["start"]
                r = await store.enqueue_rollout(
                    {"i": i}, mode=spec["mode"], resources_id=spec["resources_id"], idempotency_key=spec["key"]
                )
                end = None
                if spec["status"] != "queuing":
                    harness.clock.t = spec["end"]
                    await store.update_rollout(r.rollout_id, status=spec["status"])
                    end = spec["end"] if spec["status"] in FINISHED else None
                model.append(
                    {
                        "rollout_id": r.rollout_id, "start_time": spec["start"], "end_time": end,
                        "mode": spec["mode"], "resources_id": spec["resources_id"], "status": spec["status"],
                        "resources_version": None, "idempotency_key": spec["key"],
                    }
                )
            ids = [m["rollout_id"] for m in model]
            keys = [m["idempotency_key"] for m in model if m["idempotency_key"] is not None]
            for q in data.draw(st.lists(rollout_queries(ids, keys), min_size=1, max_size=6)):
                got = await store.query_rollouts(**q)
                expected_ids, total = ref_rollouts(model, q)
                assert [r.rollout_id for r in got.items] == expected_ids, q
                assert (got.total, got.limit, got.offset) == (total, q["limit"], q["offset"]), q
                by_id = {m["rollout_id"]: m for m in model}
                for r in got.items:
                    m = by_id[r.rollout_id]
                    assert (r.status, r.mode, r.resources_id, r.idempotency_key, r.start_time, r.end_time) == (
                        m["status"], m["mode"], m["resources_id"], m["idempotency_key"], m["start_time"], m["end_time"]
                    )
        finally:
            await store.close()

    run(example)


# --- spans -------------------------------------------------------------------------------------------

SPAN_KINDS = {
    "rollout_id": "str", "attempt_id": "str", "sequence_id": "int", "trace_id": "str", "span_id": "str",
    "parent_id": "str", "name": "str", "start_time": "time", "end_time": "time",
}
TRACE_IDS = ["0" * 31 + "1", "ab" * 16, "a" * 32]
span_specs = st.lists(
    st.fixed_dictionaries(
        {
            "slot": st.integers(0, 2),  # (rollout 0, attempt 1), (rollout 0, attempt 2), (rollout 1, attempt 1)
            "sequence_id": st.integers(0, 3),
            "name": texts,
            "trace_id": st.sampled_from(TRACE_IDS),
            "parent": st.one_of(st.none(), st.integers(0, 20)),
            "start": st.one_of(st.none(), st.sampled_from(TIMES)),
            "end": st.one_of(st.none(), st.sampled_from(TIMES)),
        }
    ),
    max_size=12,
)


@st.composite
def span_queries(draw: st.DrawFn, rollouts: list[str], attempts: list[str], model: list[dict[str, Any]]) -> dict[str, Any]:
    values = {k: [m[k] for m in model if m[k] is not None] for k in ("trace_id", "span_id", "parent_id", "name")}
    q: dict[str, Any] = {
        "rollout_id": draw(st.sampled_from(rollouts + ["ro-missing0000"])),
        "attempt_id": draw(st.sampled_from([None, "latest", "at-missing0", *attempts])),
        "filter_logic": draw(logics),
        "sort_by": draw(st.sampled_from([None, "sequence_id", *sorted(SPAN_KINDS)])),
        "sort_order": draw(sorts),
        "limit": draw(limits),
        "offset": draw(offsets),
    }
    for name in ("trace_id", "span_id", "parent_id", "name"):
        pool = values[name] or ["zz"]
        q[name] = draw(st.one_of(st.none(), st.none(), st.sampled_from(pool), texts))
        q[name + "_contains"] = draw(
            st.one_of(st.none(), st.none(), st.sampled_from([v[1:3] or v for v in pool]), texts)
        )
    return q


def ref_spans(model: list[dict[str, Any]], latest: dict[str, str], q: dict[str, Any]) -> tuple[list[str], int]:
    def match(sp: dict[str, Any]) -> bool:
        if sp["rollout_id"] != q["rollout_id"]:
            return False
        if q["attempt_id"] == "latest":
            if latest.get(q["rollout_id"]) != sp["attempt_id"]:
                return False
        elif q["attempt_id"] is not None and sp["attempt_id"] != q["attempt_id"]:
            return False
        conds = []
        for name in ("trace_id", "span_id", "parent_id", "name"):
            if q[name] is not None:
                conds.append(sp[name] is not None and sp[name] == q[name])
            if q[name + "_contains"] is not None:
                conds.append(contains(sp[name], q[name + "_contains"]))
        return ref_pool(conds, q["filter_logic"])  # the pool always applies: OR over nothing is false

    hits = ref_sort([sp for sp in model if match(sp)], q["sort_by"], q["sort_order"], SPAN_KINDS)
    return [sp["span_id"] for sp in ref_page(hits, q["limit"], q["offset"])], len(hits)


@SETTINGS
@given(specs=span_specs, data=st.data())
def test_query_spans_matches_reference(harness: Harness, specs: list[dict[str, Any]], data: st.DataObject) -> None:
    async def example() -> None:
        store = harness.store()
        try:
            r0, r1 = await store.enqueue_many_rollouts([{"input": 0}, {"input": 1}])
            a01 = await store.dequeue_rollout()
            a11 = await store.dequeue_rollout()
            a02 = await store.start_attempt(r0.rollout_id)
            assert a01 is not None and a11 is not None
            slots = [
                (r0.rollout_id, a01.attempt.attempt_id),
                (r0.rollout_id, a02.attempt.attempt_id),
                (r1.rollout_id, a11.attempt.attempt_id),
            ]
            model: list[dict[str, Any]] = []
            for i, spec in enumerate(specs):
                rid, aid = slots[spec["slot"]]
                span_id = f"{i:016x}"
                parent = f"{spec['parent']:016x}" if spec["parent"] is not None else None
                span = make_span(rid, aid, spec["sequence_id"], name=spec["name"])
                span = span.model_copy(
                    update={
                        "span_id": span_id, "trace_id": spec["trace_id"], "parent_id": parent,
                        "start_time": spec["start"], "end_time": spec["end"],
                    }
                )
                assert await store.add_span(span) is span
                model.append(
                    {
                        "rollout_id": rid, "attempt_id": aid, "sequence_id": spec["sequence_id"],
                        "trace_id": spec["trace_id"], "span_id": span_id, "parent_id": parent,
                        "name": spec["name"], "start_time": spec["start"], "end_time": spec["end"],
                    }
                )
            latest = {r0.rollout_id: a02.attempt.attempt_id, r1.rollout_id: a11.attempt.attempt_id}
            rollouts = [r0.rollout_id, r1.rollout_id]
            attempts = [aid for _, aid in slots]
            for q in data.draw(st.lists(span_queries(rollouts, attempts, model), min_size=1, max_size=6)):
                got = await store.query_spans(**q)
                expected, total = ref_spans(model, latest, q)
                assert [sp.span_id for sp in got.items] == expected, q
                assert got.total == total, q
        finally:
            await store.close()

    run(example)


# --- workers -----------------------------------------------------------------------------------------

WORKER_KINDS = {
    "worker_id": "str", "status": "str", "last_heartbeat_time": "time", "last_dequeue_time": "time",
    "last_busy_time": "time", "last_idle_time": "time", "current_rollout_id": "str", "current_attempt_id": "str",
}
worker_specs = st.lists(
    st.fixed_dictionaries({"id": texts, "how": st.sampled_from(["heartbeat", "idle", "claim"]), "t": st.sampled_from(TIMES)}),
    max_size=8,
    unique_by=lambda spec: spec["id"],
)


@st.composite
def worker_queries(draw: st.DrawFn, ids: list[str]) -> dict[str, Any]:
    return {
        "status_in": draw(st.one_of(st.none(), st.lists(st.sampled_from(["idle", "busy", "unknown"]), max_size=2))),
        "worker_id_contains": draw(st.one_of(st.none(), texts, st.sampled_from([i[:2] for i in ids] or ["a"]))),
        "filter_logic": draw(logics),
        "sort_by": draw(st.one_of(st.none(), st.sampled_from(sorted(WORKER_KINDS)))),
        "sort_order": draw(sorts),
        "limit": draw(limits),
        "offset": draw(offsets),
    }


def ref_workers(model: list[dict[str, Any]], q: dict[str, Any]) -> tuple[list[str], int]:
    def match(w: dict[str, Any]) -> bool:
        conds = []
        if q["status_in"] is not None:
            conds.append(w["status"] in q["status_in"])
        if q["worker_id_contains"] is not None:
            conds.append(contains(w["worker_id"], q["worker_id_contains"]))
        return True if not conds else ref_pool(conds, q["filter_logic"])

    hits = ref_sort([w for w in model if match(w)], q["sort_by"], q["sort_order"], WORKER_KINDS)
    return [w["worker_id"] for w in ref_page(hits, q["limit"], q["offset"])], len(hits)


@SETTINGS
@given(specs=worker_specs, data=st.data())
def test_query_workers_matches_reference(harness: Harness, specs: list[dict[str, Any]], data: st.DataObject) -> None:
    async def example() -> None:
        store = harness.store()
        try:
            model: list[dict[str, Any]] = []
            for spec in specs:
                harness.clock.t = spec["t"]
                w = dict.fromkeys(WORKER_KINDS)
                w["worker_id"] = spec["id"]
                if spec["how"] == "heartbeat":
                    await store.update_worker(spec["id"])
                    w.update(status="unknown", last_heartbeat_time=spec["t"])
                elif spec["how"] == "idle":
                    assert await store.dequeue_rollout(worker_id=spec["id"]) is None
                    w.update(status="idle", last_idle_time=spec["t"], last_dequeue_time=spec["t"])
                else:
                    await store.enqueue_rollout({"for": spec["id"]})
                    claimed = await store.dequeue_rollout(worker_id=spec["id"])
                    assert claimed is not None
                    w.update(
                        status="busy", last_busy_time=spec["t"], last_dequeue_time=spec["t"],
                        current_rollout_id=claimed.rollout_id, current_attempt_id=claimed.attempt.attempt_id,
                    )
                model.append(w)
            ids = [w["worker_id"] for w in model]
            for q in data.draw(st.lists(worker_queries(ids), min_size=1, max_size=6)):
                got = await store.query_workers(**q)
                expected, total = ref_workers(model, q)
                assert [w.worker_id for w in got.items] == expected, q
                assert got.total == total, q
                by_id = {w["worker_id"]: w for w in model}
                for w in got.items:
                    assert w.model_dump(include=set(WORKER_KINDS)) == by_id[w.worker_id]
        finally:
            await store.close()

    run(example)


# --- resources ---------------------------------------------------------------------------------------

RESOURCES_KINDS = {"resources_id": "str", "create_time": "time", "update_time": "time", "version": "int"}
resources_ops = st.lists(st.tuples(texts, st.sampled_from(TIMES)), max_size=12)


@st.composite
def resources_queries(draw: st.DrawFn, ids: list[str]) -> dict[str, Any]:
    return {
        "resources_id": draw(st.one_of(st.none(), texts, st.sampled_from(ids or ["a"]))),
        "resources_id_contains": draw(st.one_of(st.none(), texts, st.sampled_from([i[:2] for i in ids] or ["a"]))),
        "sort_by": draw(st.one_of(st.none(), st.sampled_from(sorted(RESOURCES_KINDS)))),
        "sort_order": draw(sorts),
        "limit": draw(limits),
        "offset": draw(offsets),
    }


def ref_resources(model: list[dict[str, Any]], q: dict[str, Any]) -> tuple[list[str], int]:
    def match(r: dict[str, Any]) -> bool:  # always AND-ed (no filter_logic)
        if q["resources_id"] is not None and r["resources_id"] != q["resources_id"]:
            return False
        return q["resources_id_contains"] is None or contains(r["resources_id"], q["resources_id_contains"])

    hits = ref_sort([r for r in model if match(r)], q["sort_by"], q["sort_order"], RESOURCES_KINDS)
    return [r["resources_id"] for r in ref_page(hits, q["limit"], q["offset"])], len(hits)


@SETTINGS
@given(ops=resources_ops, data=st.data())
def test_query_resources_matches_reference(harness: Harness, ops: list[tuple[str, float]], data: st.DataObject) -> None:
    async def example() -> None:
        store = harness.store()
        try:
            model: dict[str, dict[str, Any]] = {}  # insertion order = first creation
            for rid, t in ops:
                harness.clock.t = t
                update = await store.update_resources(rid, {})
                entry = model.setdefault(rid, {"resources_id": rid, "create_time": t, "version": 0})
                entry.update(version=entry["version"] + 1, update_time=t)
                assert (update.version, update.create_time, update.update_time) == (
                    entry["version"], entry["create_time"], t
                )
            items = list(model.values())
            for q in data.draw(st.lists(resources_queries(list(model)), min_size=1, max_size=6)):
                got = await store.query_resources(**q)
                expected, total = ref_resources(items, q)
                assert [r.resources_id for r in got.items] == expected, q
                assert got.total == total, q
        finally:
            await store.close()

    run(example)


# --- string order does not depend on the database's default collation --------------------------------


@pytest.mark.postgres
def test_span_names_sort_by_code_point_under_a_locale_collation() -> None:
    """A database whose default collation is ICU en-US still sorts every string field by code point."""
    require_postgres()
    dbname = f"lsql_icu_{uuid.uuid4().hex[:8]}"

    asyncio.run(pg_execute(PG_URL, f"CREATE DATABASE {dbname} TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"))
    try:
        url = PG_URL.rsplit("/", 1)[0] + f"/{dbname}"
        names = ["a", "B", "_x", "b"]

        async def example() -> list[str]:
            store = SqlLightningStore(url, run="icu", clock_sync=False)
            try:
                await store.enqueue_rollout({})
                claimed = await store.dequeue_rollout()
                assert claimed is not None
                for i, name in enumerate(names):
                    await store.add_span(make_span(claimed.rollout_id, claimed.attempt.attempt_id, i, name=name))
                return [s.name for s in await store.query_spans(claimed.rollout_id, sort_by="name")]
            finally:
                await store.close()

        assert asyncio.run(example()) == sorted(names)
    finally:
        asyncio.run(pg_execute(PG_URL, f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)"))
