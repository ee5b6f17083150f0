"""A read-only connection to the database of a SQL or OMOP data source, and its password.

Settings (in the dataset's table of agent.toml)::

    engine = "postgresql"                # or "sqlite"
    dsn = "host=cdw.hospital.local port=5432 dbname=cdw user=fedclinic_reader"   # PostgreSQL (libpq conninfo)
    password_file = "/etc/hospital-agent/cdw-password"   # or password_env = "CDW_PASSWORD"; never in the TOML
    database = "/data/cdw.sqlite"        # SQLite: the database file
    connect_timeout_s = 10

Every query runs in a read-only transaction: PostgreSQL sessions start with ``default_transaction_read_only =
on`` and each transaction is ``BEGIN READ ONLY`` (psycopg's ``read_only``), and is rolled back at the end;
SQLite files are opened with the ``mode=ro`` URI (and ``PRAGMA query_only``). A write the query could hide
(a function that writes) is refused by the database itself.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import quote

from fedclinic.data.sources.records import SourceCheck
from fedclinic.errors import ConfigError, DatasetError, FedclinicError

ENGINES = ("postgresql", "sqlite")
#: the keys of a dataset table that configure its database
DATABASE_KEYS = ("engine", "dsn", "database", "password_file", "password_env", "connect_timeout_s")
UNREACHABLE = "the data source's database cannot be reached"
REFUSED = "the database refused the data source's query"

class SourceUnavailable(DatasetError):
    """The data source's database cannot be reached now (down, refusing, a password file missing): the agent
    declines the round for now, not the task for good (``transient``); the public part is the rule only."""

    transient = True


#: run(sql) -> (column names, rows)
Runner = Callable[[str], tuple[list[str], list[tuple]]]


@dataclass(frozen=True)
class Database:
    """Where a SQL source's rows live; :meth:`read_only` opens it."""

    engine: str
    dsn: str | None = None
    path: Path | None = None
    password_file: Path | None = None
    password_env: str | None = None
    connect_timeout_s: float = 10.0

    @classmethod
    def from_entry(cls, entry: dict[str, Any], base: Path, where: str) -> "Database":
        """The database settings of a dataset table (ConfigError says what to change)."""
        refuse_password(entry, where)
        engine = entry.get("engine")
        if engine not in ENGINES:
            raise ConfigError(f"{where}: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        timeout = entry.get("connect_timeout_s", 10)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
            raise ConfigError(f"{where}: connect_timeout_s must be a number of seconds in (0, 600], got {timeout!r}")
        if engine == "sqlite":
            for key in ("dsn", "password_file", "password_env"):
                if key in entry:
                    raise ConfigError(f"{where}: {key} is a PostgreSQL setting; a SQLite source names its file "
                                      "with database = \"/path/to/file.sqlite\"")
            path = entry.get("database")
            if not isinstance(path, str) or not path:
                raise ConfigError(f"{where}: a SQLite source needs database = \"/path/to/file.sqlite\"")
            p = Path(path).expanduser()
            return cls("sqlite", path=p if p.is_absolute() else base / p, connect_timeout_s=float(timeout))
        if "database" in entry:
            raise ConfigError(f"{where}: database names a SQLite file; a PostgreSQL source uses dsn = \"host=... "
                              "dbname=... user=...\"")
        dsn = entry.get("dsn")
        if not isinstance(dsn, str) or not dsn.strip():
            raise ConfigError(f"{where}: a PostgreSQL source needs dsn = \"host=HOST port=5432 dbname=DB "
                              "user=USER\" (libpq connection string, without the password)")
        _no_password_in(dsn, where)
        pw_file, pw_env = entry.get("password_file"), entry.get("password_env")
        if pw_file is not None and pw_env is not None:
            raise ConfigError(f"{where}: set password_file or password_env, not both")
        if pw_file is not None and (not isinstance(pw_file, str) or not pw_file):
            raise ConfigError(f"{where}: password_file must be a path, got {pw_file!r}")
        if pw_env is not None and (not isinstance(pw_env, str) or not pw_env.strip()):
            raise ConfigError(f"{where}: password_env must name an environment variable, got {pw_env!r}")
        pf = Path(pw_file).expanduser() if pw_file else None
        return cls("postgresql", dsn=dsn.strip(), password_file=(pf if pf is None or pf.is_absolute() else base / pf),
                   password_env=pw_env, connect_timeout_s=float(timeout))

    def describe(self) -> str:
        """The engine and where (host, port, database, user; never a password)."""
        if self.engine == "sqlite":
            return f"sqlite {self.path}"
        from psycopg.conninfo import conninfo_to_dict

        parts = conninfo_to_dict(self.dsn)
        shown = " ".join(f"{k}={parts[k]}" for k in ("host", "port", "dbname", "user") if k in parts)
        return f"postgresql {shown}".strip()

    def password(self) -> str | None:
        """The password from password_file or password_env (None when neither is set: libpq's own means, e.g.
        a client certificate or ~/.pgpass). DatasetError says what is missing."""
        if self.password_file is not None:
            try:
                return self.password_file.read_text(encoding="utf-8").rstrip("\r\n")
            except OSError as exc:
                raise SourceUnavailable(f"password_file {self.password_file} cannot be read ({exc.strerror or exc}); "
                                   "create it, readable by the agent's user only (chmod 600)",
                                   rule=UNREACHABLE) from None
        if self.password_env is not None:
            value = os.environ.get(self.password_env)
            if value is None:
                raise SourceUnavailable(f"the environment variable {self.password_env} (password_env) is not set for "
                                   "the agent; set it in the service's environment (e.g. a systemd EnvironmentFile)",
                                   rule=UNREACHABLE)
            return value
        return None

    def password_file_exposed(self) -> bool:
        """The password file is readable by users other than its owner and group's (mode o+r)."""
        try:
            return self.password_file is not None and bool(self.password_file.stat().st_mode & 0o004)
        except OSError:
            return False

    @contextmanager
    def read_only(self) -> Iterator[Runner]:
        """A read-only transaction on the database; yields ``run(sql) -> (columns, rows)``. DatasetError
        (rule :data:`UNREACHABLE`) when it cannot be opened, (rule :data:`REFUSED`) when a query fails."""
        if self.engine == "sqlite":
            with self._sqlite() as run:
                yield run
        else:
            with self._postgresql() as run:
                yield run

    @contextmanager
    def _sqlite(self) -> Iterator[Runner]:
        if self.path is None or not self.path.is_file():
            raise SourceUnavailable(f"{self.describe()}: no such database file; check database = in the dataset's table",
                               rule=UNREACHABLE)
        try:
            db = sqlite3.connect(f"file:{quote(str(self.path))}?mode=ro", uri=True, timeout=self.connect_timeout_s)
            db.execute("PRAGMA query_only = ON")
        except sqlite3.Error as exc:
            raise SourceUnavailable(f"{self.describe()}: cannot open the database read-only ({exc}); check the file and "
                               "that the agent's user may read it", rule=UNREACHABLE) from None

        def run(sql: str) -> tuple[list[str], list[tuple]]:
            try:
                cur = db.execute(sql)
                return [d[0] for d in cur.description or ()], cur.fetchall()
            except sqlite3.Error as exc:
                raise DatasetError(f"{self.describe()}: the query failed: {exc}", rule=REFUSED) from None

        try:
            yield run
        finally:
            db.close()

    @contextmanager
    def _postgresql(self) -> Iterator[Runner]:
        import psycopg

        password = self.password()
        kwargs: dict[str, Any] = {"connect_timeout": max(1, int(round(self.connect_timeout_s))),
                                  "options": "-c default_transaction_read_only=on"}
        if password is not None:
            kwargs["password"] = password
        try:
            conn = psycopg.connect(self.dsn, autocommit=False, **kwargs)
        except psycopg.Error as exc:
            raise SourceUnavailable(f"{self.describe()}: cannot connect ({_first_line(exc)}); check host, port, dbname, "
                               "user and the password, and that the server accepts this machine",
                               rule=UNREACHABLE) from None
        conn.read_only = True  # every transaction: BEGIN READ ONLY

        def run(sql: str) -> tuple[list[str], list[tuple]]:
            try:
                with conn.cursor() as cur:
                    cur.execute(sql)
                    return [d.name for d in cur.description or ()], cur.fetchall()
            except psycopg.Error as exc:
                raise DatasetError(f"{self.describe()}: the query failed: {_first_line(exc)}", rule=REFUSED) from None

        try:
            yield run
        finally:
            try:
                conn.rollback()
            finally:
                conn.close()


def refuse_password(entry: dict[str, Any], where: str) -> None:
    """ConfigError when a dataset table holds a ``password`` (it belongs in password_file or password_env)."""
    if "password" in entry:
        raise ConfigError(f"{where}: do not put the database password in agent.toml; write it to a file only "
                          "the agent's user can read and set password_file, or set password_env to the name "
                          "of an environment variable holding it")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _no_password_in(dsn: str, where: str) -> None:
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(dsn)
    except Exception as exc:  # psycopg.ProgrammingError: an unparsable conninfo
        raise ConfigError(f"{where}: dsn is not a valid libpq connection string ({_first_line(exc)}); e.g. "
                          "\"host=cdw.hospital.local port=5432 dbname=cdw user=fedclinic_reader\"") from None
    if "password" in parts:
        raise ConfigError(f"{where}: the dsn holds a password; remove it and use password_file or password_env "
                          "(a password in agent.toml ends up in backups and support bundles)")





def read_only_report(db: Database, run: Runner) -> tuple[list[str], list[str], list[str]]:
    """``(facts, problems, notes)`` on how read-only the open connection ``run`` is, for check-config:
    PostgreSQL: the transaction is read-only, the role is no superuser (a problem: it could lift the read-only
    setting outside fedclinic), and whether it may write any table (a note: grant it SELECT only); SQLite: the
    file is opened with mode=ro and query_only."""
    if db.engine == "sqlite":
        _, rows = run("PRAGMA query_only")
        ok = bool(rows and rows[0][0])
        return ([f"read-only: opened with mode=ro{', query_only on' if ok else ''}"], [], [])
    facts, problems, notes = [], [], []
    _, rows = run("SHOW transaction_read_only")
    if rows and rows[0][0] == "on":
        facts.append("read-only: every query runs in a READ ONLY transaction")
    else:
        problems.append("the transaction is not read-only (a pooler dropped the session options?); connect to the "
                        "server directly")
    _, rows = run("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")
    user, superuser = (rows[0][0], bool(rows[0][1])) if rows else ("?", False)
    if superuser:
        problems.append(f"the database user {user!r} is a superuser; connect as a role that may only SELECT the "
                        "tables the dataset reads (docs/hospital-it.md, \"A read-only database role\")")
    _, rows = run("SELECT count(*) FROM information_schema.table_privileges WHERE grantee = current_user AND "
                  "privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE')")
    writable = int(rows[0][0]) if rows else 0
    if writable:
        notes.append(f"the database user {user!r} may write {writable} table privilege(s) (INSERT/UPDATE/DELETE/"
                     "TRUNCATE); fedclinic only reads, but a role with SELECT only is safer")
    else:
        facts.append(f"database user {user!r} holds no write privilege on any table")
    return facts, problems, notes
def check_database(db: Database, body: Callable[[Runner, SourceCheck], None]) -> SourceCheck:
    """``check-config``'s report for a database source: reachable, the read-only checks of
    :func:`read_only_report`, then ``body(run, report)`` (the source's own columns and counts) in the same read-only
    transaction; a FedclinicError becomes a problem, and a password file others can read a note."""
    report = SourceCheck()
    try:
        with db.read_only() as run:
            report.facts.append(f"reachable: {db.describe()}")
            facts, problems, notes = read_only_report(db, run)
            report.facts += facts
            report.problems += problems
            report.notes += notes
            body(run, report)
    except FedclinicError as exc:
        report.problems.append(str(exc))
    if db.password_file_exposed():
        report.notes.append(f"password_file {db.password_file} is readable by every user of this machine; "
                            f"chmod 600 {db.password_file}")
    return report


__all__ = ["DATABASE_KEYS", "ENGINES", "Database", "REFUSED", "SourceUnavailable", "UNREACHABLE", "check_database", "read_only_report",
           "refuse_password"]
