"""The design's static rules (docs/architecture.md §7): sizes, and no private names of other packages.

A text check of the source: it keeps the redesign of the execution layer from growing back into
several forms of each operation on library internals.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_sql"
STORE_MAX_LINES = 7000
MODULE_MAX_LINES = 700

# The private names of SQLAlchemy, its asyncpg adapter and pydantic that the old execution layer used.
FORBIDDEN_ATTRIBUTES = (
    "_result_columns",
    "_bind_processors",
    "_process_parameters_for_postcompile",
    "_render_schema_translates",
    "_has_events",
    "_execute_mutex",
    "_start_transaction",
    "_handle_exception",
    "_async_ping",
    "__pydantic_fields_set__",
)
IMPORT = re.compile(r"^\s*from (sqlalchemy|asyncpg|pydantic)[\w.]* import (\([^)]*\)|.*)", re.MULTILINE)
PRIVATE_NAME = re.compile(r"\b_[A-Za-z]\w*")
PRIVATE_MODULE = re.compile(r"\b(sqlalchemy|asyncpg|pydantic)(\.\w+)*\._[A-Za-z]\w*")


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_the_store_package_stays_within_its_size() -> None:
    total = sum(_lines(path) for path in (PACKAGE / "store").rglob("*.py"))
    assert total <= STORE_MAX_LINES, f"lightning_sql/store/ has {total} lines (at most {STORE_MAX_LINES})"


def test_no_module_is_over_the_size_of_one_job() -> None:
    too_long = {str(p.relative_to(PACKAGE)): n for p in _sources() if (n := _lines(p)) > MODULE_MAX_LINES}
    assert not too_long, f"modules over {MODULE_MAX_LINES} lines: {too_long}"


def test_no_private_names_of_other_packages() -> None:
    found = []
    for path in _sources():
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(PACKAGE))
        found += [f"{where}: .{name}" for name in FORBIDDEN_ATTRIBUTES if f".{name}" in text]
        found += [f"{where}: {m.group(0).strip()}" for m in IMPORT.finditer(text) if PRIVATE_NAME.search(m.group(2))]
        found += [f"{where}: {m.group(0)}" for m in PRIVATE_MODULE.finditer(text)]
        if re.search(r"\.__class__\s*=[^=]", text):
            found.append(f"{where}: assigns __class__")
    assert not found, "private names of other packages:\n" + "\n".join(found)
