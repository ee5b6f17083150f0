"""DurableFile: exact bytes back for every length and write pattern, O_DIRECT or buffered, and clean failures."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from fedclinic.runtime import durable_file
from fedclinic.runtime.durable_file import ALIGN, DurableFile

SMALL_BUFFER = 4 * ALIGN  # several flushes even for small test files


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 5 * SMALL_BUFFER + 3), cuts=st.lists(st.integers(0, 10**6), max_size=8),
       direct=st.booleans())
def test_round_trip_any_length_and_split(tmp_path_factory, size, cuts, direct):
    folder = tmp_path_factory.mktemp("df")
    data = os.urandom(size)
    f = DurableFile(folder / "x", direct=direct, buffer_bytes=SMALL_BUFFER)
    for piece in _pieces(data, cuts):
        f.write(piece)
    assert f.close() == size
    assert (folder / "x").read_bytes() == data
    assert (folder / "x").stat().st_mode & 0o777 == 0o600


def test_direct_io_is_used_on_this_filesystem_when_supported(tmp_path):
    f = DurableFile(tmp_path / "x", buffer_bytes=SMALL_BUFFER)
    f.write(b"a" * (SMALL_BUFFER + 5))
    f.close()
    probe = _supports_direct(tmp_path)
    assert f.direct == probe
    assert (tmp_path / "x").read_bytes() == b"a" * (SMALL_BUFFER + 5)


def _supports_direct(folder: Path) -> bool:
    if not getattr(os, "O_DIRECT", 0):
        return False
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / "probe")
    return True


def test_operator_switch_turns_direct_io_off(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDCLINIC_DIRECT_IO", "0")
    f = DurableFile(tmp_path / "x")
    assert not f.direct
    f.write(b"hello")
    assert f.close() == 5
    assert (tmp_path / "x").read_bytes() == b"hello"


def test_refuses_to_overwrite_an_existing_file(tmp_path):
    (tmp_path / "x").write_bytes(b"kept")
    with pytest.raises(FileExistsError):
        DurableFile(tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == b"kept"


def test_discard_removes_the_file_and_writes_after_close_fail(tmp_path):
    f = DurableFile(tmp_path / "x", buffer_bytes=SMALL_BUFFER)
    f.write(os.urandom(SMALL_BUFFER * 2 + 1))
    f.discard()
    f.discard()  # idempotent
    assert not (tmp_path / "x").exists()
    g = DurableFile(tmp_path / "y")
    g.close()
    with pytest.raises(ValueError, match="already closed"):
        g.write(b"late")
    assert (tmp_path / "y").read_bytes() == b""


def test_bad_buffer_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="multiple of"):
        DurableFile(tmp_path / "x", buffer_bytes=ALIGN + 1)
    assert not (tmp_path / "x").exists()


def test_first_write_refused_by_the_filesystem_falls_back_to_buffered(tmp_path, monkeypatch):
    """Some filesystems accept O_DIRECT at open and refuse the write (EINVAL): the same bytes go buffered."""
    real_pwrite = os.pwrite
    refused = []

    def pwrite(fd, data, offset):
        if os.fstat(fd).st_ino == inode[0] and _has_direct(fd):
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    inode = [None]
    f = DurableFile(tmp_path / "x", direct=True, buffer_bytes=SMALL_BUFFER)
    if not f.direct:
        f.discard()
        pytest.skip("O_DIRECT is not available on this filesystem")
    inode[0] = os.fstat(f._fd).st_ino
    monkeypatch.setattr(durable_file.os, "pwrite", pwrite)
    data = os.urandom(SMALL_BUFFER * 3 + 77)
    f.write(data)
    assert f.close() == len(data)
    assert refused and not f.direct
    assert (tmp_path / "x").read_bytes() == data


@pytest.mark.parametrize("direct", [True, False])
def test_a_later_write_error_is_raised_and_the_file_removed(tmp_path, monkeypatch, direct):
    """A failed background (O_DIRECT) or inline (buffered) write surfaces on a later write, never silently."""
    real_pwrite, real_write = os.pwrite, os.write
    calls = [0]

    def failing(real):
        def call(fd, data, *offset):
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, data, *offset)
        return call

    f = DurableFile(tmp_path / "x", direct=direct, buffer_bytes=SMALL_BUFFER)
    monkeypatch.setattr(durable_file.os, "pwrite", failing(real_pwrite))
    monkeypatch.setattr(durable_file.os, "write", failing(real_write))
    if not direct:
        f.write(b"x")  # buffered files write through: the second call is the one that fails
    with pytest.raises(OSError, match="No space"):
        f.write(os.urandom(SMALL_BUFFER * 3))
    f.discard()
    assert not (tmp_path / "x").exists()


def _has_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.mark.parametrize("umask, mode", [(0o077, 0o644), (0o000, 0o600), (0o022, 0o600)])
def test_write_atomically_gives_exactly_the_mode_whatever_the_umask(tmp_path, umask, mode):
    """The file has ``mode`` (a umask can narrow the creation mode; it is widened back on the empty file,
    before any byte is written) and replaces an older file whole; no temporary file is left."""
    from fedclinic.runtime.durable_file import write_atomically

    path = tmp_path / "sub" / "file.txt"
    old = os.umask(umask)
    try:
        write_atomically(path, b"first")
        write_atomically(path, b"second version", mode=mode)
    finally:
        os.umask(old)
    assert path.read_bytes() == b"second version"
    assert path.stat().st_mode & 0o7777 == mode
    assert [p.name for p in path.parent.iterdir()] == ["file.txt"]


def test_write_atomically_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    from fedclinic.runtime.durable_file import write_atomically

    path = tmp_path / "file.txt"
    write_atomically(path, b"kept")

    def full_disk(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(durable_file, "_write_all", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, b"lost")
    assert path.read_bytes() == b"kept" and [p.name for p in tmp_path.iterdir()] == ["file.txt"]
