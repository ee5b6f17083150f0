"""Revocation never goes backwards: an older, validly signed CRL is refused at reload and (with a high-water
mark) at start, and the CA always issues CRLs with increasing CRL numbers."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from fedclinic import pki
from fedclinic.pki import PkiError, RevocationList
from fedclinic.pki.revocation_list import CrlVersion

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    pki.init_ca(tmp_path / "ca")
    return tmp_path / "ca"


def number(path: Path) -> int:
    crl = x509.load_pem_x509_crl(path.read_bytes())
    return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number


def put(src: Path, dst: Path) -> None:
    """Replace ``dst`` by a copy of ``src`` the way an operator's copy would (new inode, new mtime)."""
    tmp = dst.with_suffix(".incoming")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def signed_crl(ca: Path, out: Path, *, crl_number: int | None, this_update: dt.datetime) -> Path:
    """A CRL validly signed by the CA with the given number (None: no CRLNumber extension) and thisUpdate."""
    key = serialization.load_pem_private_key((ca / "ca.key").read_bytes(), None)
    cert = x509.load_pem_x509_certificate((ca / "ca.crt").read_bytes())
    b = (x509.CertificateRevocationListBuilder().issuer_name(cert.subject).last_update(this_update)
         .next_update(this_update + dt.timedelta(days=7)))
    if crl_number is not None:
        b = b.add_extension(x509.CRLNumber(crl_number), critical=False)
    out.write_bytes(b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return out


@pytest.mark.parametrize("offered, in_use, older", [
    (CrlVersion(3, T0 + dt.timedelta(days=9)), CrlVersion(4, T0), True),    # the number decides, not the time
    (CrlVersion(5, T0 - dt.timedelta(days=9)), CrlVersion(4, T0), False),
    (CrlVersion(4, T0 - dt.timedelta(seconds=1)), CrlVersion(4, T0), True),  # same number: thisUpdate
    (CrlVersion(4, T0), CrlVersion(4, T0), False),                           # the same CRL again
    (CrlVersion(None, T0 - dt.timedelta(days=1)), CrlVersion(4, T0), True),  # no number: thisUpdate
    (CrlVersion(9, T0 - dt.timedelta(days=1)), CrlVersion(None, T0), True),
    (CrlVersion(None, T0 + dt.timedelta(days=1)), CrlVersion(None, T0), False),
])
def test_crl_version_order(offered: CrlVersion, in_use: CrlVersion, older: bool) -> None:
    assert offered.older_than(in_use) is older


def test_an_older_validly_signed_crl_is_refused_at_reload_and_the_newer_stays_in_force(ca: Path, tmp_path: Path) -> None:
    a = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "a")
    old = tmp_path / "old-crl.pem"
    shutil.copyfile(ca / "crl.pem", old)  # number 1, revokes nothing
    pki.revoke(ca, serial_hex=a.serial_hex)
    deployed = tmp_path / "deployed.pem"
    shutil.copyfile(ca / "crl.pem", deployed)
    rl = RevocationList(deployed, ca / "ca.crt")
    assert rl.is_revoked(a.serial_hex) and rl.version.number == 2

    put(old, deployed)
    assert rl.reload_if_changed() is False
    assert rl.is_revoked(a.serial_hex) and rl.version.number == 2
    assert rl.last_error is not None
    assert "older than the one in use (CRL number 1" in rl.last_error and "in use: CRL number 2" in rl.last_error
    assert "refresh-crl" in rl.last_error

    pki.refresh_crl(ca)  # a newer one is taken again
    put(ca / "crl.pem", deployed)
    assert rl.reload_if_changed() is True and rl.last_error is None and rl.version.number == 3
    assert rl.is_revoked(a.serial_hex)


