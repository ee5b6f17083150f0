"""ONNX export of the image-text-classification family: a tiny ResNet + BiLSTM model exported once (fp32 and int8)
from the CLI with real stand-in images (PNG and DICOM), parity against PyTorch, the bundle's files, and the
served bundle's predictions against the PyTorch model's on the same files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.cli import main
from fedclinic.errors import ConfigError
from fedclinic.export.onnx_export import FP32_TOLERANCE, ParityError, check_parity, export_onnx
from fedclinic.models import build_model
from fedclinic.transport.package import ModelPackage

from tests.helpers.image_text_models import LABELS, trained_package
from tests.helpers.image_text_models import package as image_text_package


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(package folder, bundle folder, held-out manifest rows, manifest folder): exported once with --int8 and the
    held-out rows (8 PNG + 4 DICOM stand-in images with their reports) as parity inputs."""
    from fedclinic.assets.imaging_standin import write_standin

    root = tmp_path_factory.mktemp("image-text-export")
    trained_package(root / "train").save(root / "pkg")
    data = root / "heldout"
    png = write_standin(data, n=8, seed=11, manifest_format="jsonl", name="png")
    dcm = write_standin(data, n=4, seed=12, image_format="dicom", manifest_format="jsonl", name="dcm")
    rows = [json.loads(line) for m in (png, dcm) for line in m.read_text().splitlines()]
    heldout = data / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"text": r["text"], "image": r["image"]}) + "\n" for r in rows))
    assert main(["export", "onnx", str(root / "pkg"), str(root / "bundle"), "--int8", "--texts", str(heldout),
                 "--allow-unsigned"]) == 0
    return root / "pkg", root / "bundle", rows, data


def test_export_matches_pytorch_with_real_images_and_reports_int8(exported, capsys):
    _, bundle, rows, _ = exported
    report = json.loads((bundle / "export_report.json").read_text())
    assert report["family"] == "image-text-classification" and report["architecture"] == "resnet-bilstm"
    fp32, int8 = report["fp32"], report["int8"]
    assert fp32["inputs"] == len(rows) == 12  # the held-out rows, images included
    assert fp32["max_abs_diff"] <= FP32_TOLERANCE and fp32["tolerance"] == FP32_TOLERANCE
    assert fp32["label_agreement"] == 1.0 and fp32["top1_agreement"] == 1.0
    assert int8["label_agreement"] >= 0.95 and int8["max_abs_diff"] <= int8["tolerance"]
    assert {"model.onnx", "model.int8.onnx", "tokenizer.json", "fedclinic_model.json", "preprocessing.json",
            "model_card.json", "MODEL_CARD.md"} <= set(report["files"])


def test_graph_has_a_fixed_image_and_dynamic_batch_and_length(exported):
    import onnxruntime as ort
    import torch

    pkg, bundle, _, _ = exported
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert list(shapes) == ["image", "input_ids", "attention_mask"]
    assert shapes["image"][1:] == [1, 32, 32] and isinstance(shapes["image"][0], str)
    assert all(isinstance(d, str) for d in shapes["input_ids"]) and shapes["input_ids"] == shapes["attention_mask"]
    assert [o.name for o in session.get_outputs()] == ["logits"]
    # a batch size and length never seen at export time, ragged: equal to PyTorch's packed forward
    loaded = build_model(ModelPackage.load(pkg))
    rng = np.random.default_rng(5)
    image = rng.normal(size=(5, 1, 32, 32)).astype(np.float32)
    ids = rng.integers(1, 20, size=(5, 11)).astype(np.int64)
    mask = (np.arange(11)[None, :] < np.array([[11], [1], [4], [7], [2]])).astype(np.int64)
    ids[mask == 0] = loaded.pad_id
    got = session.run(["logits"], {"image": image, "input_ids": ids, "attention_mask": mask})[0]
    with torch.no_grad():
        want = loaded.logits(*(torch.from_numpy(x) for x in (image, ids, mask))).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)
    alone = session.run(["logits"], {"image": image[2:3], "input_ids": ids[2:3, :4], "attention_mask": mask[2:3, :4]})
    np.testing.assert_allclose(alone[0][0], got[2], atol=1e-5)  # padding changes nothing


