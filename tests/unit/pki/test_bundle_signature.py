"""fedclinic.pki.bundle_signature and model_signatures without processes: the refusals `fedclinic serve` and
`fedclinic export` rely on, with certificates of a real fedclinic CA."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic import pki
from fedclinic.pki.bundle_signature import (
    BUNDLE_SIGNATURE_FILE,
    BundleSignatureError,
    UnsignedBundle,
    bundle_files,
    sign_bundle,
    verify_bundle,
)
from fedclinic.pki.common import PkiError
from fedclinic.pki.model_signatures import (
    ModelSignatures,
    aggregator_statement,
    check_aggregator_statement,
    countersign,
)
from fedclinic.pki.signed_statement import Signer
from fedclinic.transport.package import ModelPackage


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root / "ca")
    signers = {}
    for role, name in (("aggregator", "aggregator"), ("scientist", "alice")):
        issued = pki.issue(root / "ca", role=role, name=name, out_dir=root / name)
        signers[role] = Signer(key_path=issued.key_path, cert_path=issued.cert_path)
    return root / "ca" / "ca.crt", signers


def _signatures(signers, package: ModelPackage, task_id: str = "t-1") -> ModelSignatures:
    manifest = package.manifest()
    stmt = aggregator_statement(signers["aggregator"], task_id=task_id, round=2, model_hash=manifest.model_hash,
                                final=True)
    return countersign(signers["scientist"], stmt, task_id=task_id, manifest=manifest)


def test_signatures_survive_a_save_and_name_what_changed(ca, tmp_path):
    ca_path, signers = ca
    package = ModelPackage({"w": np.arange(4, dtype=np.float32)}, {"fedclinic_model.json": b"{}"})
    _signatures(signers, package).save(tmp_path)
    loaded = ModelSignatures.load(tmp_path)
    assert loaded.verify(ca_path=ca_path, manifest=package.manifest()).final
    edited = ModelPackage({"w": np.arange(4, dtype=np.float32) + 1}, {"fedclinic_model.json": b"{}", "x.txt": b""})
    with pytest.raises(PkiError, match="tensor 'w' differs, file 'x.txt' was added"):
        loaded.verify(ca_path=ca_path, manifest=edited.manifest())
    assert ModelSignatures.load(tmp_path / "nowhere") is None


def test_a_countersignature_over_another_aggregator_statement_is_refused(ca):
    ca_path, signers = ca
    package = ModelPackage({"w": np.zeros(2, dtype=np.float32)})
    one, other = _signatures(signers, package, "t-1"), _signatures(signers, package, "t-2")
    with pytest.raises(PkiError, match="covers another aggregator statement"):
        ModelSignatures(other.aggregator, one.download).verify(ca_path=ca_path)


def test_the_aggregator_statement_must_name_the_round_asked_for(ca):
    ca_path, signers = ca
    stmt = aggregator_statement(signers["aggregator"], task_id="t-1", round=0, model_hash="ab" * 32, final=False)
    check_aggregator_statement(stmt, ca_path=ca_path, task_id="t-1", round=-1, model_hash="ab" * 32)
    with pytest.raises(PkiError, match="initial model, not its latest"):
        check_aggregator_statement(stmt, ca_path=ca_path, task_id="t-1", round=0, model_hash="ab" * 32)
    with pytest.raises(PkiError, match="for round 0, not round 3"):
        check_aggregator_statement(stmt, ca_path=ca_path, task_id="t-1", round=3, model_hash="ab" * 32)
    # a scientist cannot stand in for the aggregator
    with pytest.raises(PkiError, match="the signer is the scientist 'alice'"):
        check_aggregator_statement(signers["scientist"].sign(stmt.purpose, stmt.payload), ca_path=ca_path,
                                   task_id="t-1", round=-1, model_hash="ab" * 32)


def test_bundle_refusals_name_the_file(ca, tmp_path):
    ca_path, signers = ca
    (tmp_path / "model.onnx").write_bytes(b"graph")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.json").write_bytes(b"{}")
    with pytest.raises(UnsignedBundle, match="is not signed"):
        verify_bundle(tmp_path, ca_path=ca_path)
    sign_bundle(tmp_path, signers["scientist"], files=bundle_files(tmp_path), source=None)
    assert verify_bundle(tmp_path, ca_path=ca_path).files == 2
    (tmp_path / "sub" / "a.json").unlink()
    with pytest.raises(BundleSignatureError, match="file sub/a.json, which its signature covers, is missing"):
        verify_bundle(tmp_path, ca_path=ca_path)
    (tmp_path / BUNDLE_SIGNATURE_FILE).write_text("{not json")
    with pytest.raises(BundleSignatureError, match="is not JSON"):
        verify_bundle(tmp_path, ca_path=ca_path)


def test_a_signed_path_outside_the_bundle_is_never_read(ca, tmp_path):
    """A signature listing '../secret' (signed by a trusted scientist, even) is refused as a missing file: the
    check reads only files found inside the bundle."""
    ca_path, signers = ca
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "model.onnx").write_bytes(b"graph")
    (tmp_path / "secret").write_bytes(b"s")
    stmt = signers["scientist"].sign_json("onnx-bundle", {"files": {"model.onnx": "0" * 64, "../secret": "1" * 64},
                                                          "source": None})
    from fedclinic.pki.model_signatures import statement_to_json

    (bundle / BUNDLE_SIGNATURE_FILE).write_text(json.dumps({"format": "fedclinic-bundle-signature-v1",
                                                            "statement": statement_to_json(stmt)}))
    with pytest.raises(BundleSignatureError, match=r"file \.\./secret, which its signature covers, is missing"):
        verify_bundle(bundle, ca_path=ca_path)
