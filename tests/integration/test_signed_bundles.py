"""Signed model downloads and ONNX bundles (issue 17, item 4), over real processes.

A model a scientist downloads carries the aggregator's signature and the scientist's countersignature
(``SIGNATURES.json``); ``fedclinic export onnx`` checks them and signs the bundle (``BUNDLE_SIGNATURE.json``);
``fedclinic serve`` (a real process) checks that signature before it loads anything and refuses, with exit code 2
and the reason, a bundle with one byte edited (the file named), a file added, a signer from another CA, and an
unsigned bundle unless ``--allow-unsigned``. A malicious aggregator (tests/helpers/malicious_aggregator.py) that
sends a scientist a model it did not sign, or a signature it did not make, is refused by the SDK's download.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from fedclinic import pki
from fedclinic.cli import main
from fedclinic.client import state_name
from fedclinic.errors import IntegrityError
from fedclinic.pki.bundle_signature import BUNDLE_SIGNATURE_FILE, bundle_files, sign_bundle
from fedclinic.pki.signed_statement import SignedStatement, Signer
from fedclinic.proto import tensors_pb2

from tests.helpers.malicious_aggregator import CONTROL_FETCH, MaliciousAggregator, Tamper
from tests.helpers.serving import ServeProcesses, call
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


def _flip_byte(path, offset: int | None = None) -> None:
    """Change one byte of ``path`` (the middle one by default)."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _export(model, bundle, *args: str) -> int:
    return main(["export", "onnx", str(model), str(bundle), *args])


def test_a_downloaded_model_exported_and_served_keeps_its_signatures_and_any_change_is_refused(
        federation_factory, tmp_path, capsys):
    fed = federation_factory(2, samples=(24, 32))
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=1, min_sites=2), package=tiny_package("logreg"))
        final = client.wait(st.task_id, timeout=180, progress=False)
        assert state_name(final.state) == "completed", final.error
        model = client.download(st.task_id, tmp_path / "final-model")
    signatures = json.loads((model / "SIGNATURES.json").read_text())
    assert json.loads(signatures["aggregator"]["payload"]) == {
        "task_id": st.task_id, "round": 1, "model_hash": final.final_model_hash, "final": True}
    assert json.loads(signatures["download"]["payload"])["model_hash"] == final.final_model_hash

    sci = fed.creds("scientist")
    ca, signing = sci["ca"], ["--ca", sci["ca"], "--sign-cert", sci["cert"], "--sign-key", sci["key"]]
    bundle = tmp_path / "bundle"
    assert _export(model, bundle, *signing) == 0
    printed = capsys.readouterr().out
    assert f"model signatures verified: the final model of task {st.task_id}" in printed
    assert "signed by the aggregator 'aggregator' and downloaded by the scientist 'scientist'" in printed
    assert (bundle / BUNDLE_SIGNATURE_FILE).is_file()

    # export refuses a downloaded model with one tensor byte edited (the last byte of the weights' data), or one
    # without its signatures; --allow-unsigned exports it anyway, unsigned
    edited = tmp_path / "edited-model"
    shutil.copytree(model, edited)
    _flip_byte(edited / "model.safetensors", offset=(edited / "model.safetensors").stat().st_size - 1)
    assert _export(edited, tmp_path / "never", *signing) == 2
    err = capsys.readouterr().err
    assert "refused: the model was changed after it was signed: tensor" in err and "differs" in err
    (edited / "SIGNATURES.json").unlink()
    assert _export(edited, tmp_path / "never", *signing) == 2
    assert "has no SIGNATURES.json" in capsys.readouterr().err
    assert not (tmp_path / "never" / "model.onnx").exists()

    with ServeProcesses(tmp_path) as procs:
        proc, port = procs.start(bundle, trust=("--trust-ca", ca))
        status, out = call(port, "/v1/predict", {"texts": ["chest pain and palpitations"]})
        assert status == 200 and len(out["predictions"]) == 1
        proc.terminate()
        assert "verified: signed by the scientist 'scientist'" in proc.communicate(timeout=30)[0]

        def copy(name: str):
            dst = tmp_path / name
            shutil.copytree(bundle, dst)
            return dst

        # one byte edited, in the graph and in a JSON file: refused, the file named
        graph = copy("graph-edited")
        _flip_byte(graph / "model.onnx")
        rc, out = procs.refused(graph, "--trust-ca", ca)
        assert rc == 2 and "file model.onnx was altered after the bundle was signed" in out, out
        meta = copy("meta-edited")
        (meta / "fedclinic_model.json").write_bytes((meta / "fedclinic_model.json").read_bytes()
                                                    .replace(b"cardio", b"cardiO", 1))
        rc, out = procs.refused(meta, "--trust-ca", ca)
        assert rc == 2 and "file fedclinic_model.json was altered" in out, out
        rc, out = procs.refused(meta, "--trust-ca", ca, "--allow-unsigned")  # a failed signature is never allowed
        assert rc == 2 and "file fedclinic_model.json was altered" in out, out
        added = copy("file-added")
        (added / "extra.onnx").write_bytes(b"x")
        rc, out = procs.refused(added, "--trust-ca", ca)
        assert rc == 2 and "file extra.onnx is not covered by its signature" in out, out

        # re-signed by a scientist of another CA
        other = tmp_path / "other-ca"
        pki.init_ca(other)
        mallory = pki.issue(other, role="scientist", name="mallory", out_dir=tmp_path / "mallory")
        foreign = copy("foreign")
        sign_bundle(foreign, Signer(key_path=mallory.key_path, cert_path=mallory.cert_path),
                    files=bundle_files(foreign), source=None)
        rc, out = procs.refused(foreign, "--trust-ca", ca)
        assert rc == 2 and "signature does not verify against the CA" in out and "was not issued by the CA" in out, out

        # unsigned: refused, unless --allow-unsigned (then served with a warning); no CA at all: refused
        unsigned = copy("unsigned")
        (unsigned / BUNDLE_SIGNATURE_FILE).unlink()
        rc, out = procs.refused(unsigned, "--trust-ca", ca)
        assert rc == 2 and "is not signed" in out and "--allow-unsigned" in out, out
        rc, out = procs.refused(bundle)
        assert rc == 2 and "give --trust-ca" in out, out
        proc, port = procs.start(unsigned, trust=("--trust-ca", ca, "--allow-unsigned"))
        assert call(port, "/v1/predict", {"texts": ["migraine with aura"]})[0] == 200
        proc.terminate()
        assert "UNVERIFIED (--allow-unsigned): it is not signed" in proc.communicate(timeout=30)[0]


