"""Model packages larger than memory: ModelPackage.load(mapped=True) hashes and serves tensors one memory map at a
time (runtime.safetensors_file.MappedSafetensors). It reads exactly what the safetensors library wrote; a damaged
header is refused; numpy's buffers are traced by tracemalloc, so reading the whole file shows in the traced peak."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from safetensors.numpy import save_file

from fedclinic.errors import IntegrityError
from fedclinic.runtime.safetensors_file import MappedSafetensors
from fedclinic.transport.package import WEIGHTS_FILE, ModelPackage

N, SIZE = 8, 1 << 19  # 8 float32 tensors of 2 MiB


def _mixed():
    rng = np.random.default_rng(0)
    return {"a.weight": rng.normal(size=(3, 5)).astype(np.float32), "b.ids": np.arange(7, dtype=np.int64),
            "c.half": rng.normal(size=(4,)).astype(np.float16), "d.empty": np.zeros((0, 3), np.float32),
            "e.mask": np.array([True, False])}


def test_a_mapped_file_reads_what_the_safetensors_library_wrote(tmp_path):
    tensors = _mixed()
    save_file(tensors, str(tmp_path / "x.safetensors"))
    mapped = MappedSafetensors(tmp_path / "x.safetensors")
    assert set(mapped) == set(tensors) and len(mapped) == len(tensors)
    for name, arr in tensors.items():
        np.testing.assert_array_equal(mapped[name], arr, err_msg=name)


def test_a_mapped_package_hashes_like_a_loaded_one_and_a_damaged_header_is_refused(tmp_path):
    pkg = ModelPackage({k: v for k, v in _mixed().items()}, {"config.json": b"{}"})
    pkg.save(tmp_path / "p")
    assert ModelPackage.load(tmp_path / "p", mapped=True).manifest() == ModelPackage.load(tmp_path / "p").manifest()
    weights = tmp_path / "p" / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    weights.write_bytes(bytes(data[:-1]))  # one byte short: the last tensor does not end where the file does
    with pytest.raises(IntegrityError, match="cannot read .*the tensors end at byte"):
        ModelPackage.load(tmp_path / "p", mapped=True)


def _traced(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_hashing_a_mapped_package_holds_one_tensor_not_the_model(tmp_path):
    rng = np.random.default_rng(1)
    pkg = ModelPackage({f"t{i}": rng.normal(size=SIZE).astype(np.float32) for i in range(N)}, {"config.json": b"{}"})
    model_bytes, tensor_bytes = N * SIZE * 4, SIZE * 4
    pkg.save(tmp_path / "p")
    hashed = _traced(lambda: ModelPackage.load(tmp_path / "p", mapped=True).manifest())
    assert hashed < tensor_bytes, f"hashing traced {hashed / 1e6:.1f} MB"
    assert _traced(lambda: ModelPackage.load(tmp_path / "p").manifest()) >= model_bytes  # the check can fail
