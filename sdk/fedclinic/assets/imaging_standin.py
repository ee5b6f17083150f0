"""A STAND-IN image + text dataset for tests and demos of the image-text family. **Not chest X-rays.**

No chest X-ray images exist offline (shared/reference/offline_assets.md). This module makes a small,
clearly labelled substitute from the only real medical images at hand: the two slices that pydicom bundles
with its wheel, ``CT_small.dcm`` (a 128 x 128 CT slice) and ``MR_small.dcm`` (a 64 x 64 MR slice), read with
``get_testdata_file(..., download=False)`` (never a download). Nothing here is clinical data; results on it say
that the pipeline works, not how well a model reads X-rays.

Each example is derived from one of the two real slices (the modality is drawn at random, half each):

1. ``x`` = the slice's modality values (pydicom's modality LUT: Hounsfield units for CT);
2. a random square crop of 70-100 % of the side at a random offset, and a left-right flip with probability 0.5;
3. with probability 0.5 a **synthetic finding**, the label ``marker``: a disc of radius 8-15 % of the crop's side
   at a random place, set to the slice's maximum value (a bright round spot);
4. Gaussian noise with standard deviation 3 % of the slice's value range.

Labels (multi-label): exactly one of ``ct`` / ``mr`` (the real modality) plus ``marker`` when step 3 drew one.
The text is a short template report: it names the modality in 80 % of the examples ("axial ct slice", ...) and
the finding in 75 % ("focal bright marker noted" / "no focal marker"); otherwise it says "see image". So
neither modality alone always suffices and the fused model has something to learn from both.

Files: images go to ``FOLDER/images/`` as 8- or 16-bit grayscale PNG (the augmented values min-max scaled
to the full range) or as DICOM (the source file's dataset with the new pixels stored back through the
inverse rescale, new deterministic UIDs, patient fields replaced by ``STANDIN``, and an ImageComments line
saying what it is). The manifest (CSV or JSONL, the format :mod:`fedclinic.data.image` reads) lies in
``FOLDER`` with image paths relative to it. Same seed, same files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from fedclinic.errors import ConfigError
from fedclinic.models.base import wordlevel_tokenizer_json

STANDIN_LABELS = ("ct", "mr", "marker")
SOURCES = {"ct": "CT_small.dcm", "mr": "MR_small.dcm"}
_MODALITY_PHRASES = {"ct": ("axial ct slice", "computed tomography image"),
                     "mr": ("mr image", "magnetic resonance slice")}
_NEUTRAL_PHRASES = ("cross sectional slice", "single image")
_MARKER_PHRASES = ("focal bright marker noted", "a bright round marker is seen")
_NO_MARKER_PHRASES = ("no focal marker", "unremarkable appearance without marker")
_OPENINGS = ("stand in report", "synthetic study")
NOTICE = "fedclinic stand-in image derived from pydicom test data; NOT a chest X-ray, not clinical data"


@dataclass(frozen=True)
class StandinExample:
    """One generated example in memory: modality values ``image`` (float64 ``[H, W]``), report, labels, source."""

    image: np.ndarray
    text: str
    labels: tuple[str, ...]
    modality: str


def standin_words() -> list[str]:
    """Every word the template reports use (for a word-level tokenizer)."""
    phrases = [p for ps in _MODALITY_PHRASES.values() for p in ps] + list(
        _NEUTRAL_PHRASES + _MARKER_PHRASES + _NO_MARKER_PHRASES + _OPENINGS) + ["see image"]
    return sorted({w for p in phrases for w in p.split()})


def standin_tokenizer_json() -> bytes:
    """A word-level ``tokenizer.json`` covering :func:`standin_words` (see ``wordlevel_tokenizer_json``)."""
    return wordlevel_tokenizer_json(standin_words())


def _source(modality: str):
    import pydicom
    from pydicom.data import get_testdata_file

    path = get_testdata_file(SOURCES[modality], download=False)
    if path is None:
        raise ConfigError(f"pydicom's bundled test file {SOURCES[modality]} is missing; install pydicom==3.0.2 "
                          "(the [train] extra) — the stand-in never downloads anything")
    return pydicom.dcmread(path)


def _modality_values(ds) -> np.ndarray:
    from pydicom.pixels import apply_modality_lut

    return np.asarray(apply_modality_lut(ds.pixel_array, ds), dtype=np.float64)


def generate(n: int, *, seed: int = 0) -> list[StandinExample]:
    """``n`` stand-in examples in memory (module doc, steps 1-4)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"n must be a positive integer, got {n!r}")
    rng = np.random.default_rng(seed)
    bases = {m: _modality_values(_source(m)) for m in SOURCES}
    out = []
    for _ in range(n):
        modality = "ct" if rng.random() < 0.5 else "mr"
        base = bases[modality]
        lo, hi = float(base.min()), float(base.max())
        side = min(base.shape)
        crop = int(round(side * rng.uniform(0.7, 1.0)))
        top = int(rng.integers(0, base.shape[0] - crop + 1))
        left = int(rng.integers(0, base.shape[1] - crop + 1))
        x = base[top:top + crop, left:left + crop].copy()
        if rng.random() < 0.5:
            x = x[:, ::-1].copy()
        marker = bool(rng.random() < 0.5)
        if marker:
            radius = crop * rng.uniform(0.08, 0.15)
            cy, cx = rng.uniform(radius, crop - radius, size=2)
            yy, xx = np.mgrid[0:crop, 0:crop]
            x[(yy - cy) ** 2 + (xx - cx) ** 2 <= radius ** 2] = hi
        x = x + rng.normal(0.0, 0.03 * (hi - lo), size=x.shape)
        labels = (modality, "marker") if marker else (modality,)
        out.append(StandinExample(image=x, text=_report(rng, modality, marker), labels=labels, modality=modality))
    return out


