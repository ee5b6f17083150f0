"""`fedclinic serve` as real processes on 127.0.0.1, over HTTP and gRPC: classifiers, NER, question answering,
image + report classification."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from fedclinic.export.onnx_export import export_onnx
from fedclinic.models.feature_classification import package_feature_model

from tests.helpers.serving import ServeProcesses, call as _call
from tests.helpers.text_models import LABELS, tiny_package

pytestmark = pytest.mark.integration


@pytest.fixture
def serve(tmp_path):
    with ServeProcesses(tmp_path) as procs:
        yield procs.start


def test_text_bundle_over_http(tmp_path, serve):
    tiny_package("transformer", seed=2).save(tmp_path / "pkg")
    export_onnx(tmp_path / "pkg", tmp_path / "bundle")
    proc, port = serve(tmp_path / "bundle")
    assert _call(port, "/healthz") == (200, {"status": "ok"})
    status, ready = _call(port, "/readyz")
    assert status == 200 and ready["model"]["labels"] == LABELS
    assert ready["model"]["card"]["model_hash"] and ready["model"]["card"]["task_id"] is None  # a local package
    status, out = _call(port, "/v1/predict", {"texts": ["fever cough", "rash"]})
    assert status == 200 and len(out["predictions"]) == 2
    assert all(p["label"] in LABELS and abs(sum(p["scores"].values()) - 1) < 1e-5 for p in out["predictions"])
    # bad requests get a clear 4xx and the server keeps serving
    assert _call(port, "/v1/predict", raw=b"{not json")[0] == 400
    code, err = _call(port, "/v1/predict", {"text": "x"})
    assert code == 400 and "non-empty list in 'texts'" in err["error"]
    code, err = _call(port, "/v1/predict", {"texts": ["ok", ""]})
    assert code == 422 and "text 1 is empty" in err["error"]
    code, err = _call(port, "/v1/predict", {"texts": ["a"] * 300})
    assert code == 400 and "limit is 256" in err["error"]
    assert _call(port, "/nope")[0] == 404
    assert _call(port, "/v1/predict", {"texts": ["still up"]})[0] == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_feature_bundle_over_http(tmp_path, serve):
    package_feature_model(num_features=3, labels=["low", "high"]).save(tmp_path / "pkg")
    export_onnx(tmp_path / "pkg", tmp_path / "bundle")
    _, port = serve(tmp_path / "bundle")
    status, out = _call(port, "/v1/predict", {"features": [[0.1, 0.2, 0.3], [1, 2, 3]]})
    assert status == 200 and [p["scores"]["low"] for p in out["predictions"]] == [0.5, 0.5]  # zero-initialised
    code, err = _call(port, "/v1/predict", {"features": [[1, 2], [1]]})
    assert code == 400 and "equal-length" in err["error"]


def test_missing_bundle_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "fedclinic.cli", "serve", str(tmp_path), "--port", "0"],
                         capture_output=True, text=True, timeout=60, env={**os.environ})
    assert out.returncode == 2 and "has no model.onnx" in out.stderr


def test_grpc_inference_with_mutual_tls(tmp_path, serve):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fedclinic import pki
    from fedclinic.proto import inference_pb2, inference_pb2_grpc
    from fedclinic.transport.rpc import TlsFiles, secure_channel

    ca = tmp_path / "ca"
    pki.init_ca(ca)
    server = pki.issue(ca, role="aggregator", name="inference", out_dir=tmp_path / "srv", dns=["localhost"],
                       ips=["127.0.0.1"])
    client_cert = pki.issue(ca, role="scientist", name="integration", out_dir=tmp_path / "cli")
    tiny_package("logreg").save(tmp_path / "pkg")
    export_onnx(tmp_path / "pkg", tmp_path / "bundle")
    _, ports = serve(tmp_path / "bundle", "--grpc-port", "0", "--cert", str(server.cert_path), "--key",
                     str(server.key_path), "--ca", str(server.ca_path))
    address = f"127.0.0.1:{ports['grpc']}"
    tls = TlsFiles(client_cert.cert_path, client_cert.key_path, client_cert.ca_path)
    with secure_channel(address, tls) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="fedclinic.v1.Inference"),
                                                          timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = inference_pb2_grpc.InferenceStub(channel)
        assert list(stub.DescribeModel(inference_pb2.DescribeModelRequest(), timeout=30).labels) == LABELS
        out = stub.Predict(inference_pb2.PredictRequest(texts=["fever cough", "rash"]), timeout=30)
        assert len(out.predictions) == 2 and all(p.label in LABELS for p in out.predictions)
        with pytest.raises(grpc.RpcError) as bad:
            stub.Predict(inference_pb2.PredictRequest(), timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "send texts" in bad.value.details()
    # no client certificate: the handshake is refused
    creds = grpc.ssl_channel_credentials(root_certificates=server.ca_path.read_bytes())
    with grpc.secure_channel(address, creds) as anonymous:
        with pytest.raises(grpc.RpcError):
            inference_pb2_grpc.InferenceStub(anonymous).DescribeModel(inference_pb2.DescribeModelRequest(), timeout=10)


def test_partial_tls_flags_are_refused(tmp_path):
    package_feature_model(num_features=3, labels=["a", "b"]).save(tmp_path / "pkg")
    export_onnx(tmp_path / "pkg", tmp_path / "bundle")
    out = subprocess.run([sys.executable, "-m", "fedclinic.cli", "serve", str(tmp_path / "bundle"), "--grpc-port", "0",
                          "--cert", "x.crt"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "give all of --cert, --key and --ca" in out.stderr


def _trained_ner_bundle(tmp_path, architecture: str = "transformer-crf"):
    """A tiny NER model trained to recognise the test vocabulary's drugs and conditions, exported to ONNX."""
    from fedclinic.training import trainer as training
    from fedclinic.models import build_model, module_tensors
    from fedclinic.transport.package import ModelPackage

    from tests.helpers.ner_models import make_examples, package

    start = package(architecture)
    model = build_model(start)
    training.train_local(model, training.encode(make_examples(48, seed=1), model),
                         training.TrainConfig(local_epochs=10, batch_size=8, learning_rate=5e-3),
                         trainable=[n for n, _ in model.module.named_parameters()])
    ModelPackage(module_tensors(model.module), start.files).save(tmp_path / "ner-pkg")
    export_onnx(tmp_path / "ner-pkg", tmp_path / "ner-bundle")
    return tmp_path / "ner-bundle"


