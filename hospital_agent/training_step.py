"""The agent's training step: one assignment's local round, through the one site round the simulator runs.

For an assignment whose model is synced (hospital_agent.model_sync)::

    private values -> the model (memory, else the private store, else the global model's initial values)
    eval_metrics   = evaluate(model, the site's held-out split)      (secure rounds; when configured)
    site round     = fedclinic.federation.site_round.run_site_round(task, site = this site's name, round, send_tensors,
                     private tensors, codec + this task's error-feedback state, SAFL, DP-SGD plan)
    keep the private tensors (memory and the private store) before the update exists
    ... the update is sent ...
    evaluate_base  = the model synced back to the round's base (from the cache) + the private values from before
                     the round, evaluated on the held-out split   (plain rounds: the same values, after the update)

The site round derives the training seed from (the task's seed, round, site name), exactly as the simulator
does for a site of that name. The caller charges privacy, then :meth:`TrainingStep.stage_feedback` makes the
staged error-feedback residual durable, then the update goes to the outbox.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Collection

import numpy as np
import structlog

from fedclinic.transport import codec_wire
from fedclinic.codecs import ErrorFeedback
from fedclinic.evaluation.combine import defined_values
from fedclinic.evaluation.multilabel import round_report_metrics
from fedclinic.training.private_modules import PrivateStore
from fedclinic.proto import agent_pb2
from fedclinic.federation.site_round import SiteRoundInput, SiteRoundResult, run_site_round
from fedclinic.evaluation.statistics_counts import unk_rate

from hospital_agent.config import AgentConfig
from hospital_agent.metrics import AgentMetrics
from hospital_agent.site_data import has_eval, read_ids, read_rows, reader_kwargs  # noqa: F401 (reader_kwargs: re-exported)
from hospital_agent.task_state import Stopped, TaskState
from hospital_agent.uploader import feedback_path
from fedclinic.training import safl

if TYPE_CHECKING:
    from fedclinic.training.trainer import TrainConfig

log = structlog.get_logger("fedclinic.agent")


@dataclass
class Trained:
    """One round's local result, as the agent sends it."""

    site: SiteRoundResult
    metrics: dict[str, float]                   # reported with the update (site round's + train_seconds)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    #: the site's private tensors as they were before this round trained them (for the round's evaluation after
    #: the update, :meth:`TrainingStep.restore_base`); None without private modules
    private_before: dict | None = None


