"""Validation and encoding of the JSON values the store writes (docs/store-contract.md §0.4).

`encode_json` is on the span-ingest hot path, so it makes one recursive walk over the value with exact-type
fast paths and no per-node string work; the path of an offending element is assembled only when an error
unwinds the walk.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, NoReturn

from pydantic import BaseModel

try:
    import orjson
except ImportError:  # pragma: no cover - a core dependency; the standard encoder still works
    orjson = None  # type: ignore[assignment]


def _limit_from_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer number of bytes, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer number of bytes, got {raw!r}")
    return value


__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_JSON_BYTES",
    "MAX_ID_BYTES",
    "MIN_INT64",
    "MAX_INT64",
    "check_int64",
    "encode_json",
    "check_json",
    "json_text",
    "check_text",
    "is_storable_text",
]

MAX_JSON_DEPTH = 64  # deeper values are almost certainly cycles or bugs; keeps the walk's recursion bounded
# Per stored value (one input, one span's attributes, ...): far above any sane payload, well below
# driver limits.  Deployments that want a tighter cap set LIGHTNING_SQL_MAX_JSON_BYTES (read at import).
MAX_JSON_BYTES = _limit_from_env("LIGHTNING_SQL_MAX_JSON_BYTES", 16 * 1024 * 1024)
# Ids and names are index keys: PostgreSQL refuses a btree row over 2,704 bytes, and the limit is the
# same on every backend so that what SQLite accepts PostgreSQL accepts too.
MAX_ID_BYTES = 1024

# Every integer the store keeps, in a JSON value or a column, fits a signed 64-bit integer: what
# PostgreSQL's BIGINT and SQLite's INTEGER hold, and what a JSON reader can give back as an integer.
MIN_INT64 = -(2**63)
MAX_INT64 = 2**63 - 1

# UTF-8 needs at most 4 bytes per code point: text this short cannot exceed the limit, so we skip encoding it.
_SAFE_CHARS = MAX_JSON_BYTES // 4

# Lone surrogates cannot be encoded as UTF-8 (and PostgreSQL text cannot hold NUL).
_SURROGATE = re.compile("[\ud800-\udfff]")


class _Invalid(Exception):
    """Raised inside the walk; collects the path segments (innermost first) while unwinding."""

    def __init__(self, error_type: type[Exception], message: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.segments: list[str] = []


def _fail(error_type: type[Exception], message: str) -> NoReturn:
    raise _Invalid(error_type, message)


def _string_problem(value: str) -> str | None:
    if "\x00" in value:
        return "NUL character (\\x00) is not allowed"
    if not value.isascii():
        match = _SURROGATE.search(value)
        if match is not None:
            return f"lone surrogate U+{ord(match.group()):04X} is not allowed"
    return None


def _check_string(value: str) -> None:
    problem = _string_problem(value)
    if problem is not None:
        _fail(ValueError, f"{problem} in a string")


def _int_text(value: int) -> str:
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} digits)"


def _check_int(value: int) -> None:
    if not MIN_INT64 <= value <= MAX_INT64:
        _fail(ValueError, f"integer {_int_text(value)} is outside the signed 64-bit range")


def check_int64(value: Any, field: str, *, minimum: int = MIN_INT64, maximum: int = MAX_INT64) -> int:
    """``value`` when it is an int (not a bool) in ``minimum..maximum``; else a ``TypeError`` (not an
    int) or ``ValueError`` naming ``field``, the value and the bounds."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{field} must be an integer in {minimum}..{maximum}, got {_int_text(value)}")
    return value


def _check_float(value: float) -> None:
    if not math.isfinite(value):
        if value != value:
            _fail(ValueError, "NaN is not allowed")
        _fail(ValueError, f"{'' if value > 0 else '-'}Infinity is not allowed")


def _walk(value: Any, depth: int, allow_models: bool) -> None:
    kind = type(value)
    # Exact-type fast paths first: this is what spans and inputs are made of.
    if kind is str:
        _check_string(value)
        return
    if kind is bool or value is None:
        return
    if kind is int:
        _check_int(value)
        return
    if kind is float:
        _check_float(value)
        return
    if kind is dict:
        _walk_dict(value, depth + 1, allow_models)
        return
    if kind is list or kind is tuple:
        _walk_sequence(value, depth + 1, allow_models)
        return
    # Subclasses (str enums, int enums, OrderedDict, ...) encode like their bases.
    if isinstance(value, str):
        _check_string(value)
    elif isinstance(value, bool):
        return
    elif isinstance(value, int):
        _check_int(value)
    elif isinstance(value, float):
        _check_float(value)
    elif isinstance(value, dict):
        _walk_dict(value, depth + 1, allow_models)
    elif isinstance(value, list | tuple):
        _walk_sequence(value, depth + 1, allow_models)
    elif isinstance(value, BaseModel) and allow_models:
        _walk(value.model_dump(mode="json"), depth, allow_models)
    else:
        hint = " (dump it with model_dump(mode='json'))" if isinstance(value, BaseModel) else ""
        _fail(TypeError, f"value of type {kind.__name__} is not JSON-serialisable{hint}")


