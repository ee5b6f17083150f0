"""``fedclinic task verify``: check a task's public records against the sites' signed round statements.

For every round the verifier checks (:func:`verify_task`):

1. every statement: signed by the agent certificate of the site it names (fedclinic.verification.records);
2. one model per round: every site trained from the same base model, and that is the model the round declares;
   otherwise a **split view**, naming which sites got which model;
3. the chain: round 1 started from the task's initial model, round r from round r-1's result;
4. the aggregate: the round's published model is the declared aggregate of the committed updates, recomputed
   (fedclinic.verification.recompute) from the published updates (plain rounds) or from the unmasked sum and
   its survivors (secure rounds, each survivor with a statement of that session); a round that cannot be
   recomputed says why;
5. the task's final model is its last round's result.

Any failure makes the verdict FAILED (the CLI exits 1); a round not recomputed is a note, not a failure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fedclinic.errors import FedclinicError, IntegrityError
from fedclinic.proto import control_pb2
from fedclinic.verification.recompute import (decode_update, differences, plain_round, secure_round,
                                              why_not_recomputed)
from fedclinic.verification.records import RecordSource, RoundView, checked_blob, read_statements

CLOSED = control_pb2.ROUND_STATE_CLOSED


@dataclass
class RoundResult:
    """What the verifier found for one round."""

    round: int
    base_model: str
    model: str
    sites: list[str]
    aggregate: str               # "recomputed: matches", "recomputed: DIFFERS", "not recomputed: ..."
    failures: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    """The whole check: per-round results, failures (each names the round and what is wrong), notes."""

    task_id: str
    rounds: list[RoundResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "ok": self.ok, "failures": self.failures, "notes": self.notes,
                "rounds": [r.__dict__ for r in self.rounds]}

    def text(self) -> str:
        lines = [f"task {self.task_id}: {len(self.rounds)} round(s) checked",
                 f"{'round':>5}  {'base model':<12}  {'result':<12}  {'sites':<24}  aggregate"]
        for r in self.rounds:
            lines.append(f"{r.round:>5}  {r.base_model[:12]:<12}  {(r.model or '-')[:12]:<12}  "
                         f"{', '.join(r.sites) or '-':<24}  {r.aggregate}")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"FAILED: {f}" for f in self.failures]
        lines.append("verdict: " + ("OK: every statement is signed, every site of a round trained from the same "
                                    "model, and the chain of models holds" if self.ok else
                                    f"FAILED ({len(self.failures)} problem(s) above)"))
        return "\n".join(lines)


def _short(h: str) -> str:
    return h[:12] if h else "(none)"


def verify_task(source: RecordSource, task_id: str, ca_path: str, *, recompute: bool = True) -> Verdict:
    """Run every check of the module docstring on ``task_id``'s records from ``source``; ``recompute`` False (a
    site's reading, fedclinic.verification.site_records) skips step 4 and says so for each round."""
    records = source.task_records(task_id)
    verdict = Verdict(task_id)
    spec = records.spec
    previous = records.initial_model_hash
    models: dict[int, tuple[dict, str]] = {}

    def model(rnd: int) -> tuple[dict, str]:  # the tensors after round rnd (-1: initial) and their verified hash
        if rnd not in models:
            package, h = source.fetch_model(task_id, rnd)
            models[rnd] = (package.tensors, h)
        return models[rnd]

    last_closed = None
    for rec in records.rounds:
        view = read_statements(task_id, rec, ca_path)
        result = RoundResult(rec.round, rec.base_model_hash, rec.model_hash,
                             sorted(s.site for s in view.statements), "")
        result.failures += view.problems
        if rec.state != CLOSED:
            result.aggregate = "not checked: the round did not close"
            verdict.rounds.append(result)
            continue
        _check_bases(view, previous, records.initial_model_hash, result)
        result.aggregate = (_check_aggregate(source, task_id, spec, view, model, result) if recompute else
                            "not recomputed: read by a site (statements, models given and chain checked)")
        verdict.rounds.append(result)
        if result.aggregate.startswith("not recomputed"):
            verdict.notes.append(f"round {rec.round}: {result.aggregate}")
        previous, last_closed = rec.model_hash, rec
    if records.final_model_hash and (last_closed is None or records.final_model_hash != last_closed.model_hash):
        verdict.failures.append(f"the task's final model {_short(records.final_model_hash)} is not the result of its "
                                f"last round ({_short(last_closed.model_hash if last_closed else '')})")
    verdict.failures = [f for r in verdict.rounds for f in r.failures] + verdict.failures
    return verdict