def test_same_number_with_an_earlier_this_update_is_refused(ca: Path, tmp_path: Path) -> None:
    deployed = signed_crl(ca, tmp_path / "deployed.pem", crl_number=7, this_update=T0)
    rl = RevocationList(deployed, ca / "ca.crt")
    put(signed_crl(ca, tmp_path / "earlier.pem", crl_number=7, this_update=T0 - dt.timedelta(hours=1)), deployed)
    assert rl.reload_if_changed() is False and rl.version == CrlVersion(7, T0)
    put(signed_crl(ca, tmp_path / "same.pem", crl_number=7, this_update=T0), deployed)  # re-copying is fine
    assert rl.reload_if_changed() is True and rl.last_error is None


def test_the_high_water_mark_refuses_an_old_crl_across_a_restart(ca: Path, tmp_path: Path) -> None:
    a = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "a")
    old = tmp_path / "old-crl.pem"
    shutil.copyfile(ca / "crl.pem", old)
    deployed, mark = tmp_path / "deployed.pem", tmp_path / "state" / "crl-high-water.json"
    mark.parent.mkdir()
    shutil.copyfile(ca / "crl.pem", deployed)
    RevocationList(deployed, ca / "ca.crt", high_water=mark)
    assert json.loads(mark.read_text())["crl_number"] == 1

    pki.revoke(ca, serial_hex=a.serial_hex)
    rl = RevocationList(old, ca / "ca.crt", high_water=mark)  # equal to the mark: fine
    put(ca / "crl.pem", deployed)
    rl = RevocationList(deployed, ca / "ca.crt", high_water=mark)
    assert rl.is_revoked(a.serial_hex) and json.loads(mark.read_text())["crl_number"] == 2

    put(old, deployed)  # "restart" with the old CRL copied in
    with pytest.raises(PkiError, match=r"older than the one already used \(recorded in .*crl-high-water.json\) "
                                       r"\(CRL number 1.*CRL number 2.*refresh-crl"):
        RevocationList(deployed, ca / "ca.crt", high_water=mark)

    # a reload raises the mark too
    put(ca / "crl.pem", deployed)
    rl = RevocationList(deployed, ca / "ca.crt", high_water=mark)
    pki.refresh_crl(ca)
    put(ca / "crl.pem", deployed)
    assert rl.reload_if_changed() is True and json.loads(mark.read_text())["crl_number"] == 3


def test_a_mark_of_another_ca_or_an_unreadable_mark_does_not_block(ca: Path, tmp_path: Path) -> None:
    mark = tmp_path / "crl-high-water.json"
    mark.write_text(json.dumps({"ca_key_sha256": "00" * 32, "crl_number": 99, "this_update": T0.isoformat()}))
    RevocationList(ca / "crl.pem", ca / "ca.crt", high_water=mark)
    assert json.loads(mark.read_text())["crl_number"] == 1  # replaced by this CA's
    mark.write_text("{not json")
    RevocationList(ca / "crl.pem", ca / "ca.crt", high_water=mark)  # logged, not fatal
    assert json.loads(mark.read_text())["crl_number"] == 1


def test_revoke_and_refresh_always_increase_the_crl_number(ca: Path, tmp_path: Path) -> None:
    a = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "a")
    seen = [number(ca / "crl.pem")]
    pki.revoke(ca, serial_hex=a.serial_hex)
    seen.append(number(ca / "crl.pem"))
    pki.revoke(ca, serial_hex=a.serial_hex)  # again: still a new CRL
    seen.append(number(ca / "crl.pem"))
    pki.refresh_crl(ca)
    seen.append(number(ca / "crl.pem"))
    assert seen == sorted(set(seen)) and len(seen) == 4

    # the registry restored from an old backup (crl_number 0): the next CRL still goes above the current one
    registry = json.loads((ca / "issued.json").read_text())
    registry["crl_number"] = 0
    (ca / "issued.json").write_text(json.dumps(registry))
    pki.refresh_crl(ca)
    assert number(ca / "crl.pem") == seen[-1] + 1
