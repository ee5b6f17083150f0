"""Per-peer limits without a server: the slot accounting of PeerLimits, the field table, a model's files."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from fedclinic.errors import IntegrityError, Refused
from fedclinic.proto import agent_pb2, control_pb2, tensors_pb2
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.transport.package import FileEntry

from aggregator_service.declared_files import DeclaredFiles
from aggregator_service.field_limits import FieldLimits
from aggregator_service.limits import Limits
from aggregator_service.peer_limits import DOWNLOAD, UNARY, UPLOAD, PeerLimits


def test_slots_per_peer_and_class_and_the_long_lived_cap():
    counted = []
    limits = PeerLimits(Limits(uploads_per_peer=2, unary_per_peer=1, unary_reserve=4), max_workers=8,
                        count=counted.append)
    assert limits.long_lived_cap == 4
    limits.acquire("agent a", UPLOAD)
    limits.acquire("agent a", UPLOAD)
    with pytest.raises(Refused, match="at most 2 concurrent uploads per certificate") as exc:
        limits.acquire("agent a", UPLOAD)
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    limits.acquire("agent b", UPLOAD)  # another certificate has its own slots
    limits.acquire("agent a", DOWNLOAD)  # and another class
    with pytest.raises(Refused, match="maximum of 4 streams"):  # all peers' long-lived calls: 4 of 8 threads
        limits.acquire("agent c", DOWNLOAD)
    limits.acquire("agent c", UNARY)  # unary calls are not long-lived: the reserve is theirs
    limits.release("agent a", UPLOAD)
    limits.acquire("agent c", DOWNLOAD)
    assert limits.held("agent a", UPLOAD) == 1 and counted == ["concurrency", "long_lived"]


def test_free_text_is_truncated_and_exact_fields_are_refused():
    fields = FieldLimits(Limits(reason_chars=100))
    m = agent_pb2.DeclineRequest(task_id="t-1", reason="r" * 5000)
    fields.apply(m)
    assert m.reason.startswith("r" * 100) and m.reason.endswith("truncated by the aggregator: 5000 characters]")
    for message, says in [
        (agent_pb2.UpdateHeader(task_id="t" * 65), "UpdateHeader.task_id has 65 characters; at most 64"),
        (agent_pb2.UpdateHeader(metrics={f"m{i}": 0.0 for i in range(257)}), "UpdateHeader.metrics has 257 entries"),
        (agent_pb2.UpdateChunk(header=agent_pb2.UpdateHeader(metrics={"k" * 5000: 1.0})), "UpdateHeader.metrics key"),
        (agent_pb2.SecAggPhase(advertise_keys=agent_pb2.SecAggPublicKeys(mask_public_key=bytes(65))),
         "SecAggPublicKeys.mask_public_key has 65 bytes"),
        (control_pb2.SubmitTaskChunk(header=control_pb2.SubmitTaskHeader(idempotency_key="k" * 5000)),
         "SubmitTaskHeader.idempotency_key has 5000 characters; at most 4096"),
    ]:
        with pytest.raises(Refused, match=says) as exc:
            fields.apply(message)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    fields.apply(agent_pb2.UpdateChunk(tensor=tensors_pb2.TensorChunk(name="w", data=bytes(4 << 20))))  # chunk data


def test_a_nul_character_is_refused_in_exact_fields_and_replaced_in_free_text():
    """PostgreSQL's text type cannot hold U+0000 (SQLite's can): a task id with one was NOT_FOUND on SQLite and an
    INTERNAL error on PostgreSQL; every string field now answers the same on both."""
    fields = FieldLimits(Limits(reason_chars=100))
    for message, says in [
        (control_pb2.GetTaskRequest(task_id="t-1\x00"), "GetTaskRequest.task_id contains a NUL character"),
        (control_pb2.SubmitTaskChunk(header=control_pb2.SubmitTaskHeader(idempotency_key="\x00k")),
         "SubmitTaskHeader.idempotency_key contains a NUL character .U.0000. at position 0"),
        (agent_pb2.UpdateHeader(metrics={"lo\x00ss": 1.0}), "UpdateHeader.metrics key contains a NUL"),
    ]:
        with pytest.raises(Refused, match=says) as exc:
            fields.apply(message)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    m = control_pb2.CancelTaskRequest(task_id="t-1", reason="stop\x00now")
    fields.apply(m)
    assert m.reason == "stop\ufffdnow"
    m = agent_pb2.DeclineRequest(task_id="t-1", reason="\x00" * 300)
    fields.apply(m)
    assert m.reason == "\ufffd" * 100 + " [... truncated by the aggregator: 300 characters]"


def test_a_models_files_are_streamed_and_only_declared_ones_taken(tmp_path):
    blobs = BlobStore(tmp_path / "blobs")
    data = b"vocab " * 1000
    entry = FileEntry("vocab.txt", hashlib.sha256(data).hexdigest(), len(data))
    with pytest.raises(IntegrityError, match="at most 1 "):
        DeclaredFiles(blobs, (entry, FileEntry("b", entry.sha256, 1)), max_files=1, max_total_bytes=1 << 20)
    with pytest.raises(IntegrityError, match="at most 100 in all"):
        DeclaredFiles(blobs, (entry,), max_files=5, max_total_bytes=100)
    files = DeclaredFiles(blobs, (entry,), max_files=5, max_total_bytes=1 << 20)
    with pytest.raises(IntegrityError, match="'other' is not in the manifest"):
        files.add(tensors_pb2.FileChunk(path="other", offset=0, data=b"x", total_nbytes=1, sha256=entry.sha256))
    files.add(tensors_pb2.FileChunk(path="vocab.txt", offset=0, data=data[:4000], total_nbytes=len(data),
                                    sha256=entry.sha256))
    with pytest.raises(IntegrityError, match="stream ended inside"):
        files.finish()
    files.add(tensors_pb2.FileChunk(path="vocab.txt", offset=4000, data=data[4000:]))
    files.finish()
    assert blobs.read(entry.sha256) == data and files.nbytes == len(data)
    bad = DeclaredFiles(blobs, (FileEntry("x", "0" * 64, 3),), max_files=5, max_total_bytes=1 << 20)
    with pytest.raises(IntegrityError, match="file 'x'"):
        bad.add(tensors_pb2.FileChunk(path="x", offset=0, data=b"abc", total_nbytes=3, sha256="0" * 64))
    assert not blobs.has("0" * 64)
    with pytest.raises(IntegrityError, match=r"file\(s\) \['vocab.txt'\] of the manifest were not sent"):
        DeclaredFiles(blobs, (entry,), max_files=5, max_total_bytes=1 << 20).finish()
