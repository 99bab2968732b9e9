"""What a run amounts to: counts by mode and status, rewards, failures grouped by error type.

``Trainer.fit`` returns a :class:`FitSummary` (and prints it unless told not to).  Everything here
is read through the public store API, mostly in one query: the rollouts with their latest attempt,
whose metadata holds the error of a failed attempt and the final reward of a succeeded one (both
written by the runner).  Rollouts finished by other runners, without a recorded reward, have their
reward read from their spans.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from lightning_sql.runtime.adapter import reward_of
from lightning_sql.runtime.runner import FINAL_REWARD_KEY
from lightning_sql.types import FINISHED_STATUSES, AttemptedRollout, Rollout

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = [
    "FailureGroup",
    "FitSummary",
    "VersionStats",
    "collect_summary",
    "final_reward",
    "gather_chunked",
    "reward_bar",
    "version_table",
    "TRACEBACK_TAIL_LINES",
]

TRACEBACK_TAIL_LINES = 4  # the end of a traceback: the failing line of the agent and the error
READ_CONCURRENCY = 32  # per-rollout reads in flight while collecting a summary
BAR_WIDTH = 24  # characters of the widest reward bar
MESSAGE_CHARS = 300  # an error message or traceback line is cut here (the store keeps it whole)


@dataclass(frozen=True)
class FailureGroup:
    """Failed rollouts that share an error type, with the first one's details."""

    error_type: str
    count: int
    first_rollout_id: str
    message: str
    traceback_tail: str
    """The last lines of the first occurrence's traceback."""


@dataclass(frozen=True)
class VersionStats:
    """Rollouts of one mode that ran with one version of one resources id."""

    resources_id: str | None
    version: int | None
    mode: str
    rollouts: int
    succeeded: int
    mean_reward: float | None


@dataclass
class FitSummary:
    """The state of a run when ``fit`` returned."""

    run: str | None
    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    """Rollouts by (mode, status); mode ``"-"`` for rollouts without one."""
    mean_reward: dict[str, float | None] = field(default_factory=dict)
    """Mean final reward of succeeded rollouts, by mode (None: no rewards recorded)."""
    failures: list[FailureGroup] = field(default_factory=list)
    """Failed rollouts grouped by error type, most frequent first."""
    versions: list[VersionStats] = field(default_factory=list)
    """Rollouts and mean reward by resources version and mode, in publishing order."""
    finished_before: int = 0
    """Rollouts already finished when ``fit`` started (a resumed run)."""
    run_was_finished: bool = False
    """The run had been marked finished before this ``fit``."""
    wall_time_s: float | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def count(self, *, mode: str | None = None, status: str | None = None) -> int:
        """Rollouts with this mode and/or status."""
        return sum(
            n for (m, s), n in self.counts.items() if (mode is None or m == mode) and (status is None or s == status)
        )

    @property
    def finished(self) -> int:
        return sum(self.count(status=s) for s in FINISHED_STATUSES)

    @property
    def new_this_fit(self) -> int:
        """Rollouts that finished during this ``fit``."""
        return max(self.finished - self.finished_before, 0)

    @property
    def failed(self) -> int:
        return self.count(status="failed")

    def __rich__(self) -> RenderableType:
        return self.render()

    def render(self, *, include_versions: bool = True) -> RenderableType:
        """The summary as rich renderables: a table by mode and status, reward by version, then failures."""
        parts: list[RenderableType] = []
        title = f"run {escape(self.run)!s}" if self.run else "run"
        table = Table(title=title, title_justify="left")
        table.add_column("mode")
        table.add_column("status")
        table.add_column("rollouts", justify="right")
        table.add_column("mean reward", justify="right")
        for (mode, status), n in sorted(self.counts.items()):
            mean = self.mean_reward.get(mode) if status == "succeeded" else None
            table.add_row(escape(mode), status, str(n), "" if mean is None else f"{mean:.3f}")
        if not self.counts:
            table.add_row("-", "-", "0", "")
        parts.append(table)
        new = self.new_this_fit
        if self.run_was_finished and new == 0:
            parts.append(Text(f"The run was already complete: nothing ran ({self.finished} rollouts finished before)."))
        else:
            resumed = f", {self.finished_before} were finished before (resumed)" if self.finished_before else ""
            timing = f" in {self.wall_time_s:.1f} s" if self.wall_time_s is not None else ""
            parts.append(Text(f"{new} rollouts finished in this fit{timing}{resumed}."))
        if include_versions and len({(v.resources_id, v.version) for v in self.versions}) > 1:
            parts.append(version_table(self.versions))
        for group in self.failures:
            head = Text.assemble(
                (f"{group.count} failed with {group.error_type}", "bold red"),
                f" (first: rollout {group.first_rollout_id})",
                f": {group.message}" if group.message else "",
            )
            parts.append(head)
            if group.traceback_tail:
                parts.append(Text(group.traceback_tail, style="dim"))
        return Group(*parts)


