"""What the network sends never crashes a service or an agent (issue 16, items 1 and 7), over real processes:

- a raw ``SubmitTask`` (a real scientist certificate, the SDK's own checks bypassed) whose manifest declares a
  tensor of shape [2^32, 2^32] with 0 bytes, or whose spec holds an absurd number, is refused with
  INVALID_ARGUMENT and a message naming the problem; the running agents stay up;
- a failure the aggregator did not map (a blob deleted under it) reaches the caller with a status that is not
  UNKNOWN and without the server's file path;
- a hostile assignment handed to a real agent (built from its real config, connected to the real aggregator)
  is declined with a reason and the agent carries on: the overflowing manifest, and an unexpected exception
  raised while handling an assignment.
"""

from __future__ import annotations

import hashlib
import math

import grpc
import pytest

from fedclinic.client import submission_stream
from fedclinic.federation.local_federation import wait_until
from fedclinic.proto import agent_pb2, control_pb2, control_pb2_grpc, tensors_pb2
from fedclinic.transport.rpc import TlsFiles, secure_channel
from fedclinic.transport.wire import manifest_to_proto

from tests.helpers.federation import watch_assignments
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration

_EMPTY_SHA = hashlib.sha256(b"").hexdigest()


def _overflowing_header(name: str = "zz.overflow") -> tensors_pb2.TensorHeader:
    """[2^32, 2^32] float32 declared with 0 bytes: its int64 element count wraps to 0."""
    return tensors_pb2.TensorHeader(name=name, dtype="float32", shape=[2**32, 2**32], codec="raw", sha256=_EMPTY_SHA,
                                    encoded_nbytes=0)


def _raw_submission(spec, package, extra: tensors_pb2.TensorHeader | None = None):
    """A SubmitTask stream as the SDK would send it, plus ``extra`` (an empty tensor) in the manifest and payload."""
    manifest = package.manifest()
    model = manifest_to_proto(manifest)
    model.model_hash = ""  # the manifest is altered: no hash to match
    if extra is not None:
        model.tensors.append(extra)
    header = control_pb2.SubmitTaskHeader(spec=spec, idempotency_key=hashlib.sha256(repr(spec).encode()).hexdigest()
                                          + str(extra is not None), model=model)
    *chunks, commit = submission_stream(header, package, manifest)
    yield from chunks
    if extra is not None:
        yield control_pb2.SubmitTaskChunk(tensor=tensors_pb2.TensorChunk(name=extra.name, header=extra, offset=0)
                                          ).SerializeToString()
    yield commit


def _control_stub(fed):
    c = fed.creds("scientist")
    channel = secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")
    stub = control_pb2_grpc.ControlStub(channel)
    submit = channel.stream_unary("/fedclinic.v1.Control/SubmitTask", request_serializer=None,
                                  response_deserializer=control_pb2.TaskStatus.FromString)
    return channel, stub, submit


def _spec_with(path: str, value):
    package = tiny_package()
    spec = make_task(min_sites=2).to_spec()
    section, name = path.split(".")
    setattr(getattr(spec, section), name, value)
    return spec, package


