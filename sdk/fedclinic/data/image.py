"""Site dataset reader for the image + text family ("image-text-classification"), and image preprocessing.

A dataset is a **manifest**: a CSV/TSV file with a header row, or a JSONL file, one example per row:

* ``image``: the image file's path **relative to the manifest's folder** (absolute paths and paths that
  leave the folder, by ``..`` or through a symbolic link, are refused: a task can only read what the site
  put beside its manifest);
* ``text``: the report that goes with the image (must not be empty);
* ``labels``: the findings, at least one per row, from the task's label set: a JSON list in JSONL (a single
  string is one label), ``|``-separated in CSV/TSV (``"cardiomegaly|effusion"``). Include a "normal" or
  "no finding" label in the label set for rows without findings, as IU-CXR does. When the configured
  label field is ``label`` and a row has none, ``labels`` is read instead.

Column names are configurable (``image_field``, ``text_field``, ``label_field``). Every problem raises
:class:`~fedclinic.errors.DatasetError` naming the manifest, the row (1-based; in CSV/TSV the header is row
1), the image file where there is one, and what to do. Nothing is read lazily: every image is decoded once
while reading, so a manifest that passes is fully valid (a corrupt image fails here, not in round 7).
Examples keep the image *path*; :func:`load_image` decodes it again when the model encodes the data (once
per task), at the model's image size.

A server that receives an image's bytes (``fedclinic serve``) decodes them with :func:`decode_image_bytes`: the
same recognition, decoders and steps as for a file. Image files are recognised by their content, not their name: PNG, JPEG, or DICOM (Part 10, with the
``DICM`` marker; PNG/JPEG via Pillow, DICOM via pydicom; compressed DICOM transfer syntaxes decode when
pydicom has a decoder for them).

Preprocessing (exactly; :func:`decode_image` then :func:`preprocess`)
---------------------------------------------------------------------
1. **To grayscale in [0, 1]** (float64 while computing, float32 after):

   * PNG/JPEG, 8-bit modes (``L``, ``P``, ``RGB``, ``RGBA``, ``CMYK``, ``1``, ...): Pillow's
     ``convert("L")``, i.e. ITU-R 601-2 luma ``L = (299 R + 587 G + 114 B) / 1000`` (alpha is ignored),
     then ``L / 255``.
   * PNG 16-bit grayscale (modes ``I;16*``, or ``I`` holding values in [0, 65535]): ``v / 65535``.
   * DICOM: ``x = modality LUT(stored values)`` (Rescale Slope/Intercept or a Modality LUT, pydicom's
     ``apply_modality_lut``). Then, when the file has a window (the first Window Center ``c`` and Window
     Width ``w``), the VOI window of DICOM PS3.3 C.11.2.1.2 maps ``x`` to [0, 1] by its VOI LUT Function:
     ``LINEAR`` (default): ``clip(((x - (c - 0.5)) / (w - 1)) + 0.5, 0, 1)`` (``w >= 1``);
     ``LINEAR_EXACT``: ``clip((x - c) / w + 0.5, 0, 1)``; ``SIGMOID``: ``1 / (1 + exp(-4 (x - c) / w))``.
     Without a window: ``(x - min x) / (max x - min x)`` over the image (a constant image becomes 0).
     ``MONOCHROME1`` images (where low values are bright) are inverted: ``1 - v``. RGB DICOM uses the luma
     weights above on the [0, 1]-scaled channels (``v / (2^BitsStored - 1)``). One frame per file;
     palette-colour images are refused.
2. **Resize** to ``size x size`` with Pillow's bilinear filter on the float image (mode ``F``; Pillow widens
   the filter's support when shrinking, so downsampling is antialiased). The aspect ratio is *not* kept,
   as in the IU-CXR code (224 x 224).
3. **Normalise**: ``(v - mean) / std`` with the model's ``image_mean`` and ``image_std`` (defaults 0.5 and
   0.5, giving [-1, 1]); the result is float32 ``[1, size, size]`` (one channel).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from fedclinic.data.files import (
    FORMATS,
    require_text,
    check_label_set,
    decode_guard,
    fmt_labels,
    open_text,
    parse_labels,
    infer_format,
    jsonl_objects,
)
from fedclinic.errors import ConfigError, DatasetError

IMAGE_KINDS = ("png", "jpeg", "dicom")
#: luma weights of ITU-R 601-2 (what Pillow's convert("L") uses), for RGB DICOM
_LUMA = np.array([0.299, 0.587, 0.114])
# Only real line breaks end a JSONL row (a JSON string may hold U+2028, which str.splitlines would split on).
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class ImageTextExample:
    """One image, its report and its labels (at least one, in the task's label order).

    ``image`` is the resolved absolute path of a file that decoded when the manifest was read; ``source`` says
    where the example came from ("MANIFEST: row N"), for errors raised later.
    """

    image: Path
    text: str
    labels: tuple[str, ...]
    source: str = ""


# ------------------------------------------------------------------------------------------------------------
# reading a manifest


def read_image_text(
    path: str | os.PathLike[str],
    *,
    label_set: Sequence[str],
    format: str | None = None,
    image_field: str = "image",
    text_field: str = "text",
    label_field: str = "labels",
) -> list[ImageTextExample]:
    """Read and validate an image + text manifest (module doc); returns its examples in file order.

    Every image is decoded once here; a manifest that passes is fully valid.
    """
    labels = check_label_set(label_set)
    for name, value in (("image_field", image_field), ("text_field", text_field), ("label_field", label_field)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name} must name a column, got {value!r}")
    fmt = (format or "").lower() or infer_format(path)
    if fmt not in FORMATS:
        raise DatasetError(f"{path}: unknown manifest format {format!r}; use one of {', '.join(FORMATS)}")
    root = Path(path).resolve().parent
    rows = (_jsonl_rows(path, image_field, text_field, label_field) if fmt == "jsonl"
            else _table_rows(path, image_field, text_field, label_field, "," if fmt == "csv" else "\t"))
    allowed = set(labels)
    order = {lab: i for i, lab in enumerate(labels)}
    out: list[ImageTextExample] = []
    for where, image, text, raw_labels, used_label_field in rows:
        require_text(text, where, text_field, "the report that goes with its image")
        found = parse_labels(raw_labels, where, used_label_field, fmt, allowed)
        if not found:
            raise DatasetError(f"{where}: no label (field {used_label_field!r}); every row needs at least one label "
                               f"from {fmt_labels(labels)} (use a 'normal' label for rows without findings)")
        unknown = [lab for lab in found if lab not in allowed]
        if unknown:
            raise DatasetError(f"{where}: unknown label {unknown[0]!r}; allowed labels are {fmt_labels(labels)} "
                               "(fix the row or add the label to the task's label set)")
        image_path = resolve_image_path(root, image, where, image_field)
        decode_image(image_path, where=where)  # validate now; the pixels are decoded again at encoding time
        out.append(ImageTextExample(image=image_path, text=text, labels=tuple(sorted(set(found), key=order.__getitem__)),
                                    source=where))
    if not out:
        raise DatasetError(f"{path}: the manifest is empty (no example rows), so there is nothing to train; point "
                           "the site at a manifest with data")
    return out


def resolve_image_path(root: Path, value: Any, where: str, image_field: str = "image") -> Path:
    """The image file ``value`` names, relative to the manifest folder ``root`` (already resolved).

    DatasetError for a missing/empty value, an absolute path, a path that leaves ``root`` (``..`` or a
    symbolic link pointing outside) and a file that does not exist.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DatasetError(f"{where}: missing image field {image_field!r}; every row needs an image path relative "
                           "to the manifest's folder")
    if not isinstance(value, str):
        raise DatasetError(f"{where}: image field {image_field!r} must be a path (string), got {type(value).__name__}")
    rel = value.strip()
    if os.path.isabs(rel) or rel.startswith(("/", "\\")) or re.match(r"[A-Za-z]:[\\/]", rel):
        raise DatasetError(f"{where}: image path {rel!r} is absolute; give it relative to the manifest's folder "
                           f"{root} (a manifest may only name files inside its own folder)")
    if ".." in Path(rel.replace("\\", "/")).parts:
        raise DatasetError(f"{where}: image path {rel!r} leaves the manifest's folder through '..'; move the image "
                           f"under {root} and name it relative to it")
    candidate = root / rel
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise DatasetError(f"{where}: image path {rel!r} resolves to {resolved}, outside the manifest's folder "
                           f"{root} (a symbolic link?); copy the image under {root}")
    if not resolved.exists():
        raise DatasetError(f"{where}: image file {candidate} not found; check the path (relative to {root}) or "
                           "remove the row")
    if not resolved.is_file():
        raise DatasetError(f"{where}: image path {candidate} is not a file")
    return resolved


def _label_value(obj: dict, label_field: str) -> tuple[Any, str]:
    if obj.get(label_field) is None and label_field == "label" and "labels" in obj:
        return obj.get("labels"), "labels"
    return obj.get(label_field), label_field


def _jsonl_rows(path, image_field: str, text_field: str, label_field: str) -> Iterator[tuple]:
    with open_text(path) as fh:
        lines = _LINE_BREAK.split(decode_guard(path, fh.read))
    expects = f"{image_field!r}, {text_field!r} and {label_field!r}"
    for where, obj in jsonl_objects(path, lines, expects):
        raw, used = _label_value(obj, label_field)
        yield where, obj.get(image_field), obj.get(text_field), raw, used


def _table_rows(path, image_field: str, text_field: str, label_field: str, delimiter: str) -> Iterator[tuple]:
    with open_text(path) as fh:
        content = decode_guard(path, fh.read)
    reader = csv.reader(content.splitlines(keepends=True), delimiter=delimiter)
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise DatasetError(f"{path}: the manifest is empty (no header row), so there is nothing to train; the first "
                           f"row must name the columns, e.g. {image_field}{delimiter}{text_field}{delimiter}"
                           f"{label_field}") from None
    except csv.Error as exc:
        raise DatasetError(f"{path}: row 1: malformed header ({exc})") from None
    if label_field not in header and label_field == "label" and "labels" in header:
        label_field = "labels"
    missing = [f for f in (image_field, text_field, label_field) if f not in header]
    if missing:
        raise DatasetError(f"{path}: row 1: the header has no column(s) {missing}; found columns {header}. Rename "
                           "the columns or set image_field/text_field/label_field")
    ii, ti, li = header.index(image_field), header.index(text_field), header.index(label_field)
    row_no = 1
    kind = "TSV" if delimiter == "\t" else "CSV"
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise DatasetError(f"{path}: row {row_no + 1}: malformed {kind} ({exc})") from None
        row_no += 1
        if not row or all(not c.strip() for c in row):
            continue

        def cell(i: int) -> str | None:
            return row[i] if i < len(row) else None

        yield f"{path}: row {row_no}", cell(ii), cell(ti), cell(li), label_field


# ------------------------------------------------------------------------------------------------------------
# decoding and preprocessing


def sniff_image_kind(head: bytes) -> str | None:
    """'png' / 'jpeg' / 'dicom' from a file's first 132 bytes (magic numbers), else None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if len(head) >= 132 and head[128:132] == b"DICM":
        return "dicom"
    return None


def decode_image(path: str | os.PathLike[str], *, where: str = "") -> np.ndarray:
    """The image at ``path`` as a float32 ``[H, W]`` grayscale array in [0, 1] (module doc, step 1).

    DatasetError (prefixed with ``where`` and naming the file) for an unknown or corrupt file.
    """
    p = Path(path)
    prefix = f"{where}: " if where else ""
    try:
        with open(p, "rb") as fh:
            head = fh.read(132)
    except OSError as exc:
        raise DatasetError(f"{prefix}cannot read image file {p} ({exc.strerror or exc}); check the file and its "
                           "permissions") from None
    return _decode(p, head, f"{prefix}image file {p}", "re-export the image or remove the row",
                   "convert it or remove the row")


def decode_image_bytes(data: bytes, *, name: str = "the image") -> np.ndarray:
    """:func:`decode_image` for a file's bytes held in memory (e.g. received by a server): the same recognition,
    decoders and grayscale conversion. DatasetError naming ``name`` for empty, unknown or corrupt bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DatasetError(f"{name} must be the bytes of a PNG, JPEG or DICOM file, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise DatasetError(f"{name} is empty (0 bytes); send the bytes of a PNG, JPEG or DICOM file")
    return _decode(io.BytesIO(data), data[:132], name, "send the image file's bytes unchanged",
                   "send a PNG, JPEG or DICOM (Part 10) file")


def _decode(source: Path | io.BytesIO, head: bytes, what: str, fix_corrupt: str, fix_unknown: str) -> np.ndarray:
    """Decode ``source`` (a file or its bytes; ``head`` = its first 132 bytes) to [0, 1] grayscale; ``what`` names
    it in errors, ``fix_*`` say what to do about a corrupt or an unrecognised image."""
    kind = sniff_image_kind(head)
    if kind is None:
        raise DatasetError(f"{what} is not a PNG, JPEG or DICOM file (unrecognised content; a DICOM "
                           "file must be in Part 10 format: 128-byte preamble, then 'DICM'); " + fix_unknown)
    try:
        gray = _decode_dicom(source) if kind == "dicom" else _decode_pil(source)
    except DatasetError as exc:
        raise DatasetError(f"{what}: {exc}") from None
    except Exception as exc:  # decoders raise many types (OSError, ValueError, SyntaxError, ...) for bad bytes
        raise DatasetError(f"{what} is corrupt or unreadable as {kind.upper()} "
                           f"({type(exc).__name__}: {exc}); {fix_corrupt}") from None
    if gray.ndim != 2 or gray.size == 0:
        raise DatasetError(f"{what} decoded to shape {gray.shape}; expected one 2-D image")
    if not np.isfinite(gray).all():
        raise DatasetError(f"{what} holds NaN or infinite pixel values")
    return gray.astype(np.float32)


def _decode_pil(p: Path | io.BytesIO) -> np.ndarray:
    from PIL import Image

    with Image.open(p) as img:
        img.load()
        mode = img.mode
        if mode.startswith("I;16"):
            return np.asarray(img, dtype=np.float64) / 65535.0
        if mode == "I":
            arr = np.asarray(img, dtype=np.float64)
            if arr.size and (arr.min() < 0 or arr.max() > 65535):
                raise DatasetError(f"32-bit integer pixel values outside [0, 65535] (mode {mode}); save it as 8- or "
                                   "16-bit grayscale")
            return arr / 65535.0
        if mode == "F":
            raise DatasetError("floating-point pixels (mode F) are not a PNG/JPEG grayscale; save it as 8- or "
                               "16-bit")
        return np.asarray(img.convert("L"), dtype=np.float64) / 255.0


def _decode_dicom(p: Path | io.BytesIO) -> np.ndarray:
    import pydicom
    from pydicom.pixels import apply_modality_lut

    ds = pydicom.dcmread(p)
    if "PixelData" not in ds and "FloatPixelData" not in ds and "DoubleFloatPixelData" not in ds:
        raise DatasetError("the DICOM file has no pixel data (a report or a structured document?); give an image")
    frames = int(ds.get("NumberOfFrames", 1) or 1)
    if frames != 1:
        raise DatasetError(f"the DICOM file holds {frames} frames; store one image (one frame) per file")
    photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2")).upper()
    if photometric == "PALETTE COLOR":
        raise DatasetError("palette-colour DICOM images are not supported; export it as MONOCHROME2 or RGB")
    raw = ds.pixel_array
    samples = int(ds.get("SamplesPerPixel", 1) or 1)
    if samples == 3:
        if raw.ndim != 3 or raw.shape[-1] != 3:
            raise DatasetError(f"an RGB DICOM decoded to shape {raw.shape}; expected rows x columns x 3")
        top = float(2 ** int(ds.get("BitsStored", 8)) - 1)
        return (raw.astype(np.float64) / top) @ _LUMA
    if samples != 1:
        raise DatasetError(f"{samples} samples per pixel are not supported (grayscale or RGB only)")
    x = np.asarray(apply_modality_lut(raw, ds), dtype=np.float64)
    window = _first_window(ds)
    if window is not None:
        center, width = window
        function = str(ds.get("VOILUTFunction", "LINEAR") or "LINEAR").upper()
        v = voi_window(x, center, width, function)
    else:
        lo, hi = float(x.min()), float(x.max())
        v = (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)
    if photometric == "MONOCHROME1":
        v = 1.0 - v
    return v


def _first_window(ds) -> tuple[float, float] | None:
    """The first (Window Center, Window Width) pair of the file, or None when it has no usable window."""
    from pydicom.multival import MultiValue

    def first(value: Any) -> float:
        items = list(value) if isinstance(value, (list, tuple, MultiValue)) else [value]
        try:
            return float(items[0])
        except (TypeError, ValueError, IndexError):
            return math.nan

    center, width = ds.get("WindowCenter"), ds.get("WindowWidth")
    if center is None or width is None:
        return None
    c, w = first(center), first(width)
    if not (math.isfinite(c) and math.isfinite(w)) or w <= 0:
        return None
    return c, w


def voi_window(x: np.ndarray, center: float, width: float, function: str = "LINEAR") -> np.ndarray:
    """DICOM PS3.3 C.11.2.1.2 VOI windowing of modality values ``x`` onto [0, 1] (module doc, step 1).

    ``function``: ``LINEAR`` (needs ``width >= 1``), ``LINEAR_EXACT`` or ``SIGMOID`` (``width > 0``).
    """
    function = function.upper()
    if function == "LINEAR":
        if width < 1:
            raise DatasetError(f"Window Width {width} < 1 is invalid for the LINEAR VOI function")
        if width == 1:
            return (x > center - 0.5).astype(np.float64)
        return np.clip((x - (center - 0.5)) / (width - 1.0) + 0.5, 0.0, 1.0)
    if width <= 0:
        raise DatasetError(f"Window Width {width} must be > 0")
    if function == "LINEAR_EXACT":
        return np.clip((x - center) / width + 0.5, 0.0, 1.0)
    if function == "SIGMOID":
        return 1.0 / (1.0 + np.exp(-4.0 * (x - center) / width))
    raise DatasetError(f"unknown VOI LUT Function {function!r} (LINEAR, LINEAR_EXACT or SIGMOID)")


def preprocess(gray: np.ndarray, *, size: int, mean: float = 0.5, std: float = 0.5) -> np.ndarray:
    """A [0, 1] grayscale ``[H, W]`` image -> float32 ``[1, size, size]``: bilinear resize, then ``(v - mean) / std``
    (module doc, steps 2-3)."""
    from PIL import Image

    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"image size must be a positive integer, got {size!r}")
    if not (std > 0 and math.isfinite(std) and math.isfinite(mean)):
        raise ConfigError(f"image normalisation needs a finite mean and std > 0, got mean {mean!r}, std {std!r}")
    arr = np.ascontiguousarray(gray, dtype=np.float32)
    if arr.shape != (size, size):
        arr = np.asarray(Image.fromarray(arr).resize((size, size), Image.Resampling.BILINEAR), dtype=np.float32)
    return ((arr - np.float32(mean)) / np.float32(std))[None, :, :].astype(np.float32, copy=False)


def load_image(path: str | os.PathLike[str], *, size: int, mean: float = 0.5, std: float = 0.5,
               where: str = "") -> np.ndarray:
    """:func:`decode_image` then :func:`preprocess`: the model input ``[1, size, size]`` float32 of one file."""
    return preprocess(decode_image(path, where=where), size=size, mean=mean, std=std)


__all__ = ["IMAGE_KINDS", "ImageTextExample", "decode_image", "decode_image_bytes", "load_image", "preprocess",
           "read_image_text", "resolve_image_path", "sniff_image_kind", "voi_window"]
