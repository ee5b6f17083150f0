"""A site's answer to a federated statistics task (``kind = "statistics"``).

:func:`answer_statistics` is the one entry point the agent's dispatcher calls::

    dataset  = the site's registry entry the spec names (its training file, ``path``, or its source's training
               rows; not the held-out split), read as training reads it (hospital_agent.site_data), tolerantly for text classification: bad rows are
               counted (missing / invalid), never sent; the other families' readers stop at the first bad row
    values   = fedclinic.evaluation.statistics.site_statistics(rows, the task's tokenizer, spec, min_cell = k)
               (small cells withheld; discrete Laplace noise when spec.statistics.epsilon > 0)
    noise    -> the privacy ledger: admit epsilon (delta 0) for (dataset, task) *before* reading, charge it before
               the values are returned, finish the task: a site answers a noisy statistics task once (a second
               answer would be a second noisy sample of the same counts; the ledger refuses it)
    patients -> a dataset with a patient id column (``group_field``) is protected per patient: the noise covers
               the most rows one patient has in the file (fedclinic.evaluation.statistics_dp), and the ledger
               records the unit "patient", as a per-patient DP-SGD task does

Every refusal raises :class:`StatisticsDeclined` (or :class:`~hospital_agent.privacy_ledger.BudgetExceeded`),
a :class:`~fedclinic.errors.FedclinicError` whose message is the decline reason and holds no value from the data
(a bad dataset file gives only the rule that failed and the row number, ``DatasetError.public``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from fedclinic.errors import DatasetError, FedclinicError
from fedclinic.evaluation.statistics import RowProblems, site_statistics
from fedclinic.proto import task_pb2
from fedclinic.strategies.secure_laplace import SecureDiscreteLaplace

from hospital_agent.config import AgentConfig
from hospital_agent.privacy_ledger import PrivacyLedger
from hospital_agent.site_privacy import SitePrivacy
from hospital_agent.site_data import read_ids, read_rows

#: families whose rows carry no text and labels to describe
UNSUPPORTED_FAMILIES = ("question-answering",)


class StatisticsDeclined(FedclinicError):
    """The site will not answer this statistics task; the message is the reason, safe to send."""


def answer_statistics(spec: task_pb2.TaskSpec, *, task_id: str, config: AgentConfig, min_cell: int,
                      ledger: PrivacyLedger | SitePrivacy | None, tokenizer: Any = None,
                      sampler: SecureDiscreteLaplace | None = None) -> dict[str, float]:
    """The site's released statistics of the dataset ``spec`` names (keys: fedclinic.evaluation.statistics).

    ``min_cell``: the site policy's ``min_cell_rows``. ``ledger``: the agent's privacy ledger (or its
    SitePrivacy); needed only when the spec asks for noise. ``tokenizer``: the task's tokenizer -- the bytes of
    the model's ``tokenizer.json``, that file's path or the synced model folder holding it (checked against
    ``spec.tokenizer_sha256`` when the spec pins one), or a loaded ``tokenizers.Tokenizer``; None leaves out the token keys (unk_rate, tokens_q*, truncated_rate,
    tokens_per_char). ``sampler``: for tests that replay the noise; None draws it from a fresh CSPRNG."""
    if spec.family in UNSUPPORTED_FAMILIES:
        raise StatisticsDeclined(f"statistics of a {spec.family} dataset are not supported (its rows have no "
                                 "label to count); ask for text-, token- or image-text-classification statistics")
    entry = config.datasets.get(spec.dataset)
    if entry is None:
        raise StatisticsDeclined(f"dataset {spec.dataset!r} is not in this site's registry; the site admin adds "
                                 f"it under [datasets.{spec.dataset}] in agent.toml, or the task names another")
    tok = _tokenizer(tokenizer, spec)
    epsilon = float(spec.statistics.epsilon) if spec.HasField("statistics") else 0.0
    book = _ledger(ledger) if epsilon > 0 else None
    per_unit = _rows_per_patient(spec, entry) if book is not None else 1
    if book is not None:
        unit = "patient" if entry.group_field else "example"
        book.admit(spec.dataset, task_id, epsilon, 0.0,  # BudgetExceeded names the budget left
                   accountant=json.dumps({"mechanism": "discrete-laplace", "kind": "statistics", "unit": unit,
                                          "epsilon": epsilon}))
    try:
        values = _compute(spec, entry, tok, min_cell, sampler, per_unit)
        if book is not None:
            book.charge(spec.dataset, task_id, 1, epsilon)  # before anything leaves; refused if answered already
    finally:
        if book is not None:
            book.finish(spec.dataset, task_id)  # one answer per task: nothing more is spent on it
    return values


def _rows_per_patient(spec: task_pb2.TaskSpec, entry) -> int:
    """The most rows one patient has in the dataset file (every row, bad ones too); 1 for a dataset without a
    patient id column (each row its own unit)."""
    if not entry.group_field:
        return 1
    try:
        ids = read_ids(entry)
    except DatasetError as exc:
        raise StatisticsDeclined(f"dataset {spec.dataset!r} protects patients but its patient ids cannot be read: "
                                 f"{exc.public or 'they do not meet the data contract'}; noisy statistics need "
                                 "every row's patient id") from None
    return max(Counter(ids).values(), default=1)


def _compute(spec: task_pb2.TaskSpec, entry, tokenizer: Any, min_cell: int,
             sampler: SecureDiscreteLaplace | None, rows_per_unit: int = 1) -> dict[str, float]:
    problems = RowProblems()
    try:
        rows = read_rows(entry, spec, on_bad_row=problems)
    except DatasetError as exc:
        raise StatisticsDeclined(f"dataset {spec.dataset!r} cannot be read: "
                                 f"{exc.public or 'it does not meet the task data contract'}") from None
    return site_statistics(rows, tokenizer, spec, min_cell=min_cell, problems=problems, sampler=sampler,
                           rows_per_unit=rows_per_unit)


def _tokenizer(tokenizer: Any, spec: task_pb2.TaskSpec) -> Any:
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        try:
            tokenizer = path.read_bytes()
        except OSError:
            raise StatisticsDeclined("the task's model has no readable tokenizer.json at this site; statistics "
                                     "need the tokenizer the task declares") from None
    if not isinstance(tokenizer, (bytes, bytearray)):
        return tokenizer
    if spec.tokenizer_sha256 and hashlib.sha256(tokenizer).hexdigest() != spec.tokenizer_sha256:
        raise StatisticsDeclined("the tokenizer.json given is not the tokenizer the task declares "
                                 "(tokenizer_sha256); resubmit the task with its model's tokenizer")
    from fedclinic.models.base import load_tokenizer  # the tokenizers library, only when a task brings one

    return load_tokenizer(bytes(tokenizer))


def _ledger(ledger: PrivacyLedger | SitePrivacy | None) -> PrivacyLedger:
    if isinstance(ledger, SitePrivacy):
        return ledger.ledger
    if ledger is None:
        raise StatisticsDeclined("the task asks for noisy statistics ([statistics] epsilon) but this site keeps no "
                                 "privacy ledger; ask for exact statistics, or run the task on a hospital agent")
    return ledger


__all__ = ["StatisticsDeclined", "UNSUPPORTED_FAMILIES", "answer_statistics"]
