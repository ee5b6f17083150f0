"""Signed statements: a payload signed for one purpose verifies for that purpose, signer, role and CA only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fedclinic import pki
from fedclinic.pki import PkiError
from fedclinic.pki.signed_statement import SignedStatement, Signer, canonical_json


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    pki.init_ca(tmp_path / "ca")
    return tmp_path / "ca"


def _signer(ca: Path, tmp_path: Path, role: str, name: str) -> Signer:
    c = pki.issue(ca, role=role, name=name, out_dir=tmp_path / name)
    return Signer(key_path=c.key_path, cert_path=c.cert_path)


def test_a_statement_verifies_for_its_purpose_signer_and_ca_and_nothing_else(ca: Path, tmp_path: Path) -> None:
    s = _signer(ca, tmp_path, "scientist", "alice").sign_json("task", {"b": 1, "a": [1.5, "x"]})
    assert s.payload == b'{"a":[1.5,"x"],"b":1}' == canonical_json({"a": [1.5, "x"], "b": 1})
    ident = s.verify(ca_path=ca / "ca.crt", role="scientist", name="alice", purpose="task")
    assert (ident.role, ident.name) == ("scientist", "alice")
    back = SignedStatement.from_proto(s.to_proto())
    assert back == s and back.json() == {"a": [1.5, "x"], "b": 1}

    with pytest.raises(PkiError, match="signed for 'task' .* 'model'"):
        s.verify(ca_path=ca / "ca.crt", role="scientist", purpose="model")
    with pytest.raises(PkiError, match="not by 'bob'"):
        s.verify(ca_path=ca / "ca.crt", role="scientist", name="bob")
    with pytest.raises(PkiError, match="role 'agent'"):
        s.verify(ca_path=ca / "ca.crt", role="agent")
    with pytest.raises(PkiError, match="changed after"):
        replace(s, payload=s.payload.replace(b"1.5", b"2.5")).verify(ca_path=ca / "ca.crt", role="scientist")
    with pytest.raises(PkiError, match="changed after"):  # the purpose is signed too
        replace(s, purpose="model").verify(ca_path=ca / "ca.crt", role="scientist")
    with pytest.raises(PkiError, match="not signed"):
        replace(s, signature=b"").verify(ca_path=ca / "ca.crt", role="scientist")
    pki.init_ca(tmp_path / "other-ca")
    with pytest.raises(PkiError, match="not issued by the CA"):
        s.verify(ca_path=tmp_path / "other-ca" / "ca.crt", role="scientist")


def test_a_non_finite_payload_cannot_be_signed(ca: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        _signer(ca, tmp_path, "agent", "site-a").sign_json("round-statement", {"loss": float("nan")})
