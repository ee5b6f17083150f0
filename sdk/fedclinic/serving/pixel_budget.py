"""The pixel budget of ``fedclinic serve``: an image's size read from its header, before any pixel is decoded.

A PNG of a few hundred KB can declare 13,000 x 13,000 pixels and decode to gigabytes. :class:`PixelBudget`
reads only the header (Pillow's ``Image.open`` parses the size without decoding; for DICOM, pydicom reads the
data set up to the pixel data: Rows x Columns x Number of Frames) and refuses an image above the budget with
:class:`ImageTooLarge`, which names the image, its size and the budget. :meth:`PixelBudget.install` also sets
Pillow's own decompression-bomb limit to the budget (and makes its warning an error), so an image whose header
the check could not read is still bounded by the decoder.
"""

from __future__ import annotations

import io
import warnings

from fedclinic.data.image import sniff_image_kind
from fedclinic.errors import FedclinicError

#: default budget: 5,000 x 5,000 (a chest radiograph is about 3,000 x 3,000, a mammogram up to about 4,100 x 5,600)
DEFAULT_MAX_PIXELS = 25_000_000


class ImageTooLarge(FedclinicError):
    """An image declares more pixels than the server's budget (HTTP 413, gRPC RESOURCE_EXHAUSTED)."""


class PixelBudget:
    """At most ``max_pixels`` pixels per image (all frames together)."""

    def __init__(self, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        if not isinstance(max_pixels, int) or max_pixels < 1:
            raise ValueError(f"the pixel budget must be a positive integer, got {max_pixels!r}")
        self.max_pixels = max_pixels

    def install(self) -> None:
        """Make Pillow refuse any image above the budget in this process (``Image.MAX_IMAGE_PIXELS``; its
        ``DecompressionBombWarning`` becomes an error, so the limit is the budget itself, not twice it)."""
        from PIL import Image

        Image.MAX_IMAGE_PIXELS = self.max_pixels
        warnings.simplefilter("error", Image.DecompressionBombWarning)

    def check(self, data: bytes, name: str) -> None:
        """Raise :class:`ImageTooLarge` when the file ``data`` declares more pixels than the budget.

        Reads the header only. Bytes whose header cannot be read pass: the decoder then refuses them with its
        own message (and Pillow's limit from :meth:`install` still applies)."""
        size = header_size(data)
        if size is None:
            return
        width, height, frames = size
        pixels = width * height * frames
        if pixels > self.max_pixels:
            frames_text = f" x {frames} frames" if frames > 1 else ""
            raise ImageTooLarge(f"{name} is {width} x {height}{frames_text} = {pixels:,} pixels; the server's pixel "
                                f"budget is {self.max_pixels:,} per image (fedclinic serve --max-image-pixels): "
                                "downscale the image before sending it")


def header_size(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, frames) declared by a PNG, JPEG or DICOM file's header, or None when it cannot be read."""
    kind = sniff_image_kind(bytes(data[:132]))
    if kind in ("png", "jpeg"):
        # the format's own class parses the header only, and without Image.open's decompression-bomb check
        # (which would refuse the image without saying its size)
        from PIL import JpegImagePlugin, PngImagePlugin

        opener = PngImagePlugin.PngImageFile if kind == "png" else JpegImagePlugin.JpegImageFile
        try:
            with opener(io.BytesIO(data)) as img:
                width, height = img.size
                return int(width), int(height), 1  # the decoder reads the first frame only
        except Exception:  # noqa: BLE001 - any unreadable header is the decoder's to report
            return None
    if kind == "dicom":
        import pydicom

        try:
            ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
            return int(ds.Columns), int(ds.Rows), max(1, int(ds.get("NumberOfFrames", 1) or 1))
        except Exception:  # noqa: BLE001 - as above
            return None
    return None
