"""Signatures over a downloaded model: the aggregator's statement and the scientist's countersignature.

When a scientist downloads a model (``Control.FetchModel``), the aggregator sends right after the manifest a
:class:`~fedclinic.pki.signed_statement.SignedStatement` of purpose :data:`MODEL_PURPOSE`, made with its own TLS
key, over ``{"task_id", "round", "model_hash", "final"}`` (``round`` 0 = the initial model the scientist
submitted; ``final`` = the completed task's final model). The SDK checks it (:func:`check_aggregator_statement`:
issued by the CA to an ``aggregator``, naming the task, the round asked for and the hash of the manifest that was
downloaded), then countersigns with the scientist's key (:func:`countersign`, purpose :data:`DOWNLOAD_PURPOSE`)
over ``{"task_id", "model_hash", "aggregator_statement_sha256", "tensors", "files"}``: the sha256 of the
aggregator's payload, and every tensor's and file's sha256 of the manifest (so that a later check can name what
changed). Both go into the model folder as ``SIGNATURES.json`` (:class:`ModelSignatures`)::

    {"format": "fedclinic-model-signatures-v1",
     "model_hash": "<the manifest's model hash>",
     "aggregator": {"purpose": "model", "payload": "<canonical JSON, as signed>",
                    "signature": "<base64>", "certificate_pem": "<PEM>"},
     "download":   {"purpose": "model-download", ...}}

:meth:`ModelSignatures.verify` checks the folder's signatures against the CA and against the manifest of the
package the folder holds now (``fedclinic export`` does before it exports); a tensor or file edited after the
download is named. What the signatures cover is the package (:class:`~fedclinic.transport.package.ModelPackage`:
the tensors of ``model.safetensors`` and the package files); the model card is not part of it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fedclinic.pki.common import PeerIdentity, PkiError
from fedclinic.pki.identity import identity_from_pem
from fedclinic.pki.signed_statement import SignedStatement, Signer
from fedclinic.transport.package import SIGNATURES_FILE, Manifest

MODEL_PURPOSE = "model"
DOWNLOAD_PURPOSE = "model-download"
SIGNATURES_FORMAT = "fedclinic-model-signatures-v1"
#: the roles whose certificates may countersign a download or sign a bundle (the control API's callers)
PERSON_ROLES = ("scientist", "admin")
#: the most bytes of a signatures file read (a few KiB in practice: two statements and a manifest's hashes)
MAX_SIGNATURE_FILE_BYTES = 16 << 20


def statement_to_json(statement: SignedStatement) -> dict[str, str]:
    """``statement`` as a JSON object: the payload as the exact (UTF-8, canonical JSON) text that was signed."""
    return {"purpose": statement.purpose, "payload": statement.payload.decode("utf-8"),
            "signature": base64.b64encode(statement.signature).decode("ascii"),
            "certificate_pem": statement.certificate_pem.decode("ascii")}


def statement_from_json(doc: Any, what: str) -> SignedStatement:
    """The statement :func:`statement_to_json` wrote; PkiError naming ``what`` when it is malformed."""
    try:
        return SignedStatement(str(doc["purpose"]), doc["payload"].encode("utf-8"),
                               base64.b64decode(doc["signature"], validate=True),
                               doc["certificate_pem"].encode("ascii"))
    except (KeyError, TypeError, AttributeError, ValueError, UnicodeError):
        raise PkiError(f"{what} is malformed: expected purpose, payload, signature (base64) and certificate_pem")


def verify_person(statement: SignedStatement, *, ca_path: str | os.PathLike[str], purpose: str) -> PeerIdentity:
    """Verify a statement a person signed (a certificate of a role in :data:`PERSON_ROLES`): the signer, or
    PkiError saying what failed."""
    try:
        role = identity_from_pem(statement.certificate_pem).role
    except PkiError:
        role = PERSON_ROLES[0]  # verify() reports the bad certificate
    if role not in PERSON_ROLES:
        raise PkiError(f"the {purpose} statement is signed by a certificate of role {role!r}; it must come from a "
                       f"{' or '.join(PERSON_ROLES)} certificate")
    return statement.verify(ca_path=ca_path, role=role, purpose=purpose)


def aggregator_statement(signer: Signer, *, task_id: str, round: int, model_hash: str,
                         final: bool) -> SignedStatement:
    """The aggregator's statement on a model it streams to a scientist (module docstring)."""
    return signer.sign_json(MODEL_PURPOSE, {"task_id": task_id, "round": int(round), "model_hash": model_hash,
                                            "final": bool(final)})


