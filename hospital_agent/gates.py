"""Gates: the site's checks on an assignment, as a chain of small steps (in the manner of NVFlare's filters).

Each gate looks at an assignment and returns a :class:`Verdict`: *proceed* (the next gate runs), *hold* (the
assignment waits at the site, e.g. for manual approval; the aggregator is told why) or *decline* (with the
reason the task owner sees; *permanent* when the task can never run here). The agent applies the first verdict
that is not *proceed* (hospital_agent.worker). Nothing is downloaded, read or trained before the chain passes:

==========================  ==================================================================================
:class:`SignedTaskGate`     the task is the one its owner signed (spec, round-1 model, task id bound through the
                            idempotency key), by a scientist or admin of the site's CA, an allowed owner
:class:`SpecGate`           the task spec passes the one validator the SDK and the aggregator run
                            (:mod:`fedclinic.spec.validation`), against the model the assignment names
:class:`PolicyGate`         the site policy (families, datasets, required secure aggregation, DP, cohort, epsilon)
:class:`ApprovalGate`       ``approval = "manual"``: a task waits until IT approves it; a rejected one is declined
:class:`TokenizerGate`      the model's tokenizer.json is the one the task declares
:class:`PrivateModulesGate` the private patterns are valid, and the aggregator's send list names no private tensor
==========================  ==================================================================================

After the data contract is read, :meth:`PrivacyBudget.admit` plans and reserves a private task's DP-SGD budget;
after training, :meth:`PrivacyBudget.charge` charges the round before anything leaves. Both decline for good
when the budget refuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Collection, Protocol, Sequence

import structlog

from fedclinic.errors import ConfigError, FedclinicError
from fedclinic.pki.common import PkiError
from fedclinic.pki.signed_statement import SignedStatement
from fedclinic.proto import agent_pb2
from fedclinic.spec.signed_task import verify_signed_task
from fedclinic.spec.validation import spec_problems
from fedclinic.training import private_modules
from fedclinic.transport.wire import manifest_from_proto

from hospital_agent.approvals import APPROVED, REJECTED, ApprovalStore
from hospital_agent.config import AgentConfig
from hospital_agent.privacy_ledger import BudgetExceeded
from hospital_agent.site_privacy import PrivatePlan, SitePrivacy
from hospital_agent.task_bindings import TaskBindings
from hospital_agent.uploader import Audit

log = structlog.get_logger("fedclinic.agent")
#: what the aggregator (and so the task owner) is told while a task waits for approval here
HOLD_AWAITING_APPROVAL = 'awaiting approval by the site\'s IT (approval = "manual")'
PROCEED, HOLD, DECLINE = "proceed", "hold", "decline"


@dataclass(frozen=True)
class Verdict:
    """A gate's answer. ``refused``: the ``assignments_refused`` metric label of a decline; ``audit``: the audit
    record kind written after it; ``notify``: a hold the aggregator has not been told about yet."""

    action: str
    reason: str = ""
    permanent: bool = True
    refused: str = ""
    audit: str = ""
    notify: bool = False

    @property
    def proceed(self) -> bool:
        return self.action == PROCEED


GO = Verdict(PROCEED)


class Gate(Protocol):
    def check(self, a: agent_pb2.Assignment) -> Verdict: ...


class GateChain:
    """Gates in order; the first verdict that is not *proceed* is the chain's."""

    def __init__(self, gates: Sequence[Gate]) -> None:
        self.gates = list(gates)

    def check(self, a: agent_pb2.Assignment) -> Verdict:
        for gate in self.gates:
            verdict = gate.check(a)
            if not verdict.proceed:
                return verdict
        return GO


