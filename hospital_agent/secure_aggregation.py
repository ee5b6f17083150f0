"""The site's side of secure aggregation: after local training, the round's delta leaves only masked.

For a task with ``[secure_aggregation] enabled = true`` the worker trains as usual (and charges sample-level
DP, when the task has it, before anything leaves), then hands the delta to :meth:`SiteSecAgg.ready`, which
flattens it (the assignment's ``send_tensors``, each in C order, float32) and *joins* the round
(``SecAggRespond(join)`` naming the model it trained on). Phase messages then arrive on the work stream and
are answered on one thread, one :class:`~fedclinic.secagg.ClientSession` per session:

============================  ====================================================================
``SecAggSetup``               rebuild and check the session parameters (they must hash to the session
                              id, name the model trained on, the agreed tensor order and length, and only
                              sites the task's allow-list admits; a distributed-DP task's noise plan must be
                              its signed task's, fedclinic.secagg.dp_plan.check_setup); create the
                              ClientSession (site policy: ``secure_aggregation_min_cohort``, raised to the
                              plan's survivor floor); answer ``advertise_keys`` with the keys
                              signed ("secagg-keys") by this agent's certificate key
``SecAggKeyDirectory``        check every peer's signed keys against the site's CA (role agent, the
                              certificate named as the entry's site, this session); answer ``share_keys``
``SecAggMaskedInputRequest``  encode the input in the session's layout (:mod:`fedclinic.secagg.vector_layout`:
                              the quantized delta times the site's weight -- its sample count, capped -- the
                              weight itself, per-tensor weights under SAFL and the evaluation metrics, all in
                              the session's ring; under privacy level "distributed" the whole delta
                              clipped to L2 norm C, scaled, rounded, plus this site's Skellam noise share
                              from a CSPRNG, fedclinic.secagg.skellam_encoding) and mask it; write it to
                              the outbox and upload it through
                              ``SubmitUpdate`` with an idempotency key (``secagg_session_id`` set; no sample
                              count, metrics or DP report beside it: they are inside the masked vector)
``SecAggSurvivors``           sign the survivor set ("secagg-survivors"; once per session)
``SecAggUnmaskRequest``       check the survivors' signatures (a quorum, over exactly the set this site
                              signed, its own among them); answer ``unmask_response``; the round's vector is
                              then forgotten
``SecAggAbort``               drop the session; join again (``rejoin``) unless this site already revealed
                              shares for the round: a second sum over another cohort would let the aggregator
                              subtract one from the other
============================  ====================================================================

A repeated phase message (a reconnected work stream gets the live session's messages again) is answered with
the answer given the first time. A :class:`~fedclinic.secagg.SecAggRefusal` (or any protocol error) is
logged and reported to the aggregator as a decline with its reason; nothing more is sent for that round.
Nothing here is persisted except the masked vector in the outbox (and, for a ``topk:F`` task, the
error-feedback residual: the values outside the session's shared index set, staged before the masked input
exists and committed when the aggregator acknowledges it, as the plain top-k codec's; ``SiteSecAgg.ready``
adds the committed residual to the next round's delta): a restarted agent has lost its keys and counts as
dropped.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import numpy as np
import structlog

from fedclinic.pki.attestor import CertificateAttestor
from fedclinic.privacy.secure_random import SecureRandom
from fedclinic.privacy.skellam_noise import skellam_noise
from fedclinic.pki.signed_statement import Signer
from fedclinic.runtime.failpoints import failpoint
from fedclinic.transport.package import tensor_sha256
from fedclinic.proto import agent_pb2, agent_pb2_grpc, task_pb2, tensors_pb2
from fedclinic.transport.rpc import explain_rpc_error
from fedclinic.secagg import (AdvertiseKeys, ClientPolicy, ClientSession, KeyDirectory, MaskedInputRequest, Quantizer,
                              SecAggError, SessionParams, SurvivorsRequest, UnmaskRequest)
from fedclinic.secagg import dp_plan
from fedclinic.secagg.skellam_encoding import SkellamEncoding
from fedclinic.secagg.task_config import floor_of, index_fraction_of
from fedclinic.secagg.vector_layout import METRIC_BITS, VectorLayout, index_seed
from fedclinic.codecs import ErrorFeedback
from fedclinic.transport.wire import manifest_from_proto

from hospital_agent.config import AgentConfig
from hospital_agent.outbox import Outbox, OutboxEntry
from hospital_agent.uploader import feedback_path

log = structlog.get_logger("fedclinic.agent.secagg")

FEATURE = "secagg-v2"
"""Signed keys and the consistency round; an aggregator without it sends unsigned directories, which are refused."""
MASKED_TENSOR = "secagg.masked_input"


@dataclass
class _Job:
    """One trained round of one task, waiting for or inside a session."""

    task_id: str
    round: int
    attempt: int
    model_hash: str                    # hex: the global model this site trained on (its commitment)
    names: tuple[str, ...]             # the round's tensors (all of them, also those SAFL did not select)
    vector: np.ndarray | None          # float32, the flattened delta (zeros where not sent); None once revealed
    sizes: tuple[int, ...] = ()        # values of each of ``names``
    sent: frozenset[str] = frozenset() # the tensors this site sends (SAFL: the layers it selected + the head)
    num_samples: int = 0               # its FedAvg weight, capped by the session's weight_cap
    metrics: dict[str, float] = field(default_factory=dict)  # the global model evaluated on its held-out split
    layout: VectorLayout | None = None # the live session's input layout
    admitted: tuple[str, ...] = ()     # the task's site allow-list (TaskSpec.sites); empty = any enrolled site
    session: ClientSession | None = None
    session_id: str = ""
    answers: dict[str, agent_pb2.SecAggPhase] = field(default_factory=dict)  # incoming body kind -> our answer
    revealed: bool = False             # answered an unmask request: never join another session for this round
    index_fraction: float = 0.0        # the task's "topk:F" codec: a session sums a shared random F of the values
    feedback: ErrorFeedback | None = None  # top-k: residuals of what earlier rounds did not send (``vector`` has them)
    spec: task_pb2.TaskSpec | None = None  # the (owner-signed) task: a distributed-DP plan is checked against it


class SecAggHost(Protocol):
    """What the secure-aggregation client needs of the agent it runs in (hospital_agent.worker.Agent)."""

    site_id: str                 # this site's name, as the aggregator confirmed it
    config: AgentConfig
    outbox: Outbox

    def stub(self) -> agent_pb2_grpc.AgentServiceStub:
        """The stub for the next call (on the current channel)."""

    def upload_with_retries(self, entry: OutboxEntry) -> None:
        """Upload an outbox entry (the masked input), retrying while the aggregator is unavailable."""

    def decline_round(self, task_id: str, rnd: int, reason: str, permanent: bool = False) -> None:
        """Tell the aggregator this site sends nothing for the round, with the reason."""

    def mark_sent(self, task_id: str, rnd: int) -> None:
        """The round is done at this site: never train or send it again."""

    def secagg_policy(self) -> ClientPolicy:
        """The site policy's limits on a session (e.g. the smallest cohort it joins)."""


