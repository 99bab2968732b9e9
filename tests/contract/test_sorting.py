"""Contract §1.13: sorting — exact errors, NULL placement, stable ties, code-point order (every backend)."""

from __future__ import annotations

import pytest

from tests.contract.test_spans import make_span


async def _queries(store):
    ar = await store.start_rollout(1)
    rid = ar.rollout_id
    return {
        "Rollout": lambda **kw: store.query_rollouts(**kw),
        "Attempt": lambda **kw: store.query_attempts(rid, **kw),
        "Span": lambda **kw: store.query_spans(rid, **kw),
        "ResourcesUpdate": lambda **kw: store.query_resources(**kw),
        "Worker": lambda **kw: store.query_workers(**kw),
    }


async def test_unknown_sort_field_exact_message_even_when_nothing_matches(store):
    # Nothing in the run matches anything (no spans, resources or workers; no rollout with this id).
    for model, call in (await _queries(store)).items():
        with pytest.raises(ValueError) as e:
            await call(sort_by="nope")
        assert str(e.value) == f"Failed to sort items by 'nope': field does not exist on {model}"
    with pytest.raises(ValueError) as e:
        await store.query_rollouts(rollout_id_in=[], sort_by="bogus_field")
    assert str(e.value) == "Failed to sort items by 'bogus_field': field does not exist on Rollout"
    with pytest.raises(ValueError) as e:
        await store.query_spans("ro-missing", sort_by="nope")
    assert str(e.value) == "Failed to sort items by 'nope': field does not exist on Span"


NON_SCALAR = [
    ("Rollout", "input"),
    ("Rollout", "config"),
    ("Rollout", "metadata"),
    ("Attempt", "metadata"),
    ("Span", "attributes"),
    ("Span", "status"),
    ("Span", "events"),
    ("Span", "resource"),
    ("ResourcesUpdate", "resources"),
    ("Worker", "heartbeat_stats"),
]


async def test_non_scalar_sort_field_is_rejected_naming_it(store):
    queries = await _queries(store)
    for model, field in NON_SCALAR:
        with pytest.raises(ValueError, match=f"'{field}'") as e:
            await queries[model](sort_by=field)
        assert "does not exist" not in str(e.value), (model, field)


async def test_bad_sort_order_names_the_value(store):
    for call in (await _queries(store)).values():
        with pytest.raises(ValueError, match="sideways"):
            await call(sort_by=None, sort_order="sideways")


async def test_time_fields_sort_null_as_infinity(store, clock):
    rids = []
    for i in range(4):
        clock.set(1_800_000_000.0 + 10 * i)
        rids.append((await store.enqueue_rollout(i)).rollout_id)
    # end_time: rids[1] at t=100, rids[3] at t=50, the others NULL.
    clock.set(1_800_000_100.0)
    await store.update_rollout(rids[1], status="failed")
    clock.set(1_800_000_050.0)
    await store.update_rollout(rids[3], status="succeeded")
    asc = [r.rollout_id for r in await store.query_rollouts(sort_by="end_time")]
    assert asc == [rids[3], rids[1], rids[0], rids[2]]  # NULLs last, tied in insertion order
    desc = [r.rollout_id for r in await store.query_rollouts(sort_by="end_time", sort_order="desc")]
    assert desc == [rids[0], rids[2], rids[1], rids[3]]  # NULLs first, still in insertion order
    # start_time (never NULL) desc.
    desc = [r.rollout_id for r in await store.query_rollouts(sort_by="start_time", sort_order="desc")]
    assert desc == rids[::-1]


async def test_other_fields_sort_null_as_empty_string_tied_with_real_empty(store):
    r_none1 = await store.enqueue_rollout(0, resources_id=None)  # no resources in the run: stays NULL
    r_b = await store.enqueue_rollout(1, resources_id="b")
    r_empty = await store.enqueue_rollout(2, resources_id="")
    r_none2 = await store.enqueue_rollout(3, resources_id=None)
    r_a = await store.enqueue_rollout(4, resources_id="a")
    assert r_none1.resources_id is None and r_empty.resources_id == ""
    asc = [r.rollout_id for r in await store.query_rollouts(sort_by="resources_id")]
    assert asc == [r_none1.rollout_id, r_empty.rollout_id, r_none2.rollout_id, r_a.rollout_id, r_b.rollout_id]
    desc = [r.rollout_id for r in await store.query_rollouts(sort_by="resources_id", sort_order="desc")]
    assert desc == [
        r_b.rollout_id,
        r_a.rollout_id,
        r_none1.rollout_id,
        r_empty.rollout_id,
        r_none2.rollout_id,
    ]


