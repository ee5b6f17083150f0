"""Work that trains nothing: evaluating a model, answering a statistics task, and sending a round's evaluation.

An assignment with ``work`` set (after the admission gates of hospital_agent.gates passed) comes here:

- ``"evaluate"``: declined when site policy ``allow_evaluation = false``; else the model checks (tokenizer, private
  modules), the model synced (hospital_agent.model_sync) and evaluated on the site's held-out split (``eval_path``;
  an "evaluate" task, which trains nothing, uses the whole dataset when there is none, a training task's final
  evaluation declines). A training task's final model is sent as "final" (its shared tensors with the global
  values of any private ones) and, when the task has private modules, "own" (the same with this site's private
  tensors); an "evaluate" task's model as "model";
- ``"statistics"``: declined when ``allow_statistics = false``; else
  ``hospital_agent.site_statistics.answer_statistics`` computes, suppresses, noises and charges.

Only values leave the site, through ``SubmitResult``: a flat ``name -> number`` per model with ``eval_rows`` (rows
evaluated) and the site's ``min_cell_rows`` (the aggregator withholds a cell of fewer rows). Never rows, text,
predictions or per-row scores. :meth:`ResultWork.send_round_eval` sends a training round's evaluation of its base
model the same way, after the update (off the round's critical path).
"""

from __future__ import annotations

from typing import Callable

import grpc
import structlog

from fedclinic.errors import FedclinicError
from fedclinic.proto import agent_pb2, agent_pb2_grpc
from fedclinic.transport.rpc import explain_rpc_error
from fedclinic.transport.wire import manifest_from_proto

from hospital_agent.config import AgentConfig
from hospital_agent.gates import GateChain, Verdict, private_names
from hospital_agent.model_sync import ModelSync
from hospital_agent.task_state import TaskState
from hospital_agent.training_step import TrainingStep, evaluate_warm

log = structlog.get_logger("fedclinic.agent")

#: the Hello feature: this agent takes result work and speaks SubmitResult
FEATURE = "results-v1"