class SiteSecAgg:
    """The agent's secure-aggregation client: jobs by task, phase handling on the caller's thread."""

    def __init__(self, agent: SecAggHost) -> None:
        self.agent = agent
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    # from the work loop ------------------------------------------------------------------------------
    def resume(self, a: agent_pb2.Assignment) -> bool:
        """The assignment (again, e.g. a new attempt or a reconnected stream) for a round this site already
        trained: join with the vector it holds instead of training (and charging privacy) twice. True when
        handled; False when the site must train."""
        with self._lock:
            job = self._jobs.get(a.task_id)
            if job is None or job.round != a.round or job.model_hash != a.model.model_hash:
                return False
            if job.revealed:
                log.info("round already revealed to the aggregator; not joining another session", round=a.round)
                return True
            # join again even with a session running: after an aggregator restart that session is gone (the
            # aggregator ignores the join of a member of its live session)
            job.attempt = a.attempt
        self._join(job)
        return True

    def ready(self, a: agent_pb2.Assignment, model_hash: str, delta: dict[str, np.ndarray],
              names: list[str], *, num_samples: int = 0, eval_metrics: dict[str, float] | None = None) -> None:
        """Local training of ``a`` is done (and its privacy charged): hold the flattened delta (``names``: the
        tensors it sends, a subset of ``a.send_tensors`` under SAFL), its sample count and evaluation metrics
        (they leave only inside the masked vector), and join."""
        vector, order, sizes = _flatten(a, delta, names)
        if dp_plan.is_distributed(a.spec):  # distributed DP clips the whole update's L2 norm instead
            norm, bound = float(np.linalg.norm(vector)), a.spec.privacy.max_grad_norm
            if norm > bound:
                log.info("update scaled down to the distributed-DP clip norm", norm=round(norm, 6), clip_norm=bound)
        else:
            clip = a.spec.secure_aggregation.clip or 1.0
            peak = float(np.abs(vector).max()) if vector.size else 0.0
            if peak > clip:
                log.warning("delta values beyond the secure-aggregation clip are clipped", peak=round(peak, 6),
                            clip=clip, hint="raise [secure_aggregation] clip or lower the learning rate")
        job = _Job(a.task_id, a.round, a.attempt, model_hash, order, vector, sizes, frozenset(names),
                   int(num_samples), {k: float(v) for k, v in (eval_metrics or {}).items()},
                   admitted=tuple(a.spec.sites), index_fraction=index_fraction_of(a.spec), spec=a.spec)
        if job.index_fraction:
            self._add_residuals(job, a.spec.update.codec)
        with self._lock:
            self._jobs[a.task_id] = job
        log.info("update ready for secure aggregation", values=int(vector.size))
        self._join(job)

    def _add_residuals(self, job: _Job, codec: str) -> None:
        """Top-k under secure aggregation: add the committed error-feedback residual of each sent tensor to the
        vector (what earlier sessions' index sets left out), as the plain top-k codec does."""
        assert job.vector is not None
        path = feedback_path(self.agent.config.work_dir, job.task_id)
        job.feedback = ErrorFeedback.load(path, codec) if path.exists() else ErrorFeedback(codec)
        for name, (start, stop) in _slices(job):
            if name in job.sent:
                job.vector[start:stop] = job.feedback.with_residual(name, job.vector[start:stop])

    def _stage_residuals(self, job: _Job) -> None:
        """What this session's index set does not send becomes each sent tensor's staged residual, durable before
        the masked input exists (committed when the aggregator acknowledges it, hospital_agent.uploader)."""
        assert job.layout is not None and job.vector is not None and job.feedback is not None
        unsent = job.vector.copy()
        unsent[job.layout.index_set()] = 0.0
        for name, (start, stop) in _slices(job):
            if name in job.sent:
                job.feedback.stage(name, unsent[start:stop])
        path = feedback_path(self.agent.config.work_dir, job.task_id)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        job.feedback.save(path)

    def forget(self, task_id: str) -> None:
        """The task was cancelled or ended here: drop its job (keys, shares, vector)."""
        with self._lock:
            self._jobs.pop(task_id, None)

    def _join(self, job: _Job) -> None:
        msg = agent_pb2.SecAggPhase(task_id=job.task_id, round=job.round, join=agent_pb2.SecAggJoin(
            attempt=job.attempt, model_hash=job.model_hash, vector_length=int(job.vector.size),
            metric_names=sorted(job.metrics)))
        if self._send(msg):
            log.info("joined secure aggregation", task_id=job.task_id, round=job.round, attempt=job.attempt)

    def _send(self, msg: agent_pb2.SecAggPhase) -> bool:
        try:
            self.agent.stub().SecAggRespond(msg, timeout=60)
            return True
        except grpc.RpcError as exc:
            log.warning("secure-aggregation message not accepted", body=msg.WhichOneof("body"),
                        error=str(explain_rpc_error(exc, self.agent.config.aggregator)))
            return False

    # phase messages ----------------------------------------------------------------------------------
    def handle(self, msg: agent_pb2.SecAggPhase) -> None:
        """Answer one phase message from the work stream (never raises: failures are logged or declined)."""
        kind = msg.WhichOneof("body")
        with self._lock:
            job = self._jobs.get(msg.task_id)
        if job is None or job.round != msg.round:
            log.info("phase message for a round this site holds no update for; ignored", task_id=msg.task_id,
                     round=msg.round, body=kind)
            return
        if kind == "abort":
            self._on_abort(job, msg)
            return
        if kind != "setup" and msg.session_id != job.session_id:
            log.info("phase message of another session; ignored", body=kind, session=msg.session_id[:16])
            return
        if kind == "setup" and msg.session_id == job.session_id and "setup" not in job.answers:
            return  # a session this site refused or abandoned
        if kind != "setup" and job.session is None and kind not in job.answers:
            log.info("phase message of a session this site refused or left; ignored", body=kind)
            return
        answered = job.answers.get(kind)
        if answered is not None and msg.session_id == job.session_id:
            if answered.WhichOneof("body") is not None:
                self._send(answered)  # a repeated message: the same answer again
            return
        try:
            if kind == "setup":
                answer = self._setup(job, msg)
            elif kind == "key_directory":
                answer = self._share_keys(job, msg)
            elif kind == "masked_input_request":
                answer = self._masked_input(job, msg)
            elif kind == "survivors_request":
                answer = self._sign_survivors(job, msg)
            elif kind == "unmask_request":
                answer = self._unmask(job, msg)
            else:
                log.warning("unexpected phase message from the aggregator; ignored", body=kind)
                return
        except (SecAggError, ValueError) as exc:  # ValueError: malformed hex or sizes in the message
            self._refuse(job, str(exc))
            return
        job.answers[kind] = answer
        if answer.WhichOneof("body") is not None:
            self._send(answer)

    def _reply(self, job: _Job, **body: object) -> agent_pb2.SecAggPhase:
        return agent_pb2.SecAggPhase(task_id=job.task_id, round=job.round, session_id=job.session_id, **body)

    def _setup(self, job: _Job, msg: agent_pb2.SecAggPhase) -> agent_pb2.SecAggPhase:
        s = msg.setup
        job.session, job.session_id, job.answers = None, msg.session_id, {}
        if job.revealed or job.vector is None:
            raise SecAggError("this site already revealed shares for this round; it joins no second session")
        job.layout = _layout_of(job, s)
        params = SessionParams(task_id=job.task_id, round=job.round, cohort=tuple(s.cohort),
                               model_hash=bytes.fromhex(s.model_hash), vector_length=int(s.vector_length),
                               quantizer=job.layout.quantizer, degree=s.degree or None, threshold=s.threshold,
                               nonce=s.nonce, layout_digest=job.layout.digest())
        if params.session_id.hex() != msg.session_id:
            raise SecAggError("the setup's parameters do not hash to its session id (inconsistent setup)")
        policy = self.agent.secagg_policy()
        if job.layout.dp is not None and job.spec is not None:  # the noise plan needs at least floor survivors
            policy = dataclasses.replace(policy, min_cohort=max(policy.min_cohort, floor_of(job.spec)))
        job.session = ClientSession(self.agent.site_id, params, committed_model_hash=bytes.fromhex(job.model_hash),
                                    policy=policy, attestor=self._attestor(),
                                    admitted=job.admitted or None)
        adv = job.session.advertise()
        log.info("secure-aggregation session joined", session=msg.session_id[:16], cohort=len(params.cohort),
                 threshold=params.threshold)
        return self._reply(job, advertise_keys=agent_pb2.SecAggPublicKeys(
            mask_public_key=adv.mask_public_key, encryption_public_key=adv.encryption_public_key,
            keys_statement=task_pb2.SignedStatement.FromString(adv.attestation)))

    def _attestor(self) -> CertificateAttestor:
        """Signs with this agent's certificate key, checks peers against its CA (role agent)."""
        tls = self.agent.config.tls
        return CertificateAttestor(ca_path=tls.ca, role="agent", signer=Signer(key_path=tls.key, cert_path=tls.cert))

    def _share_keys(self, job: _Job, msg: agent_pb2.SecAggPhase) -> agent_pb2.SecAggPhase:
        failpoint("agent.secagg.share-keys")  # kill campaign
        assert job.session is not None
        sid = job.session.params.session_id
        directory = KeyDirectory(sid, tuple(
            AdvertiseKeys(sid, e.site_id, e.mask_public_key, e.encryption_public_key,
                          e.keys_statement.SerializeToString() if e.HasField("keys_statement") else b"")
            for e in msg.key_directory.entries))
        shares = job.session.share_keys(directory)
        return self._reply(job, share_keys=agent_pb2.SecAggShareKeys(ciphertexts=dict(shares.ciphertexts)))

    def _masked_input(self, job: _Job, msg: agent_pb2.SecAggPhase) -> agent_pb2.SecAggPhase:
        assert job.session is not None and job.vector is not None
        failpoint("agent.secagg.before-masked-input")
        r = msg.masked_input_request
        request = MaskedInputRequest(job.session.params.session_id, self.agent.site_id, tuple(r.alive),
                                     dict(r.ciphertexts))
        masked = job.session.masked_input(request, _encode(job)).masked
        if job.layout is not None and job.layout.sparse and job.feedback is not None:
            self._stage_residuals(job)
        header = agent_pb2.UpdateHeader(
            task_id=job.task_id, round=job.round, attempt=job.attempt, base_model_hash=job.model_hash,
            idempotency_key=f"{job.task_id}:{job.round}:{self.agent.site_id}:secagg:{uuid.uuid4().hex}",
            secagg_session_id=job.session_id)
        header.tensors.append(tensors_pb2.TensorHeader(
            name=MASKED_TENSOR, dtype=masked.dtype.name, shape=[int(masked.size)], codec="raw", sha256=tensor_sha256(masked),
            encoded_nbytes=int(masked.nbytes)))
        entry = self.agent.outbox.put(header, {MASKED_TENSOR: masked})
        log.info("masked input ready", nbytes=int(masked.nbytes), session=job.session_id[:16])
        self.agent.upload_with_retries(entry)
        return self._reply(job)  # the answer went through SubmitUpdate

    def _sign_survivors(self, job: _Job, msg: agent_pb2.SecAggPhase) -> agent_pb2.SecAggPhase:
        assert job.session is not None
        signed = job.session.sign_survivors(SurvivorsRequest(job.session.params.session_id,
                                                             tuple(msg.survivors_request.survivors)))
        log.info("survivor set signed", survivors=len(msg.survivors_request.survivors))
        return self._reply(job, survivors_signature=agent_pb2.SecAggSurvivorsSignature(
            statement=task_pb2.SignedStatement.FromString(signed.attestation)))

    def _unmask(self, job: _Job, msg: agent_pb2.SecAggPhase) -> agent_pb2.SecAggPhase:
        failpoint("agent.secagg.unmask")  # kill campaign
        assert job.session is not None
        r = msg.unmask_request
        job.revealed = True  # from here on, never join another session for this round
        signatures = {site: st.SerializeToString() for site, st in r.survivor_signatures.items()}
        response = job.session.unmask(UnmaskRequest(job.session.params.session_id, bytes.fromhex(r.model_hash),
                                                    tuple(r.survivors), tuple(r.dropped), signatures))
        job.vector = None
        self.agent.mark_sent(job.task_id, job.round)
        log.info("unmask shares revealed", survivors=len(r.survivors), dropped=list(r.dropped))
        return self._reply(job, unmask_response=agent_pb2.SecAggUnmaskResponse(
            self_mask_shares=dict(response.self_mask_shares), mask_key_shares=dict(response.mask_key_shares)))

    def _on_abort(self, job: _Job, msg: agent_pb2.SecAggPhase) -> None:
        if msg.session_id and msg.session_id != job.session_id:
            return
        job.session, job.answers = None, {}
        log.warning("secure-aggregation session aborted by the aggregator", reason=msg.abort.reason,
                    rejoin=msg.abort.rejoin)
        if msg.abort.rejoin and not job.revealed and job.vector is not None:
            self._join(job)

    def _refuse(self, job: _Job, reason: str) -> None:
        job.session, job.answers = None, {"setup": agent_pb2.SecAggPhase()}  # answer nothing more in this session
        log.error("secure-aggregation session refused", reason=reason, session=job.session_id[:16])
        self.agent.decline_round(job.task_id, job.round, f"secure aggregation refused: {reason}")


