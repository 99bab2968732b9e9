"""Contract §1.11, §1.12, §2.10, §2.11: PaginatedResult, filters, span/rollout/attempt reads, pagination.

Also: no N+1 — ``query_rollouts`` issues a bounded number of SQL statements whatever the number of rows.
"""

from __future__ import annotations

import warnings

import pytest
from sqlalchemy import Engine, event

from lightning_sql import Attempt, AttemptedRollout, EnqueueRolloutRequest, PaginatedResult, Rollout, Span
from tests.contract.test_spans import make_span

# --- PaginatedResult from the store (§1.11) ----------------------------------------------------


async def test_paginated_result_shape_from_every_query_method(store):
    ar = await store.start_rollout({"x": 1})
    await store.add_span(make_span(ar.rollout_id, ar.attempt.attempt_id, 1))
    await store.add_resources({})
    await store.update_worker("w1")
    for result, model in (
        (await store.query_rollouts(), AttemptedRollout),
        (await store.query_attempts(ar.rollout_id), Attempt),
        (await store.query_spans(ar.rollout_id), Span),
        (await store.query_resources(), object),
        (await store.query_workers(), object),
    ):
        assert isinstance(result, PaginatedResult)
        assert (result.limit, result.offset, result.total, len(result)) == (-1, 0, 1, 1)
        assert isinstance(result[0], model)
        assert list(result) == list(result.items)
        assert result[0:5] == list(result.items) and isinstance(result[0:5], list)
        assert repr(result) == f"<PaginatedResult (0: of 1) {result.items[0]!r}>"


async def test_paginated_result_repr_and_len_vs_total(store):
    for i in range(3):
        await store.enqueue_rollout(i)
    page = await store.query_rollouts(limit=2, offset=1)
    assert len(page) == 2 and page.total == 3
    assert repr(page) == f"<PaginatedResult (1:3 of 3) [{page.items[0]!r}, ...]>"
    empty = await store.query_rollouts(limit=0)
    assert len(empty) == 0 and empty.total == 3
    assert repr(empty) == "<PaginatedResult (0:0 of 3) empty>"


# --- query_rollouts, filters (§1.12, §2.11) ----------------------------------------------------


async def _three_rollouts(store):
    a = await store.enqueue_rollout("a", idempotency_key="key-a")
    b = await store.enqueue_rollout("b", idempotency_key="key-b")
    c = await store.enqueue_rollout("c")
    await store.dequeue_rollout()  # a -> preparing
    await store.update_rollout(c.rollout_id, status="succeeded")
    return a, b, c


def ids(result) -> list[str]:
    return [r.rollout_id for r in result]


async def test_query_rollouts_filters_and_logic(store):
    a, b, c = await _three_rollouts(store)
    all_ids = [a.rollout_id, b.rollout_id, c.rollout_id]
    assert ids(await store.query_rollouts()) == all_ids  # base order = insertion order
    assert ids(await store.query_rollouts(filter_logic="or")) == all_ids  # no conditions -> everything
    assert ids(await store.query_rollouts(status_in=["queuing", "succeeded"])) == [b.rollout_id, c.rollout_id]
    assert ids(await store.query_rollouts(rollout_id_in=[c.rollout_id, a.rollout_id, "ro-nope"])) == [
        a.rollout_id,
        c.rollout_id,
    ]
    assert ids(await store.query_rollouts(rollout_id_contains=b.rollout_id[3:9])) == [b.rollout_id]
    assert ids(await store.query_rollouts(idempotency_key_in=["key-b", "key-zzz"])) == [b.rollout_id]
    # AND of several conditions.
    assert ids(
        await store.query_rollouts(status_in=["preparing"], rollout_id_in=[a.rollout_id, b.rollout_id])
    ) == [a.rollout_id]
    assert ids(await store.query_rollouts(status_in=["queuing"], rollout_id_in=[a.rollout_id])) == []
    # OR pools every condition, several on one field included.
    got = await store.query_rollouts(
        status_in=["succeeded"],
        rollout_id_in=[a.rollout_id],
        rollout_id_contains=b.rollout_id,
        filter_logic="or",
    )
    assert ids(got) == all_ids
    got = await store.query_rollouts(status_in=["succeeded"], idempotency_key_in=["key-a"], filter_logic="or")
    assert ids(got) == [a.rollout_id, c.rollout_id]