def _walk_dict(value: dict[Any, Any], depth: int, allow_models: bool) -> None:
    if depth > MAX_JSON_DEPTH:
        _fail(ValueError, f"nesting exceeds the maximum depth of {MAX_JSON_DEPTH}")
    for key, item in value.items():
        if type(key) is not str and not isinstance(key, str):
            _fail(
                TypeError, f"dict key {key!r} of type {type(key).__name__} is not allowed (keys must be str)"
            )
        if "\x00" in key or not key.isascii():
            problem = _string_problem(key)
            if problem is not None:
                _fail(ValueError, f"dict key {key!r}: {problem}")
        # Clean ASCII strings and ints are most leaves: settle them here rather than in a call per leaf.
        kind = type(item)
        if kind is str:
            if "\x00" not in item and item.isascii():
                continue
        elif kind is bool or item is None:
            continue
        elif kind is int and MIN_INT64 <= item <= MAX_INT64:
            continue
        elif kind is float and item - item == 0.0:  # false only for NaN and ±Infinity
            continue
        try:
            _walk(item, depth, allow_models)
        except _Invalid as error:
            error.segments.append(f"[{key!r}]")
            raise


def _walk_sequence(value: list[Any] | tuple[Any, ...], depth: int, allow_models: bool) -> None:
    if depth > MAX_JSON_DEPTH:
        _fail(ValueError, f"nesting exceeds the maximum depth of {MAX_JSON_DEPTH}")
    for index, item in enumerate(value):
        kind = type(item)
        if kind is str:
            if "\x00" not in item and item.isascii():
                continue
        elif kind is bool or item is None:
            continue
        elif kind is int and MIN_INT64 <= item <= MAX_INT64:
            continue
        elif kind is float and item - item == 0.0:  # false only for NaN and ±Infinity
            continue
        try:
            _walk(item, depth, allow_models)
        except _Invalid as error:
            error.segments.append(f"[{index}]")
            raise


def _model_default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"value of type {type(value).__name__} is not JSON-serialisable")


def check_json(value: Any, field: str, *, allow_models: bool = False) -> None:
    """Return normally iff `value` is a storable JSON value (§0.4); else raise naming `field` and the path.

    Raises:
        TypeError: a value of a type JSON cannot hold (set, bytes, datetime, non-str dict key, a pydantic model
            unless `allow_models`, ...).
        ValueError: NaN/±Infinity, an integer outside the signed 64-bit range, a NUL character or lone
            surrogate in a string or key, or nesting deeper than `MAX_JSON_DEPTH`.
    """
    try:
        _walk(value, 0, allow_models)
    except _Invalid as error:
        path = field + "".join(reversed(error.segments))
        raise error.error_type(f"{path}: {error.message}") from None


def encode_json(value: Any, field: str, *, allow_models: bool = False) -> str | None:
    """Return the compact JSON text of `value`, or None for None (stored as SQL NULL); validates per §0.4.

    Pydantic models (anywhere in `value`) are accepted only with `allow_models=True` and are encoded as
    `model_dump(mode="json")`. Errors name `field` and the path inside it, e.g.
    `input['tags']: value of type set is not JSON-serialisable`.
    """
    if value is None:
        return None
    kind = type(value)
    if (kind is list or kind is dict) and not value:
        return "[]" if kind is list else "{}"  # most span events / links: no walk, no encoder
    if allow_models and isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    check_json(value, field, allow_models=allow_models)
    return json_text(value, field, allow_models=allow_models)


def json_text(value: Any, field: str, *, allow_models: bool = False) -> str:
    """The compact JSON text of a value that ``check_json`` passed (or whose every leaf the caller
    checked as it would); raises ``ValueError`` naming ``field`` when it exceeds ``MAX_JSON_BYTES``."""
    text: str | None = None
    if orjson is not None:
        # ~10x faster than json.dumps on span attributes; the walk already refused what orjson
        # would accept differently (NaN, non-str keys, depth, integers beyond 64 bits); a value the
        # caller did not check may still make it raise TypeError: the standard encoder takes those.
        try:
            text = orjson.dumps(value, default=_model_default if allow_models else None).decode()
        except TypeError:
            text = None
    if text is None:
        text = json.dumps(
            value,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
            default=_model_default if allow_models else None,
        )
    if len(text) > _SAFE_CHARS:
        size = len(text.encode("utf-8"))
        if size > MAX_JSON_BYTES:
            raise ValueError(f"{field}: encoded size {size} bytes exceeds the limit of {MAX_JSON_BYTES} bytes")
    return text


def check_text(value: str, field: str, *, max_bytes: int | None = MAX_ID_BYTES) -> None:
    """Return normally iff `value` can be stored as text: a str with no NUL character and no lone surrogate.

    Raises:
        TypeError: `value` is not a str.
        ValueError: `value` contains a NUL character or a lone surrogate, or its UTF-8 encoding is
            longer than `max_bytes` (ids are index keys) (the message names `field`).
    """
    if not isinstance(value, str):
        raise TypeError(f"{field}: expected a str, got a value of type {type(value).__name__}")
    if max_bytes is not None and len(value) > max_bytes // 4:  # shorter is within the limit anyway
        size = len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise ValueError(f"{field}: {size} bytes (UTF-8) exceed the limit of {max_bytes} bytes for an id or name")
    problem = _string_problem(value)
    if problem is not None:
        raise ValueError(f"{field}: {problem}")


def is_storable_text(value: object) -> bool:
    """Whether ``value`` could be a stored id or name (``check_text`` passes): reads use it to make an
    impossible id match nothing instead of raising."""
    try:
        check_text(value, "value")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True