class ResultWork:
    """Handles result work for the agent (module docstring)."""

    def __init__(self, config: AgentConfig, stub: Callable[[], agent_pb2_grpc.AgentServiceStub],
                 training: TrainingStep, model_sync: ModelSync, model_checks: GateChain,
                 passes: Callable[[agent_pb2.Assignment, Verdict], bool],
                 decline: Callable[..., None], ledger: Callable[[], object], audit: Callable[..., None]) -> None:
        self.config = config
        self._stub = stub
        self.training = training
        self.model_sync = model_sync
        self.model_checks = model_checks
        self._passes = passes
        self._decline = decline
        self._ledger = ledger
        self._audit = audit
        #: (task, round) answered: a copy of the same assignment is not worked again
        self.answered: set[tuple[str, int]] = set()

    def handle(self, a: agent_pb2.Assignment, state: TaskState) -> None:
        if (a.task_id, a.round) in self.answered:
            return
        policy = self.config.policy
        if a.work == "statistics":
            if not policy.allow_statistics:
                self._decline(a.task_id, a.round, "site policy allow_statistics = false: this site does not answer "
                                                  "statistics tasks", permanent=True)
                return
            results = [agent_pb2.ResultValues(model="statistics", values=self._statistics(a))]
            self._submit(a, a.work, "", results)
            return
        if a.work != "evaluate":
            self._decline(a.task_id, a.round, f"this agent does not know the work {a.work!r}; upgrade it")
            return
        if not policy.allow_evaluation:
            self._decline(a.task_id, a.round, "site policy allow_evaluation = false: this site does not evaluate "
                                              "models for others", permanent=bool(a.spec.kind))
            return
        if not self._passes(a, self.model_checks.check(a)):
            return
        results = self._evaluate(a, state)
        if results is not None:
            self._submit(a, a.work, manifest_from_proto(a.model).model_hash, results)

    def _statistics(self, a: agent_pb2.Assignment) -> dict[str, float]:
        try:
            from hospital_agent.site_statistics import answer_statistics  # the stats helper's entry point
        except ImportError:
            raise FedclinicError("this agent cannot compute statistics yet (no hospital_agent.site_statistics); "
                                 "upgrade it") from None
        return answer_statistics(a.spec, task_id=a.task_id, config=self.config,
                                 min_cell=self.config.policy.min_cell_rows, ledger=self._ledger(),
                                 tokenizer=self._tokenizer(a))

    def _tokenizer(self, a: agent_pb2.Assignment) -> bytes | None:
        """The task model's tokenizer.json (for the token statistics), fetched with the model when this site does
        not hold it; None when the model has none."""
        manifest = manifest_from_proto(a.model)
        entry = next((f for f in manifest.files if f.path == "tokenizer.json"), None)
        if entry is None:
            return None
        cache = self.model_sync.cache
        if not cache.has(entry.sha256):
            self.model_sync.fetch(a.task_id, manifest, True)
        return cache.read(entry.sha256)

    def _evaluate(self, a: agent_pb2.Assignment, state: TaskState) -> list[agent_pb2.ResultValues] | None:
        """Sync the assignment's model and evaluate it (module docstring); None when declined."""
        from fedclinic.training import trainer  # torch-heavy: imported when a model is evaluated

        final = not a.spec.kind  # a training task's final model, else an "evaluate" task's model
        self.training.prepare_data(a, state)
        if state.raw_eval is None:
            if final:
                self._decline(a.task_id, a.round, "this site has no held-out split (eval_path) to evaluate the final "
                                                  "model on")
                return None
            state.raw_eval = state.raw_train  # nothing trains here: the whole dataset is held out
        private = private_names(a)
        for name in private:  # the final model's own values of the private tensors, not this site's
            state.tensor_sha[name] = ""
        manifest = manifest_from_proto(a.model)
        self.model_sync.sync(a, manifest, state)
        if state.eval_data is None:
            cfg = trainer.TrainConfig.from_proto(a.spec.training)
            state.eval_data = trainer.encode(state.raw_eval, state.loaded, max_length=cfg.max_length)
        out = [agent_pb2.ResultValues(model="final" if final else "model", values=evaluate_warm(state))]
        if final and private:
            self.training.restore_private(a.task_id, state, private)
            out.append(agent_pb2.ResultValues(model="own", values=evaluate_warm(state)))
        return out

    def _submit(self, a: agent_pb2.Assignment, work: str, model_hash: str,
                results: list[agent_pb2.ResultValues]) -> None:
        request = agent_pb2.SubmitResultRequest(task_id=a.task_id, round=a.round, work=work, model_hash=model_hash,
                                                results=results, min_cell_rows=self.config.policy.min_cell_rows)
        answer = self._stub().SubmitResult(request, timeout=60)
        self.answered.add((a.task_id, a.round))
        self._audit("result.sent", a.task_id, round=a.round, work=work, models=[r.model for r in results],
                    values=sum(len(r.values) for r in results), stored=answer.stored)
        log.info("results sent", work=work, models=[r.model for r in results], stored=answer.stored)

    def send_round_eval(self, task_id: str, rnd: int, base_model_hash: str, values: dict[str, float]) -> None:
        """A training round's evaluation of its base model, after the update; best effort (logged, never raised:
        the round does not wait for it)."""
        request = agent_pb2.SubmitResultRequest(
            task_id=task_id, round=rnd, work="round-eval", model_hash=base_model_hash,
            results=[agent_pb2.ResultValues(model="round", values=values)],
            min_cell_rows=self.config.policy.min_cell_rows)
        try:
            answer = self._stub().SubmitResult(request, timeout=60)
        except grpc.RpcError as exc:
            log.warning("round evaluation not sent", error=str(explain_rpc_error(exc, self.config.aggregator)))
            return
        if not answer.stored and answer.note:
            log.info("round evaluation not kept", note=answer.note)
