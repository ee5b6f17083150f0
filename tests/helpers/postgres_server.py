"""A real PostgreSQL server that the test suite starts itself (issue 21).

Binaries, first found wins:

1. ``$FEDCLINIC_PG_BINDIR``;
2. ``pg_config --bindir`` when it holds ``initdb`` and ``postgres``;
3. the newest ``/usr/lib/postgresql/*/bin`` (Debian's ``postgresql-NN`` package);
4. the ``pgserver`` wheel's bundled server (``pgserver/pginstall/bin``), when that package is installed.

``scripts/install_postgresql.sh`` (run by ``make test``) provides one of them on a fresh machine.

The server runs as an unprivileged user when the tests run as root (``initdb`` refuses root; CI runs as root): the
``postgres`` system account when it exists, else ``nobody``. Its data directory and unix socket live in a fresh
temporary folder that user owns; it listens on 127.0.0.1 only, on a free port. It is tuned for tests (``fsync``
off: a crash of the test machine loses the test databases, nothing else). The process is this one's child, killed
by the kernel if this process dies (``PR_SET_PDEATHSIG``), and stopped on :meth:`PostgresServer.stop` with a fast
shutdown awaited under a deadline, so no server outlives the tests.

Authentication: trust on the unix socket (the helper's own administration), SCRAM password over TCP, so the DSN
the aggregator is given must carry a password from a file or the environment, as in production.
"""

from __future__ import annotations

