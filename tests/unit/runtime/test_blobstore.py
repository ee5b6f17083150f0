import hashlib
import os

import numpy as np
import pytest

from fedclinic.runtime.blobstore import BlobStore
from fedclinic.errors import IntegrityError
from fedclinic.transport.package import ModelPackage, raw_bytes, tensor_sha256


def test_put_read_and_memory_map(tmp_path):
    store = BlobStore(tmp_path)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    sha = store.put(raw_bytes(a))
    assert sha == tensor_sha256(a) and store.has(sha)
    view = store.array(sha, "float32", (3, 4))
    assert np.array_equal(view, a)


def test_wrong_hash_or_size_never_publishes(tmp_path):
    store = BlobStore(tmp_path)
    bad = hashlib.sha256(b"other").hexdigest()
    with pytest.raises(IntegrityError, match="does not match"):
        store.put(b"hello", expected_sha256=bad)
    assert not store.has(bad)
    w = store.writer(expected_nbytes=3)
    with pytest.raises(IntegrityError, match="longer"):
        w.write(b"toolong")
    w.abort()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_partial_writes_are_cleaned_on_restart(tmp_path):
    store = BlobStore(tmp_path)
    w = store.writer()
    w.write(b"half")  # a process dying here leaves a temp file, never a blob
    assert len(list(store.tmp_dir.iterdir())) == 1
    BlobStore(tmp_path)
    assert list(store.tmp_dir.iterdir()) == []


def test_invalid_blob_ids_are_refused(tmp_path):
    with pytest.raises(IntegrityError, match="not a sha256"):
        BlobStore(tmp_path).path("../../etc/passwd")


def test_package_save_refuses_paths_outside(tmp_path):
    pkg = ModelPackage({"w": np.zeros(2, np.float32)}, {"../evil.txt": b"x"})
    with pytest.raises(IntegrityError, match="inside the package"):
        pkg.save(tmp_path / "pkg")
    assert not (tmp_path / "evil.txt").exists()


def test_package_save_load_round_trip(tmp_path):
    pkg = ModelPackage({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"config.json": b"{}"})
    loaded = ModelPackage.load(pkg.save(tmp_path / "p"))
    assert loaded.manifest().model_hash == pkg.manifest().model_hash
    assert os.path.exists(tmp_path / "p" / "model.safetensors")
