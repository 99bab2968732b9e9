"""Checks of a store call's arguments, done in Python before any I/O: bad input raises a clear
error (pydantic's ``ValidationError`` where Agent-Lightning raises one) and writes nothing."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_sql.store.sql import rollouts as ro
from lightning_sql.store.sql.executor import EncodedJson
from lightning_sql.store.sql.rows import encoded
from lightning_sql.types import (
    UNSET,
    Attempt,
    Rollout,
    RolloutConfig,
    Unset,
    check_text,
    new_rollout_id,
)

ROLLOUT_STATUSES = ("queuing", "preparing", "running", "failed", "succeeded", "cancelled", "requeuing")
ATTEMPT_STATUSES = ("preparing", "running", "failed", "succeeded", "unresponsive", "timeout")
MODES = ("train", "val", "test")

# The smallest valid instance of each model, to validate one field through the model.
_PROBES: dict[str, tuple[type[Rollout] | type[Attempt], dict[str, Any]]] = {
    "Rollout": (Rollout, {"rollout_id": "x", "input": None, "start_time": 0.0}),
    "Attempt": (Attempt, {"rollout_id": "x", "attempt_id": "y", "sequence_id": 1, "start_time": 0.0}),
}


def _validated(model: str, field: str, value: Any) -> Any:
    """``value`` as pydantic makes it for ``field`` of ``model``, or pydantic's ValidationError, so
    the caller gets the error upstream raises."""
    cls, probe = _PROBES[model]
    return getattr(cls.model_validate({**probe, field: value}), field)


def invalid_rollout_field(field: str, value: Any, model: str = "Rollout") -> None:
    """Raise pydantic's ValidationError for a value a model field cannot take (as upstream), or a
    ``TypeError`` naming the field when pydantic would coerce it (e.g. pairs into a dict)."""
    _validated(model, field, value)
    raise TypeError(f"{field} must be a dict or None, got a value of type {type(value).__name__}")


def validate_literal(value: Any, allowed: Sequence[str], field: str, model: str) -> None:
    if value not in allowed:
        from pydantic import ValidationError

        _validated(model, field, value)
        raise ValidationError.from_exception_data(model, [])  # pragma: no cover - unreachable


def new_rollout(
    default_rollout_config: RolloutConfig | None,
    input: Any,
    mode: Any,
    resources_id: Any,
    config: Any,
    metadata: Any,
    idempotency_key: Any,
    where: str = "",
    priority: Any = 0,
) -> ro.NewRollout:
    if mode is not None:
        validate_literal(mode, MODES, "mode", "Rollout")
    if resources_id is not None:
        check_text(resources_id, f"{where}resources_id")
    if config is None:
        config = default_rollout_config.model_copy(deep=True) if default_rollout_config else RolloutConfig()
    elif isinstance(config, RolloutConfig):
        config = config.model_copy(deep=True)
    else:
        config = RolloutConfig.model_validate(config)
    if metadata is not None and not isinstance(metadata, dict):
        invalid_rollout_field("metadata", metadata)
    metadata_value = dict(metadata) if metadata is not None else {}
    if idempotency_key is not None:
        if not isinstance(idempotency_key, str) or not idempotency_key:
            raise ValueError(f"{where}idempotency_key must be a non-empty str or None, got {idempotency_key!r}")
        check_text(idempotency_key, f"{where}idempotency_key")
    return ro.NewRollout(
        rollout_id=new_rollout_id(),
        input=encoded(input, f"{where}input"),
        mode=mode,
        resources_id=resources_id,
        config=config,
        metadata=encoded(metadata_value, f"{where}metadata"),
        idempotency_key=idempotency_key,
        priority=check_priority(priority, f"{where}priority"),
        input_value=json_roundtrip_value(input),
        metadata_value=metadata_value,
    )


def attempt_changes(status: Any, worker_id: Any, last_heartbeat_time: Any, metadata: Any) -> dict[str, Any]:
    """The columns an ``update_attempt`` writes, checked (bad input raises before any I/O)."""
    changes: dict[str, Any] = {}
    if not isinstance(status, Unset):
        validate_literal(status, ATTEMPT_STATUSES, "status", "Attempt")
        changes["status"] = status
    if not isinstance(worker_id, Unset):
        if worker_id is not None:
            check_text(worker_id, "worker_id")
        changes["worker_id"] = worker_id
    if not isinstance(last_heartbeat_time, Unset):
        if last_heartbeat_time is not None and (
            isinstance(last_heartbeat_time, bool) or not isinstance(last_heartbeat_time, (int, float))
        ):
            _validated("Attempt", "last_heartbeat_time", last_heartbeat_time)
            last_heartbeat_time = float(last_heartbeat_time)  # pydantic accepted it as a number
        if last_heartbeat_time is not None and not math.isfinite(last_heartbeat_time):
            raise ValueError(f"last_heartbeat_time must be a finite number, got {last_heartbeat_time!r}")
        changes["last_heartbeat_time"] = None if last_heartbeat_time is None else float(last_heartbeat_time)
    if not isinstance(metadata, Unset):
        changes["metadata"] = _metadata(metadata, "Attempt")
    return changes


def check_priority(priority: Any, field: str = "priority") -> int:
    """A rollout's priority: an int of 32 bits (a bool is refused)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"{field} must be an int, got {priority!r}")
    if not -(2**31) <= priority < 2**31:
        raise ValueError(f"{field} must fit 32 bits, got {priority!r}")
    return priority


def rollout_changes(
    input: Any, mode: Any, resources_id: Any, status: Any, config: Any, metadata: Any, priority: Any = UNSET
) -> dict[str, Any]:
    """The columns an ``update_rollout`` writes, checked (bad input raises before any I/O)."""
    changes: dict[str, Any] = {}
    if not isinstance(priority, Unset):
        changes["priority"] = check_priority(priority)
    if not isinstance(input, Unset):
        changes["input"] = encoded(input, "input")
    if not isinstance(mode, Unset):
        if mode is not None:
            validate_literal(mode, MODES, "mode", "Rollout")
        changes["mode"] = mode
    if not isinstance(resources_id, Unset):
        if resources_id is not None:
            check_text(resources_id, "resources_id")
        changes["resources_id"] = resources_id
    if not isinstance(status, Unset):
        validate_literal(status, ROLLOUT_STATUSES, "status", "Rollout")
        changes["status"] = status
    if not isinstance(config, Unset):
        if not isinstance(config, RolloutConfig):
            config = _validated("Rollout", "config", config)
        changes["config"] = config
    if not isinstance(metadata, Unset):
        changes["metadata"] = _metadata(metadata, "Rollout")
    return changes


def _metadata(metadata: Any, model: str) -> EncodedJson | None:
    """An update's ``metadata`` (a dict or None), checked and encoded."""
    if metadata is not None and not isinstance(metadata, dict):
        invalid_rollout_field("metadata", metadata, model)
    return encoded(metadata, "metadata")


def json_roundtrip_value(value: Any) -> Any:
    """What a JSON value reads back as (tuples become lists), without encoding it again."""
    if isinstance(value, tuple | list):
        return [json_roundtrip_value(v) for v in value]
    if isinstance(value, dict):
        return {k: json_roundtrip_value(v) for k, v in value.items()}
    return value
