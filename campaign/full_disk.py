"""A disk that fills up and empties again, for the disk-full campaign part.

Where the campaign runs as root and may mount a tmpfs, :class:`FullDisk` is a real small filesystem (a tmpfs of
``size_mib`` mounted on the folder) that :meth:`fill` fills to the last byte with a filler file and :meth:`free`
empties again: every write of every kind (SQLite, blobs, logs, ``open()``) then meets a real ENOSPC. Elsewhere
(not root, no mount permission: CI containers) it falls back to the injected full disk of
:func:`fedclinic.runtime.failpoints.disk_full`: the process started with :meth:`env` sees ENOSPC on every durable
write (blobs, spill files, atomically replaced files) while the flag file exists; SQLite and plain ``open()``
writes go through, so the injected mode covers less.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path


def can_mount() -> bool:
    """Can this process mount a tmpfs (root with CAP_SYS_ADMIN)?"""
    if os.geteuid() != 0:
        return False
    probe = Path(f"/tmp/.fedclinic-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        return ok
    finally:
        probe.rmdir()


class FullDisk:
    """The disk under ``folder`` (module docstring); ``real`` chooses a tmpfs (True) or the injected mode."""

    def __init__(self, folder: Path, *, real: bool, size_mib: int = 24) -> None:
        self.folder = folder
        self.real = real
        self.folder.mkdir(parents=True, exist_ok=True)
        self.flag = folder.with_name(folder.name + ".disk-full")
        self.filler = folder / ".filler"
        if real:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(folder)],
                           check=True, capture_output=True)

    def env(self) -> dict[str, str]:
        """What the process writing under the folder needs in its environment (the injected mode's flag)."""
        return {} if self.real else {"FEDCLINIC_DISK_FULL": str(self.flag)}

    def fill(self) -> None:
        """No byte left: the filler takes every free block (real), or the flag is up (injected)."""
        if not self.real:
            self.flag.touch()
            return
        chunk = b"\0" * (1 << 20)
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        os.write(fd, chunk[:size])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)

    def free_bytes(self) -> int:
        st = os.statvfs(self.folder)
        return st.f_bavail * st.f_frsize

    def free(self) -> None:
        """Space is back."""
        self.flag.unlink(missing_ok=True)
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        """Unmount the tmpfs (after every process writing there stopped)."""
        self.free()
        if self.real:
            subprocess.run(["umount", "-l", str(self.folder)], capture_output=True)
