"""Contract §2.7 update_attempt (resolution, fields, propagation D6, worker sync) and touch_attempt (D13),
§2.8 the attempt status machine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lightning_sql import Attempt, RolloutConfig, Span, rollout_status_from_attempt

RETRY_FAILED = RolloutConfig(max_attempts=2, retry_condition=["failed"])
RETRY_ALL = RolloutConfig(max_attempts=3, retry_condition=["failed", "timeout", "unresponsive"])


def _span(rollout_id: str, attempt_id: str, seq: int = 1) -> Span:
    return Span.from_attributes(attributes={}, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq)


# --- resolution -------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["update_attempt", "touch_attempt"])
async def test_resolution_order_and_messages(store, method):
    call = getattr(store, method)
    kwargs = {"status": "running"} if method == "update_attempt" else {}
    with pytest.raises(ValueError) as info:
        await call("ro-missing", "at-missing", **kwargs)
    assert str(info.value) == "Rollout ro-missing not found"
    queued = await store.enqueue_rollout(1)
    for aid in ("latest", "at-missing"):
        with pytest.raises(ValueError) as info:
            await call(queued.rollout_id, aid, **kwargs)
        assert str(info.value) == f"No attempts found for rollout {queued.rollout_id}"
    ar = await store.start_rollout(2)
    with pytest.raises(ValueError) as info:
        await call(ar.rollout_id, "at-missing", **kwargs)
    assert str(info.value) == f"Attempt at-missing not found for rollout {ar.rollout_id}"
    # An attempt of another rollout is "not found" for this one.
    with pytest.raises(ValueError, match="not found for rollout"):
        await call(ar.rollout_id, (await store.start_attempt(queued.rollout_id)).attempt.attempt_id, **kwargs)


@pytest.mark.parametrize("method", ["update_attempt", "touch_attempt"])
async def test_latest_means_highest_sequence_id(store, method):
    ar = await store.start_rollout(1)
    second = await store.start_attempt(ar.rollout_id)
    kwargs = {"metadata": {"hit": True}} if method == "update_attempt" else {}
    got = await getattr(store, method)(ar.rollout_id, "latest", **kwargs)
    assert type(got) is Attempt
    assert got.attempt_id == second.attempt.attempt_id and got.sequence_id == 2


# --- fields -----------------------------------------------------------------------------------


async def test_update_attempt_fields(store, clock):
    ar = await store.start_rollout(1)
    aid = ar.attempt.attempt_id
    a = await store.update_attempt(ar.rollout_id, aid, metadata={})
    assert a.metadata == {}
    a = await store.update_attempt(ar.rollout_id, aid, worker_id="")
    assert a.worker_id == ""
    a = await store.update_attempt(ar.rollout_id, aid, last_heartbeat_time=123.5)
    assert a.last_heartbeat_time == 123.5  # the caller's value, stored verbatim
    a = await store.update_attempt(ar.rollout_id, aid, metadata={"k": [1, 2]})
    assert (a.metadata, a.worker_id, a.last_heartbeat_time, a.status, a.end_time) == (
        {"k": [1, 2]},
        "",
        123.5,
        "preparing",
        None,
    )
    assert await store.get_latest_attempt(ar.rollout_id) == a


async def test_end_time_only_for_failed_and_succeeded(store, clock):
    ar = await store.start_rollout(1)
    aid = ar.attempt.attempt_id
    for status in ("running", "timeout", "unresponsive"):
        a = await store.update_attempt(ar.rollout_id, aid, status=status)
        assert (a.status, a.end_time) == (status, None)
    for status in ("failed", "succeeded", "failed"):
        clock.advance(1)
        a = await store.update_attempt(ar.rollout_id, aid, status=status)
        assert (a.status, a.end_time) == (status, clock())  # overwritten each time
    end = clock()
    clock.advance(1)
    for status in ("running", "preparing", "timeout"):
        a = await store.update_attempt(ar.rollout_id, aid, status=status)
        assert a.end_time == end  # nothing clears it


@pytest.mark.parametrize(
    "kwargs",
    [{"status": "cancelled"}, {"status": "queuing"}, {"status": None}, {"last_heartbeat_time": "soon"}],
)
async def test_invalid_attempt_values(store, kwargs):
    ar = await store.start_rollout(1)
    with pytest.raises(ValidationError):
        await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, **kwargs)
    assert await store.get_latest_attempt(ar.rollout_id) == ar.attempt


# --- propagation (D6) -------------------------------------------------------------------------


def test_rollout_status_from_attempt_mapping():
    cfg = RolloutConfig(max_attempts=2, retry_condition=["timeout"])
    assert rollout_status_from_attempt("preparing", 1, cfg) == "preparing"
    assert rollout_status_from_attempt("running", 5, cfg) == "running"
    assert rollout_status_from_attempt("succeeded", 1, cfg) == "succeeded"
    assert rollout_status_from_attempt("timeout", 1, cfg) == "requeuing"
    assert rollout_status_from_attempt("timeout", 2, cfg) == "failed"  # sequence_id < max_attempts is strict
    assert rollout_status_from_attempt("failed", 1, cfg) == "failed"  # not in retry_condition
    assert rollout_status_from_attempt("unresponsive", 1, cfg) == "failed"
    with pytest.raises(ValueError):
        rollout_status_from_attempt("cancelled", 1, cfg)


@pytest.mark.parametrize(
    ("attempt_status", "config", "expected"),
    [
        ("running", RolloutConfig(), "running"),
        ("succeeded", RolloutConfig(), "succeeded"),
        ("failed", RolloutConfig(), "failed"),
        ("failed", RETRY_FAILED, "requeuing"),
        ("timeout", RETRY_FAILED, "failed"),
        ("timeout", RETRY_ALL, "requeuing"),
        ("unresponsive", RETRY_ALL, "requeuing"),
        ("unresponsive", RolloutConfig(retry_condition=["unresponsive"]), "failed"),  # max_attempts=1
    ],
)
async def test_status_on_latest_attempt_propagates(store, clock, attempt_status, config, expected):
    ar = await store.start_rollout(1, config=config)
    clock.advance(2)
    await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status=attempt_status)
    got = await store.get_rollout_by_id(ar.rollout_id)
    assert got is not None and got.status == expected
    finished = expected in ("succeeded", "failed")
    assert got.end_time == (clock() if finished else None)
    assert (await store.statistics())["queue_depth"] == (1 if expected == "requeuing" else 0)


async def test_propagation_respects_max_attempts_across_attempts(store):
    r = await store.enqueue_rollout(1, config=RETRY_FAILED)
    first = await store.dequeue_rollout()
    assert first is not None
    await store.update_attempt(r.rollout_id, first.attempt.attempt_id, status="failed")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    second = await store.dequeue_rollout()
    assert second is not None and second.attempt.sequence_id == 2
    await store.update_attempt(r.rollout_id, "latest", status="failed")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"  # type: ignore[union-attr]


async def test_setting_the_same_status_again_still_propagates(store):
    ar = await store.start_rollout(1)
    await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="running")
    await store.update_rollout(ar.rollout_id, status="preparing")  # rollout drifted from its attempt
    await store.update_attempt(
        ar.rollout_id, ar.attempt.attempt_id, status="running"
    )  # unchanged attempt status
    assert (await store.get_rollout_by_id(ar.rollout_id)).status == "running"  # type: ignore[union-attr]


async def test_non_status_updates_never_touch_the_rollout(store):
    ar = await store.start_rollout(1)
    await store.update_rollout(ar.rollout_id, status="succeeded")
    before = await store.get_rollout_by_id(ar.rollout_id)
    aid = ar.attempt.attempt_id
    await store.update_attempt(ar.rollout_id, aid, metadata={"x": 1})
    await store.update_attempt(ar.rollout_id, aid, worker_id="w")
    await store.update_attempt(ar.rollout_id, aid, last_heartbeat_time=5.0)
    after = await store.get_rollout_by_id(ar.rollout_id)
    assert after is not None and before is not None
    assert (
        (after.status, after.end_time) == (before.status, before.end_time) == ("succeeded", before.end_time)
    )


@pytest.mark.parametrize("status", ["succeeded", "failed", "running", "preparing"])
async def test_cancelled_rollout_is_never_changed_by_propagation(store, clock, status):
    ar = await store.start_rollout(1, config=RETRY_ALL)
    cancelled = await store.update_rollout(ar.rollout_id, status="cancelled")
    clock.advance(3)
    a = await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status=status)
    assert a.status == status  # the attempt itself is updated
    got = await store.get_rollout_by_id(ar.rollout_id)
    assert got is not None and (got.status, got.end_time) == ("cancelled", cancelled.end_time)


async def test_non_latest_attempt_never_affects_the_rollout(store):
    ar = await store.start_rollout(1, config=RETRY_ALL)
    await store.start_attempt(ar.rollout_id)
    for status in ("succeeded", "failed", "running"):
        old = await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status=status)
        assert old.status == status
        got = await store.get_rollout_by_id(ar.rollout_id)
        assert got is not None and (got.status, got.end_time) == ("preparing", None)


async def test_propagation_to_requeuing_enters_queue_tail_and_notifies_queue(store):
    other = await store.enqueue_rollout("other")
    ar = await store.start_rollout(1, config=RETRY_FAILED)
    await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="failed")
    assert await store.wait_for_queue(timeout=0) is True
    first = await store.dequeue_rollout()
    second = await store.dequeue_rollout()
    assert (first.rollout_id, second.rollout_id) == (other.rollout_id, ar.rollout_id)  # type: ignore[union-attr]
    assert second.attempt.sequence_id == 2  # type: ignore[union-attr]


# --- worker sync ------------------------------------------------------------------------------


async def test_worker_sync_follows_the_attempt_status(store, clock):
    await store.update_worker("w", heartbeat_stats={"cpu": 1})
    hb = clock()
    ar = await store.start_rollout(1, worker_id="w")
    aid = ar.attempt.attempt_id
    clock.advance(1)
    await store.update_attempt(ar.rollout_id, aid, status="running")
    w = await store.get_worker_by_id("w")
    assert w is not None
    assert (w.status, w.last_busy_time, w.current_rollout_id, w.current_attempt_id) == (
        "busy",
        clock(),
        ar.rollout_id,
        aid,
    )
    clock.advance(1)
    await store.update_attempt(ar.rollout_id, aid, status="succeeded")
    w = await store.get_worker_by_id("w")
    assert w is not None
    assert (w.status, w.last_idle_time, w.current_rollout_id, w.current_attempt_id) == (
        "idle",
        clock(),
        None,
        None,
    )
    clock.advance(1)
    await store.update_attempt(ar.rollout_id, aid, status="timeout")
    w = await store.get_worker_by_id("w")
    assert w is not None
    assert (w.status, w.last_idle_time, w.current_rollout_id, w.current_attempt_id) == (
        "unknown",
        clock(),
        None,
        None,
    )
    clock.advance(1)
    await store.update_attempt(ar.rollout_id, aid, status="preparing")  # applied even when nothing changes
    w = await store.get_worker_by_id("w")
    assert w is not None and (w.status, w.last_busy_time, w.current_attempt_id) == ("busy", clock(), aid)
    clock.advance(1)
    await store.update_attempt(ar.rollout_id, aid, status="failed")
    w = await store.get_worker_by_id("w")
    assert w is not None and (w.status, w.last_idle_time) == ("idle", clock())
    clock.advance(1)
    await store.update_attempt(ar.rollout_id, aid, status="unresponsive")
    w = await store.get_worker_by_id("w")
    assert w is not None and (w.status, w.last_idle_time) == ("unknown", clock())
    # Worker sync never touches the heartbeat fields, nor the dequeue time.
    assert (w.heartbeat_stats, w.last_heartbeat_time, w.last_dequeue_time) == ({"cpu": 1}, hb, None)


async def test_worker_sync_conditions(store, clock):
    ar = await store.start_rollout(1)  # no worker
    aid = ar.attempt.attempt_id
    await store.update_attempt(ar.rollout_id, aid, status="running")
    assert (await store.statistics())["total_workers"] == 0
    await store.update_attempt(ar.rollout_id, aid, worker_id="")  # falsy: no sync
    await store.update_attempt(ar.rollout_id, aid, status="succeeded")  # resulting worker_id "" is falsy
    assert (await store.statistics())["total_workers"] == 0
    # worker_id given and truthy: sync with the attempt's current status, creating the worker.
    await store.update_attempt(ar.rollout_id, aid, worker_id="A")
    a = await store.get_worker_by_id("A")
    assert a is not None and (a.status, a.last_idle_time, a.current_attempt_id) == ("idle", clock(), None)
    # Metadata-only updates never sync.
    await store.update_attempt(ar.rollout_id, aid, status="running")
    clock.advance(1)
    await store.update_attempt(ar.rollout_id, aid, metadata={"m": 1})
    await store.update_attempt(ar.rollout_id, aid, last_heartbeat_time=1.0)
    a = await store.get_worker_by_id("A")
    assert a is not None and a.status == "busy" and a.last_busy_time == clock() - 1


async def test_moving_an_attempt_between_workers_syncs_only_the_new_one(store, clock):
    ar = await store.start_rollout(1, worker_id="A")
    aid = ar.attempt.attempt_id
    clock.advance(1)
    await store.update_attempt(ar.rollout_id, aid, worker_id="B", status="running")
    a = await store.get_worker_by_id("A")
    b = await store.get_worker_by_id("B")
    assert a is not None and b is not None
    assert (a.status, a.current_attempt_id, a.last_busy_time) == ("busy", aid, clock() - 1)  # A stays busy
    assert (b.status, b.current_attempt_id, b.last_busy_time) == ("busy", aid, clock())
    await store.update_attempt(ar.rollout_id, aid, status="succeeded")
    assert (await store.get_worker_by_id("B")).status == "idle"  # type: ignore[union-attr]
    assert (await store.get_worker_by_id("A")).status == "busy"  # type: ignore[union-attr]


# --- touch_attempt (D13) ----------------------------------------------------------------------


async def test_touch_attempt_sets_only_the_heartbeat(store, clock):
    ar = await store.start_rollout(1, worker_id="w", config=RETRY_ALL)
    aid = ar.attempt.attempt_id
    await store.update_attempt(ar.rollout_id, aid, metadata={"keep": 1})
    w_before = await store.get_worker_by_id("w")
    clock.advance(9)
    touched = await store.touch_attempt(ar.rollout_id, aid)
    assert type(touched) is Attempt
    assert touched.last_heartbeat_time == clock()
    expected = ar.attempt.model_copy(update={"last_heartbeat_time": clock(), "metadata": {"keep": 1}})
    assert touched == expected
    assert await store.get_latest_attempt(ar.rollout_id) == expected
    assert await store.get_worker_by_id("w") == w_before  # no worker sync
    assert (await store.get_rollout_by_id(ar.rollout_id)).status == "preparing"  # type: ignore[union-attr]


@pytest.mark.parametrize("status", ["unresponsive", "timeout", "failed", "succeeded"])
async def test_touch_attempt_changes_no_status_and_reports_the_lease(store, clock, status):
    ar = await store.start_rollout(1, config=RETRY_ALL)
    await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status=status)
    rollout_before = await store.get_rollout_by_id(ar.rollout_id)
    clock.advance(1)
    touched = await store.touch_attempt(ar.rollout_id, "latest")
    # The runner learns it lost its lease: the attempt's status is returned as it is.
    assert (touched.status, touched.last_heartbeat_time) == (status, clock())
    assert await store.get_rollout_by_id(ar.rollout_id) == rollout_before.model_copy(  # type: ignore[union-attr]
        update={"attempt": touched}
    )


async def test_touch_attempt_does_not_sweep(store_factory, clock):
    st = store_factory(scan_debounce_seconds=0)
    ar = await st.start_rollout(1, config=RolloutConfig(unresponsive_seconds=5))
    clock.advance(6)
    touched = await st.touch_attempt(ar.rollout_id, ar.attempt.attempt_id)
    assert touched.status == "preparing"  # not swept first: the fresh heartbeat saves it
    assert await st.sweep() == 0


# --- §2.8 status machine (attempt side) -------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("preparing", "running"),
        ("unresponsive", "running"),
        ("running", "running"),
        ("timeout", "timeout"),
        ("failed", "failed"),
        ("succeeded", "succeeded"),
    ],
)
async def test_span_moves_attempt_status(store, clock, before, after):
    ar = await store.start_rollout(1)
    aid = ar.attempt.attempt_id
    if before != "preparing":
        await store.update_attempt(ar.rollout_id, aid, status=before)
    clock.advance(2)
    await store.add_span(_span(ar.rollout_id, aid))
    a = await store.get_latest_attempt(ar.rollout_id)
    assert a is not None and (a.status, a.last_heartbeat_time) == (after, clock())


async def test_any_attempt_status_to_any_via_update_attempt(store):
    ar = await store.start_rollout(1)
    statuses = [
        "running",
        "succeeded",
        "preparing",
        "failed",
        "timeout",
        "unresponsive",
        "succeeded",
        "running",
    ]
    for status in statuses:
        assert (await store.update_attempt(ar.rollout_id, "latest", status=status)).status == status
