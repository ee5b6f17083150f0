"""fedclinic.data.image: image + text manifests (CSV/JSONL; PNG, JPEG, DICOM) read exactly as documented, and
every bad input is refused with an error naming the manifest, the row and the image file."""

from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image
from pydicom.data import get_testdata_file

from fedclinic.data.text import read_dataset
from fedclinic.data.image import (ImageTextExample, decode_image, load_image, preprocess, read_image_text,
                                  sniff_image_kind, voi_window)
from fedclinic.errors import ConfigError, DatasetError

LABELS = ["normal", "cardiomegaly", "effusion"]


def dicom_file(name: str) -> str:
    path = get_testdata_file(name, download=False)  # bundled with the pydicom wheel; never downloaded
    assert path is not None, name
    return path


def write_png(path, array) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, format="PNG")


def gray(path, value=128, size=(12, 10)) -> None:
    write_png(path, np.full(size, value, dtype=np.uint8))


def csv_manifest(folder, rows, name="manifest.csv", header="image,text,labels") -> os.PathLike:
    p = folder / name
    p.write_text(header + "\n" + "".join(r + "\n" for r in rows), encoding="utf-8")
    return p


def jsonl_manifest(folder, rows, name="manifest.jsonl"):
    p = folder / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return p


def read(path, **kw):
    kw.setdefault("label_set", LABELS)
    return read_image_text(path, **kw)


# ------------------------------------------------------------------------------------------------ happy paths


def test_csv_and_jsonl_manifests_with_png_jpeg_and_dicom(tmp_path):
    gray(tmp_path / "img" / "a.png")
    Image.fromarray(np.full((9, 9, 3), 200, np.uint8)).save(tmp_path / "img" / "b.jpg", format="JPEG")
    shutil.copy(dicom_file("CT_small.dcm"), tmp_path / "img" / "c")  # DICOM recognised by content, not by name
    m = csv_manifest(tmp_path, ["img/a.png,no acute disease,normal",
                                "img/b.jpg,enlarged heart and fluid,effusion|cardiomegaly",
                                'img/c,"heart, enlarged",cardiomegaly'])
    rows = read(m)
    assert [r.labels for r in rows] == [("normal",), ("cardiomegaly", "effusion"), ("cardiomegaly",)]  # task order
    assert rows[2].text == "heart, enlarged" and rows[2].image == (tmp_path / "img" / "c").resolve()
    assert rows[1].source == f"{m}: row 3"
    j = jsonl_manifest(tmp_path, [{"image": "img/a.png", "text": "clear", "labels": ["normal"]}, "",
                                  {"image": "img/c", "text": "big heart", "labels": "cardiomegaly"}])
    assert [(r.image.name, r.text, r.labels) for r in read(j)] == [("a.png", "clear", ("normal",)),
                                                                  ("c", "big heart", ("cardiomegaly",))]


def test_field_names_and_the_label_fallback(tmp_path):
    gray(tmp_path / "x.png")
    m = csv_manifest(tmp_path, ["x.png,report,normal"], header="file,report,labels")
    # the agent's default label_field is "label": a manifest with a "labels" column is read through it
    rows = read_dataset("image-text-classification", m, image_field="file", text_field="report", label_field="label",
                        label_set=LABELS)
    assert rows == [ImageTextExample(image=(tmp_path / "x.png").resolve(), text="report", labels=("normal",),
                                     source=f"{m}: row 2")]
    j = jsonl_manifest(tmp_path, [{"image": "x.png", "text": "t", "label": "effusion"}])
    assert read(j, label_field="label")[0].labels == ("effusion",)


