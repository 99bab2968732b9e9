"""Two resources versions side by side: each resource flattened to lines, then ``difflib``.

Multi-line strings (prompt templates) become one line each, so a changed sentence shows as a changed
line rather than one long JSON string."""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def resource_lines(resources: Any) -> list[str]:
    """A resources snapshot as text lines: one block per named resource, one line per field (or per
    line of a multi-line string field)."""
    if not isinstance(resources, Mapping):
        return json.dumps(resources, indent=2, sort_keys=True, ensure_ascii=False).splitlines()
    lines: list[str] = []
    for name in sorted(resources, key=str):
        value = resources[name]
        lines.append(f"[{name}]")
        if isinstance(value, Mapping):
            for key in sorted(value, key=str):
                field = value[key]
                if isinstance(field, str) and "\n" in field:
                    lines.append(f"  {key}:")
                    lines.extend(f"    {line}" for line in field.splitlines())
                else:
                    lines.append(f"  {key}: {json.dumps(field, sort_keys=True, ensure_ascii=False)}")
        else:
            lines.append(f"  {json.dumps(value, sort_keys=True, ensure_ascii=False)}")
    return lines


@dataclass(frozen=True)
class DiffRow:
    kind: str  # "same", "changed", "removed", "added"
    left_no: int | None
    left: str
    right_no: int | None
    right: str


def side_by_side(left: list[str], right: list[str]) -> list[DiffRow]:
    rows: list[DiffRow] = []
    matcher = difflib.SequenceMatcher(a=left, b=right, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            rows.extend(DiffRow("same", i + 1, left[i], j + 1, right[j]) for i, j in zip(range(i1, i2), range(j1, j2), strict=True))
            continue
        n = max(i2 - i1, j2 - j1)
        for k in range(n):
            i, j = i1 + k, j1 + k
            has_l, has_r = i < i2, j < j2
            kind = "changed" if has_l and has_r else ("removed" if has_l else "added")
            rows.append(
                DiffRow(
                    kind,
                    i + 1 if has_l else None,
                    left[i] if has_l else "",
                    j + 1 if has_r else None,
                    right[j] if has_r else "",
                )
            )
    return rows