def test_hostile_submissions_are_refused_with_invalid_argument_and_agents_live(federation_factory):
    fed = federation_factory(2)
    channel, stub, submit = _control_stub(fed)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            submit(_raw_submission(make_task(min_sites=2).to_spec(), tiny_package(), _overflowing_header()), timeout=60)
        e = exc.value
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
        assert "zz.overflow" in e.details() and "one tensor may have" in e.details()

        for path, value, says in [("rounds.round_timeout_s", math.inf, "rounds.round_timeout_s must be a finite"),
                                  ("rounds.round_timeout_s", 1e300, "rounds.round_timeout_s must be a finite"),
                                  ("rounds.num_rounds", 10**9, "rounds.num_rounds must be a whole number"),
                                  ("training.learning_rate", math.inf, "training.learning_rate must be a finite"),
                                  ("training.learning_rate", math.nan, "training.learning_rate must be a finite"),
                                  ("training.batch_size", -8, "training.batch_size must be a whole number")]:
            spec, package = _spec_with(path, value)
            with pytest.raises(grpc.RpcError) as exc:
                submit(_raw_submission(spec, package), timeout=60)
            e = exc.value
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and says in e.details(), (path, e.code(), e.details())
        # a NUL character (which PostgreSQL's text cannot hold) is refused the same way on either state database
        with pytest.raises(grpc.RpcError) as exc:
            stub.GetTask(control_pb2.GetTaskRequest(task_id="t-\x00"), timeout=30)
        e = exc.value
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "task_id contains a NUL" in e.details(), e.details()
        assert not stub.ListTasks(control_pb2.ListTasksRequest(include_finished=True), timeout=30).tasks
        assert all(p.poll() is None for p in fed.agents.values()), "an agent exited"
    finally:
        channel.close()


def test_an_unmapped_failure_is_not_unknown_and_shows_no_server_path(federation_factory):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.start_aggregator()
    channel, stub, _ = _control_stub(fed)
    try:
        with fed.client() as client:
            st = client.submit(make_task(min_sites=1), package=tiny_package())
        blobs = fed.root / "aggregator-state" / "blobs"
        victim = next(p for p in sorted(blobs.glob("??/*")) if p.stat().st_size > 0)
        victim.unlink()
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.FetchModel(control_pb2.ControlFetchModelRequest(task_id=st.task_id, round=-1), timeout=60))
        e = exc.value
        assert e.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.OK), e.details()
        assert str(fed.root) not in e.details() and victim.name not in e.details(), e.details()
    finally:
        channel.close()


def test_a_hostile_assignment_is_declined_and_the_agent_carries_on(federation_factory):
    """The aggregator refuses the overflowing manifest now, so it is handed to the agent directly: a real Agent
    from the site's real config, connected to the real aggregator, takes a real assignment altered on the way."""
    from hospital_agent.config import AgentConfig
    from hospital_agent.worker import Agent

    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.start_aggregator()
    agent = Agent(AgentConfig.load(fed.write_agent_config("site-a")))
    agent.connect()
    agent.hello()
    work, watch = watch_assignments(agent.stub())
    try:
        with fed.client() as client:
            first = client.submit(make_task(min_sites=1, name="overflow"), package=tiny_package())
            a = work.get(timeout=60)
            assert a.task_id == first.task_id
            hostile = agent_pb2.Assignment()
            hostile.CopyFrom(a)
            hostile.model.model_hash = ""
            hostile.model.tensors.append(_overflowing_header())
            agent._handle_safely(hostile)  # returns: nothing it raised escaped

            def declined(task_id: str) -> list[str]:
                rounds = client.status(task_id).rounds
                return list(rounds[0].declined) if rounds else []

            wait_until(lambda: declined(first.task_id), 30, "the refusal to reach the task owner")
            reason = declined(first.task_id)[0]
            assert reason.startswith("site-a: ") and "one tensor may have" in reason, reason

            # an exception no gate expects, raised while handling what the network sent: declined, not fatal
            second = client.submit(make_task(min_sites=1, name="unexpected"), package=tiny_package(seed=1))
            b = work.get(timeout=60)
            while b.task_id != second.task_id:
                b = work.get(timeout=60)

            def explode(*_args, **_kwargs):
                raise ValueError("array is too big; `arr.size * arr.dtype.itemsize` is larger than the maximum")

            agent.training.prepare_data = explode
            agent._handle_safely(b)
            wait_until(lambda: declined(second.task_id), 30, "the second refusal to reach the task owner")
            reason = declined(second.task_id)[0]
            assert "ValueError" in reason and "resubmit" in reason and "array is too big" not in reason, reason
            assert agent.hello().site_id == "site-a"  # the agent still talks to the aggregator
    finally:
        watch.cancel()
        agent.stop()
