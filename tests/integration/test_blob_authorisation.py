"""A hash is not a capability (issue 16, item 2): a blob is streamed only through a task that references it.

Real processes: a site assigned to its own task cannot fetch another scientist's model by naming its hash, and
a scientist cannot smuggle another scientist's blob into a task through a manifest that names a tensor twice.
"""

from __future__ import annotations

import hashlib

import grpc
import pytest

from fedclinic import pki
from fedclinic.client import connect
from fedclinic.proto import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc
from fedclinic.transport.package import raw_bytes
from fedclinic.transport.rpc import TlsFiles, secure_channel
from fedclinic.transport.wire import file_chunks, header_of, manifest_to_proto, tensor_chunks

from tests.helpers.federation import watch_assignments
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


def _second_scientist(fed):
    """Credentials of a second scientist, ``scientist-b``, issued by the federation's CA."""
    pki.issue(fed.ca_dir, role="scientist", name="scientist-b", out_dir=fed.pki_dir / "scientist-b", days=7)
    return fed.creds("scientist-b")


def _fetch_error(stub, **request) -> grpc.RpcError | None:
    """Drain a FetchModel call; the error it ended with (None when the model was streamed)."""
    try:
        for _ in stub.FetchModel(agent_pb2.FetchModelRequest(**request), timeout=60):
            pass
    except grpc.RpcError as exc:
        return exc
    return None


def test_a_site_cannot_fetch_another_scientists_model_by_its_hash(federation_factory):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    b = _second_scientist(fed)
    fed.start_aggregator()
    c = fed.creds("site-a")
    channel = secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")
    site_a = agent_pb2_grpc.AgentServiceStub(channel)
    work, watch = watch_assignments(site_a)
    try:
        theirs = tiny_package("lstm", seed=1)
        with connect(fed.address, cert=b["cert"], key=b["key"], ca=b["ca"], server_name="localhost") as bob:
            bob.submit(make_task(name="bob", architecture="lstm", num_rounds=1, min_sites=1, sites=["site-b"],
                                 round_timeout_s=300), package=theirs)
        foreign = theirs.manifest().model_hash
        with fed.client() as alice:
            st = alice.submit(make_task(name="alice", num_rounds=1, min_sites=1, sites=["site-a"],
                                        round_timeout_s=300), package=tiny_package())
            a = work.get(timeout=60)
            assert a.task_id == st.task_id
            # its own task's model: streamed
            assert _fetch_error(site_a, task_id=a.task_id, model_hash=a.model.model_hash) is None
            # scientist B's model, named by its hash through site A's own task: refused ...
            refused = _fetch_error(site_a, task_id=a.task_id, model_hash=foreign, include_files=True)
            assert refused is not None and refused.code() == grpc.StatusCode.NOT_FOUND, refused
            # ... with the answer a hash that exists nowhere gets: nothing tells whether the blob exists elsewhere
            nowhere = "0" * 64
            absent = _fetch_error(site_a, task_id=a.task_id, model_hash=nowhere)
            assert absent is not None and absent.code() == grpc.StatusCode.NOT_FOUND
            assert refused.details().replace(foreign[:12], "H") == absent.details().replace(nowhere[:12], "H")
            assert "aggregator-state" not in refused.details()
    finally:
        watch.cancel()
        channel.close()


def test_a_manifest_naming_a_tensor_twice_is_refused_at_submit(federation_factory):
    """The first entry of the duplicated name points at scientist B's blob; before the fix the task was accepted
    and its round -1 download streamed B's tensor."""
    fed = federation_factory(1, start=False)
    fed.make_pki()
    b = _second_scientist(fed)
    fed.start_aggregator()
    theirs = tiny_package("lstm", seed=1)
    with connect(fed.address, cert=b["cert"], key=b["key"], ca=b["ca"], server_name="localhost") as bob:
        bob.submit(make_task(name="bob", architecture="lstm", num_rounds=1, min_sites=1, round_timeout_s=300),
                   package=theirs)
    ours = tiny_package("lstm")
    manifest = ours.manifest()
    target = manifest.tensors[0]
    stolen = next(t for t in theirs.manifest().tensors if t.name == target.name)
    assert stolen.sha256 != target.sha256 and stolen.shape == target.shape
    proto = manifest_to_proto(manifest)
    del proto.tensors[:]
    proto.tensors.append(header_of(stolen))  # first entry: B's blob, never sent
    proto.tensors.extend(header_of(t) for t in manifest.tensors)
    proto.model_hash = ""
    task = make_task(name="thief", architecture="lstm", num_rounds=1, min_sites=1, round_timeout_s=300)
    tok = ours.files.get("tokenizer.json")
    spec = task.to_spec(tokenizer_sha256=hashlib.sha256(tok).hexdigest() if tok else "")
    header = control_pb2.SubmitTaskHeader(spec=spec, idempotency_key="dup-1", model=proto)

    def stream():
        yield control_pb2.SubmitTaskChunk(header=header)
        for f in manifest.files:
            for c in file_chunks(f.path, ours.files[f.path]):
                yield control_pb2.SubmitTaskChunk(file=c)
        for t in manifest.tensors:
            for c in tensor_chunks(header_of(t), raw_bytes(ours.tensors[t.name])):
                yield control_pb2.SubmitTaskChunk(tensor=c)
        yield control_pb2.SubmitTaskChunk(commit=control_pb2.SubmitTaskCommit())

    c = fed.creds("scientist")
    with secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost") as channel:
        with pytest.raises(grpc.RpcError) as exc:
            control_pb2_grpc.ControlStub(channel).SubmitTask(stream(), timeout=60)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
    assert "more than once" in exc.value.details()
    with fed.client() as alice:
        assert [t.spec.name for t in alice.list(include_finished=True)] == []  # nothing was stored
