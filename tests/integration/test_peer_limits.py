"""Resource exhaustion by one certificate (issue 16, item 4), over a real aggregator process, real certificates
and raw gRPC stubs (the SDK's and agent's own behaviour bypassed):

- 70 idle SubmitUpdate streams of one site: those over the per-certificate upload limit (or, with that limit
  lifted, over the aggregator's cap on long-lived calls) are refused at once with RESOURCE_EXHAUSTED, and a
  scientist's ListTasks and another site's Hello answer while the others are open;
- a stream that sent only its header (or nothing) is ended by the idle timeout with DEADLINE_EXCEEDED, its
  slot and its partial state freed;
- Decline, Hold and SecAggRespond from a site never assigned to the task are refused PERMISSION_DENIED and write
  nothing into the task's events; an assigned site's 3,000,000-character reason is stored truncated with a
  marker; an over-long field of another request is refused INVALID_ARGUMENT naming the field;
- a SubmitTask carrying large files its manifest does not declare is refused at the first such chunk, and the
  aggregator's peak resident memory stays bounded (a size, not a time); a manifest declaring too many files or
  too many bytes of files is refused before any byte.
"""

from __future__ import annotations

import hashlib
import signal
import threading
from pathlib import Path

import grpc
import pytest

from fedclinic.federation.local_federation import wait_until
from fedclinic.proto import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc, task_pb2, tensors_pb2
from fedclinic.transport.package import raw_bytes
from fedclinic.transport.rpc import TlsFiles, secure_channel
from fedclinic.transport.wire import encoded_tensor_chunks, file_chunks, header_of, manifest_to_proto


from tests.helpers.federation import aggregator_store, keep_aggregator_address, watch_assignments
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration

STREAMS = 70
CHUNK = (4 << 20) - 1024  # a file chunk's data, within gRPC's 4 MiB message limit
_SUBMIT_TENSOR_FIELD = control_pb2.SubmitTaskChunk.DESCRIPTOR.fields_by_name["tensor"].number


def _channel(fed, who: str) -> grpc.Channel:
    c = fed.creds(who)
    return secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")


def _silent_stream(release: threading.Event, first: agent_pb2.UpdateChunk | None = None):
    """A SubmitUpdate request stream that sends ``first`` (or nothing) and then nothing until ``release``."""
    if first is not None:
        yield first
    release.wait()


def _events(fed, task_id: str) -> list[tuple[str, str]]:
    """The task's events as stored, read from the aggregator's database: (kind, message)."""
    with aggregator_store(fed) as store:
        return [(r.kind, r.message) for r in store.all("SELECT kind, message FROM events WHERE task_id=? ORDER BY seq",
                                                       (task_id,))]


