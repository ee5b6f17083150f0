"""Result phases: the final model's evaluation, "evaluate" and "statistics" tasks, and the sites' results.

A **result phase** is a task's work that trains nothing and ends with a site x model matrix:

- after the last round of a training task (kind "", not under secure aggregation, whose sites reveal only
  sums), every site that trained (an update or a signed round statement in some round,
  :meth:`Store.reported_sites`) and announced :data:`FEATURE` at Hello evaluates the final model on its held-out split ("final"; with private modules also "own" = final shared tensors + its private
  ones). The task stays RUNNING during the phase and is COMPLETED when it closes: the final model is downloadable
  from the moment the last round closed; ``completed`` means "trained and evaluated". With no such site the task
  completes at once, as before;
- a task of kind "evaluate" (the submitted model, or the final model of a finished task of the same owner,
  ``[evaluation] model_task``) or "statistics" has only this phase, numbered 1, opened when it is submitted.

The phase's number is its ``round`` in the task's assignments (last round + 1, or 1), so Decline, Hold and the
stake checks (aggregator_service.stakes) apply to it unchanged. It closes when every site given the work has
answered or declined (an "evaluate"/"statistics" task open to any site: every eligible connected site, and at
least one answered), or at its deadline (``[evaluation] timeout_s``, else the round timeout); sites that did not
answer leave empty cells and never fail the task.

``SubmitResult`` (:meth:`ResultPhases.submit`) takes a site's values (flat ``name -> number``, checked by
:func:`check_values`) only from a site assigned to that task and phase (PERMISSION_DENIED otherwise, the same
whether the task exists or not; nothing written), for the phase's own model; a second copy of a cell is
acknowledged and ignored. A training round's evaluation sent after the update (work "round-eval") is kept while
the round is open or, once closed, while it is the task's newest closed round of a running task: its
``eval_*`` figures are recomputed with it (:func:`aggregator_service.round_metrics.evaluation_metrics`); later
than that it is dropped (answered, not an error). Callers hold the engine's lock.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import grpc
import structlog

from fedclinic.errors import Refused
from fedclinic.evaluation.combine import pool_evaluations
from fedclinic.proto import agent_pb2, control_pb2, task_pb2
from fedclinic.transport.wire import manifest_to_proto

from aggregator_service.round_metrics import evaluation_metrics
from aggregator_service.stakes import require_assignment
from aggregator_service.store import ResultPhaseRecord, SiteResultRecord, Store, StoreTransaction, now_ms
from aggregator_service.update_admission import sent_tensors

log = structlog.get_logger("fedclinic.aggregator.results")

S = control_pb2
#: the Hello feature of agents that take result work and speak SubmitResult
FEATURE = "results-v1"
EVALUATE, STATISTICS, ROUND_EVAL = "evaluate", "statistics", "round-eval"
#: the models a phase's cells may name, by (task kind, work)
PHASE_MODELS = {("", EVALUATE): ("final", "own"), (EVALUATE, EVALUATE): ("model",),
                (STATISTICS, STATISTICS): ("statistics",)}
ROUND_MODEL = "round"
#: most values one result may carry (the contract: at least 8,192 keys per site per result)
MAX_RESULT_KEYS = 16_384
#: longest value name (ASCII)
MAX_KEY_CHARS = 200
#: largest k a site may ask for
MAX_MIN_CELL = 1_000_000


def task_kind(spec: task_pb2.TaskSpec) -> str:
    """"" (train), "evaluate" or "statistics"."""
    return spec.kind if spec.kind in (EVALUATE, STATISTICS) else ""


def check_values(values: "dict[str, float] | Iterable", where: str) -> dict[str, float]:
    """``values`` as a plain dict, or Refused INVALID_ARGUMENT saying what is wrong: at most
    :data:`MAX_RESULT_KEYS` entries, names of 1-:data:`MAX_KEY_CHARS` printable ASCII characters, finite numbers."""
    out = dict(values)
    if len(out) > MAX_RESULT_KEYS:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"{where} has {len(out)} values; at most {MAX_RESULT_KEYS} are taken per result: send fewer "
                      "(e.g. fewer labels or bins)")
    for k, v in out.items():
        if not 0 < len(k) <= MAX_KEY_CHARS or not k.isascii() or not k.isprintable():
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{where}: value name {k[:40]!r} must be 1-{MAX_KEY_CHARS} printable ASCII characters")
        if not math.isfinite(v):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: value {k!r} is {v}; send finite numbers only")
    return out


class ResultPhases:
    """Result phases and the sites' results (module docstring). ``eligible(task_id, spec, site)`` and
    ``connected()`` come from aggregator_service.sites."""

    def __init__(self, store: Store, eligible: Callable[[str, task_pb2.TaskSpec, str], bool],
                 connected: Callable[[], list[str]]) -> None:
        self.store = store
        self._eligible = eligible
        self._connected = connected
        #: sites that announced FEATURE at their latest Hello, and those whose latest Hello did not (an older agent:
        #: no phase waits for it; a site not heard from since a restart is still waited for, until the deadline)
        self._capable: set[str] = set()
        self._incapable: set[str] = set()

    def hello(self, site: str, features: Iterable[str]) -> None:
        if FEATURE in set(features):
            self._capable.add(site)
            self._incapable.discard(site)
        else:
            self._capable.discard(site)
            self._incapable.add(site)

    # opening and closing -----------------------------------------------------------------------------------
    def open_after_training(self, tx: StoreTransaction, task_id: str, spec: task_pb2.TaskSpec, last_round: int,
                            model_hash: str) -> bool:
        """In the transaction that closes the last round: open the final model's evaluation when a site that
        trained can take it; False (the caller completes the task now) when none can, or when the task runs under
        secure aggregation (its sites reveal only sums: a per-site matrix would be new; an "evaluate" task asks
        for one explicitly, under each site's policy)."""
        if spec.secure_aggregation.enabled:
            return False
        if not any(s in self._capable for s in self.store.reported_sites(task_id)):
            return False
        self._open(tx, task_id, spec, last_round + 1, EVALUATE, model_hash,
                   "final model: evaluation by the sites that trained opened")
        return True

    def open_for_task(self, tx: StoreTransaction, task_id: str, spec: task_pb2.TaskSpec, model_hash: str) -> None:
        """Open the only phase of an "evaluate" or "statistics" task (in its creating transaction)."""
        work = STATISTICS if task_kind(spec) == STATISTICS else EVALUATE
        what = "statistics of the sites' data" if work == STATISTICS else f"evaluation of model {model_hash[:12]}"
        self._open(tx, task_id, spec, 1, work, model_hash if work == EVALUATE else "", f"{what} opened")

    def _open(self, tx: StoreTransaction, task_id: str, spec: task_pb2.TaskSpec, rnd: int, work: str,
              model_hash: str, message: str) -> None:
        timeout = spec.evaluation.timeout_s or spec.rounds.round_timeout_s
        opened = now_ms()
        tx.open_result_phase(ResultPhaseRecord(task_id, rnd, work, model_hash, opened, opened + int(timeout * 1000), 0))
        tx.add_event(task_id, "results-opened", f"{message}; deadline in {timeout:g} s", round=rnd, work=work,
                     model_hash=model_hash)

    def maybe_close(self, task_id: str) -> None:
        """Close the task's phase when nobody else is expected to answer (module docstring)."""
        phase = self.store.result_phase(task_id)
        task = self.store.task(task_id)
        if phase is None or phase.closed_ms or task is None or task.state != S.TASK_STATE_RUNNING:
            return
        answered = {r.site for r in self.store.results_of(task_id, phase.round)}
        declined = {a.site for a in self.store.assignments_of(task_id, phase.round) if a.declined}
        done = answered | declined
        if task_kind(task.spec) == "" or task.spec.sites:
            expected = set(self._expected(task_id, task.spec, phase))
            if expected <= done:
                self.close(task_id)
        elif answered and all(s in done for s in self._connected()
                              if s in self._capable and self._eligible(task_id, task.spec, s)):
            self.close(task_id)

    def _expected(self, task_id: str, spec: task_pb2.TaskSpec, phase: ResultPhaseRecord) -> list[str]:
        """The sites a phase waits for: those that trained (final evaluation), else the task's named sites."""
        if task_kind(spec) == "":
            return [s for s in self.store.reported_sites(task_id) if s not in self._incapable]
        return [s for s in spec.sites if not self.store.declined_for_good(task_id, s) and s not in self._incapable]

    def tick(self) -> float:
        """Close phases whose deadline passed; seconds until the next deadline (at most 1)."""
        wait = 1.0
        now = now_ms()
        for phase in self.store.open_result_phases():
            if now >= phase.deadline_ms:
                self.close(phase.task_id, late=True)
            else:
                wait = min(wait, (phase.deadline_ms - now) / 1000)
        return wait

    def close(self, task_id: str, *, late: bool = False) -> None:
        """Close the phase and complete the task with its final model (a training task's last round's, an
        "evaluate" task's evaluated model, a "statistics" task's submitted one)."""
        phase = self.store.result_phase(task_id)
        task = self.store.task(task_id)
        assert phase is not None and task is not None
        results = self.store.results_of(task_id, phase.round)
        sites = sorted({r.site for r in results})
        summary = (f"{len(sites)} site(s) answered" + (f" ({', '.join(sites)})" if sites else "")
                   + ("; the deadline passed, sites that did not answer have empty cells" if late else ""))
        what = "statistics" if phase.work == STATISTICS else "evaluation"
        if phase.work == EVALUATE:
            for model in sorted({r.model for r in results}):
                pooled = pool_evaluations({r.site: r.values for r in results if r.model == model},
                                          {r.site: r.min_cell for r in results if r.model == model})
                label = {"final": "final model", "own": "sites' own models", "model": "the model"}.get(model, model)
                summary += f"; {label}: " + (headline(pooled.values) + f" over {pooled.sites} site(s)"
                                             if pooled.values else pooled.note)
        with self.store.transaction() as tx:
            tx.close_result_phase(task_id, now_ms())
            tx.complete_task(task_id, phase.model_hash or task.initial_model, now_ms())
            tx.add_event(task_id, "results-closed", f"{what} closed: {summary}", round=phase.round, sites=sites)
            tx.add_event(task_id, "completed", "task completed" + (
                f" after {phase.round - 1} round(s); final model evaluated by {len(sites)} site(s)"
                if task_kind(task.spec) == "" else f": {what} by {len(sites)} site(s)"),
                final_model=phase.model_hash or task.initial_model, rounds=max(phase.round - 1, 0))
        log.info("result phase closed", task_id=task_id, work=phase.work, sites=len(sites), late=late)

    # work on the stream ---------------------------------------------------------------------------------
    def next_work(self, site: str, delivered: dict[tuple[str, int, int], bool]) -> list[agent_pb2.WorkItem]:
        """Result work for ``site`` not yet delivered on this stream (keys ``(task, phase round, 0)``; attempt 0
        marks a phase); keys of closed phases are forgotten."""
        for key in [k for k in delivered if k[2] == 0]:
            phase = self.store.result_phase(key[0])
            if phase is None or phase.closed_ms:
                del delivered[key]
        if site not in self._capable:
            return []
        items = []
        for phase in self.store.open_result_phases():
            key = (phase.task_id, phase.round, 0)
            if key in delivered:
                continue
            task = self.store.task(phase.task_id)
            assert task is not None
            if task_kind(task.spec) == "":
                if site not in self.store.reported_sites(phase.task_id):
                    continue
            elif not self._eligible(phase.task_id, task.spec, site):
                continue
            a = self.store.assignment(phase.task_id, phase.round, site)
            if (a is not None and a.declined) or any(r.site == site for r in self.store.results_of(phase.task_id,
                                                                                                   phase.round)):
                continue
            if a is None:
                with self.store.transaction() as tx:
                    tx.assign(phase.task_id, phase.round, site, 1, now_ms())
                    tx.add_event(phase.task_id, "site-assigned", f"{site} was given the {phase.work} work",
                                 actor=site, round=phase.round)
            manifest = self.store.model(phase.model_hash or task.initial_model)
            assert manifest is not None
            # a training task's final evaluation names the tensors its rounds sent (nothing is sent now): what the
            # site approved of the task stays the same (hospital_agent.approvals digests spec and sent tensors)
            assignment = agent_pb2.Assignment(task_id=phase.task_id, round=phase.round, attempt=1, spec=task.spec,
                                              model=manifest_to_proto(manifest), deadline_unix_ms=phase.deadline_ms,
                                              work=phase.work, send_tensors=sent_tensors(task.spec, manifest)
                                              if task_kind(task.spec) == "" else [])
            signed = self.store.signed_task(phase.task_id)
            if signed:
                assignment.signed_task.ParseFromString(signed)
            items.append(agent_pb2.WorkItem(assignment=assignment))
            delivered[key] = True
        return items

    # SubmitResult ---------------------------------------------------------------------------------------
    def submit(self, site: str, req: agent_pb2.SubmitResultRequest) -> agent_pb2.SubmitResultResponse:
        """Keep a site's results (module docstring); Refused with what to do otherwise."""
        require_assignment(self.store, site, req.task_id, req.round, "submit results for")
        task = self.store.task(req.task_id)
        assert task is not None  # an assignment exists
        if not 0 <= req.min_cell_rows <= MAX_MIN_CELL:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"min_cell_rows must be 0-{MAX_MIN_CELL} (0 = 10), got {req.min_cell_rows}")
        if not req.results:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a result carries at least one ResultValues")
        names = [r.model for r in req.results]
        if len(set(names)) != len(names):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"models {names} repeat; send each model once")
        if req.work == ROUND_EVAL:
            return self._round_eval(site, req, task.spec)
        phase = self.store.result_phase(req.task_id)
        allowed = PHASE_MODELS.get((task_kind(task.spec), req.work), ())
        if phase is None or phase.round != req.round or phase.work != req.work or not allowed:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"round {req.round} of task {req.task_id} takes no {req.work!r} results; send results for "
                          "the work an assignment asked for (Assignment.work)")
        if phase.closed_ms or task.state != S.TASK_STATE_RUNNING:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"the {phase.work} phase of task {req.task_id} is over; results are no longer taken")
        if phase.work == EVALUATE and req.model_hash != phase.model_hash:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the results are of model {req.model_hash[:12]!r}, the phase evaluates "
                          f"{phase.model_hash[:12]}; evaluate the assignment's model")
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model name(s) {unknown} are not taken here; this phase takes {list(allowed)}")
        checked = [(r.model, check_values(r.values, f"the {r.model!r} result")) for r in req.results]
        stored = 0
        with self.store.transaction() as tx:
            for model, values in checked:
                stored += tx.record_result(SiteResultRecord(req.task_id, req.round, site, model, req.work,
                                                            req.model_hash, values, req.min_cell_rows, now_ms()))
            if stored:
                tx.add_event(req.task_id, "result-received", f"{site} sent its {phase.work} results "
                             f"({', '.join(n for n, _ in checked)})", actor=site, round=req.round)
        self.maybe_close(req.task_id)
        return agent_pb2.SubmitResultResponse(stored=stored, note="" if stored else "already received")

    def _round_eval(self, site: str, req: agent_pb2.SubmitResultRequest,
                    spec: task_pb2.TaskSpec) -> agent_pb2.SubmitResultResponse:
        """A training round's evaluation of its base model, sent after the site's update."""
        if names_other_than_round(req):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a round evaluation carries one result named {ROUND_MODEL!r}")
        rnd = self.store.round(req.task_id, req.round)
        task = self.store.task(req.task_id)
        if rnd is None or task is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"task {req.task_id} has no round {req.round}")
        if req.model_hash != rnd.base_model:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"round {req.round} started from model {rnd.base_model[:12]}, the results are of "
                          f"{req.model_hash[:12]!r}; evaluate the round's base model")
        values = check_values(req.results[0].values, "the round evaluation")
        newest = self.store.last_closed_round(req.task_id)
        in_time = task.state == S.TASK_STATE_RUNNING and (
            rnd.state == S.ROUND_STATE_OPEN or (rnd.state == S.ROUND_STATE_CLOSED and newest is not None
                                                and newest.round == rnd.round))
        if not in_time:
            log.info("late round evaluation dropped", task_id=req.task_id, round=req.round, site=site)
            return agent_pb2.SubmitResultResponse(stored=0, note=f"round {req.round} is no longer the newest round "
                                                  "of a running task; the evaluation was dropped")
        with self.store.transaction() as tx:
            stored = tx.record_result(SiteResultRecord(req.task_id, req.round, site, ROUND_MODEL, ROUND_EVAL,
                                                       req.model_hash, values, req.min_cell_rows, now_ms()))
            if stored and rnd.state == S.ROUND_STATE_CLOSED:
                merged = {k: v for k, v in rnd.metrics.items() if not k.startswith("eval_")}
                merged.update(evaluation_metrics(self.store.updates_of(req.task_id, req.round),
                                                 self.store.results_of(req.task_id, req.round)))
                tx.set_round_metrics(req.task_id, req.round, merged)
                tx.add_event(req.task_id, "round-evaluated", round_eval_line(req.round, merged), round=req.round)
        return agent_pb2.SubmitResultResponse(stored=int(stored), note="" if stored else "already received")


