"""Resumable uploads: the verified prefix of an interrupted ``SubmitUpdate``, kept on disk until it resumes.

An update whose header names an ``upload_id`` and whose stream breaks (a reset, a dead connection) leaves the
bytes the assembler had accepted: the spill file is closed (fsync'd) and kept here with its header, as
``<spill root>/<task>/<round>/partial/<site digest>/<upload digest>.bin`` and ``.hdr``. ``QueryUpload``
answers its size (:meth:`UploadPartials.held`); a resumed stream (``resume_offset`` > 0, the same header)
takes it (:meth:`UploadPartials.take`) and the prefix is replayed from disk through the same checks as the
network bytes (:func:`replay`), so the whole update is still verified: every tensor's sha256, sizes, finite
values, the commit's count.

Limits (every resource a peer can hold has one): at most :attr:`PartialLimits.per_site` prefixes and
:attr:`PartialLimits.per_site_bytes` bytes per site (the oldest go first), each dropped
:attr:`PartialLimits.expire_s` after its last byte. They live in the round's spill folder, so a closed round,
an ended task and a restart (recovery deletes every unreferenced spill file) clean them with the spill files.
"""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc
import structlog

from fedclinic.errors import Refused
from fedclinic.proto import agent_pb2, tensors_pb2
from fedclinic.transport.wire import CHUNK_BYTES

log = structlog.get_logger("fedclinic.aggregator.uploads")


@dataclass(frozen=True)
class PartialLimits:
    """Bounds on what interrupted uploads may keep at the aggregator (defaults in SECURITY.md)."""

    per_site: int = 4
    per_site_bytes: int = 8 << 30
    expire_s: float = 3600.0


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def header_bytes(h: agent_pb2.UpdateHeader) -> bytes:
    """The header as it must be repeated by a resumed stream (its resume_offset aside), serialized canonically."""
    same = agent_pb2.UpdateHeader()
    same.CopyFrom(h)
    same.resume_offset = 0
    return same.SerializeToString(deterministic=True)