def _flatten(a: agent_pb2.Assignment, delta: dict[str, np.ndarray],
             names: list[str]) -> tuple[np.ndarray, tuple[str, ...], tuple[int, ...]]:
    """The round's update as one float32 vector over all the assignment's tensors (``a.send_tensors``, in order;
    zeros for those not in ``names``), the order, and each tensor's number of values (from the model)."""
    order = tuple(a.send_tensors) or tuple(names)
    manifest = manifest_from_proto(a.model)
    sizes = tuple(int(np.prod(delta[n].shape if n in delta else manifest.tensor(n).shape, dtype=np.int64))
                  for n in order)
    vector = np.zeros(sum(sizes), np.float32)
    offset = 0
    for n, size in zip(order, sizes):
        if n in names:
            vector[offset:offset + size] = np.asarray(delta[n], dtype=np.float32).ravel()
        offset += size
    return vector, order, sizes


def _layout_of(job: _Job, s: agent_pb2.SecAggSetup) -> VectorLayout:
    """The session's input layout as this site reads the setup; raises SecAggError when it does not fit what the
    site trained (other tensors, another length, a subset of layers without per-tensor weights)."""
    if tuple(s.tensor_order) != job.names:
        raise SecAggError(f"the session flattens tensors {list(s.tensor_order)[:3]}...; this site trained "
                          f"{list(job.names)[:3]}...")
    if not s.per_tensor_counts and job.sent != frozenset(job.names):
        raise SecAggError("this site sends only some of the round's tensors (SAFL), but the session has no "
                          "per-tensor weights: the sum would mix layers it did not train")
    if s.index_fraction != job.index_fraction:
        raise SecAggError(f"the session sums a fraction {s.index_fraction:g} of the update's values (0 = all); this "
                          f"site's task codec gives {job.index_fraction:g}")
    quantizer = Quantizer(clip=s.clip, bits=s.bits, rounding=s.rounding,  # type: ignore[arg-type]
                          ring_bits=s.ring_bits or 32, weight_cap=s.weight_cap or 1)
    seed = index_seed(job.task_id, job.round, bytes.fromhex(s.model_hash), s.nonce) if s.index_fraction else b""
    layout = VectorLayout(tuple(zip(job.names, job.sizes)), quantizer, metric_names=tuple(s.metric_names),
                          metric_clip=s.metric_clip or 100.0, per_tensor_counts=s.per_tensor_counts,
                          metric_bits=s.metric_bits or METRIC_BITS, index_fraction=s.index_fraction,
                          index_seed=seed, dp=_dp_encoding_of(job, s))
    layout.check_cohort(len(s.cohort))  # no slot's sum may wrap the ring
    if layout.length != s.vector_length:
        raise SecAggError(f"the session's vector has {s.vector_length} values; this site's update in its layout "
                          f"has {layout.length}")
    return layout


