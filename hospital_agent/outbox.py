"""The agent's outbox: an update is written to disk (durably) before it is sent, and removed only once
the aggregator has acknowledged it. After a crash or SIGTERM the agent resends what is still here with the
same idempotency key, so the aggregator stores it exactly once.

Layout: ``outbox/<task_id>.<round>/header.pb`` (a serialized ``UpdateHeader`` protobuf message: plain data,
never pickle) and ``tensors.bin`` (the tensors' bytes as sent, raw or encoded, back to back, in header order).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from fedclinic.runtime.array_blocks import flat_blocks
from fedclinic.runtime.blobstore import fsync_dir
from fedclinic.transport.package import raw_bytes
from fedclinic.proto import agent_pb2


@dataclass
class OutboxEntry:
    folder: Path
    header: agent_pb2.UpdateHeader

    @property
    def tensors_path(self) -> Path:
        return self.folder / "tensors.bin"


class Outbox:
    """``seal(header)``, when given, completes a header before it is written (the site's signed round statement,
    hospital_agent.uploader.StatementSeal): every resend of the entry then carries the same bytes."""

    def __init__(self, root: Path, seal: Callable[[agent_pb2.UpdateHeader], None] | None = None) -> None:
        self.root = root
        self.seal = seal
        self.root.mkdir(parents=True, exist_ok=True)
        for partial in self.root.glob("*.tmp"):
            shutil.rmtree(partial, ignore_errors=True)

    def put(self, header: agent_pb2.UpdateHeader, tensors: Mapping[str, np.ndarray | bytes]) -> OutboxEntry:
        """Persist an update (header tensors must be in the same order as ``tensors``): raw arrays, or the
        encoded payloads of an update codec (bytes, written as they will be sent). The header is sealed first."""
        if self.seal is not None:
            self.seal(header)
        final = self.root / f"{header.task_id}.{header.round}"
        tmp = self.root / f"{header.task_id}.{header.round}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        with open(tmp / "tensors.bin", "wb") as fh:
            for t in header.tensors:
                data = tensors[t.name]
                if isinstance(data, bytes):
                    fh.write(data)
                    continue
                for (block,) in flat_blocks([np.asarray(data)]):  # a spilled delta: one block's pages mapped at a time
                    fh.write(raw_bytes(block))
            fh.flush()
            os.fsync(fh.fileno())
        with open(tmp / "header.pb", "wb") as fh:
            fh.write(header.SerializeToString())
            fh.flush()
            os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(self.root)
        return OutboxEntry(final, header)

    def get(self, task_id: str, rnd: int) -> OutboxEntry | None:
        folder = self.root / f"{task_id}.{rnd}"
        if not (folder / "header.pb").is_file():
            return None
        return OutboxEntry(folder, agent_pb2.UpdateHeader.FromString((folder / "header.pb").read_bytes()))

    def entries(self) -> Iterator[OutboxEntry]:
        for folder in sorted(self.root.iterdir()):
            if folder.is_dir() and not folder.name.endswith(".tmp") and (folder / "header.pb").is_file():
                yield OutboxEntry(folder, agent_pb2.UpdateHeader.FromString((folder / "header.pb").read_bytes()))

    def count(self) -> int:
        """Updates waiting here for the aggregator's acknowledgement (without reading their headers)."""
        return sum(1 for folder in self.root.iterdir()
                   if not folder.name.endswith(".tmp") and (folder / "header.pb").is_file())

    def remove(self, entry: OutboxEntry) -> None:
        shutil.rmtree(entry.folder, ignore_errors=True)
