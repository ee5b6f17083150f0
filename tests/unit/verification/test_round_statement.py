"""Round statements (fedclinic.verification.round_statement) and the recomputation of a round
(fedclinic.verification.recompute): what a site signs is what its header declares, nothing else verifies, and a
recomputed fedavg round matches the aggregator's own strategy and flags a changed model."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedclinic import pki
from fedclinic.pki import PkiError
from fedclinic.pki.signed_statement import SignedStatement, Signer
from fedclinic.proto import agent_pb2, control_pb2, task_pb2, tensors_pb2
from fedclinic.verification.recompute import decode_update, differences, plain_round, why_not_recomputed
from fedclinic.verification.round_statement import RoundStatement, check_against_header, sign_header


@pytest.fixture
def ca(tmp_path: Path) -> Path:
    pki.init_ca(tmp_path / "ca")
    return tmp_path / "ca"


def _signer(ca: Path, tmp_path: Path, name: str) -> Signer:
    c = pki.issue(ca, role="agent", name=name, out_dir=tmp_path / name)
    return Signer(key_path=c.key_path, cert_path=c.cert_path)


def _header(delta: np.ndarray, samples: int = 8) -> agent_pb2.UpdateHeader:
    h = agent_pb2.UpdateHeader(task_id="t-1", round=2, attempt=1, idempotency_key="k", base_model_hash="ab" * 32,
                               num_samples=samples)
    h.tensors.append(tensors_pb2.TensorHeader(name="w", dtype="float32", shape=list(delta.shape), codec="raw",
                                              sha256=hashlib.sha256(delta.tobytes()).hexdigest(),
                                              encoded_nbytes=delta.nbytes))
    return h


def test_a_statement_checks_against_its_header_and_signer_only(ca: Path, tmp_path: Path) -> None:
    h = _header(np.ones(3, np.float32))
    sign_header(h, "site-a", _signer(ca, tmp_path, "site-a"))
    st = check_against_header(SignedStatement.from_proto(h.statement), h, "site-a", ca / "ca.crt")
    assert (st.site, st.round, st.base_model, st.num_samples) == ("site-a", 2, "ab" * 32, 8)

    other = agent_pb2.UpdateHeader()
    other.CopyFrom(h)
    other.base_model_hash = "cd" * 32  # the aggregator relabels the model the site trained from
    with pytest.raises(PkiError, match=r"differs in base_model"):
        check_against_header(SignedStatement.from_proto(h.statement), other, "site-a", ca / "ca.crt")
    with pytest.raises(PkiError, match=r"differs in site"):  # site-a's statement presented for site-b
        check_against_header(SignedStatement.from_proto(h.statement), h, "site-b", ca / "ca.crt")

    posing = _header(np.ones(3, np.float32))  # site-b signs a statement that names site-a
    sign_header(posing, "site-a", _signer(ca, tmp_path, "site-b"))
    with pytest.raises(PkiError, match="signed by the agent 'site-b', not by 'site-a'"):
        check_against_header(SignedStatement.from_proto(posing.statement), posing, "site-a", ca / "ca.crt")

    signed = SignedStatement.from_proto(h.statement)
    forged = replace(signed, payload=signed.payload.replace(b'"num_samples":8', b'"num_samples":80'))
    with pytest.raises(PkiError):
        RoundStatement.read(forged).verify(ca / "ca.crt")
    with pytest.raises(PkiError, match="not a round statement"):
        RoundStatement.read(replace(signed, purpose="task"))


def _records(model_hash: str = "m") -> control_pb2.RoundRecords:
    return control_pb2.RoundRecords(round=1, model_hash=model_hash, updates_published=True)


def test_a_recomputed_fedavg_round_matches_and_a_changed_model_is_named(ca: Path, tmp_path: Path) -> None:
    spec = task_pb2.TaskSpec(strategy="fedavg")
    base = {"w": np.array([1.0, 2.0, 3.0], np.float32), "b": np.zeros(2, np.float32)}
    deltas = {"site-a": (np.array([0.5, 0.0, -1.0], np.float32), 10),
              "site-b": (np.array([-0.5, 1.0, 1.0], np.float32), 30)}
    blobs, updates = {}, []
    for site, (d, n) in deltas.items():
        h = _header(d, n)
        sign_header(h, site, _signer(ca, tmp_path, site))
        blobs[h.tensors[0].sha256] = d.tobytes()
        st = RoundStatement.read(SignedStatement.from_proto(h.statement))
        updates.append((st, decode_update(st, lambda sha, what: blobs[sha])))
    got = plain_round(spec, base, updates)
    want = base["w"] + (10 * deltas["site-a"][0] + 30 * deltas["site-b"][0]) / 40
    np.testing.assert_allclose(got["w"], want, rtol=1e-6)
    assert differences(got, {"w": want, "b": base["b"]}) == []
    assert differences(got, {"w": want + np.float32(0.01), "b": base["b"]}) == ["'w' (off by up to 0.01)"]
    assert differences(got, {"w": want, "b": base["b"] + 1}) == ["'b' (off by up to 1)"]

    assert why_not_recomputed(spec, _records()) == ""
    assert why_not_recomputed(task_pb2.TaskSpec(strategy="fedadam"), _records()).startswith(
        "not recomputed: strategy fedadam")
    assert "publish_updates = false" in why_not_recomputed(spec, control_pb2.RoundRecords(round=1, model_hash="m"))
