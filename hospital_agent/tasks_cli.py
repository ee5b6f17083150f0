"""``hospital-agent tasks list | show ID | approve ID | reject ID --reason ...``: review tasks at the site.

Reads and writes the agent's approval store (hospital_agent.approvals) and appends decisions to the site's
audit trail (``WORK_DIR/audit.jsonl``); no network. The running agent picks a decision up within a second.
"""

from __future__ import annotations

import datetime as dt
import getpass
import math
import sys


from fedclinic.runtime.proto_json import message_to_json
from fedclinic.errors import FedclinicError
from fedclinic.proto import task_pb2

from hospital_agent.approvals import ApprovalStore, TaskApproval
from fedclinic.privacy.accounting import plan_for_config
from fedclinic.runtime.audit_log import AuditLog
from hospital_agent.config import AgentConfig
from hospital_agent.site_data import has_eval, read_ids, read_rows


def _when(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if ms else "-"


def _store(config):
    return ApprovalStore(config.work_dir / "approvals.sqlite")


def list_tasks(config) -> int:
    rows = _store(config).all()
    if not rows:
        print("no task has been offered to this site yet")
        return 0
    print(f"{'task':<16} {'state':<9} {'name':<24} {'dataset':<14} {'rounds':>6}  {'first seen':<23} decided by")
    for r in rows:
        print(f"{r.task_id:<16} {r.state:<9} {r.spec.name[:24]:<24} {r.spec.dataset[:14]:<14} "
              f"{r.spec.rounds.num_rounds:>6}  {_when(r.first_seen_ms):<23} {r.decided_by or '-'}"
              + (f" ({r.reason})" if r.reason else "") + (f"  [{r.note}]" if r.note else ""))
    pending = sum(r.state == "pending" for r in rows)
    if pending:
        print(f"\n{pending} task(s) pending: review with `hospital-agent tasks show ID`, then approve or reject")
    return 0


def _planned_epsilon(config, spec: task_pb2.TaskSpec) -> str:
    """The epsilon this task would spend on the local dataset (the same plan the agent admits), or why not."""
    pc = spec.privacy
    entry = config.datasets.get(spec.dataset)
    if entry is None:
        return f"not computable: this site has no dataset {spec.dataset!r}"
    try:
        rows = read_rows(entry, spec)
        units, unit = len(rows), "local examples"
        if pc.unit == "patient":
            if not entry.group_field:
                return (f"not computable: the task protects each patient but dataset {spec.dataset!r} declares no "
                        "group_field, so the agent will decline it")
            units = len(set(read_ids(entry, rows=len(rows))))
            unit = f"local patients ({len(rows)} rows)"
        plan = plan_for_config(pc, num_examples=units, batch_size=spec.training.batch_size or 16,
                               local_epochs=spec.training.local_epochs or 1, rounds=spec.rounds.num_rounds)
    except FedclinicError as exc:
        return f"not computable: {exc}"
    budget = ""
    if entry.privacy_epsilon is not None:
        budget = f"; the dataset's budget is epsilon {entry.privacy_epsilon:g} (delta {entry.privacy_delta:g})"
    else:
        budget = "; the dataset has no privacy budget, so the agent will refuse this task"
    return (f"{plan.planned_epsilon:.3f} (delta {plan.delta:g}) over {plan.rounds} round(s) on {units} {unit}: noise multiplier {plan.noise_multiplier:.3f}, sampling rate {plan.sample_rate:.4f}, "
            f"{plan.steps_per_round} step(s) per round{budget}")


def describe(config, r: TaskApproval) -> str:
    spec = r.spec
    rc, tc, pc, sa = spec.rounds, spec.training, spec.privacy, spec.secure_aggregation
    lines = [f"task {r.task_id}: {spec.name!r}" + (f" ({spec.description})" if spec.description else ""),
             f"  state: {r.state}" + (f", by {r.decided_by} at {_when(r.decided_ms)}" if r.decided_by else "")
             + (f": {r.reason}" if r.reason else "") + (f" [{r.note}]" if r.note else ""),
             f"  first offered: {_when(r.first_seen_ms)}; last assignment: round {r.round}, model {r.model_hash[:16]}",
             f"  spec sha256: {r.spec_sha256} (an approval covers exactly this spec and tensor list)",
             "",
             "what runs here:",
             f"  {spec.family} / {spec.architecture or 'default'} on dataset {spec.dataset!r}"
             + (f", labels {list(spec.labels)}" if spec.labels else ""),
             f"  {rc.num_rounds} round(s); quorum {rc.min_sites} site(s), participation {rc.participation_fraction:g}, "
             f"round timeout {rc.round_timeout_s:g} s, on quorum miss: "
             f"{task_pb2.QuorumPolicy.Name(rc.on_quorum_miss).removeprefix('QUORUM_POLICY_').lower()}",
             f"  training per round: {tc.local_epochs} epoch(s), batch {tc.batch_size}, lr {tc.learning_rate:g}, "
             f"optimizer {tc.optimizer or 'default'}" + (f", at most {tc.max_steps} step(s)" if tc.max_steps else ""),
             f"  strategy: {spec.strategy or 'fedavg'}; sites: {', '.join(spec.sites) or 'any enrolled site'}",
             "",
             f"what would leave this site, once per round ({rc.num_rounds} round(s)):"]
    nparams = sum(math.prod(shape) for _, _, shape, _ in r.send_tensors)
    nbytes = sum(n for _, _, _, n in r.send_tensors)
    codec = spec.update.codec or "raw"
    if sa.enabled:
        lines.append(f"  secure aggregation ON: only a masked, quantized vector of the delta of these "
                     f"{len(r.send_tensors)} tensor(s) ({nparams} values, {sa.bits or 20}-bit, clipped to "
                     f"+/-{sa.clip or 1.0:g}); the aggregator learns only the sum over at least "
                     f"{max(sa.min_cohort, config.policy.secure_aggregation_min_cohort)} sites "
                     f"(threshold {sa.threshold or 'default'}, this site's floor "
                     f"{config.policy.secure_aggregation_min_cohort}); no sample count or metrics travel with it")
    else:
        lines.append(f"  the update: delta (local - global) of {len(r.send_tensors)} tensor(s), {nparams} values "
                     f"({nbytes} bytes before encoding), codec {codec!r}")
    for name, dtype, shape, _n in r.send_tensors:
        lines.append(f"    {name}  {dtype}  {list(shape)}")
    if not sa.enabled:
        lines.append("  secure aggregation: off (the aggregator sees this site's update itself)")
        entry = config.datasets.get(spec.dataset)
        evaluates = entry is not None and has_eval(entry)
        lines.append("  beside it: the number of training examples, training metrics (loss, train_seconds)"
                     + (", and metrics of the global model on this site's held-out split (eval_path)"
                        if evaluates else "; no evaluation metrics (no eval_path configured)"))
    if pc.level == "sample":
        target = (f"target epsilon {pc.target_epsilon:g}" if pc.target_epsilon
                  else f"noise multiplier {pc.noise_multiplier:g}")
        lines.append(f"  differential privacy: sample-level DP-SGD at this site, {target}, delta "
                     f"{pc.target_delta:g}, per-example clip {pc.max_grad_norm or 1.0:g}, accountant "
                     f"{pc.accountant or 'rdp'}; the epsilon spent so far travels with each update")
        lines.append(f"  planned epsilon: {_planned_epsilon(config, spec)}")
    elif pc.level == "distributed":
        target = (f"target epsilon {pc.target_epsilon:g}" if pc.target_epsilon
                  else f"noise multiplier {pc.noise_multiplier:g}")
        lines.append(f"  differential privacy: distributed (client-level), {pc.mechanism or 'skellam'} noise added "
                     f"by this site inside secure aggregation: the whole update clipped to L2 norm "
                     f"{pc.max_grad_norm:g}, {target} over all rounds, delta {pc.target_delta or 1e-5:g}; the "
                     "aggregator sees only the noised sum")
    elif pc.level == "client":
        lines.append(f"  differential privacy: client-level at the aggregator (clip {pc.max_grad_norm:g}, noise "
                     f"{pc.noise_multiplier:g}); the update leaves this site un-noised")
    else:
        lines.append("  differential privacy: none")
    lines += ["", "declarative spec, as the aggregator sent it:",
              message_to_json(spec)]  # 64-bit fields (the seed) as numbers
    return "\n".join(lines)


def show_task(config, task_id: str) -> int:
    r = _store(config).get(task_id)
    if r is None:
        print(f"error: this site has not been offered task {task_id!r}; `hospital-agent tasks list` shows the "
              "tasks it has seen", file=sys.stderr)
        return 2
    print(describe(config, r))
    return 0


def decide(config, task_id: str, *, approve: bool, reason: str = "") -> int:
    by = f"site-admin:{getpass.getuser()}"
    r = _store(config).decide(task_id, approve=approve, by=by, reason=reason)
    with AuditLog(config.work_dir / "audit.jsonl", on_torn_tail="quarantine") as audit:
        if approve:
            audit.append("task.approved", actor=by, task_id=task_id, by=by, mode="manual",
                         spec_sha256=r.spec_sha256, name=r.spec.name)
        else:
            audit.append("task.rejected", actor=by, task_id=task_id, by=by, reason=r.reason,
                         spec_sha256=r.spec_sha256, name=r.spec.name)
    if approve:
        print(f"task {task_id} approved; the agent starts it with the next assignment (within a second if it is "
              "waiting for one)")
    else:
        print(f"task {task_id} rejected; the agent declines it for good and the reason reaches its owner")
    return 0


def add_commands(sub) -> None:
    tasks = sub.add_parser("tasks", help="review the tasks offered to this site; approve or reject them")
    tsub = tasks.add_subparsers(dest="tasks_command", required=True)
    p = tsub.add_parser("list", help="tasks offered to this site, pending, approved or rejected")
    p.add_argument("--config", required=True)
    p = tsub.add_parser("show", help="a task's spec and exactly what would leave the site")
    p.add_argument("task_id")
    p.add_argument("--config", required=True)
    p = tsub.add_parser("approve", help="let a pending task run at this site")
    p.add_argument("task_id")
    p.add_argument("--config", required=True)
    p = tsub.add_parser("reject", help="decline a task for good; the reason reaches its owner")
    p.add_argument("task_id")
    p.add_argument("--reason", required=True, help="why (sent to the task's owner)")
    p.add_argument("--config", required=True)


def run(args) -> int:
    try:
        config = AgentConfig.load(args.config)
        if args.tasks_command == "list":
            return list_tasks(config)
        if args.tasks_command == "show":
            return show_task(config, args.task_id)
        return decide(config, args.task_id, approve=args.tasks_command == "approve",
                      reason=getattr(args, "reason", "") or "")
    except FedclinicError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
