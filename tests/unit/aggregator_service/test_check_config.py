"""``fedclinic-aggregator check-config``: a good configuration passes; each problem is named with what to do."""

from __future__ import annotations

import os

from aggregator_service.cli import main
from fedclinic import pki


def _setup(tmp_path, role: str = "aggregator"):
    pki.init_ca(tmp_path / "ca")
    pki.issue(tmp_path / "ca", role=role, name="central", out_dir=tmp_path / "tls", dns=["localhost"])
    config = tmp_path / "aggregator.toml"
    config.write_text('listen = "127.0.0.1:7443"\nstate_dir = "state"\n[tls]\ncert = "tls/central.crt"\n'
                      'key = "tls/central.key"\nca = "tls/ca.crt"\ncrl = "ca/crl.pem"\n')
    return config


def test_good_configuration_passes_and_creates_state_dir(tmp_path, capsys):
    config = _setup(tmp_path)
    assert main(["check-config", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "aggregator 'central', valid until" in out and "configuration OK" in out
    assert (tmp_path / "state").is_dir()


def test_each_problem_is_reported(tmp_path, capsys):
    config = _setup(tmp_path, role="agent")  # a site's certificate where the aggregator's belongs
    os.chmod(tmp_path / "tls" / "central.key", 0o644)
    config.write_text(config.read_text().replace('crl = "ca/crl.pem"', 'crl = "tls/ca.crt"'))  # not a CRL
    assert main(["check-config", "--config", str(config)]) == 1
    err = capsys.readouterr()
    assert "problem(s) found" in err.out
    assert "chmod 600" in err.err and "[tls] crl" in err.err
    os.chmod(tmp_path / "tls" / "central.key", 0o600)
    assert main(["check-config", "--config", str(config)]) == 1
    assert "role 'aggregator'" in capsys.readouterr().err


def test_unknown_setting_and_missing_crl(tmp_path, capsys):
    config = _setup(tmp_path)
    config.write_text(config.read_text().replace('crl = "ca/crl.pem"', 'crl_path = "ca/crl.pem"'))
    assert main(["check-config", "--config", str(config)]) == 1
    assert "crl_path" in capsys.readouterr().err
    config.write_text(config.read_text().replace('crl_path = "ca/crl.pem"\n', ""))
    assert main(["check-config", "--config", str(config)]) == 1
    assert "no revocation list configured" in capsys.readouterr().err


def _with_state(config, state: dict) -> None:
    lines = "".join(f'{k} = "{v}"\n' for k, v in state.items())
    config.write_text(config.read_text() + "[state]\n" + lines)


def test_a_postgresql_state_is_reached_and_its_schema_reported_without_writing(tmp_path, capsys, postgres_server):
    """check-config connects to the configured database with the configured password file, says what schema it holds
    (none yet, then this build's after serve's migration) and writes nothing; a newer schema is a problem."""
    from aggregator_service.store import SCHEMA_VERSION, DatabaseSettings, PostgresStore
    from tests.helpers.postgres_server import postgres_state

    name = postgres_server.create_database()
    try:
        config = _setup(tmp_path)
        _with_state(config, postgres_state(postgres_server, name))
        assert main(["check-config", "--config", str(config)]) == 0
        out = capsys.readouterr().out
        assert f"/{name}, no fedclinic schema yet (serve creates it)" in out and "configuration OK" in out
        assert postgres_server.admin_sql("SELECT to_regclass('meta') IS NULL", name) == [(True,)]  # nothing written
        PostgresStore(DatabaseSettings(url=postgres_server.dsn(name), password_file=postgres_server.password_file()),
                      tmp_path / "state").close()
        assert main(["check-config", "--config", str(config)]) == 0
        assert f"schema version {SCHEMA_VERSION} (this build's)" in capsys.readouterr().out
        postgres_server.admin_sql(f"UPDATE meta SET value = '{SCHEMA_VERSION + 1}' WHERE key = 'schema_version'", name)
        assert main(["check-config", "--config", str(config)]) == 1
        assert f"has schema version {SCHEMA_VERSION + 1}, newer than this" in capsys.readouterr().err
    finally:
        postgres_server.drop_database(name)


def test_an_unreachable_or_refused_postgresql_state_is_a_problem_that_says_what_to_check(tmp_path, capsys,
                                                                                         postgres_server):
    from tests.helpers.postgres_server import free_port, postgres_state

    config = _setup(tmp_path)
    base = config.read_text()
    state = postgres_state(postgres_server, "postgres")
    (tmp_path / "wrong-password").write_text("not-the-password\n")
    _with_state(config, {**state, "database_password_file": str(tmp_path / "wrong-password")})
    assert main(["check-config", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "cannot use the PostgreSQL database" in err and "the password" in err and "not-the-password" not in err
    config.write_text(base)
    nobody = state["database"].replace(f":{postgres_server.port}/", f":{free_port()}/")
    assert nobody != state["database"]
    _with_state(config, {**state, "database": nobody})
    assert main(["check-config", "--config", str(config)]) == 1
    assert "Check that the server runs and accepts connections from this host" in capsys.readouterr().err
