"""``lightning-sql sweep``, ``check`` and ``gc``: expire dead attempts, verify a run, delete old data."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import click
from rich.console import Console

from lightning_sql.cli import queries as q
from lightning_sql.cli.options import (
    EXIT_FAILED,
    common_options,
    database,
    fail,
    handled,
    need_run,
    open_existing,
    run_option,
    writable_store,
)
from lightning_sql.cli.output import emit, markup, printable
from lightning_sql.store.sql.urls import mask_url

# Span rows deleted per transaction by `gc --spans-before`: short enough never to hold writers up.
GC_BATCH_ROWS = 2_000
# What `gc --delete-run --dry-run` counts, in the order it prints them.
RUN_CONTENTS = ("rollouts", "attempts", "spans", "workers")


@click.command("sweep")
@run_option()
@click.option("--all-runs", is_flag=True, help="Sweep every run of the database.")
@common_options
@handled
def sweep_command(
    run: str | None, all_runs: bool, url: str | None, schema: str | None, connect_timeout: float, as_json: bool
) -> None:
    """Expire dead attempts now (timeout / unresponsive -> requeue or fail)."""
    if not all_runs:
        run = need_run(run)

    async def go() -> int:
        store = writable_store(url, schema, connect_timeout, None if all_runs else run)
        try:
            return int(await store.sweep(all_runs=all_runs))
        finally:
            await store.close()

    expired = asyncio.run(go())
    data = {"run": None if all_runs else run, "expired_attempts": expired}
    emit(as_json, data, lambda c: c.print(f"Expired {expired} attempt(s)."))


@click.command("check")
@run_option()
@common_options
@handled
def check_command(run: str | None, url: str | None, schema: str | None, connect_timeout: float, as_json: bool) -> None:
    """Check a run's invariants; exit 1 listing the violations."""
    name = need_run(run)
    db = database(url, schema)
    db.require_existing_file()
    try:
        from lightning_sql.checker import check_url
    except ImportError as exc:
        fail(as_json, f"the invariant checker is not available in this installation ({exc})")
    options: dict[str, Any] = {"connect_deadline_seconds": connect_timeout}
    if schema is not None:
        options["schema"] = schema
    violations = asyncio.run(check_url(db.url, name, **options))
    data = {"run": name, "ok": not violations, "violations": violations}

    def render(c: Console) -> None:
        for violation in violations:
            c.print(f"[red]{markup(violation)}[/]")
        c.print(
            f"[green]run {markup(name)}: all invariants hold[/]" if not violations else f"{len(violations)} violation(s)"
        )

    emit(as_json, data, render)
    if violations:
        raise click.exceptions.Exit(EXIT_FAILED)


def dry_run_summary(delete_run: str | None, counts: dict[str, Any], spans_before: str | None, run: str | None) -> str:
    """What ``gc --dry-run`` would delete, as one sentence."""
    if delete_run is not None:
        contents = ", ".join(f"{counts.get(key, 0)} {key}" for key in RUN_CONTENTS)
        return f"Would delete run '{printable(delete_run)}' and everything in it: {contents}. Nothing was deleted."
    where = f"run '{printable(run)}'" if run else "every run"
    return f"Would delete {counts['spans']} span(s) started before {spans_before} in {where}. Nothing was deleted."


async def _delete_spans_in_batches(store: Any, run_ids: Sequence[int], cutoff: float, batch_rows: int) -> dict[str, int]:
    """Delete the spans in short write transactions (``store.run_sql``: no store method does this)."""
    total, batches = 0, 0
    while True:
        n = await store.run_sql(lambda ctx: q.delete_spans_before(ctx, run_ids, cutoff, batch_rows), write=True, bound=False)
        total += n
        batches += int(n > 0)
        if n < batch_rows:
            return {"deleted_spans": total, "batches": batches}


@click.command("gc")
@click.option("--delete-run", "delete_run", metavar="NAME", help="Delete this run and everything in it.")
@click.option("--spans-before", metavar="TIME", help="Delete spans that started before TIME (epoch or ISO 8601).")
@run_option(required=False)
@click.option("--all-runs", is_flag=True, help="With --spans-before: in every run.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--batch-rows", type=click.IntRange(min=1), default=GC_BATCH_ROWS, show_default=True)
@common_options
@handled
def gc_command(
    delete_run: str | None,
    spans_before: str | None,
    run: str | None,
    all_runs: bool,
    dry_run: bool,
    yes: bool,
    batch_rows: int,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Delete a run, or old spans, in short batches that never hold writers up for long."""
    from lightning_sql import analysis

    if (delete_run is None) == (spans_before is None):
        raise click.UsageError("give exactly one of --delete-run NAME or --spans-before TIME")
    cutoff = 0.0
    if spans_before is not None:
        try:
            cutoff = analysis.to_epoch(spans_before) or 0.0
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        if not all_runs:
            run = need_run(run)

    with contextlib.closing(open_existing(url, schema, connect_timeout)) as db:
        if delete_run is not None:
            counts = q.records(*db.rows(analysis.run_overview(db.run_id(delete_run))))[0]
            run_ids: list[int] = []
        else:
            run_ids = [int(r[0]) for r in db.rows(analysis.run_overview())[1]] if all_runs else [db.run_id(run or "")]
            counts = {"spans": db.rows(q.count_spans_before(run_ids, cutoff))[1][0][0]}

    if dry_run:
        data = {"dry_run": True, "run": delete_run or run, "would_delete": counts}
        summary = dry_run_summary(delete_run, counts, spans_before, None if all_runs else run)
        emit(as_json, data, lambda c: c.print(markup(summary)))
        return
    what = (
        f"run '{printable(delete_run)}' ({counts.get('rollouts', 0)} rollouts, {counts['spans']} spans)"
        if delete_run
        else f"{counts['spans']} span(s) started before {spans_before}"
    )
    if not yes:
        click.confirm(f"Delete {what} from {mask_url(database(url, schema).url)}?", abort=True)

    async def go() -> dict[str, Any]:
        store = writable_store(url, schema, connect_timeout, None)
        try:
            if delete_run is not None:
                started = time.monotonic()
                deleted = await store.delete_run(delete_run)
                return {"deleted_run": delete_run if deleted else None, "seconds": round(time.monotonic() - started, 3)}
            return await _delete_spans_in_batches(store, run_ids, cutoff, batch_rows)
        finally:
            await store.close()

    data = asyncio.run(go())
    emit(as_json, data, lambda c: c.print(f"Deleted {markup(what)}."))
