"""Text from the database prints as itself: never as rich markup, never as raw control characters.

Issue 34 item 9: a run named ``[/]`` crashed `runs`, ``[red]good[/red]`` showed as "good", ESC
reached the terminal.  Every command that prints stored text runs here on SQLite and PostgreSQL,
on a terminal (``FORCE_COLOR``: rich tables) and off one (plain lines).
"""

from __future__ import annotations

import asyncio

import pytest

from lightning_sql import RolloutConfig, SqlLightningStore
from tests.analysis.dataset import make_span
from tests.analysis.fixtures import Populated
from tests.cli.runner import invoke, with_store

RUNS = ["[/]", "[red]good[/red]", "esc\x1b[31mred\x07"]
SPAN_NAME = "[bold]step[/] \x1b[2Jclear"
WORKER = "w[/]"
ERROR_MESSAGE = "[/] broke \x1b[0mreset"

# How each stored string must appear: markup as typed, control characters escaped.
SHOWN = {
    "[/]": "[/]",
    "[red]good[/red]": "[red]good[/red]",
    "esc\x1b[31mred\x07": "esc\\x1b[31mred\\x07",
    SPAN_NAME: "[bold]step[/] \\x1b[2Jclear",
    WORKER: WORKER,
    ERROR_MESSAGE: "[/] broke \\x1b[0mreset",
}
RAW = ["esc\x1b", "\x07", "\x1b[2J", "\x1b[0mreset"]

MODES = {"terminal": {"FORCE_COLOR": "1"}, "plain": {}}


async def _write_run(store: SqlLightningStore) -> str:
    await store.enqueue_rollout({"q": 1}, config=RolloutConfig(max_attempts=1))
    claimed = await store.dequeue_rollout(worker_id=WORKER)
    assert claimed is not None
    await store.add_many_spans(
        [make_span(claimed.rollout_id, claimed.attempt.attempt_id, 1, SPAN_NAME, 100.0, 101.0, {}, trace_id="ab" * 16)]
    )
    await store.update_attempt(
        claimed.rollout_id,
        claimed.attempt.attempt_id,
        status="failed",
        metadata={"error": {"type": "ValueError", "message": ERROR_MESSAGE, "traceback": f"Traceback\n  {ERROR_MESSAGE}\n"}},
    )
    return claimed.rollout_id


@pytest.fixture
def hostile(fresh: Populated) -> tuple[Populated, dict[str, str]]:
    rollouts = {run: asyncio.run(with_store(fresh, run, _write_run)) for run in RUNS}
    return fresh, rollouts


def _assert_shown_safely(output: str, *stored: str) -> None:
    for text in stored:
        assert SHOWN[text] in output, (text, output)
    for raw in RAW:
        assert raw not in output, (raw, output)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_runs_lists_hostile_names_as_typed(hostile: tuple[Populated, dict[str, str]], mode: str) -> None:
    spec, _ = hostile
    result = invoke(["runs", *spec.cli_args()], env=MODES[mode])
    assert result.exit_code == 0, result.output
    _assert_shown_safely(result.stdout, *RUNS)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_command_prints_stored_text_as_itself(hostile: tuple[Populated, dict[str, str]], mode: str) -> None:
    spec, rollouts = hostile
    env = MODES[mode]
    for run, rollout_id in rollouts.items():
        args = ["--run", run, *spec.cli_args()]
        status = invoke(["status", *args], env=env)
        assert status.exit_code == 0, status.output
        _assert_shown_safely(status.stdout, run, WORKER)

        listed = invoke(["rollouts", *args], env=env)
        assert listed.exit_code == 0, listed.output
        _assert_shown_safely(listed.stdout, WORKER)

        spans = invoke(["spans", *args], env=env)
        assert spans.exit_code == 0, spans.output
        _assert_shown_safely(spans.stdout, SPAN_NAME)

        shown = invoke(["show", rollout_id, *args], env=env)
        assert shown.exit_code == 0, shown.output
        _assert_shown_safely(shown.stdout, run, SPAN_NAME, WORKER, ERROR_MESSAGE)