@pytest.mark.parametrize("bidirectional, layers", [(True, 2), (False, 1)])
def test_the_exported_text_path_equals_the_packed_one(bidirectional, layers):
    """What the exporter traces (unpacked LSTM) against the packed LSTM used in training, with ragged lengths."""
    import torch

    from fedclinic.models.text_classification import lstm_final_states_unpacked

    module = build_model(image_text_package(seed=1, bidirectional=bidirectional, lstm_layers=layers)).module.eval()
    ids = torch.randint(1, 20, (4, 9), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(9)[None] < torch.tensor([9, 3, 1, 6])[:, None]).long()
    with torch.no_grad():
        packed = module.text_features(ids, mask)
        unpacked = lstm_final_states_unpacked(module.text_embedding(ids), mask, module.text_lstm, bidirectional)
    np.testing.assert_allclose(unpacked.numpy(), packed.numpy(), atol=1e-6)


def test_bundle_files_let_any_binding_make_the_inputs(exported):
    pkg, bundle, _, _ = exported
    spec = json.loads((bundle / "preprocessing.json").read_text())
    meta = json.loads((bundle / "fedclinic_model.json").read_text())
    assert spec["image"]["input"] == "image" and spec["image"]["shape"] == ["batch", 1, 32, 32]
    assert (spec["image"]["height"], spec["image"]["width"], spec["image"]["channels"]) == (32, 32, 1)
    assert (spec["image"]["mean"], spec["image"]["std"]) == (meta["arch_config"]["image_mean"],
                                                           meta["arch_config"]["image_std"])
    assert spec["text"]["tokenizer"] == "tokenizer.json" and spec["text"]["max_length"] == meta["max_length"]
    assert spec["text"]["pad_id"] == build_model(ModelPackage.load(pkg)).pad_id
    assert spec["output"]["threshold"] == 0.5 and meta["labels"] == LABELS
    card = json.loads((bundle / "model_card.json").read_text())
    assert card["family"] == "image-text-classification" and card["image"]["size"] == 32
    assert card["export"]["inputs"] == ["image", "input_ids", "attention_mask"]
    assert card["export"]["fp32"]["label_agreement"] == 1.0 and "label_agreement" in card["export"]["int8"]
    assert any("exactly 1 x 32 x 32" in note for note in card["notes"])
    markdown = (bundle / "MODEL_CARD.md").read_text()
    assert "per-label decision agreement" in markdown and "preprocessing.json" in markdown


def test_served_bundle_predicts_like_pytorch_from_file_bytes(exported):
    from fedclinic.serving.bundle import ClassifierBundle

    pkg, bundle, rows, data = exported
    loaded = build_model(ModelPackage.load(pkg))
    paths = [data / r["image"] for r in rows]
    texts = [r["text"] for r in rows]
    want = loaded.predict_proba(paths, texts)
    served = ClassifierBundle(bundle, threads=1)
    got = served.predict(texts, images=[p.read_bytes() for p in paths])  # PNG and DICOM bytes
    assert len(got) == len(rows)
    for row, p in zip(got, want):
        np.testing.assert_allclose([row["scores"][lab] for lab in LABELS], p, atol=1e-5)
        assert row["labels"] == [lab for lab, v in zip(LABELS, p) if v >= 0.5] and row["threshold"] == 0.5
    assert len({tuple(row["labels"]) for row in got}) > 1  # not one answer for everything
    assert served.predict(texts[:2], images=paths[:2]) == got[:2]  # paths decode like bytes
    strict = ClassifierBundle(bundle, threads=1, threshold=0.9)
    assert all(row["threshold"] == 0.9 and row["labels"] == [lab for lab in LABELS if row["scores"][lab] >= 0.9]
               for row in strict.predict(texts, images=paths))
    int8 = ClassifierBundle(bundle, int8=True, threads=1).predict(texts, images=paths)
    agree = np.mean([(a["scores"][lab] >= 0.5) == (b["scores"][lab] >= 0.5) for a, b in zip(int8, got)
                     for lab in LABELS])
    assert agree >= 0.95
    # the accuracy change of int8: per-label accuracy against the rows' true labels, fp32 bundle vs int8 bundle

    def label_accuracy(predictions) -> float:
        return float(np.mean([(lab in p["labels"]) == (lab in r["labels"]) for p, r in zip(predictions, rows)
                              for lab in LABELS]))

    print(f"per-label accuracy on {len(rows)} held-out rows: fp32 {label_accuracy(got):.3f}, "
          f"int8 {label_accuracy(int8):.3f}")
    assert label_accuracy(got) > 0.6 and abs(label_accuracy(int8) - label_accuracy(got)) <= 0.05


