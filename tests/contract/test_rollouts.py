"""Contract §2.2 start_rollout, §2.3 enqueue (idempotency keys), §2.5 start_attempt, §2.6 update_rollout,
§2.8 the rollout status machine."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from lightning_sql import (
    AttemptedRollout,
    EnqueueRolloutRequest,
    PromptTemplate,
    Rollout,
    RolloutConfig,
    Span,
)

RETRY = RolloutConfig(max_attempts=2, retry_condition=["failed"])


def _prompt(text: str) -> dict[str, PromptTemplate]:
    return {"p": PromptTemplate(template=text, engine="f-string")}


def _span(rollout_id: str, attempt_id: str, seq: int = 1) -> Span:
    return Span.from_attributes(attributes={}, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq)


# --- §2.2 start_rollout -----------------------------------------------------------------------


async def test_start_rollout_creates_preparing_rollout_with_first_attempt(store, clock):
    ar = await store.start_rollout({"q": [1, 2]}, mode="val", metadata={"m": 1})
    assert type(ar) is AttemptedRollout
    assert ar.rollout_id.startswith("ro-") and len(ar.rollout_id) == 15
    assert (ar.input, ar.mode, ar.status, ar.metadata, ar.start_time, ar.end_time) == (
        {"q": [1, 2]},
        "val",
        "preparing",
        {"m": 1},
        clock(),
        None,
    )
    assert (ar.resources_id, ar.resources_version, ar.idempotency_key) == (None, None, None)
    assert ar.config == RolloutConfig()
    att = ar.attempt
    assert att.attempt_id.startswith("at-") and len(att.attempt_id) == 11
    assert (att.rollout_id, att.sequence_id, att.status, att.start_time, att.worker_id) == (
        ar.rollout_id,
        1,
        "preparing",
        clock(),
        None,
    )
    # Not queued.
    assert (await store.statistics())["queue_depth"] == 0
    assert await store.dequeue_rollout() is None
    stored = await store.get_rollout_by_id(ar.rollout_id)
    assert stored == ar
    assert (await store.statistics())["total_workers"] == 0


async def test_start_rollout_with_worker_marks_it_busy_without_dequeue_time(store, clock):
    ar = await store.start_rollout(1, worker_id="Worker-7")
    assert ar.attempt.worker_id == "Worker-7"
    w = await store.get_worker_by_id("Worker-7")
    assert w is not None
    assert (w.status, w.last_busy_time, w.last_dequeue_time) == ("busy", clock(), None)
    assert (w.current_rollout_id, w.current_attempt_id) == (ar.rollout_id, ar.attempt.attempt_id)


async def test_config_and_metadata_are_copied(store):
    config = RolloutConfig(timeout_seconds=5, retry_condition=["timeout"], max_attempts=2)
    metadata = {"a": 1}
    ar = await store.start_rollout(1, config=config, metadata=metadata)
    r = await store.enqueue_rollout(2, config=config, metadata=metadata)
    config.retry_condition.append("failed")
    config.timeout_seconds = 99
    metadata["b"] = 2
    for rid in (ar.rollout_id, r.rollout_id):
        got = await store.get_rollout_by_id(rid)
        assert got is not None
        assert got.config == RolloutConfig(timeout_seconds=5, retry_condition=["timeout"], max_attempts=2)
        assert got.metadata == {"a": 1}
    assert ar.metadata == {"a": 1} and r.metadata == {"a": 1}


async def test_metadata_none_becomes_empty_dict(store):
    ar = await store.start_rollout(None)
    r = await store.enqueue_rollout(None)
    assert ar.metadata == {} and r.metadata == {}
    assert ar.input is None and r.input is None
    for rid in (ar.rollout_id, r.rollout_id):
        got = await store.get_rollout_by_id(rid)
        assert got is not None and got.metadata == {} and got.input is None


async def test_default_rollout_config_applies_to_every_producer(store_factory):
    default = RolloutConfig(
        unresponsive_seconds=60, max_attempts=3, retry_condition=["unresponsive", "timeout"]
    )
    st = store_factory(default_rollout_config=default)
    ar = await st.start_rollout(1)
    r = await st.enqueue_rollout(2)
    (m,) = await st.enqueue_many_rollouts([EnqueueRolloutRequest(input=3)])
    explicit = await st.enqueue_rollout(4, config=RolloutConfig())
    assert ar.config == r.config == m.config == default
    assert explicit.config == RolloutConfig()
    # A copy: mutating the default afterwards does not change stored rollouts; the attribute is settable.
    default.max_attempts = 9
    assert (await st.get_rollout_by_id(r.rollout_id)).config.max_attempts == 3  # type: ignore[union-attr]
    st.default_rollout_config = None
    assert (await st.enqueue_rollout(5)).config == RolloutConfig()


async def test_resources_resolution_for_start_and_enqueue(store):
    none = await store.enqueue_rollout(0)
    assert (none.resources_id, none.resources_version) == (None, None)
    first = await store.add_resources(_prompt("a {x}"))
    second = await store.add_resources(_prompt("b {x}"))
    await store.update_resources(first.resources_id, _prompt("a2 {x}"))  # first is now the latest, version 2
    ar = await store.start_rollout(1)
    r = await store.enqueue_rollout(2)
    (m,) = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=3)])
    for x in (ar, r, m):
        assert (x.resources_id, x.resources_version) == (first.resources_id, 2)
    given = await store.enqueue_rollout(4, resources_id=second.resources_id)
    assert (given.resources_id, given.resources_version) == (second.resources_id, 1)
    unknown = await store.start_rollout(5, resources_id="does-not-exist")
    assert (unknown.resources_id, unknown.resources_version) == ("does-not-exist", None)


async def test_bad_input_writes_nothing(store):
    with pytest.raises(TypeError, match="input"):
        await store.enqueue_rollout({"tags": {1, 2}})
    with pytest.raises(ValueError, match="input"):
        await store.start_rollout({"x": float("nan")})
    with pytest.raises(ValidationError):
        await store.enqueue_rollout(1, mode="bogus")
    with pytest.raises(TypeError, match=r"requests\[1\]"):
        await store.enqueue_many_rollouts(
            [EnqueueRolloutRequest(input=1), EnqueueRolloutRequest(input={b"k"})]
        )
    stats = await store.statistics()
    assert (stats["total_rollouts"], stats["total_attempts"]) == (0, 0)


# --- §2.3 enqueue and idempotency keys --------------------------------------------------------


async def test_enqueue_returns_plain_queued_rollout_without_attempt(store, clock):
    r = await store.enqueue_rollout({"x": 1}, mode="test", metadata={"k": "v"})
    assert type(r) is Rollout
    assert (r.status, r.end_time, r.start_time, r.mode, r.idempotency_key) == (
        "queuing",
        None,
        clock(),
        "test",
        None,
    )
    assert await store.get_latest_attempt(r.rollout_id) is None
    assert len(await store.query_attempts(r.rollout_id)) == 0
    got = await store.get_rollout_by_id(r.rollout_id)
    assert type(got) is Rollout and got == r


async def test_enqueue_many_in_request_order_and_empty(store):
    assert await store.enqueue_many_rollouts([]) == []
    out = await store.enqueue_many_rollouts(
        [EnqueueRolloutRequest(input=i, mode="train", metadata={"i": i}) for i in range(4)]
    )
    assert [r.input for r in out] == [0, 1, 2, 3]
    assert all(type(r) is Rollout and r.status == "queuing" and r.metadata == {"i": r.input} for r in out)
    assert len({r.rollout_id for r in out}) == 4


async def test_known_idempotency_key_returns_existing_rollout_unchanged(store, clock):
    first = await store.enqueue_rollout({"v": 1}, idempotency_key="sample-1", metadata={"a": 1})
    assert first.idempotency_key == "sample-1"
    clock.advance(5)
    again = await store.enqueue_rollout(
        {"v": 2}, idempotency_key="sample-1", config=RolloutConfig(max_attempts=4)
    )
    assert again == first
    assert (await store.statistics())["total_rollouts"] == 1

    # Whatever its status: a claimed, finished rollout is returned as it is now; the queue is unchanged.
    ar = await store.dequeue_rollout()
    assert ar is not None
    await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")
    done = await store.enqueue_rollout({"v": 3}, mode="val", idempotency_key="sample-1")
    assert type(done) is Rollout
    assert (done.rollout_id, done.status, done.input, done.mode, done.end_time) == (
        first.rollout_id,
        "succeeded",
        {"v": 1},
        None,
        clock(),
    )
    stats = await store.statistics()
    assert (stats["total_rollouts"], stats["queue_depth"], stats["total_attempts"]) == (1, 0, 1)
    (found,) = await store.query_rollouts(idempotency_key_in=["sample-1"])
    assert found.rollout_id == first.rollout_id


async def test_idempotency_keys_in_batches(store):
    existing = await store.enqueue_rollout("old", idempotency_key="k0")
    out = await store.enqueue_many_rollouts(
        [
            EnqueueRolloutRequest(input="a", idempotency_key="k1"),
            EnqueueRolloutRequest(input="b", idempotency_key="k0"),
            EnqueueRolloutRequest(input="c"),
            EnqueueRolloutRequest(input="d", idempotency_key="k1"),
            EnqueueRolloutRequest(input="e"),
        ]
    )
    assert out[1] == existing
    assert out[3].rollout_id == out[0].rollout_id and out[0].input == "a"
    assert out[2].rollout_id != out[4].rollout_id
    assert [r.idempotency_key for r in out] == ["k1", "k0", None, "k1", None]
    assert (await store.statistics())["total_rollouts"] == 4
    # Queue order = request order of the new rollouts, behind the existing one.
    claimed = [(await store.dequeue_rollout()).rollout_id for _ in range(4)]  # type: ignore[union-attr]
    assert claimed == [existing.rollout_id, out[0].rollout_id, out[2].rollout_id, out[4].rollout_id]


@pytest.mark.parametrize("bad", ["", 5])
async def test_bad_idempotency_key(store, bad):
    with pytest.raises(ValueError, match="idempotency_key"):
        await store.enqueue_rollout(1, idempotency_key=bad)
    assert (await store.statistics())["total_rollouts"] == 0


async def test_concurrent_enqueues_of_one_key_create_one_rollout(store):
    results = await asyncio.gather(
        *(store.enqueue_rollout({"i": i}, idempotency_key="same") for i in range(20))
    )
    assert len({r.rollout_id for r in results}) == 1
    assert all(r.idempotency_key == "same" for r in results)
    stats = await store.statistics()
    assert (stats["total_rollouts"], stats["queue_depth"]) == (1, 1)


async def test_concurrent_enqueues_of_one_key_from_several_instances(backend, store_factory):
    if not backend.persistent:
        pytest.skip("an in-memory database belongs to one instance")
    stores = [store_factory() for _ in range(4)]
    results = await asyncio.gather(
        *(stores[i % 4].enqueue_rollout(i, idempotency_key="shared") for i in range(20)),
        *(
            stores[i % 4].enqueue_many_rollouts([EnqueueRolloutRequest(input=i, idempotency_key="shared")])
            for i in range(8)
        ),
    )
    ids = {r.rollout_id for r in results[:20]} | {batch[0].rollout_id for batch in results[20:]}  # type: ignore[index]
    assert len(ids) == 1
    assert (await stores[0].statistics())["total_rollouts"] == 1


# --- §2.5 start_attempt -----------------------------------------------------------------------


async def test_start_attempt_ignores_max_attempts_and_reopens_finished_rollouts(store, clock):
    ar = await store.start_rollout(1, config=RolloutConfig(max_attempts=1))
    await store.update_attempt(ar.rollout_id, ar.attempt.attempt_id, status="succeeded")
    finished = await store.get_rollout_by_id(ar.rollout_id)
    assert finished is not None and finished.status == "succeeded" and finished.end_time == clock()
    end = finished.end_time
    for expected_seq, status in ((2, "failed"), (3, "cancelled"), (4, None)):
        clock.advance(1)
        if status is not None:
            await store.update_rollout(ar.rollout_id, status=status)
            end = clock()
        again = await store.start_attempt(ar.rollout_id, worker_id="Worker-1")
        assert type(again) is AttemptedRollout
        assert (again.status, again.end_time) == ("preparing", end)
        assert (again.attempt.sequence_id, again.attempt.status, again.attempt.start_time) == (
            expected_seq,
            "preparing",
            clock(),
        )
        assert again.attempt.worker_id == "Worker-1"
        w = await store.get_worker_by_id("Worker-1")
        assert w is not None and (w.status, w.current_attempt_id, w.last_busy_time) == (
            "busy",
            again.attempt.attempt_id,
            clock(),
        )
        assert w.last_dequeue_time is None


async def test_start_attempt_takes_a_queued_rollout_out_of_the_queue(store):
    r = await store.enqueue_rollout(1)
    ar = await store.start_attempt(r.rollout_id)
    assert ar.status == "preparing" and ar.attempt.sequence_id == 1
    assert (await store.statistics())["queue_depth"] == 0
    assert await store.dequeue_rollout() is None


# --- §2.6 update_rollout ----------------------------------------------------------------------


async def test_update_rollout_replaces_each_given_field(store):
    await store.add_resources(_prompt("{x}"))
    r = await store.enqueue_rollout({"x": 1}, mode="train", metadata={"a": 1, "b": 2})
    assert r.resources_id is not None
    up = await store.update_rollout(r.rollout_id, metadata={"c": 3})
    assert type(up) is Rollout and up.metadata == {"c": 3}  # replaced, not merged
    up = await store.update_rollout(r.rollout_id, input=None, mode=None, resources_id=None, metadata=None)
    assert (up.input, up.mode, up.resources_id, up.resources_version, up.metadata) == (
        None,
        None,
        None,
        None,
        None,
    )
    up = await store.update_rollout(r.rollout_id, input=[1, (2, 3)], mode="val")
    assert (up.input, up.mode) == ([1, [2, 3]], "val")
    new_config = RolloutConfig(timeout_seconds=1.5, max_attempts=4, retry_condition=["timeout"])
    up = await store.update_rollout(r.rollout_id, config=new_config)
    assert up.config == new_config
    assert up.status == "queuing" and up.idempotency_key is None
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got == up
    # Nothing given: nothing changes.
    assert await store.update_rollout(r.rollout_id) == up


async def test_update_rollout_resources_id_re_resolves_version(store):
    res = await store.add_resources(_prompt("{x}"))
    await store.update_resources(res.resources_id, _prompt("v2 {x}"))
    r = await store.enqueue_rollout(1, resources_id="other")
    assert r.resources_version is None
    up = await store.update_rollout(r.rollout_id, resources_id=res.resources_id)
    assert (up.resources_id, up.resources_version) == (res.resources_id, 2)
    up = await store.update_rollout(r.rollout_id, resources_id="missing")
    assert (up.resources_id, up.resources_version) == ("missing", None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"status": None},
        {"status": "bogus"},
        {"config": None},
        {"mode": "bogus"},
        {"config": {"max_attempts": 0}},
    ],
)
async def test_update_rollout_invalid_values(store, kwargs):
    r = await store.enqueue_rollout(1)
    with pytest.raises(ValidationError):
        await store.update_rollout(r.rollout_id, **kwargs)
    assert await store.get_rollout_by_id(r.rollout_id) == r


async def test_update_rollout_end_time_rules(store, clock):
    r = await store.enqueue_rollout(1)
    up = await store.update_rollout(r.rollout_id, status="running")
    assert up.end_time is None
    for status in ("succeeded", "failed", "cancelled"):
        clock.advance(1)
        up = await store.update_rollout(r.rollout_id, status=status)
        assert (up.status, up.end_time) == (status, clock())  # overwritten each time
    finished_at = clock()
    clock.advance(1)
    for status in ("running", "queuing", "preparing", "requeuing"):
        up = await store.update_rollout(r.rollout_id, status=status)
        assert (up.status, up.end_time) == (status, finished_at)  # never cleared


async def test_update_rollout_has_no_transition_guard_and_leaves_attempts_alone(store):
    ar = await store.start_rollout(1, worker_id="w")
    await store.add_span(_span(ar.rollout_id, ar.attempt.attempt_id))
    up = await store.update_rollout(ar.rollout_id, status="succeeded")
    assert up.status == "succeeded"
    att = await store.get_latest_attempt(ar.rollout_id)
    assert att is not None and att.status == "running" and att.end_time is None
    assert (await store.get_worker_by_id("w")).status == "busy"  # type: ignore[union-attr]
    for status in ("cancelled", "queuing", "preparing", "failed", "requeuing", "running", "cancelled"):
        assert (await store.update_rollout(ar.rollout_id, status=status)).status == status


# --- §2.8 status machine (rollout side) -------------------------------------------------------


async def test_span_from_latest_attempt_promotes_in_flight_and_queued_rollouts(store):
    # preparing -> running
    ar = await store.start_rollout(1)
    await store.add_span(_span(ar.rollout_id, ar.attempt.attempt_id, 1))
    assert (await store.get_rollout_by_id(ar.rollout_id)).status == "running"  # type: ignore[union-attr]
    # requeuing -> running (and out of the queue)
    r = await store.enqueue_rollout(2, config=RETRY)
    c = await store.dequeue_rollout()
    assert c is not None
    await store.update_attempt(r.rollout_id, c.attempt.attempt_id, status="failed")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"  # type: ignore[union-attr]
    await store.add_span(_span(r.rollout_id, c.attempt.attempt_id, 1))
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got is not None and got.status == "running" and got.end_time is None
    assert (await store.statistics())["queue_depth"] == 0


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
async def test_span_never_promotes_a_finished_rollout(store, status):
    ar = await store.start_rollout(1)
    up = await store.update_rollout(ar.rollout_id, status=status)
    await store.add_span(_span(ar.rollout_id, ar.attempt.attempt_id, 1))
    got = await store.get_rollout_by_id(ar.rollout_id)
    assert got is not None and (got.status, got.end_time) == (status, up.end_time)


async def test_span_from_an_older_attempt_does_not_move_the_rollout(store):
    ar = await store.start_rollout(1)
    second = await store.start_attempt(ar.rollout_id)
    await store.update_rollout(ar.rollout_id, status="requeuing")
    await store.add_span(_span(ar.rollout_id, ar.attempt.attempt_id, 1))
    got = await store.get_rollout_by_id(ar.rollout_id)
    assert got is not None and got.status == "requeuing"
    assert got.attempt.attempt_id == second.attempt.attempt_id  # type: ignore[union-attr]
    # The older attempt itself did become running.
    atts = await store.query_attempts(ar.rollout_id)
    assert [a.status for a in atts] == ["running", "preparing"]
    assert (await store.statistics())["queue_depth"] == 1