async def test_attempt_worker_id_null_ties_with_empty_string(store):
    ar = await store.start_rollout(1, worker_id="w")
    rid = ar.rollout_id
    a2 = await store.start_attempt(rid)  # worker None
    a3 = await store.start_attempt(rid, worker_id="")
    a4 = await store.start_attempt(rid, worker_id="a")
    got = [a.sequence_id for a in await store.query_attempts(rid, sort_by="worker_id")]
    assert got == [2, 3, 4, 1]
    got = [a.sequence_id for a in await store.query_attempts(rid, sort_by="worker_id", sort_order="desc")]
    assert got == [1, 4, 2, 3]
    assert a2.attempt.worker_id is None and a3.attempt.worker_id == "" and a4.attempt.worker_id == "a"


async def test_worker_null_fields_and_time_fields(store, clock):
    await store.update_worker("w-a")  # never dequeued: last_dequeue_time NULL, current_rollout_id NULL
    clock.advance(1)
    await store.dequeue_rollout(worker_id="w-b")  # empty queue -> idle, last_dequeue_time set
    clock.advance(1)
    r = await store.enqueue_rollout(1)
    await store.dequeue_rollout(worker_id="w-c")  # busy, current_rollout_id set
    await store.update_worker("w-d")
    asc = [w.worker_id for w in await store.query_workers(sort_by="last_dequeue_time")]
    assert asc == ["w-b", "w-c", "w-a", "w-d"]
    desc = [w.worker_id for w in await store.query_workers(sort_by="last_dequeue_time", sort_order="desc")]
    assert desc == ["w-a", "w-d", "w-c", "w-b"]
    asc = [w.worker_id for w in await store.query_workers(sort_by="current_rollout_id")]
    assert asc == ["w-a", "w-b", "w-d", "w-c"]
    desc = [w.worker_id for w in await store.query_workers(sort_by="current_rollout_id", sort_order="desc")]
    assert desc == ["w-c", "w-a", "w-b", "w-d"]
    assert (await store.get_worker_by_id("w-c")).current_rollout_id == r.rollout_id


async def test_ties_keep_insertion_order_in_both_directions(store):
    # All rollouts share start_time (the fake clock does not move) and pairs share a status.
    rids = [(await store.enqueue_rollout(i)).rollout_id for i in range(6)]
    for rid in rids[::2]:
        await store.update_rollout(rid, status="failed")
    for order in ("asc", "desc"):
        got = [r.rollout_id for r in await store.query_rollouts(sort_by="start_time", sort_order=order)]
        assert got == rids, order
    asc = [r.rollout_id for r in await store.query_rollouts(sort_by="status")]
    assert asc == [rids[0], rids[2], rids[4], rids[1], rids[3], rids[5]]  # failed < queuing
    desc = [r.rollout_id for r in await store.query_rollouts(sort_by="status", sort_order="desc")]
    assert desc == [rids[1], rids[3], rids[5], rids[0], rids[2], rids[4]]
    # Spans: equal sequence ids keep insertion order both ways.
    ar = await store.start_rollout(1)
    spans = [make_span(ar.rollout_id, ar.attempt.attempt_id, 1 + i % 2, name=f"s{i}") for i in range(6)]
    await store.add_many_spans(spans)
    asc = [s.name for s in await store.query_spans(ar.rollout_id)]
    assert asc == ["s0", "s2", "s4", "s1", "s3", "s5"]
    desc = [s.name for s in await store.query_spans(ar.rollout_id, sort_order="desc")]
    assert desc == ["s1", "s3", "s5", "s0", "s2", "s4"]


async def test_strings_sort_by_code_point(store):
    keys = ["b", "B", "a", "Z", "_x", "aa", "é", "😀", "A b", "a-", "Ä"]
    for key in keys:
        await store.update_resources(key, {})
        await store.update_worker(key)
    expected = sorted(keys)  # Python compares str by code point
    assert expected[:3] == ["A b", "B", "Z"]
    assert [r.resources_id for r in await store.query_resources(sort_by="resources_id")] == expected
    assert [w.worker_id for w in await store.query_workers(sort_by="worker_id")] == expected
    assert [
        w.worker_id for w in await store.query_workers(sort_by="worker_id", sort_order="desc")
    ] == expected[::-1]
    # Base order (sort_by=None) is creation order.
    assert [r.resources_id for r in await store.query_resources()] == keys
    assert [w.worker_id for w in await store.query_workers()] == keys


