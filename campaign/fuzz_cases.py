"""The cases the fuzzer fires: one hypothesis strategy per service, drawing an RPC, a certificate and the
request(s), built from the proto descriptors (:mod:`campaign.proto_strategies`) and from the valid messages a
real run sent (:mod:`campaign.fuzz_capture`).

A case's requests are wire bytes: a message drawn field by field, a mutation of a captured message (often
re-aimed at the open round of the fuzzer's target task, so the deep checks run), or damaged bytes. A streamed
request is a sequence of chunks: a valid stream, one chunk mutated or damaged, cut short, reordered, a chunk
repeated or dropped, random chunks after a valid header, or cancelled by the client mid-stream.

``CancelTask`` never names the real task (the campaign needs it to complete); every other RPC may.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from google.protobuf.message import Message
from hypothesis import strategies as st

from fedclinic.pki.signed_statement import Signer
from fedclinic.proto import agent_pb2, control_pb2, inference_pb2
from fedclinic.verification.round_statement import sign_header

from campaign.proto_strategies import any_or_mutated, message_strategy, mutated, mutated_bytes

AGENT = "/fedclinic.v1.AgentService/"
CONTROL = "/fedclinic.v1.Control/"
INFERENCE = "/fedclinic.v1.Inference/"
HEALTH = "/grpc.health.v1.Health/Check"


@dataclass
class RpcCase:
    """One call: ``method`` (full name) with ``identity``'s certificate, ``requests`` as wire bytes (one for a
    unary request); a streamed request is cancelled by the client after ``abort_after`` messages when set."""

    service: str
    method: str
    identity: str
    requests: list[bytes]
    request_stream: bool = False
    response_stream: bool = False
    abort_after: int | None = None

    def describe(self, limit: int = 300) -> str:
        body = " | ".join(r[:80].hex() for r in self.requests[:4])
        more = f" (+{len(self.requests) - 4} more)" if len(self.requests) > 4 else ""
        cut = f", cancelled after {self.abort_after}" if self.abort_after is not None else ""
        return f"{self.method} as {self.identity}: {len(self.requests)} message(s){cut} [{body[:limit]}{more}]"


@dataclass
class Targets:
    """What a batch aims mutations at: task ids, and site-c's open assignment of the target task."""

    real_task: str
    capture_task: str
    target_task: str
    assignment: agent_pb2.Assignment | None
    #: site-c's key: a re-aimed update carries site-c's round statement about its new header (issue 17)
    site_c: Signer | None = None


def _weighted(*pairs: tuple[int, str]) -> st.SearchStrategy:
    return st.sampled_from([name for n, name in pairs for _ in range(n)])