def names_other_than_round(req: agent_pb2.SubmitResultRequest) -> bool:
    return len(req.results) != 1 or req.results[0].model != ROUND_MODEL


#: value -> how an event line names it (the first one present is shown)
HEADLINE = (("macro_auc", "macro AUC"), ("accuracy", "acc"), ("strict_f1", "entity F1"), ("rougeL", "ROUGE-L"))


def headline(values: dict[str, float], prefix: str = "") -> str:
    """The headline figure of an evaluation (``prefix`` + key), with the rows it is over."""
    head = next((f"{name} {values[prefix + k]:.3f}" for k, name in HEADLINE if prefix + k in values), "")
    rows = values.get("eval_rows")
    return (head + (f" on {int(rows)} rows" if rows else "")).strip()


def round_eval_line(rnd: int, metrics: dict[str, float]) -> str:
    """How an event names a round's site evaluation: of the model the round started from."""
    sites = int(metrics.get("eval_sites", 0))
    start = "the initial model" if rnd == 1 else f"the round-{rnd - 1} model"
    return (f"round {rnd}: site-eval of the model it started from ({start}) by {sites} site(s): "
            f"{headline(metrics, 'eval_')}")


__all__ = ["FEATURE", "MAX_RESULT_KEYS", "ResultPhases", "check_values", "round_eval_line", "task_kind"]
