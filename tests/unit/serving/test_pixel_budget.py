"""The pixel budget reads an image's size from its header (PNG, JPEG, DICOM) and refuses it before decoding."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from fedclinic.serving.pixel_budget import ImageTooLarge, PixelBudget, header_size

from tests.helpers.serving import png_header_bomb


def _dicom(rows: int, columns: int, frames: int = 1) -> bytes:
    """A DICOM Part 10 file whose header declares rows x columns x frames (its pixel data is 4 bytes: only the
    header matters here)."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Rows, ds.Columns, ds.NumberOfFrames = rows, columns, frames
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = b"\0" * 4
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()


def _jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("L", (width, height)).save(out, "JPEG")
    return out.getvalue()


def test_sizes_come_from_the_header():
    assert header_size(png_header_bomb(13_000, 12_000)) == (13_000, 12_000, 1)
    assert header_size(_jpeg(30, 20)) == (30, 20, 1)
    assert header_size(_dicom(rows=7_000, columns=9_000, frames=2)) == (9_000, 7_000, 2)
    assert header_size(b"GIF89a") is None and header_size(b"\x89PNG\r\n\x1a\n broken") is None


@pytest.mark.parametrize("image,size", [(png_header_bomb(13_000, 13_000), "13000 x 13000 = 169,000,000"),
                                        (_dicom(rows=6_000, columns=5_000), "5000 x 6000 = 30,000,000"),
                                        (_dicom(rows=3_000, columns=3_000, frames=4), "3000 x 3000 x 4 frames")])
def test_an_image_above_the_budget_is_refused_naming_its_size_and_the_budget(image, size):
    with pytest.raises(ImageTooLarge, match=f"image 2 is {size}.* pixel budget is 25,000,000"):
        PixelBudget().check(image, "image 2")


def test_an_image_within_the_budget_and_unreadable_headers_pass_to_the_decoder():
    budget = PixelBudget(100)
    budget.check(_jpeg(10, 10), "image 0")
    budget.check(b"\x89PNG\r\n\x1a\n broken", "image 0")  # the decoder's message, not the budget's
    with pytest.raises(ImageTooLarge):
        budget.check(_jpeg(11, 10), "image 0")
