"""Checks of what the aggregator reads back from its own disk, and the two refusals they raise.

Nothing stored is trusted because it was verified when written: a blob or spill file can be edited, truncated
or deleted on disk afterwards. Before the aggregator aggregates from, publishes or streams stored bytes it
checks them against the sha256 recorded when they were written (:func:`verify_blob`, :func:`verify_spill`);
damage raises :class:`StoredCopyDamaged`, whose ``message`` is what callers and the task's failure reason say
("stored copy damaged: <what>, restore from backup") and whose ``path`` goes to the operator's log only (a
caller never sees a server path).

:class:`BlobNotAuthorised` is raised when a blob would be streamed through a task that does not reference it
(:meth:`aggregator_service.store.Store.task_blobs`): a hash is not a capability.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Collection

import numpy as np

from fedclinic.errors import IntegrityError
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.strategies.tensorsource import blocks

READ_BYTES = 1 << 20
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class StoredCopyDamaged(Exception):
    """Bytes the aggregator stored no longer match what it recorded. ``what`` names the damaged item for callers
    (tensor, model, site's update: never a path); ``path`` is the file, for the operator's log."""

    def __init__(self, what: str, path: Path | str | None = None) -> None:
        self.what = what
        self.path = str(path) if path is not None else ""
        super().__init__(self.message)

    @property
    def message(self) -> str:
        """The reason given to callers and recorded as the task's failure (docs/operator.md)."""
        return (f"stored copy damaged: {self.what}, restore from backup (the aggregator's state folder: "
                "`fedclinic-aggregator restore`; see docs/operator.md, 'Stored copy damaged')")


class BlobNotAuthorised(Exception):
    """A blob was to be streamed through a task that does not reference it (or through a manifest that names a
    tensor or file twice). Callers answer NOT_FOUND with the same message as for a model that does not exist."""


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks (FileNotFoundError when it is gone)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while data := fh.read(READ_BYTES):
            h.update(data)
    return h.hexdigest()


def verify_blob(blobs: BlobStore, sha256: str, what: str) -> None:
    """Check that the blob ``sha256`` is present and still hashes to its name; StoredCopyDamaged (``what`` names
    it for callers) otherwise."""
    path = blobs.path(sha256)
    try:
        actual = file_sha256(path)
    except FileNotFoundError:
        if sha256 == EMPTY_SHA256:
            return  # an empty tensor reads as zeros without its file
        raise StoredCopyDamaged(f"{what} is missing", path) from None
    if actual != sha256:
        raise StoredCopyDamaged(f"{what} does not match its recorded sha256", path)


def verify_model(blobs: BlobStore, manifest, model_hash: str, tensors: Collection[str] | None = None) -> None:
    """Check the tensor and file blobs of a stored model (a ``Manifest``) before they are read; StoredCopyDamaged
    naming the first damaged one. ``tensors``: check only the tensors of these names, and no file (what a round's
    aggregation reads; None: every tensor and file)."""
    for t in manifest.tensors:
        if tensors is None or t.name in tensors:
            verify_blob(blobs, t.sha256, f"tensor {t.name!r} of model {model_hash[:12]}")
    for f in manifest.files if tensors is None else ():
        verify_blob(blobs, f.sha256, f"file {f.path!r} of model {model_hash[:12]}")


def verify_spill(path: Path, sha256: str, tensors: dict, what: str) -> None:
    """Check an acknowledged update's spill file before it is folded again (recovery): it exists, hashes to the
    ``sha256`` recorded when the update was acknowledged (skipped when none was recorded: an older release),
    and every value of its ``tensors`` (name -> FileTensor/EncodedTensor, the update's layout) is finite.
    StoredCopyDamaged otherwise."""
    try:
        if sha256 and file_sha256(path) != sha256:
            raise StoredCopyDamaged(f"{what} does not match the sha256 recorded when it was acknowledged", path)
        scratch = np.empty(1 << 16, dtype=np.float32)
        for name, tensor in tensors.items():
            for _, block in blocks(tensor, scratch):
                if not np.isfinite(block).all():
                    raise StoredCopyDamaged(f"{what} holds non-finite values (tensor {name!r})", path)
    except FileNotFoundError:
        raise StoredCopyDamaged(f"{what} is missing", path) from None
    except (EOFError, ValueError, IntegrityError) as exc:
        raise StoredCopyDamaged(f"{what} is truncated or unreadable ({type(exc).__name__})", path) from None
