"""``fedclinic task watch TASK --eval test.jsonl``: every round's global model scored on the scientist's own test
set as the round closes, beside the figures the sites reported.

As each round closes (seen on the task's event stream), its model is fetched over the control API with the
scientist's certificate (:meth:`fedclinic.client.Client.fetch_package`: the aggregator's signature over it
checked, as ``task download`` does), built for the task's family, and evaluated on the file's rows encoded with
that model's own tokenizer and the task's max_length (:func:`fedclinic.training.trainer.evaluate`). One model is
held at a time: each is dropped before the next is fetched. The file is read (the agents' readers, the task's
family and labels) before the first model is fetched, so a bad file fails at once with its row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, TextIO

from fedclinic.federation.model_scores import EVAL_ROWS, evaluation_figures
from fedclinic.federation.own_files import read_rows
from fedclinic.federation.task_simulation import headline_metric

if TYPE_CHECKING:
    from fedclinic.client import Client
    from fedclinic.proto import control_pb2

#: the prefix of a round's metrics that are the sites' evaluations (``eval_accuracy``, ...)
SITE_EVAL_PREFIX = "eval_"


@dataclass
class ScoredRounds:
    """Round number -> the figures of that round's global model on the test file; the task's final status."""

    rounds: dict[int, dict[str, float]] = field(default_factory=dict)
    status: "control_pb2.TaskStatus | None" = None


def sites_figures(metrics: Mapping[str, float]) -> dict[str, float]:
    """The sites' own evaluation figures among a round's metrics (``eval_accuracy`` -> ``accuracy``)."""
    return {k[len(SITE_EVAL_PREFIX):]: float(v) for k, v in metrics.items() if k.startswith(SITE_EVAL_PREFIX)}


def score_round(client: "Client", task_id: str, round_: int, rows: list, max_length: int) -> dict[str, float]:
    """The figures of round ``round_``'s global model of ``task_id`` on ``rows`` (fetched, built, evaluated)."""
    # lazy: torch only when a model is scored (the CLI imports this module to build its parser)
    from fedclinic.models import build_model
    from fedclinic.training.trainer import encode

    loaded = build_model(client.fetch_package(task_id, round=round_))
    return evaluation_figures(loaded, encode(rows, loaded, max_length=max_length or None))


def format_round(round_: int, mine: Mapping[str, float], sites: Mapping[str, float]) -> str:
    """One line: the round, the test file's headline metric and loss, and the sites' figure of that metric."""
    key = headline_metric(mine)
    text = f"round {round_}: your test set ({int(mine[EVAL_ROWS])} rows) {key} {mine[key]:.4f} loss {mine['loss']:.4f}"
    if key in sites:
        text += f" | sites' evaluation {key} {sites[key]:.4f}"
    elif sites:
        text += " | sites' evaluation " + " ".join(f"{k} {v:.4f}" for k, v in sorted(sites.items()))
    return text


def watch_and_score(client: "Client", task_id: str, eval_path: Any, *, out: TextIO,
                    on_event: "Callable[[control_pb2.TaskEvent], None] | None" = None) -> ScoredRounds:
    """Follow ``task_id`` until it ends, scoring each closed round's model on ``eval_path`` (a line per round on
    ``out``); ``on_event`` sees every event (a progress display). Returns the figures per round."""
    from fedclinic.proto import control_pb2

    status = client.status(task_id)
    rows = read_rows(status.spec, eval_path)
    max_length = status.spec.training.max_length
    scored = ScoredRounds(status=status)
    for event in client.watch(task_id):
        scored.status = event.status
        if on_event is not None:
            on_event(event)
        for r in event.status.rounds:
            if r.state == control_pb2.ROUND_STATE_CLOSED and r.round not in scored.rounds:
                scored.rounds[r.round] = score_round(client, task_id, r.round, rows, max_length)
                out.write(format_round(r.round, scored.rounds[r.round], sites_figures(r.metrics)) + "\n")
                out.flush()
    return scored


__all__ = ["ScoredRounds", "format_round", "score_round", "sites_figures", "watch_and_score"]
