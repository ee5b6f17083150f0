"""The scientist's signed task: what the task owner signs at submit, and what the aggregator and each site check.

The SDK (:meth:`fedclinic.client.Client.submit`) signs a :class:`~fedclinic.pki.signed_statement.SignedStatement`
for purpose ``"task"`` with the owner's certificate key. Its payload (canonical JSON) binds:

=====================  ===========================================================================================
``owner``              the signer's identity name (equal to the certificate's; the aggregator records it as owner)
``idempotency_key``    the submission's key: the aggregator makes exactly one task of it per owner, so a site that
                       remembers (owner, key) -> task id (hospital_agent.task_bindings) sees any replay of the
                       same signed task under another task id
``spec_sha256``        sha256 of the TaskSpec as canonical JSON (:func:`spec_digest`): every field of the spec,
                       its datasets, hyper-parameters, rounds, strategy, privacy and secure-aggregation settings
``model_hash``         the initial model's manifest hash (every tensor and file of it): what round 1 starts from
``name``               the task's name, for people reading the statement
``signed_unix_ms``     when it was signed: a site may refuse to start a task signed too long ago
                       (``signed_task_max_age_days``), so an old signed task cannot be replayed to it for ever
=====================  ===========================================================================================

The aggregator relays the statement as it was submitted, in every ``Assignment``; the sites check it against
their CA before anything is downloaded. The task id is not signed (the aggregator chooses it after the
signature is made); it is bound through the idempotency key as above.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from fedclinic.pki import identity_from_pem
from fedclinic.pki.common import PeerIdentity, PkiError
from fedclinic.pki.signed_statement import SignedStatement, Signer, canonical_json
from fedclinic.proto import task_pb2

#: the purpose a task statement is signed for (never accepted for another purpose, nor another for this one)
PURPOSE = "task"
#: the roles whose certificates may sign a task (those the control API lets submit one)
SIGNER_ROLES = ("scientist", "admin")
PAYLOAD_VERSION = 1
_FIELDS = {"v": int, "owner": str, "idempotency_key": str, "spec_sha256": str, "model_hash": str, "name": str,
           "signed_unix_ms": int}


def spec_digest(spec: task_pb2.TaskSpec) -> str:
    """sha256 (hex) of ``spec`` as canonical JSON (proto field names, defaults omitted, sorted keys)."""
    as_dict = json_format.MessageToDict(spec, preserving_proto_field_name=True)
    return hashlib.sha256(canonical_json(as_dict)).hexdigest()


def sign_task(signer: Signer, spec: task_pb2.TaskSpec, *, model_hash: str, idempotency_key: str, owner: str,
              signed_unix_ms: int | None = None) -> SignedStatement:
    """The owner's signed statement over ``spec``, the initial model ``model_hash`` and ``idempotency_key``, made
    at ``signed_unix_ms`` (default: now)."""
    when = int(time.time() * 1000) if signed_unix_ms is None else signed_unix_ms
    payload: dict[str, Any] = {"v": PAYLOAD_VERSION, "owner": owner, "idempotency_key": idempotency_key,
                               "spec_sha256": spec_digest(spec), "model_hash": model_hash, "name": spec.name,
                               "signed_unix_ms": when}
    return signer.sign_json(PURPOSE, payload)


@dataclass(frozen=True)
class SignedTask:
    """A task statement whose signature checked out: who signed it and what it binds (module docstring)."""

    signer: PeerIdentity
    idempotency_key: str
    spec_sha256: str
    model_hash: str
    name: str
    signed_unix_ms: int
    #: sha256 of the statement's signature: names this one signed statement (two signings differ)
    statement_id: str


def verify_signed_task(statement: SignedStatement, *, ca_path: Any, spec: task_pb2.TaskSpec,
                       model_hash: str | None = None) -> SignedTask:
    """Check ``statement``: signed for purpose "task", by a certificate of a signing role (:data:`SIGNER_ROLES`)
    that the CA at ``ca_path`` issued, over a well-formed payload whose owner is the signer, whose spec digest is
    that of ``spec`` and (when given) whose initial model is ``model_hash``. PkiError says what failed."""
    if statement.purpose != PURPOSE:
        raise PkiError(f"the task's signature is a statement for {statement.purpose!r}, not for a task")
    if not statement.signature or not statement.certificate_pem:
        raise PkiError("the task statement carries no signature or no certificate")
    try:
        claimed = identity_from_pem(statement.certificate_pem)
    except (PkiError, ValueError):
        raise PkiError("the task's signing certificate is not a fedclinic certificate") from None
    if claimed.role not in SIGNER_ROLES:
        raise PkiError(f"the task is signed by the {claimed.role} {claimed.name!r}; only a task owner "
                       f"({' or '.join(SIGNER_ROLES)} certificate) may sign a task")
    signer = statement.verify(ca_path=ca_path, role=claimed.role, purpose=PURPOSE)
    body = statement.json()
    if not isinstance(body, dict) or any(not isinstance(body.get(k), t) or isinstance(body.get(k), bool)
                                         for k, t in _FIELDS.items()):
        raise PkiError("the signed task statement is malformed (it lacks owner, idempotency key, spec or model "
                       "hash)")
    if body["v"] != PAYLOAD_VERSION:
        raise PkiError(f"the signed task statement has version {body['v']}; this fedclinic reads version "
                       f"{PAYLOAD_VERSION} (upgrade it)")
    if body["owner"] != signer.name:
        raise PkiError(f"the task statement names owner {body['owner']!r} but is signed by {signer.name!r}")
    if body["spec_sha256"] != spec_digest(spec):
        raise PkiError(f"the task spec is not the one its owner {signer.name!r} signed: it was altered after "
                       "signing (or this fedclinic is older than the SDK that signed it and drops fields it does "
                       "not know)")
    if model_hash is not None and body["model_hash"] != model_hash:
        raise PkiError(f"the initial model ({model_hash[:12]}...) is not the one the owner {signer.name!r} signed "
                       f"({body['model_hash'][:12]}...): it was swapped after signing")
    return SignedTask(signer, body["idempotency_key"], body["spec_sha256"], body["model_hash"], body["name"],
                      body["signed_unix_ms"], hashlib.sha256(statement.signature).hexdigest())


__all__ = ["PURPOSE", "SIGNER_ROLES", "SignedTask", "sign_task", "spec_digest", "verify_signed_task"]
