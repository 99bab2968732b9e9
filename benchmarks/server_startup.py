"""Time from starting ``lightning-sql serve`` to its first ``200`` on ``/healthz``.

    python -m benchmarks.server_startup [--repeat 5] [--postgres URL]

Each start is a new process (as a supervisor restarts it); the database already exists (the server's
first start migrates it, and that start is reported apart).  Prints the median and the worst.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import psutil

POLL_S = 0.01
GIVE_UP_S = 60.0


@dataclass(frozen=True)
class Startup:
    wall_s: float  # spawn to the first 200 on /healthz
    cpu_s: float  # CPU the server process used until then: the wall time of an idle core, less I/O


def free_port() -> int:
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_server(args: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[str, Startup]]:
    """Spawn ``python -m lightning_sql.server ARGS``; yield its base URL and how long it took to
    answer 200 on /healthz; stop it afterwards."""
    port = free_port()
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_sql.server", *args, "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=1) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if process.poll() is not None:
                raise RuntimeError(f"the server exited: {process.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
            if time.perf_counter() - began > GIVE_UP_S:
                raise RuntimeError("the server did not become healthy")
            time.sleep(POLL_S)
        wall = time.perf_counter() - began
        cpu = psutil.Process(process.pid).cpu_times()
        yield base, Startup(wall, cpu.user + cpu.system)
    finally:
        process.terminate()
        process.wait(30)


def time_to_healthy(args: list[str], env: dict[str, str] | None = None) -> Startup:
    """Wall and CPU seconds from spawning the server to its first 200 on /healthz."""
    with running_server(args, env) as (_base, startup):
        return startup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--postgres", help="also measure on this PostgreSQL URL (a throwaway schema)")
    options = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as workdir:
        targets = {"sqlite": ["--url", f"sqlite:///{workdir}/startup.db"]}
        if options.postgres:
            targets["postgresql"] = ["--url", options.postgres, "--schema", f"startup_{os.getpid()}"]
        for name, args in targets.items():
            first = time_to_healthy(args, env)
            starts = [time_to_healthy(args, env) for _ in range(options.repeat)]
            walls, cpus = [s.wall_s for s in starts], [s.cpu_s for s in starts]
            print(
                f"{name}: first start (migrates) {first.wall_s:.2f} s; then wall median {statistics.median(walls):.2f} s "
                f"(worst {max(walls):.2f} s), CPU median {statistics.median(cpus):.2f} s over {len(starts)} starts; "
                f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
            )


if __name__ == "__main__":
    main()