def test_eight_bit_sixteen_bit_and_rgb_pngs_become_documented_grayscale(tmp_path):
    ramp8 = np.arange(256, dtype=np.uint8).reshape(16, 16)
    write_png(tmp_path / "g8.png", ramp8)
    np.testing.assert_allclose(decode_image(tmp_path / "g8.png"), ramp8 / 255.0, atol=1e-7)
    ramp16 = (np.arange(64, dtype=np.uint32).reshape(8, 8) * 1000 + 535).astype(np.uint16)
    write_png(tmp_path / "g16.png", ramp16)
    np.testing.assert_allclose(decode_image(tmp_path / "g16.png"), ramp16 / 65535.0, atol=1e-7)
    rgb = np.zeros((4, 3, 3), dtype=np.uint8)
    rgb[0, :, 0], rgb[1, :, 1], rgb[2, :, 2], rgb[3] = 255, 255, 255, (10, 100, 200)
    write_png(tmp_path / "rgb.png", rgb)
    f = rgb.astype(float)
    luma = (299 * f[..., 0] + 587 * f[..., 1] + 114 * f[..., 2]) / 1000 / 255
    np.testing.assert_allclose(decode_image(tmp_path / "rgb.png"), luma, atol=1 / 255)  # Pillow rounds to uint8
    rgba = np.dstack([rgb, np.zeros((4, 3), np.uint8)])  # alpha is ignored, not composited
    write_png(tmp_path / "rgba.png", rgba)
    np.testing.assert_allclose(decode_image(tmp_path / "rgba.png"), decode_image(tmp_path / "rgb.png"))


def test_dicom_ct_without_window_is_min_max_scaled_modality_values():
    import pydicom

    ds = pydicom.dcmread(dicom_file("CT_small.dcm"))
    hu = ds.pixel_array.astype(np.float64) * float(ds.RescaleSlope) + float(ds.RescaleIntercept)
    assert "WindowCenter" not in ds
    np.testing.assert_allclose(decode_image(dicom_file("CT_small.dcm")), (hu - hu.min()) / (hu.max() - hu.min()),
                               atol=1e-6)


def test_dicom_mr_window_and_monochrome1_inversion(tmp_path):
    import pydicom

    ds = pydicom.dcmread(dicom_file("MR_small.dcm"))
    c, w = float(ds.WindowCenter), float(ds.WindowWidth)
    x = ds.pixel_array.astype(np.float64)  # no rescale in this file: modality values are the stored values
    expected = np.clip((x - (c - 0.5)) / (w - 1) + 0.5, 0, 1)
    np.testing.assert_allclose(decode_image(dicom_file("MR_small.dcm")), expected, atol=1e-6)
    inverted = copy.deepcopy(ds)
    inverted.PhotometricInterpretation = "MONOCHROME1"
    inverted.save_as(tmp_path / "mono1.dcm")
    np.testing.assert_allclose(decode_image(tmp_path / "mono1.dcm"), 1 - expected, atol=1e-6)


def test_voi_window_functions_follow_the_dicom_standard():
    c, w = 40.0, 400.0
    lo, hi = c - 0.5 - (w - 1) / 2, c - 0.5 + (w - 1) / 2  # PS3.3 C.11.2.1.2.1: the linear window's ends
    np.testing.assert_allclose(voi_window(np.array([lo - 5, lo, hi, hi + 5]), c, w), [0, 0, 1, 1], atol=1e-12)
    assert voi_window(np.array([c - 0.5]), c, w)[0] == pytest.approx(0.5)
    np.testing.assert_allclose(voi_window(np.array([c - w / 2, c, c + w / 2]), c, w, "LINEAR_EXACT"), [0, 0.5, 1])
    assert voi_window(np.array([c]), c, w, "SIGMOID")[0] == pytest.approx(0.5)
    assert voi_window(np.array([c + w]), c, w, "SIGMOID")[0] == pytest.approx(1 / (1 + np.exp(-4)))
    with pytest.raises(DatasetError, match="unknown VOI LUT Function 'CUBIC'"):
        voi_window(np.zeros(2), c, w, "CUBIC")


def test_rgb_dicom_uses_the_luma_weights():
    import pydicom

    ds = pydicom.dcmread(dicom_file("examples_rgb_color.dcm"))
    rgb = ds.pixel_array.astype(np.float64) / 255
    expected = 0.299 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2]
    np.testing.assert_allclose(decode_image(dicom_file("examples_rgb_color.dcm")), expected, atol=1e-6)


