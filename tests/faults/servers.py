"""Throwaway servers for the fault scenarios: a private PostgreSQL cluster, PgBouncer in front of it,
a small tmpfs for a full disk, and ``lightning-sql worker`` subprocesses.

Nothing here touches the shared PostgreSQL server on 5432: every cluster is initdb'd in a temp dir and
listens on a free port, and is stopped and deleted afterwards.  Binaries: PostgreSQL's from
/usr/lib/postgresql/*/bin (Debian's ``postgresql`` package), ``pgbouncer`` (Debian's ``pgbouncer``).
As root, servers run as the ``postgres`` OS user (neither initdb nor pgbouncer runs as root).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from glob import glob
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]

# The apt line that provides every binary used here (CI installs it; see the module docstring).
APT_PACKAGES = "postgresql pgbouncer"


class MissingServerBinary(FileNotFoundError):
    """A server binary this scenario needs is not installed."""


def pg_bin(name: str) -> str:
    candidates = sorted(glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if candidates:
        return candidates[-1]
    found = shutil.which(name)
    if found is None:
        raise MissingServerBinary(f"{name} not found under /usr/lib/postgresql/*/bin or on PATH")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_root() -> bool:
    return os.geteuid() == 0


def _wait_for_port(port: int, timeout: float, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


# --- PostgreSQL -------------------------------------------------------------------------------------


DEFAULT_PG_SETTINGS: dict[str, str | int] = {"fsync": "off", "max_connections": 100}


class ThrowawayPostgres:
    """A private PostgreSQL cluster (initdb + pg_ctl as the ``postgres`` OS user, trust auth, temp dir).

    ``settings`` are appended to postgresql.conf (over ``DEFAULT_PG_SETTINGS``), e.g.
    ``{"max_connections": 30}``.  Scenarios that stop, restart or crash the server, or need roles and
    server settings of their own, use this, never the shared server on 5432.
    """

    def __init__(self, settings: Mapping[str, str | int] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lsql-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = free_port()
        self.settings = {**DEFAULT_PG_SETTINGS, **(settings or {})}
        if _as_root():
            shutil.chown(self.dir, user="postgres", group="postgres")
        self._run(pg_bin("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        lines = [
            f"port = {self.port}",
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{self.dir}'",
            *(f"{key} = {_pg_value(value)}" for key, value in self.settings.items()),
        ]
        with open(self.data / "postgresql.conf", "a") as fh:
            fh.write("\n" + "\n".join(lines) + "\n")

    def _run(self, *args: str) -> None:
        cmd = ["runuser", "-u", "postgres", "--", *args] if _as_root() else list(args)
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def url(self, password: str | None = None, *, user: str = "postgres", database: str = "postgres") -> str:
        auth = user if password is None else f"{user}:{password}"
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, mode: str = "fast") -> None:
        self._run(
            pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-m", mode, "-w", "-t", "60", "restart"
        )

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- administration (as the superuser, which no role limit or role setting applies to) -----------

    async def execute(self, *statements: str, database: str = "postgres") -> None:
        import asyncpg

        conn = await asyncpg.connect(self.url(database=database))
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    async def fetchval(self, query: str, *args: Any, database: str = "postgres") -> Any:
        import asyncpg

        conn = await asyncpg.connect(self.url(database=database))
        try:
            return await conn.fetchval(query, *args)
        finally:
            await conn.close()

    async def role_with_database(
        self, name: str, *, connection_limit: int = -1, role_settings: Mapping[str, str] | None = None
    ) -> str:
        """A login role (not a superuser: role limits apply to it) that owns a database of the same
        name; returns the role's URL of that database."""
        statements = [f'CREATE ROLE "{name}" LOGIN CONNECTION LIMIT {int(connection_limit)}']
        for key, value in (role_settings or {}).items():
            statements.append(f"ALTER ROLE \"{name}\" SET {key} = '{value}'")
        statements.append(f'CREATE DATABASE "{name}" OWNER "{name}"')
        await self.execute(*statements)
        return self.url(user=name, database=name)

    async def connections_of(self, role: str) -> int:
        """Client connections the server holds for ``role`` right now."""
        return int(
            await self.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND backend_type = 'client backend'",
                role,
            )
        )


def _pg_value(value: str | int) -> str:
    if isinstance(value, int):
        return str(value)
    return value if value.replace(".", "").replace("_", "").isalnum() else f"'{value}'"


@contextmanager
def throwaway_postgres(settings: Mapping[str, str | int] | None = None) -> Iterator[ThrowawayPostgres]:
    """A started ``ThrowawayPostgres``, destroyed on exit."""
    pg = ThrowawayPostgres(settings)
    try:
        pg.start()
        yield pg
    finally:
        pg.destroy()


# --- PgBouncer ------------------------------------------------------------------------------------


