"""Programmatic Alembic: create, upgrade, downgrade, check and guard the lightning_sql schema
(docs/architecture.md §9: locking, and the ``lightning_sql_compat`` marker that lets older code
refuse a schema it must not use).

Every function takes a sync ``Connection`` already inside the caller's transaction and never commits,
rolls back or closes it.  Whatever may migrate first holds the migration lock and re-reads the version
under it: on PostgreSQL ``pg_advisory_xact_lock(MIGRATION_LOCK_KEY)`` in a READ COMMITTED transaction
(so the re-read sees another process's migration); on SQLite ``migration_file_lock`` and ``BEGIN
IMMEDIATE``, with ``PRAGMA foreign_keys`` switched OFF before the transaction begins (batch revisions
rebuild tables; ``upgrade`` runs ``foreign_key_check`` after).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Column, Connection, MetaData, String, Table, delete, func, insert, inspect, select

from lightning_sql.store.sql import schema as schema_module
from lightning_sql.store.sql.schema import VERSION_TABLE

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

logger = logging.getLogger(__name__)

# The newest revision this code ships (a test keeps it equal to Alembic's head).
HEAD_REVISION = "0005"

# pg_advisory_xact_lock key serialising migrations database-wide: 0x6C73716C6D696772, the ASCII
# bytes of "lsqlmigr" (docs/store-contract.md §4).
MIGRATION_LOCK_KEY = 7814714488923973490

# One-row table: the oldest code revision that may use this database (see the module docstring).
COMPAT_TABLE = "lightning_sql_compat"

UPGRADE_COMMAND = "lightning-sql db upgrade"

# Tables that belong to the migration machinery rather than to schema.py.
BOOKKEEPING_TABLES = frozenset({VERSION_TABLE, COMPAT_TABLE})


class SchemaError(RuntimeError):
    """The database schema is missing, too old, incompatible, or could not be migrated."""


def script_location() -> Path:
    """Return the Alembic script directory: the installed ``lightning_sql.migrations`` package, or
    the top-level ``migrations/`` of a source checkout that is not installed."""
    try:
        installed = resources.files("lightning_sql.migrations")
    except ModuleNotFoundError:
        installed = None
    if isinstance(installed, Path) and (installed / "env.py").is_file():
        return installed
    checkout = Path(__file__).resolve().parents[3] / "migrations"
    if (checkout / "env.py").is_file():
        return checkout
    raise SchemaError(
        f"cannot find the lightning_sql migrations: neither the package lightning_sql.migrations "
        f"({installed}) nor {checkout} holds env.py; reinstall lightning_sql"
    )


def current_revision(conn: Connection, schema: str | None) -> str | None:
    """Return the revision recorded in the version table, or ``None`` for an empty database."""
    _check_schema_argument(conn, schema)
    return _read_state(conn, schema).revision


@dataclass(frozen=True)
class SchemaStatus:
    """Where a database's schema stands against this code (:func:`schema_status`)."""

    revision: str | None  # None: no lightning_sql schema yet
    state: str  # "empty", "behind", "up to date", "newer, compatible" or "newer, incompatible"
    min_code_revision: str | None = None  # for a newer schema: the oldest code revision that may use it

    @property
    def is_newer(self) -> bool:
        return self.state.startswith("newer")

    def describe(self) -> str:
        """One sentence for a newer schema: compatible or not, and that lightning_sql is what to upgrade."""
        newer = f"this database is at schema revision {self.revision}, newer than this code's {HEAD_REVISION}"
        if self.state == "newer, compatible":
            return f"{newer}; it is compatible with this code (upgrade lightning_sql to use what {self.revision} adds)"
        needed = self.min_code_revision or self.revision
        return f"{newer}; it needs code that knows revision {needed}: upgrade lightning_sql on this host"


