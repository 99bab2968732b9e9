"""The analysis views, one shape on SQLite and PostgreSQL (docs/schema.md describes their columns):
``rollout_summary_v1``, ``rewards_v1``, ``llm_calls_v1`` and ``attempts_v1``.

The final reward is not denormalised onto the rollout on the span-ingest path: the view reads it
through the partial index ``ix_spans_reward``, one short index range per rollout.  The SQL differs
per dialect only in JSON access, and is built from this module's constants (the PostgreSQL schema
name goes through identifier quoting).  Non-numeric JSON values read as NULL rather than failing the
query.  A ``_v1`` definition never changes once released; a new shape is a new name (``_v2``) made by
a new revision, so code reading ``_v1`` keeps working during a rolling upgrade.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

from sqlalchemy import BigInteger, Column, Connection, Float, MetaData, Table, Text, event

from lightning_sql.store.sql import dialect as d

# Placeholder for "<quoted schema>." (PostgreSQL) or "" (SQLite) in the statements below.
_NS = "__lsql_ns__."

REWARD_SPAN_NAME = "agentlightning.annotation"
REWARD_KEY_PREFIX = "agentlightning.reward."
FIRST_REWARD_KEY = "agentlightning.reward.0.value"
LLM_CALL_SPAN_NAME = "openai.chat.completion"

VIEW_NAMES = ("rollout_summary_v1", "rewards_v1", "llm_calls_v1", "attempts_v1")
"""Every view, in creation order (drop in reverse)."""


_TYPES = {"int": BigInteger, "float": Float, "text": Text}

VIEW_COLUMNS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "rollout_summary_v1": (
        ("run_id", "int"), ("run_name", "text"), ("rollout_id", "text"), ("status", "text"), ("mode", "text"),
        ("resources_id", "text"), ("resources_version", "int"), ("idempotency_key", "text"), ("attempts", "int"),
        ("latest_attempt_id", "text"), ("latest_attempt_status", "text"), ("latest_worker_id", "text"),
        ("start_time", "float"), ("end_time", "float"), ("duration_seconds", "float"), ("final_reward", "float"),
    ),
    "rewards_v1": (
        ("run_id", "int"), ("run_name", "text"), ("rollout_id", "text"), ("attempt_id", "text"), ("span_id", "text"),
        ("sequence_id", "int"), ("start_time", "float"), ("dimension", "int"), ("reward_name", "text"),
        ("reward_value", "float"),
    ),
    "llm_calls_v1": (
        ("run_id", "int"), ("run_name", "text"), ("rollout_id", "text"), ("attempt_id", "text"), ("span_id", "text"),
        ("parent_id", "text"), ("sequence_id", "int"), ("name", "text"), ("status_code", "text"), ("system", "text"),
        ("model", "text"), ("request_model", "text"), ("response_model", "text"), ("prompt_tokens", "int"),
        ("completion_tokens", "int"), ("total_tokens", "int"), ("start_time", "float"), ("end_time", "float"),
        ("latency_seconds", "float"),
    ),
    "attempts_v1": (
        ("run_id", "int"), ("run_name", "text"), ("rollout_id", "text"), ("attempt_id", "text"),
        ("attempt_number", "int"), ("is_latest", "int"), ("mode", "text"), ("rollout_status", "text"),
        ("status", "text"), ("worker_id", "text"), ("start_time", "float"), ("end_time", "float"),
        ("last_heartbeat_time", "float"), ("duration_seconds", "float"), ("error_type", "text"),
        ("error_message", "text"),
    ),
}
"""Every view's columns and their kinds (``int``, ``float``, ``text``), in order."""

# Table objects for querying the views with SQLAlchemy Core (schema_translate_map applies to them).
# Their own MetaData: create_all on schema.metadata must never create them as tables.
view_metadata = MetaData()
VIEW_TABLES: Mapping[str, Table] = {
    name: Table(name, view_metadata, *(Column(col, _TYPES[kind]()) for col, kind in columns))
    for name, columns in VIEW_COLUMNS.items()
}