def check_aggregator_statement(statement: SignedStatement | None, *, ca_path: str | os.PathLike[str],
                               task_id: str, round: int, model_hash: str) -> PeerIdentity:
    """Check the aggregator's statement on a download of ``round`` (0 = the latest/final model, -1 = the initial
    one, as ``Control.FetchModel`` takes it) of ``task_id`` whose manifest hashes to ``model_hash``: signed by an
    aggregator of the CA, for this task, round and model. Returns the aggregator; PkiError saying what failed."""
    if statement is None:
        raise PkiError("the aggregator sent no signature over the model, so nothing shows it is the model the "
                       "aggregator vouches for; upgrade the aggregator, or pass --allow-unsigned to accept it")
    try:
        identity = statement.verify(ca_path=ca_path, role="aggregator", purpose=MODEL_PURPOSE)
    except PkiError as exc:
        raise PkiError(f"the aggregator's signature over the model does not verify: {exc}") from None
    doc = statement.json()
    if not isinstance(doc, dict):
        raise PkiError("the aggregator's model statement is not a JSON object")
    if doc.get("task_id") != task_id:
        raise PkiError(f"the aggregator's signature is for task {doc.get('task_id')!r}, not {task_id!r}")
    if doc.get("model_hash") != model_hash:
        raise PkiError(f"the aggregator signed model {str(doc.get('model_hash'))[:12]}..., but the model downloaded "
                       f"is {model_hash[:12]}...: it is not the model the aggregator vouches for; do not use it")
    want = 0 if round < 0 else round
    if round != 0 and doc.get("round") != want:
        raise PkiError(f"the aggregator's signature is for round {doc.get('round')!r}, not round {want}")
    if round == 0 and doc.get("round") == 0:  # "the latest" exists only once a round has closed
        raise PkiError("the aggregator's signature is for the task's initial model, not its latest one")
    return identity


def manifest_hashes(manifest: Manifest) -> dict[str, dict[str, str]]:
    """Every tensor's and file's sha256 (name -> hash), as the countersignature records them."""
    return {"tensors": {t.name: t.sha256 for t in manifest.tensors},
            "files": {f.path: f.sha256 for f in manifest.files}}


@dataclass(frozen=True)
class ModelProvenance:
    """What a folder's verified signatures say: who signed, for which task, round and model."""

    aggregator: PeerIdentity
    scientist: PeerIdentity
    task_id: str
    round: int
    final: bool
    model_hash: str

    def describe(self) -> str:
        which = "final model" if self.final else (f"model after round {self.round}" if self.round else "initial model")
        return (f"the {which} of task {self.task_id} ({self.model_hash[:12]}...), signed by the aggregator "
                f"{self.aggregator.name!r} and downloaded by the {self.scientist.role} {self.scientist.name!r}")


