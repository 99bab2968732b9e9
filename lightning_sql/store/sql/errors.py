"""The store's own exceptions, and how a database error is classed: retry, give up, or report."""

from __future__ import annotations

import os
import random
import sqlite3
from typing import Literal

from sqlalchemy.exc import DBAPIError, OperationalError

from lightning_sql.store.sql.urls import DatabaseTarget


class StoreUnavailableError(ConnectionError):
    """The database cannot be reached (or stayed unreachable past ``connect_deadline_seconds``).

    The message names the masked URL and the driver's reason.
    """


ErrorKind = Literal["transient", "unavailable", "denied", "fatal"]

# PostgreSQL SQLSTATEs that a replay of the whole unit can cure: the server is busy, restarting or
# out of connection slots, or it aborted the transaction on purpose (lock conflicts, timeouts).
PG_TRANSIENT_SQLSTATES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "57014",  # query_canceled (statement_timeout, pg_cancel_backend)
        "57P01",  # admin_shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now (starting up, shutting down, in recovery)
        "53300",  # too_many_connections (max_connections or a role's CONNECTION LIMIT)
        "53400",  # configuration_limit_exceeded
        "08000",  # connection_exception
        "08001",  # sqlclient_unable_to_establish_sqlconnection
        "08003",  # connection_does_not_exist
        "08004",  # sqlserver_rejected_establishment_of_sqlconnection
        "08006",  # connection_failure
    }
)
# ...and those no retry can cure: report them at once.
PG_UNAVAILABLE_SQLSTATES = frozenset(
    {
        "28000",  # invalid_authorization_specification (unknown role)
        "28P01",  # invalid_password
        "3D000",  # invalid_catalog_name (unknown database)
    }
)
PG_DENIED_SQLSTATES = frozenset({"42501"})  # insufficient_privilege: a role without write grants

# asyncpg's connection-level exceptions, by name (they carry no SQLSTATE when raised by the client).
_CONNECTION_ERROR_NAMES = frozenset(
    "ConnectionDoesNotExistError InterfaceError CannotConnectNowError ConnectionFailureError "
    "PostgresConnectionError InternalClientError TooManyConnectionsError".split()
)

RETRY_BASE_DELAY_S = 0.01  # first back-off after a transient error; doubles up to the cap
RETRY_MAX_DELAY_S = 1.0


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it wraps (SQLAlchemy's ``orig``, causes and contexts), each once."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not seen for seen in out):
        out.append(cur)
        cur = getattr(cur, "orig", None) or cur.__cause__ or cur.__context__
    return out


def sqlstate(exc: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE somewhere in ``exc``'s chain, if any."""
    for item in _chain(exc):
        state = getattr(item, "sqlstate", None) or getattr(item, "pgcode", None)
        if isinstance(state, str):
            return state
    return None


def classify_error(exc: BaseException) -> ErrorKind:
    """``transient`` (replay the unit after a back-off), ``unavailable`` (give up at once),
    ``denied`` (the role may not do this) or ``fatal`` (the unit's own error: report it)."""
    state = sqlstate(exc)
    if state in PG_DENIED_SQLSTATES:
        return "denied"
    if state in PG_UNAVAILABLE_SQLSTATES:
        return "unavailable"
    if state in PG_TRANSIENT_SQLSTATES:
        return "transient"
    for item in _chain(exc):
        if isinstance(item, DBAPIError) and item.connection_invalidated:
            return "transient"
        if isinstance(item, (sqlite3.OperationalError, OperationalError)):
            message = str(item).lower()
            # busy / locked: another writer; full: the disk (space may be freed: retry, then report)
            if "locked" in message or "busy" in message or "database or disk is full" in message:
                return "transient"
            if "unable to open database" in message or "readonly database" in message:
                return "unavailable"
        if isinstance(item, sqlite3.OperationalError) and "disk i/o error" in str(item).lower():
            return "transient"
        if isinstance(item, (ConnectionError, TimeoutError, OSError)) and not isinstance(
            item, (FileNotFoundError, PermissionError)
        ):
            return "transient"
        name = type(item).__name__
        if name in _CONNECTION_ERROR_NAMES and "connect" in (str(item).lower() + name.lower()):
            return "transient"
        if name == "InternalClientError":
            # asyncpg's protocol is in a state no operation can start from: a connection the server
            # ended between two statements ("another operation (2) is in progress").  A new one cures it.
            return "transient"
        if name in ("InvalidPasswordError", "InvalidAuthorizationSpecificationError", "InvalidCatalogNameError"):
            return "unavailable"
    return "fatal"


def backoff(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (from 0): exponential, capped, jittered."""
    delay = min(RETRY_MAX_DELAY_S, RETRY_BASE_DELAY_S * (2**attempt))
    return delay * (0.5 + random.random())


def _in_words(exc: BaseException, target: DatabaseTarget) -> str | None:
    """What went wrong, in words, for the failures a new user meets first."""
    chain = _chain(exc)
    if target.path is not None:
        folder = os.path.dirname(target.path)
        if not os.path.isdir(folder):
            return f"the folder {folder} does not exist (create it, or point the URL at another file)"
        if os.path.exists(target.path) and not os.access(target.path, os.W_OK):
            return f"the file {target.path} is read-only (open it with read_only=True, or fix its permissions)"
        if not os.access(folder, os.W_OK) and any("readonly" in str(item) for item in chain):
            return f"the folder {folder} is read-only: SQLite needs to create files beside the database"
        if any("database or disk is full" in str(item) for item in chain):
            return f"the disk holding {target.path} is full"
    if any(isinstance(item, ConnectionRefusedError) for item in chain):
        host, port = target.url.host or "localhost", target.url.port or 5432
        return f"connection refused at {host}:{port} (is PostgreSQL running there?)"
    if sqlstate(exc) in ("28P01", "28000"):
        return f"authentication failed for user {target.url.username!r}: {_first_line(exc)}"
    if sqlstate(exc) == "3D000":
        return f"database {target.url.database!r} does not exist on {target.url.host or 'localhost'}"
    return None


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    lines = str(orig).strip().splitlines()
    return lines[0] if lines else type(orig).__name__


def reason(exc: BaseException, target: DatabaseTarget) -> str:
    """The reason for ``exc`` in one line (no SQL text), in words where it is a common one, with the
    password masked."""
    orig = getattr(exc, "orig", None) or exc
    out = _in_words(exc, target) or f"{type(orig).__name__}: {_first_line(exc)}"
    out = out.replace(str(target.url), target.masked)
    password = target.url.password
    if password:
        out = out.replace(str(password), "***")
    return out


def unavailable(exc: BaseException, target: DatabaseTarget) -> StoreUnavailableError:
    return StoreUnavailableError(f"Database {target.masked} is unavailable: {reason(exc, target)}")


def denied(exc: BaseException, target: DatabaseTarget) -> PermissionError:
    return PermissionError(f"Database {target.masked} refused the operation: {reason(exc, target)}")
