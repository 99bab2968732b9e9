"""Tables, indexes and column types: the single source of the lightning_sql schema (docs/architecture.md §3).

Every table carries ``run_id`` (a store is bound to one run).  On PostgreSQL the tables live in a
schema chosen at run time (``schema_translate_map`` maps the ``None`` schema used here onto it), on
SQLite the file is the namespace.  Constraint and index names come from ``NAMING_CONVENTION`` so a
migration written today applies identically tomorrow.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    event,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import ExecutableDDLElement
from sqlalchemy.sql.compiler import DDLCompiler
from sqlalchemy.types import JSON, TypeDecorator, TypeEngine

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

DEFAULT_PG_SCHEMA = "lightning_sql"
VERSION_TABLE = "lightning_sql_version"

metadata = MetaData(naming_convention=NAMING_CONVENTION)


class JsonValue(TypeDecorator[Any]):
    """JSON text on SQLite, JSONB on PostgreSQL; Python ``None`` is SQL NULL (``none_as_null``)."""

    impl = JSON
    cache_ok = True

    def __init__(self) -> None:
        super().__init__(none_as_null=True)

    def load_dialect_impl(self, dialect: Any) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(postgresql.JSONB(none_as_null=True))
        return dialect.type_descriptor(JSON(none_as_null=True))


class IdText(TypeDecorator[str]):
    """Text ids that sort by code point: ``COLLATE "C"`` on PostgreSQL, BINARY (default) on SQLite."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Any) -> TypeEngine[Any]:
        # Returned unadapted: dialect.type_descriptor() would turn Text into PostgreSQL's generic
        # string type and the DDL would read VARCHAR instead of TEXT.
        if dialect.name == "postgresql":
            return Text(collation="C")
        return Text()


# Epoch seconds, double precision (the API's wire format).
EpochSeconds = Float(precision=53)

# One database-wide sequence hands out create/touch/queue positions on PostgreSQL without locking a
# per-run counter row (SQLite serialises writers anyway and uses ``runs.seq``).  Values are
# monotonic, so every run's subset of them is too.
position_seq = Sequence("lightning_sql_position_seq", metadata=metadata, start=1)


runs = Table(
    "runs",
    metadata,
    Column("run_id", Integer, primary_key=True, autoincrement=True),
    Column("name", IdText, nullable=False),
    Column("status", String(16), nullable=False),
    Column("created_at", EpochSeconds, nullable=False),
    Column("finished_at", EpochSeconds),
    Column("metadata", JsonValue),
    # SQLite's per-run position counter (see position_seq); unused on PostgreSQL.
    Column("seq", BigInteger, nullable=False, server_default=text("0")),
    # 1 while the run is paused: its claims take nothing (revision 0005, docs/queue.md).
    Column("paused", Integer, nullable=False, server_default=text("0")),
    UniqueConstraint("name"),
)

rollouts = Table(
    "rollouts",
    metadata,
    Column("run_id", Integer, nullable=False),
    Column("rollout_id", IdText, nullable=False),
    Column("input", JsonValue),
    Column("mode", String(8)),
    Column("resources_id", IdText),
    Column("resources_version", Integer),
    Column("status", String(16), nullable=False),
    Column("timeout_seconds", EpochSeconds),
    Column("unresponsive_seconds", EpochSeconds),
    Column("max_attempts", Integer, nullable=False),
    Column("retry_condition", JsonValue, nullable=False),
    Column("metadata", JsonValue),
    Column("idempotency_key", IdText),
    Column("start_time", EpochSeconds, nullable=False),
    Column("end_time", EpochSeconds),
    # Position in the run's queue; set <=> status in (queuing, requeuing).  The queue IS the partial
    # index below.
    Column("queue_seq", BigInteger),
    # Highest span sequence id handed out or seen for this rollout (D4).
    Column("span_seq", BigInteger, nullable=False, server_default=text("0")),
    # Insertion order: the base order of query_rollouts.
    Column("create_seq", BigInteger, nullable=False),
    # Number of attempts so far; the next attempt's sequence_id is attempt_count + 1.
    Column("attempt_count", Integer, nullable=False, server_default=text("0")),
    # Back-off of requeues (revision 0005, docs/queue.md): first delay (NULL/0: none), factor, cap.
    Column("retry_backoff_seconds", EpochSeconds),
    Column("retry_backoff_factor", EpochSeconds, nullable=False, server_default=text("2")),
    Column("retry_backoff_max_seconds", EpochSeconds),
    # Higher is claimed first, FIFO (queue_seq) within one priority (revision 0005).
    Column("priority", Integer, nullable=False, server_default=text("0")),
    # A requeue's back-off: not claimable before this time (NULL: no delay).  A queued row with it
    # set is in ix_rollouts_delayed, not in the claimable ix_rollouts_queue (docs/queue.md).
    Column("not_before", EpochSeconds),
    PrimaryKeyConstraint("run_id", "rollout_id"),
    UniqueConstraint("run_id", "idempotency_key"),
    ForeignKeyConstraint(["run_id"], ["runs.run_id"]),
)
CLAIMABLE = and_(rollouts.c.queue_seq.isnot(None), rollouts.c.not_before.is_(None))
DELAYED = and_(rollouts.c.queue_seq.isnot(None), rollouts.c.not_before.isnot(None))
# The claimable queue in claim order, and the delayed rollouts by due time (revision 0005).
Index(
    "ix_rollouts_queue",
    rollouts.c.run_id,
    rollouts.c.priority.desc(),
    rollouts.c.queue_seq,
    postgresql_where=CLAIMABLE,
    sqlite_where=CLAIMABLE,
)
Index("ix_rollouts_delayed", rollouts.c.run_id, rollouts.c.not_before, postgresql_where=DELAYED, sqlite_where=DELAYED)
Index("ix_rollouts_run_id_create_seq", rollouts.c.run_id, rollouts.c.create_seq)
Index("ix_rollouts_run_id_status", rollouts.c.run_id, rollouts.c.status)

