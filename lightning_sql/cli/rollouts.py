"""``lightning-sql rollouts``, ``show`` and ``spans``: what happened inside a run."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime
from typing import Any

import click
from rich.console import Console
from rich.text import Text
from rich.tree import Tree

from lightning_sql.cli import queries as q
from lightning_sql.cli.options import common_options, fail, handled, need_run, open_existing, run_option
from lightning_sql.cli.output import console, emit, fmt, plain_lines, print_table, printable, rich_table

ROLLOUT_COLUMNS = ["rollout_id", "status", "mode", "resources_version", "attempts", "latest_worker_id",
                   "duration_seconds", "final_reward"]
# Spans `show` prints per attempt unless told otherwise: a whole agent step, not a whole trace dump.
SHOW_SPAN_LIMIT = 100


@click.command("rollouts")
@run_option()
@click.option("--status", "statuses", multiple=True, help="Keep these statuses (repeatable).")
@click.option("--mode", type=click.Choice(["train", "val", "test"]), help="Keep this mode.")
@click.option("--worker", help="Keep rollouts whose latest attempt ran on this worker.")
@click.option("--resources-version", type=int, help="Keep rollouts created under this resources version.")
@click.option("--sort", type=click.Choice(sorted(q.ROLLOUT_SORTS)), default="start", show_default=True)
@click.option("--desc", is_flag=True, help="Sort descending.")
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True, help="0 = all.")
@common_options
@handled
def rollouts_command(
    run: str | None,
    statuses: tuple[str, ...],
    mode: str | None,
    worker: str | None,
    resources_version: int | None,
    sort: str,
    desc: bool,
    limit: int,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Rollouts of a run (rollout_summary_v1): filter, sort, limit."""
    name = need_run(run)
    with contextlib.closing(open_existing(url, schema, connect_timeout)) as database:
        stmt = q.rollouts_of_run(
            database.run_id(name),
            statuses=statuses,
            mode=mode,
            worker=worker,
            resources_version=resources_version,
            sort=sort,
            desc=desc,
            limit=limit,
        )
        records = q.records(*database.rows(stmt))
    emit(as_json, records, lambda c: print_table(c, f"rollouts of {name}", ROLLOUT_COLUMNS, records))


# --- show -------------------------------------------------------------------------------------------------