def test_preprocess_resizes_and_normalises_exactly():
    flat = np.full((30, 17), 0.75, dtype=np.float32)
    out = preprocess(flat, size=8)
    assert out.shape == (1, 8, 8) and out.dtype == np.float32
    np.testing.assert_allclose(out, (0.75 - 0.5) / 0.5, atol=1e-6)  # a constant image stays constant
    img = np.random.default_rng(0).random((20, 20)).astype(np.float32)
    np.testing.assert_array_equal(preprocess(img, size=20, mean=0.0, std=1.0)[0], img)  # same size: no resampling
    small = preprocess(img, size=5, mean=0.25, std=2.0)[0] * 2.0 + 0.25
    reference = np.asarray(Image.fromarray(img).resize((5, 5), Image.Resampling.BILINEAR))
    np.testing.assert_allclose(small, reference, atol=1e-6)
    assert img.min() <= small.min() and small.max() <= img.max()  # non-negative filter weights: no overshoot
    with pytest.raises(ConfigError, match="std > 0"):
        preprocess(img, size=5, std=0.0)


def test_load_image_of_a_real_dicom(tmp_path):
    out = load_image(dicom_file("MR_small.dcm"), size=32)
    assert out.shape == (1, 32, 32) and -1.0 <= out.min() and out.max() <= 1.0


def test_sniffing():
    assert sniff_image_kind(b"\x89PNG\r\n\x1a\n....") == "png"
    assert sniff_image_kind(b"\xff\xd8\xff\xe0") == "jpeg"
    assert sniff_image_kind(b"\0" * 128 + b"DICM") == "dicom"
    assert sniff_image_kind(b"hello") is None


# ------------------------------------------------------------------------------------------------ bad inputs


@pytest.fixture
def site(tmp_path):
    folder = tmp_path / "site"
    gray(folder / "ok.png")
    return folder


def check(path, pattern, **kw):
    with pytest.raises(DatasetError, match=pattern):
        read(path, **kw)


def test_missing_image_file_names_row_and_file(site):
    m = csv_manifest(site, ["ok.png,fine,normal", "gone.png,report,normal"])
    check(m, rf"manifest.csv: row 3: image file {site / 'gone.png'} not found")