def reward_bar(value: float | None, low: float, high: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar for ``value`` on the scale ``low``..``high`` (eighth-block resolution)."""
    if value is None:
        return ""
    span = high - low
    fraction = 1.0 if span <= 0 else min(max((value - low) / span, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    return "█" * full + ("" if rest == 0 else " ▏▎▍▌▋▊▉"[rest])


def version_table(versions: Sequence[VersionStats]) -> Table:
    """Mean reward by resources version and mode, with a bar per row (the run's learning curve)."""
    table = Table(title="reward by resources version", title_justify="left")
    table.add_column("resources")
    table.add_column("version", justify="right")
    table.add_column("mode")
    table.add_column("rollouts", justify="right")
    table.add_column("mean reward", justify="right")
    table.add_column("", min_width=BAR_WIDTH, no_wrap=True)
    rewards = [v.mean_reward for v in versions if v.mean_reward is not None]
    low = min(0.0, *rewards) if rewards else 0.0
    high = max(1.0, *rewards) if rewards else 1.0
    for v in versions:
        table.add_row(
            escape(v.resources_id or "-"),
            "-" if v.version is None else str(v.version),
            escape(v.mode),
            str(v.rollouts),
            "" if v.mean_reward is None else f"{v.mean_reward:.3f}",
            reward_bar(v.mean_reward, low, high),
        )
    return table


_MARKER_CHARS = frozenset(" ^~")


def _tail(traceback_text: str, lines: int = TRACEBACK_TAIL_LINES) -> str:
    """The last ``lines`` lines of a traceback, without the ``^^^^`` marker lines."""
    kept = [line for line in traceback_text.rstrip().splitlines() if line.strip() and set(line) - _MARKER_CHARS]
    tail = kept[-lines:]
    while len(tail) > 1 and not tail[0].lstrip().startswith("File ") and any(
        line.lstrip().startswith("File ") for line in tail[1:]
    ):
        tail = tail[1:]  # start at a frame, not half-way through one
    return "\n".join(line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS] + "…" for line in tail)


def _recorded_reward(rollout: Rollout) -> float | None:
    attempt = rollout.attempt if isinstance(rollout, AttemptedRollout) else None
    value = (attempt.metadata or {}).get(FINAL_REWARD_KEY) if attempt is not None else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


async def final_reward(store: LightningStore, rollout: Rollout) -> float | None:
    """The last reward of the rollout's latest attempt: as its runner recorded it, else from its spans."""
    recorded = _recorded_reward(rollout)
    if recorded is not None:
        return recorded
    spans = await store.query_spans(rollout.rollout_id, attempt_id="latest", name_contains="agentlightning.")
    values = [r for r in (reward_of(s) for s in spans) if r is not None]
    return values[-1] if values else None


async def _error_of(store: LightningStore, rollout: Rollout) -> dict[str, Any]:
    attempt = rollout.attempt if isinstance(rollout, AttemptedRollout) else await store.get_latest_attempt(rollout.rollout_id)
    if attempt is None:
        return {"type": "no attempt", "message": "the rollout failed before any attempt started"}
    error = (attempt.metadata or {}).get("error")
    if isinstance(error, dict) and error.get("type"):
        return error
    if attempt.status in ("unresponsive", "timeout"):
        return {"type": f"lease {attempt.status}", "message": "its last attempt ran out of lease or time"}
    return {"type": f"attempt {attempt.status}", "message": "no error was recorded"}


async def gather_chunked(coroutines: list[Any]) -> list[Any]:
    """``asyncio.gather`` in chunks of ``READ_CONCURRENCY`` (a store serves a bounded number at once)."""
    results: list[Any] = []
    for start in range(0, len(coroutines), READ_CONCURRENCY):
        results += await asyncio.gather(*coroutines[start : start + READ_CONCURRENCY])
    return results


async def collect_summary(store: LightningStore, run: str | None = None) -> FitSummary:
    """Read the run's rollouts, rewards and failures from ``store`` into a :class:`FitSummary`."""
    rollouts = list(await store.query_rollouts())
    rollouts.sort(key=lambda r: (r.start_time, r.rollout_id))
    summary = FitSummary(run=run)
    counts: Counter[tuple[str, str]] = Counter((r.mode or "-", r.status) for r in rollouts)
    summary.counts = dict(counts)

    succeeded = [r for r in rollouts if r.status == "succeeded"]
    rewards = await gather_chunked([final_reward(store, r) for r in succeeded])
    by_mode: dict[str, list[float]] = defaultdict(list)
    by_version: dict[tuple[str | None, int | None, str], list[float]] = defaultdict(list)
    for r, value in zip(succeeded, rewards, strict=True):
        if value is not None:
            by_mode[r.mode or "-"].append(value)
            by_version[(r.resources_id, r.resources_version, r.mode or "-")].append(value)
    summary.mean_reward = {
        mode: (sum(values) / len(values) if values else None) for mode, values in sorted(by_mode.items())
    }

    version_rows: dict[tuple[str | None, int | None, str], list[Rollout]] = {}
    for r in rollouts:
        version_rows.setdefault((r.resources_id, r.resources_version, r.mode or "-"), []).append(r)
    for (rid, version, mode), members in version_rows.items():
        values = by_version.get((rid, version, mode), [])
        summary.versions.append(
            VersionStats(
                resources_id=rid,
                version=version,
                mode=mode,
                rollouts=len(members),
                succeeded=sum(1 for m in members if m.status == "succeeded"),
                mean_reward=sum(values) / len(values) if values else None,
            )
        )

    failed = [r for r in rollouts if r.status == "failed"]
    errors = await gather_chunked([_error_of(store, r) for r in failed])
    groups: dict[str, list[tuple[Rollout, dict[str, Any]]]] = defaultdict(list)
    for r, error in zip(failed, errors, strict=True):
        groups[str(error.get("type") or "unknown error")].append((r, error))
    for error_type, occurrences in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        first, error = occurrences[0]
        message = str(error.get("message") or "")
        summary.failures.append(
            FailureGroup(
                error_type=error_type,
                count=len(occurrences),
                first_rollout_id=first.rollout_id,
                message=message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + "…",
                traceback_tail=_tail(str(error.get("traceback") or "")),
            )
        )
    return summary