class _ModelStreams(Tamper):
    """Rewrites a scientist's model downloads (Control.FetchModel) as ``mode`` says: "record" keeps a copy of the
    stream; "drop" removes the aggregator's statement; "edit" changes its payload; "foreign" re-signs it with
    another CA's aggregator; "substitute" sends the recorded model under this download's statement; "replay"
    sends the whole recorded stream (another task's model and its genuine statement)."""

    def __init__(self, foreign: Signer) -> None:
        self.mode = "honest"
        self.recorded: list[tensors_pb2.ModelChunk] = []
        self.foreign = foreign
        self.lock = threading.Lock()

    def model_chunk(self, caller, method, chunk):
        if method != CONTROL_FETCH:
            return [chunk]
        kind = chunk.WhichOneof("item")
        with self.lock:
            mode = self.mode
            if mode == "record":
                self.recorded.append(tensors_pb2.ModelChunk.FromString(chunk.SerializeToString()))
        if mode == "drop" and kind == "statement":
            return []
        if mode == "edit" and kind == "statement":
            chunk.statement.payload = chunk.statement.payload.replace(b'"final":false', b'"final":true')
            return [chunk]
        if mode == "foreign" and kind == "statement":
            forged = self.foreign.sign(chunk.statement.purpose, bytes(chunk.statement.payload))
            return [tensors_pb2.ModelChunk(statement=forged.to_proto())]
        if mode == "substitute":
            if kind == "manifest":
                return [c for c in self.recorded if c.WhichOneof("item") == "manifest"]
            if kind == "statement":
                return [chunk] + [c for c in self.recorded if c.WhichOneof("item") in ("file", "tensor")]
            return []
        if mode == "replay":
            return list(self.recorded) if kind == "manifest" else []
        return [chunk]


