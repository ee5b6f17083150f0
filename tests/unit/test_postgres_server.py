"""The test suite's own PostgreSQL server (tests/helpers/postgres_server.py): it starts as an unprivileged user on
127.0.0.1, a module gets a fresh database reachable with the password over TCP (never without it), and stop() leaves
no process behind."""

from __future__ import annotations

import os

import psycopg
import pytest

from tests.helpers.postgres_server import start_server


def test_module_database_over_tcp_with_password(postgres_server, postgres_database):
    assert postgres_server.running()
    password = postgres_server.password_file().read_text().strip()
    with psycopg.connect(postgres_server.dsn(postgres_database), password=password, connect_timeout=10) as conn:
        conn.execute("CREATE TABLE t (x integer)")
        conn.execute("INSERT INTO t VALUES (1)")
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (1,)
        assert conn.execute("SELECT inet_server_addr()::text").fetchone()[0].startswith("127.0.0.1")
        if os.geteuid() == 0:
            assert conn.execute("SHOW data_directory").fetchone()  # the server is up as a non-root account
            assert postgres_server.run_as in ("postgres", "nobody")
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(postgres_server.dsn(postgres_database), password="wrong", connect_timeout=10)
    other = postgres_server.create_database()
    tables = postgres_server.admin_sql("SELECT count(*) FROM pg_tables WHERE tablename = 't'", dbname=other)
    assert tables == [(0,)]  # a fresh database per module: nothing leaks across
    postgres_server.drop_database(other)


def test_stop_leaves_no_process():
    server = start_server()
    pid, root = server.process.pid, server.root
    server.stop()
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not root.exists()
