"""Contract §0.2: the store clock (injected local clock, time.time fallback, PostgreSQL offset sync)."""

from __future__ import annotations

import time

import pytest

from lightning_sql import PromptTemplate, RolloutConfig, Span, SqlLightningStore
from tests.conftest import PG_URL, require_postgres

SKEW_S = 120.0


def _prompt(text: str) -> dict[str, PromptTemplate]:
    return {"p": PromptTemplate(template=text, engine="f-string")}


async def test_injected_clock_drives_every_timestamp(store_factory, clock):
    st = store_factory(run="clocked")
    t0 = clock()
    assert st.now() == t0

    res = await st.add_resources(_prompt("a {x}"))
    assert (res.create_time, res.update_time) == (t0, t0)
    clock.set(t0 + 1)
    res2 = await st.update_resources(res.resources_id, _prompt("b {x}"))
    assert (res2.create_time, res2.update_time, res2.version) == (t0, t0 + 1, 2)
    v1 = await st.get_resources_by_id(res.resources_id, version=1)
    v2 = await st.get_resources_by_id(res.resources_id, version=2)
    assert v1 is not None and v2 is not None
    assert (v1.update_time, v2.update_time) == (t0, t0 + 1)

    clock.set(t0 + 2)
    started = await st.start_rollout({"x": 1}, worker_id="Worker-0")
    assert started.start_time == started.attempt.start_time == t0 + 2
    w = await st.get_worker_by_id("Worker-0")
    assert w is not None and w.last_busy_time == t0 + 2

    clock.set(t0 + 3)
    queued = await st.enqueue_rollout({"x": 2})
    assert queued.start_time == t0 + 3

    clock.set(t0 + 4)
    claimed = await st.dequeue_rollout(worker_id="Worker-1")
    assert claimed is not None and claimed.attempt.start_time == t0 + 4 and claimed.start_time == t0 + 3
    w1 = await st.get_worker_by_id("Worker-1")
    assert w1 is not None and (w1.last_dequeue_time, w1.last_busy_time) == (t0 + 4, t0 + 4)

    clock.set(t0 + 5)
    touched = await st.touch_attempt(claimed.rollout_id, claimed.attempt.attempt_id)
    assert touched.last_heartbeat_time == t0 + 5

    clock.set(t0 + 6)
    await st.add_span(
        Span.from_attributes(
            attributes={}, rollout_id=started.rollout_id, attempt_id=started.attempt.attempt_id, sequence_id=1
        )
    )
    att = await st.get_latest_attempt(started.rollout_id)
    assert att is not None and att.last_heartbeat_time == t0 + 6 and att.status == "running"

    clock.set(t0 + 7)
    done = await st.update_attempt(started.rollout_id, "latest", status="succeeded")
    assert done.end_time == t0 + 7
    rollout = await st.get_rollout_by_id(started.rollout_id)
    assert rollout is not None and rollout.end_time == t0 + 7
    w = await st.get_worker_by_id("Worker-0")
    assert w is not None and w.last_idle_time == t0 + 7

    clock.set(t0 + 8)
    await st.update_worker("Worker-0")
    w = await st.get_worker_by_id("Worker-0")
    assert w is not None and w.last_heartbeat_time == t0 + 8

    clock.set(t0 + 9)
    cancelled = await st.update_rollout(claimed.rollout_id, status="cancelled")
    assert cancelled.end_time == t0 + 9

    clock.set(t0 + 10)
    empty = await st.dequeue_rollout(worker_id="Worker-2")
    assert empty is None
    w2 = await st.get_worker_by_id("Worker-2")
    assert w2 is not None and (w2.last_idle_time, w2.last_dequeue_time) == (t0 + 10, t0 + 10)

    run = await st.get_run("clocked")
    assert run is not None and run.created_at == t0
    clock.set(t0 + 11)
    assert (await st.mark_run_finished()).finished_at == t0 + 11
    # The fake clock sits years away from the real one: no value came from the database's now().
    assert abs(t0 - time.time()) > 3600


async def test_sweeper_now_comes_from_the_injected_clock(store_factory, clock):
    st = store_factory()
    ar = await st.start_rollout(1, config=RolloutConfig(timeout_seconds=10))
    clock.advance(10)
    assert await st.sweep() == 0
    clock.advance(0.5)
    assert await st.sweep() == 1
    assert (await st.get_latest_attempt(ar.rollout_id)).status == "timeout"  # type: ignore[union-attr]


async def test_clock_none_follows_patched_time_time(backend, monkeypatch):
    now = {"t": 1_234_567_890.5}
    monkeypatch.setattr(time, "time", lambda: now["t"])
    st = backend.open(run="wall", clock=None, clock_sync=False, scan_debounce_seconds=0)
    try:
        assert st.now() == 1_234_567_890.5
        r = await st.enqueue_rollout({"x": 1})
        assert r.start_time == 1_234_567_890.5
        now["t"] = 1_234_567_999.25
        assert st.now() == 1_234_567_999.25
        ar = await st.dequeue_rollout(worker_id="w")
        assert ar is not None and ar.attempt.start_time == 1_234_567_999.25
        run = await st.get_run("wall")
        assert run is not None and run.created_at == 1_234_567_890.5
    finally:
        await st.close()


async def test_clock_must_be_callable(backend):
    with pytest.raises(TypeError, match="clock"):
        backend.open(run="x", clock=12.0)


async def test_clock_sync_true_on_sqlite_is_refused(backend):
    if backend.is_postgres:
        st = backend.open(run="x", clock_sync=True)
        await st.close()
        return
    with pytest.raises(ValueError, match="clock_sync"):
        backend.open(run="x", clock_sync=True)


