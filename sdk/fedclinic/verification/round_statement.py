"""A site's signed round statement: what it trained from and what it sent, for ``fedclinic task verify``.

The agent signs, for every update it writes (plain or a secure-aggregation masked input), a
:class:`~fedclinic.pki.signed_statement.SignedStatement` for purpose :data:`PURPOSE` over::

    {"task_id", "round", "attempt", "site", "base_model": the hash of the global model it trained from,
     "tensors": [{"name", "dtype", "shape", "codec", "codec_params", "sha256", "encoded_nbytes"}, ...],
     "update_digest": sha256 of the canonical JSON of "tensors", "num_samples",
     "secagg_session": the masked input's session ("" for a plain update)}

Each tensor's ``sha256`` covers its encoded bytes as sent (the receiver checks it), so the statement commits to
every byte of the update; for a masked input the one tensor is the masked vector. The statement travels in
``UpdateHeader.statement`` and is written once with the update into the outbox, so a resend or a resumed upload
carries the same bytes. :func:`check_against_header` is the aggregator's admission check (and the verifier's
reading of a statement): signed by the calling site's agent certificate, for this purpose, and equal to what the
header declares.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Iterable

from fedclinic.pki.common import PkiError
from fedclinic.pki.signed_statement import SignedStatement, Signer, canonical_json
from fedclinic.proto import agent_pb2

PURPOSE = "round-statement"
"""The purpose string of a round statement (a signature for another purpose never counts as one)."""
FEATURE = "round-statements-v1"
"""The Hello feature of an agent that signs round statements: the aggregator then refuses its updates without one."""


def tensor_rows(tensors: Iterable[Any]) -> list[dict[str, Any]]:
    """The statement's view of an update's tensor headers, in order."""
    return [{"name": t.name, "dtype": t.dtype, "shape": [int(d) for d in t.shape], "codec": t.codec or "raw",
             "codec_params": dict(sorted(t.codec_params.items())), "sha256": t.sha256,
             "encoded_nbytes": int(t.encoded_nbytes)} for t in tensors]


def update_digest(rows: list[dict[str, Any]]) -> str:
    """sha256 over the canonical JSON of :func:`tensor_rows`: one value naming every byte of the update."""
    return hashlib.sha256(canonical_json(rows)).hexdigest()


def statement_payload(header: agent_pb2.UpdateHeader, site: str) -> dict[str, Any]:
    """What ``site`` states about the update ``header`` describes (module docstring)."""
    rows = tensor_rows(header.tensors)
    return {"task_id": header.task_id, "round": int(header.round), "attempt": int(header.attempt), "site": site,
            "base_model": header.base_model_hash, "tensors": rows, "update_digest": update_digest(rows),
            "num_samples": int(header.num_samples), "secagg_session": header.secagg_session_id}


def sign_header(header: agent_pb2.UpdateHeader, site: str, signer: Signer) -> None:
    """Sign ``site``'s statement about ``header`` and put it into ``header.statement`` (before the update is
    written to the outbox, so every resend carries the same statement)."""
    header.statement.CopyFrom(signer.sign_json(PURPOSE, statement_payload(header, site)).to_proto())


@dataclass(frozen=True)
class RoundStatement:
    """A signed round statement, read (:meth:`read`) and, when checked, verified."""

    signed: SignedStatement
    task_id: str
    round: int
    attempt: int
    site: str
    base_model: str
    tensors: tuple[dict[str, Any], ...]
    update_digest: str
    num_samples: int
    secagg_session: str

    @classmethod
    def read(cls, signed: SignedStatement) -> "RoundStatement":
        """Parse the payload (PkiError when it is not a round statement's); the signature is not checked here."""
        if signed.purpose != PURPOSE:
            raise PkiError(f"a statement signed for {signed.purpose!r} is not a round statement")
        doc = signed.json()
        try:
            rows = tuple(doc["tensors"])
            out = cls(signed, str(doc["task_id"]), int(doc["round"]), int(doc["attempt"]), str(doc["site"]),
                      str(doc["base_model"]), rows, str(doc["update_digest"]), int(doc["num_samples"]),
                      str(doc["secagg_session"]))
        except (KeyError, TypeError, ValueError):
            raise PkiError("the round statement lacks a field or has one of the wrong type") from None
        if update_digest(list(rows)) != out.update_digest:
            raise PkiError(f"the round statement of {out.site} names tensors that do not match its update digest")
        return out

    def verify(self, ca_path: str | os.PathLike[str]) -> None:
        """Signed by the agent certificate of :attr:`site` issued by the CA at ``ca_path`` (PkiError otherwise)."""
        self.signed.verify(ca_path=ca_path, role="agent", name=self.site, purpose=PURPOSE)


def check_against_header(statement: SignedStatement, header: agent_pb2.UpdateHeader, site: str,
                         ca_path: str | os.PathLike[str] | None) -> RoundStatement:
    """The aggregator's check of an arriving update's statement: it states exactly what ``header`` declares, for
    ``site``, and (with ``ca_path``) is signed by ``site``'s agent certificate. PkiError saying what differs."""
    got = RoundStatement.read(statement)
    want = statement_payload(header, site)
    if statement.json() != want:
        diff = sorted(k for k in want if statement.json().get(k) != want[k])
        raise PkiError(f"the round statement does not match the update it came with (it differs in "
                       f"{', '.join(diff) or 'its fields'})")
    if ca_path is not None:
        got.verify(ca_path)
    return got


__all__ = ["FEATURE", "PURPOSE", "RoundStatement", "check_against_header", "sign_header", "statement_payload",
           "tensor_rows", "update_digest"]