class SignedTaskGate:
    """Declines, for good, a task that is not the one its owner signed (fedclinic.spec.signed_task), before
    anything is downloaded: the signature must hold against the site's CA, by a ``scientist`` or ``admin``
    certificate, over this spec; round 1 must start from the signed initial model; no round beyond the signed
    ``num_rounds``; the task id must be the one this signed task first came with (:class:`TaskBindings`); with
    ``allowed_owners`` the signer must be one of them; with ``signed_task_max_age_days`` a task not seen here
    before must have been signed within that many days. An unsigned task runs only with
    ``require_signed_tasks = false`` (and no ``allowed_owners``)."""

    def __init__(self, config: AgentConfig, bindings: TaskBindings) -> None:
        self.config = config
        self.bindings = bindings

    def _decline(self, a: agent_pb2.Assignment, reason: str) -> Verdict:
        log.error("assignment refused: not the task its owner signed", task_id=a.task_id, round=a.round,
                  reason=reason)
        return Verdict(DECLINE, f"{reason}; this site trains only the task as its owner signed it, so it declines "
                                "it (nothing was downloaded)", refused="signature", audit="task.refused_signature")

    def check(self, a: agent_pb2.Assignment) -> Verdict:
        policy = self.config.policy
        if not a.HasField("signed_task"):
            if policy.require_signed_tasks:
                return self._decline(a, "the task arrived unsigned and site policy require_signed_tasks is on; the "
                                        "owner must submit it with the fedclinic SDK, which signs it")
            if policy.allowed_owners:
                return self._decline(a, "the task arrived unsigned, so its owner cannot be checked against site "
                                        "policy allowed_owners")
            log.warning("running an unsigned task (require_signed_tasks = false)", task_id=a.task_id)
            return GO
        try:
            model_hash = manifest_from_proto(a.model).model_hash if a.round == 1 else None
            signed = verify_signed_task(SignedStatement.from_proto(a.signed_task), ca_path=self.config.tls.ca,
                                        spec=a.spec, model_hash=model_hash)
        except (PkiError, FedclinicError) as exc:
            return self._decline(a, f"the task's signature does not hold: {exc}")
        # a training task's final evaluation is the phase after its last round (aggregator_service.results)
        last = a.spec.rounds.num_rounds + (1 if a.work == "evaluate" and not a.spec.kind else 0)
        if not 1 <= a.round <= last:
            return self._decline(a, f"round {a.round} is outside the {a.spec.rounds.num_rounds} round(s) the owner "
                                    "signed")
        owner = signed.signer.name
        if policy.allowed_owners and owner not in policy.allowed_owners:
            log.warning("assignment refused by site policy", reason="owner not allowed", owner=owner)
            return Verdict(DECLINE, f"site policy allowed_owners does not include the task's owner {owner!r}; this "
                                    "site trains only for " + ", ".join(repr(o) for o in policy.allowed_owners),
                           refused="policy", audit="task.refused_by_policy")
        max_days = policy.signed_task_max_age_days
        age_days = (time.time() * 1000 - signed.signed_unix_ms) / 86_400_000
        if (max_days is not None and age_days > max_days
                and not self.bindings.known(owner=owner, idempotency_key=signed.idempotency_key)):
            return self._decline(a, f"the task was signed {age_days:.1f} days ago and site policy "
                                    f"signed_task_max_age_days = {max_days:g} lets this site start only tasks signed "
                                    "more recently; the owner must submit it again")
        problem = self.bindings.bind(owner=owner, idempotency_key=signed.idempotency_key, task_id=a.task_id,
                                     statement_id=signed.statement_id)
        if problem:
            return self._decline(a, problem)
        return GO


class SpecGate:
    """Declines, for good, a task whose spec the SDK's own validator refuses (against the model it names).

    The aggregator runs the same check at submit; this one means that an aggregator of another version, or one
    that altered a spec after submit, still cannot make this site train something the rules forbid."""

    def check(self, a: agent_pb2.Assignment) -> Verdict:
        try:
            problems = spec_problems(a.spec, manifest_from_proto(a.model))
        except FedclinicError as exc:
            problems = [f"the assignment's model manifest is unusable: {exc}"]
        if not problems:
            return GO
        reason = ("task spec rejected at this site (fedclinic.spec.validation): " + "; ".join(problems)
                  + "; the task owner must fix and resubmit the task")
        log.warning("assignment refused: invalid task spec", task_id=a.task_id, problems=problems)
        return Verdict(DECLINE, reason, refused="spec", audit="task.refused_invalid_spec")


class PolicyGate:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    def check(self, a: agent_pb2.Assignment) -> Verdict:
        refusal = self.config.policy.refusal(a.spec, self.config.datasets)
        if not refusal:
            return GO
        log.warning("assignment refused by site policy", reason=refusal)
        return Verdict(DECLINE, refusal, refused="policy", audit="task.refused_by_policy")


