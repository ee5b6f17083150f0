"""Builders for the signed-task tests: another initial model of the same shapes, signers from this CA and others,
and the declines a task owner sees."""

from __future__ import annotations

from pathlib import Path

from fedclinic import pki
from fedclinic.pki.signed_statement import Signer

from tests.helpers.text_models import tiny_package


def altered_package():
    """The tiny logreg model with one weight changed: another initial model with the same tensors and shapes."""
    package = tiny_package()
    name = sorted(package.tensors)[0]
    package.tensors[name] = package.tensors[name] + 1
    return package


def issue_signer(ca_dir: Path, out_dir: Path, *, role: str, name: str) -> Signer:
    """A certificate of ``role``/``name`` from the CA at ``ca_dir`` (made there if absent), as a Signer."""
    if not (ca_dir / "ca.crt").exists():
        pki.init_ca(ca_dir)
    c = pki.issue(ca_dir, role=role, name=name, out_dir=out_dir, days=7)
    return Signer(key_path=c.key_path, cert_path=c.cert_path)


def declines(client, task_id: str) -> list[str]:
    """The refusals of the task's first round, as its owner sees them ("site: reason")."""
    rounds = client.status(task_id).rounds
    return list(rounds[0].declined) if rounds else []