import ctypes
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ADMIN_USER = "postgres"
START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 30.0
_PR_SET_PDEATHSIG = 1


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL binaries were found, or the server did not start; the message says what to do."""


def find_bindir() -> Path:
    """The directory holding ``initdb`` and ``postgres`` (see the module docstring for the search order)."""
    candidates: list[Path] = []
    if os.environ.get("FEDCLINIC_PG_BINDIR"):
        candidates.append(Path(os.environ["FEDCLINIC_PG_BINDIR"]))
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))

    def version(path: str) -> tuple[int, ...]:
        match = re.search(r"/postgresql/([\d.]+)/bin$", path)
        return tuple(int(p) for p in match.group(1).split(".")) if match else (0,)

    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True)]
    try:
        import pgserver  # type: ignore[import-not-found]

        candidates.append(Path(pgserver.__file__).parent / "pginstall" / "bin")
    except ImportError:
        pass
    for candidate in candidates:
        if (candidate / "initdb").is_file() and (candidate / "postgres").is_file():
            return candidate
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (initdb, postgres) found: run scripts/install_postgresql.sh "
        "(apt-get install postgresql as root, else pip install pgserver), or set FEDCLINIC_PG_BINDIR"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child after the user switch (which would clear the setting)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class PostgresServer:
    """One running PostgreSQL server; build it with :func:`start_server`."""

    root: Path
    port: int
    password: str
    bindir: Path
    process: subprocess.Popen[bytes]
    run_as: str | None
    _databases: list[str] = field(default_factory=list)

    host = "127.0.0.1"
    user = ADMIN_USER

    @property
    def socket_dir(self) -> Path:
        return self.root

    def dsn(self, dbname: str = "postgres", *, with_password: bool = False) -> str:
        """A ``postgresql://`` URL for ``dbname`` over TCP; without the password unless asked (the aggregator
        reads it from a file or the environment)."""
        secret = f":{self.password}" if with_password else ""
        return f"postgresql://{self.user}{secret}@{self.host}:{self.port}/{dbname}"

    def password_file(self) -> Path:
        """A file holding the password alone (mode 0600), as an operator would mount it."""
        path = self.root / "password"
        if not path.exists():
            path.write_text(self.password + "\n")
            path.chmod(0o600)
        return path

    def admin_sql(self, sql: str, dbname: str = "postgres") -> list[tuple[object, ...]]:
        """Run one statement as the superuser over the unix socket (trust auth, autocommit) and return its rows."""
        import psycopg

        with psycopg.connect(host=str(self.socket_dir), port=self.port, user=self.user, dbname=dbname,
                             autocommit=True, connect_timeout=10) as conn:
            cur = conn.execute(sql)  # type: ignore[arg-type]  # the helper's own literal statements
            return list(cur.fetchall()) if cur.description else []

    def create_database(self, name: str | None = None) -> str:
        """Create a fresh, empty database (a unique name when none is given) and return its name."""
        name = name or f"t_{secrets.token_hex(6)}"
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise ValueError(f"database name {name!r}: use lower-case letters, digits and _")
        self.admin_sql(f"CREATE DATABASE {name}")
        self._databases.append(name)
        return name

    def drop_database(self, name: str) -> None:
        """Drop ``name``, disconnecting whoever is still connected to it."""
        self.admin_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        if name in self._databases:
            self._databases.remove(name)

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Fast shutdown (SIGINT: roll back open transactions, disconnect clients), awaited under a deadline;
        SIGKILL if it has not exited by then. Removes the temporary folder."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_DEADLINE_S)
        shutil.rmtree(self.root, ignore_errors=True)


def _unprivileged_user() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise PostgresUnavailable("running as root and neither a 'postgres' nor a 'nobody' account exists to run the server")


def _log_tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def start_server(*, attempts: int = 5) -> PostgresServer:
    """initdb a fresh cluster in a new temporary folder and start it on a free 127.0.0.1 port; returns once it
    accepts connections (deadline :data:`START_DEADLINE_S`). Retries on another port if the chosen one was taken
    in the meantime. Raises :class:`PostgresUnavailable` with the server's log on failure."""
    bindir = find_bindir()
    run_as = _unprivileged_user()
    root = Path(tempfile.mkdtemp(prefix="fedclinic-pg-"))
    account = pwd.getpwnam(run_as) if run_as else None
    user_kw: dict[str, object] = {}
    if account is not None:
        os.chown(root, account.pw_uid, account.pw_gid)
        user_kw = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    root.chmod(0o700)
    password = secrets.token_urlsafe(18)
    pwfile = root / "initdb-pw"
    pwfile.write_text(password + "\n")
    if account is not None:
        os.chown(pwfile, account.pw_uid, account.pw_gid)
    data = root / "data"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    init = subprocess.run(
        [str(bindir / "initdb"), "-D", str(data), "-U", ADMIN_USER, f"--pwfile={pwfile}", "--auth-local=trust",
         "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync", "--locale=C"],
        capture_output=True, text=True, timeout=120, cwd=root, env=env, **user_kw,  # type: ignore[arg-type]
    )
    pwfile.unlink()
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise PostgresUnavailable(f"initdb failed ({init.returncode}): {init.stderr.strip()[-2000:]}")
    log = root / "server.log"
    last_error = ""
    for _ in range(attempts):
        port = free_port()
        with open(log, "ab") as log_fh:
            process = subprocess.Popen(
                [str(bindir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port),
                 "-k", str(root), "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                 "-c", "shared_buffers=32MB", "-c", "max_connections=200", "-c", "log_min_messages=warning"],
                stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=root, env=env,
                preexec_fn=_die_with_parent, **user_kw,  # type: ignore[arg-type]
            )
        server = PostgresServer(root=root, port=port, password=password, bindir=bindir, process=process,
                                run_as=run_as)
        if _wait_ready(server):
            return server
        last_error = _log_tail(log)
        if process.poll() is None:
            server.process.kill()
            server.process.wait(timeout=STOP_DEADLINE_S)
        if "could not bind" not in last_error and "already in use" not in last_error:
            break
    shutil.rmtree(root, ignore_errors=True)
    raise PostgresUnavailable(f"PostgreSQL did not start; its log ends with:\n{last_error}")


def _wait_ready(server: PostgresServer) -> bool:
    """True once ``postmaster.pid`` says ``ready`` (line 8) and the socket answers; False if the process exits or
    the deadline passes."""
    pidfile = server.root / "data" / "postmaster.pid"
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            lines = pidfile.read_text().splitlines()
        except OSError:
            lines = []
        if len(lines) >= 8 and lines[7].strip() == "ready":
            try:
                with socket.create_connection((server.host, server.port), timeout=1.0):
                    return True
            except OSError:
                pass
        try:
            server.process.wait(timeout=0.05)  # wakes at once if the server exits
        except subprocess.TimeoutExpired:
            pass
    return False


def postgres_state(server: PostgresServer, database: str) -> dict[str, str]:
    """The aggregator's ``[state]`` table for ``database`` on ``server`` (URL without the password, which the
    aggregator reads from the password file)."""
    return {"database": server.dsn(database), "database_password_file": str(server.password_file())}
