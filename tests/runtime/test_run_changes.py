"""A resumed run with other data is refused (nothing enqueued) unless accepted; unchanged runs resume as before."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest

from lightning_sql import Baseline, PromptTemplate, RolloutConfig, Trainer
from lightning_sql.runtime.fingerprint import FINGERPRINT_KEY, RunChangedError
from tests.runtime import agents

PROMPT = {"prompt_template": PromptTemplate(template="double {x}", engine="f-string")}
LEASE = RolloutConfig(unresponsive_seconds=60, max_attempts=3, retry_condition=["unresponsive"])


def _fit(store: Any, train: list[Any], val: list[Any], **kwargs: Any) -> Any:
    kwargs.setdefault("initial_resources", PROMPT)
    trainer = Trainer(
        store=store,
        n_runners=2,
        algorithm=Baseline(polling_interval=0.2, span_verbosity="none"),
        runner={"type": "agent", "poll_interval": 0.2, "heartbeat_interval": 1.0},
        rollout_config=LEASE,
        progress=False,
        summary=False,
        **kwargs,
    )
    return trainer.fit(agents.sync_agent, train, val)


def _state(store: Any) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        rollouts = list(await store.query_rollouts())
        attempts = {r.rollout_id: len(await store.query_attempts(r.rollout_id)) for r in rollouts}
        latest = await store.get_resources_by_id("default")
        run = await store.get_run(store.run)
        return {"rollouts": rollouts, "attempts": attempts, "version": latest.version if latest else None, "run": run}

    return asyncio.run(read())


def _items(n: int, offset: int = 0) -> list[dict[str, int]]:
    return [{"x": offset + i} for i in range(n)]


def test_more_train_items_are_refused_and_nothing_is_enqueued(mp_backend: Any) -> None:
    store = mp_backend.open(run="grown")
    try:
        _fit(store, _items(20), _items(10, 100))
        before = _state(store)
        assert len(before["rollouts"]) == 30
        with pytest.raises(RunChangedError) as caught:
            _fit(store, _items(25), _items(10, 100))
        message = str(caught.value)
        assert "'grown'" in message
        assert "train dataset 20 items → 25 items" in message
        assert "val" not in message.split("Resuming")[0]  # only what changed is named
        for way_on in ("new run name", "delete_run('grown')", "accept_changes=True"):
            assert way_on in message
        after = _state(store)
        assert len(after["rollouts"]) == 30
        assert after["attempts"] == before["attempts"]
        assert after["version"] == before["version"] == 1
    finally:
        asyncio.run(store.close())


def test_a_reshuffle_is_refused(mp_backend: Any) -> None:
    store = mp_backend.open(run="shuffled")
    try:
        train = _items(12)
        _fit(store, train, [])
        shuffled = list(train)
        random.Random(3).shuffle(shuffled)
        assert shuffled != train
        with pytest.raises(RunChangedError, match="the same number of items \\(12\\), other content or order"):
            _fit(store, shuffled, [])
        assert len(_state(store)["rollouts"]) == 12
        with pytest.raises(RunChangedError, match="initial resources changed"):
            _fit(store, train, [], initial_resources={"prompt_template": PromptTemplate(template="x {x}", engine="f-string")})
    finally:
        asyncio.run(store.close())


def test_an_unchanged_run_resumes_and_a_finished_one_does_nothing(mp_backend: Any) -> None:
    store = mp_backend.open(run="same")
    try:
        first = _fit(store, _items(8), _items(4, 50))
        assert first.new_this_fit == 12 and first.finished_before == 0
        before = _state(store)
        fingerprint = (before["run"].metadata or {})[FINGERPRINT_KEY]
        assert fingerprint["train"]["items"] == 8 and fingerprint["val"]["items"] == 4
        again = _fit(store, _items(8), _items(4, 50))
        after = _state(store)
        assert again.run_was_finished and again.new_this_fit == 0 and again.finished_before == 12
        assert [r.rollout_id for r in after["rollouts"]] == [r.rollout_id for r in before["rollouts"]]
        assert after["attempts"] == before["attempts"]
        assert after["version"] == 1  # the identical initial resources were not published again
    finally:
        asyncio.run(store.close())


def test_accepting_the_change_runs_only_the_new_samples(mp_backend: Any) -> None:
    store = mp_backend.open(run="accepted")
    try:
        _fit(store, _items(20), _items(10, 100))
        before = _state(store)
        # Five more train items, and the val items in another order: positional keys would mislabel them.
        val = list(reversed(_items(10, 100)))
        summary = _fit(store, _items(25), val, accept_changes=True)
        after = _state(store)
        assert summary.new_this_fit == 5
        assert len(after["rollouts"]) == 35
        keys = Counter(r.idempotency_key for r in after["rollouts"])
        assert set(keys.values()) == {1}
        for rollout in before["rollouts"]:
            assert after["attempts"][rollout.rollout_id] == before["attempts"][rollout.rollout_id]
        new_inputs = sorted(r.input["x"] for r in after["rollouts"] if r.rollout_id not in before["attempts"])
        assert new_inputs == [20, 21, 22, 23, 24]
        # The accepted data is now the run's: the same call resumes without the option.
        assert _fit(store, _items(25), val).new_this_fit == 0
    finally:
        asyncio.run(store.close())


def test_a_run_without_a_fingerprint_is_refused_unless_accepted(mp_backend: Any) -> None:
    store = mp_backend.open(run="legacy")
    try:

        async def legacy() -> None:  # as an earlier version left it: positional keys, no fingerprint
            for i in range(3):
                await store.enqueue_rollout({"x": i}, mode="train", idempotency_key=f"0:train:{i}")

        asyncio.run(legacy())
        with pytest.raises(RunChangedError, match="holds 3 rollouts but no record of the datasets"):
            _fit(store, _items(3), [])
        assert len(_state(store)["rollouts"]) == 3
        summary = _fit(store, _items(3), [], accept_changes=True)
        assert summary.new_this_fit == 6  # the three queued legacy rollouts ran too, next to ours
        assert _fit(store, _items(3), []).new_this_fit == 0
    finally:
        asyncio.run(store.close())