attempts = Table(
    "attempts",
    metadata,
    Column("run_id", Integer, nullable=False),
    Column("rollout_id", IdText, nullable=False),
    Column("attempt_id", IdText, nullable=False),
    Column("sequence_id", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("worker_id", IdText),
    Column("start_time", EpochSeconds, nullable=False),
    Column("end_time", EpochSeconds),
    Column("last_heartbeat_time", EpochSeconds),
    Column("metadata", JsonValue),
    PrimaryKeyConstraint("run_id", "rollout_id", "attempt_id"),
    UniqueConstraint("run_id", "rollout_id", "sequence_id"),
    ForeignKeyConstraint(["run_id", "rollout_id"], ["rollouts.run_id", "rollouts.rollout_id"]),
)

spans = Table(
    "spans",
    metadata,
    # BIGSERIAL on PostgreSQL (an identity column in all but name: Alembic compares an
    # IDENTITY on SQLite's rowid alias as a spurious default change), INTEGER PRIMARY KEY (the
    # rowid) on SQLite.
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True),
    Column("run_id", Integer, nullable=False),
    Column("rollout_id", IdText, nullable=False),
    Column("attempt_id", IdText, nullable=False),
    Column("sequence_id", BigInteger, nullable=False),
    Column("trace_id", IdText, nullable=False),
    Column("span_id", IdText, nullable=False),
    Column("parent_id", IdText),
    Column("name", IdText, nullable=False),
    Column("status_code", String(8), nullable=False),
    Column("start_time", EpochSeconds),
    Column("end_time", EpochSeconds),
    Column("attributes", JsonValue),
    Column("events", JsonValue),
    Column("links", JsonValue),
    Column("resource", JsonValue),
    # Everything else of the Span model (status description, context, parent, extra fields).
    Column("extra", JsonValue),
    UniqueConstraint("run_id", "rollout_id", "attempt_id", "span_id"),
    ForeignKeyConstraint(
        ["run_id", "rollout_id", "attempt_id"],
        ["attempts.run_id", "attempts.rollout_id", "attempts.attempt_id"],
    ),
)
# A rollout's spans in ``query_spans``' default order, ties in insertion order (revision 0004: the
# trailing ``id`` lets PostgreSQL read a page in order instead of sorting every span of the attempt;
# on SQLite the rowid already ends every index entry).
Index(
    "ix_spans_run_id_rollout_id_attempt_id_sequence_id_id",
    spans.c.run_id,
    spans.c.rollout_id,
    spans.c.attempt_id,
    spans.c.sequence_id,
    spans.c.id,
)
# Reward spans only (revision 0002): the analysis views find each attempt's last reward through it,
# so the final reward is never parsed on the span-ingest path.  Small: one entry per reward span.
Index(
    "ix_spans_reward",
    spans.c.run_id,
    spans.c.rollout_id,
    spans.c.attempt_id,
    spans.c.sequence_id,
    postgresql_where=spans.c.name == text("'agentlightning.annotation'"),
    sqlite_where=spans.c.name == text("'agentlightning.annotation'"),
)

