"""Tests for fedclinic.pki: the CA folder, leaf certificates, CSRs, revocation, peer identity, the
credential preflight, the CLI, and a real mutual-TLS gRPC server."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import ipaddress
import json
import os
import re
import shutil
import stat
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from fedclinic import pki
from fedclinic.errors import FedclinicError
from fedclinic.pki import PeerIdentity, PkiError, RevocationList

UTC = dt.timezone.utc


def now() -> dt.datetime:
    return dt.datetime.now(UTC)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


def ext(cert: x509.Certificate, cls):
    return cert.extensions.get_extension_for_class(cls)


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    ca_dir = tmp_path / "ca"
    pki.init_ca(ca_dir)
    return ca_dir


@pytest.fixture
def other_ca(tmp_path: Path) -> Path:
    ca_dir = tmp_path / "other-ca"
    pki.init_ca(ca_dir, common_name="someone else's CA")
    return ca_dir


# ---------------------------------------------------------------------------------------------------------
# init_ca


def test_init_ca_writes_key_cert_crl_registry(ca: Path) -> None:
    assert sorted(p.name for p in ca.iterdir() if not p.name.startswith(".")) == [
        "ca.crt", "ca.key", "crl.pem", "issued.json"]
    assert mode(ca / "ca.key") == 0o600
    key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"

    cert = load_cert(ca / "ca.crt")
    assert cert.issuer == cert.subject
    cert.verify_directly_issued_by(cert)  # self-signed
    bc = ext(cert, x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = ext(cert, x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign and ku.value.digital_signature
    assert ext(cert, x509.SubjectKeyIdentifier).value == x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    assert cert.not_valid_after_utc - now() > dt.timedelta(days=3640)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "fedclinic CA"

    crl = x509.load_pem_x509_crl((ca / "crl.pem").read_bytes())
    assert crl.is_signature_valid(key.public_key())
    assert len(crl) == 0
    assert dt.timedelta(days=6, hours=23) < crl.next_update_utc - now() <= dt.timedelta(days=7)

    assert json.loads((ca / "issued.json").read_text())["certificates"] == []


def test_init_ca_refuses_to_overwrite(ca: Path) -> None:
    before = {p: (ca / p).read_bytes() for p in ("ca.key", "ca.crt", "crl.pem")}
    with pytest.raises(PkiError, match="already holds a CA.*refusing to overwrite"):
        pki.init_ca(ca)
    assert {p: (ca / p).read_bytes() for p in before} == before


def test_pki_error_is_a_fedclinic_error() -> None:
    assert issubclass(PkiError, FedclinicError)


# ---------------------------------------------------------------------------------------------------------
# key files


def test_keys_are_0600_from_creation_even_with_permissive_umask(ca: Path, tmp_path: Path, monkeypatch) -> None:
    # Keys must be created 0600, never chmod'ed afterwards: forbid chmod and open the umask wide.
    def no_chmod(*a, **k):
        raise AssertionError("chmod must not be used")

    monkeypatch.setattr(os, "chmod", no_chmod)
    monkeypatch.setattr(os, "fchmod", no_chmod)
    old = os.umask(0)
    try:
        pki.init_ca(tmp_path / "ca2")
        res = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "site-a")
        key_path, _ = pki.make_csr(role="agent", name="site-b", out_dir=tmp_path / "site-b")
    finally:
        os.umask(old)
    for p in (tmp_path / "ca2" / "ca.key", res.key_path, key_path):
        assert mode(p) == 0o600, p
    assert mode(res.cert_path) == 0o644
    # no temporary files left behind
    assert not [p for p in (tmp_path / "site-a").iterdir() if p.name.endswith(".tmp")]


def test_reissue_replaces_key_atomically_and_keeps_0600(ca: Path, tmp_path: Path) -> None:
    a = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "out")
    first = a.key_path.read_bytes()
    b = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "out")
    assert b.key_path.read_bytes() != first and mode(b.key_path) == 0o600
    assert a.serial_hex != b.serial_hex


# ---------------------------------------------------------------------------------------------------------
# leaf certificates


def test_agent_certificate_contents(ca: Path, tmp_path: Path) -> None:
    res = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "site-a")
    assert res.cert_path == tmp_path / "site-a" / "site-a.crt"
    assert res.key_path == tmp_path / "site-a" / "site-a.key"
    assert res.ca_path.read_bytes() == (ca / "ca.crt").read_bytes()
    cert, ca_cert = load_cert(res.cert_path), load_cert(ca / "ca.crt")

    cert.verify_directly_issued_by(ca_cert)
    assert isinstance(cert.signature_hash_algorithm, hashes.SHA256)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site-a"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "agent"
    san = ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["fedclinic://agent/site-a"]
    assert san.get_values_for_type(x509.DNSName) == [] and san.get_values_for_type(x509.IPAddress) == []
    bc = ext(cert, x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ku = ext(cert, x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert (ext(cert, x509.AuthorityKeyIdentifier).value.key_identifier
            == ext(ca_cert, x509.SubjectKeyIdentifier).value.digest)
    key = serialization.load_pem_private_key(res.key_path.read_bytes(), password=None)
    assert ext(cert, x509.SubjectKeyIdentifier).value == x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    assert format(cert.serial_number, "x") == res.serial_hex
    assert cert.fingerprint(hashes.SHA256()).hex() == res.fingerprint_sha256
    assert res.not_after == cert.not_valid_after_utc
    assert dt.timedelta(days=29, hours=23) < res.not_after - now() <= dt.timedelta(days=30)

    (rec,) = json.loads((ca / "issued.json").read_text())["certificates"]
    assert rec["serial"] == res.serial_hex and rec["name"] == "site-a" and rec["role"] == "agent"
    assert rec["fingerprint_sha256"] == res.fingerprint_sha256 and rec["revoked_at"] is None
    assert set(rec) >= {"serial", "name", "role", "not_before", "not_after", "fingerprint_sha256",
                        "revoked_at", "reason"}


def test_aggregator_gets_server_and_client_auth_and_default_sans(ca: Path, tmp_path: Path) -> None:
    cert = load_cert(pki.issue(ca, role="aggregator", name="agg", out_dir=tmp_path / "a").cert_path)
    eku = list(ext(cert, x509.ExtendedKeyUsage).value)
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku and ExtendedKeyUsageOID.CLIENT_AUTH in eku
    san = ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["fedclinic://aggregator/agg"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]


def test_explicit_sans_replace_the_aggregator_defaults(ca: Path, tmp_path: Path) -> None:
    res = pki.issue(ca, role="aggregator", name="agg", out_dir=tmp_path / "a",
                    dns=["agg.example.org", "agg"], ips=["10.0.0.5", "::1"])
    san = ext(load_cert(res.cert_path), x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["agg.example.org", "agg"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("::1")]


@pytest.mark.parametrize("role", ["agent", "scientist", "admin"])
def test_client_roles_get_client_auth_only(ca: Path, tmp_path: Path, role: str) -> None:
    cert = load_cert(pki.issue(ca, role=role, name="x1", out_dir=tmp_path / role).cert_path)
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert pki.identity_from_pem(cert.public_bytes(serialization.Encoding.PEM)).role == role


def test_unknown_role_and_bad_sans_are_refused(ca: Path, tmp_path: Path) -> None:
    with pytest.raises(PkiError, match="unknown role 'hospital'.*aggregator, agent, scientist, admin"):
        pki.issue(ca, role="hospital", name="a", out_dir=tmp_path / "o")
    with pytest.raises(PkiError, match="invalid IP address '300.1.1.1'"):
        pki.issue(ca, role="aggregator", name="a", out_dir=tmp_path / "o", ips=["300.1.1.1"])
    with pytest.raises(PkiError, match="invalid DNS name 'a b'"):
        pki.issue(ca, role="aggregator", name="a", out_dir=tmp_path / "o", dns=["a b"])
    with pytest.raises(PkiError, match="--days must be at least 1"):
        pki.issue(ca, role="agent", name="a", out_dir=tmp_path / "o", days=0)


def test_issue_refuses_the_ca_folder_as_out_dir_and_missing_ca(ca: Path, tmp_path: Path) -> None:
    with pytest.raises(PkiError, match="is the CA folder"):
        pki.issue(ca, role="agent", name="site-a", out_dir=ca)
    assert not (ca / "site-a.key").exists()
    with pytest.raises(PkiError, match="not a fedclinic CA folder.*fedclinic pki init-ca"):
        pki.issue(tmp_path / "nope", role="agent", name="a", out_dir=tmp_path / "o")


def test_certificate_never_outlives_its_ca(tmp_path: Path) -> None:
    pki.init_ca(tmp_path / "ca", days=10)
    with pytest.raises(PkiError, match="after the CA itself expires"):
        pki.issue(tmp_path / "ca", role="agent", name="a", out_dir=tmp_path / "o", days=30)


@pytest.mark.parametrize("name", ["a", "site-a", "Hospital_12", "h.1-2_x", "a" * 64, "0"])
def test_valid_names(name: str) -> None:
    assert pki.validate_name(name) == name


@pytest.mark.parametrize("name", ["", "a" * 65, "site a", "../etc", "a/b", "säo", "-flag", ".hidden", "ca", "CA",
                                  "x\n", "a:b"])
def test_invalid_names(ca: Path, tmp_path: Path, name: str) -> None:
    with pytest.raises(PkiError, match=r"name|reserved"):
        pki.validate_name(name)
    with pytest.raises(PkiError):
        pki.issue(ca, role="agent", name=name, out_dir=tmp_path / "o")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=70))
def test_name_validation_matches_the_documented_rule(name: str) -> None:
    ok = re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name) is not None and name.lower() != "ca"
    if ok:
        assert pki.validate_name(name) == name
    else:
        with pytest.raises(PkiError):
            pki.validate_name(name)


# ---------------------------------------------------------------------------------------------------------
# identity


def test_identity_from_pem_round_trip_and_cache(ca: Path, tmp_path: Path) -> None:
    res = pki.issue(ca, role="scientist", name="dr.who", out_dir=tmp_path / "s")
    pem = res.cert_path.read_bytes()
    ident = pki.identity_from_pem(pem)
    assert ident == PeerIdentity(name="dr.who", role="scientist", serial_hex=res.serial_hex,
                                 fingerprint_sha256=res.fingerprint_sha256, not_after=res.not_after)
    hits = pki.identity_from_pem.cache_info().hits
    assert pki.identity_from_pem(pem) is ident
    assert pki.identity_from_pem.cache_info().hits == hits + 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        ident.role = "admin"  # type: ignore[misc]


def _custom_cert(ca_dir: Path, subject: x509.Name, sans: list[x509.GeneralName] | None) -> bytes:
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    ca_cert = load_cert(ca_dir / "ca.crt")
    key = ec.generate_private_key(ec.SECP256R1())
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now() - dt.timedelta(minutes=1))
         .not_valid_after(now() + dt.timedelta(days=1)))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_identity_falls_back_to_ou_and_cn(ca: Path) -> None:
    pem = _custom_cert(ca, x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "admin"),
                                      x509.NameAttribute(NameOID.COMMON_NAME, "ops")]), [x509.DNSName("x.org")])
    ident = pki.identity_from_pem(pem)
    assert (ident.role, ident.name) == ("admin", "ops")


def test_identity_without_fedclinic_role_is_refused(ca: Path) -> None:
    pem = _custom_cert(ca, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "www.example.org")]),
                       [x509.DNSName("www.example.org")])
    with pytest.raises(PkiError, match="no fedclinic role.*fedclinic pki issue"):
        pki.identity_from_pem(pem)
    pem = _custom_cert(ca, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]),
                       [x509.UniformResourceIdentifier("fedclinic://root/x")])
    with pytest.raises(PkiError, match="no fedclinic role"):
        pki.identity_from_pem(pem)
    with pytest.raises(PkiError, match="not a valid PEM"):
        pki.identity_from_pem(b"garbage")


# ---------------------------------------------------------------------------------------------------------
# CSR flow


def test_csr_flow_key_never_leaves_the_site(ca: Path, tmp_path: Path) -> None:
    site = tmp_path / "site-b"
    key_path, csr_path = pki.make_csr(role="aggregator", name="agg-b", out_dir=site, dns=["agg-b.example.org"])
    assert (key_path, csr_path) == (site / "agg-b.key", site / "agg-b.csr")
    assert mode(key_path) == 0o600
    csr = x509.load_pem_x509_csr(csr_path.read_bytes())
    assert csr.is_signature_valid

    out = tmp_path / "issued"
    res = pki.issue(ca, role="aggregator", name="agg-b", out_dir=out, csr_path=csr_path)
    assert res.key_path is None
    assert sorted(p.name for p in out.iterdir()) == ["agg-b.crt", "ca.crt"]
    assert [p.name for p in ca.glob("*.key")] == ["ca.key"]  # nothing but the CA key in the CA folder
    cert = load_cert(res.cert_path)
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
        == key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    san = ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["agg-b.example.org"]  # taken from the CSR
    assert pki.identity_from_pem(res.cert_path.read_bytes()).name == "agg-b"
    # the site's own preflight passes with its key and the issued certificate
    ident = pki.check_own_certificate(res.cert_path, key_path, res.ca_path, expected_role="aggregator")
    assert ident.serial_hex == res.serial_hex


def test_csr_name_mismatch_and_tampering_are_refused(ca: Path, tmp_path: Path) -> None:
    _, csr_path = pki.make_csr(role="agent", name="site-c", out_dir=tmp_path / "site")
    with pytest.raises(PkiError, match="is for CN=site-c, not 'site-d'"):
        pki.issue(ca, role="agent", name="site-d", out_dir=tmp_path / "o", csr_path=csr_path)
    with pytest.raises(PkiError, match="asks for fedclinic://agent/site-c, but you are issuing fedclinic://admin/site-c"):
        pki.issue(ca, role="admin", name="site-c", out_dir=tmp_path / "o", csr_path=csr_path)

    # a CSR whose content was altered after signing: swap in another key's request body signature
    csr = x509.load_pem_x509_csr(csr_path.read_bytes())
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    idx = der.find(b"site-c")
    der[idx:idx + 6] = b"site-x"
    bad = tmp_path / "bad.csr"
    bad.write_bytes(bytes(der))
    with pytest.raises(PkiError, match="does not verify"):
        pki.issue(ca, role="agent", name="site-x", out_dir=tmp_path / "o", csr_path=bad)
    with pytest.raises(PkiError, match="does not exist.*fedclinic pki request"):
        pki.issue(ca, role="agent", name="site-x", out_dir=tmp_path / "o", csr_path=tmp_path / "missing.csr")
    assert json.loads((ca / "issued.json").read_text())["certificates"] == []


def test_make_csr_refuses_the_ca_folder(ca: Path) -> None:
    with pytest.raises(PkiError, match="is a CA folder"):
        pki.make_csr(role="agent", name="site-a", out_dir=ca)


# ---------------------------------------------------------------------------------------------------------
# revocation


def test_revoke_puts_serial_in_a_crl_signed_by_the_ca(ca: Path, tmp_path: Path) -> None:
    a = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "a")
    b = pki.issue(ca, role="agent", name="site-b", out_dir=tmp_path / "b")
    rl = RevocationList(ca / "crl.pem", ca / "ca.crt")
    assert rl.serials == frozenset() and not rl.is_revoked(a.serial_hex)

    assert pki.revoke(ca, serial_hex=a.serial_hex.upper(), reason="key-compromise") == a.serial_hex
    ca_cert = load_cert(ca / "ca.crt")
    crl = x509.load_pem_x509_crl((ca / "crl.pem").read_bytes())
    assert crl.is_signature_valid(ca_cert.public_key()) and crl.issuer == ca_cert.subject
    entry = crl.get_revoked_certificate_by_serial_number(int(a.serial_hex, 16))
    assert entry is not None
    assert entry.extensions.get_extension_for_class(x509.CRLReason).value.reason == x509.ReasonFlags.key_compromise
    assert crl.get_revoked_certificate_by_serial_number(int(b.serial_hex, 16)) is None

    assert rl.reload_if_changed() is True
    assert rl.is_revoked(a.serial_hex) and rl.is_revoked("0x" + a.serial_hex.upper())
    assert not rl.is_revoked(b.serial_hex)
    assert rl.reload_if_changed() is False  # unchanged file

    first = {r["serial"]: r for r in pki.list_certs(ca)}[a.serial_hex]
    assert pki.revoke(ca, serial_hex=a.serial_hex) == a.serial_hex  # idempotent
    again = {r["serial"]: r for r in pki.list_certs(ca)}[a.serial_hex]
    assert again["revoked_at"] == first["revoked_at"] and again["reason"] == "key-compromise"

    assert pki.revoke(ca, cert_path=b.cert_path) == b.serial_hex
    assert rl.reload_if_changed() is True
    assert rl.serials == {a.serial_hex, b.serial_hex}
    crl = x509.load_pem_x509_crl((ca / "crl.pem").read_bytes())
    assert len(crl) == 2 and crl.is_signature_valid(ca_cert.public_key())


def test_revoke_refuses_unknown_serials_foreign_certs_and_bad_reasons(ca: Path, other_ca: Path, tmp_path: Path) -> None:
    crl_before = (ca / "crl.pem").read_bytes()
    with pytest.raises(PkiError, match="no certificate with serial abc123.*fedclinic pki list"):
        pki.revoke(ca, serial_hex="ABC123")
    with pytest.raises(PkiError, match="not a certificate serial"):
        pki.revoke(ca, serial_hex="xyz")
    foreign = pki.issue(other_ca, role="agent", name="a", out_dir=tmp_path / "f")
    with pytest.raises(PkiError, match="was not issued by the CA"):
        pki.revoke(ca, cert_path=foreign.cert_path)
    mine = pki.issue(ca, role="agent", name="a", out_dir=tmp_path / "m")
    with pytest.raises(PkiError, match="unknown revocation reason 'because'.*key-compromise"):
        pki.revoke(ca, serial_hex=mine.serial_hex, reason="because")
    with pytest.raises(PkiError, match="exactly one of --serial and --cert"):
        pki.revoke(ca)
    assert (ca / "crl.pem").read_bytes() == crl_before


def test_crl_from_another_ca_is_refused_and_the_old_list_kept(ca: Path, other_ca: Path, tmp_path: Path) -> None:
    with pytest.raises(PkiError, match="not signed by the CA"):
        RevocationList(other_ca / "crl.pem", ca / "ca.crt")

    a = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "a")
    pki.revoke(ca, serial_hex=a.serial_hex)
    deployed = tmp_path / "deployed-crl.pem"
    shutil.copyfile(ca / "crl.pem", deployed)
    rl = RevocationList(deployed, ca / "ca.crt")
    assert rl.is_revoked(a.serial_hex) and rl.last_error is None

    # someone copies the wrong CA's CRL (which revokes nothing) over the deployed one
    x = pki.issue(other_ca, role="agent", name="x", out_dir=tmp_path / "x")
    pki.revoke(other_ca, serial_hex=x.serial_hex)
    tmp = tmp_path / "incoming.pem"
    shutil.copyfile(other_ca / "crl.pem", tmp)
    os.replace(tmp, deployed)
    assert rl.reload_if_changed() is False
    assert rl.serials == {a.serial_hex} and rl.is_revoked(a.serial_hex)
    assert rl.last_error and "not signed by the CA" in rl.last_error and "previous revocation list" in rl.last_error
    assert rl.reload_if_changed() is False  # reported once per change, not re-parsed on every call

    deployed.write_bytes(b"-----BEGIN X509 CRL-----\ngarbage\n-----END X509 CRL-----\n")
    assert rl.reload_if_changed() is False and rl.serials == {a.serial_hex}
    deployed.unlink()
    assert rl.reload_if_changed() is False and rl.serials == {a.serial_hex}
    assert "disappeared" in (rl.last_error or "")

    shutil.copyfile(ca / "crl.pem", deployed)  # a good one again
    assert rl.reload_if_changed() is True and rl.last_error is None and rl.serials == {a.serial_hex}
    assert not rl.stale and rl.next_update is not None


def test_missing_crl_says_how_to_create_one(ca: Path, tmp_path: Path) -> None:
    with pytest.raises(PkiError, match="does not exist.*fedclinic pki init-ca"):
        RevocationList(tmp_path / "nope.pem", ca / "ca.crt")


def test_reload_if_changed_is_thread_safe(ca: Path, tmp_path: Path) -> None:
    a = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "a")
    rl = RevocationList(ca / "crl.pem", ca / "ca.crt")
    pki.revoke(ca, serial_hex=a.serial_hex)
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def worker() -> None:
        barrier.wait()
        results.append(rl.reload_if_changed())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(results) == [False] * 7 + [True]
    assert rl.is_revoked(a.serial_hex)


def test_refresh_crl_keeps_revoked_serials(ca: Path, tmp_path: Path) -> None:
    a = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "a")
    pki.revoke(ca, serial_hex=a.serial_hex)
    pki.refresh_crl(ca, days=14)
    crl = x509.load_pem_x509_crl((ca / "crl.pem").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(int(a.serial_hex, 16)) is not None
    assert crl.next_update_utc - now() > dt.timedelta(days=13)


# ---------------------------------------------------------------------------------------------------------
# list_certs


def test_list_certs_statuses(ca: Path, tmp_path: Path) -> None:
    valid = pki.issue(ca, role="agent", name="valid", out_dir=tmp_path / "o")
    expired = pki.issue(ca, role="agent", name="expired", out_dir=tmp_path / "o", days=1,
                        not_before=now() - dt.timedelta(days=3))
    future = pki.issue(ca, role="agent", name="future", out_dir=tmp_path / "o", days=1,
                       not_before=now() + dt.timedelta(days=3))
    revoked = pki.issue(ca, role="agent", name="revoked", out_dir=tmp_path / "o")
    revoked_expired = pki.issue(ca, role="agent", name="rex", out_dir=tmp_path / "o", days=1,
                                not_before=now() - dt.timedelta(days=3))
    pki.revoke(ca, serial_hex=revoked.serial_hex)
    pki.revoke(ca, serial_hex=revoked_expired.serial_hex, reason="superseded")
    rows = pki.list_certs(ca)
    assert [r["name"] for r in rows] == ["valid", "expired", "future", "revoked", "rex"]
    status = {r["serial"]: r["status"] for r in rows}
    assert status == {valid.serial_hex: "valid", expired.serial_hex: "expired", future.serial_hex: "not-yet-valid",
                      revoked.serial_hex: "revoked", revoked_expired.serial_hex: "revoked"}
    assert pki.list_certs(ca, now=now() + dt.timedelta(days=3, hours=12))[2]["status"] == "valid"
    assert pki.list_certs(ca, now=now() + dt.timedelta(days=31))[0]["status"] == "expired"


# ---------------------------------------------------------------------------------------------------------
# check_own_certificate


@pytest.fixture
def site(ca: Path, tmp_path: Path) -> pki.IssuedCert:
    return pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "site-a")


def test_check_own_certificate_ok(site: pki.IssuedCert) -> None:
    ident = pki.check_own_certificate(site.cert_path, site.key_path, site.ca_path, expected_role="agent")
    assert (ident.role, ident.name, ident.serial_hex) == ("agent", "site-a", site.serial_hex)


def test_check_own_certificate_wrong_ca(site: pki.IssuedCert, other_ca: Path) -> None:
    with pytest.raises(PkiError, match="was not issued by the CA in .*other-ca/ca.crt.*fedclinic pki issue"):
        pki.check_own_certificate(site.cert_path, site.key_path, other_ca / "ca.crt")


def test_check_own_certificate_expired(ca: Path, tmp_path: Path) -> None:
    nb = now() - dt.timedelta(days=3)
    old = pki.issue(ca, role="agent", name="old", out_dir=tmp_path / "old", days=1, not_before=nb)
    end = (nb + dt.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    with pytest.raises(PkiError, match=rf"expired on {end}:\d\dZ.*fedclinic pki issue --role agent --name old"):
        pki.check_own_certificate(old.cert_path, old.key_path, old.ca_path)


def test_check_own_certificate_not_yet_valid(ca: Path, tmp_path: Path) -> None:
    fut = pki.issue(ca, role="agent", name="fut", out_dir=tmp_path / "fut", days=1,
                    not_before=now() + dt.timedelta(days=2))
    with pytest.raises(PkiError, match="not valid yet: valid from .* to .*check this machine's clock"):
        pki.check_own_certificate(fut.cert_path, fut.key_path, fut.ca_path)


def test_check_own_certificate_key_mismatch(ca: Path, site: pki.IssuedCert, tmp_path: Path) -> None:
    other = pki.issue(ca, role="agent", name="site-b", out_dir=tmp_path / "site-b")
    with pytest.raises(PkiError, match="does not belong to certificate"):
        pki.check_own_certificate(site.cert_path, other.key_path, site.ca_path)


def test_check_own_certificate_group_readable_key(site: pki.IssuedCert) -> None:
    os.chmod(site.key_path, 0o644)
    with pytest.raises(PkiError, match=r"mode 0644.*chmod 600"):
        pki.check_own_certificate(site.cert_path, site.key_path, site.ca_path)
    os.chmod(site.key_path, 0o640)
    with pytest.raises(PkiError, match="chmod 600"):
        pki.check_own_certificate(site.cert_path, site.key_path, site.ca_path)
    os.chmod(site.key_path, 0o400)
    pki.check_own_certificate(site.cert_path, site.key_path, site.ca_path)


def test_check_own_certificate_wrong_role(site: pki.IssuedCert) -> None:
    with pytest.raises(PkiError, match="is for role 'agent'.*needs role 'aggregator'.*--role aggregator"):
        pki.check_own_certificate(site.cert_path, site.key_path, site.ca_path, expected_role="aggregator")


def test_check_own_certificate_missing_or_garbage_files(site: pki.IssuedCert, tmp_path: Path) -> None:
    with pytest.raises(PkiError, match="does not exist.*fedclinic pki issue"):
        pki.check_own_certificate(tmp_path / "none.crt", site.key_path, site.ca_path)
    with pytest.raises(PkiError, match="private key .* does not exist"):
        pki.check_own_certificate(site.cert_path, tmp_path / "none.key", site.ca_path)
    junk = tmp_path / "junk.key"
    fd = os.open(junk, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not a key")
    os.close(fd)
    with pytest.raises(PkiError, match="is not a PEM private key"):
        pki.check_own_certificate(site.cert_path, junk, site.ca_path)


def test_check_own_certificate_accepts_an_rsa_ca(tmp_path: Path) -> None:
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rsa CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now() - dt.timedelta(days=1))
               .not_valid_after(now() + dt.timedelta(days=10))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "s")]))
            .issuer_name(name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now() - dt.timedelta(days=1)).not_valid_after(now() + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier("fedclinic://agent/s")]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (tmp_path / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "s.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(tmp_path / "s.key", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    os.close(fd)
    ident = pki.check_own_certificate(tmp_path / "s.crt", tmp_path / "s.key", tmp_path / "ca.crt")
    assert (ident.role, ident.name) == ("agent", "s")


# ---------------------------------------------------------------------------------------------------------
# CLI


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="fedclinic")
    sub = parser.add_subparsers(dest="command", required=True)
    pki.add_pki_commands(sub)
    args = parser.parse_args(list(argv))
    capsys.readouterr()
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_end_to_end(tmp_path: Path, capsys) -> None:
    ca = str(tmp_path / "ca")
    rc, out, err = cli(capsys, "pki", "init-ca", "--ca-dir", ca, "--name", "Test CA", "--days", "365")
    assert rc == 0 and "created CA 'Test CA'" in out and err == ""

    rc, out, err = cli(capsys, "pki", "init-ca", "--ca-dir", ca)
    assert rc == 2 and out == "" and err.startswith("error: ") and "refusing to overwrite" in err

    rc, out, _ = cli(capsys, "pki", "issue", "--ca-dir", ca, "--role", "aggregator", "--name", "agg",
                     "--out", str(tmp_path / "agg"), "--dns", "agg.example.org", "localhost", "--ip", "127.0.0.1")
    assert rc == 0 and "issued aggregator certificate 'agg'" in out and "agg.key" in out
    san = ext(load_cert(tmp_path / "agg" / "agg.crt"), x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["agg.example.org", "localhost"]

    rc, out, _ = cli(capsys, "pki", "request", "--role", "agent", "--name", "site-a", "--out", str(tmp_path / "site"))
    assert rc == 0 and "site-a.csr" in out and "fedclinic pki issue" in out
    rc, out, _ = cli(capsys, "pki", "issue", "--ca-dir", ca, "--role", "agent", "--name", "site-a",
                     "--out", str(tmp_path / "site"), "--csr", str(tmp_path / "site" / "site-a.csr"), "--days", "7")
    assert rc == 0 and "private key" not in out
    site_serial = pki.identity_from_pem((tmp_path / "site" / "site-a.crt").read_bytes()).serial_hex
    pki.check_own_certificate(tmp_path / "site" / "site-a.crt", tmp_path / "site" / "site-a.key",
                              tmp_path / "site" / "ca.crt", expected_role="agent")

    rc, out, _ = cli(capsys, "pki", "revoke", "--ca-dir", ca, "--serial", site_serial, "--reason", "superseded")
    assert rc == 0 and site_serial in out
    rc, out, _ = cli(capsys, "pki", "revoke", "--ca-dir", ca, "--cert", str(tmp_path / "agg" / "agg.crt"))
    assert rc == 0
    rc, out, err = cli(capsys, "pki", "revoke", "--ca-dir", ca, "--serial", "deadbeef")
    assert rc == 2 and "error: no certificate with serial deadbeef" in err

    rc, out, _ = cli(capsys, "pki", "list", "--ca-dir", ca)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "STATUS", "NOT", "AFTER", "SERIAL", "SHA256"]
    assert len(lines) == 3 and all("revoked" in line for line in lines[1:])
    status_col = lines[0].index("STATUS")
    assert all(line[status_col:].startswith("revoked") for line in lines[1:])  # aligned columns

    rc, out, err = cli(capsys, "pki", "issue", "--ca-dir", str(tmp_path / "nope"), "--role", "agent",
                       "--name", "x", "--out", str(tmp_path / "x"))
    assert rc == 2 and "fedclinic pki init-ca" in err
    rc, out, err = cli(capsys, "pki", "issue", "--ca-dir", ca, "--role", "agent", "--name", "bad name",
                       "--out", str(tmp_path / "x"))
    assert rc == 2 and "invalid certificate name 'bad name'" in err


def test_cli_list_empty_and_argparse_refusals(tmp_path: Path, capsys) -> None:
    pki.init_ca(tmp_path / "ca")
    rc, out, _ = cli(capsys, "pki", "list", "--ca-dir", str(tmp_path / "ca"))
    assert rc == 0 and "no certificates issued yet" in out
    with pytest.raises(SystemExit):
        cli(capsys, "pki", "issue", "--ca-dir", "x", "--role", "hospital", "--name", "a", "--out", "o")
    with pytest.raises(SystemExit):
        cli(capsys, "pki", "revoke", "--ca-dir", "x", "--serial", "1", "--cert", "c")
    with pytest.raises(SystemExit):
        cli(capsys, "pki")


# ---------------------------------------------------------------------------------------------------------
# a real mutual-TLS gRPC server

IDENTITY_METHOD = "/fedclinic.test.Identity/WhoAmI"


def _raw(b: bytes) -> bytes:
    return b


@pytest.fixture
def mtls_server(ca: Path, tmp_path: Path):
    srv = pki.issue(ca, role="aggregator", name="agg", out_dir=tmp_path / "agg")
    pki.check_own_certificate(srv.cert_path, srv.key_path, srv.ca_path, expected_role="aggregator")
    revocations = RevocationList(ca / "crl.pem", ca / "ca.crt")

    def who_am_i(request: bytes, context: grpc.ServicerContext) -> bytes:
        ident = pki.identity_from_pem(context.auth_context()["x509_pem_cert"][0])
        revocations.reload_if_changed()
        if revocations.is_revoked(ident.serial_hex):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"certificate {ident.serial_hex} has been revoked")
        return f"{ident.role}/{ident.name}".encode()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("fedclinic.test.Identity", {
        "WhoAmI": grpc.unary_unary_rpc_method_handler(who_am_i, request_deserializer=_raw, response_serializer=_raw),
    })])
    creds = grpc.ssl_server_credentials([(srv.key_path.read_bytes(), srv.cert_path.read_bytes())],
                                        root_certificates=srv.ca_path.read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    assert port > 0
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield f"127.0.0.1:{port}", srv.ca_path.read_bytes()
    finally:
        server.stop(None)


def _call(address: str, server_ca: bytes, client: pki.IssuedCert) -> tuple[bytes, int]:
    creds = grpc.ssl_channel_credentials(root_certificates=server_ca, private_key=client.key_path.read_bytes(),
                                         certificate_chain=client.cert_path.read_bytes())
    with grpc.secure_channel(address, creds) as channel:
        whoami = channel.unary_unary(IDENTITY_METHOD, request_serializer=_raw, response_deserializer=_raw)
        answer = whoami(b"", timeout=10)
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    return answer, status


def test_grpc_mutual_tls(mtls_server, ca: Path, other_ca: Path, tmp_path: Path) -> None:
    address, server_ca = mtls_server

    # (a) a certificate from our CA connects, and the server sees who it is
    good = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "good")
    answer, status = _call(address, server_ca, good)
    assert answer == b"agent/site-a"
    assert status == health_pb2.HealthCheckResponse.SERVING

    # (b) a certificate from another CA is refused in the TLS handshake
    foreign = pki.issue(other_ca, role="agent", name="site-a", out_dir=tmp_path / "foreign")
    with pytest.raises(grpc.RpcError) as exc:
        _call(address, server_ca, foreign)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE

    # (c) an expired certificate from our CA is refused too
    expired = pki.issue(ca, role="agent", name="old", out_dir=tmp_path / "old", days=1,
                        not_before=now() - dt.timedelta(days=3))
    with pytest.raises(grpc.RpcError) as exc:
        _call(address, server_ca, expired)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE

    # TLS has no CRL: a revoked certificate still connects, and the per-call check refuses it
    pki.revoke(ca, serial_hex=good.serial_hex, reason="key-compromise")
    with pytest.raises(grpc.RpcError) as exc:
        _call(address, server_ca, good)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert good.serial_hex in exc.value.details()


# ---------------------------------------------------------------------------------------------------------
# rotation: renew and install


def test_renew_in_place_keeps_identity_and_names_with_a_new_key(ca: Path, tmp_path: Path) -> None:
    old = pki.issue(ca, role="aggregator", name="agg", out_dir=tmp_path / "live", dns=["agg.example.org"],
                    ips=["10.0.0.5"])
    old_key = old.key_path.read_bytes()
    new = pki.renew(ca, cert_path=old.cert_path, days=10)
    assert (new.cert_path, new.key_path) == (old.cert_path, old.key_path)
    assert new.serial_hex != old.serial_hex and old.key_path.read_bytes() != old_key
    assert mode(old.key_path) == 0o600
    ident = pki.check_own_certificate(old.cert_path, old.key_path, ca / "ca.crt", expected_role="aggregator")
    assert (ident.name, ident.serial_hex) == ("agg", new.serial_hex)
    san = ext(load_cert(old.cert_path), x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["agg.example.org"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5")]
    assert sorted(p.name for p in (tmp_path / "live").iterdir()) == ["agg.crt", "agg.key", "ca.crt"]  # no staging left
    statuses = {r["serial"]: r["status"] for r in pki.list_certs(ca)}
    assert statuses == {old.serial_hex: "valid", new.serial_hex: "valid"}
    pki.renew(ca, cert_path=old.cert_path, revoke_old=True)
    assert {r["serial"]: r["status"] for r in pki.list_certs(ca)}[new.serial_hex] == "revoked"


def test_renew_refuses_a_certificate_of_another_ca(ca: Path, other_ca: Path, tmp_path: Path) -> None:
    foreign = pki.issue(other_ca, role="agent", name="site-x", out_dir=tmp_path / "x")
    before = foreign.cert_path.read_bytes()
    with pytest.raises(PkiError, match="was not issued by the CA in"):
        pki.renew(ca, cert_path=foreign.cert_path)
    assert foreign.cert_path.read_bytes() == before


def test_install_checks_the_new_pair_before_replacing_anything(ca: Path, site: pki.IssuedCert, tmp_path: Path) -> None:
    key_path, csr_path = pki.make_csr(role="agent", name="site-a", out_dir=tmp_path / "staging")
    new = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "signed", csr_path=csr_path)
    live_cert, live_key = site.cert_path.read_bytes(), site.key_path.read_bytes()
    with pytest.raises(PkiError, match="does not belong to certificate"):  # the old key with the new certificate
        pki.install_credentials(new.cert_path, site.key_path, site.ca_path, to_cert=site.cert_path,
                                to_key=tmp_path / "elsewhere.key")
    with pytest.raises(PkiError, match="needs role 'scientist'"):
        pki.install_credentials(new.cert_path, key_path, site.ca_path, to_cert=site.cert_path, to_key=site.key_path,
                                expected_role="scientist")
    assert (site.cert_path.read_bytes(), site.key_path.read_bytes()) == (live_cert, live_key)
    ident = pki.install_credentials(new.cert_path, key_path, site.ca_path, to_cert=site.cert_path,
                                    to_key=site.key_path, expected_role="agent")
    assert ident.serial_hex == new.serial_hex and site.key_path.read_bytes() == key_path.read_bytes()
    assert mode(site.key_path) == 0o600
    pki.check_own_certificate(site.cert_path, site.key_path, site.ca_path, expected_role="agent")


def test_cli_renew_and_install(ca: Path, site: pki.IssuedCert, tmp_path: Path, capsys) -> None:
    rc, out, err = cli(capsys, "pki", "renew", "--ca-dir", str(ca), "--cert", str(site.cert_path))
    assert rc == 0, err
    assert "renewed agent certificate 'site-a'" in out and "--reason superseded" in out
    assert pki.identity_from_pem(site.cert_path.read_bytes()).serial_hex != site.serial_hex
    rc, out, err = cli(capsys, "pki", "install", "--cert", str(site.cert_path), "--key", str(tmp_path / "missing.key"),
                       "--ca", str(site.ca_path), "--to-cert", str(tmp_path / "a.crt"), "--to-key", str(tmp_path / "a.key"))
    assert rc == 2 and "missing.key does not exist" in err


def test_check_own_certificate_can_skip_the_key_mode_for_reloads(site: pki.IssuedCert) -> None:
    os.chmod(site.key_path, 0o440)
    with pytest.raises(PkiError, match="chmod 600"):
        pki.check_own_certificate(site.cert_path, site.key_path, site.ca_path)
    pki.check_own_certificate(site.cert_path, site.key_path, site.ca_path, check_key_mode=False)


def test_cli_refresh_crl_keeps_the_revoked_serials(ca: Path, site: pki.IssuedCert, capsys) -> None:
    pki.revoke(ca, serial_hex=site.serial_hex)
    before = x509.load_pem_x509_crl((ca / "crl.pem").read_bytes())
    rc, out, err = cli(capsys, "pki", "refresh-crl", "--ca-dir", str(ca), "--days", "3")
    assert rc == 0, err
    after = x509.load_pem_x509_crl((ca / "crl.pem").read_bytes())
    assert [r.serial_number for r in after] == [r.serial_number for r in before]
    assert after.next_update_utc - after.last_update_utc <= dt.timedelta(days=3, minutes=5)
    assert RevocationList(ca / "crl.pem", ca / "ca.crt").is_revoked(site.serial_hex)
