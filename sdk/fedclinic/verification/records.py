"""Where ``fedclinic task verify`` reads a task's public records from, and the records' round view.

:class:`RecordSource` is what the verifier needs from an aggregator (``fedclinic.client.Client`` is one): the
records (``Control.GetTaskRecords``), a model by round with the hash its tensors and files verified to, and a
blob the records name (``Control.FetchTaskBlob``). Nothing a source returns is trusted: every statement is
checked against the CA, every blob against the sha256 a site signed, every model against its hash.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

from fedclinic.errors import IntegrityError
from fedclinic.pki.common import PkiError
from fedclinic.pki.signed_statement import SignedStatement
from fedclinic.proto import control_pb2
from fedclinic.transport.package import ModelPackage
from fedclinic.verification.round_statement import RoundStatement


class RecordSource(Protocol):
    def task_records(self, task_id: str) -> control_pb2.TaskRecords: ...

    def fetch_model(self, task_id: str, round: int) -> tuple[ModelPackage, str]:
        """The model after ``round`` (the initial one for -1) and the model hash it verified to."""

    def fetch_task_blob(self, task_id: str, sha256: str) -> bytes: ...


def all_rounds(ask: Callable[[int], control_pb2.TaskRecords]) -> control_pb2.TaskRecords:
    """Every round of a task's records: ``ask(first_round)`` is one GetTaskRecords call (either service), asked
    again from its ``next_round`` until nothing is left."""
    out = ask(0)
    while out.next_round > (out.rounds[-1].round if out.rounds else 0):
        more = ask(out.next_round)
        out.rounds.extend(more.rounds)
        out.next_round = more.next_round
    return out


def checked_blob(source: RecordSource, task_id: str, sha256: str, what: str) -> bytes:
    """Blob ``sha256`` of the task's records, checked against that hash (IntegrityError naming ``what``)."""
    data = source.fetch_task_blob(task_id, sha256)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise IntegrityError(f"{what}: the aggregator served bytes that do not hash to the signed {sha256[:12]}")
    return data


@dataclass
class RoundView:
    """One round's records with its statements read and checked (:func:`read_statements`)."""

    record: control_pb2.RoundRecords
    statements: list[RoundStatement] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def read_statements(task_id: str, rec: control_pb2.RoundRecords, ca_path: str) -> RoundView:
    """Parse and verify every statement of round ``rec`` (signed by the agent certificate of the site it names,
    issued by the CA at ``ca_path``; about this task and round; one per site). Each bad one is a problem."""
    view = RoundView(rec)
    seen: dict[str, RoundStatement] = {}
    for msg in rec.statements:
        try:
            st = RoundStatement.read(SignedStatement.from_proto(msg))
            st.verify(ca_path)
        except PkiError as exc:
            view.problems.append(f"round {rec.round}: a site statement is not valid: {exc}")
            continue
        if st.task_id != task_id or st.round != rec.round:
            view.problems.append(f"round {rec.round}: the statement of {st.site} is about task {st.task_id} round "
                                 f"{st.round}, not this round")
            continue
        prior = seen.get(st.site)
        if prior is not None and not (rec.secure and prior.secagg_session != st.secagg_session):
            view.problems.append(f"round {rec.round}: {st.site} signed two statements for the round")
            continue
        seen[st.site] = st
        view.statements.append(st)
    return view


__all__ = ["RecordSource", "RoundView", "all_rounds", "checked_blob", "read_statements"]