async def test_query_rollouts_empty_lists_are_always_false(store):
    a, b, c = await _three_rollouts(store)
    assert ids(await store.query_rollouts(status_in=[])) == []
    assert ids(await store.query_rollouts(rollout_id_in=[])) == []
    assert ids(await store.query_rollouts(idempotency_key_in=[])) == []
    # In "or" mode an empty list contributes false, the other members still match.
    assert ids(await store.query_rollouts(status_in=[], rollout_id_in=[b.rollout_id], filter_logic="or")) == [
        b.rollout_id
    ]
    assert ids(await store.query_rollouts(status_in=[], filter_logic="or")) == []
    # A rollout without a key never matches idempotency_key_in.
    assert c.rollout_id not in ids(await store.query_rollouts(idempotency_key_in=["", "key-a"]))


async def test_query_rollouts_contains_is_case_sensitive_substring(store):
    r = await store.enqueue_rollout(1)
    assert ids(await store.query_rollouts(rollout_id_contains="ro-")) == [r.rollout_id]
    assert ids(await store.query_rollouts(rollout_id_contains="RO-")) == []
    assert ids(await store.query_rollouts(rollout_id_contains="")) == [r.rollout_id]


async def test_query_rollouts_items_carry_latest_attempt(store):
    plain = await store.enqueue_rollout("plain")
    started = await store.start_rollout("started")
    second = await store.start_attempt(started.rollout_id)
    by_id = {r.rollout_id: r for r in await store.query_rollouts()}
    assert type(by_id[plain.rollout_id]) is Rollout
    assert not hasattr(by_id[plain.rollout_id], "attempt")
    got = by_id[started.rollout_id]
    assert type(got) is AttemptedRollout
    assert got.attempt == second.attempt and got.attempt.sequence_id == 2
    assert await store.get_rollout_by_id(started.rollout_id) == got
    assert type(await store.get_rollout_by_id(plain.rollout_id)) is Rollout
    assert await store.get_rollout_by_id("ro-missing") is None


async def test_deprecated_query_rollouts_arguments(store):
    a, b, c = await _three_rollouts(store)
    with pytest.warns(DeprecationWarning):
        assert ids(await store.query_rollouts(status=["succeeded"])) == [c.rollout_id]
    with pytest.warns(DeprecationWarning):
        assert ids(await store.query_rollouts(rollout_ids=[b.rollout_id])) == [b.rollout_id]
    # The new parameter wins when both are given, and then the unused alias is not warned about
    # (upstream's behaviour, checked against it by tests/contrib/test_differential.py).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ids(await store.query_rollouts(status=["succeeded"], status_in=["queuing"])) == [b.rollout_id]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await store.query_rollouts(status_in=["queuing"])


# --- pagination (§2.11) --------------------------------------------------------------------------


async def test_pagination_rules_on_every_query_method(store):
    rids = [(await store.start_rollout(i)).rollout_id for i in range(5)]
    rid = rids[0]
    for _ in range(4):
        await store.start_attempt(rid)
    aid = (await store.get_latest_attempt(rid)).attempt_id
    for i in range(5):
        await store.add_span(make_span(rid, aid, i + 1))
        await store.update_resources(f"res-{i}", {})
        await store.update_worker(f"w-{i}")
    methods = {
        "query_rollouts": lambda **kw: store.query_rollouts(**kw),
        "query_attempts": lambda **kw: store.query_attempts(rid, **kw),
        "query_spans": lambda **kw: store.query_spans(rid, **kw),
        "query_resources": lambda **kw: store.query_resources(**kw),
        "query_workers": lambda **kw: store.query_workers(**kw),
    }
    for name, call in methods.items():
        full = await call()
        assert full.total == len(full) == 5, name
        page = await call(limit=2, offset=1)
        assert (page.limit, page.offset, page.total) == (2, 1, 5), name
        assert list(page) == list(full)[1:3], name
        zero = await call(limit=0)
        assert (len(zero), zero.total, zero.limit) == (0, 5, 0), name
        past = await call(limit=3, offset=10)
        assert (len(past), past.total, past.offset) == (0, 5, 10), name
        tail = await call(limit=-1, offset=3)
        assert list(tail) == list(full)[3:] and tail.total == 5, name
        with pytest.raises(ValueError, match="limit"):
            await call(limit=-2)
        with pytest.raises(ValueError, match="offset"):
            await call(offset=-1)


