"""fedclinic.pki.credentials.WatchedCredentials: a renewed pair is taken once it checks out, never halfway."""

from __future__ import annotations

import shutil

import pytest

from fedclinic import pki
from fedclinic.pki.credentials import WatchedCredentials
from fedclinic.transport.rpc import TlsFiles


@pytest.fixture
def live(tmp_path):
    ca = tmp_path / "ca"
    pki.init_ca(ca)
    issued = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "live")
    return ca, issued


def test_unchanged_files_are_not_reloaded(live):
    _ca, issued = live
    watched = WatchedCredentials(TlsFiles(issued.cert_path, issued.key_path, issued.ca_path), role="agent")
    assert watched.current.identity.serial_hex == issued.serial_hex
    assert watched.poll() is False and watched.poll(force=True) is False and watched.generation == 0


def test_a_half_installed_pair_is_ignored_until_both_files_are_new(live, tmp_path):
    ca, issued = live
    watched = WatchedCredentials(TlsFiles(issued.cert_path, issued.key_path, issued.ca_path), role="agent")
    new = pki.issue(ca, role="agent", name="site-a", out_dir=tmp_path / "next")
    shutil.copyfile(new.key_path, tmp_path / "k.tmp")
    (tmp_path / "k.tmp").replace(issued.key_path)         # the key first, as install does ...
    assert watched.poll() is False
    assert watched.current.identity.serial_hex == issued.serial_hex and "does not belong to" in watched.last_error
    shutil.copyfile(new.cert_path, tmp_path / "c.tmp")
    (tmp_path / "c.tmp").replace(issued.cert_path)        # ... then the certificate
    assert watched.poll() is True
    assert watched.current.identity.serial_hex == new.serial_hex and watched.generation == 1
    assert watched.last_error is None and watched.current.key == new.key_path.read_bytes()


def test_a_certificate_for_another_role_or_garbage_keeps_the_current_pair(live, tmp_path):
    ca, issued = live
    watched = WatchedCredentials(TlsFiles(issued.cert_path, issued.key_path, issued.ca_path), role="agent")
    other = pki.issue(ca, role="scientist", name="site-a", out_dir=tmp_path / "sci")
    pki.install_credentials(other.cert_path, other.key_path, other.ca_path, to_cert=issued.cert_path,
                            to_key=issued.key_path)
    assert watched.poll() is False and "needs role 'agent'" in watched.last_error
    issued.cert_path.write_text("not a certificate")
    assert watched.poll() is False and "not a valid X.509 certificate" in watched.last_error
    assert watched.current.identity.serial_hex == issued.serial_hex and watched.generation == 0
