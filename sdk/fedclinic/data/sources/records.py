"""What every data source yields and reports: :class:`Record` rows and a :class:`SourceCheck`.

A data source (SQL query, OMOP mapping, FHIR NDJSON export, Parquet file) is registered by the site admin in
agent.toml and read by the agent; it turns what it reads into records, which
:func:`fedclinic.data.text.read_source_classification` validates into the same ``Example`` rows a JSONL file
gives (one text, its labels), so training, statistics and evaluation do not know where a row came from.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable

from fedclinic.errors import DatasetError

#: the splits a source may serve: "train" (the dataset) and "eval" (its held-out split, when configured)
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Record:
    """One row of a source before validation: ``row`` (1-based position in the source's result), the raw text,
    the raw label value (a label name, a list of them, a ``|``-separated string or None) and the patient id
    (None when the source has none). ``where`` places the row for the site's own messages."""

    row: int
    text: Any
    labels: Any
    patient_id: Any = None
    where: str = ""


@dataclass
class SourceCheck:
    """What ``hospital-agent check-config`` says about one source: ``facts`` (reachable, read-only, columns, row
    counts) and ``problems`` (each with what to fix); no problem means the source is ready."""

    facts: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class DataSource(abc.ABC):
    """A dataset the agent reads from where it lives. Subclasses set ``kind`` and implement :meth:`records`
    and :meth:`check`; ``where`` names the source (never a secret) for messages."""

    kind: str = ""
    #: the dataset has a patient id per row (per-patient differential privacy)
    has_patient_ids: bool = False

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    @abc.abstractmethod
    def where(self) -> str:
        """The dataset and where its rows come from, e.g. "dataset 'notes' (sqlite /data/cdw.sqlite)"."""

    @property
    def has_eval(self) -> bool:
        """The source has a held-out split (``records("eval")``)."""
        return False

    @abc.abstractmethod
    def records(self, split: str = "train",
                on_bad_row: Callable[[DatasetError], None] | None = None) -> list[Record]:
        """Every row of ``split`` in a stable order (the same order on every read of unchanged data).
        DatasetError (naming the source, and the row where there is one) when the source cannot be read; with
        ``on_bad_row``, a row the source itself cannot turn into a record (e.g. an invalid FHIR resource) is
        handed to it and skipped."""

    @abc.abstractmethod
    def check(self) -> SourceCheck:
        """Reachable, read-only, columns present, row count: for ``hospital-agent check-config``."""

    def _split(self, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if split == "eval" and not self.has_eval:
            raise DatasetError(f"{self.where}: no held-out split is configured", rule="no held-out split")


__all__ = ["DataSource", "Record", "SPLITS", "SourceCheck"]