async def test_span_pages_at_offsets_make_up_the_whole_order(store):
    """Pages at offsets concatenate to the whole result in every order, ties in insertion order
    (on PostgreSQL a page at an offset reads its ids first: docs/adr/0010-span-pages-follow-the-index.md)."""
    ar = await store.start_rollout(1)
    rid, aid = ar.rollout_id, ar.attempt.attempt_id
    await store.add_many_spans(
        [make_span(rid, aid, 1 + k // 3, span_id=f"s{k}", name=f"n{k % 4}") for k in range(23)]
    )
    orders = [
        ("sequence_id", "asc"),
        ("sequence_id", "desc"),
        ("name", "asc"),
        ("start_time", "desc"),
        (None, "asc"),
    ]
    for sort_by, order in orders:
        whole = [s.span_id for s in await store.query_spans(rid, sort_by=sort_by, sort_order=order)]
        assert sorted(whole) == sorted(f"s{k}" for k in range(23))
        for size in (1, 4, 10):
            pages: list[str] = []
            for offset in range(0, 25, size):
                page = await store.query_spans(
                    rid, "latest", limit=size, offset=offset, sort_by=sort_by, sort_order=order
                )
                assert (page.total, page.offset, page.limit) == (23, offset, size)
                pages += [s.span_id for s in page]
            assert pages == whole, (sort_by, order, size)
        tail = await store.query_spans(rid, offset=20, sort_by=sort_by, sort_order=order)  # no limit
        assert [s.span_id for s in tail] == whole[20:]
    named = [s.span_id for s in await store.query_spans(rid, name="n1")]
    assert named == ["s1", "s5", "s9", "s13", "s17", "s21"]
    assert [s.span_id for s in await store.query_spans(rid, name="n1", limit=2, offset=1)] == named[1:3]
    assert [s.span_id for s in await store.query_spans(rid, name="n1", offset=6)] == []


# --- query_attempts, get_latest_attempt ------------------------------------------------------------


async def test_query_attempts_and_latest(store):
    ar = await store.start_rollout(1)
    a2 = await store.start_attempt(ar.rollout_id)
    a3 = await store.start_attempt(ar.rollout_id)
    got = await store.query_attempts(ar.rollout_id)
    assert [a.sequence_id for a in got] == [1, 2, 3]
    assert [a.attempt_id for a in got] == [
        ar.attempt.attempt_id,
        a2.attempt.attempt_id,
        a3.attempt.attempt_id,
    ]
    assert [a.sequence_id for a in await store.query_attempts(ar.rollout_id, sort_order="desc")] == [3, 2, 1]
    assert await store.get_latest_attempt(ar.rollout_id) == a3.attempt
    empty = await store.query_attempts("ro-missing", limit=3, offset=2)
    assert (list(empty), empty.limit, empty.offset, empty.total) == ([], 3, 2, 0)
    assert await store.get_latest_attempt("ro-missing") is None
    queued = await store.enqueue_rollout(2)
    assert await store.get_latest_attempt(queued.rollout_id) is None
    assert len(await store.query_attempts(queued.rollout_id)) == 0


# --- query_spans (§2.10) ------------------------------------------------------------------------


async def _span_fixture(store):
    ar = await store.start_rollout(1)
    rid, a1 = ar.rollout_id, ar.attempt.attempt_id
    other = await store.start_rollout(2)
    trace = "ab" * 16
    s1 = make_span(rid, a1, 2, trace_id=trace, span_id="1111111111111111", name="llm.call")
    s2 = make_span(rid, a1, 1, trace_id=trace, span_id="2222222222222222", parent_id=s1.span_id, name="tool")
    a2 = (await store.start_attempt(rid)).attempt.attempt_id
    s3 = make_span(rid, a2, 3, span_id="3333333333333333", name="llm.retry")
    s4 = make_span(rid, a2, 3, span_id="4444444444444444", parent_id=s3.span_id, name="reward")
    leak = make_span(other.rollout_id, other.attempt.attempt_id, 1, trace_id=trace, name="llm.call")
    await store.add_many_spans([s1, s2, s3, s4, leak])
    return rid, a1, a2, (s1, s2, s3, s4), other


def names(result) -> list[str]:
    return [s.name for s in result]


async def test_query_spans_attempt_scope(store):
    rid, a1, a2, (s1, s2, s3, s4), other = await _span_fixture(store)
    assert names(await store.query_spans(rid)) == [
        "tool",
        "llm.call",
        "llm.retry",
        "reward",
    ]  # sequence_id, ties: insertion
    assert names(await store.query_spans(rid, a1)) == ["tool", "llm.call"]
    assert names(await store.query_spans(rid, "latest")) == ["llm.retry", "reward"]
    assert names(await store.query_spans(rid, "at-missing")) == []
    assert names(await store.query_spans("ro-missing")) == []
    assert names(await store.query_spans("ro-missing", "latest")) == []
    assert names(await store.query_spans(rid, sort_by=None)) == ["llm.call", "tool", "llm.retry", "reward"]
    # "latest" is resolved at call time.
    a3 = (await store.start_attempt(rid)).attempt.attempt_id
    assert names(await store.query_spans(rid, "latest")) == []
    await store.add_span(make_span(rid, a3, 9, name="late"))
    assert names(await store.query_spans(rid, "latest")) == ["late"]
    queued = await store.enqueue_rollout(3)
    empty = await store.query_spans(queued.rollout_id, "latest", limit=5)
    assert (len(empty), empty.total, empty.limit) == (0, 0, 5)


async def test_query_spans_filters(store):
    rid, a1, a2, (s1, s2, s3, s4), other = await _span_fixture(store)
    trace = s1.trace_id
    assert names(await store.query_spans(rid, trace_id=trace)) == ["tool", "llm.call"]
    assert names(await store.query_spans(rid, trace_id_contains=trace[:6])) == ["tool", "llm.call"]
    assert names(await store.query_spans(rid, span_id=s3.span_id)) == ["llm.retry"]
    assert names(await store.query_spans(rid, span_id_contains="444")) == ["reward"]
    assert names(await store.query_spans(rid, parent_id=s1.span_id)) == ["tool"]
    assert names(await store.query_spans(rid, parent_id_contains="3333")) == ["reward"]
    assert names(await store.query_spans(rid, name="llm.call")) == ["llm.call"]
    assert names(await store.query_spans(rid, name_contains="llm")) == ["llm.call", "llm.retry"]
    assert names(await store.query_spans(rid, name_contains="LLM")) == []  # case-sensitive
    # AND (default) of two conditions.
    assert names(await store.query_spans(rid, name_contains="llm", trace_id=trace)) == ["llm.call"]
    # OR pool; the rollout scope is a must condition: the other rollout's matching span never leaks.
    got = await store.query_spans(rid, name="reward", trace_id=trace, filter_logic="or")
    assert names(got) == ["tool", "llm.call", "reward"]
    got = await store.query_spans(rid, a2, name="reward", span_id=s1.span_id, filter_logic="or")
    assert names(got) == ["reward"]
    # Kept on purpose (D9): an empty OR pool returns nothing; an empty AND pool returns everything.
    assert names(await store.query_spans(rid, filter_logic="or")) == []
    assert (await store.query_spans(rid, filter_logic="or")).total == 0
    assert len(await store.query_spans(rid, filter_logic="and")) == 4
    # parent_id exact does not match NULL; contains on NULL is false.
    assert names(await store.query_spans(rid, parent_id_contains="")) == ["tool", "reward"]


# --- no N+1 ---------------------------------------------------------------------------------------


async def _count_statements(store, coro_factory) -> int:
    engine = Engine  # every engine of the process: the store's executor owns its engines
    statements: list[str] = []

    def before(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    try:
        await coro_factory()
    finally:
        event.remove(engine, "before_cursor_execute", before)
    return len(statements)


async def test_query_rollouts_issues_a_bounded_number_of_statements(store):
    async def fill(n: int) -> None:
        await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(n)])
        claimed = await store.dequeue_many_rollouts(limit=n, worker_id="w")
        for ar in claimed[: n // 2]:
            await store.start_attempt(ar.rollout_id)  # two attempts: the latest must be picked

    await fill(20)
    await store.query_rollouts()  # warm-up: schema, run, sweep state
    small = await _count_statements(store, lambda: store.query_rollouts())
    small_page = await _count_statements(store, lambda: store.query_rollouts(limit=5, offset=3))
    await fill(180)
    result = await store.query_rollouts()
    assert len(result) == 200 and all(type(r) is AttemptedRollout for r in result)
    assert all(r.attempt.sequence_id == (2 if i < 10 else 1) for i, r in enumerate(result[:20]))
    large = await _count_statements(store, lambda: store.query_rollouts())
    large_page = await _count_statements(store, lambda: store.query_rollouts(limit=5, offset=3))
    assert large == small, (small, large)
    assert large_page == small_page, (small_page, large_page)
    assert 2 <= large <= 10, large  # sweep + page + latest attempts, not one query per row
    spans_small = await _count_statements(store, lambda: store.query_spans(result[0].rollout_id))
    assert 1 <= spans_small <= 10