def span_tree(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Nest spans under their parents (roots: no parent, or a parent not stored or not shown)."""
    nodes = {span["span_id"]: {**span, "children": []} for span in spans}
    roots: list[dict[str, Any]] = []
    for span in spans:
        node = nodes[span["span_id"]]
        parent = nodes.get(span["parent_id"]) if span["parent_id"] else None
        (parent["children"] if parent is not None and parent is not node else roots).append(node)
    return roots


def _attempt_error(metadata: Any) -> dict[str, Any] | None:
    """The runner's ``metadata["error"]``: ``{type, message, traceback}``."""
    error = metadata.get("error") if isinstance(metadata, dict) else None
    return error if isinstance(error, dict) else None


def _rollout_line(rollout_id: str, run: str, r: dict[str, Any]) -> Text:
    not_before = r.get("not_before")
    return Text.assemble(
        (printable(rollout_id), "bold"),
        f" run {printable(run)}: {fmt(r['status'])} mode={fmt(r['mode'])} resources={fmt(r['resources_id'])} "
        f"v{fmt(r['resources_version'])} attempts={fmt(r['attempts'])} duration={fmt(r['duration_seconds'])}s "
        f"final_reward={fmt(r['final_reward'])} priority={fmt(r.get('priority'))}"
        + ("" if not_before is None else f" not_before={_utc(not_before)}"),
    )


def _utc(epoch: float) -> str:
    """An epoch time as ISO 8601 UTC (a back-off's end)."""
    return datetime.fromtimestamp(epoch, tz=UTC).isoformat(timespec="milliseconds")


def _attempt_line(attempt: dict[str, Any]) -> Text:
    line = Text.assemble(
        f"attempt {fmt(attempt['attempt_number'])} {fmt(attempt['attempt_id'])} ",
        (fmt(attempt["status"]), "bold"),
        f" on {fmt(attempt['worker_id'])} ({fmt(attempt['duration_seconds'])}s)",
    )
    if attempt["error_type"]:
        line.append(f" {fmt(attempt['error_type'])}: {fmt(attempt['error_message'])}", style="red")
    return line


def _span_line(node: dict[str, Any]) -> Text:
    start, end = node["start_time"], node["end_time"]
    duration = end - start if end is not None and start is not None else None
    return Text(f"#{fmt(node['sequence_id'])} {fmt(node['name'])} ({fmt(duration)}s) {fmt(node['span_id'])}")


def _traceback_lines(attempt: dict[str, Any]) -> list[str]:
    error = attempt.get("error") or {}
    traceback = error.get("traceback") or ""
    return [printable(line) for line in str(traceback).rstrip("\n").splitlines()]


def _omitted_line(attempt: dict[str, Any]) -> str | None:
    omitted = attempt["spans_total"] - attempt["spans_shown"]
    return f"... {omitted} more span(s) of this attempt (--limit 0 shows all)" if omitted > 0 else None


def print_rollout(out: Console, rollout_id: str, run: str, rollout: dict[str, Any], attempts: list[dict[str, Any]]) -> None:
    """The rollout, then per attempt: its outcome, its span tree and the traceback of its error."""
    out.print(_rollout_line(rollout_id, run, rollout))
    for attempt in attempts:
        if out.is_terminal:
            tree = Tree(_attempt_line(attempt))

            def add(branch: Tree, node: dict[str, Any]) -> None:
                child = branch.add(_span_line(node))
                for grandchild in node["children"]:
                    add(child, grandchild)

            for root in attempt["spans"]:
                add(tree, root)
            out.print(tree)
        else:
            click.echo(_attempt_line(attempt).plain)

            def echo(node: dict[str, Any], depth: int) -> None:
                click.echo("    " * depth + _span_line(node).plain)
                for child in node["children"]:
                    echo(child, depth + 1)

            for root in attempt["spans"]:
                echo(root, 1)
        omitted = _omitted_line(attempt)
        if omitted:
            out.print(Text("    " + omitted, style="dim"))
        lines = _traceback_lines(attempt)
        if lines:
            out.print(Text("    traceback:", style="red"))
            for line in lines:
                out.print(Text("    " + line, style="red"))


@click.command("show")
@click.argument("rollout_id")
@run_option()
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=SHOW_SPAN_LIMIT,
    show_default=True,
    help="Spans shown per attempt (0 = all).",
)
@common_options
@handled
def show_command(
    rollout_id: str,
    run: str | None,
    limit: int,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """One rollout: its summary, attempts (with the traceback of a failed one) and span tree."""
    name = need_run(run)
    with contextlib.closing(open_existing(url, schema, connect_timeout)) as database:
        run_id = database.run_id(name)
        found = q.records(*database.rows(q.rollout_summary(run_id, rollout_id)))
        if not found:
            fail(as_json, f"rollout {rollout_id!r} not found in run {name!r}")
        attempts = q.records(*database.rows(q.attempts_of_rollout(run_id, rollout_id)))
        for attempt in attempts:
            attempt["error"] = _attempt_error(attempt.pop("metadata"))
            spans = q.records(*database.rows(q.spans_of_attempt(run_id, rollout_id, attempt["attempt_id"], limit)))
            total = len(spans)
            if limit and total == limit:
                _, [(total,)] = database.rows(q.span_count_of_attempt(run_id, rollout_id, attempt["attempt_id"]))
            attempt["spans"] = span_tree(spans)
            attempt["spans_shown"], attempt["spans_total"] = len(spans), int(total)
    data = {"rollout": found[0], "attempts": attempts}
    emit(as_json, data, lambda c: print_rollout(c, rollout_id, name, found[0], attempts))


# --- spans -------------------------------------------------------------------------------------------------


@click.command("spans")
@run_option()
@click.option("--rollout", "rollout_id", help="Spans of this rollout.")
@click.option("--attempt", "attempt_id", help="Spans of this attempt.")
@click.option("--name", "name_contains", help="Keep spans whose name contains this text.")
@click.option("--limit", type=click.IntRange(min=0), default=100, show_default=True, help="0 = all.")
@common_options
@handled
def spans_command(
    run: str | None,
    rollout_id: str | None,
    attempt_id: str | None,
    name_contains: str | None,
    limit: int,
    url: str | None,
    schema: str | None,
    connect_timeout: float,
    as_json: bool,
) -> None:
    """Spans of a run, in insertion order (filter by rollout, attempt, name), streamed page by page."""
    name = need_run(run)
    columns = q.SPAN_JSON_COLUMNS if as_json else q.SPAN_TABLE_COLUMNS
    with contextlib.closing(open_existing(url, schema, connect_timeout)) as database:
        pages = q.iter_span_pages(
            database,
            database.run_id(name),
            columns,
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            name_contains=name_contains,
            limit=limit,
        )
        if as_json:  # one JSON array, written as it is read
            click.echo("[", nl=False)
            first = True
            for page in pages:
                for record in page:
                    click.echo(("" if first else ", ") + json.dumps(record, default=str, ensure_ascii=False), nl=False)
                    first = False
            click.echo("]")
            return
        out = console()
        title = f"spans of {name}"
        shown = 0
        for page in pages:
            if out.is_terminal:
                table = rich_table(title, columns, page)
                if shown:  # later pages continue the first page's table
                    table.title, table.show_header = None, False
                out.print(table)
            else:
                lines = iter(plain_lines(columns, page))
                if shown:  # the header line once
                    next(lines)
                for line in lines:
                    click.echo(line)
            shown += len(page)
        if not shown:
            print_table(out, title, columns, [])
