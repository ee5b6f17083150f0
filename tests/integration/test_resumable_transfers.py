"""Resumable transfers (issue 16, network faults): a model fetch or an update upload cut mid-stream by a reset
continues from the last verified chunk instead of from its first byte, and ends bit-identical.

Real aggregator and agent processes; the agent dials the aggregator through :class:`campaign.fault_proxy.FaultProxy`,
which resets the connection once it carried N more bytes in one direction. What the proxy forwarded is the
proof: the receiver kept a verified prefix (> 0 bytes, at most the cut point: the agent's or the aggregator's
log says how much), the connections after the cut carry less than the rest of the transfer after that prefix
plus framing slack, and all connections together less than twice its size. A resume that does not fit what the aggregator holds
(a wrong offset, a chunk that does not match) is refused with a status that says to start again from byte 0.
"""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until
from fedclinic.proto import agent_pb2, agent_pb2_grpc, task_pb2, tensors_pb2
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.transport.package import raw_bytes
from fedclinic.transport.rpc import TlsFiles, secure_channel
from fedclinic.transport.wire import CHUNK_BYTES, tensor_chunks

from campaign.fault_proxy import FaultProxy
from tests.helpers.federation import watch_assignments
from tests.helpers.tasks import make_task
from tests.helpers.text_models import wide_package

pytestmark = pytest.mark.integration

SLACK = CHUNK_BYTES // 2  # headers, heartbeats, TLS records and gRPC framing of the resumed stream
LINK = 4e6  # bytes/s: the pace of the link while a cut is armed (the receiver takes in each chunk as it comes)


def _task(**kw):
    return make_task(architecture="lstm", num_rounds=1, min_sites=1, local_epochs=1, round_timeout_s=240, **kw)


