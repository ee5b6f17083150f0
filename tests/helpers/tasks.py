"""Tasks for the two-label text set (:mod:`tests.helpers.text_models`): the defaults the federation tests share."""

from __future__ import annotations

from fedclinic.spec.task import Task

from tests.helpers.text_models import LABELS


def make_task(**kw) -> Task:
    """A two-round logreg task on dataset ``notes`` for three sites; ``kw`` overrides any field."""
    base = dict(name="it", dataset="notes", labels=LABELS, architecture="logreg", num_rounds=2, min_sites=3,
                local_epochs=2, batch_size=8, learning_rate=0.05, optimizer="sgd", max_length=16,
                round_timeout_s=120, on_quorum_miss="fail")
    base.update(kw)
    return Task(**base)