def test_held_out_rows_must_all_have_images_or_none(exported, tmp_path, capsys):
    pkg, _, _, data = exported
    mixed = data / "mixed.jsonl"
    mixed.write_text('{"text": "mr image", "image": "images/png-0000.png"}\n{"text": "ct slice"}\n')
    assert main(["export", "onnx", str(pkg), str(tmp_path / "out"), "--texts", str(mixed)]) == 2
    assert "some rows have an 'image' and some do not" in capsys.readouterr().err
    escape = data / "escape.jsonl"
    escape.write_text('{"text": "mr image", "image": "../pkg/model.safetensors"}\n')
    assert main(["export", "onnx", str(pkg), str(tmp_path / "out"), "--texts", str(escape)]) == 2
    assert "leaves the manifest's folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="2 parity images for 1 texts"):
        export_onnx(pkg, tmp_path / "out", texts=["mr image"], images=[data / "images/png-0000.png"] * 2)
    from tests.helpers.text_models import tiny_package

    tiny_package("logreg").save(tmp_path / "text-pkg")
    with pytest.raises(ConfigError, match="parity images are for image-text-classification models"):
        export_onnx(tmp_path / "text-pkg", tmp_path / "out", texts=["x"], images=[data / "images/png-0000.png"])
    assert not (tmp_path / "out").exists()


def test_multi_label_parity_checks_the_label_decisions():
    want = np.array([[1.0, -1.0, 0.2], [0.5, 0.5, -0.3]])
    flipped = want * np.array([1.0, 1.0, -1.0])  # the third label's decision flips in both rows; argmax does not
    run = lambda *xs: flipped  # noqa: E731
    with pytest.raises(ParityError, match=r"per-label decision agreement 66.7% < 95% over 6 label decisions"):
        check_parity(run, lambda *xs: want, [(np.zeros(1), np.zeros(1), np.zeros(1))], tolerance=1.0,
                     min_agreement=0.95, multi_label=True)
    result = check_parity(run, lambda *xs: want, [(np.zeros(1),)], tolerance=1.0, min_agreement=0.5,
                          multi_label=True)
    assert result.top1_agreement == 1.0 and result.label_agreement == pytest.approx(4 / 6)


# ---------------------------------------------------------------------------------------------- serving bad inputs
# The same bundle served in-process: ClassifierBundle, then the HTTP and gRPC servers of `fedclinic serve` on
# 127.0.0.1 (tests/integration/test_serve.py runs the `fedclinic serve` process itself).


@pytest.fixture(scope="module")
def served(exported):
    from fedclinic.serving.bundle import ClassifierBundle

    return ClassifierBundle(exported[1], threads=1)


def image_bytes(exported, index: int = 0) -> bytes:
    _, _, rows, data = exported
    return (data / rows[index]["image"]).read_bytes()


def pydicom_file(name: str) -> bytes:
    from pydicom.data import get_testdata_file

    path = get_testdata_file(name, download=False)  # bundled with the pydicom wheel; never downloaded
    assert path is not None, name
    with open(path, "rb") as fh:
        return fh.read()


def bad_images(exported) -> list[tuple[object, str]]:
    """(image, the error's message) for every kind of image the bundle cannot take."""
    png = image_bytes(exported)
    return [
        (b"", r"image 0 is empty \(0 bytes\)"),
        (b"%PDF-1.7 a report, not an image", r"image 0 is not a PNG, JPEG or DICOM file"),
        (png[:60], r"image 0 is corrupt or unreadable as PNG"),
        (pydicom_file("examples_ybr_color.dcm"), r"image 0: the DICOM file holds 30 frames; store one image"),
        (pydicom_file("examples_palette.dcm"), r"image 0: palette-colour DICOM images are not supported"),
        (pydicom_file("rtplan.dcm"), r"image 0: the DICOM file has no pixel data"),
    ]


def test_bundle_refuses_bad_inputs_with_what_to_send(exported, served):
    from fedclinic.errors import DatasetError

    png = image_bytes(exported)
    for image, message in bad_images(exported):
        with pytest.raises(DatasetError, match=message):
            served.predict(["mr image"], images=[image])
    with pytest.raises(DatasetError, match="image 1 is missing; send one PNG, JPEG or DICOM image per text"):
        served.predict(["mr image", "ct slice"], images=[png, None])
    with pytest.raises(DatasetError, match="2 images for 1 texts; send exactly one image per report"):
        served.predict(["mr image"], images=[png, png])
    with pytest.raises(DatasetError, match="text 1 is empty"):
        served.predict(["mr image", "  "], images=[png, png])
    with pytest.raises(ConfigError, match="needs one image per text"):
        served.predict(["mr image"])
    with pytest.raises(ConfigError, match="images must be a list"):
        served.predict(["mr image"], images=png)
    assert served.predict(["mr image"], images=[png])[0]["threshold"] == 0.5  # and it still answers