class PgBouncer:
    """Debian's ``pgbouncer`` in front of a ``ThrowawayPostgres``, on another free port.

    Clients of every database of the cluster connect through it with the cluster's trust auth; the
    users it admits are written to its userlist.  ``pool_mode`` defaults to ``transaction``: a server
    connection belongs to a client for one transaction only, so session state (prepared statements,
    SET, LISTEN) does not survive from one transaction to the next.
    """

    def __init__(
        self,
        server: ThrowawayPostgres,
        *,
        users: Sequence[str] = ("postgres",),
        pool_mode: str = "transaction",
        default_pool_size: int = 2,
        max_client_conn: int = 200,
    ) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.path.exists(binary):
            raise MissingServerBinary("pgbouncer not found (Debian: apt-get install -y pgbouncer)")
        self.server = server
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="lsql-bouncer-"))
        self.log = self.dir / "pgbouncer.log"
        userlist = self.dir / "userlist.txt"
        userlist.write_text("".join(f'"{user}" ""\n' for user in users))
        ini = self.dir / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={server.port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {userlist}\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {default_pool_size}\n"
            f"max_client_conn = {max_client_conn}\n"
            f"logfile = {self.log}\n"
            f"pidfile = {self.dir / 'pgbouncer.pid'}\n"
            "admin_users = postgres\n"
            "ignore_startup_parameters = extra_float_digits\n"
        )
        cmd = [binary, str(ini)]
        if _as_root():
            shutil.chown(self.dir, user="postgres", group="postgres")
            for path in (userlist, ini):
                shutil.chown(path, user="postgres", group="postgres")
            cmd = [binary, "-u", "postgres", str(ini)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait_for_port(self.port, 30, self._proc)
        except BaseException:
            self.destroy()
            raise

    def url(self, *, user: str = "postgres", database: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def destroy(self) -> None:
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        if self._proc.stderr is not None:
            self._proc.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# --- a small disk ---------------------------------------------------------------------------------


class CannotMount(RuntimeError):
    """This process may not mount a tmpfs (not root, or no mount namespace rights)."""


@contextmanager
def small_tmpfs(directory: Path, size: str = "2m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``directory`` (root only), unmounted on exit."""
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise CannotMount(f"mount -t tmpfs failed ({done.stderr.strip() or done.returncode})")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def fill_disk(directory: Path, name: str = "filler.bin") -> Path:
    """Write a file in ``directory`` until the file system is full; returns its path."""
    path = directory / name
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as fh:
        for size in (65536, 4096, 512, 1):
            piece = chunk[:size]
            while True:
                try:
                    fh.write(piece)
                except OSError:
                    break
    return path


@contextmanager
def full_disk(disk: Path, database: Path) -> Iterator[None]:
    """The disk is full, and the database's WAL file empty, until the block ends."""
    wal = Path(f"{database}-wal")
    for _ in range(100):
        checkpoint = sqlite3.connect(database)
        try:
            busy, _, _ = checkpoint.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        finally:
            checkpoint.close()
        filler = fill_disk(disk)
        if busy == 0 and (not wal.exists() or wal.stat().st_size == 0):
            break
        filler.unlink()  # a reader or a write came in between: again
        time.sleep(0.05)
    else:
        raise RuntimeError(f"the WAL of {database} never emptied before the disk was filled")
    try:
        yield
    finally:
        filler.unlink()


# --- `lightning-sql worker` subprocesses -------------------------------------------------------------


def lightning_sql_script() -> str:
    """The installed ``lightning-sql`` console script of this interpreter."""
    beside = Path(sys.executable).parent / "lightning-sql"
    if beside.exists():
        return str(beside)
    found = shutil.which("lightning-sql")
    if found is None:
        raise MissingServerBinary("the lightning-sql console script is not installed (pip install -e .)")
    return found


class WorkerProcess:
    """``lightning-sql worker --url URL --run RUN --agent SPEC -n N [extra]``, with this checkout first on
    ``PYTHONPATH`` (the code under test, and the tests' agent modules); output goes to files."""

    def __init__(
        self, url: str, run: str, agent: str, n: int, directory: Path, *extra: str, env: Mapping[str, str] | None = None
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env["COLUMNS"] = "400"  # one log record stays one line whatever handler prints it
        self.stdout_path = directory / "stdout.txt"
        self.stderr_path = directory / "stderr.txt"
        self._stdout: IO[bytes] = open(self.stdout_path, "wb")  # noqa: SIM115 - closed in wait()/kill()
        self._stderr: IO[bytes] = open(self.stderr_path, "wb")  # noqa: SIM115
        cmd = [lightning_sql_script(), "worker", "--url", url, "--run", run, "--agent", agent, "-n", str(n), *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._stdout, stderr=self._stderr)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stderr_lines(self) -> list[str]:
        return [line for line in self.stderr_path.read_text(errors="replace").splitlines() if line.strip()]

    def describe(self) -> str:
        tail = "\n".join(self.stderr_lines()[-30:])
        return f"worker pid {self.pid} exit code {self.proc.poll()}; stderr tail:\n{tail}"

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._close()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(30)
        self._close()

    def _close(self) -> None:
        for fh in (self._stdout, self._stderr):
            if not fh.closed:
                fh.close()


async def sample_max(probe: Any, stop: asyncio.Event, interval: float = 0.02) -> int:
    """The largest value ``await probe()`` returned until ``stop`` is set."""
    peak = 0
    while not stop.is_set():
        peak = max(peak, int(await probe()))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass
    return max(peak, int(await probe()))


__all__ = [
    "APT_PACKAGES",
    "CannotMount",
    "MissingServerBinary",
    "PgBouncer",
    "ThrowawayPostgres",
    "WorkerProcess",
    "fill_disk",
    "full_disk",
    "free_port",
    "lightning_sql_script",
    "pg_bin",
    "sample_max",
    "small_tmpfs",
    "throwaway_postgres",
]
