"""Bad updates are refused with a clear status; nothing stored is corrupted; the round completes anyway."""

from __future__ import annotations

import hashlib
import queue
import threading

import grpc
import numpy as np
import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until
from fedclinic.proto import agent_pb2, agent_pb2_grpc, task_pb2, tensors_pb2
from fedclinic.transport.rpc import TlsFiles, secure_channel

from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


def _stream(a: agent_pb2.Assignment, arrays: dict[str, np.ndarray], *, key: str, task_id=None, rnd=None,
            corrupt=False, shape=None):
    header = agent_pb2.UpdateHeader(task_id=task_id or a.task_id, round=rnd or a.round, attempt=a.attempt,
                                    idempotency_key=key, base_model_hash=a.model.model_hash,
                                    kind=task_pb2.UPDATE_KIND_DELTA, num_samples=10)
    for name, arr in arrays.items():
        header.tensors.append(tensors_pb2.TensorHeader(
            name=name, dtype="float32", shape=list(shape or arr.shape), codec="raw",
            sha256=hashlib.sha256(arr.tobytes()).hexdigest(), encoded_nbytes=arr.nbytes))
    yield agent_pb2.UpdateChunk(header=header)
    for h, arr in zip(header.tensors, arrays.values()):
        data = bytearray(arr.tobytes())
        if corrupt:
            data[0] ^= 0xFF
        yield agent_pb2.UpdateChunk(tensor=tensors_pb2.TensorChunk(name=h.name, header=h, offset=0, data=bytes(data)))
    yield agent_pb2.UpdateChunk(commit=agent_pb2.UpdateCommit(total_encoded_nbytes=sum(a.nbytes for a in arrays.values())))


def test_bad_updates_are_refused_and_the_round_completes(federation_factory):
    from tests.helpers.prometheus import scrape, value

    fed = federation_factory(3, start=False, metrics_address="127.0.0.1:0")
    fed.make_pki()
    fed.start_aggregator()
    c = fed.creds("site-c")
    channel = secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")
    rogue = agent_pb2_grpc.AgentServiceStub(channel)
    work: queue.Queue = queue.Queue()
    watch = rogue.WatchWork(agent_pb2.WatchWorkRequest(protocol_version=1))

    def collect() -> None:
        try:
            for item in watch:
                if item.WhichOneof("item") == "assignment":
                    work.put(item)
        except grpc.RpcError:  # cancelled at the end of the test
            pass

    threading.Thread(target=collect, daemon=True).start()
    try:
        with fed.client() as client:
            st = client.submit(make_task(num_rounds=2, min_sites=2, round_timeout_s=300), package=tiny_package())
            a = work.get(timeout=60).assignment
            fed.start_agent("site-a")
            fed.start_agent("site-b")
            good = {n: np.zeros([int(s) for s in t.shape], np.float32)
                    for n in a.send_tensors for t in a.model.tensors if t.name == n}
            nan = {n: np.full_like(v, np.nan) for n, v in good.items()}

            def refused(stream):
                with pytest.raises(grpc.RpcError) as exc:
                    rogue.SubmitUpdate(stream, timeout=30)
                return exc.value

            e = refused(_stream(a, good, key="k1", corrupt=True))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "corrupted in transit" in e.details()
            e = refused(_stream(a, good, key="k2", shape=[7, 7]))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape" in e.details()
            e = refused(_stream(a, nan, key="k3"))
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in e.details()
            e = refused(_stream(a, good, key="k4", task_id="t-doesnotexist"))
            assert e.code() == grpc.StatusCode.NOT_FOUND and "no task" in e.details()
            rogue.Decline(agent_pb2.DeclineRequest(task_id=a.task_id, round=a.round, reason="testing refusals"),
                          timeout=30)
            wait_until(lambda: client.status(st.task_id).current_round >= 2, 120, "round 1 to close")
            e = refused(_stream(a, good, key="k5"))
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "closed" in e.details()
            a2 = work.get(timeout=60).assignment
            rogue.Decline(agent_pb2.DeclineRequest(task_id=a2.task_id, round=a2.round, reason="leaving",
                                                   permanent=True), timeout=30)
            final = client.wait(st.task_id, timeout=300, progress=False)
    finally:
        watch.cancel()
        channel.close()
    assert state_name(final.state) == "completed", final.error
    assert [sorted(r.site_id for r in rnd.reports) for rnd in final.rounds] == [["site-a", "site-b"]] * 2
    assert any("testing refusals" in d for d in final.rounds[0].declined)
    state = fed.root / "aggregator-state"
    for blob in (state / "blobs").glob("??/*"):  # every stored blob is intact
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.parent.name + blob.name
    assert not [p for p in (state / "updates").rglob("*") if p.is_file()]  # no spill left behind
    samples = scrape(fed.metrics_url())  # each refusal counted by its status code; no label from a bad task id
    refused = {dict(labels)["reason"]: v for (name, labels), v in samples.items()
               if name == "fedclinic_aggregator_updates_refused_total"}
    assert refused == {"invalid_argument": 3, "not_found": 1, "failed_precondition": 1}
    # the two refused rounds, and each site that declined the final evaluation (these sites hold no held-out rows)
    assert all("held-out" in d or "eval" in d for d in final.results.declined), list(final.results.declined)
    declines = 2 + len(final.results.declined)
    assert value(samples, "fedclinic_aggregator_site_declines_total", task_id=st.task_id) == declines
    assert not [k for k in samples if ("task_id", "t-doesnotexist") in k[1]]