def _dp_encoding_of(job: _Job, s: agent_pb2.SecAggSetup) -> SkellamEncoding | None:
    """The session's distributed-DP encoding, checked against this site's own plan from the signed task: a task
    with privacy level "distributed" never runs a session without it, nor with less noise, another clip, scale or
    rounding than the plan (fedclinic.secagg.dp_plan.check_setup); raises SecAggError."""
    wants = job.spec is not None and dp_plan.is_distributed(job.spec)
    if not s.dp_mechanism:
        if wants:
            raise SecAggError('the signed task asks for distributed DP (privacy level "distributed"); this session '
                              "adds no noise")
        return None
    if not wants or job.spec is None:
        raise SecAggError("the session asks for distributed-DP noise the signed task does not plan")
    values = sum(job.sizes)
    dp_plan.check_setup(job.spec, values, floor_of(job.spec), mechanism=s.dp_mechanism, scale=s.dp_scale,
                        clip_norm=s.dp_clip_norm, beta=s.dp_rounding_beta, site_variance_told=s.dp_site_variance)
    return SkellamEncoding(s.dp_clip_norm, s.dp_scale, s.dp_site_variance, values, s.ring_bits or 32,
                           s.dp_rounding_beta, s.dp_mechanism)


def _slices(job: _Job) -> list[tuple[str, tuple[int, int]]]:
    """Each tensor's ``(start, stop)`` in the job's flattened vector."""
    out, offset = [], 0
    for n, size in zip(job.names, job.sizes):
        out.append((n, (offset, offset + size)))
        offset += size
    return out


def _encode(job: _Job) -> np.ndarray:
    """This site's input in the session's ring: weight x quantized delta (top-k: its shared index set only),
    weights, evaluation metrics."""
    assert job.layout is not None and job.vector is not None
    delta = {n: job.vector[a:b] for n, (a, b) in _slices(job) if n in job.sent}
    metrics = {k: v for k, v in job.metrics.items() if k in job.layout.metric_names}
    if job.layout.dp is not None:  # distributed DP: this site's share of the Skellam noise, from a CSPRNG
        rng = SecureRandom()
        noise = skellam_noise(rng, job.layout.dp.site_variance, job.layout.values)
        return job.layout.encode(delta, weight=1, dp_noise=noise, dp_random=rng)
    return job.layout.encode(delta, weight=job.layout.weight_of(job.num_samples), metrics=metrics)
