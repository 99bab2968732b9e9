"""Contract §0.1 (runs) and the run-management calls of §4: names, binding, isolation, resume."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from lightning_sql import EnqueueRolloutRequest, PromptTemplate, RolloutConfig, Run, Span

LEASE = RolloutConfig(unresponsive_seconds=30, max_attempts=2, retry_condition=["unresponsive"])
GENERATED_NAME = re.compile(r"^run-\d{8}-\d{6}-[0-9a-f]{4,}$")


def _span(rollout_id: str, attempt_id: str, sequence_id: int = 1, name: str = "step") -> Span:
    return Span.from_attributes(
        attributes={"k": sequence_id},
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        name=name,
    )


def _persistent_only(backend) -> None:
    if not backend.persistent:
        pytest.skip("an in-memory database belongs to one instance: several instances cannot share it")


# --- names and binding ------------------------------------------------------------------------


async def test_run_none_generates_readable_unique_name_logged_and_created_on_first_call(
    store_factory, clock, caplog
):
    with caplog.at_level(logging.INFO, logger="lightning_sql"):
        a = store_factory(run=None)
    b = store_factory(run=None)
    assert a.run is not None and GENERATED_NAME.match(a.run), a.run
    assert b.run is not None and GENERATED_NAME.match(b.run), b.run
    assert a.run != b.run
    assert any(a.run in rec.getMessage() for rec in caplog.records if rec.levelno == logging.INFO)
    # The constructor does no I/O: the run row appears with the first run-scoped call.
    assert await a.get_run(a.run) is None
    await a.enqueue_rollout({"x": 1})
    run = await a.get_run(a.run)
    assert isinstance(run, Run)
    assert (run.name, run.status, run.created_at, run.finished_at) == (a.run, "active", clock(), None)


@pytest.mark.parametrize("bad", ["", 123, b"run"])
async def test_run_must_be_non_empty_str(backend, bad):
    with pytest.raises(ValueError, match="run"):
        backend.open(run=bad)


@pytest.mark.parametrize("flag", [{"create_run": False}, {"read_only": True}])
async def test_unknown_run_without_create_raises_listing_existing_runs(backend, store_factory, flag):
    _persistent_only(backend)
    await store_factory(run="alpha").enqueue_rollout(1)
    await store_factory(run="beta").enqueue_rollout(2)
    ghost = store_factory(run="ghost", **flag)
    calls = [
        ghost.query_rollouts,
        ghost.statistics,
        ghost.get_latest_resources,
        lambda: ghost.get_rollout_by_id("ro-x"),
    ]
    if not flag.get("read_only"):
        calls.append(ghost.dequeue_rollout)
    for call in calls:
        with pytest.raises(ValueError) as info:
            await call()
        message = str(info.value)
        assert "ghost" in message and "alpha" in message and "beta" in message
    assert [r.name for r in await ghost.list_runs()] == ["alpha", "beta"]
    assert await ghost.get_run("ghost") is None


async def test_unknown_run_on_empty_database_with_create_run_false(store_factory):
    ghost = store_factory(run="ghost", create_run=False)
    with pytest.raises(ValueError, match="ghost"):
        await ghost.enqueue_rollout(1)
    assert await ghost.list_runs() == []


@pytest.mark.parametrize("flag", [{"create_run": False}, {"read_only": True}])
async def test_run_none_without_create_binds_no_run(backend, store_factory, flag):
    _persistent_only(backend)
    await store_factory(run="existing").enqueue_rollout(1)
    unbound = store_factory(run=None, **flag)
    assert unbound.run is None
    assert [r.name for r in await unbound.list_runs()] == ["existing"]
    assert (await unbound.get_run("existing")).name == "existing"  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        await unbound.query_rollouts()
    with pytest.raises(ValueError):
        await unbound.statistics()
    assert [r.name for r in await unbound.list_runs()] == ["existing"]


async def test_create_run_false_binds_an_existing_run(backend, store_factory):
    _persistent_only(backend)
    r = await store_factory(run="exp").enqueue_rollout({"x": 1})
    other = store_factory(run="exp", create_run=False)
    got = await other.dequeue_rollout()
    assert got is not None and got.rollout_id == r.rollout_id


async def test_run_row_created_exactly_once_under_a_race(backend, store_factory):
    _persistent_only(backend)
    stores = [store_factory(run="raced", run_metadata={"i": i}) for i in range(10)]
    rollouts = await asyncio.gather(*(st.enqueue_rollout(i) for i, st in enumerate(stores)))
    runs = await stores[0].list_runs()
    assert [r.name for r in runs] == ["raced"]
    assert runs[0].metadata in [{"i": i} for i in range(10)]
    # All ten instances are bound to the same run: each sees every rollout.
    for st in stores:
        assert {r.rollout_id for r in await st.query_rollouts()} == {r.rollout_id for r in rollouts}


async def test_run_metadata_stored_and_kept_for_existing_run(backend, store_factory, clock):
    first = store_factory(run="meta", run_metadata={"lr": 0.1, "tags": ["a", "b"], "nested": {"k": None}})
    await first.enqueue_rollout(1)
    assert (await first.get_run("meta")).metadata == {"lr": 0.1, "tags": ["a", "b"], "nested": {"k": None}}  # type: ignore[union-attr]
    if not backend.persistent:
        return
    clock.advance(50)
    second = store_factory(run="meta", run_metadata={"lr": 99})
    await second.enqueue_rollout(2)
    run = await second.get_run("meta")
    assert run is not None
    assert run.metadata == {"lr": 0.1, "tags": ["a", "b"], "nested": {"k": None}}
    assert run.created_at == clock() - 50


async def test_run_metadata_none_is_null_and_bad_metadata_rejected(backend, store_factory):
    st = store_factory(run="nometa")
    await st.enqueue_rollout(1)
    assert (await st.get_run("nometa")).metadata is None  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="run_metadata"):
        backend.open(run="bad", run_metadata={"s": {1, 2}})


# --- isolation --------------------------------------------------------------------------------


async def test_two_runs_in_one_database_never_see_each_other(backend, store_factory, clock):
    _persistent_only(backend)
    a = store_factory(run="run-a")
    b = store_factory(run="run-b")

    # Resources: same caller-chosen id in both runs, independent versions.
    await a.update_resources("default", {"p": PromptTemplate(template="A {x}", engine="f-string")})
    await a.update_resources("default", {"p": PromptTemplate(template="A2 {x}", engine="f-string")})
    assert await b.get_latest_resources() is None
    assert await b.get_resources_by_id("default") is None
    assert len(await b.query_resources()) == 0
    rb = await b.update_resources("default", {"p": PromptTemplate(template="B {x}", engine="f-string")})
    assert rb.version == 1
    assert (await a.get_resources_by_id("default")).version == 2  # type: ignore[union-attr]

    # Rollouts, queue and idempotency keys.
    ra_q = await a.enqueue_rollout({"run": "a"}, idempotency_key="k1")
    ra = await a.start_rollout({"run": "a"}, worker_id="Worker-0", config=LEASE)
    rb_k = await b.enqueue_rollout({"run": "b"}, idempotency_key="k1")
    assert rb_k.rollout_id != ra_q.rollout_id
    assert rb_k.resources_id == "default" and rb_k.resources_version == 1
    assert ra_q.resources_version == 2
    assert len(await b.query_rollouts()) == 1
    assert len(await b.query_rollouts(rollout_id_in=[ra_q.rollout_id, ra.rollout_id])) == 0
    assert len(await b.query_rollouts(idempotency_key_in=["k1"])) == 1
    assert await b.get_rollout_by_id(ra.rollout_id) is None
    assert await b.get_latest_attempt(ra.rollout_id) is None
    assert len(await b.query_attempts(ra.rollout_id)) == 0
    assert await b.wait_for_rollouts(rollout_ids=[ra.rollout_id], timeout=0) == []
    claimed = await b.dequeue_rollout(worker_id="Worker-0")
    assert claimed is not None and claimed.rollout_id == rb_k.rollout_id
    assert await b.dequeue_rollout() is None  # a's queued rollout is not claimable from b
    assert (await a.statistics())["queue_depth"] == 1

    # Writes addressed at the other run's ids fail as unknown ids.
    with pytest.raises(ValueError, match="Item does not exist"):
        await b.update_rollout(ra.rollout_id, status="cancelled")
    with pytest.raises(ValueError, match=f"Rollout {ra.rollout_id} not found"):
        await b.update_attempt(ra.rollout_id, ra.attempt.attempt_id, status="failed")
    with pytest.raises(ValueError, match=f"Rollout {ra.rollout_id} not found"):
        await b.touch_attempt(ra.rollout_id, "latest")
    with pytest.raises(ValueError, match=f"Rollout {ra.rollout_id} not found"):
        await b.start_attempt(ra.rollout_id)
    with pytest.raises(ValueError, match=f"Rollout {ra.rollout_id} not found"):
        await b.add_span(_span(ra.rollout_id, ra.attempt.attempt_id))
    with pytest.raises(ValueError, match=f"Rollout {ra.rollout_id} not found"):
        await b.get_next_span_sequence_id(ra.rollout_id, ra.attempt.attempt_id)

    # Spans and sequence counters.
    await a.add_span(_span(ra.rollout_id, ra.attempt.attempt_id, 1))
    assert await a.get_next_span_sequence_id(ra.rollout_id, ra.attempt.attempt_id) == 2
    assert len(await b.query_spans(ra.rollout_id)) == 0
    assert await b.get_next_span_sequence_id(claimed.rollout_id, claimed.attempt.attempt_id) == 1

    # Workers: "Worker-0" exists independently in both runs.
    wa = await a.get_worker_by_id("Worker-0")
    wb = await b.get_worker_by_id("Worker-0")
    assert wa is not None and wb is not None
    assert wa.current_rollout_id == ra.rollout_id and wb.current_rollout_id == rb_k.rollout_id
    await b.update_worker("only-b", heartbeat_stats={"gpu": 1})
    assert await a.get_worker_by_id("only-b") is None
    assert {w.worker_id for w in await a.query_workers()} == {"Worker-0"}

    # Statistics count only the bound run.
    sa, sb = await a.statistics(), await b.statistics()
    assert (
        sa["total_rollouts"],
        sa["total_attempts"],
        sa["total_spans"],
        sa["total_resources"],
        sa["total_workers"],
    ) == (
        2,
        1,
        1,
        1,
        1,
    )
    assert (
        sb["total_rollouts"],
        sb["total_attempts"],
        sb["total_spans"],
        sb["total_resources"],
        sb["total_workers"],
    ) == (
        1,
        1,
        0,
        1,
        2,
    )
    assert sb["queue_depth"] == 0

    # The sweeper of one run never touches another run's leases.
    clock.advance(31)
    assert await b.sweep() == 0
    a_reader = store_factory(run="run-a", read_only=True)  # never sweeps: shows what b's sweep left
    assert (await a_reader.get_latest_attempt(ra.rollout_id)).status == "running"  # type: ignore[union-attr]
    assert await a.sweep() == 1
    assert (await a.get_rollout_by_id(ra.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    # ... and b's worker "Worker-0" (busy on b's rollout) is untouched by a's sweep.
    assert (await b.get_worker_by_id("Worker-0")).status == "busy"  # type: ignore[union-attr]
    assert (await a.get_worker_by_id("Worker-0")).status == "unknown"  # type: ignore[union-attr]


async def test_waits_and_queue_signals_are_scoped_to_the_run(backend, store_factory):
    _persistent_only(backend)
    a = store_factory(run="run-a")
    b = store_factory(run="run-b")
    await a.enqueue_rollout(1)
    assert await a.wait_for_queue(timeout=0) is True
    assert await b.wait_for_queue(timeout=0.2) is False


# --- resume -----------------------------------------------------------------------------------


async def test_reopened_run_resumes_everything(backend, store_factory, clock):
    _persistent_only(backend)
    first = store_factory(run="long")
    res = await first.add_resources({"p": PromptTemplate(template="{x}", engine="f-string")})
    done = await first.start_rollout({"i": 0}, worker_id="Worker-0")
    await first.add_span(_span(done.rollout_id, done.attempt.attempt_id, 1))
    await first.update_attempt(done.rollout_id, done.attempt.attempt_id, status="succeeded")
    queued = await first.enqueue_many_rollouts([EnqueueRolloutRequest(input={"i": i}) for i in (1, 2)])
    in_flight = await first.enqueue_rollout({"i": 3}, config=LEASE)
    # queued[0], queued[1] stay queued; claim the leased one by moving it to the queue front via the others' claims.
    claimed = await first.dequeue_many_rollouts(limit=3, worker_id="Worker-1")
    assert [c.rollout_id for c in claimed] == [q.rollout_id for q in queued] + [in_flight.rollout_id]
    for c in claimed[:2]:
        await first.update_rollout(c.rollout_id, status="queuing")  # back in the queue, in order
    await first.update_worker("Worker-1", heartbeat_stats={"mem": 3})
    await first.close()

    # "The process died": a new instance on the same run sees everything and carries on.
    clock.advance(31)
    second = store_factory(run="long")
    assert [r.name for r in await second.list_runs()] == ["long"]
    st = await second.statistics()
    assert (
        st["total_rollouts"],
        st["total_attempts"],
        st["total_spans"],
        st["total_resources"],
        st["total_workers"],
    ) == (
        4,
        4,
        1,
        1,
        2,
    )
    assert (await second.get_rollout_by_id(done.rollout_id)).status == "succeeded"  # type: ignore[union-attr]
    assert len(await second.query_spans(done.rollout_id)) == 1
    assert (await second.get_latest_resources()).resources_id == res.resources_id  # type: ignore[union-attr]
    assert (await second.get_worker_by_id("Worker-1")).heartbeat_stats == {"mem": 3}  # type: ignore[union-attr]
    assert await second.get_next_span_sequence_id(done.rollout_id, done.attempt.attempt_id) == 2
    # The in-flight rollout is recovered by its lease (the [sweeps] read below sweeps), behind the queued ones.
    assert (await second.get_rollout_by_id(in_flight.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    order = [(await second.dequeue_rollout(worker_id="Worker-2")) for _ in range(4)]
    assert [o.rollout_id if o else None for o in order] == [
        queued[0].rollout_id,
        queued[1].rollout_id,
        in_flight.rollout_id,
        None,
    ]
    assert order[2].attempt.sequence_id == 2  # type: ignore[union-attr]


async def test_same_store_instance_reattaches_after_close(backend, store_factory):
    _persistent_only(backend)
    st = store_factory(run="again")
    r = await st.enqueue_rollout({"x": 1})
    await st.close()
    await st.close()  # idempotent
    got = await st.get_rollout_by_id(r.rollout_id)
    assert got is not None and got.input == {"x": 1}


# --- run management (§4) ----------------------------------------------------------------------


async def test_list_get_runs_in_creation_order(backend, store_factory, clock):
    a = store_factory(run="zeta", run_metadata={"n": 1})
    await a.statistics()
    if backend.persistent:
        clock.advance(5)
        b = store_factory(run="alpha")
        await b.enqueue_rollout(1)
        runs = await b.list_runs()
        assert [r.name for r in runs] == ["zeta", "alpha"]
        assert runs[1].created_at == clock()
        assert runs[0].created_at == clock() - 5
    assert (await a.get_run("zeta")).metadata == {"n": 1}  # type: ignore[union-attr]
    assert await a.get_run("nope") is None
    assert await a.get_run("bad\x00name") is None


async def test_mark_run_finished_is_informational_and_repeatable(store_factory, clock):
    st = store_factory(run="fin")
    await st.enqueue_rollout(1)
    clock.advance(10)
    run = await st.mark_run_finished()
    assert (run.name, run.status, run.finished_at) == ("fin", "finished", clock())
    assert run.created_at == clock() - 10
    clock.advance(5)
    again = await st.mark_run_finished()
    assert again.finished_at == clock() and again.status == "finished"
    # Nothing refuses work on a finished run.
    assert (await st.dequeue_rollout()) is not None
    await st.enqueue_rollout(2)
    assert (await st.get_run("fin")).status == "finished"  # type: ignore[union-attr]


async def test_delete_run_removes_everything_of_that_run_only(backend, store_factory):
    _persistent_only(backend)
    keep = store_factory(run="keep")
    gone = store_factory(run="gone")
    for st in (keep, gone):
        await st.add_resources({"p": PromptTemplate(template="{x}", engine="f-string")})
        ar = await st.start_rollout({"x": 1}, worker_id="Worker-0")
        await st.add_span(_span(ar.rollout_id, ar.attempt.attempt_id))
        await st.enqueue_rollout({"x": 2})
    before_keep = await keep.statistics()
    assert await keep.delete_run("gone") is True
    assert await keep.delete_run("gone") is False
    assert await keep.delete_run("never-existed") is False
    assert [r.name for r in await keep.list_runs()] == ["keep"]
    after_keep = await keep.statistics()
    for key in (
        "total_rollouts",
        "total_attempts",
        "total_spans",
        "total_resources",
        "total_workers",
        "queue_depth",
    ):
        assert after_keep[key] == before_keep[key], key  # type: ignore[literal-required]
    # Reopening the deleted run's name starts an empty run.
    fresh = store_factory(run="gone")
    stats = await fresh.statistics()
    assert (stats["total_rollouts"], stats["total_spans"], stats["total_workers"]) == (0, 0, 0)


async def test_delete_own_run_then_use_creates_it_again(store_factory):
    st = store_factory(run="self")
    await st.enqueue_rollout(1)
    assert await st.delete_run("self") is True
    assert await st.get_run("self") is None
    assert (await st.statistics())["total_rollouts"] == 0
    assert [r.name for r in await st.list_runs()] == ["self"]