class _Json:
    """JSON access in view SQL, from the dialect's templates (``dialect.VIEW_SQL``); arguments are
    constants of this module, never user input."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        self.sql = d.VIEW_SQL[dialect]

    def text(self, column: str, key: str) -> str:
        return self.sql["text"].format(c=column, k=key)

    def nested_text(self, column: str, outer: str, inner: str) -> str:
        return self.sql["nested_text"].format(c=column, k=outer, k2=inner)

    def number(self, column: str, key: str) -> str:
        return self.sql["number"].format(c=column, k=key)

    def integer(self, column: str, key: str) -> str:
        return self.sql["integer"].format(c=column, k=key)

    def first_integer(self, column: str, *keys: str) -> str:
        return "COALESCE(" + ", ".join(self.integer(column, key) for key in keys) + ")"

    def has_key_prefix(self, column: str, prefix: str) -> str:
        """Whether the JSON object has a key starting with ``prefix``."""
        return self.sql["has_key_prefix"].format(c=column, k=prefix, n=len(prefix))

    def contains(self, column: str, needle: str) -> str:
        return self.sql["contains"].format(c=column, k=needle)


def _rollout_summary(j: _Json) -> str:
    reward = j.number("fr.attributes", FIRST_REWARD_KEY)
    return f"""CREATE VIEW {_NS}rollout_summary_v1 AS
SELECT
    ro.run_id AS run_id,
    ru.name AS run_name,
    ro.rollout_id AS rollout_id,
    ro.status AS status,
    ro.mode AS mode,
    ro.resources_id AS resources_id,
    ro.resources_version AS resources_version,
    ro.idempotency_key AS idempotency_key,
    ro.attempt_count AS attempts,
    la.attempt_id AS latest_attempt_id,
    la.status AS latest_attempt_status,
    la.worker_id AS latest_worker_id,
    ro.start_time AS start_time,
    ro.end_time AS end_time,
    ro.end_time - ro.start_time AS duration_seconds,
    (SELECT {reward}
       FROM {_NS}spans fr
      WHERE fr.run_id = la.run_id
        AND fr.rollout_id = la.rollout_id
        AND fr.attempt_id = la.attempt_id
        AND fr.name = '{REWARD_SPAN_NAME}'
        AND {reward} IS NOT NULL
      ORDER BY fr.sequence_id DESC, fr.start_time DESC NULLS LAST, fr.id DESC
      LIMIT 1) AS final_reward
FROM {_NS}rollouts ro
JOIN {_NS}runs ru ON ru.run_id = ro.run_id
LEFT JOIN {_NS}attempts la
    ON la.run_id = ro.run_id AND la.rollout_id = ro.rollout_id AND la.sequence_id = ro.attempt_count"""  # noqa: S608 - built from this module's constants only


def _rewards(j: _Json) -> str:
    fill = {"ns": _NS, "span": REWARD_SPAN_NAME, "prefix": REWARD_KEY_PREFIX, "after": len(REWARD_KEY_PREFIX) + 1}
    fill["less"] = len(REWARD_KEY_PREFIX) + 6
    fill["dim"] = j.sql["reward_dim"].format(**fill)
    source, dimension, name, value = (j.sql[f"reward_{part}"].format(**fill) for part in ("source", "dimension", "name", "value"))
    return f"""CREATE VIEW {_NS}rewards_v1 AS
SELECT
    sp.run_id AS run_id,
    ru.name AS run_name,
    sp.rollout_id AS rollout_id,
    sp.attempt_id AS attempt_id,
    sp.span_id AS span_id,
    sp.sequence_id AS sequence_id,
    sp.start_time AS start_time,
    {dimension} AS dimension,
    {name} AS reward_name,
    {value} AS reward_value
{source}"""  # noqa: S608 - built from this module's constants only


def _llm_calls(j: _Json) -> str:
    a = "sp.attributes"
    request_model = j.text(a, "gen_ai.request.model")
    response_model = j.text(a, "gen_ai.response.model")
    prompt_tokens = j.first_integer(a, "gen_ai.usage.prompt_tokens", "gen_ai.usage.input_tokens")
    completion_tokens = j.first_integer(a, "gen_ai.usage.completion_tokens", "gen_ai.usage.output_tokens")
    total_tokens = j.integer(a, "gen_ai.usage.total_tokens")
    return f"""CREATE VIEW {_NS}llm_calls_v1 AS
SELECT
    sp.run_id AS run_id,
    ru.name AS run_name,
    sp.rollout_id AS rollout_id,
    sp.attempt_id AS attempt_id,
    sp.span_id AS span_id,
    sp.parent_id AS parent_id,
    sp.sequence_id AS sequence_id,
    sp.name AS name,
    sp.status_code AS status_code,
    {j.text(a, "gen_ai.system")} AS system,
    COALESCE({response_model}, {request_model}) AS model,
    {request_model} AS request_model,
    {response_model} AS response_model,
    {prompt_tokens} AS prompt_tokens,
    {completion_tokens} AS completion_tokens,
    COALESCE({total_tokens}, {prompt_tokens} + {completion_tokens}) AS total_tokens,
    sp.start_time AS start_time,
    sp.end_time AS end_time,
    sp.end_time - sp.start_time AS latency_seconds