def _check_bases(view: RoundView, previous: str, initial: str, result: RoundResult) -> None:
    """One model for the round, the one it declares, following the previous round's result."""
    rec = view.record
    by_base: dict[str, list[str]] = {}
    for st in view.statements:
        by_base.setdefault(st.base_model, []).append(st.site)
    if len(by_base) > 1:
        got = "; ".join(f"{', '.join(sorted(sites))} trained from {_short(h)}" for h, sites in sorted(by_base.items()))
        result.failures.append(f"round {rec.round}: split view: the sites were given different models ({got})")
    strays = sorted(s for h, sites in by_base.items() if h != rec.base_model_hash for s in sites)
    if strays and len(by_base) == 1:
        result.failures.append(f"round {rec.round}: {', '.join(strays)} trained from "
                               f"{_short(next(iter(by_base)))}, not from the model the round declares "
                               f"({_short(rec.base_model_hash)})")
    if rec.base_model_hash != previous:
        what = "the task's initial model" if previous == initial and rec.round == 1 else "the previous round's result"
        result.failures.append(f"round {rec.round}: it started from {_short(rec.base_model_hash)}, not from {what} "
                               f"({_short(previous)}): a model nobody aggregated")


def _check_aggregate(source: RecordSource, task_id: str, spec, view: RoundView, model, result: RoundResult) -> str:
    rec = view.record
    if not view.statements:
        result.failures.append(f"round {rec.round}: no site statement: nothing shows which updates made its model")
        return "not recomputed: no statements"
    why = why_not_recomputed(spec, rec)
    if why:
        return why
    try:
        base, base_hash = model(rec.round - 1 if rec.round > 1 else -1)
        published, published_hash = model(rec.round)
        if published_hash != rec.model_hash:
            result.failures.append(f"round {rec.round}: the aggregator served model {_short(published_hash)} as the "
                                   f"round's result, but its records declare {_short(rec.model_hash)}")
            return "recomputed: DIFFERS"
        if base_hash != rec.base_model_hash:
            return "not recomputed: the round's base is not the previous round's result (see above)"
        if rec.secure:
            survivors = set(rec.survivors)
            session = json.loads(rec.secure_params_json).get("session", "")
            signed = {s.site for s in view.statements if s.secagg_session and s.secagg_session == session}
            missing = sorted(survivors - signed)
            if missing:
                result.failures.append(f"round {rec.round}: the secure sum counts {', '.join(missing)}, who signed no "
                                       f"masked input for its session {session[:16]}")
            blob = checked_blob(source, task_id, rec.secure_sum_sha256, f"round {rec.round}'s secure sum")
            recomputed = secure_round(spec, base, rec, blob)
            result.sites = sorted(survivors)
        else:
            updates = [(st, decode_update(st, lambda sha, what: checked_blob(source, task_id, sha,
                                                                             f"round {rec.round}: {what}")))
                       for st in sorted(view.statements, key=lambda s: s.site)]
            recomputed = plain_round(spec, base, updates)
    except (IntegrityError, FedclinicError, ValueError, KeyError, TypeError) as exc:
        result.failures.append(f"round {rec.round}: could not recompute its model: {exc}")
        return "recomputed: FAILED"
    diff = differences(recomputed, published)
    if diff:
        kind = "unmasked secure sum" if rec.secure else "committed updates"
        result.failures.append(f"round {rec.round}: the published model {_short(rec.model_hash)} is not the "
                               f"{spec.strategy or 'fedavg'} aggregate of the {kind}: {', '.join(diff[:5])}"
                               + (f" and {len(diff) - 5} more" if len(diff) > 5 else ""))
        return "recomputed: DIFFERS"
    return "recomputed: matches"


__all__ = ["RoundResult", "Verdict", "verify_task"]