class TrainingStep:
    def __init__(self, config: AgentConfig, private_store: PrivateStore, metrics: AgentMetrics,
                 site_id: Callable[[], str], stop_event: threading.Event, cancelled: Collection[str]) -> None:
        self.config = config
        self.private_store = private_store
        self.metrics = metrics
        self._site_id = site_id
        self.stop_event = stop_event
        self._cancelled = cancelled
        #: DP-SGD's sampler/noise seed for every round; None (always, in a running agent) draws it from the OS.
        #: Only a test that replays a private round sets it.
        self.dp_entropy: int | None = None
        self._devices: list[str] | None = None
        # a multi-device round's private job folders (model, encoded data) left by an agent that was killed mid-round
        for stale in config.work_dir.glob("fedclinic-ddp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def devices(self) -> list[str]:
        """The devices a round trains on when ``devices`` is configured (resolved and checked once:
        fedclinic.federation.distributed_round.resolve_devices; ConfigError when a named GPU is not visible)."""
        from fedclinic.federation.distributed_round import resolve_devices  # torch: when the agent connects

        if self._devices is None:
            self._devices = resolve_devices(self.config.devices if self.config.devices is not None else ["cpu"])
        return self._devices

    def prepare_data(self, a: agent_pb2.Assignment, state: TaskState) -> None:
        """Read and validate the task's dataset (once per task), from its file or its source
        (hospital_agent.site_data): DatasetError names the file or source and the row."""
        entry = self.config.datasets[a.spec.dataset]
        if state.raw_train is None:
            state.raw_train = read_rows(entry, a.spec)
            state.raw_eval = read_rows(entry, a.spec, split="eval") if has_eval(entry) else None
        if state.patient_ids is None and per_patient(a.spec) and entry.group_field:
            state.patient_ids = read_ids(entry, rows=len(state.raw_train))

    def restore_private(self, task_id: str, state: TaskState, private: list[str]) -> None:
        """Put the site's own private tensors into the warm model (after each sync to the global weights): from
        memory, else from the private store (a restarted agent), else the global model's initial values (the
        site's first round). IntegrityError (the assignment is declined for now) when the stored file does not
        fit the model."""
        from fedclinic.models import load_tensors, module_tensors  # torch-heavy: imported when a round runs

        if state.private_values is None:
            current = module_tensors(state.loaded.module, private)
            stored = self.private_store.load(task_id, {n: (a.shape, a.dtype) for n, a in current.items()})
            state.private_values = stored[0] if stored is not None else current
            if stored is not None:
                log.info("private modules restored", tensors=len(private), from_round=stored[1])
        load_tensors(state.loaded.module, state.private_values)

    def run(self, a: agent_pb2.Assignment, state: TaskState, cfg: "TrainConfig", private: list[str], *,
            evaluate: bool = True) -> Trained:
        """Evaluate the synced model (global shared tensors + this site's private ones) on the site's held-out
        split (``evaluate``; otherwise the caller evaluates it after the update, :meth:`evaluate_base`), run the
        site round and keep the private tensors. IntegrityError if a private tensor is to be sent (the last gate
        before anything is written)."""
        from fedclinic.training import trainer as training  # torch-heavy: imported when a round runs
        from fedclinic.models import module_tensors

        loaded = state.loaded
        # the round's report leaves out the threshold histograms (for the final-model evaluation) and, for very
        # many labels, the per-label figures: an update carries at most 256 evaluation values. A secure round's
        # travel inside the masked vector, so it evaluates first; a plain round after its update (evaluate_base)
        eval_metrics = (round_report_metrics(training.evaluate(loaded, state.eval_data))
                        if evaluate and state.eval_data is not None else {})
        private_before = ({k: np.array(v, copy=True) for k, v in module_tensors(loaded.module, private).items()}
                          if private and not evaluate and state.eval_data is not None else None)
        started = time.monotonic()

        def progress(step: int, total: int, loss: float) -> None:
            if self.stop_event.is_set():
                raise Stopped("agent is stopping")
            if a.task_id in self._cancelled:
                raise Stopped("task cancelled")
            if step == total or step % 10 == 0:
                log.info("training", step=step, steps=total, loss=round(loss, 4))

        codec = codec_wire.task_codec(a.spec.update.codec)
        path = feedback_path(self.config.work_dir, a.task_id)
        feedback = ErrorFeedback.load(path, codec) if codec_wire.uses_error_feedback(codec) and path.exists() else None
        inp = SiteRoundInput(
            task_id=a.task_id, site=self._site_id(), round=a.round, send=list(a.send_tensors), train=cfg,
            private=private, codec=a.spec.update.codec, safl=safl.SaflConfig.from_spec(a.spec),
            dp=state.private.dp_sgd if state.private is not None else None,
            dp_groups=state.patient_ids if state.private is not None and state.private.unit == "patient" else None,
            optimizer_state=state.optimizer_state if state.private is None else None,
            feedback=feedback, progress=progress,
            dp_entropy=self.dp_entropy, base=state.global_tensors,
            spill_dir=update_spill_dir(self.config.work_dir, a.task_id))
        out = self._site_round(loaded, state, inp)
        if out.selection is not None:
            log.info("layers selected", layers=out.selection.layers, tensors=len(out.send))
        state.optimizer_state = out.train.optimizer_state
        self.metrics.trained(a.task_id, time.monotonic() - started)
        # the module now holds local weights; remember that so the next round reloads the global ones
        for name in out.send:
            state.tensor_sha[name] = ""
        if private:  # kept before the update exists: a restart trains the next round from these values
            state.private_values = out.private_values
            self.private_store.save(a.task_id, a.round, state.private_values)
        metrics = {**out.metrics, "train_seconds": time.monotonic() - started}
        if not state.coverage_reported:  # the site's first update of the task says how well the tokenizer covers it
            rate = coverage_rate(loaded, state.raw_train)
            if rate is not None:
                metrics["tokenizer_unk_rate"] = rate
            state.coverage_reported = True
        return Trained(out, metrics, eval_metrics, private_before)

    def _site_round(self, loaded, state: TaskState, inp: SiteRoundInput) -> SiteRoundResult:
        """The site round in this process, or -- with several ``devices`` configured and a round that shards --
        as a torch.distributed job over them (the same round, the same update)."""
        if self.config.gradient_checkpointing:
            from fedclinic.models.base import enable_gradient_checkpointing  # torch: when a round runs

            enable_gradient_checkpointing(loaded.module)
        if self.config.devices is None:
            return run_site_round(loaded, state.train_data, inp)
        from fedclinic.federation.distributed_round import (fsdp_problem, run_site_round_distributed,
                                                            single_process_reason)

        devices = self.devices()
        reason = single_process_reason(loaded, inp) if len(devices) > 1 else "one device configured or visible"
        if reason:
            log.info("training in one process", reason=reason, device=devices[0])
            return run_site_round(loaded, state.train_data, replace(inp, train=replace(inp.train, device=devices[0])))
        sharding = self.config.sharding
        problem = fsdp_problem(loaded, inp) if sharding == "fsdp" else None
        if problem:  # e.g. a classifier's task at an FSDP site: each process holds the whole model
            log.info("training data-parallel without sharding", reason=problem)
            sharding = "none"
        threads = max(1, self.config.torch_threads // len(devices)) if self.config.torch_threads else 0
        log.info("training on several devices", devices=devices, sharding=sharding)
        return run_site_round_distributed(loaded, state.train_data, inp, files=state.package_files or {},
                                          devices=devices, threads=threads,
                                          collective_timeout=self.config.distributed_timeout,
                                          gradient_checkpointing=self.config.gradient_checkpointing,
                                          sharding=sharding, workdir=self.config.work_dir)

    def evaluate_base(self, a: agent_pb2.Assignment, state: TaskState, trained: Trained, sync) -> dict[str, float]:
        """The round's evaluation, after its update left: the warm model brought back to the round's base model
        (``sync``: hospital_agent.model_sync.ModelSync.sync reloads, from the cache, the tensors training changed)
        with this site's private tensors as they were before the round, evaluated on the held-out split. The same
        values :meth:`run` would have computed before training (without the threshold histograms, which are for
        the final model's evaluation); empty without a held-out split."""
        from fedclinic.models import load_tensors  # torch-heavy: imported when a round runs

        if state.eval_data is None:
            return {}
        sync()
        if trained.private_before is not None:
            load_tensors(state.loaded.module, trained.private_before)
        return round_report_metrics(evaluate_warm(state))

    def stage_feedback(self, task_id: str, trained: Trained) -> None:
        """Make the round's staged error-feedback residual durable (before the update exists; committed when the
        aggregator acknowledges it, hospital_agent.uploader)."""
        if trained.site.feedback is None:
            return
        path = feedback_path(self.config.work_dir, task_id)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        trained.site.feedback.save(path)


def update_spill_dir(work_dir: Path, task_id: str) -> Path:
    """Where a round's delta is written tensor by tensor (fedclinic.federation.spilled_tensors) until its update is
    in the outbox; emptied when the task's next round trains, removed once the update is written."""
    return work_dir / "update-spill" / task_id


__all__ = ["Trained", "TrainingStep", "update_spill_dir", "coverage_rate", "evaluate_warm", "evaluation_values", "reader_kwargs"]


def evaluate_warm(state: TaskState) -> dict[str, float]:
    """The warm model as it is now on the site's held-out split, as it leaves the site (:func:`evaluation_values`;
    ``eval_rows`` = the split's rows when the family's metrics do not count them)."""
    from fedclinic.training import trainer  # torch-heavy: imported when a model is evaluated

    values = evaluation_values(trainer.evaluate(state.loaded, state.eval_data))
    values.setdefault("eval_rows", float(len(state.eval_data)))
    return values


def evaluation_values(metrics: dict) -> dict[str, float]:
    """An evaluation as it leaves the site: its defined (finite) values as floats
    (fedclinic.evaluation.combine.defined_values: an undefined AUC is left out, not sent as NaN), with
    ``eval_rows`` (the rows evaluated, the trainer's ``n``) by which the aggregator weights it."""
    values = defined_values({k: v for k, v in metrics.items() if k != "n"})
    if "n" in metrics:
        values["eval_rows"] = float(metrics["n"])
    return values


def coverage_rate(loaded, rows: list | None) -> float | None:
    """The share of the content tokens of the site's training texts that are the task tokenizer's unknown token
    (``fedclinic.evaluation.statistics_counts.unk_rate``): a rate, never text; None for rows without a text (a
    question-answering task) or a model without a tokenizer."""
    tokenizer = getattr(loaded, "tokenizer", None)
    texts = [ex.text for ex in rows or () if isinstance(getattr(ex, "text", None), str)]
    if tokenizer is None or not texts:
        return None
    return unk_rate(tokenizer, texts)


def per_patient(spec) -> bool:
    """The task asks for sample-level DP per patient (``privacy.unit = "patient"``)."""
    return spec.privacy.level == "sample" and spec.privacy.unit == "patient"

