"""Where the aggregator keeps its state: the ``[state]`` table of ``aggregator.toml``.

Without it (or with ``database = "sqlite"``) the state is the embedded SQLite database in ``state_dir``. With a
PostgreSQL URL it is a PostgreSQL database (:class:`~aggregator_service.store.postgres_store.PostgresStore`)::

    [state]
    database = "postgresql://fedclinic@db.example.org:5432/fedclinic?sslmode=verify-full&sslrootcert=/etc/fedclinic/db-ca.crt"
    database_password_file = "/run/secrets/fedclinic-db-password"   # or FEDCLINIC_DATABASE_PASSWORD in the environment
    pool_size = 16                                                    # connections the aggregator may hold

The password never goes in the TOML: a URL carrying one (``user:secret@`` or ``password=``) is refused. It comes
from ``database_password_file`` (the file holds the password alone; a trailing newline is ignored) or from the
environment variable :data:`PASSWORD_ENV` (a Kubernetes Secret as env), not both; with neither, libpq's own sources
apply (``PGPASSFILE`` / ``~/.pgpass``, or a client certificate named in the URL: ``sslcert=``, ``sslkey=``).
``state_dir`` is still used with PostgreSQL: model blobs, update spill files, the audit trail and the CRL
high-water mark live there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedclinic.errors import ConfigError

PASSWORD_ENV = "FEDCLINIC_DATABASE_PASSWORD"
KEYS = ("database", "database_password_file", "pool_size")
SCHEMES = ("postgresql://", "postgres://")
DEFAULT_POOL_SIZE = 16


@dataclass(frozen=True)
class DatabaseSettings:
    """The ``[state]`` table, checked. ``url`` "" = the embedded SQLite database."""

    url: str = ""
    password_file: Path | None = None
    pool_size: int = DEFAULT_POOL_SIZE

    @property
    def is_postgresql(self) -> bool:
        return bool(self.url)

    @classmethod
    def from_table(cls, table: Any, src: str, base: Path) -> "DatabaseSettings":
        """Check ``[state]`` of ``src`` (relative paths are relative to ``base``, the TOML's folder)."""
        if table is None:
            return cls()
        if not isinstance(table, dict):
            raise ConfigError(f"{src}: state must be a table ([state])")
        unknown = sorted(set(table) - set(KEYS))
        if unknown:
            raise ConfigError(f"{src}: [state] has unknown keys {unknown}; known: {list(KEYS)}")
        url = table.get("database", "sqlite")
        if not isinstance(url, str):
            raise ConfigError(f"{src}: [state] database must be a string: \"sqlite\" or a postgresql:// URL")
        pool_size = table.get("pool_size", DEFAULT_POOL_SIZE)
        if not isinstance(pool_size, int) or isinstance(pool_size, bool) or not 2 <= pool_size <= 1000:
            raise ConfigError(f"{src}: [state] pool_size must be a whole number from 2 to 1000, got {pool_size!r}")
        pw = table.get("database_password_file")
        if url in ("", "sqlite"):
            if pw is not None:
                raise ConfigError(f"{src}: [state] database_password_file is set but the state is the embedded SQLite "
                                  "database; set [state] database to a postgresql:// URL, or remove it")
            return cls()
        if not url.startswith(SCHEMES):
            raise ConfigError(f"{src}: [state] database must be \"sqlite\" or a postgresql:// URL, got "
                              f"{_scheme(url)!r}...")
        params = parse_url(url, src)
        if "password" in params:
            raise ConfigError(f"{src}: [state] database carries a password; never put it in the configuration: put "
                              f"it in a file named by [state] database_password_file, or in {PASSWORD_ENV}")
        password_file = None
        if pw is not None:
            if not isinstance(pw, str) or not pw:
                raise ConfigError(f"{src}: [state] database_password_file must be a path")
            if os.environ.get(PASSWORD_ENV):
                raise ConfigError(f"{src}: both [state] database_password_file and {PASSWORD_ENV} are set; keep one")
            q = Path(pw).expanduser()
            password_file = q if q.is_absolute() else base / q
            read_password(password_file, src)  # fail at load, not at the first connection
        return cls(url=url, password_file=password_file, pool_size=pool_size)

    def password(self) -> str | None:
        """The password from the file or :data:`PASSWORD_ENV`; None: leave it to libpq."""
        if self.password_file is not None:
            return read_password(self.password_file, "[state] database_password_file")
        return os.environ.get(PASSWORD_ENV) or None

    def where(self) -> str:
        """``user@host:port/dbname``: what error messages name (never the password)."""
        p = parse_url(self.url, "[state] database")
        host = p.get("host") or "localhost (unix socket)"
        return f"{p.get('user', '(default user)')}@{host}:{p.get('port', '5432')}/{p.get('dbname', '(default)')}"


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] + "://" if "://" in url else url[:12]


def parse_url(url: str, src: str) -> dict[str, str]:
    """libpq's reading of ``url`` as keyword -> value (ConfigError when it is not a valid connection URL)."""
    from psycopg import conninfo as ci
    from psycopg import ProgrammingError

    try:
        return {k: str(v) for k, v in ci.conninfo_to_dict(url).items()}
    except ProgrammingError as exc:  # libpq's message names the part it could not parse, not the secret
        raise ConfigError(f"{src}: [state] database is not a valid PostgreSQL URL: {exc}") from None


def read_password(path: Path, src: str) -> str:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{src}: cannot read the database password file {path}: {exc.strerror}") from None
    password = text.rstrip("\r\n")
    if not password or "\n" in password:
        raise ConfigError(f"{src}: the database password file {path} must hold the password alone, on one line")
    return password