@dataclass(frozen=True)
class ModelSignatures:
    """A downloaded model's ``SIGNATURES.json`` (module docstring): the aggregator's statement and the
    countersignature of the scientist who downloaded it."""

    aggregator: SignedStatement
    download: SignedStatement

    def to_json(self) -> dict[str, Any]:
        return {"format": SIGNATURES_FORMAT, "model_hash": self.download_payload().get("model_hash", ""),
                "aggregator": statement_to_json(self.aggregator), "download": statement_to_json(self.download)}

    @classmethod
    def from_json(cls, doc: Any, what: str = SIGNATURES_FILE) -> "ModelSignatures":
        if not isinstance(doc, dict) or doc.get("format") != SIGNATURES_FORMAT:
            raise PkiError(f"{what} is not a fedclinic signatures file (format {SIGNATURES_FORMAT!r})")
        return cls(statement_from_json(doc.get("aggregator"), f"{what}: the aggregator's statement"),
                   statement_from_json(doc.get("download"), f"{what}: the download countersignature"))

    def save(self, folder: str | os.PathLike[str]) -> Path:
        path = Path(folder) / SIGNATURES_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> "ModelSignatures | None":
        """The signatures in ``folder``; None when it has no ``SIGNATURES.json``; PkiError when it is unreadable."""
        path = Path(folder) / SIGNATURES_FILE
        if not path.is_file():
            return None
        if path.stat().st_size > MAX_SIGNATURE_FILE_BYTES:
            raise PkiError(f"{path} is larger than {MAX_SIGNATURE_FILE_BYTES} bytes; it is not a signatures file")
        try:
            doc = json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError):
            raise PkiError(f"{path} is not JSON") from None
        return cls.from_json(doc, str(path))

    def download_payload(self) -> dict[str, Any]:
        doc = self.download.json()
        return doc if isinstance(doc, dict) else {}

    def verify(self, *, ca_path: str | os.PathLike[str], manifest: Manifest | None = None) -> ModelProvenance:
        """Check both signatures against the CA, that the countersignature covers this aggregator statement, and
        (given ``manifest``, the package as it is now) that the model is the one signed, naming the tensors and
        files that changed. PkiError saying what failed."""
        try:
            agg = self.aggregator.verify(ca_path=ca_path, role="aggregator", purpose=MODEL_PURPOSE)
        except PkiError as exc:
            raise PkiError(f"the aggregator's signature over the model does not verify: {exc}") from None
        try:
            person = verify_person(self.download, ca_path=ca_path, purpose=DOWNLOAD_PURPOSE)
        except PkiError as exc:
            raise PkiError(f"the download countersignature does not verify: {exc}") from None
        a, d = self.aggregator.json(), self.download_payload()
        if not isinstance(a, dict) or d.get("aggregator_statement_sha256") != hashlib.sha256(
                self.aggregator.payload).hexdigest():
            raise PkiError("the download countersignature covers another aggregator statement than the one beside it")
        if a.get("model_hash") != d.get("model_hash") or a.get("task_id") != d.get("task_id"):
            raise PkiError("the aggregator's statement and the download countersignature name different models")
        if manifest is not None and manifest.model_hash != d.get("model_hash"):
            raise PkiError(f"the model was changed after it was signed: {_changes(manifest, d)}")
        return ModelProvenance(agg, person, str(d.get("task_id")), int(a.get("round", 0)), bool(a.get("final")),
                               str(d.get("model_hash")))


def countersign(signer: Signer, aggregator: SignedStatement, *, task_id: str, manifest: Manifest) -> ModelSignatures:
    """The scientist's countersignature (with ``signer``) over an aggregator statement already checked by
    :func:`check_aggregator_statement`, for the downloaded ``manifest``."""
    download = signer.sign_json(DOWNLOAD_PURPOSE, {
        "task_id": task_id, "model_hash": manifest.model_hash,
        "aggregator_statement_sha256": hashlib.sha256(aggregator.payload).hexdigest(), **manifest_hashes(manifest)})
    return ModelSignatures(aggregator, download)


def _changes(manifest: Manifest, signed: Mapping[str, Any]) -> str:
    """Which tensors and files of ``manifest`` differ from the signed hashes (for the error message)."""
    now = manifest_hashes(manifest)
    parts = []
    for kind, noun in (("tensors", "tensor"), ("files", "file")):
        was = signed.get(kind) if isinstance(signed.get(kind), dict) else {}
        for name in sorted(set(now[kind]) | set(was)):
            if name not in was:
                parts.append(f"{noun} {name!r} was added")
            elif name not in now[kind]:
                parts.append(f"{noun} {name!r} is missing")
            elif now[kind][name] != was[name]:
                parts.append(f"{noun} {name!r} differs")
    return ", ".join(parts[:8]) + (f" and {len(parts) - 8} more" if len(parts) > 8 else "") if parts else \
        "its hash differs from the signed one"