def _wire(msg_strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Serialized messages, damaged on the wire one time in eight."""
    as_bytes = msg_strategy.map(lambda m: m.SerializeToString())
    return st.one_of(*[as_bytes] * 7, as_bytes.flatmap(mutated_bytes))


def _aimed(messages: list[Message], aim: Callable[[Message], Message]) -> list[Message]:
    return messages + [aim(_copy(m)) for m in messages]


def _copy(m: Message) -> Message:
    c = type(m)()
    c.CopyFrom(m)
    return c


@st.composite
def chunk_stream(draw, cls: Any, streams: list[list[Message]]) -> tuple[list[bytes], int | None]:
    """A streamed request of ``cls`` chunks from the valid ``streams`` (module docstring) and its abort point."""
    if not streams:
        chunks = draw(st.lists(message_strategy(cls.DESCRIPTOR), min_size=1, max_size=4))
        return [c.SerializeToString() for c in chunks], None
    base = [_copy(c) for c in draw(st.sampled_from(streams))]
    op = draw(st.sampled_from(("valid", "mutate", "mutate", "mutate", "bytes", "truncate", "reorder", "repeat",
                               "drop", "cancel", "random-tail")))
    wire = [c.SerializeToString() for c in base]
    abort = None
    i = draw(st.integers(0, len(base) - 1))
    if op == "mutate":
        wire[i] = draw(mutated(base[i])).SerializeToString()
    elif op == "bytes":
        wire[i] = draw(mutated_bytes(wire[i]))
    elif op == "truncate":
        wire = wire[:i]
    elif op == "reorder" and len(wire) > 1:
        wire = draw(st.permutations(wire))
    elif op == "repeat":
        wire.insert(i, wire[i])
    elif op == "drop":
        del wire[i]
    elif op == "cancel":
        abort = i
    elif op == "random-tail":
        wire = wire[:max(i, 1)] + [c.SerializeToString() for c in
                                   draw(st.lists(message_strategy(cls.DESCRIPTOR, 3), min_size=1, max_size=3))]
    return list(wire), abort


def _streams_aimed(streams: list[list[Message]], aim: Callable[[Message], Message]) -> list[list[Message]]:
    out = list(streams)
    for s in streams:
        out.append([aim(_copy(c)) for c in s])
    return out


def _update_aim(t: Targets) -> Callable[[agent_pb2.UpdateChunk], agent_pb2.UpdateChunk]:
    """Re-aim a captured update chunk at site-c's open assignment (header: task, round, attempt, a fresh key)."""
    a = t.assignment
    task, rnd, attempt = (a.task_id, a.round, a.attempt) if a is not None else (t.target_task, 1, 0)

    def aim(c: agent_pb2.UpdateChunk) -> agent_pb2.UpdateChunk:
        if c.WhichOneof("item") == "header":
            c.header.task_id, c.header.round, c.header.attempt = task, rnd, attempt
            c.header.idempotency_key = f"{c.header.idempotency_key[:40]}-{task}-{rnd}-{attempt}"
            if t.site_c is not None and c.header.HasField("statement"):
                c.header.ClearField("statement")
                sign_header(c.header, "site-c", t.site_c)
        return c
    return aim


def aimed_updates(capture, t: Targets) -> list[list[bytes]]:
    """The real agent's captured uploads re-aimed at site-c's open assignment: valid uploads, when the target
    task starts from the capture task's model (its first round)."""
    aim = _update_aim(t)
    return [[aim(_copy(c)).SerializeToString() for c in s]
            for s in capture.streams(AGENT + "SubmitUpdate", agent_pb2.UpdateChunk)[:1]]


def agent_cases(capture, t: Targets) -> st.SearchStrategy:
    """Cases for every AgentService RPC, mostly with site-c's certificate."""
    a = t.assignment
    task, rnd, attempt = (a.task_id, a.round, a.attempt) if a is not None else (t.target_task, 1, 0)
    model_hash = a.model.model_hash if a is not None else ""

    aim_update = _update_aim(t)

    def aim_fetch(m: agent_pb2.FetchModelRequest) -> agent_pb2.FetchModelRequest:
        m.task_id, m.model_hash = task, model_hash
        return m

    cap = capture
    hello = cap.messages(AGENT + "Hello", agent_pb2.HelloRequest)[:3]
    watch = cap.messages(AGENT + "WatchWork", agent_pb2.WatchWorkRequest)[:2]
    fetch = _aimed(cap.messages(AGENT + "FetchModel", agent_pb2.FetchModelRequest)[:4], aim_fetch)
    updates = _streams_aimed(cap.streams(AGENT + "SubmitUpdate", agent_pb2.UpdateChunk)[:2], aim_update)
    declines = [agent_pb2.DeclineRequest(task_id=x, round=rnd, reason="policy", permanent=False)
                for x in (task, t.real_task, t.capture_task)]
    holds = [agent_pb2.HoldRequest(task_id=x, round=rnd, reason="waiting for approval") for x in (task, t.real_task)]
    secagg = [agent_pb2.SecAggPhase(task_id=task, round=rnd, join=agent_pb2.SecAggJoin(
        attempt=attempt, model_hash=model_hash, vector_length=100))]
    unary = {"Hello": (agent_pb2.HelloRequest, hello), "Decline": (agent_pb2.DeclineRequest, declines),
             "Hold": (agent_pb2.HoldRequest, holds), "SecAggRespond": (agent_pb2.SecAggPhase, secagg)}
    server_stream = {"WatchWork": (agent_pb2.WatchWorkRequest, watch), "FetchModel": (agent_pb2.FetchModelRequest, fetch)}
    ids = _weighted((6, "site-c"), (1, "site-d"), (1, "scientist"), (1, "operator"), (1, "aggregator"))

    @st.composite
    def case(draw) -> RpcCase:
        who = draw(ids)
        rpc = draw(_weighted((3, "SubmitUpdate"), (2, "FetchModel"), (2, "Decline"), (2, "Hold"),
                             (2, "SecAggRespond"), (1, "Hello"), (1, "WatchWork")))
        if rpc == "SubmitUpdate":
            wire, abort = draw(chunk_stream(agent_pb2.UpdateChunk, updates))
            return RpcCase("agent", AGENT + rpc, who, wire, request_stream=True, abort_after=abort)
        cls, valid = unary.get(rpc) or server_stream[rpc]
        return RpcCase("agent", AGENT + rpc, who, [draw(_wire(any_or_mutated(cls.DESCRIPTOR, valid)))],
                       response_stream=rpc in server_stream)

    return case()


def control_cases(capture, t: Targets) -> st.SearchStrategy:
    """Cases for every Control RPC, mostly with the task owner's certificate."""
    task_ids = [t.real_task, t.capture_task, t.target_task]
    cap = capture
    submits = cap.streams(CONTROL + "SubmitTask", control_pb2.SubmitTaskChunk)[:3]
    gets = [control_pb2.GetTaskRequest(task_id=x) for x in task_ids] + cap.messages(
        CONTROL + "GetTask", control_pb2.GetTaskRequest)[:2]
    watches = [control_pb2.WatchTaskRequest(task_id=x, after_seq=s) for x in task_ids for s in (0, 3)]
    fetches = [control_pb2.ControlFetchModelRequest(task_id=x, round=r) for x in task_ids for r in (-1, 0, 1)]
    fetches += cap.messages(CONTROL + "FetchModel", control_pb2.ControlFetchModelRequest)[:2]
    cancels = [control_pb2.CancelTaskRequest(task_id=x, reason="fuzz") for x in (t.target_task, t.capture_task)]
    lists = [control_pb2.ListTasksRequest(include_finished=b) for b in (False, True)]

    def not_real(m: control_pb2.CancelTaskRequest) -> control_pb2.CancelTaskRequest:
        if m.task_id == t.real_task:
            m.task_id = t.target_task
        return m

    unary = {"GetTask": (control_pb2.GetTaskRequest, gets), "ListTasks": (control_pb2.ListTasksRequest, lists),
             "CancelTask": (control_pb2.CancelTaskRequest, cancels)}
    server_stream = {"WatchTask": (control_pb2.WatchTaskRequest, watches),
                     "FetchModel": (control_pb2.ControlFetchModelRequest, fetches)}
    ids = _weighted((5, "scientist"), (2, "scientist-2"), (2, "operator"), (1, "site-c"), (1, "aggregator"))

    @st.composite
    def case(draw) -> RpcCase:
        who = draw(ids)
        rpc = draw(_weighted((3, "SubmitTask"), (2, "GetTask"), (1, "ListTasks"), (2, "WatchTask"), (1, "CancelTask"),
                             (2, "FetchModel")))
        if rpc == "SubmitTask":
            wire, abort = draw(chunk_stream(control_pb2.SubmitTaskChunk, submits))
            return RpcCase("control", CONTROL + rpc, who, wire, request_stream=True, abort_after=abort)
        cls, valid = unary.get(rpc) or server_stream[rpc]
        strategy = any_or_mutated(cls.DESCRIPTOR, valid)
        if rpc == "CancelTask":
            strategy = strategy.map(not_real)
        return RpcCase("control", CONTROL + rpc, who, [draw(_wire(strategy))], response_stream=rpc in server_stream)

    return case()


def inference_cases(texts: list[str]) -> st.SearchStrategy:
    """Cases for the Inference service (and its health service) of ``fedclinic serve``, with every role."""
    valid = [inference_pb2.PredictRequest(texts=texts), inference_pb2.PredictRequest(texts=texts[:1] * 3),
             inference_pb2.PredictRequest(texts=texts, contexts=[""] * len(texts))]
    ids = _weighted((2, "scientist"), (1, "scientist-2"), (1, "operator"), (1, "site-c"), (1, "aggregator"))
    from grpc_health.v1 import health_pb2

    @st.composite
    def case(draw) -> RpcCase:
        who = draw(ids)
        rpc = draw(_weighted((8, "Predict"), (1, "DescribeModel"), (1, "Health")))
        if rpc == "Predict":
            wire = draw(_wire(any_or_mutated(inference_pb2.PredictRequest.DESCRIPTOR, valid)))
            return RpcCase("inference", INFERENCE + rpc, who, [wire])
        if rpc == "DescribeModel":
            return RpcCase("inference", INFERENCE + rpc, who,
                           [draw(_wire(message_strategy(inference_pb2.DescribeModelRequest.DESCRIPTOR)))])
        return RpcCase("inference", HEALTH, who, [draw(_wire(message_strategy(
            health_pb2.HealthCheckRequest.DESCRIPTOR)))])

    return case()
