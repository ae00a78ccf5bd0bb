"""A real PostgreSQL server for tests and benchmarks, on a temporary data directory.

Debian's server binaries (``/usr/lib/postgresql/<version>/bin``: ``apt-get install
postgresql``, which scripts/test.sh does where they are missing). The server refuses to
run as root, so as root it runs as the ``postgres`` user (``runuser``). It listens on
127.0.0.1 on a free port, with its Unix socket in the temporary directory and trust
authentication (nothing but this machine can reach it), and is stopped and removed after.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

PG_USER = "postgres"


class PostgresMissingError(RuntimeError):
    pass


def server_bin_dir() -> Path:
    """The newest installed server's bin directory."""
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    if not found:
        raise PostgresMissingError(
            "PostgreSQL's server binaries are not installed (no /usr/lib/postgresql/*/bin/"
            "initdb): apt-get install postgresql (scripts/test.sh installs it)"
        )
    newest = max(found, key=lambda p: int(Path(p).parts[-3].split(".")[0]))
    return Path(newest).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    """A running server; ``url(db)`` for one of its databases, ``new_database()`` for an
    empty one."""

    def __init__(self, bin_dir: Path, root: Path, port: int) -> None:
        self.bin_dir, self.root, self.port = bin_dir, root, port
        self._names = itertools.count(1)

    def url(self, dbname: str) -> str:
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/{dbname}"

    def run(self, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / tool), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", PG_USER, "--", *cmd]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, check=False, cwd=self.root
        )
        if done.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"{tool} {' '.join(args)} failed ({done.returncode}):\n"
                f"{done.stdout}{done.stderr}{tail}"
            )
        return done

    def create_database(self, dbname: str) -> str:
        self.run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, dbname)
        return self.url(dbname)

    def new_database(self) -> str:
        return self.create_database(f"test_{os.getpid()}_{next(self._names)}")


def _prepare_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="omnistage-pg-"))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam(PG_USER)
        except KeyError:
            shutil.rmtree(root)
            raise PostgresMissingError(
                f"running as root needs the {PG_USER!r} user (Debian's postgresql package makes it)"
            ) from None
        os.chown(root, user.pw_uid, user.pw_gid)
    return root


@contextlib.contextmanager
def postgres_server(durable: bool = False) -> Iterator[PostgresServer]:
    """A fresh server. ``durable=False`` (tests) turns off fsync: a crash of the machine
    would lose the data, which a test does not keep anyway; ``durable=True`` keeps
    PostgreSQL's defaults (a benchmark measures what a user would run)."""
    bin_dir = server_bin_dir()
    root = _prepare_root()
    server = PostgresServer(bin_dir, root, 0)
    data = root / "data"
    started = False
    try:
        server.run("initdb", "-D", str(data), "-U", PG_USER, "-A", "trust", "-E", "UTF8",
                   "--no-locale", "--no-sync")  # fmt: skip
        options = f"-k {root} -c listen_addresses=127.0.0.1 -c max_connections=200"
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        for attempt in range(3):  # the free port may be taken before the server binds it
            server.port = _free_port()
            try:
                server.run("pg_ctl", "-D", str(data), "-l", str(root / "server.log"), "-w",
                           "-t", "60", "-o", f"{options} -p {server.port}", "start")  # fmt: skip
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        started = True
        yield server
    finally:
        if started:
            with contextlib.suppress(Exception):
                server.run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def postgres_database(dbname: str = "omnistage", durable: bool = False) -> Iterator[str]:
    """A fresh server with one empty database: its URL."""
    with postgres_server(durable) as server:
        yield server.create_database(dbname)
