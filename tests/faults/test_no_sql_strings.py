"""CI check: no SQL text is built from runtime strings (docs/operations.md, "Hostile input").

Statically scans every module of lightning_sql/ (and the migrations shipped inside it) for a call that
sends raw SQL text — ``text()``, ``literal_column()``, ``.exec_driver_sql()``, ``.execute()``,
``.executescript()``, ``.fetch*()`` — whose SQL argument is built at run time: an f-string with
placeholders, ``%`` or ``+`` on strings, ``.format()``, ``.join()``, or a local name bound to one of
those.  Values must be bound parameters; identifiers must come from SQLAlchemy constructs.

Exceptions are listed in ALLOWED with the reason each is safe; an entry that no longer matches
anything fails too, so the list cannot rot.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [ROOT / "lightning_sql", ROOT / "migrations"]
SQL_SINKS = {"text", "literal_column", "exec_driver_sql", "execute", "executescript", "fetch", "fetchrow", "fetchval"}

# (path relative to the repo, exact source of the SQL argument) -> why it is safe.
ALLOWED: dict[tuple[str, str], str] = {
    ("lightning_sql/store/sql/migrate.py", 'f"CREATE SCHEMA IF NOT EXISTS {quoted}"'): (
        "DDL takes no bound parameters; the schema name is quoted by the dialect's identifier preparer"
    ),
    ("lightning_sql/store/sql/migrate.py", "f\"PRAGMA legacy_alter_table={'ON' if previous else 'OFF'}\""): (
        "PRAGMA takes no bound parameters; the f-string only chooses between two literals"
    ),
    ("lightning_sql/store/sql/sqlite_executor.py", 'f"PRAGMA wal_autocheckpoint={SQLITE_AUTOCHECKPOINT_BACKSTOP_PAGES}"'): (
        "PRAGMA takes no bound parameters; the value is a named integer constant of the module"
    ),
    ("lightning_sql/store/sql/planner_stats.py", 'f"ANALYZE {tables}"'): (
        "ANALYZE takes no bound parameters; the table names are planner_stats.RUN_TABLES constants and "
        "the schema the store's own, each quoted by the dialect's identifier preparer"
    ),
    ("migrations/env.py", 'f"CREATE SCHEMA IF NOT EXISTS {quoted}"'): (
        "DDL takes no bound parameters; the schema name is quoted by the dialect's identifier preparer"
    ),
    ("migrations/env.py", 'f"SET search_path TO {quoted}"'): (
        "SET takes no bound parameters; the schema name is quoted by the dialect's identifier preparer"
    ),
}


def _is_dynamic_str(node: ast.AST, dynamic_names: set[str]) -> bool:
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.Add)):
        # "..." % x, "..." + x, x + "...": anything string-shaped on either side.
        return any(
            isinstance(side, (ast.Constant, ast.JoinedStr)) and isinstance(getattr(side, "value", ""), str)
            or _is_dynamic_str(side, dynamic_names)
            for side in (node.left, node.right)
        )
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("format", "join"):
        return True
    if isinstance(node, ast.Name):
        return node.id in dynamic_names
    return False


def _sink_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def scan(path: Path) -> list[tuple[int, str]]:
    """(line, source of the SQL argument) for every sink fed a runtime-built string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    source = path.read_text()
    findings: list[tuple[int, str]] = []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]
    for scope in scopes:
        dynamic_names: set[str] = set()
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and _is_dynamic_str(node.value, set()):
                dynamic_names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(scope):
            if isinstance(node, ast.Call) and _sink_name(node) in SQL_SINKS and node.args:
                arg = node.args[0]
                if _is_dynamic_str(arg, dynamic_names):
                    findings.append((arg.lineno, ast.get_source_segment(source, arg) or "?"))
    return sorted(set(findings))


def _all_findings() -> list[tuple[str, int, str]]:
    out = []
    for base in SCANNED:
        for path in sorted(base.rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            out.extend((rel, line, src) for line, src in scan(path))
    return out


def test_no_sql_text_from_runtime_strings() -> None:
    violations = [
        f"{rel}:{line}: {src}" for rel, line, src in _all_findings() if (rel, src) not in ALLOWED
    ]
    assert violations == [], "SQL text built from runtime strings:\n" + "\n".join(violations)


def test_allow_list_entries_still_exist() -> None:
    found = {(rel, src) for rel, _line, src in _all_findings()}
    stale = [key for key in ALLOWED if key not in found]
    assert stale == [], f"remove stale ALLOWED entries: {stale}"


def test_the_scanner_catches_each_pattern(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from sqlalchemy import text\n"
        "def f(conn, name, n):\n"
        "    conn.execute(text(f\"SELECT * FROM t WHERE name = '{name}'\"))\n"
        "    conn.exec_driver_sql('DELETE FROM t WHERE id = %s' % n)\n"
        "    conn.exec_driver_sql('DELETE FROM t WHERE id = ' + n)\n"
        "    conn.execute(text('SELECT {}'.format(name)))\n"
        "    sql = f'DROP TABLE {name}'\n"
        "    conn.exec_driver_sql(sql)\n"
        "    conn.execute(text('SELECT 1'))\n"  # constant: fine
        "    conn.execute(text('SELECT :v'), {'v': name})\n"  # bound: fine
    )
    assert [line for line, _ in scan(bad)] == [3, 4, 5, 6, 8]
