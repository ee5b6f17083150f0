"""fedclinic.runtime.array_blocks: same-sized arrays walked in C-order blocks, a read-only memory map's pages
released after each block (the process's peak stays one block, not the array), writable maps never touched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedclinic.runtime.array_blocks import flat_blocks, release_mapped


def _kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_blocks_cover_the_arrays_in_c_order():
    a = np.arange(1000, dtype=np.float32).reshape(10, 100)
    b = np.arange(1000, dtype=np.float64).reshape(100, 10).T  # not C-contiguous: read in a's order all the same
    pairs = list(flat_blocks([a, b], block_bytes=128))
    assert len(pairs) == 63 and all(x.size == y.size for x, y in pairs)
    np.testing.assert_array_equal(np.concatenate([x for x, _ in pairs]), a.reshape(-1))
    np.testing.assert_array_equal(np.concatenate([y for _, y in pairs]), np.ascontiguousarray(b).reshape(-1))
    assert list(flat_blocks([np.zeros(0)])) == []
    with pytest.raises(ValueError, match="one size"):
        list(flat_blocks([a, np.zeros(999)]))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak reset")
def test_a_read_only_map_keeps_one_block_of_pages_resident(tmp_path):
    size = 64 << 20
    np.save(tmp_path / "x.npy", np.arange(size // 4, dtype=np.float32))  # in the page cache now: reads are cheap
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")

    def peak_growth(read) -> tuple[int, float]:
        Path("/proc/self/clear_refs").write_text("5")
        start = _kb("VmRSS")
        total = read()
        return (_kb("VmHWM") - start) * 1024, total

    blocked, total_blocked = peak_growth(lambda: sum(float(x.sum(dtype=np.float64))
                                                     for (x,) in flat_blocks([mapped], block_bytes=4 << 20)))
    whole, total_whole = peak_growth(lambda: float(mapped.sum(dtype=np.float64)))
    assert total_blocked == total_whole
    assert whole >= 0.75 * size  # the measurement sees the mapped pages
    assert blocked <= 0.25 * size, f"{blocked / 1e6:.1f} MB resident for a {size / 1e6:.0f} MB map read in blocks"


def test_maps_that_can_be_written_and_plain_arrays_are_left_alone(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros(1 << 20, dtype=np.float32))
    private = np.load(tmp_path / "x.npy", mmap_mode="c")  # copy-on-write: dropping its pages would lose writes
    for (block,) in flat_blocks([private], block_bytes=4096):
        block += 1.0
    assert float(private.sum()) == float(1 << 20)
    shared = np.load(tmp_path / "x.npy", mmap_mode="r+")
    assert not release_mapped(shared[:1024]) and not release_mapped(np.ones(10))
    assert release_mapped(np.load(tmp_path / "x.npy", mmap_mode="r")[5:4000])