class ApprovalGate:
    """Records each task in the approval store; under ``approval = "manual"`` a task not approved yet is held (the
    aggregator sees a slow site: the round waits for it until its deadline) and re-checked by :meth:`decided`; a
    rejected one is declined for good with the reason."""

    def __init__(self, config: AgentConfig, approvals: ApprovalStore, audit: Audit,
                 site_name: Callable[[], str]) -> None:
        self.config = config
        self.approvals = approvals
        self.audit = audit
        self._site_name = site_name
        #: the latest assignment of each task waiting for approval
        self.held: dict[str, agent_pb2.Assignment] = {}

    def check(self, a: agent_pb2.Assignment) -> Verdict:
        rec, what = self.approvals.observe(a, auto=self.config.policy.approval == "auto",
                                           decided_by="site policy (approval = \"auto\")")
        if what:
            if rec.state == APPROVED:
                self.audit("task.approved", a.task_id, by=rec.decided_by, mode="auto", spec_sha256=rec.spec_sha256,
                           name=a.spec.name)
            else:
                self.audit("task.awaiting_approval", a.task_id, round=a.round, spec_sha256=rec.spec_sha256,
                           name=a.spec.name, **({"note": rec.note} if rec.note else {}))
        if rec.state == APPROVED:
            self.held.pop(a.task_id, None)
            return GO
        if rec.state == REJECTED:
            self.held.pop(a.task_id, None)
            return Verdict(DECLINE, f"rejected at {self._site_name()}: {rec.reason}", refused="rejected")
        previous = self.held.get(a.task_id)
        if previous is None or what:
            log.warning("task awaiting approval at this site; nothing is fetched or trained until then",
                        name=a.spec.name, approve=f"hospital-agent tasks approve {a.task_id} --config ...",
                        show=f"hospital-agent tasks show {a.task_id} --config ...")
        self.held[a.task_id] = a
        return Verdict(HOLD, HOLD_AWAITING_APPROVAL, notify=previous is None or previous.round != a.round)

    def decided(self, cancelled: Collection[str]) -> list[tuple[agent_pb2.Assignment, bool]]:
        """Held assignments whose task has been decided since (approved: True), removed from the held set;
        cancelled tasks are dropped."""
        if not self.held:
            return []
        for task_id in [t for t in self.held if t in cancelled]:
            del self.held[task_id]
        states = self.approvals.states(list(self.held))
        out = []
        for task_id, a in list(self.held.items()):
            if states.get(task_id) in (APPROVED, REJECTED):
                del self.held[task_id]
                out.append((a, states[task_id] == APPROVED))
        return out


class TokenizerGate:
    def check(self, a: agent_pb2.Assignment) -> Verdict:
        declared = {f.path: f.sha256 for f in a.model.files}.get("tokenizer.json", "")
        if a.spec.tokenizer_sha256 and declared != a.spec.tokenizer_sha256:
            reason = ("the model's tokenizer.json is not the tokenizer the task declares (tokenizer_sha256); refusing "
                      "to train with it")
            log.error("assignment refused", error=reason)
            return Verdict(DECLINE, reason, permanent=False, refused="data")
        return GO


class PrivateModulesGate:
    def check(self, a: agent_pb2.Assignment) -> Verdict:
        try:
            private = private_names(a)
        except ConfigError as exc:
            return Verdict(DECLINE, str(exc))
        asked = private_modules.outgoing_problems(a.send_tensors, private)
        if not asked:
            return GO
        # the aggregator's send list must never name a private tensor: refuse the task, send nothing
        reason = (f"the aggregator asked this site to send {len(asked)} private tensor(s): {asked[0]}; this site "
                  "keeps private modules to itself, so it refuses the task")
        log.error("assignment refused: private tensors requested", reason=reason)
        return Verdict(DECLINE, reason, refused="policy", audit="task.refused_private_requested")


def private_names(a: agent_pb2.Assignment) -> list[str]:
    """The assignment's private tensors (its private patterns over the model's tensors); ConfigError if invalid."""
    return private_modules.private_names([t.name for t in a.model.tensors], a.spec.update.private_patterns,
                                         frozen=a.spec.update.frozen_patterns)


class PrivacyBudget:
    """Sample-level DP's two gates: admit a private task against the dataset's budget (once, before any download),
    and charge each trained round before its update leaves."""

    def __init__(self, privacy: SitePrivacy) -> None:
        self.privacy = privacy

    def admit(self, a: agent_pb2.Assignment, num_examples: int, batch_size: int, local_epochs: int,
              num_patients: int | None = None) -> tuple[Verdict, PrivatePlan | None]:
        try:
            plan = self.privacy.admit(a.task_id, a.spec, num_examples, batch_size=batch_size,
                                      local_epochs=local_epochs, num_patients=num_patients)
        except (BudgetExceeded, ConfigError) as exc:
            log.warning("private task refused", reason=str(exc))
            return Verdict(DECLINE, str(exc), refused="privacy_budget", audit="task.refused_by_privacy_budget"), None
        return GO, plan

    def charge(self, a: agent_pb2.Assignment, plan: PrivatePlan) -> tuple[Verdict, agent_pb2.DpReport | None]:
        try:
            report = self.privacy.charge(a.task_id, a.spec, a.round, plan)
        except BudgetExceeded as exc:
            log.warning("update withheld: privacy budget", reason=str(exc))
            return Verdict(DECLINE, str(exc), refused="privacy_budget", audit="update.withheld_by_privacy_budget"), None
        log.info("privacy charged", epsilon=round(report.epsilon, 4), delta=report.delta)
        return GO, report


__all__ = ["ApprovalGate", "DECLINE", "GO", "Gate", "GateChain", "HOLD", "HOLD_AWAITING_APPROVAL", "PROCEED",
           "PolicyGate", "PrivacyBudget", "PrivateModulesGate", "SignedTaskGate", "SpecGate", "TokenizerGate",
           "Verdict", "private_names"]