async def test_sort_by_every_scalar_field_works(store):
    ar = await store.start_rollout(1, worker_id="w")
    await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 1))
    await store.add_resources({})
    fields = {
        "query_rollouts": (
            lambda **kw: store.query_rollouts(**kw),
            ["rollout_id", "start_time", "end_time", "mode", "resources_id", "status"],
        ),
        "query_attempts": (
            lambda **kw: store.query_attempts(ar.rollout_id, **kw),
            [
                "rollout_id",
                "attempt_id",
                "sequence_id",
                "start_time",
                "end_time",
                "status",
                "worker_id",
                "last_heartbeat_time",
            ],
        ),
        "query_spans": (
            lambda **kw: store.query_spans(ar.rollout_id, **kw),
            [
                "rollout_id",
                "attempt_id",
                "sequence_id",
                "trace_id",
                "span_id",
                "parent_id",
                "name",
                "start_time",
                "end_time",
            ],
        ),
        "query_resources": (
            lambda **kw: store.query_resources(**kw),
            ["resources_id", "create_time", "update_time", "version"],
        ),
        "query_workers": (
            lambda **kw: store.query_workers(**kw),
            [
                "worker_id",
                "status",
                "last_heartbeat_time",
                "last_dequeue_time",
                "last_busy_time",
                "last_idle_time",
                "current_rollout_id",
                "current_attempt_id",
            ],
        ),
    }
    for name, (call, sortable) in fields.items():
        for field in sortable:
            for order in ("asc", "desc"):
                assert len(await call(sort_by=field, sort_order=order)) == 1, (name, field)


async def test_int_field_sorts_null_as_zero(store):
    r_none = await store.enqueue_rollout(0)  # no resources yet: resources_version NULL
    await store.update_resources("r", {})
    await store.update_resources("r", {})
    r_two = await store.enqueue_rollout(1)  # version 2
    r_none2 = await store.enqueue_rollout(2, resources_id="missing")  # NULL again
    await store.update_resources("q", {})
    r_one = await store.enqueue_rollout(3)  # "q" version 1
    assert [r.resources_version for r in (r_none, r_two, r_none2, r_one)] == [None, 2, None, 1]
    asc = [r.rollout_id for r in await store.query_rollouts(sort_by="resources_version")]
    assert asc == [r_none.rollout_id, r_none2.rollout_id, r_one.rollout_id, r_two.rollout_id]
    desc = [r.rollout_id for r in await store.query_rollouts(sort_by="resources_version", sort_order="desc")]
    assert desc == [r_two.rollout_id, r_one.rollout_id, r_none.rollout_id, r_none2.rollout_id]


@pytest.mark.parametrize("backend", ["sqlite_file", "sqlite_memory"], indirect=True)
async def test_a_span_page_in_sequence_order_reads_the_index_in_order(store):
    """A NOT NULL sort key has no NULL to place: sorted as the plain column, SQLite reads the span
    index (run, rollout, attempt, sequence_id) in order instead of sorting the rows it found
    ("USE TEMP B-TREE FOR ORDER BY" with the NULL-placing expression)."""
    from lightning_sql.store.sql import dialect, spans

    ar = await store.start_rollout(1)
    for seq in (3, 1, 2):
        await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, seq, name=f"s{seq}"))
    shape = (True, "latest", (None,) * 4, (None,) * 4, "and", "sequence_id", "asc", False, False)

    def plan(ctx, run_id, _now):
        page, _count = spans.read_statements("sqlite", shape, True)
        compiled = page.compile(dialect=ctx.conn.dialect)
        key_row = (ar.rollout_id, "", *[""] * 8)
        given = {"run_id": run_id, **dialect.keys_params("sqlite", "q", spans.READ_KEYS, [key_row], single=True)}
        values = compiled.construct_params(given)
        params = tuple(values[name] for name in compiled.positiontup)
        return [row[-1] for row in ctx.conn.exec_driver_sql("EXPLAIN QUERY PLAN " + str(compiled), params)]

    details = await store._call("test", plan, write=False)
    assert any("USING INDEX ix_spans_run_id_rollout_id_attempt_id_sequence_id_id" in line for line in details), details
    assert not any("TEMP B-TREE" in line for line in details), details
    got = await store.query_spans(ar.rollout_id, "latest")
    assert [s.sequence_id for s in got] == [1, 2, 3]
