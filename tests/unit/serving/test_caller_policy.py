"""Who may query a served model: certificate roles and the bearer token."""

from __future__ import annotations

import pytest

from fedclinic import pki
from fedclinic.errors import ConfigError
from fedclinic.serving.caller_policy import CallerPolicy


def test_certificate_roles(tmp_path):
    pki.init_ca(tmp_path / "ca")
    pem = {role: pki.issue(tmp_path / "ca", role=role, name=f"{role}-1", out_dir=tmp_path / role).cert_path.read_bytes()
           for role in pki.ROLES}
    policy = CallerPolicy()
    assert policy.check_certificate(pem["scientist"]) is None and policy.check_certificate(pem["agent"]) is None
    for role in ("admin", "aggregator"):
        assert f"role {role!r}" in policy.check_certificate(pem[role])
    assert "requires a client certificate" in policy.check_certificate(None)
    assert CallerPolicy(("admin",)).check_certificate(pem["admin"]) is None
    with pytest.raises(ConfigError, match="unknown role"):
        CallerPolicy(("doctor",))


def test_bearer_token(tmp_path):
    (tmp_path / "token").write_text("  abcdefghijklmnopqrstuvwxyz\n")
    policy = CallerPolicy.from_token_file(str(tmp_path / "token"))
    assert policy.check_token("Bearer abcdefghijklmnopqrstuvwxyz") is None
    assert policy.check_token("bearer  abcdefghijklmnopqrstuvwxyz ") is None
    assert "not this server's token" in policy.check_token("Bearer abcdefghijklmnopqrstuvwxyZ")
    assert "requires 'Authorization: Bearer" in policy.check_token(None)
    assert "requires 'Authorization: Bearer" in policy.check_token("Basic abc")
    assert CallerPolicy().check_token(None) is None  # no token configured
    (tmp_path / "short").write_text("short")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        CallerPolicy.from_token_file(str(tmp_path / "short"))
    with pytest.raises(ConfigError, match="cannot read the token file"):
        CallerPolicy.from_token_file(str(tmp_path / "missing"))
