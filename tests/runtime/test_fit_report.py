"""fit() shows progress and a summary, returns the summary, reports failing agents by error type."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from lightning_sql import Baseline, LitAgent, PromptTemplate, RolloutConfig, Trainer
from lightning_sql.runtime.algorithm import publish_resources
from lightning_sql.runtime.summary import FitSummary
from lightning_sql.types import Rollout
from tests.runtime import agents

PROMPT = {"prompt_template": PromptTemplate(template="double {x}", engine="f-string")}
ONE_ATTEMPT = RolloutConfig(unresponsive_seconds=60, max_attempts=1)


class RaisesOnOdd(LitAgent[dict[str, Any]]):
    """Odd inputs raise KeyError, multiples of 4 raise ZeroDivisionError, the rest get a reward."""

    def rollout(self, task: dict[str, Any], resources: Any, rollout: Rollout) -> float:
        if task["x"] % 2:
            return float({"a": 1}["missing-" + str(task["x"])])
        if task["x"] % 4 == 0:
            return 1 / 0
        return 0.5


def _trainer(store: Any, **kwargs: Any) -> Trainer:
    return Trainer(
        store=store,
        n_runners=2,
        algorithm=Baseline(polling_interval=0.2, span_verbosity="none"),
        runner={"type": "agent", "poll_interval": 0.2, "heartbeat_interval": 1.0},
        rollout_config=ONE_ATTEMPT,
        initial_resources=PROMPT,
        **kwargs,
    )


def test_a_raising_agent_is_reported_by_error_type(
    mp_backend: Any, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    store = mp_backend.open(run="raising")
    caplog.set_level(logging.INFO, logger="lightning_sql")
    try:
        summary = _trainer(store).fit(RaisesOnOdd(), [{"x": i} for i in range(12)], [{"x": 101}, {"x": 102}])
        out = capsys.readouterr().out
    finally:
        asyncio.run(store.close())
    assert isinstance(summary, FitSummary)
    assert summary.counts == {("train", "failed"): 9, ("train", "succeeded"): 3, ("val", "failed"): 1, ("val", "succeeded"): 1}
    assert summary.mean_reward == {"train": 0.5, "val": 0.5}
    assert [(g.error_type, g.count) for g in summary.failures] == [("KeyError", 7), ("ZeroDivisionError", 3)]
    key_error = summary.failures[0]
    assert key_error.message == "'missing-1'"  # the first occurrence, in the order the rollouts were enqueued
    assert key_error.first_rollout_id.startswith("ro-")
    assert 'return float({"a": 1}["missing-" + str(task["x"])])' in key_error.traceback_tail
    assert key_error.traceback_tail.splitlines()[-1] == "KeyError: 'missing-1'"
    # Printed: the table, the failure groups with their first rollout and the end of the traceback.
    assert "7 failed with KeyError (first: rollout " + key_error.first_rollout_id in out
    assert "3 failed with ZeroDivisionError" in out
    assert "ZeroDivisionError: division by zero" in out
    assert "14 rollouts finished in this fit" in out
    # The adapter is not asked to build a trace of a failed rollout.
    assert "No spans provided" not in caplog.text


def test_fit_shows_progress_and_summary_by_default_and_can_be_quiet(
    mp_backend: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    store = mp_backend.open(run="talkative")
    try:
        summary = _trainer(store).fit(agents.sync_agent, [{"x": i} for i in range(6)], [{"x": 50}])
        out = capsys.readouterr().out
        assert "run talkative" in out and "7/7" in out  # the bar, as it ended
        assert "7 rollouts finished in this fit" in out
        assert summary.count(status="succeeded") == 7 and summary.mean_reward == {"train": 1.0, "val": 1.0}

        quiet = _trainer(store, progress=False, summary=False).fit(
            agents.sync_agent, [{"x": i} for i in range(6)], [{"x": 50}]
        )
        assert capsys.readouterr().out == ""
        assert quiet.run_was_finished and quiet.new_this_fit == 0 and quiet.total == 7
    finally:
        asyncio.run(store.close())


def test_a_rerun_of_a_finished_run_says_so_and_publishes_nothing(
    mp_backend: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    store = mp_backend.open(run="rerun")
    try:
        for _ in range(3):
            _trainer(store).fit(agents.sync_agent, [{"x": i} for i in range(4)])
        outputs = capsys.readouterr().out

        async def versions() -> list[int]:
            return [u.version for u in await store.query_resources(resources_id="default")]

        assert asyncio.run(versions()) == [1]
        assert outputs.count("Run rerun is complete") == 2
        assert outputs.count("The run was already complete: nothing ran (4 rollouts finished before).") == 2
    finally:
        asyncio.run(store.close())


def test_publish_resources_adds_a_version_only_for_new_content(backend: Any) -> None:
    async def go() -> None:
        store = backend.open(run="publish")
        try:
            first = await publish_resources(store, "default", PROMPT)
            same = await publish_resources(store, "default", dict(PROMPT))
            assert (first.version, same.version) == (1, 1)
            other = {"prompt_template": PromptTemplate(template="triple {x}", engine="f-string")}
            assert (await publish_resources(store, "default", other)).version == 2
            assert (await publish_resources(store, "default", PROMPT)).version == 3  # back to the first: new version
        finally:
            await store.close()

    asyncio.run(go())


def test_an_empty_trace_is_named_as_such(mp_backend: Any, caplog: pytest.LogCaptureFixture) -> None:
    class Silent(LitAgent[dict[str, Any]]):
        def rollout(self, task: dict[str, Any], resources: Any, rollout: Rollout) -> None:
            return None

    store = mp_backend.open(run="silent")
    caplog.set_level(logging.INFO, logger="lightning_sql")
    try:
        _trainer(store, progress=False, summary=False, tracer="noop").fit(Silent(), [{"x": 1}])
    finally:
        asyncio.run(store.close())
    assert "succeeded but stored no spans" in caplog.text
    assert "No spans provided" not in caplog.text


def test_the_summary_reads_recorded_rewards_and_falls_back_to_spans(backend: Any) -> None:
    from lightning_sql import emit_reward
    from lightning_sql.runtime.runner import FINAL_REWARD_KEY
    from lightning_sql.runtime.summary import collect_summary

    async def go() -> None:
        store = backend.open(run="rewards")
        try:
            # Written through the store API alone (no runner): the reward is only in a span.
            by_hand = await store.start_rollout({"x": 1}, mode="val")
            span = emit_reward(0.25, propagate=False)
            span.rollout_id, span.attempt_id, span.sequence_id = by_hand.rollout_id, by_hand.attempt.attempt_id, 1
            await store.add_span(span)
            await store.update_attempt(by_hand.rollout_id, by_hand.attempt.attempt_id, status="succeeded")
            # As a runner reports it: the reward recorded with the attempt (and no span to read).
            recorded = await store.start_rollout({"x": 2}, mode="train")
            await store.update_attempt(
                recorded.rollout_id, recorded.attempt.attempt_id, status="succeeded", metadata={FINAL_REWARD_KEY: 0.75}
            )
            summary = await collect_summary(store, "rewards")
            assert summary.mean_reward == {"train": 0.75, "val": 0.25}
        finally:
            await store.close()

    asyncio.run(go())


def test_runners_record_the_final_reward_with_the_attempt(mp_backend: Any) -> None:
    store = mp_backend.open(run="recorded")
    try:
        _trainer(store, progress=False, summary=False).fit(agents.async_agent, [{"x": 1}, {"x": 2}])

        async def read() -> list[Any]:
            return [r.attempt.metadata for r in await store.query_rollouts()]  # type: ignore[union-attr]

        assert asyncio.run(read()) == [{"final_reward": 0.5}, {"final_reward": 0.5}]
    finally:
        asyncio.run(store.close())


def test_a_huge_error_message_is_cut_in_the_summary(mp_backend: Any, capsys: pytest.CaptureFixture[str]) -> None:
    store = mp_backend.open(run="huge-error")
    try:
        summary = _trainer(store).fit(agents.AlwaysFails(), [{"x": 1}, {"x": 2}])
        out = capsys.readouterr().out
    finally:
        asyncio.run(store.close())
    (group,) = summary.failures
    assert group.error_type == "ValueError" and group.count == 2
    assert group.message.startswith("boom xxx") and len(group.message) == 301 and group.message.endswith("…")
    assert all(len(line) <= 301 for line in group.traceback_tail.splitlines())
    assert group.traceback_tail.splitlines()[-1].startswith("ValueError: boom xxx")
    assert len(out) < 5_000  # the 50,000-character message is in the store, not on the screen
