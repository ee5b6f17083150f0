"""A multi-label model's per-label decision thresholds, as the model card, the ONNX bundle and ``serve`` carry them.

The card's ``thresholds`` section (absent: every label is decided at probability 0.5)::

    "thresholds": {"rule": "probability >= threshold",
                   "values": {"<label>": 0.34, ...},            every label, in label order
                   "tuned_on": {"rows": 1480, "sites": ["a", "b", "c"], "bins": 50} | null,
                   "source": "final evaluation of task <id>" | "<file>" | ...}

``tuned_on`` says which validation rows the thresholds were chosen on (pooled histograms of the sites' rows:
:mod:`fedclinic.evaluation.thresholds`); null when they were set by hand. ``fedclinic export onnx`` copies the
values, in label order, into the bundle's ``fedclinic_model.json`` as ``"thresholds": [...]``, which the bundle
signature covers like every file; ``serve`` decides each label with its own threshold (``fedclinic.serving.bundle``).

:func:`card_markdown_lines` renders the section and the per-label figures of the last round's evaluation
(``eval_f1/<label>``, ``eval_auc/<label>``) as one table.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from fedclinic.errors import ConfigError

RULE = "probability >= threshold"
#: the threshold of every label of a model without tuned ones
DEFAULT = 0.5


def check_thresholds(values: Any, labels: Sequence[str]) -> list[float]:
    """``values`` as one threshold per label in label order: a list (label order) or a mapping label -> threshold
    (every label named, no other). ConfigError unless each is a finite number strictly between 0 and 1."""
    if isinstance(values, Mapping):
        unknown = sorted(set(map(str, values)) - set(labels))
        missing = [lab for lab in labels if lab not in values]
        if unknown or missing:
            raise ConfigError(f"thresholds must name every label exactly: unknown {unknown}, missing {missing}")
        values = [values[lab] for lab in labels]
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != len(labels):
        raise ConfigError(f"thresholds must be one number per label ({len(labels)}), got {values!r}")
    out = []
    for lab, v in zip(labels, values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0.0 < v < 1.0):
            raise ConfigError(f"threshold of label {lab!r} must be a probability strictly between 0 and 1, got {v!r}")
        out.append(float(v))
    return out


def thresholds_section(values: Any, labels: Sequence[str], *, source: str, rows: int | None = None,
                       sites: Sequence[str] | None = None, bins: int | None = None) -> dict[str, Any]:
    """The card's ``thresholds`` section (module doc); ``rows``/``sites``/``bins`` describe the tuning rows
    (all None: set by hand)."""
    checked = check_thresholds(values, labels)
    tuned_on = None
    if rows is not None or sites is not None:
        tuned_on = {"rows": rows, "sites": sorted(sites or []), "bins": bins}
    return {"rule": RULE, "values": dict(zip(labels, checked)), "tuned_on": tuned_on, "source": source}


def card_thresholds(card: Mapping[str, Any] | None) -> list[float] | None:
    """The thresholds a card carries, in its label order, or None when it has none. ConfigError when the section
    is malformed (a label missing, a value outside (0, 1))."""
    if not card or card.get("thresholds") is None:
        return None
    section = card["thresholds"]
    if not isinstance(section, Mapping) or not isinstance(section.get("values"), Mapping):
        raise ConfigError("the model card's thresholds section has no 'values' table; set the thresholds again")
    return check_thresholds(section["values"], list(card.get("labels") or []))


def is_per_label_metric(name: str) -> bool:
    """A round metric about one label (``eval_f1/<label>``, ``eval_auc/<label>``), shown in the per-label table."""
    return name.startswith(("eval_f1/", "eval_auc/", "f1/", "auc/"))


def card_markdown_lines(card: Mapping[str, Any]) -> list[str]:
    """The Markdown of the card's per-label section: each label's threshold and last-round F1 / AUC ([] for a
    card with neither)."""
    labels = list(card.get("labels") or [])
    final = card.get("final_round_metrics") or {}
    section = card.get("thresholds") if isinstance(card.get("thresholds"), Mapping) else None
    has_metrics = any(f"eval_f1/{lab}" in final for lab in labels)
    if not labels or (section is None and not has_metrics):
        return []
    values = section.get("values", {}) if section else {}

    def fmt(v: Any) -> str:
        return "–" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["## Per-label decisions", ""]
    if section:
        tuned = section.get("tuned_on")
        where = (f"tuned for F1 on {tuned.get('rows')} validation rows of {len(tuned.get('sites') or [])} site(s) "
                 f"({', '.join(tuned.get('sites') or [])}), {tuned.get('bins')} bins" if tuned else "set by hand")
        lines += [f"A label is predicted when its {section.get('rule', RULE)}; thresholds {where} "
                  f"(source: {section.get('source')}).", ""]
    else:
        lines += [f"Every label is predicted at probability >= {DEFAULT} (no tuned thresholds).", ""]
    lines += ["| label | threshold | F1 (last round) | AUC (last round) |", "|---|---|---|---|"]
    for lab in labels:
        lines.append(f"| {lab.replace('|', chr(92) + '|')} | {fmt(values.get(lab, DEFAULT))} | {fmt(final.get(f'eval_f1/{lab}'))} | "
                     f"{fmt(final.get(f'eval_auc/{lab}'))} |")
    return lines + [""]


__all__ = ["DEFAULT", "RULE", "card_markdown_lines", "card_thresholds", "check_thresholds", "is_per_label_metric",
           "thresholds_section"]