def schema_status(conn: Connection, schema: str | None) -> SchemaStatus:
    """Compare the database's revision with this code's: empty, behind, up to date, or newer."""
    _check_schema_argument(conn, schema)
    state = _read_state(conn, schema)
    if state.revision is None:
        return SchemaStatus(None, "empty")
    if state.revision == HEAD_REVISION:
        return SchemaStatus(state.revision, "up to date")
    known = _known_revisions()
    if state.revision in known:
        return SchemaStatus(state.revision, "behind")
    compatible = state.min_code_revision is not None and state.min_code_revision in known
    return SchemaStatus(
        state.revision, "newer, compatible" if compatible else "newer, incompatible", state.min_code_revision
    )


def ensure_schema(
    conn: Connection,
    *,
    schema: str | None,
    auto_migrate: bool,
    read_only: bool,
    url_for_messages: str,
) -> None:
    """Make sure the database holds a schema this code can use, creating or upgrading it if allowed.

    Returns at once (no lock, no Alembic) when the database is at this code's head revision or at a
    newer revision that older code may use.  Raises :class:`SchemaError` naming
    ``lightning-sql db upgrade`` for an empty or older schema when ``auto_migrate`` is false or
    ``read_only`` is true, and naming both revisions for a newer schema that declares itself
    incompatible with this code.  See the module docstring for the caller's duties (transaction,
    SQLite file lock and foreign keys).
    """
    _check_schema_argument(conn, schema)
    where = _describe(url_for_messages, schema)
    state = _read_state(conn, schema)
    if not _needs_upgrade(state, where):
        return
    if read_only or not auto_migrate:
        raise SchemaError(_refusal(state, where, read_only=read_only))
    take_migration_lock(conn)
    # Another process may have migrated while this one waited for the lock.
    state = _read_state(conn, schema)
    if not _needs_upgrade(state, where):
        return
    logger.info("Migrating %s from revision %s to %s", where, state.revision or "<empty>", HEAD_REVISION)
    _run_alembic(conn, schema, "upgrade", "head")


def upgrade(conn: Connection, schema: str | None, revision: str = "head") -> None:
    """Upgrade the schema to ``revision`` (default: this code's head) under the migration lock."""
    _check_schema_argument(conn, schema)
    take_migration_lock(conn)
    _run_alembic(conn, schema, "upgrade", revision)


def downgrade(conn: Connection, schema: str | None, revision: str) -> None:
    """Downgrade the schema to ``revision`` (``"base"`` drops everything) under the migration lock."""
    _check_schema_argument(conn, schema)
    take_migration_lock(conn)
    _run_alembic(conn, schema, "downgrade", revision)


def check(conn: Connection, schema: str | None, *, target_metadata: MetaData | None = None) -> list[Any]:
    """Return the differences between the database and ``schema.metadata``; empty means in sync.

    Alembic's autogenerate diff (tables, columns, types, nullability, server defaults, indexes,
    constraints), plus what autogenerate does not compare: partial-index predicates
    (``("modify_index_predicate", schema, table, index, in_database, in_model)``) and column
    collations (``("modify_collation", schema, table, column, in_database, in_model)``).  Sequences
    and views are not compared.  ``target_metadata`` replaces ``schema.metadata`` (for tests).
    """
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    _check_schema_argument(conn, schema)
    target = _metadata_in_schema(target_metadata or schema_module.metadata, schema)

    def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
        if type_ == "schema":
            return name == schema
        if type_ == "table":
            return name not in BOOKKEEPING_TABLES
        return True

    context = MigrationContext.configure(
        connection=conn,
        opts={
            "target_metadata": target,
            "include_schemas": schema is not None,
            "include_name": include_name,
            "compare_type": True,
            "compare_server_default": True,
        },
    )
    diffs: list[Any] = list(compare_metadata(context, target))
    diffs.extend(_predicate_and_collation_diffs(conn, target, schema))
    return diffs


