"""How commands print: JSON, rich tables on a terminal, plain untruncated text elsewhere.

Everything read from the database is untrusted text: a run named ``[/]`` or ``[red]x[/red]`` must
print as itself, and an ESC byte in a span name must not reach the terminal.  So stored values are
never parsed as rich markup (table cells are :class:`~rich.text.Text`; values placed inside a
markup line go through :func:`markup`) and unprintable characters are shown escaped (``\\x1b``).
When stdout is not a terminal, tables print as tab-separated lines with nothing cut short, so
``grep``, ``cut`` and ``awk`` see whole ids.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text


def console() -> Console:
    # No file: rich writes to whatever sys.stdout is at the time (click's test runner swaps it).
    return Console(soft_wrap=True)


def is_terminal() -> bool:
    return console().is_terminal


def printable(value: str, *, multiline: bool = False) -> str:
    """``value`` with every unprintable character (ESC, tab, bidi overrides...) escaped; newlines
    too unless ``multiline``."""
    if value.isprintable():
        return value
    if multiline:
        return "\n".join(printable(line) for line in value.split("\n"))
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in value)


def fmt(value: Any) -> str:
    """A stored value as one printable cell: ``-`` for NULL, short floats, epoch times as local time."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    return printable(str(value))


def markup(value: Any) -> str:
    """A stored value, formatted by :func:`fmt`, safe to place inside a rich markup string."""
    return escape(fmt(value))


def emit(as_json: bool, data: Any, render: Callable[[Console], None]) -> None:
    """``data`` as one JSON line with ``--json``, else ``render(console)``."""
    if as_json:
        click.echo(json.dumps(data, default=str, ensure_ascii=False))
    else:
        render(console())


def rich_table(title: str, columns: Sequence[str], rows: Iterable[dict[str, Any]], labels: Sequence[str] | None = None) -> Table:
    table = Table(title=Text(printable(title)))
    for label in labels or columns:
        table.add_column(label)
    for row in rows:
        table.add_row(*(Text(fmt(row.get(c))) for c in columns))
    return table


def plain_lines(columns: Sequence[str], rows: Iterable[dict[str, Any]], labels: Sequence[str] | None = None) -> Iterable[str]:
    """A header line and one tab-separated line per row (tabs and newlines inside values escaped)."""
    yield "\t".join(labels or columns)
    for row in rows:
        yield "\t".join(fmt(row.get(c)) for c in columns)


def print_table(
    out: Console,
    title: str,
    columns: Sequence[str],
    rows: Iterable[dict[str, Any]],
    labels: Sequence[str] | None = None,
) -> None:
    """A rich table on a terminal; plain tab-separated lines, untruncated, elsewhere."""
    if out.is_terminal:
        out.print(rich_table(title, columns, rows, labels))
    else:
        for line in plain_lines(columns, rows, labels):
            click.echo(line)