def _encoded_stream(a: agent_pb2.Assignment, payloads: dict[str, tuple[bytes, dict]], *, key: str, codec: str):
    """An update whose tensors carry ``(payload, codec_params)`` under ``codec``, sha256 and sizes consistent, so
    only the codec checks can refuse it."""
    header = agent_pb2.UpdateHeader(task_id=a.task_id, round=a.round, attempt=a.attempt, idempotency_key=key,
                                    base_model_hash=a.model.model_hash, kind=task_pb2.UPDATE_KIND_DELTA, num_samples=10)
    shapes = {t.name: list(t.shape) for t in a.model.tensors}
    for name, (payload, params) in payloads.items():
        header.tensors.append(tensors_pb2.TensorHeader(
            name=name, dtype="float32", shape=shapes[name], codec=codec, sha256=hashlib.sha256(payload).hexdigest(),
            encoded_nbytes=len(payload), codec_params=params))
    yield agent_pb2.UpdateChunk(header=header)
    for h, (payload, _) in zip(header.tensors, payloads.values()):
        yield agent_pb2.UpdateChunk(tensor=tensors_pb2.TensorChunk(name=h.name, header=h, offset=0, data=payload))
    yield agent_pb2.UpdateChunk(commit=agent_pb2.UpdateCommit(total_encoded_nbytes=sum(len(p) for p, _ in payloads.values())))


def test_malformed_encoded_updates_are_refused_and_nothing_is_stored(federation_factory):
    from fedclinic.transport.codec_wire import header_params
    from fedclinic.codecs import available_codecs, parse_codec

    fed = federation_factory(3, start=False)
    fed.make_pki()
    fed.start_aggregator()
    c = fed.creds("site-c")
    channel = secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")
    rogue = agent_pb2_grpc.AgentServiceStub(channel)
    hello = rogue.Hello(agent_pb2.HelloRequest(protocol_version=1, capabilities=agent_pb2.Capabilities(
        codecs=["raw", *available_codecs()])), timeout=30)
    assert {"int8", "topk"} <= set(hello.codecs)
    work: queue.Queue = queue.Queue()
    watch = rogue.WatchWork(agent_pb2.WatchWorkRequest(protocol_version=1))

    def collect() -> None:
        try:
            for item in watch:
                if item.WhichOneof("item") == "assignment":
                    work.put(item)
        except grpc.RpcError:  # cancelled at the end of the test
            pass

    threading.Thread(target=collect, daemon=True).start()
    spec = "topk:0.25+int8"
    codec = parse_codec(spec)
    try:
        with fed.client() as client:
            st = client.submit(make_task(num_rounds=1, min_sites=2, round_timeout_s=300, codec=spec), package=tiny_package())
            a = work.get(timeout=60).assignment
            assert a.spec.update.codec == codec.spec
            fed.start_agent("site-a")
            fed.start_agent("site-b")
            rng = np.random.default_rng(0)
            shapes = {t.name: [int(s) for s in t.shape] for t in a.model.tensors if t.name in a.send_tensors}
            good = {n: codec.encode(rng.standard_normal(s).astype(np.float32), rng=rng) for n, s in shapes.items()}
            name = next(iter(good))

            def variant(**change):
                out = {n: (e.payload, header_params(e)) for n, e in good.items()}
                payload, params = out[name]
                out[name] = (change.get("payload", payload), {**params, **change.get("params", {})})
                return out

            def refused(stream):
                with pytest.raises(grpc.RpcError) as exc:
                    rogue.SubmitUpdate(stream, timeout=30)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
                return exc.value.details()

            # truncated payload: consistent sha256 and size, so only the codec's length check can catch it
            assert "truncated" in refused(_encoded_stream(a, variant(payload=good[name].payload[:-1]), key="c1",
                                                          codec=codec.spec))
            # an index beyond the tensor (the varint of the first gap set to 127): caught before anything is folded
            bad_index = bytes([127]) + good[name].payload[1:]
            assert "out of range" in refused(_encoded_stream(a, variant(payload=bad_index), key="c2", codec=codec.spec))
            # params that disagree with the task's codec, a different codec, raw bytes for a codec task
            k = codec.k_for(int(np.prod(shapes[name])))
            assert "codec_params k is" in refused(_encoded_stream(a, variant(params={"k": str(k + 1)}), key="c3",
                                                                  codec=codec.spec))
            assert "not JSON" in refused(_encoded_stream(a, variant(params={"idx": "varint"}), key="c4",
                                                         codec=codec.spec))
            assert "the task's updates use" in refused(_encoded_stream(a, variant(), key="c5", codec="int8"))
            raw = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
            assert "the task's updates use" in refused(_stream(a, raw, key="c6"))
            rogue.Decline(agent_pb2.DeclineRequest(task_id=a.task_id, round=a.round, reason="done testing"),
                          timeout=30)
            final = client.wait(st.task_id, timeout=300, progress=False)
    finally:
        watch.cancel()
        channel.close()
    assert state_name(final.state) == "completed", final.error
    assert sorted(r.site_id for r in final.rounds[0].reports) == ["site-a", "site-b"]
    state = fed.root / "aggregator-state"
    assert not [p for p in (state / "updates").rglob("*") if p.is_file()]  # no spill left behind