@contextlib.contextmanager
def migration_file_lock(database_path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the exclusive SQLite migration lock on ``<database_path>.migrate.lock`` (blocking)."""
    lock_path = f"{os.fspath(database_path)}.migrate.lock"
    with open(lock_path, "a+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


# -- used by migrations/env.py ----------------------------------------------------------------------


def take_migration_lock(conn: Connection) -> None:
    """On PostgreSQL, wait for the database-wide migration lock (held until the transaction ends)."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(MIGRATION_LOCK_KEY)))


def prepare_pg_schema(conn: Connection, schema: str) -> None:
    """Create the PostgreSQL schema if it is missing (the identifier is quoted, never spliced raw).

    Looks first: PostgreSQL checks the CREATE privilege on the database even for
    ``CREATE SCHEMA IF NOT EXISTS``, and a role may own a schema a DBA created without holding it.
    """
    if inspect(conn).has_schema(schema):
        return
    quoted = conn.dialect.identifier_preparer.quote_identifier(schema)
    conn.exec_driver_sql(f"CREATE SCHEMA IF NOT EXISTS {quoted}")


@contextlib.contextmanager
def migration_namespace(conn: Connection, schema: str | None) -> Iterator[None]:
    """Point the revisions' schema-less names at ``schema`` for the duration of a migration.

    Two mechanisms, because Alembic's ALTER-style operations (``add_column``, ``alter_column``,
    ...) render table names themselves and ignore ``schema_translate_map``: the map (for
    SQLAlchemy-compiled DDL such as CREATE TABLE and CREATE INDEX) and a transaction-local
    ``search_path`` with ``schema`` first (for everything else, raw SQL included).  The caller's
    execution options and search path are restored afterwards; on an error the caller rolls back,
    which ends the transaction-local setting anyway.
    """
    if schema is None:
        if conn.dialect.name != "sqlite":
            yield
            return
        # Batch mode rebuilds a table as copy + DROP + RENAME; since SQLite 3.26 the RENAME refuses
        # while a view (the analysis views) names the dropped table.  The legacy rename leaves views
        # alone, and they resolve to the rebuilt table by name.
        previous = conn.exec_driver_sql("PRAGMA legacy_alter_table").scalar()
        conn.exec_driver_sql("PRAGMA legacy_alter_table=ON")
        try:
            yield
        finally:
            conn.exec_driver_sql(f"PRAGMA legacy_alter_table={'ON' if previous else 'OFF'}")
        return
    prepare_pg_schema(conn, schema)
    previous_map = conn.get_execution_options().get("schema_translate_map")
    previous_path = conn.execute(select(func.current_setting("search_path"))).scalar_one()
    quoted = conn.dialect.identifier_preparer.quote_identifier(schema)
    # Connection.execution_options() changes the caller's connection in place.
    conn.execution_options(schema_translate_map={None: schema})
    try:
        conn.execute(select(func.set_config("search_path", f"{quoted}, {previous_path}", True)))
        yield
        conn.execute(select(func.set_config("search_path", previous_path, True)))
    finally:
        conn.execution_options(schema_translate_map=previous_map)


def write_compat_marker(conn: Connection, schema: str | None, script: ScriptDirectory | None = None) -> None:
    """Record in ``lightning_sql_compat`` the oldest code revision that may use the database as it
    now stands (after an upgrade or downgrade); drop the table when no revision is applied.

    ``script`` is the script directory the migration ran from (default: this package's)."""
    table = _compat_table(schema)
    revision = _read_version(conn, schema)
    if revision is None:
        table.drop(conn, checkfirst=True)
        return
    table.create(conn, checkfirst=True)
    conn.execute(delete(table))
    min_code_revision = _min_code_revision(script or _script_directory(), revision)
    conn.execute(insert(table).values(min_code_revision=min_code_revision))


def check_sqlite_foreign_keys(conn: Connection) -> None:
    """Raise :class:`SchemaError` if a migration left SQLite rows that break a foreign key."""
    violations = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if violations:
        shown = ", ".join(f"{row[0]} rowid {row[1]} -> {row[2]}" for row in violations[:10])
        raise SchemaError(f"the migration broke {len(violations)} foreign key(s): {shown}")


# -- internals -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SchemaState:
    revision: str | None
    min_code_revision: str | None
    unversioned_tables: tuple[str, ...] = ()


def _check_schema_argument(conn: Connection, schema: str | None) -> None:
    if conn.dialect.name == "sqlite" and schema is not None:
        raise ValueError(f"schema={schema!r}: SQLite has no schemas; pass schema=None")
    if schema is not None and (not isinstance(schema, str) or not schema):
        raise ValueError(f"schema={schema!r}: expected a non-empty PostgreSQL schema name or None")


def _describe(url: str, schema: str | None) -> str:
    return f"{url} (schema {schema!r})" if schema is not None else url


def _version_table(schema: str | None) -> Table:
    return Table(VERSION_TABLE, MetaData(), Column("version_num", String(32), nullable=False), schema=schema)


def _compat_table(schema: str | None) -> Table:
    return Table(
        COMPAT_TABLE, MetaData(), Column("min_code_revision", String(32), nullable=False), schema=schema
    )


def _read_version(conn: Connection, schema: str | None) -> str | None:
    if not inspect(conn).has_table(VERSION_TABLE, schema=schema):
        return None
    rows = conn.execute(select(_version_table(schema).c.version_num)).scalars().all()
    if len(rows) > 1:
        raise SchemaError(f"the version table {VERSION_TABLE} holds several revisions: {sorted(rows)}")
    return rows[0] if rows else None


def _read_state(conn: Connection, schema: str | None) -> _SchemaState:
    revision = _read_version(conn, schema)
    if revision is None:
        ours = {table.name for table in schema_module.metadata.tables.values()}
        present = ours.intersection(inspect(conn).get_table_names(schema=schema))
        return _SchemaState(None, None, tuple(sorted(present)))
    min_code_revision = None
    # Only a revision this code does not ship needs the marker; spare the common case its queries.
    if revision != HEAD_REVISION and inspect(conn).has_table(COMPAT_TABLE, schema=schema):
        compat = _compat_table(schema)
        min_code_revision = conn.execute(select(func.max(compat.c.min_code_revision))).scalar()
    return _SchemaState(revision, min_code_revision)


def _needs_upgrade(state: _SchemaState, where: str) -> bool:
    """True for an empty or older schema; False for ours or a compatible newer one; raises for a
    schema this code must not touch."""
    if state.revision is None:
        if state.unversioned_tables:
            raise SchemaError(
                f"{where} holds lightning_sql tables ({', '.join(state.unversioned_tables)}) but no "
                f"{VERSION_TABLE} revision: it was not created by lightning_sql's migrations; "
                f"refusing to touch it"
            )
        return True
    if state.revision == HEAD_REVISION:
        return False
    known = _known_revisions()
    if state.revision in known:
        return True
    if state.min_code_revision is None or state.min_code_revision not in known:
        raise SchemaError(
            f"{where} is at schema revision {state.revision}, which requires code that knows revision "
            f"{state.min_code_revision or state.revision}; this code's newest revision is "
            f"{HEAD_REVISION}. Upgrade lightning_sql on this host."
        )
    logger.debug(
        "%s is at revision %s, newer than this code's %s but compatible with it",
        where,
        state.revision,
        HEAD_REVISION,
    )
    return False


def _refusal(state: _SchemaState, where: str, *, read_only: bool) -> str:
    reason = "a read-only store never migrates" if read_only else "auto_migrate=False"
    if state.revision is None:
        found = "has no lightning_sql schema"
    else:
        found = f"is at schema revision {state.revision}, older than this code's {HEAD_REVISION}"
    return f"{where} {found} ({reason}); run `{UPGRADE_COMMAND}` to bring it to revision {HEAD_REVISION}"


def _metadata_in_schema(metadata: MetaData, schema: str | None) -> MetaData:
    if schema is None:
        return metadata
    copy = MetaData(naming_convention=metadata.naming_convention)
    for table in metadata.sorted_tables:
        table.to_metadata(copy, schema=schema)
    return copy


def _predicate_and_collation_diffs(conn: Connection, target: MetaData, schema: str | None) -> list[Any]:
    inspector = inspect(conn)
    existing = set(inspector.get_table_names(schema=schema))
    dialect = conn.dialect
    diffs: list[Any] = []
    for table in target.sorted_tables:
        if table.name not in existing:
            continue  # autogenerate reports the missing table
        reflected_indexes = {ix["name"]: ix for ix in inspector.get_indexes(table.name, schema=schema)}
        for index in sorted(table.indexes, key=lambda ix: str(ix.name)):
            reflected = reflected_indexes.get(str(index.name))
            if reflected is None:
                continue  # autogenerate reports the missing index
            in_model = index.dialect_kwargs.get(f"{dialect.name}_where")
            model_text = _normal_predicate(
                None
                if in_model is None
                else str(
                    in_model.compile(
                        dialect=dialect, compile_kwargs={"literal_binds": True, "include_table": False}
                    )
                )
            )
            in_database = reflected.get("dialect_options", {}).get(f"{dialect.name}_where")
            database_text = _normal_predicate(
                None if in_database is None else str(getattr(in_database, "text", in_database))
            )
            if model_text != database_text:
                diffs.append(
                    ("modify_index_predicate", schema, table.name, index.name, database_text, model_text)
                )
        reflected_columns = {col["name"]: col for col in inspector.get_columns(table.name, schema=schema)}
        for column in table.columns:
            reflected_column = reflected_columns.get(column.name)
            if reflected_column is None:
                continue  # autogenerate reports the missing column
            model_impl = column.type.dialect_impl(dialect)
            model_collation = getattr(getattr(model_impl, "impl", model_impl), "collation", None)
            database_collation = getattr(reflected_column["type"], "collation", None)
            if model_collation != database_collation:
                diffs.append(
                    ("modify_collation", schema, table.name, column.name, database_collation, model_collation)
                )
    return diffs


def _normal_predicate(predicate: str | None) -> str | None:
    """Predicate text without parentheses, case, spacing or literal-cast differences (PostgreSQL
    rewrites ``name = 'x'`` as ``(name = 'x'::text)``)."""
    if predicate is None:
        return None
    spaced = " ".join(predicate.replace("(", " ").replace(")", " ").lower().split())
    return spaced.replace("::character varying", "").replace("::text", "")


def _config(conn: Connection, schema: str | None) -> Config:
    from alembic.config import Config

    config = Config()
    # ConfigParser interpolates '%': escape it in the path.
    config.set_main_option("script_location", str(script_location()).replace("%", "%%"))
    config.set_main_option("path_separator", "os")
    config.attributes["connection"] = conn
    config.attributes["schema"] = schema
    return config


@lru_cache(maxsize=1)
def _script_directory() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(script_location()))