def test_the_sdk_refuses_a_download_the_aggregator_did_not_sign(federation_factory, tmp_path):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    other = tmp_path / "other-ca"
    pki.init_ca(other)
    evil = pki.issue(other, role="aggregator", name="aggregator", out_dir=tmp_path / "evil")
    tamper = _ModelStreams(Signer(key_path=evil.key_path, cert_path=evil.cert_path))
    with MaliciousAggregator(fed, tamper), fed.client() as client:
        mine = client.submit(make_task(num_rounds=1, min_sites=1), package=tiny_package("logreg"))
        theirs = client.submit(make_task(num_rounds=1, min_sites=1, architecture="lstm"),
                               package=tiny_package("lstm", seed=1))
        assert theirs.initial_model_hash != mine.initial_model_hash
        tamper.mode = "record"
        client.download(theirs.task_id, tmp_path / "theirs", round=-1)
        assert [c.WhichOneof("item") for c in tamper.recorded[:2]] == ["manifest", "statement"]

        tamper.mode = "honest"
        honest = client.download(mine.task_id, tmp_path / "honest", round=-1)
        payload = json.loads(json.loads((honest / "SIGNATURES.json").read_text())["aggregator"]["payload"])
        assert payload == {"task_id": mine.task_id, "round": 0, "model_hash": mine.initial_model_hash, "final": False}

        refusals = {
            "drop": "the aggregator sent no signature over the model",
            "edit": "the signature does not match the data",
            "foreign": "was not issued by the CA",
            "substitute": "it is not the model the aggregator vouches for",
            "replay": f"the aggregator's signature is for task '{theirs.task_id}', not '{mine.task_id}'",
        }
        for mode, message in refusals.items():
            tamper.mode = mode
            out = tmp_path / f"download-{mode}"
            with pytest.raises(IntegrityError, match="download of task .* refused") as refused:
                client.download(mine.task_id, out, round=-1)
            assert message in str(refused.value), (mode, str(refused.value))
            assert not out.exists(), mode  # nothing is written from a refused download

        tamper.mode = "drop"  # an aggregator that signs nothing (older): accepted only when asked, and unsigned
        folder = client.download(mine.task_id, tmp_path / "unsigned", round=-1, allow_unsigned=True)
        assert (folder / "model.safetensors").is_file() and not (folder / "SIGNATURES.json").exists()


def test_a_bundle_signature_from_a_non_person_role_is_refused(tmp_path):
    """Only a scientist's (or admin's) certificate signs a bundle: one signed with a site's agent certificate of
    the right CA is refused by `fedclinic serve`."""
    from fedclinic.models.feature_classification import package_feature_model
    from fedclinic.export.onnx_export import export_onnx

    pki.init_ca(tmp_path / "ca")
    agent = pki.issue(tmp_path / "ca", role="agent", name="site-a", out_dir=tmp_path / "site-a")
    package_feature_model(num_features=3, labels=["low", "high"]).save(tmp_path / "pkg")
    export_onnx(tmp_path / "pkg", tmp_path / "bundle")
    sign_bundle(tmp_path / "bundle", Signer(key_path=agent.key_path, cert_path=agent.cert_path),
                files=bundle_files(tmp_path / "bundle"), source=None)
    rc, out = ServeProcesses.refused(tmp_path / "bundle", "--trust-ca", str(tmp_path / "ca" / "ca.crt"))
    assert rc == 2 and "signed by a certificate of role 'agent'" in out, out


def test_statement_json_round_trips_exactly():
    """The JSON form of a statement keeps the signed payload byte for byte (so a copy still verifies)."""
    from fedclinic.pki.model_signatures import statement_from_json, statement_to_json

    s = SignedStatement("model", '{"a":"é","b":1}'.encode(), b"\x00sig\xff", b"-----BEGIN CERTIFICATE-----\n")
    assert statement_from_json(json.loads(json.dumps(statement_to_json(s))), "x") == s
