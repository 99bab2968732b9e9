"""``lightning-sql runs`` and ``lightning-sql status``: the runs of a database, and one run now."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import click
from rich.console import Console, Group

from lightning_sql.cli import queries as q
from lightning_sql.cli.options import common_options, handled, need_run, open_existing, run_option
from lightning_sql.cli.output import console, emit, plain_lines, print_table, rich_table

# "recent" throughput in `status`: rollouts finished in this window (or the run's age, if shorter).
STATUS_THROUGHPUT_WINDOW_S = 300.0

RUN_COLUMNS = ["name", "status", "created_at", "rollouts", "queued", "running", "succeeded", "failed", "attempts",
               "spans", "workers"]
STATUS_KEYS = ["rollouts", "queue_depth", "running", "succeeded", "failed", "cancelled",
               "throughput_per_min_recent", "throughput_per_min_overall"]
WORKER_COLUMNS = ["worker_id", "status", "current_rollout_id", "heartbeat_age_seconds"]


@click.command("runs")
@common_options
@handled
def runs_command(url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """List the runs with their state and counts."""
    from lightning_sql.analysis import run_overview

    with contextlib.closing(open_existing(url, schema, connect_timeout)) as database:
        records = q.records(*database.rows(run_overview()))
    emit(as_json, records, lambda c: print_table(c, "runs", RUN_COLUMNS, records))


def recent_throughput_per_min(finished_recently: int, run_age_s: float | None) -> float | None:
    """Rollouts per minute over the last window, or over the run's whole life when it is younger."""
    window = STATUS_THROUGHPUT_WINDOW_S if run_age_s is None else min(STATUS_THROUGHPUT_WINDOW_S, run_age_s)
    if window <= 0:
        return None
    return round(finished_recently * 60.0 / window, 3)


def status_snapshot(database: Any, run: str, now: float) -> dict[str, Any]:
    """Counts, throughput and workers of one run, as of ``now``."""
    from lightning_sql.analysis import run_overview

    run_id = database.run_id(run)
    overview = q.records(*database.rows(run_overview(run_id)))[0]
    _, [(recent, first_start, last_end, n_finished)] = database.rows(
        q.finished_rollout_counts(run_id, now - STATUS_THROUGHPUT_WINDOW_S)
    )
    workers = q.records(*database.rows(q.workers_of_run(run_id)))
    for worker in workers:
        beat = worker["last_heartbeat_time"]
        worker["heartbeat_age_seconds"] = None if beat is None else round(now - beat, 3)
    created = overview["created_at"]
    span = (last_end - first_start) if (first_start is not None and last_end is not None) else None
    return {
        "run": run,
        "now": now,
        "status": overview["status"],
        "rollouts": overview["rollouts"],
        "queue_depth": overview["queued"],
        "running": overview["running"],
        "succeeded": overview["succeeded"],
        "failed": overview["failed"],
        "cancelled": overview["cancelled"],
        "throughput_per_min_recent": recent_throughput_per_min(recent, None if created is None else now - created),
        "throughput_per_min_overall": round(n_finished * 60.0 / span, 3) if span else None,
        "workers": workers,
    }


def _labels(keys: list[str]) -> list[str]:
    return [key.replace("_", " ") for key in keys]


def render_status(snapshot: dict[str, Any]) -> Group:
    """Two rich tables: the run's counts and its workers."""
    head = rich_table(f"run {snapshot['run']} ({snapshot['status']})", STATUS_KEYS, [snapshot], _labels(STATUS_KEYS))
    workers = rich_table("workers", WORKER_COLUMNS, snapshot["workers"], _labels(WORKER_COLUMNS))
    return Group(head, workers)


def print_status(out: Console, snapshot: dict[str, Any]) -> None:
    if out.is_terminal:
        out.print(render_status(snapshot))
        return
    for line in plain_lines(["run", "status", *STATUS_KEYS], [snapshot], ["run", "status", *_labels(STATUS_KEYS)]):
        click.echo(line)
    click.echo("")
    for line in plain_lines(WORKER_COLUMNS, snapshot["workers"], _labels(WORKER_COLUMNS)):
        click.echo(line)


@click.command("status")
@run_option()
@click.option("--watch", is_flag=True, help="Refresh until interrupted.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option("--count", type=int, default=0, help="With --watch: stop after N refreshes (0 = never).")
@click.option("--now", "now_override", type=float, hidden=True, help="Evaluate ages at this epoch time.")
@common_options
@handled
def status_command(
    run: str | None,
    watch: bool,
    interval: float,
    count: int,
    now_override: float | None,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Queue depth, running, succeeded / failed, throughput, and workers with their heartbeat age."""
    name = need_run(run)
    with contextlib.closing(open_existing(url, schema, connect_timeout)) as database:

        def snapshot() -> dict[str, Any]:
            return status_snapshot(database, name, now_override or time.time())

        if not watch:
            current = snapshot()
            emit(as_json, current, lambda c: print_status(c, current))
            return
        out = console()
        if as_json or not out.is_terminal:
            shown = 0
            while True:
                current = snapshot()
                if as_json:
                    click.echo(json.dumps(current, default=str))
                else:
                    if shown:
                        click.echo("")
                    print_status(out, current)
                shown += 1
                if count and shown >= count:
                    return
                time.sleep(interval)
        from rich.live import Live

        with Live(render_status(snapshot()), console=out) as live:
            shown = 1
            try:
                while not count or shown < count:
                    time.sleep(interval)
                    live.update(render_status(snapshot()))
                    shown += 1
            except KeyboardInterrupt:
                pass