def _report(rng: np.random.Generator, modality: str, marker: bool) -> str:
    def pick(options: Sequence[str]) -> str:
        return options[int(rng.integers(0, len(options)))]

    what = pick(_MODALITY_PHRASES[modality]) if rng.random() < 0.8 else pick(_NEUTRAL_PHRASES)
    finding = (pick(_MARKER_PHRASES if marker else _NO_MARKER_PHRASES) if rng.random() < 0.75 else "see image")
    return f"{pick(_OPENINGS)} {what} {finding}"


def write_standin(folder: str | Path, *, n: int, seed: int = 0, image_format: str = "png",
                  manifest_format: str = "csv", png_bits: int = 8, name: str = "manifest") -> Path:
    """Write ``n`` stand-in examples under ``folder``; returns the manifest's path (``folder/NAME.csv|jsonl``).

    ``image_format``: ``png`` or ``dicom``; ``png_bits``: 8 or 16; ``manifest_format``: ``csv`` (labels
    ``|``-separated) or ``jsonl`` (a list). Columns/fields: ``image``, ``text``, ``labels``.
    """
    if image_format not in ("png", "dicom"):
        raise ConfigError(f"image_format must be 'png' or 'dicom', got {image_format!r}")
    if manifest_format not in ("csv", "jsonl"):
        raise ConfigError(f"manifest_format must be 'csv' or 'jsonl', got {manifest_format!r}")
    if png_bits not in (8, 16):
        raise ConfigError(f"png_bits must be 8 or 16, got {png_bits!r}")
    root = Path(folder)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    sources = {m: _source(m) for m in SOURCES}
    for i, ex in enumerate(generate(n, seed=seed)):
        rel = f"images/{name}-{i:04d}.{'png' if image_format == 'png' else 'dcm'}"
        if image_format == "png":
            _write_png(root / rel, ex.image, png_bits)
        else:
            _write_dicom(root / rel, ex.image, sources[ex.modality], uid_key=f"fedclinic-standin-{seed}-{name}-{i}")
        rows.append({"image": rel, "text": ex.text, "labels": list(ex.labels)})
    manifest = root / f"{name}.{manifest_format}"
    if manifest_format == "jsonl":
        manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    else:
        import csv
        import io

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["image", "text", "labels"])
        for r in rows:
            w.writerow([r["image"], r["text"], "|".join(r["labels"])])
        manifest.write_text(buf.getvalue(), encoding="utf-8")
    return manifest


def _write_png(path: Path, x: np.ndarray, bits: int) -> None:
    from PIL import Image

    lo, hi = float(x.min()), float(x.max())
    v = (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)
    if bits == 8:
        Image.fromarray(np.round(v * 255).astype(np.uint8)).save(path, format="PNG")
    else:
        Image.fromarray(np.round(v * 65535).astype(np.uint16)).save(path, format="PNG")


def _write_dicom(path: Path, x: np.ndarray, source, *, uid_key: str) -> None:
    import copy

    from pydicom.uid import generate_uid

    ds = copy.deepcopy(source)
    slope = float(ds.get("RescaleSlope", 1) or 1)
    intercept = float(ds.get("RescaleIntercept", 0) or 0)
    stored = np.clip(np.round((x - intercept) / slope), -32768, 32767).astype(np.int16)
    if int(ds.PixelRepresentation) != 1 or int(ds.BitsAllocated) != 16:
        raise ConfigError("the stand-in expects signed 16-bit source slices")  # true of both bundled files
    ds.Rows, ds.Columns = stored.shape
    ds.PixelData = stored.tobytes()
    for tag in ("SmallestImagePixelValue", "LargestImagePixelValue"):
        if tag in ds:
            del ds[tag]
    uid = generate_uid(entropy_srcs=[uid_key])
    ds.SOPInstanceUID = uid
    ds.file_meta.MediaStorageSOPInstanceUID = uid
    ds.PatientName = "STANDIN^SYNTHETIC"
    ds.PatientID = "STANDIN"
    ds.ImageComments = NOTICE
    ds.save_as(path, enforce_file_format=True)


__all__ = ["NOTICE", "STANDIN_LABELS", "StandinExample", "generate", "standin_tokenizer_json", "standin_words",
           "write_standin"]