def test_corrupt_png_is_refused(site):
    data = (site / "ok.png").read_bytes()
    (site / "cut.png").write_bytes(data[: len(data) // 2])
    (site / "junk.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 20)
    check(csv_manifest(site, ["cut.png,report,normal"]), r"row 2: image file .*cut.png is corrupt or unreadable as PNG")
    check(csv_manifest(site, ["junk.png,report,normal"]), r"row 2: image file .*junk.png is corrupt or unreadable as PNG")


def test_corrupt_jpeg_and_truncated_dicom_are_refused(site):
    Image.fromarray(np.full((32, 32), 90, np.uint8)).save(site / "a.jpg", format="JPEG")
    data = (site / "a.jpg").read_bytes()
    (site / "a.jpg").write_bytes(data[:40])
    check(csv_manifest(site, ["a.jpg,report,normal"]), r"row 2: image file .*a.jpg is corrupt or unreadable as JPEG")
    shutil.copy(dicom_file("MR_truncated.dcm"), site / "t.dcm")  # a real truncated DICOM from pydicom's test files
    check(jsonl_manifest(site, [{"image": "t.dcm", "text": "x", "labels": ["normal"]}]),
          r"manifest.jsonl: row 1: image file .*t.dcm is corrupt or unreadable as DICOM \(ValueError: The number of "
          r"bytes of pixel data is less than expected")


def test_a_file_that_is_no_image_is_refused(site):
    (site / "notes.png").write_text("this is a text file")
    check(csv_manifest(site, ["notes.png,report,normal"]), r"row 2: image file .*notes.png is not a PNG, JPEG or DICOM")


@pytest.mark.parametrize("name, message", [
    ("rtplan.dcm", "has no pixel data"),
    ("examples_palette.dcm", "palette-colour DICOM images are not supported"),
    ("examples_ybr_color.dcm", "holds 30 frames; store one image"),
])
def test_dicom_files_that_are_not_one_grayscale_or_rgb_image(site, name, message):
    shutil.copy(dicom_file(name), site / "x.dcm")
    check(csv_manifest(site, ["x.dcm,report,normal"]), rf"row 2: image file .*x.dcm: .*{message}")


def test_unknown_label(site):
    check(csv_manifest(site, ["ok.png,report,normal|pneumothorax"]),
          r"row 2: unknown label 'pneumothorax'; allowed labels are \['normal', 'cardiomegaly', 'effusion'\]")


def test_empty_and_missing_text(site):
    check(csv_manifest(site, ["ok.png,   ,normal"]), r"row 2: empty text in field 'text'")
    check(jsonl_manifest(site, [{"image": "ok.png", "labels": ["normal"]}]), r"row 1: missing text field 'text'")
    check(jsonl_manifest(site, [{"image": "ok.png", "text": 3, "labels": ["normal"]}]), r"row 1: text field .* string")


def test_row_without_label(site):
    check(csv_manifest(site, ["ok.png,report,"]), r"row 2: no label \(field 'labels'\)")
    check(jsonl_manifest(site, [{"image": "ok.png", "text": "r", "labels": []}]), r"row 1: no label")


def test_absolute_image_path_is_refused(site):
    check(csv_manifest(site, [f"{site / 'ok.png'},report,normal"]), r"row 2: image path .* is absolute")
    check(csv_manifest(site, ["C:\\scans\\ok.png,report,normal"]), r"row 2: image path .* is absolute")


def test_dotdot_escape_is_refused(site, tmp_path):
    gray(tmp_path / "outside.png")
    check(csv_manifest(site, ["../outside.png,report,normal"]), r"row 2: image path '../outside.png' leaves the "
                                                                r"manifest's folder through '..'")
    check(csv_manifest(site, ["sub/../../outside.png,report,normal"]), "leaves the manifest's folder")


def test_symlink_escape_is_refused(site, tmp_path):
    gray(tmp_path / "secret.png")
    (site / "link.png").symlink_to(tmp_path / "secret.png")
    check(csv_manifest(site, ["link.png,report,normal"]), r"row 2: image path 'link.png' resolves to .*secret.png, "
                                                          r"outside the manifest's folder")


def test_missing_image_field(site):
    check(jsonl_manifest(site, [{"text": "r", "labels": ["normal"]}]), r"row 1: missing image field 'image'")
    check(csv_manifest(site, ["ok.png,r,normal"], header="picture,text,labels"),
          r"row 1: the header has no column\(s\) \['image'\]")


def test_empty_manifest_means_nothing_to_train(site):
    check(csv_manifest(site, []), r"manifest.csv: the manifest is empty \(no example rows\), so there is nothing to train")
    (site / "blank.csv").write_text("")
    check(site / "blank.csv", r"blank.csv: the manifest is empty \(no header row\)")
    check(jsonl_manifest(site, ["", ""]), "nothing to train")


def test_invalid_json_row(site):
    check(jsonl_manifest(site, ['{"image": "ok.png", "text": "a", "labels": ["normal"]}', "{not json"]),
          r"manifest.jsonl: row 2: invalid JSON")


def test_missing_manifest_and_unknown_format(tmp_path):
    check(tmp_path / "none.csv", "file not found")
    (tmp_path / "m.parquet").write_text("x")
    check(tmp_path / "m.parquet", "cannot tell the format")


def test_the_agent_refuses_a_bad_manifest_before_any_model_is_fetched(site, tmp_path):
    """The agent reads the data contract first: a bad row stops the assignment (DatasetError names file and
    row; the agent declines it permanently) before anything is downloaded or trained."""
    from fedclinic.proto import agent_pb2
    from fedclinic.spec.task import Task
    from hospital_agent.config import AgentConfig
    from hospital_agent.task_state import TaskState
    from hospital_agent.worker import Agent

    m = csv_manifest(site, ["ok.png,fine,normal", "ok.png,,effusion"])
    cfg = AgentConfig.from_dict({"aggregator": "127.0.0.1:1", "work_dir": str(tmp_path / "work"),
                                 "tls": {"cert": "a", "key": "b", "ca": "c"},
                                 "datasets": {"cxr": {"path": str(m), "image_field": "image"}},
                                 "policy": {"allowed_families": ["image-text-classification"]}},
                                base=tmp_path, source="agent.toml")
    assert cfg.datasets["cxr"].image_field == "image"
    spec = Task(name="t", dataset="cxr", family="image-text-classification", architecture="resnet-bilstm",
                labels=LABELS, multi_label=True).to_spec()
    agent = Agent(cfg)
    state = TaskState()
    with pytest.raises(DatasetError, match=r"manifest.csv: row 3: empty text"):
        agent.training.prepare_data(agent_pb2.Assignment(task_id="t-1", round=1, spec=spec), state)
    assert state.loaded is None and state.train_data is None  # nothing was built, encoded or trained
