"""At a trainer's start: hand back at once the rollouts held by runner processes of this machine that are gone.

Runners put their process identity in every worker heartbeat (``heartbeat_stats``): host name, boot
id, PID namespace, pid and the process's start time.  A process of the same host, boot and PID
namespace whose pid no longer exists (or belongs to a process started later) cannot be running its
attempt any more, so waiting for its lease to expire only stalls the rerun.  Its attempts are marked
``unresponsive`` through the public store API, exactly as an expired lease would be, and the
rollout's retry policy requeues them.  Rollouts held by workers this process cannot check (another
host, or no identity recorded) are counted, with the longest time their lease can still run.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

import psutil

from lightning_sql.store.base import PersistentStore
from lightning_sql.types import AttemptedRollout, RolloutStatus, Worker

if TYPE_CHECKING:
    from lightning_sql.store.base import LightningStore

__all__ = ["LeaseRecovery", "process_identity", "process_gone", "release_stopped_local_workers"]

logger = logging.getLogger(__name__)

START_TIME_TOLERANCE_S = 1.0  # psutil's create_time is rounded; a reused pid starts much later
IN_FLIGHT: list[RolloutStatus] = ["preparing", "running"]


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


@cache
def _machine() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pid_namespace": _pid_namespace(),
    }


def process_identity() -> dict[str, Any]:
    """Who this process is, for the worker heartbeat: host, boot id, PID namespace, pid, start time."""
    return {**_machine(), "pid": os.getpid(), "process_started": psutil.Process().create_time()}


def process_gone(stats: dict[str, Any] | None) -> bool:
    """True when ``stats`` name a process of this machine (same host, boot, PID namespace) that no longer runs."""
    if not stats:
        return False
    here = _machine()
    if here["boot_id"] is None or here["pid_namespace"] is None:
        return False  # no way to tell this kernel's processes apart from another's
    if any(stats.get(key) != here[key] for key in ("host", "boot_id", "pid_namespace")):
        return False
    pid = stats.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid == os.getpid():
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return True  # killed, not yet reaped by its parent
        started = process.create_time()
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
    recorded = stats.get("process_started")
    return isinstance(recorded, (int, float)) and started > recorded + START_TIME_TOLERANCE_S


@dataclass
class LeaseRecovery:
    """What ``release_stopped_local_workers`` did and found."""

    released: list[str] = field(default_factory=list)
    """Rollouts whose attempt was handed back (their worker's process is gone)."""
    waiting: list[str] = field(default_factory=list)
    """Rollouts held by workers that cannot be checked from here."""
    waiting_workers: list[str] = field(default_factory=list)
    longest_wait_s: float = 0.0
    """The longest time one of the ``waiting`` leases can still run."""

    def describe(self) -> list[str]:
        """One line per finding, for the user."""
        lines = []
        if self.released:
            lines.append(
                f"{len(self.released)} rollouts held by stopped runner processes of this machine were handed back "
                "to the queue"
            )
        if self.waiting:
            workers = ", ".join(self.waiting_workers[:4]) + (" …" if len(self.waiting_workers) > 4 else "")
            lines.append(
                f"{len(self.waiting)} rollouts wait for the lease of a worker that may have stopped ({workers}), "
                f"up to {self.longest_wait_s:.0f} s"
            )
        return lines


async def release_stopped_local_workers(store: LightningStore) -> LeaseRecovery:
    """Hand back the attempts of gone local runner processes; count the in-flight rollouts left to leases."""
    recovery = LeaseRecovery()
    persistent = store if isinstance(store, PersistentStore) else None
    if persistent is not None and persistent.read_only:
        return recovery
    inflight = [r for r in await store.query_rollouts(status_in=IN_FLIGHT) if isinstance(r, AttemptedRollout)]
    if not inflight:
        return recovery
    workers: dict[str, Worker] = {w.worker_id: w for w in await store.query_workers()}
    now = persistent.now() if persistent is not None else time.time()
    for rollout in inflight:
        attempt = rollout.attempt
        worker = workers.get(attempt.worker_id or "")
        stats = worker.heartbeat_stats if worker is not None else None
        if process_gone(stats):
            assert stats is not None
            error = {
                "type": "lightning_sql.RunnerProcessGone",
                "message": f"{attempt.worker_id} (pid {stats.get('pid')} on {stats.get('host')}) was gone when a "
                "trainer started on the same machine",
                "traceback": "",
            }
            try:
                await store.update_attempt(
                    rollout.rollout_id, attempt.attempt_id, status="unresponsive",
                    metadata={**(attempt.metadata or {}), "error": error},
                )
            except Exception as exc:  # noqa: BLE001 - its lease still recovers it
                logger.warning("Could not hand back rollout %s: %s", rollout.rollout_id, exc)
            else:
                recovery.released.append(rollout.rollout_id)
                continue
        if stats and stats.get("host") == _machine()["host"] and not process_gone(stats):
            pid = stats.get("pid")
            if isinstance(pid, int) and psutil.pid_exists(pid):
                continue  # a live runner of this machine is working on it
        recovery.waiting.append(rollout.rollout_id)
        if attempt.worker_id and attempt.worker_id not in recovery.waiting_workers:
            recovery.waiting_workers.append(attempt.worker_id)
        lease = rollout.config.unresponsive_seconds
        if lease is not None:
            last = attempt.last_heartbeat_time if attempt.last_heartbeat_time is not None else attempt.start_time
            recovery.longest_wait_s = max(recovery.longest_wait_s, last + lease - now, 0.0)
    return recovery
