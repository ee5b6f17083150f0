"""verify_model (aggregator_service/stored_data.py): what a round close checks of its base model before reading it."""

from __future__ import annotations

import numpy as np
import pytest

from fedclinic.runtime.blobstore import BlobStore
from fedclinic.transport.package import ModelPackage

from aggregator_service.stored_data import StoredCopyDamaged, verify_model


def _stored_model(tmp_path):
    blobs = BlobStore(tmp_path / "blobs")
    package = ModelPackage(tensors={"frozen.weight": np.arange(8, dtype=np.float32),
                                    "head.weight": np.ones(4, dtype=np.float32)},
                           files={"config.json": b"{}"})
    manifest = package.manifest()
    for t in manifest.tensors:
        blobs.put(package.tensors[t.name].tobytes(), t.sha256)
    blobs.put(b"{}", manifest.files[0].sha256)
    return blobs, manifest


def _damage(blobs, sha256):
    path = blobs.path(sha256)
    path.chmod(0o600)
    path.write_bytes(b"\x7f" * path.stat().st_size)


def test_only_the_named_tensors_are_checked_and_a_damaged_one_of_them_is_refused(tmp_path):
    blobs, manifest = _stored_model(tmp_path)
    verify_model(blobs, manifest, manifest.model_hash)  # intact: every blob
    frozen, head = manifest.tensor("frozen.weight"), manifest.tensor("head.weight")
    _damage(blobs, frozen.sha256)
    _damage(blobs, manifest.files[0].sha256)
    # a round that aggregates only the head reads only the head: the frozen tensor and the file are not its to check
    verify_model(blobs, manifest, manifest.model_hash, tensors={"head.weight"})
    with pytest.raises(StoredCopyDamaged, match="tensor 'frozen.weight'"):
        verify_model(blobs, manifest, manifest.model_hash)
    _damage(blobs, head.sha256)
    with pytest.raises(StoredCopyDamaged, match="tensor 'head.weight'"):
        verify_model(blobs, manifest, manifest.model_hash, tensors={"head.weight"})
    blobs.path(head.sha256).unlink()
    with pytest.raises(StoredCopyDamaged, match="'head.weight' .* is missing"):
        verify_model(blobs, manifest, manifest.model_hash, tensors={"head.weight"})