FROM {_NS}spans sp
JOIN {_NS}runs ru ON ru.run_id = sp.run_id
WHERE {j.contains("sp.name", LLM_CALL_SPAN_NAME)} OR {j.has_key_prefix(a, "gen_ai.")}"""  # noqa: S608 - built from this module's constants only


def _attempts(j: _Json) -> str:
    return f"""CREATE VIEW {_NS}attempts_v1 AS
SELECT
    at.run_id AS run_id,
    ru.name AS run_name,
    at.rollout_id AS rollout_id,
    at.attempt_id AS attempt_id,
    at.sequence_id AS attempt_number,
    CASE WHEN at.sequence_id = ro.attempt_count THEN 1 ELSE 0 END AS is_latest,
    ro.mode AS mode,
    ro.status AS rollout_status,
    at.status AS status,
    at.worker_id AS worker_id,
    at.start_time AS start_time,
    at.end_time AS end_time,
    at.last_heartbeat_time AS last_heartbeat_time,
    at.end_time - at.start_time AS duration_seconds,
    {j.nested_text("at.metadata", "error", "type")} AS error_type,
    {j.nested_text("at.metadata", "error", "message")} AS error_message
FROM {_NS}attempts at
JOIN {_NS}rollouts ro ON ro.run_id = at.run_id AND ro.rollout_id = at.rollout_id
JOIN {_NS}runs ru ON ru.run_id = at.run_id"""  # noqa: S608 - built from this module's constants only


@cache  # built once per dialect, from the constants above
def _build(dialect: str) -> dict[str, str]:
    j = _Json(dialect)
    return {
        "rollout_summary_v1": _rollout_summary(j),
        "rewards_v1": _rewards(j),
        "llm_calls_v1": _llm_calls(j),
        "attempts_v1": _attempts(j),
    }





def _namespace(dialect: Any, schema: str | None) -> str:
    if dialect.name != "postgresql" or schema is None:  # SQLite has no schemas
        return ""
    return dialect.identifier_preparer.quote_schema(schema) + "."


def _dialect_name(dialect: Any) -> str:
    if dialect.name not in d.VIEW_SQL:
        raise ValueError(f"lightning_sql views exist for SQLite and PostgreSQL, not {dialect.name!r}")
    return str(dialect.name)


def create_statements(dialect: Any, schema: str | None) -> list[str]:
    """The ``CREATE VIEW`` statements for ``dialect`` (a SQLAlchemy dialect), in ``schema`` on PostgreSQL."""
    texts = _build(_dialect_name(dialect))
    ns = _namespace(dialect, schema)
    return [texts[name].replace(_NS, ns) for name in VIEW_NAMES]


def drop_statements(dialect: Any, schema: str | None) -> list[str]:
    """The ``DROP VIEW IF EXISTS`` statements, in reverse creation order."""
    _dialect_name(dialect)
    ns = _namespace(dialect, schema)
    return [f"DROP VIEW IF EXISTS {ns}{name}" for name in reversed(VIEW_NAMES)]


def connection_schema(conn: Connection) -> str | None:
    """The schema the connection maps schema-less names onto (``schema_translate_map``), if any."""
    mapping = conn.get_execution_options().get("schema_translate_map") or {}
    schema = mapping.get(None)
    return schema if isinstance(schema, str) else None


def create_views(conn: Connection, schema: str | None = None) -> None:
    """Create every view on ``conn`` (``schema`` defaults to the connection's translate map)."""
    target = schema if schema is not None else connection_schema(conn)
    for statement in create_statements(conn.dialect, target):
        conn.exec_driver_sql(statement)


def drop_views(conn: Connection, schema: str | None = None) -> None:
    """Drop every view on ``conn`` (missing ones are skipped)."""
    target = schema if schema is not None else connection_schema(conn)
    for statement in drop_statements(conn.dialect, target):
        conn.exec_driver_sql(statement)


def attach(metadata: MetaData) -> None:
    """Make ``metadata.create_all`` / ``drop_all`` create and drop the views too, so a fresh create
    holds the same catalogue as ``upgrade head``."""

    def after_create(_target: Any, connection: Connection, **_kw: Any) -> None:
        create_views(connection)

    def before_drop(_target: Any, connection: Connection, **_kw: Any) -> None:
        drop_views(connection)

    event.listen(metadata, "after_create", after_create)
    event.listen(metadata, "before_drop", before_drop)
