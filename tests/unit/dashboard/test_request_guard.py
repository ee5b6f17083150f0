"""The dashboard's per-request token and Host checks, and where it may listen."""

from __future__ import annotations

import pytest

from fedclinic.dashboard.request_guard import RequestGuard, new_token
from fedclinic.dashboard.server import check_binding
from fedclinic.errors import ConfigError

TOKEN = new_token()


def test_a_request_needs_the_token_and_a_host_naming_this_server():
    guard = RequestGuard(TOKEN, 8765)
    for host in ("127.0.0.1:8765", "localhost:8765", "[::1]:8765", "LOCALHOST:8765"):
        assert guard.refusal({"host": host}, {"token": TOKEN}) is None
        assert guard.refusal({"host": host, "x-fedclinic-token": TOKEN}, {}) is None
    assert guard.refusal({"host": "127.0.0.1:8765"}, {})[0] == 403
    assert guard.refusal({"host": "127.0.0.1:8765"}, {"token": TOKEN[:-1]})[0] == 403
    assert guard.refusal({"host": "127.0.0.1:8765", "x-fedclinic-token": "x" + TOKEN}, {})[0] == 403
    # DNS rebinding: a foreign name (or another port, or none) is refused even with the right token
    for host in ("attacker.example:8765", "127.0.0.1:9999", "127.0.0.1", ""):
        status, why = guard.refusal({"host": host}, {"token": TOKEN})
        assert status == 403 and "Host" in why


def test_names_beyond_loopback_are_allowed_only_when_given():
    guard = RequestGuard(TOKEN, 443, bound_host="10.1.2.3", allowed_hosts=["Dash.Hospital.example"])
    for host in ("10.1.2.3:443", "dash.hospital.example:443", "dash.hospital.example"):
        assert guard.refusal({"host": host}, {"token": TOKEN}) is None
    assert guard.refusal({"host": "other.hospital.example"}, {"token": TOKEN})[0] == 403
    with pytest.raises(ValueError):
        RequestGuard("short", 1)


def test_a_non_loopback_address_needs_allow_remote_and_https():
    check_binding("127.0.0.1", allow_remote=False, https_cert=None, https_key=None)
    check_binding("::1", allow_remote=False, https_cert=None, https_key=None)
    with pytest.raises(ConfigError, match="not a loopback address"):
        check_binding("0.0.0.0", allow_remote=False, https_cert=None, https_key=None)
    with pytest.raises(ConfigError, match="needs HTTPS"):
        check_binding("0.0.0.0", allow_remote=True, https_cert=None, https_key=None)
    with pytest.raises(ConfigError, match="both"):
        check_binding("127.0.0.1", allow_remote=False, https_cert="c.pem", https_key=None)
    check_binding("0.0.0.0", allow_remote=True, https_cert="c.pem", https_key="k.pem")


def test_the_command_refuses_a_non_loopback_bind_with_a_clear_error(tmp_path, capsys):
    from fedclinic import pki
    from fedclinic.cli import main

    pki.init_ca(tmp_path / "ca", common_name="test CA", days=1)
    pki.issue(tmp_path / "ca", role="scientist", name="alice", out_dir=tmp_path / "alice", days=1)
    creds = ["--address", "127.0.0.1:9", "--cert", str(tmp_path / "alice" / "alice.crt"),
             "--key", str(tmp_path / "alice" / "alice.key"), "--ca", str(tmp_path / "alice" / "ca.crt")]
    assert main(["dashboard", "--host", "0.0.0.0", *creds]) == 2
    assert "not a loopback address" in capsys.readouterr().err
    assert main(["dashboard", "--host", "0.0.0.0", "--allow-remote", *creds]) == 2
    assert "needs HTTPS" in capsys.readouterr().err
    assert main(["dashboard", "--poll", "0", *creds]) == 2
    assert "--poll must be" in capsys.readouterr().err