def test_ner_bundle_over_http_and_grpc(tmp_path, serve):
    from fedclinic import pki
    from fedclinic.proto import inference_pb2, inference_pb2_grpc
    from fedclinic.transport.rpc import TlsFiles, secure_channel

    bundle = _trained_ner_bundle(tmp_path)
    ca = tmp_path / "ca"
    pki.init_ca(ca)
    server = pki.issue(ca, role="aggregator", name="inference", out_dir=tmp_path / "srv", dns=["localhost"],
                       ips=["127.0.0.1"])
    client_cert = pki.issue(ca, role="scientist", name="integration", out_dir=tmp_path / "cli")
    proc, ports = serve(bundle, "--grpc-port", "0", "--cert", str(server.cert_path), "--key", str(server.key_path),
                        "--ca", str(server.ca_path))
    text = "patient took metformin for back pain"
    expected = [{"start": 13, "end": 22, "label": "DRUG", "text": "metformin"},
                {"start": 27, "end": 36, "label": "CONDITION", "text": "back pain"}]
    status, ready = _call(ports["http"], "/readyz")
    assert status == 200 and ready["model"]["family"] == "token-classification"
    status, out = _call(ports["http"], "/v1/predict", {"texts": [text, "the week"]})
    assert status == 200 and out["predictions"] == [{"entities": expected}, {"entities": []}]
    code, err = _call(ports["http"], "/v1/predict", {"texts": [""]})
    assert code == 422 and "text 0 is empty" in err["error"]
    tls = TlsFiles(client_cert.cert_path, client_cert.key_path, client_cert.ca_path)
    with secure_channel(f"127.0.0.1:{ports['grpc']}", tls) as channel:
        got = inference_pb2_grpc.InferenceStub(channel).Predict(inference_pb2.PredictRequest(texts=[text]), timeout=30)
    assert [(e.start, e.end, e.label, e.text) for e in got.predictions[0].entities] == \
        [(e["start"], e["end"], e["label"], e["text"]) for e in expected]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def _trained_qa_bundle(tmp_path):
    """A tiny GPT-2 trained to answer the toy questions (tests/helpers/qa_models.py), exported to ONNX with past
    key/values, and the PyTorch model it came from."""
    from fedclinic.models import build_model, module_tensors
    from fedclinic.models.causal_lm import stored_names
    from fedclinic.transport.package import ModelPackage

    from tests.helpers.qa_models import package, toy_examples, train

    start = package(seed=1)
    model = build_model(start)
    train(model, toy_examples())
    ModelPackage(module_tensors(model.module, stored_names(model.module)), start.files).save(tmp_path / "qa-pkg")
    export_onnx(tmp_path / "qa-pkg", tmp_path / "qa-bundle")
    return tmp_path / "qa-bundle", model