@lru_cache(maxsize=1)
def _known_revisions() -> frozenset[str]:
    return frozenset(script.revision for script in _script_directory().walk_revisions())


def _min_code_revision(scripts: ScriptDirectory, revision: str) -> str:
    """The newest revision up to ``revision`` that declares itself incompatible with older code, or
    the base revision when none does."""
    oldest = revision
    for script in scripts.iterate_revisions(revision, "base"):
        if getattr(script.module, "compatible_with_older_code", True) is False:
            return script.revision
        oldest = script.revision
    return oldest


def _run_alembic(conn: Connection, schema: str | None, direction: str, revision: str) -> None:
    from alembic import command
    from alembic.util import CommandError

    if conn.dialect.name == "sqlite" and _read_version(conn, schema) is not None:
        _require_sqlite_foreign_keys_off(conn)
    config = _config(conn, schema)
    try:
        if direction == "upgrade":
            command.upgrade(config, revision)
        else:
            command.downgrade(config, revision)
    except CommandError as error:
        raise SchemaError(f"cannot {direction} to {revision!r}: {error}") from error
    if conn.dialect.name == "sqlite":
        check_sqlite_foreign_keys(conn)


def _require_sqlite_foreign_keys_off(conn: Connection) -> None:
    # Batch mode rebuilds tables (create copy, drop, rename); with foreign keys on, dropping a
    # referenced table deletes or rejects its children's references.
    if conn.exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise SchemaError(
            "PRAGMA foreign_keys is ON: switch it OFF before beginning the migrating transaction "
            "(the pragma cannot change inside one) and back ON after it commits"
        )