def _peak_rss(pid: int) -> int:
    """The process's peak resident set size in bytes (VmHWM of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


class _Assigned:
    """site-a's work stream, a running task assigned to site-a only, and site-a's first assignment."""

    def __init__(self, fed) -> None:
        self.channel = _channel(fed, "site-a")
        self.stub = agent_pb2_grpc.AgentServiceStub(self.channel)
        work, self.watch = watch_assignments(self.stub)
        with fed.client() as client:
            self.task_id = client.submit(make_task(num_rounds=1, min_sites=1, sites=["site-a"], round_timeout_s=600),
                                         package=tiny_package()).task_id
        self.assignment = work.get(timeout=60)
        assert self.assignment.task_id == self.task_id

    def update_header(self, key: str) -> agent_pb2.UpdateChunk:
        """A valid header of a zero delta for the assignment (its bytes are never sent)."""
        a = self.assignment
        tensors = []
        for t in a.model.tensors:
            if t.name in a.send_tensors:
                h = tensors_pb2.TensorHeader()
                h.CopyFrom(t)
                h.sha256 = hashlib.sha256(bytes(t.encoded_nbytes)).hexdigest()
                tensors.append(h)
        return agent_pb2.UpdateChunk(header=agent_pb2.UpdateHeader(
            task_id=a.task_id, round=a.round, attempt=a.attempt, idempotency_key=key,
            base_model_hash=a.model.model_hash, kind=task_pb2.UPDATE_KIND_DELTA, num_samples=8, tensors=tensors))

    def close(self) -> None:
        self.watch.cancel()
        self.channel.close()


@pytest.mark.parametrize("limits, held, refusal", [
    ({"uploads_per_peer": 4}, 4, "at most 4 concurrent uploads per certificate"),
    # the per-certificate limit lifted: the cap on long-lived calls of all peers (max_workers - unary_reserve)
    # still leaves threads for unary calls
    ({"uploads_per_peer": STREAMS, "unary_reserve": 16}, 48, "maximum of 48 streams"),
], ids=["per-certificate", "all-peers"])
def test_idle_upload_streams_of_one_site_are_refused_over_the_limit_and_others_are_served(federation_factory,
                                                                                          limits, held, refusal):
    # 64 worker threads: the pool the probe filled with 70 idle streams
    fed = federation_factory(2, start=False, aggregator_settings={"max_workers": 64, "limits": limits})
    fed.make_pki()
    fed.start_aggregator()
    site_a, site_b, scientist = _channel(fed, "site-a"), _channel(fed, "site-b"), _channel(fed, "scientist")
    release = threading.Event()
    calls = []
    try:
        submit = agent_pb2_grpc.AgentServiceStub(site_a).SubmitUpdate
        calls = [submit.future(_silent_stream(release)) for _ in range(STREAMS)]

        def refused() -> list[grpc.Future]:
            return [c for c in calls if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]

        wait_until(lambda: len(refused()) == STREAMS - held, timeout=60,
                   what=f"{STREAMS - held} of {STREAMS} idle streams refused at once")
        assert all(refusal in c.details() for c in refused()), refused()[0].details()
        open_ = [c for c in calls if not c.done()]
        assert len(open_) == held
        # while the accepted streams are open, others are served within their normal deadline
        listed = control_pb2_grpc.ControlStub(scientist).ListTasks(control_pb2.ListTasksRequest(), timeout=15)
        assert list(listed.tasks) == []
        hello = agent_pb2_grpc.AgentServiceStub(site_b).Hello(
            agent_pb2.HelloRequest(protocol_version=1, agent_version="probe"), timeout=15)
        assert hello.site_id == "site-b"
        assert all(not c.done() for c in open_), "an accepted stream ended before it was released"
    finally:
        release.set()
        for c in calls:
            c.cancel()
        for ch in (site_a, site_b, scientist):
            ch.close()


def test_a_silent_upload_stream_is_ended_by_the_idle_timeout_and_its_slot_freed(federation_factory):
    fed = federation_factory(2, start=False, aggregator_settings={"limits": {"idle_timeout_s": 2,
                                                                             "uploads_per_peer": 1}})
    fed.make_pki()
    fed.start_aggregator()
    task = _Assigned(fed)
    release = threading.Event()
    try:
        for i, first in enumerate([task.update_header("k-header-only"), task.update_header("k-again"), None]):
            call = task.stub.SubmitUpdate.future(_silent_stream(release, first))
            with pytest.raises(grpc.RpcError) as exc:  # pre-fix: still open at this deadline (FutureTimeoutError)
                call.result(timeout=90)
            e = exc.value
            # a second stream of the same site is admitted (not RESOURCE_EXHAUSTED): the first one's slot was freed
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (i, e.code(), e.details())
            assert "sent nothing for 2 s" in e.details() and "idle timeout" in e.details()
        spill = fed.root / "aggregator-state" / "updates"
        wait_until(lambda: not [p for p in spill.rglob("*") if p.is_file()], timeout=30,
                   what="no partial update left in the spill folder")
        assert not any(k == "update-received" for k, _ in _events(fed, task.task_id))
    finally:
        release.set()
        task.close()


def test_a_site_never_assigned_to_a_task_writes_nothing_into_it(federation_factory):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    fed.start_aggregator()
    task = _Assigned(fed)
    site_b = _channel(fed, "site-b")
    try:
        stub_b = agent_pb2_grpc.AgentServiceStub(site_b)
        before = _events(fed, task.task_id)
        t, rnd = task.task_id, task.assignment.round
        huge = "x" * 3_000_000
        calls = {
            "Decline": lambda: stub_b.Decline(agent_pb2.DeclineRequest(task_id=t, round=rnd, reason=huge,
                                                                       permanent=True), timeout=30),
            "Hold": lambda: stub_b.Hold(agent_pb2.HoldRequest(task_id=t, round=rnd, reason="held"), timeout=30),
            "SecAggRespond": lambda: stub_b.SecAggRespond(agent_pb2.SecAggPhase(
                task_id=t, round=rnd, join=agent_pb2.SecAggJoin(attempt=1, model_hash=task.assignment.model.model_hash,
                                                                vector_length=1)), timeout=30),
            "SubmitUpdate": lambda: stub_b.SubmitUpdate(iter([task.update_header("k-b")]), timeout=30),
            # a task that does not exist gets the same answer: nothing tells a site which tasks exist
            "Decline (no such task)": lambda: stub_b.Decline(agent_pb2.DeclineRequest(task_id="t-000000000000",
                                                                                      round=1, reason="r"), timeout=30),
        }
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, exc.value.code(),
                                                                          exc.value.details())
        assert _events(fed, task.task_id) == before
        status = control_pb2_grpc.ControlStub(_channel(fed, "scientist")).GetTask(
            control_pb2.GetTaskRequest(task_id=t), timeout=30)
        assert not any(r.declined or r.held for r in status.rounds)
        assert status.state == control_pb2.TASK_STATE_RUNNING
    finally:
        site_b.close()
        task.close()


def test_over_long_fields_are_truncated_or_refused(federation_factory):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    fed.start_aggregator()
    task = _Assigned(fed)
    site_b = _channel(fed, "site-b")
    try:
        # a free-text reason of an assigned site: stored truncated, with a marker saying so
        task.stub.Decline(agent_pb2.DeclineRequest(task_id=task.task_id, round=task.assignment.round,
                                                   reason="y" * 3_000_000), timeout=30)
        declined = [m for k, m in _events(fed, task.task_id) if k == "declined"]
        assert len(declined) == 1 and len(declined[0]) < 3000, len(declined[0])
        assert "truncated by the aggregator: 3000000 characters" in declined[0]
        # a field that must be exact: refused, naming the field and its limit
        with pytest.raises(grpc.RpcError) as exc:
            agent_pb2_grpc.AgentServiceStub(site_b).Hello(
                agent_pb2.HelloRequest(protocol_version=1, agent_version="v" * 5000), timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "HelloRequest.agent_version" in exc.value.details() and "at most 128" in exc.value.details()
        metrics = {f"m{i}": 1.0 for i in range(300)}
        header = task.update_header("k-metrics")
        header.header.metrics.update(metrics)
        with pytest.raises(grpc.RpcError) as exc:
            task.stub.SubmitUpdate(iter([header]), timeout=30)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "UpdateHeader.metrics has 300 entries" in exc.value.details()
    finally:
        site_b.close()
        task.close()


def _submission(package, extra_files: int = 0, extra_bytes: int = 0, declare: list | None = None):
    """A SubmitTask stream: the package as the SDK sends it, ``declare`` extra FileInfos in the manifest, and
    ``extra_files`` files of ``extra_bytes`` each that the manifest does not declare (sent in 4 MiB chunks)."""
    manifest = package.manifest()
    model = manifest_to_proto(manifest)
    model.model_hash = ""
    model.files.extend(declare or [])
    spec = make_task(min_sites=1).to_spec()
    key = hashlib.sha256(f"{extra_files}-{extra_bytes}-{len(declare or [])}".encode()).hexdigest()
    yield control_pb2.SubmitTaskChunk(header=control_pb2.SubmitTaskHeader(spec=spec, idempotency_key=key,
                                                                          model=model)).SerializeToString()
    for f in manifest.files:
        for c in file_chunks(f.path, package.files[f.path]):
            yield control_pb2.SubmitTaskChunk(file=c).SerializeToString()
    block = bytes(CHUNK)
    digest = hashlib.sha256()  # the files' true hash: nothing but their being undeclared is wrong with them
    for offset in range(0, extra_bytes, CHUNK):
        digest.update(block[:min(CHUNK, extra_bytes - offset)])
    for i in range(extra_files):
        path = f"undeclared-{i}.bin"
        for offset in range(0, extra_bytes, CHUNK):
            data = block[:min(CHUNK, extra_bytes - offset)]
            yield control_pb2.SubmitTaskChunk(file=tensors_pb2.FileChunk(
                path=path, offset=offset, data=data, total_nbytes=extra_bytes,
                sha256=digest.hexdigest() if offset == 0 else "")).SerializeToString()
    for t in manifest.tensors:
        yield from encoded_tensor_chunks(_SUBMIT_TENSOR_FIELD, header_of(t), raw_bytes(package.tensors[t.name]))
    yield control_pb2.SubmitTaskChunk(commit=control_pb2.SubmitTaskCommit()).SerializeToString()


def test_undeclared_files_of_a_submission_are_refused_with_bounded_memory(federation_factory):
    fed = federation_factory(1, start=False, aggregator_settings={"limits": {"model_files": 3,
                                                                             "model_file_bytes": 64 << 20}})
    fed.make_pki()
    fed.start_aggregator()
    channel = _channel(fed, "scientist")
    submit = channel.stream_unary("/fedclinic.v1.Control/SubmitTask", request_serializer=None,
                                  response_deserializer=control_pb2.TaskStatus.FromString)
    try:
        pid = fed.aggregator.pid
        peak_before = _peak_rss(pid)
        with pytest.raises(grpc.RpcError) as exc:  # the probe's 2 x 240 MiB (below the 256 MiB per-file cap)
            submit(_submission(tiny_package(), extra_files=2, extra_bytes=240 << 20), timeout=300)
        grown = _peak_rss(pid) - peak_before
        assert grown < 64 << 20, f"the aggregator's peak RSS grew by {grown >> 20} MiB"
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'undeclared-0.bin' is not in the manifest" in exc.value.details(), exc.value.details()
        for declare, says in [
            ([tensors_pb2.FileInfo(path=f"f{i}", nbytes=1, sha256="0" * 64) for i in range(4)], "at most 3"),
            ([tensors_pb2.FileInfo(path="big", nbytes=65 << 20, sha256="0" * 64)], "at most 67108864 in all"),
        ]:
            with pytest.raises(grpc.RpcError) as exc:
                submit(_submission(tiny_package(), declare=declare), timeout=60)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in exc.value.details(), \
                exc.value.details()
        tasks = control_pb2_grpc.ControlStub(channel).ListTasks(control_pb2.ListTasksRequest(include_finished=True),
                                                                timeout=30).tasks
        assert not tasks
        assert fed.aggregator.poll() is None
    finally:
        channel.close()


def test_an_agent_keeps_an_update_refused_for_a_limit_and_sends_it_later(federation_factory):
    """RESOURCE_EXHAUSTED is a limit of the aggregator, not a verdict on the update: the real agent keeps the update
    in its outbox and sends it when the round is offered again (here after an aggregator restart). Before, it
    dropped the update and marked the round sent, so the task could never finish."""
    fed = federation_factory(1, start=False, aggregator_settings={"limits": {"uploads_per_peer": 1,
                                                                             "idle_timeout_s": 600}})
    fed.make_pki()
    fed.start_aggregator()
    keep_aggregator_address(fed)  # the agent reconnects to the restarted aggregator
    squatter = _channel(fed, "site-a")  # site-a's own certificate holds its only upload slot
    release = threading.Event()
    held = agent_pb2_grpc.AgentServiceStub(squatter).SubmitUpdate.future(_silent_stream(release))
    fed.start_agent("site-a")
    agent_log = fed.logs / "agent-site-a.log"
    try:
        with fed.client() as client:
            st = client.submit(make_task(num_rounds=1, min_sites=1, round_timeout_s=600), package=tiny_package())
        wait_until(lambda: "at most 1 concurrent uploads" in agent_log.read_text(errors="replace"), timeout=180,
                   what="the agent's upload refused for the upload limit")
        release.set()
        held.cancel()
        squatter.close()
        assert fed.signal_aggregator(signal.SIGTERM) == 0
        fed.start_aggregator()
        with fed.client() as client:
            wait_until(lambda: client.status(st.task_id).state != control_pb2.TASK_STATE_RUNNING, timeout=180,
                       what="the task to end")
            final = client.status(st.task_id)
        assert final.state == control_pb2.TASK_STATE_COMPLETED, final.error
        assert [r.site_id for r in final.rounds[0].reports] == ["site-a"]
        assert "dropping it" not in agent_log.read_text(errors="replace")
    finally:
        release.set()
        held.cancel()
        squatter.close()
