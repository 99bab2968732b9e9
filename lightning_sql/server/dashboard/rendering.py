"""The Jinja environment: autoescaping everywhere, and filters that show stored values as text.

Every ``{{ }}`` output passes ``visible``: control characters (ESC and friends) and the invisible
bidirectional controls become ``\\xNN`` / ``\\uNNNN`` text, so a stored terminal sequence or a
right-to-left override cannot hide or reorder what is shown (right-to-left scripts themselves are
shown as they are); HTML escaping is Jinja's autoescape.  Data is never marked safe."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A, 0x0D)}
_CONTROL.update({c: f"\\u{c:04x}" for c in (0x200E, 0x200F, 0x061C, *range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def visible(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, Markup):  # template-made markup (macros, blocks) passes untouched
        return value
    if isinstance(value, str):
        return value.translate(_CONTROL)
    return value


def fmt_time(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    try:
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return "—"


def fmt_tick(value: float, span_seconds: float) -> str:
    """A time axis label, as short as the axis' extent allows."""
    text = fmt_time(value)
    if span_seconds < 86400:
        return text[11:]
    return text[5:16]


def fmt_clock(value: float | None) -> str:
    text = fmt_time(value)
    return text[11:] if len(text) > 11 else text


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    seconds = max(seconds, 0.0)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
    return f"{int(seconds // 86400)} d {int(seconds % 86400 // 3600)} h"


def fmt_number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 1e6 else f"{value:.3e}"
    return str(value)


def pretty_json(value: Any) -> str:
    """Stored JSON as indented text (escaped by the template like any other string); a list of
    scalars (token ids) stays on one line."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and not any(isinstance(v, (dict, list)) for v in value):
        return json.dumps(value, ensure_ascii=False, default=str)
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False, default=str)


# Characters of a name (a span's) a page shows: names are free text, and one of megabytes would
# make every page that lists it as large.
NAME_CHARS = 200


def short_name(value: Any) -> str:
    return one_line(value, NAME_CHARS)


def one_line(value: Any, limit: int = 160) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def make_environment() -> Environment:
    env = Environment(
        loader=PackageLoader("lightning_sql.server.dashboard", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        finalize=visible,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        time=fmt_time,
        clock=fmt_clock,
        duration=fmt_duration,
        num=fmt_number,
        pretty=pretty_json,
        one_line=one_line,
        short=short_name,
    )
    return env