def test_question_answering_bundle_over_http_and_grpc(tmp_path, serve):
    import grpc

    from fedclinic.proto import inference_pb2, inference_pb2_grpc

    bundle, model = _trained_qa_bundle(tmp_path)
    proc, ports = serve(bundle, "--grpc-port", "0")
    questions = ["what treats headache", "what treats diabetes", "what is the drug for a patient with reflux"]
    contexts = ["", "patient needs drug", ""]
    want = model.generate(questions, contexts)  # PyTorch's greedy answers
    assert want[:2] == ["drug aspirin", "drug metformin"]
    status, ready = _call(ports["http"], "/readyz")
    assert status == 200 and ready["model"]["family"] == "question-answering" and ready["model"]["labels"] == []
    status, out = _call(ports["http"], "/v1/predict", {"texts": questions, "contexts": contexts})
    assert status == 200 and out["predictions"] == [{"answer": a} for a in want]
    status, out = _call(ports["http"], "/v1/predict", {"texts": questions[:1]})  # contexts are optional
    assert status == 200 and out["predictions"] == [{"answer": want[0]}]
    # bad requests: a clear 4xx, and the server keeps answering
    code, err = _call(ports["http"], "/v1/predict", {"texts": ["what treats headache", " "]})
    assert code == 422 and "question 1 is empty" in err["error"]
    code, err = _call(ports["http"], "/v1/predict", {"texts": ["what treats headache " * 10]})
    assert code == 422 and "question 0 is too long" in err["error"] and "shorten the question" in err["error"]
    code, err = _call(ports["http"], "/v1/predict", {"texts": questions, "contexts": [""]})
    assert code == 400 and "1 contexts for 3 questions" in err["error"]
    code, err = _call(ports["http"], "/v1/predict", {"texts": questions, "contexts": "x"})
    assert code == 400 and "'contexts' must be a list of strings" in err["error"]
    code, err = _call(ports["http"], "/v1/predict", {"texts": ["what treats headache"] * 33})
    assert code == 400 and "the limit is 32" in err["error"]
    with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        assert stub.DescribeModel(inference_pb2.DescribeModelRequest(), timeout=30).family == "question-answering"
        got = stub.Predict(inference_pb2.PredictRequest(texts=questions, contexts=contexts), timeout=60)
        assert [p.answer for p in got.predictions] == want
        with pytest.raises(grpc.RpcError) as bad:
            stub.Predict(inference_pb2.PredictRequest(texts=["what treats headache " * 10]), timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "too long" in bad.value.details()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_contexts_are_refused_by_a_classifier(tmp_path, serve):
    tiny_package("logreg").save(tmp_path / "pkg")
    export_onnx(tmp_path / "pkg", tmp_path / "bundle")
    _, port = serve(tmp_path / "bundle")
    code, err = _call(port, "/v1/predict", {"texts": ["fever"], "contexts": ["x"]})
    assert code == 400 and "'contexts' are for question-answering bundles" in err["error"]
    code, err = _call(port, "/v1/predict", {"texts": ["fever"], "images": ["aGk="]})
    assert code == 400 and "'images' are for image-text-classification bundles" in err["error"]


def _trained_image_text_bundle(tmp_path):
    """A tiny ResNet + BiLSTM model trained briefly on stand-in images (tests/helpers/image_text_models.py),
    exported to ONNX, and the PyTorch model it came from."""
    import torch

    from fedclinic.models import build_model
    from fedclinic.transport.package import ModelPackage

    from tests.helpers.image_text_models import trained_package

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: a second thread only adds contention
    try:
        trained_package(tmp_path / "it-train").save(tmp_path / "it-pkg")
        export_onnx(tmp_path / "it-pkg", tmp_path / "it-bundle")
    finally:
        torch.set_num_threads(before)
    return tmp_path / "it-bundle", build_model(ModelPackage.load(tmp_path / "it-pkg"))


def test_image_text_bundle_over_http_and_grpc(tmp_path, serve):
    import base64

    import grpc
    import numpy as np

    from fedclinic.assets.imaging_standin import write_standin
    from fedclinic.proto import inference_pb2, inference_pb2_grpc

    bundle, model = _trained_image_text_bundle(tmp_path)
    data = tmp_path / "studies"
    rows = [json.loads(line) for manifest in (write_standin(data, n=3, seed=21, manifest_format="jsonl", name="png"),
                                              write_standin(data, n=3, seed=22, image_format="dicom",
                                                            manifest_format="jsonl", name="dcm"))
            for line in manifest.read_text().splitlines()]
    paths = [data / r["image"] for r in rows]
    texts = [r["text"] for r in rows]
    want = model.predict_proba(paths, texts)  # PyTorch, from the same files
    proc, ports = serve(bundle, "--grpc-port", "0", "--threshold", "0.4")
    status, ready = _call(ports["http"], "/readyz")
    assert status == 200 and ready["model"]["family"] == "image-text-classification"
    assert ready["model"]["image"]["size"] == 32 and ready["model"]["threshold"] == 0.4
    images = [base64.b64encode(p.read_bytes()).decode() for p in paths]  # PNG and DICOM files
    status, out = _call(ports["http"], "/v1/predict", {"images": images, "texts": texts})
    assert status == 200 and len(out["predictions"]) == len(rows)
    labels = model.labels
    for p, w in zip(out["predictions"], want):
        np.testing.assert_allclose([p["scores"][lab] for lab in labels], w, atol=1e-5)
        assert p["labels"] == [lab for lab, v in zip(labels, w) if v >= 0.4] and p["threshold"] == 0.4
    # bad requests: a clear 400 naming the input, and the server keeps answering
    code, err = _call(ports["http"], "/v1/predict", {"texts": texts[:1]})
    assert code == 400 and "no images" in err["error"]
    code, err = _call(ports["http"], "/v1/predict", {"images": images[:1]})
    assert code == 400 and "non-empty list of reports in 'texts'" in err["error"]
    code, err = _call(ports["http"], "/v1/predict", {"images": [base64.b64encode(b"GIF89a...").decode()],
                                                     "texts": texts[:1]})
    assert code == 400 and "image 0 is not a PNG, JPEG or DICOM file" in err["error"]
    code, err = _call(ports["http"], "/v1/predict", {"images": images[:2], "texts": [texts[0], " "]})
    assert code == 400 and "text 1 is empty" in err["error"]
    with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        assert stub.DescribeModel(inference_pb2.DescribeModelRequest(), timeout=30).image_size == 32
        got = stub.Predict(inference_pb2.PredictRequest(texts=texts, images=[p.read_bytes() for p in paths]),
                           timeout=60)
        assert [list(p.labels) for p in got.predictions] == [p["labels"] for p in out["predictions"]]
        with pytest.raises(grpc.RpcError) as bad:
            stub.Predict(inference_pb2.PredictRequest(texts=texts[:1], images=[paths[0].read_bytes()[:50]]), timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "corrupt or unreadable" in bad.value.details()
        with pytest.raises(grpc.RpcError) as bad:
            stub.Predict(inference_pb2.PredictRequest(texts=texts[:1]), timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no images" in bad.value.details()
    assert _call(ports["http"], "/v1/predict", {"images": images[:1], "texts": texts[:1]})[0] == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