class UploadPartials:
    """The kept prefixes of interrupted resumable uploads (module docstring). ``is_open(task_id, round)`` tells
    whether a round still takes updates (a prefix of a closed round is neither kept nor resumed)."""

    def __init__(self, spill_root: Path, is_open: Callable[[str, int], bool],
                 limits: PartialLimits = PartialLimits(), clock: Callable[[], float] = time.time) -> None:
        self.spill_root = spill_root
        self.is_open = is_open
        self.limits = limits
        self.clock = clock
        self._lock = threading.Lock()

    def _path(self, site: str, task_id: str, rnd: int, upload_id: str) -> Path:
        return self.spill_root / task_id / str(rnd) / "partial" / _digest(site) / f"{_digest(task_id, upload_id)}.bin"

    def _site_files(self, site: str) -> list[Path]:
        return sorted(self.spill_root.glob(f"*/*/partial/{_digest(site)}/*.bin"), key=lambda p: p.stat().st_mtime)

    def _find(self, site: str, task_id: str, upload_id: str) -> Path | None:
        name = f"{_digest(task_id, upload_id)}.bin"
        return next((p for p in self._site_files(site) if p.name == name), None)

    @staticmethod
    def _drop(path: Path) -> None:
        path.unlink(missing_ok=True)
        path.with_suffix(".hdr").unlink(missing_ok=True)

    def _expired(self, path: Path) -> bool:
        return self.clock() - path.stat().st_mtime > self.limits.expire_s

    def held(self, site: str, task_id: str, upload_id: str) -> tuple[int, int]:
        """(verified bytes, expiry in unix ms) of ``site``'s upload ``upload_id`` of ``task_id``; (0, 0) if none."""
        with self._lock:
            path = self._find(site, task_id, upload_id)
            if path is None or self._expired(path):
                return 0, 0
            st = path.stat()
            return st.st_size, int((st.st_mtime + self.limits.expire_s) * 1000)

    def take(self, site: str, h: agent_pb2.UpdateHeader) -> Path | None:
        """Claim the prefix a stream with header ``h`` resumes from: None when ``h.resume_offset`` is 0 (a held
        prefix of the same upload is dropped: the agent starts over); otherwise the prefix file, renamed so no
        other stream can take it (the caller deletes it). FAILED_PRECONDITION when nothing is held for the
        upload, when it began with another header, or when ``resume_offset`` is beyond what is held."""
        with self._lock:
            path = self._find(site, h.task_id, h.upload_id)
            if path is not None and self._expired(path):
                self._drop(path)
                path = None
            if not h.resume_offset:
                if path is not None:
                    self._drop(path)
                return None
            held = path.stat().st_size if path is not None else 0
            if path is None or h.resume_offset > held:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"upload {h.upload_id[:64]!r} cannot resume at byte {h.resume_offset}: the aggregator "
                              f"holds {held} verified bytes of it; ask QueryUpload and resume from there, or send the "
                              "update from its first byte (resume_offset 0)")
            if path.with_suffix(".hdr").read_bytes() != base64.b64encode(header_bytes(h)):
                self._drop(path)
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"upload {h.upload_id[:64]!r} began with another header; its kept bytes were dropped: "
                              "send the update from its first byte (resume_offset 0)")
            claimed = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}.taken")
            os.replace(path, claimed)
            path.with_suffix(".hdr").unlink(missing_ok=True)
            return claimed

    def keep(self, site: str, h: agent_pb2.UpdateHeader, prefix: Path) -> int:
        """Keep ``prefix`` (a closed, fsync'd file: the first bytes of the update ``h``) for a resumed stream,
        within the site's limits; returns the bytes kept (0 when it was not kept and was deleted: an empty
        prefix, a closed round, or a prefix larger than the site's whole allowance)."""
        size = prefix.stat().st_size
        if not h.upload_id or size == 0 or size > self.limits.per_site_bytes or not self.is_open(h.task_id, h.round):
            prefix.unlink(missing_ok=True)
            return 0
        with self._lock:
            dest = self._path(site, h.task_id, h.round, h.upload_id)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.with_suffix(".hdr").write_bytes(base64.b64encode(header_bytes(h)))
            os.replace(prefix, dest)
            self._evict(site, keep=dest)
        log.info("interrupted upload kept for resumption", site=site, task_id=h.task_id, round=h.round, nbytes=size)
        return size

    def _evict(self, site: str, keep: Path) -> None:
        """Drop the site's expired prefixes, then its oldest until it is within its count and byte limits."""
        files = []
        for p in self._site_files(site):
            if p != keep and self._expired(p):
                self._drop(p)
            else:
                files.append(p)
        total = sum(p.stat().st_size for p in files)
        for p in [f for f in files if f != keep]:
            if len(files) <= self.limits.per_site and total <= self.limits.per_site_bytes:
                break
            total -= p.stat().st_size
            files.remove(p)
            self._drop(p)
            log.info("kept upload prefix dropped (site over its limit)", site=site)

    def query(self, site: str, request: agent_pb2.QueryUploadRequest) -> agent_pb2.QueryUploadResponse:
        """The answer to ``QueryUpload`` (INVALID_ARGUMENT for an upload id that is empty or over 255 characters)."""
        if not request.upload_id or len(request.upload_id) > 255:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "upload_id must be 1-255 characters")
        nbytes, expires = self.held(site, request.task_id, request.upload_id)
        return agent_pb2.QueryUploadResponse(verified_nbytes=nbytes, expires_unix_ms=expires)


def replay(prefix: Path, h: agent_pb2.UpdateHeader, nbytes: int) -> Iterator[agent_pb2.UpdateChunk]:
    """The first ``nbytes`` of a kept prefix as the tensor chunks that carried them (tensors back to back in
    ``h.tensors`` order, the first chunk of each with its header): fed to the same assembler as the network's."""
    with open(prefix, "rb") as fh:
        left = nbytes
        for t in h.tensors:
            if left <= 0:
                return
            if t.encoded_nbytes == 0:
                yield agent_pb2.UpdateChunk(tensor=tensors_pb2.TensorChunk(name=t.name, header=t, offset=0))
                continue
            offset = 0
            while left > 0 and offset < t.encoded_nbytes:
                data = fh.read(min(CHUNK_BYTES, int(t.encoded_nbytes) - offset, left))
                if not data:
                    return  # a short file: the assembler reports the tensor incomplete
                yield agent_pb2.UpdateChunk(tensor=tensors_pb2.TensorChunk(
                    name=t.name, header=t if offset == 0 else None, offset=offset, data=data))
                offset += len(data)
                left -= len(data)
