"""Scoring one model on every site's evaluation rows and on shared test sets, and pooling the sites' figures.

Per site: :func:`fedclinic.training.trainer.evaluate` (the family's metrics) plus ``eval_rows``, the rows
evaluated. Pooled over the sites, the rule of the evaluation contract between sites (issue 19): a key starting
with ``count/`` is a raw count and is **summed**; every other key is the mean **weighted by ``eval_rows``**.
(A simulation runs on the scientist's own files, so nothing is suppressed.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from fedclinic.evaluation.combine import COUNT_PREFIX, weighted_metrics
from fedclinic.evaluation.combine import ROWS as EVAL_ROWS

if TYPE_CHECKING:
    from fedclinic.models import LoadedModel


def pool_by_rows(per_site: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The sites' figures pooled by the one combining rule (:func:`fedclinic.evaluation.combine.weighted_metrics`:
    ``count/*`` and ``eval_rows`` summed, every other key weighted by ``eval_rows``) over the sites that evaluated
    rows; nothing is suppressed (these are the scientist's own files). Empty when no site has evaluation rows."""
    sites = {name: m for name, m in per_site.items() if m.get(EVAL_ROWS, 0) > 0}
    return weighted_metrics(sites) if sites else {}


def evaluation_figures(loaded: "LoadedModel", data: Any) -> dict[str, float]:
    """The family's metrics of ``loaded`` on encoded ``data``, with ``eval_rows`` (its row count) added."""
    # lazy: torch only where a model is scored
    from fedclinic.training.trainer import evaluate

    m = {k: float(v) for k, v in evaluate(loaded, data).items()}
    m.pop("n", None)  # the same count, under the name the pooling rule reads
    m[EVAL_ROWS] = float(len(data))
    return m


@dataclass
class ModelScores:
    """One model's figures: per site (its evaluation rows), pooled over the sites, and per shared test set."""

    sites: dict[str, dict[str, float]] = field(default_factory=dict)
    pooled: dict[str, float] = field(default_factory=dict)
    tests: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"sites": self.sites, "pooled": self.pooled, "tests": self.tests}


def score_model(loaded: "LoadedModel", site_eval: Mapping[str, Any], tests: Mapping[str, Any] | None = None, *,
                before_site: Callable[[str], None] | None = None) -> ModelScores:
    """Score ``loaded`` on each site's encoded evaluation set of ``site_eval`` (sites without rows are left
    out) and on each encoded set of ``tests``; ``before_site(name)`` runs before a site's set is scored (to load
    that site's private tensors) and is undone by nothing: call it last, or reload after."""
    out = ModelScores()
    for name, data in (tests or {}).items():
        out.tests[name] = evaluation_figures(loaded, data)
    for name, data in site_eval.items():
        if data is None or len(data) == 0:
            continue
        if before_site is not None:
            before_site(name)
        out.sites[name] = evaluation_figures(loaded, data)
    out.pooled = pool_by_rows(out.sites)
    return out


__all__ = ["COUNT_PREFIX", "EVAL_ROWS", "ModelScores", "evaluation_figures", "pool_by_rows", "score_model"]
