"""Class weighting of a multi-label task from federated label counts: the BCE ``pos_weight`` of each label.

With binary cross-entropy per label, a rare label's few positive rows are outweighed by its many negative ones,
and the model learns to keep its probability low. ``pos_weight`` multiplies the loss of each positive::

    loss(z, y) = -[ w * y * log sigmoid(z) + (1 - y) * log(1 - sigmoid(z)) ]      (torch's pos_weight)

A statistics task (``kind = "statistics"``) gives, pooled over the sites and without moving rows, ``rows`` (rows
counted) and ``label/<label>`` (rows carrying the label). The weight of a label is the ratio of its negative to
its positive rows, so positives and negatives weigh the same in total::

    w = clip((rows - positives) / positives, 1, cap)          cap = :data:`POS_WEIGHT_CAP` = 100

A label with no positive row (or absent from the statistics: a suppressed cell) gets ``cap`` (there is nothing
to balance, and the cap bounds how much a handful of rows can move the model); a label more frequent than its
absence gets 1 (weighting never lowers a positive's loss below the unweighted one).

``[training] pos_weight = "from-statistics:<task id>"`` in a task file is resolved by :func:`resolve_task_pos_weight`
when the task is submitted (:meth:`fedclinic.client.Client.submit`): it reads that statistics task's pooled values
and writes the weights, and where they came from, into the spec the sites receive.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from fedclinic.errors import ConfigError

#: the largest pos_weight derived from counts
POS_WEIGHT_CAP = 100.0
#: the task-file form that asks for weights from a statistics task's counts
FROM_STATISTICS = "from-statistics:"


def pos_weight_from_statistics(pooled: Mapping[str, float], labels: Sequence[str], *,
                               cap: float = POS_WEIGHT_CAP) -> list[float]:
    """Each label's ``pos_weight`` (module doc for the formula) from a statistics task's pooled ``rows`` and
    ``label/<label>`` counts. ConfigError when ``rows`` is missing or not a positive count."""
    if not (math.isfinite(cap) and cap >= 1):
        raise ConfigError(f"the pos_weight cap must be a finite number >= 1, got {cap!r}")
    rows = pooled.get("rows")
    if rows is None or not math.isfinite(float(rows)) or float(rows) <= 0:
        raise ConfigError("the statistics have no positive 'rows' count (was the statistics task suppressed, or of "
                          "another dataset?); give [training] pos_weight as numbers instead")
    total = float(rows)
    out = []
    for label in labels:
        positives = pooled.get(f"label/{label}")
        if positives is None or not math.isfinite(float(positives)) or float(positives) <= 0:
            out.append(float(cap))
            continue
        out.append(float(min(max((total - float(positives)) / float(positives), 1.0), cap)))
    return out


def statistics_values(status: Any) -> dict[str, float]:
    """The pooled values of a statistics task: a plain mapping as is, or a ``TaskStatus``'s ``pooled_statistics``.
    ConfigError when there are none."""
    values = status if isinstance(status, Mapping) else getattr(status, "pooled_statistics", None)
    if values:
        return {str(k): float(v) for k, v in values.items()}
    raise ConfigError("the task holds no pooled statistics: is it a finished statistics task (kind = "
                      "\"statistics\")? Give [training] pos_weight as numbers instead")


def resolve_task_pos_weight(task: Any, fetch_status: Callable[[str], Any]) -> Any:
    """``task`` itself, or, when its ``pos_weight`` is ``"from-statistics:<task id>"``, a copy with the weights
    derived from that task's pooled counts (``fetch_status(task_id)``) and ``pos_weight_source`` naming it."""
    value = task.pos_weight
    if not isinstance(value, str):
        return task
    if not value.startswith(FROM_STATISTICS) or not value[len(FROM_STATISTICS):].strip():
        raise ConfigError(f"pos_weight {value!r} must be a list of numbers or \"{FROM_STATISTICS}<task id>\"")
    stats_task = value[len(FROM_STATISTICS):].strip()
    weights = pos_weight_from_statistics(statistics_values(fetch_status(stats_task)), task.labels)
    return dataclasses.replace(task, pos_weight=weights, pos_weight_source=value)


__all__ = ["FROM_STATISTICS", "POS_WEIGHT_CAP", "pos_weight_from_statistics", "resolve_task_pos_weight",
           "statistics_values"]