def test_an_incomplete_or_inconsistent_bundle_is_refused(exported, tmp_path):
    import shutil

    from fedclinic.serving.bundle import ClassifierBundle

    bundle = tmp_path / "bundle"
    shutil.copytree(exported[1], bundle)
    with pytest.raises(ConfigError, match=r"threshold must be a probability in \(0, 1\)"):
        ClassifierBundle(bundle, threshold=1.5)
    spec = json.loads((bundle / "preprocessing.json").read_text())
    spec["image"]["height"] = spec["image"]["width"] = 64
    (bundle / "preprocessing.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="the graph's image input is .* but preprocessing.json says 1 x 64 x 64"):
        ClassifierBundle(bundle)
    (bundle / "preprocessing.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a valid image preprocessing file"):
        ClassifierBundle(bundle)
    (bundle / "preprocessing.json").unlink()
    with pytest.raises(ConfigError, match="has no preprocessing.json, which an image-text-classification bundle needs"):
        ClassifierBundle(bundle)


@pytest.fixture
def http_server(served):
    from fedclinic.serving.http_server import InferenceServer

    server = InferenceServer(served, "127.0.0.1", 0)
    thread = server.start_in_thread()
    yield server.http_port
    server.stop()
    thread.join(timeout=30)


def post(port: int, body) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/predict", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_bad_requests_are_400_with_the_reason(exported, served, http_server):
    import base64

    png = image_bytes(exported)
    b64 = base64.b64encode(png).decode()
    status, out = post(http_server, {"images": [b64, "data:image/png;base64," + b64], "texts": ["mr image", "ct"]})
    assert status == 200 and out["predictions"] == served.predict(["mr image", "ct"], images=[png, png])
    cases = [
        ({"texts": ["mr image"]}, "no images: send one image per report in 'images'"),
        ({"images": [b64]}, "expected a non-empty list of reports in 'texts'"),
        ({"images": [b64], "texts": [""]}, "text 0 is empty"),
        ({"images": [b64, b64], "texts": ["mr image"]}, "2 images for 1 reports"),
        ({"images": b64, "texts": ["mr image"]}, "'images' must be a list of base64 strings"),
        ({"images": [None], "texts": ["mr image"]}, "image 0 is missing or not a string"),
        ({"images": ["not base64!"], "texts": ["mr image"]}, "image 0 is not valid base64"),
        ({"images": ["data:image/png," + b64], "texts": ["mr image"]}, "data URL without ';base64,'"),
        ({"images": [b64] * 17, "texts": ["mr image"] * 17}, "the limit is 16 per call"),
    ] + [({"images": [base64.b64encode(image).decode()], "texts": ["mr image"]}, message.replace("\\", ""))
         for image, message in bad_images(exported) if image]  # "" is a missing image (above) over JSON
    for body, message in cases:
        status, out = post(http_server, body)
        assert status == 400, (body if len(json.dumps(body)) < 200 else message, out)
        assert message in out["error"], out
    assert post(http_server, {"images": [b64], "texts": ["mr image"]})[0] == 200  # still serving


def test_grpc_takes_image_bytes_and_refuses_bad_ones(exported, served):
    import grpc

    from fedclinic.proto import inference_pb2, inference_pb2_grpc
    from fedclinic.serving.inference_grpc import make_grpc_server
    from fedclinic.serving.prediction_service import PredictionService
    from fedclinic.serving.work_pool import WorkPool

    png = image_bytes(exported, 8)  # a DICOM stand-in image
    server, port = make_grpc_server(PredictionService(served), WorkPool(1, 4), "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            description = stub.DescribeModel(inference_pb2.DescribeModelRequest(), timeout=30)
            assert (description.family, description.image_size, description.threshold) == \
                ("image-text-classification", 32, 0.5)
            got = stub.Predict(inference_pb2.PredictRequest(texts=["ct slice"], images=[png]), timeout=60)
            want = served.predict(["ct slice"], images=[png])[0]
            assert list(got.predictions[0].labels) == want["labels"] and got.predictions[0].threshold == 0.5
            assert dict(got.predictions[0].scores) == pytest.approx(want["scores"])
            for request, message in [
                (inference_pb2.PredictRequest(texts=["ct slice"]), "no images"),
                (inference_pb2.PredictRequest(images=[png]), "expected a non-empty list of reports"),
                (inference_pb2.PredictRequest(texts=["ct slice"], images=[b"\x89PNG\r\n\x1a\n broken"]),
                 "image 0 is corrupt or unreadable as PNG"),
                (inference_pb2.PredictRequest(texts=["ct slice"], images=[pydicom_file("examples_ybr_color.dcm")]),
                 "holds 30 frames"),
            ]:
                with pytest.raises(grpc.RpcError) as bad:
                    stub.Predict(request, timeout=60)
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in bad.value.details()
    finally:
        server.stop(grace=None)