resources = Table(
    "resources",
    metadata,
    Column("run_id", Integer, nullable=False),
    Column("resources_id", IdText, nullable=False),
    Column("version", Integer, nullable=False),
    Column("create_time", EpochSeconds, nullable=False),
    Column("update_time", EpochSeconds, nullable=False),
    Column("resources", JsonValue, nullable=False),
    Column("create_seq", BigInteger, nullable=False),
    Column("touch_seq", BigInteger, nullable=False),
    PrimaryKeyConstraint("run_id", "resources_id"),
    ForeignKeyConstraint(["run_id"], ["runs.run_id"]),
)
Index("ix_resources_run_id_touch_seq", resources.c.run_id, resources.c.touch_seq)
Index("ix_resources_run_id_create_seq", resources.c.run_id, resources.c.create_seq)

resource_versions = Table(
    "resource_versions",
    metadata,
    Column("run_id", Integer, nullable=False),
    Column("resources_id", IdText, nullable=False),
    Column("version", Integer, nullable=False),
    Column("resources", JsonValue, nullable=False),
    Column("time", EpochSeconds, nullable=False),
    PrimaryKeyConstraint("run_id", "resources_id", "version"),
    ForeignKeyConstraint(["run_id"], ["runs.run_id"]),
)

workers = Table(
    "workers",
    metadata,
    Column("run_id", Integer, nullable=False),
    Column("worker_id", IdText, nullable=False),
    Column("status", String(16), nullable=False),
    Column("heartbeat_stats", JsonValue),
    Column("last_heartbeat_time", EpochSeconds),
    Column("last_dequeue_time", EpochSeconds),
    Column("last_busy_time", EpochSeconds),
    Column("last_idle_time", EpochSeconds),
    Column("current_rollout_id", IdText),
    Column("current_attempt_id", IdText),
    Column("create_seq", BigInteger, nullable=False),
    PrimaryKeyConstraint("run_id", "worker_id"),
    ForeignKeyConstraint(["run_id"], ["runs.run_id"]),
)
Index("ix_workers_run_id_create_seq", workers.c.run_id, workers.c.create_seq)

ALL_TABLES = (runs, rollouts, attempts, spans, resources, resource_versions, workers)


# PostgreSQL: the columns ANALYZE never samples (statistics target 0; revision 0003, ADR 0007).  A
# sample of ``run_id`` describes the runs that existed when it was taken: a run created later looks
# empty to the planner, which then reads that run's rows through any index starting with ``run_id``
# where a key look-up was meant (every call of the new run costs more as it grows).  Unsampled,
# ``run_id = x`` is taken for 0.5% of the table, and the store's statements are written to need no
# more than that (dialect.py, "Keyed UPDATEs").  ``queue_seq``: a run's queue goes from empty to
# full and back, so a sample taken at either end misleads the claim's plan.
UNSAMPLED_COLUMNS: dict[str, tuple[str, ...]] = {
    "attempts": ("run_id",),
    "rollouts": ("run_id", "queue_seq"),
    "spans": ("run_id",),
    "workers": ("run_id",),
}


class SetStatisticsTarget(ExecutableDDLElement):
    """``ALTER TABLE <table> ALTER COLUMN <column> SET STATISTICS <statistics_target>`` (PostgreSQL;
    -1 is the server's default target)."""

    def __init__(self, table: Table, column: str, statistics_target: int) -> None:
        self.table, self.column, self.statistics_target = table, column, int(statistics_target)


@compiles(SetStatisticsTarget)
def _set_statistics_target(element: SetStatisticsTarget, compiler: DDLCompiler, **kw: Any) -> str:
    preparer = compiler.preparer
    return (
        f"ALTER TABLE {preparer.format_table(element.table)} "
        f"ALTER COLUMN {preparer.quote(element.column)} SET STATISTICS {element.statistics_target:d}"
    )


def _leave_unsampled(table: Table, connection: Any, **_kw: Any) -> None:
    if connection.dialect.name == "postgresql":
        for column in UNSAMPLED_COLUMNS[table.name]:
            connection.execute(SetStatisticsTarget(table, column, 0))


for _name in UNSAMPLED_COLUMNS:
    event.listen(metadata.tables[_name], "after_create", _leave_unsampled)

# The analysis views (views.py) belong to the schema too: a fresh create_all makes them as well.
from lightning_sql.store.sql import views as _views  # noqa: E402 - needs nothing from this module

_views.attach(metadata)
