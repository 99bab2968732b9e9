"""A run remembers what it was started with; resuming it with other data is refused unless accepted.

At a run's first ``fit`` the Trainer records a fingerprint of the algorithm, the datasets and the
initial resources in the run's metadata (key ``lightning_sql.fit``).  A later ``fit`` on the same run
compares: the same fingerprint resumes as before; another one raises :class:`RunChangedError`,
whose message names what changed and the three ways on (a new run name, deleting the run,
``Trainer(accept_changes=True)``), before anything is enqueued.  ``Baseline`` keys samples by their
content, so an accepted change keeps the finished samples that are still in the datasets and runs
the others.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_sql.store.base import PersistentStore

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = [
    "FINGERPRINT_KEY",
    "RunChangedError",
    "canonical_json",
    "content_digest",
    "fit_fingerprint",
    "describe_changes",
    "check_fingerprint",
]

FINGERPRINT_KEY = "lightning_sql.fit"
DIGEST_CHARS = 16  # 64 bits of SHA-256: collisions among a run's samples are not a practical concern


class RunChangedError(ValueError):
    """A run is resumed with other datasets, initial resources or algorithm than it was started with."""


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    return repr(value)


def canonical_json(value: Any) -> str:
    """One JSON text per value: sorted keys, no spaces (models as their JSON dump)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_plain)


def content_digest(value: Any) -> str:
    """A short stable hash of a value's canonical JSON."""
    return hashlib.sha256(canonical_json(value).encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_CHARS]


def _dataset_part(dataset: Sequence[Any] | None) -> dict[str, Any]:
    items = list(dataset or [])
    digest = hashlib.sha256()
    for item in items:
        digest.update(canonical_json(item).encode("utf-8", "surrogatepass"))
        digest.update(b"\n")
    return {"items": len(items), "sha256": digest.hexdigest()[:DIGEST_CHARS]}


def fit_fingerprint(
    algorithm: Any, train_dataset: Sequence[Any] | None, val_dataset: Sequence[Any] | None, initial_resources: Any
) -> dict[str, Any]:
    """What a ``fit`` is started with: the algorithm's class and ``settings()``, each dataset's size and hash,
    the initial resources' hash."""
    cls = type(algorithm)
    settings = getattr(algorithm, "settings", None)
    return {
        "algorithm": f"{cls.__module__}.{cls.__qualname__}",
        "settings": settings() if callable(settings) else {},
        "train": _dataset_part(train_dataset),
        "val": _dataset_part(val_dataset),
        "initial_resources": None if not initial_resources else content_digest(initial_resources),
    }


def describe_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, in words."""
    changes: list[str] = []
    if recorded.get("algorithm") != current.get("algorithm"):
        changes.append(f"algorithm {recorded.get('algorithm')} → {current.get('algorithm')}")
    for part in ("train", "val"):
        old, new = recorded.get(part) or {}, current.get(part) or {}
        if old == new:
            continue
        if old.get("items") != new.get("items"):
            changes.append(f"{part} dataset {old.get('items')} items → {new.get('items')} items")
        else:
            changes.append(f"{part} dataset: the same number of items ({new.get('items')}), other content or order")
    if recorded.get("settings", {}) != current.get("settings", {}):
        changes.append(f"algorithm settings {recorded.get('settings', {})} → {current.get('settings', {})}")
    if recorded.get("initial_resources") != current.get("initial_resources"):
        changes.append("initial resources changed")
    return changes or ["the recorded fingerprint differs"]


async def check_fingerprint(
    store: LightningStore, run: str | None, fingerprint: dict[str, Any], *, accept_changes: bool, rollouts: int = 0
) -> list[str]:
    """Record the fingerprint at a run's first fit; refuse (or, accepted, record) another one later.

    ``rollouts`` is how many rollouts the run holds: a run with rollouts but no fingerprint was started
    by an earlier lightning_sql or by another program, so its data cannot be compared.  Returns the
    changes that were accepted (empty when nothing changed).  Stores that keep no run metadata (no
    ``get_run`` / ``update_run_metadata``) are not checked.

    Raises:
        RunChangedError: the run was started with another fingerprint and ``accept_changes`` is false.
    """
    if run is None or not isinstance(store, PersistentStore) or store.read_only:
        return []
    row = await store.get_run(run)
    metadata: dict[str, Any] = dict((row.metadata if row is not None else None) or {})
    recorded = metadata.get(FINGERPRINT_KEY)
    if recorded == fingerprint:
        return []
    changes: list[str] = []
    if not isinstance(recorded, dict) and rollouts:
        changes = [f"the run holds {rollouts} rollouts but no record of the data it was started with"]
        if not accept_changes:
            raise RunChangedError(
                f"Run {run!r} holds {rollouts} rollouts but no record of the datasets it was started with (an "
                "earlier lightning_sql or another program started it), so resuming cannot check that they are "
                "the same; nothing was enqueued. Either use a new run name (Trainer(run=...)), or pass "
                "Trainer(accept_changes=True) to resume it: samples are matched by content, and those finished "
                "under another key scheme run again."
            )
    elif isinstance(recorded, dict):
        changes = describe_changes(recorded, fingerprint)
        if not accept_changes:
            raise RunChangedError(
                f"Run {run!r} was started with other data: {'; '.join(changes)}. Resuming it would mix its "
                "finished rollouts with the new data, so nothing was enqueued. Either use a new run name "
                f"(Trainer(run=...)), delete the run first (lightning-sql gc --delete-run {run} --url URL, or "
                f"store.delete_run({run!r})), or pass Trainer(accept_changes=True) to keep the finished samples "
                "that are still in the datasets and run the rest."
            )
    metadata[FINGERPRINT_KEY] = fingerprint
    await store.update_run_metadata(metadata)
    return changes
