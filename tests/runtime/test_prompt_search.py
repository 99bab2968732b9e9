"""PromptSearch: greedy over edits, one resources version per candidate, resumable, refuses bad setups."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lightning_sql import LitAgent, PromptSearch, PromptTemplate, RolloutConfig, Trainer
from lightning_sql.types import Rollout

START = PromptTemplate(template="Q: {x}", engine="f-string")


class KeywordAgent(LitAgent[dict[str, Any]]):
    """Reward 0.5 per keyword ('alpha', 'beta') the prompt holds; a prompt with 'crash' makes it raise."""

    def rollout(self, task: dict[str, Any], resources: Any, rollout: Rollout) -> float:
        prompt = resources["prompt"].format(x=task["x"])
        if "crash" in prompt:
            raise RuntimeError("this prompt breaks the agent")
        return 0.5 * ("alpha" in prompt) + 0.5 * ("beta" in prompt)


def _fit(store: Any, search: PromptSearch, **kwargs: Any) -> Any:
    trainer = Trainer(
        store=store,
        n_runners=2,
        algorithm=search,
        runner={"type": "agent", "poll_interval": 0.2, "heartbeat_interval": 1.0},
        rollout_config=RolloutConfig(unresponsive_seconds=60, max_attempts=1),
        initial_resources={"prompt": START},
        progress=False,
        summary=False,
        **kwargs,
    )
    return trainer.fit(KeywordAgent(), [{"x": i} for i in range(4)], [{"x": 100}, {"x": 101}])


def _search(**kwargs: Any) -> PromptSearch:
    kwargs.setdefault("edits", ["noise", "alpha", "crash", "beta"])
    return PromptSearch(polling_interval=0.2, span_verbosity="none", **kwargs)


def test_search_keeps_the_best_edit_each_round_and_versions_every_candidate(mp_backend: Any) -> None:
    store = mp_backend.open(run="search")
    try:
        search = _search()
        summary = _fit(store, search)
        stages = [(s.stage, s.version, s.edit, s.mode, s.mean_reward) for s in search.stages]
        assert stages == [
            (0, 1, None, "train", 0.0),
            (0, 1, None, "val", 0.0),
            (1, 2, "noise", "train", 0.0),
            (2, 3, "alpha", "train", 0.5),
            (3, 4, "crash", "train", 0.0),  # failed rollouts count 0: a breaking prompt never wins
            (4, 5, "beta", "train", 0.5),  # a tie does not replace the earlier candidate
            (5, 6, "noise", "train", 0.5),
            (6, 7, "crash", "train", 0.0),
            (7, 8, "beta", "train", 1.0),
            (8, 9, "noise", "train", 1.0),
            (9, 10, "crash", "train", 0.0),  # round 3 brings nothing: the search stops
            (10, 11, None, "val", 1.0),
        ]
        assert search.best_template == "beta alpha Q: {x}"
        assert summary.count(status="failed") == 12

        async def versions() -> list[str]:
            found = [await store.get_resources_by_id("prompt-search", version=v) for v in range(1, 12)]
            return [u.resources["prompt"].template for u in found if u is not None]

        templates = asyncio.run(versions())
        assert templates[0] == "Q: {x}" and templates[3] == "crash Q: {x}" and templates[10] == "beta alpha Q: {x}"
        # Every rollout ran with the version current when it was enqueued.
        assert {(v.version, v.mode): v.rollouts for v in summary.versions}[(11, "val")] == 2

        # A rerun of the finished search walks the same stages from the store and publishes nothing.
        again = _search()
        assert _fit(store, again).new_this_fit == 0
        assert [(s.stage, s.version, s.mean_reward) for s in again.stages] == [
            (s[0], s[1], s[4]) for s in stages
        ]
        latest = asyncio.run(store.get_resources_by_id("prompt-search"))
        assert latest is not None and latest.version == 11
    finally:
        asyncio.run(store.close())


def test_other_edits_are_a_changed_run(mp_backend: Any) -> None:
    from lightning_sql import RunChangedError

    store = mp_backend.open(run="search-edits")
    try:
        _fit(store, _search(edits=["alpha"]))
        with pytest.raises(RunChangedError, match="algorithm settings"):
            _fit(store, _search(edits=["alpha", "beta"]))
    finally:
        asyncio.run(store.close())


def test_bad_setups_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        PromptSearch(edits=[])
    with pytest.raises(ValueError, match="distinct"):
        PromptSearch(edits=["a", "a"])
    search = PromptSearch()
    with pytest.raises(ValueError, match="exactly one PromptTemplate"):
        search._prompt({})
    with pytest.raises(ValueError, match="no PromptTemplate named 'other'"):
        PromptSearch(resource_name="other")._prompt({"prompt": START})
    assert PromptSearch.propose(START, "Use {braces}.").format(x=1) == "Use {braces}. Q: 1"
