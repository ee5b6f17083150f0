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