async def test_clock_sync_default_is_off_on_sqlite(backend, clock):
    if backend.is_postgres:
        pytest.skip("the default turns clock_sync on for PostgreSQL (tested below)")
    st = backend.open(run="x", clock=clock, scan_debounce_seconds=0)  # clock_sync=None
    try:
        r = await st.enqueue_rollout(1)
        assert r.start_time == clock() == st.now()
    finally:
        await st.close()


async def test_now_does_no_io(tmp_path, clock):
    # Databases that cannot be reached: reading the store clock still works, without touching them.
    missing = SqlLightningStore(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}", run="x", clock=clock)
    assert missing.now() == clock()
    pg = SqlLightningStore("postgresql://nobody@127.0.0.1:1/none", run="x", clock=clock, clock_sync=True)
    assert pg.now() == clock()
    assert not (tmp_path / "no").exists()


async def test_clock_stepping_back_keeps_latest_resources_by_sequence(store_factory, clock):
    st = store_factory()
    a = await st.add_resources(_prompt("a {x}"))
    clock.advance(-100)  # the wall clock steps back
    b = await st.add_resources(_prompt("b {x}"))
    assert b.create_time < a.create_time
    latest = await st.get_latest_resources()
    assert latest is not None and latest.resources_id == b.resources_id
    clock.advance(-100)
    await st.update_resources(a.resources_id, _prompt("a2 {x}"))
    latest = await st.get_latest_resources()
    assert latest is not None and latest.resources_id == a.resources_id and latest.version == 2
    r = await st.enqueue_rollout(1)
    assert r.resources_id == a.resources_id and r.resources_version == 2


# --- PostgreSQL: offset to the server clock ----------------------------------------------------


class SkewedClock:
    """The real wall clock moved by a fixed offset (a host whose clock is wrong)."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    def __call__(self) -> float:
        return time.time() + self.skew


async def test_clock_sync_makes_skewed_hosts_agree(pg_backend):
    fast = pg_backend.open(run="skew", clock=SkewedClock(SKEW_S), clock_sync=True, scan_debounce_seconds=0)
    slow = pg_backend.open(run="skew", clock=SkewedClock(0.0), clock_sync=True, scan_debounce_seconds=0)
    unsynced = pg_backend.open(
        run="skew", clock=SkewedClock(SKEW_S), clock_sync=False, scan_debounce_seconds=0
    )
    try:
        # The offset is measured before the first call reads "now".
        t_before = time.monotonic()
        await fast.statistics()
        await slow.statistics()
        await unsynced.statistics()
        rtt_bound = time.monotonic() - t_before  # covers one round trip of each, generously
        diff = abs(fast.now() - slow.now())
        # Synchronised, they differ by at most a round trip (milliseconds); without it, by 120 s.
        assert diff <= rtt_bound + 1.0, (diff, rtt_bound)
        assert abs(unsynced.now() - slow.now() - SKEW_S) < 1.0
        # Both agree with the server's clock (this machine's clock is the server's: same host).
        assert abs(fast.now() - time.time()) < 1.0

        # What matters: a lease written by one host is judged by the other on one time line.
        config = RolloutConfig(unresponsive_seconds=60, max_attempts=2, retry_condition=["unresponsive"])
        ar = await slow.start_rollout({"x": 1}, config=config)
        assert abs(ar.start_time - fast.now()) < 1.0
        assert await fast.sweep() == 0  # 120 s of skew would have expired a 60 s lease
        assert (await fast.get_latest_attempt(ar.rollout_id)).status == "preparing"  # type: ignore[union-attr]
        assert await unsynced.sweep() == 1  # the same host without clock_sync kills a live attempt
    finally:
        for st in (fast, slow, unsynced):
            await st.close()


async def test_clock_sync_defaults_on_for_postgres(pg_backend):
    skewed = pg_backend.open(run="default-sync", clock=SkewedClock(-SKEW_S), scan_debounce_seconds=0)
    try:
        r = await skewed.enqueue_rollout(1)
        assert abs(r.start_time - time.time()) < 1.0
        assert abs(skewed.now() - time.time()) < 1.0
    finally:
        await skewed.close()


async def test_clock_sync_offset_is_per_instance_and_follows_a_fake_clock(pg_backend, clock):
    # A fake local clock far from the server's: the store clock becomes the server's time line,
    # and moves with the fake clock afterwards (reading it does no I/O).
    require_postgres()
    st = SqlLightningStore(PG_URL, **pg_backend.options(run="fake-sync", clock=clock, clock_sync=True))
    try:
        await st.statistics()
        base = st.now()
        assert abs(base - time.time()) < 1.0
        clock.advance(30)
        assert abs(st.now() - base - 30) < 1e-6
    finally:
        await st.close()


async def test_without_clock_sync_a_span_stamps_the_callers_time_at_call_time(backend):
    """The Agent-Lightning bridge's convention (docs/agentlightning.md): with ``clock_sync=False``
    an attempt's heartbeat after ``add_otel_span`` is the calling host's ``time.time()`` during the
    call, on every backend."""
    from opentelemetry.sdk.trace import TracerProvider

    store = backend.open(run="r", clock_sync=False)
    try:
        ar = await store.start_rollout({"q": 1})
        with TracerProvider().get_tracer("t").start_as_current_span("step") as otel_span:
            pass
        before = time.time()
        await store.add_otel_span(ar.rollout_id, ar.attempt.attempt_id, otel_span)
        after = time.time()
        attempt = await store.get_latest_attempt(ar.rollout_id)
        assert attempt is not None and attempt.last_heartbeat_time is not None
        assert before <= attempt.last_heartbeat_time <= after
    finally:
        await store.close()