def _audit(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _log_events(fed, name: str, event: str) -> list[dict]:
    return [json.loads(line) for line in fed.log_text(name).splitlines() if f'"event": "{event}"' in line]


def _after_cut(proxy: FaultProxy, direction: str) -> int:
    """Bytes forwarded in ``direction`` by the connections opened after the first reset one."""
    cut = next(c for c in proxy.connections if c.reset)
    return sum(c.bytes(direction) for c in proxy.connections if c.number > cut.number)


def test_a_model_fetch_cut_mid_stream_resumes_from_the_last_verified_chunk(federation_factory):
    package = wide_package()
    size = sum(t.nbytes for t in package.manifest().tensors) + sum(len(d) for d in package.files.values())
    cut_at = 2 * CHUNK_BYTES + 12345  # inside the embedding (the files and two small tensors come first)
    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.start_aggregator()
    with FaultProxy(fed.address) as proxy:
        proxy.reset_after(cut_at, "down", bytes_per_s=LINK)
        fed.start_agent("site-a", address=proxy.address)
        with fed.client() as client:
            st = client.submit(_task(), package=package)
            final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        assert proxy.resets == 1
        down = proxy.forwarded("down")
        assert down < 2 * size, f"{down} bytes forwarded for a {size}-byte model: it was fetched again in full"
        resumed = _log_events(fed, "agent-site-a", "model stream cut; resuming from the last verified chunk")
        assert len(resumed) == 1 and resumed[0]["offset"] > 0  # inside the tensor cut, not from its first byte
        manifest = package.manifest()
        names = [t.name for t in manifest.tensors]
        kept = (sum(len(d) for d in package.files.values()) + resumed[0]["offset"]
                + sum(t.nbytes for t in manifest.tensors[:names.index(resumed[0]["tensor"])]))
        assert 0 < kept <= cut_at
        assert _after_cut(proxy, "down") < size - kept + SLACK, "the resumed fetch sent again what was verified"
    fetched = [e for e in _audit(fed.root / "agent-site-a" / "audit.jsonl") if e["kind"] == "model.fetched"]
    assert fetched and fetched[0]["details"]["resumed"] >= 1
    cache = BlobStore(fed.root / "agent-site-a" / "cache")
    for name, array in package.tensors.items():  # bit-identical to what was submitted
        entry = package.manifest().tensor(name)
        assert hashlib.sha256(cache.read(entry.sha256)).hexdigest() == entry.sha256
        assert cache.read(entry.sha256) == raw_bytes(array)


def test_a_scientist_s_download_cut_mid_stream_resumes_and_is_bit_identical(federation_factory):
    package = wide_package()
    size = sum(t.nbytes for t in package.manifest().tensors) + sum(len(d) for d in package.files.values())
    cut_at = 2 * CHUNK_BYTES + 777
    fed = federation_factory(1)
    with fed.client() as client:
        st = client.submit(_task(), package=package)
        final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        direct = client.fetch_package(st.task_id)
    with FaultProxy(fed.address) as proxy, fed.client(proxy.address) as client:
        proxy.reset_after(cut_at, "down", bytes_per_s=LINK)
        got = client.fetch_package(st.task_id)
        assert proxy.resets == 1
        assert proxy.forwarded("down") < 2 * size
        assert _after_cut(proxy, "down") < size - CHUNK_BYTES, "the download started over after the cut"
    assert got.manifest().model_hash == direct.manifest().model_hash  # bit-identical: every tensor and file hash
    assert all(raw_bytes(got.tensors[n]) == raw_bytes(a) for n, a in direct.tensors.items())


def test_an_upload_cut_mid_stream_resumes_from_what_the_aggregator_holds(federation_factory):
    package = wide_package()
    update_size = sum(t.nbytes for t in package.manifest().tensors)  # raw float32 deltas of every tensor
    cut_at = 2 * CHUNK_BYTES + 54321
    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.start_aggregator()
    with FaultProxy(fed.address) as proxy:
        fed.start_agent("site-a", address=proxy.address)
        with fed.client() as client:
            wait_until(lambda: "connected" in fed.log_text("agent-site-a"), 60, "the agent to connect")
            # a hospital link's pace lets the aggregator
            # take in each chunk as it arrives (on bare loopback it would still be in gRPC's buffers at the cut)
            proxy.reset_after(cut_at, "up", bytes_per_s=LINK)
            st = client.submit(_task(), package=package)
            final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        assert [r.site_id for r in final.rounds[0].reports] == ["site-a"]
        assert proxy.resets == 1
        up = proxy.forwarded("up")
        assert up < 2 * update_size, f"{up} bytes sent up for a {update_size}-byte update: it was sent again in full"
        kept = _log_events(fed, "aggregator", "interrupted upload kept for resumption")
        assert len(kept) == 1 and 0 < kept[0]["nbytes"] <= cut_at
        resumed = _log_events(fed, "agent-site-a", "upload cut; resuming from the bytes the aggregator holds")
        assert [r["offset"] for r in resumed] == [kept[0]["nbytes"]]
        assert _after_cut(proxy, "up") < update_size - kept[0]["nbytes"] + SLACK, "the resumed upload sent again what " \
                                                                                 "the aggregator held"
    def sent() -> list[dict]:
        return [e for e in _audit(fed.root / "agent-site-a" / "audit.jsonl") if e["kind"] == "update.sent"]

    wait_until(sent, 60, "the agent's record of its acknowledged upload")
    sent = sent()
    received = [e for e in _audit(fed.root / "aggregator-state" / "audit.jsonl") if e["kind"] == "update.received"]
    assert len(sent) == 1 and len(received) == 1  # acknowledged once, counted once
    assert received[0]["details"]["sha256"] == sent[0]["details"]["sha256"]  # every tensor's hash, verified
    assert received[0]["details"]["size"] == update_size


def _agent_stub(fed, site: str, address: str):
    c = fed.creds(site)
    channel = secure_channel(address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")
    return channel, agent_pb2_grpc.AgentServiceStub(channel)


def _update(a: agent_pb2.Assignment, upload_id: str, fill: float) -> tuple[agent_pb2.UpdateHeader, list]:
    """A well-formed update of the assignment's tensors (every value ``fill``) and its tensor chunk messages."""
    import numpy as np

    h = agent_pb2.UpdateHeader(task_id=a.task_id, round=a.round, attempt=a.attempt, idempotency_key=upload_id,
                               upload_id=upload_id, base_model_hash=a.model.model_hash, num_samples=3,
                               kind=task_pb2.UPDATE_KIND_DELTA)
    chunks = []
    for t in a.model.tensors:
        if t.name not in a.send_tensors:
            continue
        data = raw_bytes(np.full(tuple(t.shape), fill, dtype=np.float32))
        header = tensors_pb2.TensorHeader(name=t.name, dtype="float32", shape=list(t.shape), codec="raw",
                                          sha256=hashlib.sha256(data).hexdigest(), encoded_nbytes=len(data))
        h.tensors.append(header)
        chunks += [agent_pb2.UpdateChunk(tensor=c) for c in tensor_chunks(header, data)]
    return h, chunks


def _stream(h, chunks, start: int):
    """Header, the chunks from byte ``start`` of the update on (re-cut at that byte), commit."""
    yield agent_pb2.UpdateChunk(header=h)
    pos = 0
    for m in chunks:
        c = m.tensor
        end = pos + len(c.data)
        if end > start:
            skip = max(0, start - pos)
            yield agent_pb2.UpdateChunk(tensor=tensors_pb2.TensorChunk(
                name=c.name, header=c.header if c.offset + skip == 0 else None, offset=c.offset + skip,
                data=c.data[skip:]))
        pos = end
    yield agent_pb2.UpdateChunk(commit=agent_pb2.UpdateCommit(total_encoded_nbytes=sum(
        t.encoded_nbytes for t in h.tensors)))


def test_a_resume_that_does_not_fit_what_the_aggregator_holds_is_refused_with_a_clear_status(federation_factory):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.start_aggregator()
    with FaultProxy(fed.address) as proxy:
        channel, stub = _agent_stub(fed, "site-a", proxy.address)
        work, watch = watch_assignments(stub)
        try:
            with fed.client() as client:
                client.submit(_task(), package=wide_package())
            a = work.get(timeout=120)
            h, chunks = _update(a, "upload-1", 0.001)
            proxy.reset_after(3 * CHUNK_BYTES, "up", bytes_per_s=LINK)
            with pytest.raises(grpc.RpcError):
                stub.SubmitUpdate(_stream(h, chunks, 0), timeout=120)
            channel.close()
            channel, stub = _agent_stub(fed, "site-a", fed.address)  # no more faults: straight to the aggregator
            query = agent_pb2.QueryUploadRequest(task_id=a.task_id, upload_id="upload-1")
            wait_until(lambda: stub.QueryUpload(query, timeout=30).verified_nbytes > 0, 60, "the kept prefix")
            held = stub.QueryUpload(query, timeout=30).verified_nbytes
            assert 0 < held <= 3 * CHUNK_BYTES

            h.resume_offset = held + 4  # beyond what the aggregator holds
            with pytest.raises(grpc.RpcError) as wrong:
                stub.SubmitUpdate(_stream(h, chunks, held + 4), timeout=120)
            assert wrong.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"holds {held} verified bytes" in wrong.value.details()
            assert "resume_offset 0" in wrong.value.details()

            other, other_chunks = _update(a, "upload-1", 0.002)  # same header fields, other bytes: hashes differ
            with pytest.raises(grpc.RpcError) as mismatch:
                h.resume_offset = held
                stub.SubmitUpdate(_stream(h, other_chunks, held), timeout=120)
            assert mismatch.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sha256" in mismatch.value.details() and "from its first byte" in mismatch.value.details()
            assert stub.QueryUpload(query, timeout=30).verified_nbytes == 0  # the kept bytes were dropped

            for tensor, offset, why in (("embedding.weight", 1000, "not a chunk boundary"),
                                        ("embedding.weight", 64 * CHUNK_BYTES, "not a chunk boundary"),
                                        ("no.such.tensor", 0, "not a tensor this stream sends"),
                                        ("", CHUNK_BYTES, "without resume_tensor")):
                with pytest.raises(grpc.RpcError) as bad_fetch:  # a model fetch resumed where no chunk starts
                    list(stub.FetchModel(agent_pb2.FetchModelRequest(
                        task_id=a.task_id, model_hash=a.model.model_hash, resume_tensor=tensor, resume_offset=offset),
                        timeout=60))
                assert bad_fetch.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert why in bad_fetch.value.details() and "cannot resume" in bad_fetch.value.details()

            h.resume_offset = 0
            receipt = stub.SubmitUpdate(_stream(h, chunks, 0), timeout=120)  # from byte 0: accepted, once
            assert not receipt.duplicate and receipt.stored_nbytes == sum(t.encoded_nbytes for t in h.tensors)
            assert stub.SubmitUpdate(_stream(h, chunks, 0), timeout=120).duplicate
        finally:
            watch.cancel()
            channel.close()


def test_an_agent_stopped_mid_upload_keeps_its_update_and_does_not_decline(federation_factory):
    """SIGTERM while an update crawls up a slow link: the upload is interrupted (the update stays in the outbox),
    the site does not decline the task, and once restarted it sends the update and the task completes."""
    import signal

    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.start_aggregator()
    with FaultProxy(fed.address) as proxy:
        fed.start_agent("site-a", address=proxy.address)
        with fed.client() as client:
            st = client.submit(_task(), package=wide_package())
            wait_until(lambda: "update ready" in fed.log_text("agent-site-a"), 120, "the update to be written")
            proxy.set_bandwidth(200e3)  # ~40 s for the update: the agent is stopped while it is on the way
            wait_until(lambda: proxy.forwarded("up") > 1 << 20, 60, "the upload to be under way")
            assert fed.signal_agent("site-a", signal.SIGTERM) == 0
            assert "assignment failed unexpectedly" not in fed.log_text("agent-site-a")
            status = client.status(st.task_id)
            assert not status.rounds[0].declined, status.rounds[0].declined
            proxy.set_pass()
            fed.start_agent("site-a", address=proxy.address)
            final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    assert [r.site_id for r in final.rounds[0].reports] == ["site-a"]
