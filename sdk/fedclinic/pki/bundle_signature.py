"""The signed manifest of an ONNX bundle: every file's sha256, signed by the scientist who exported it.

``fedclinic export onnx`` writes ``BUNDLE_SIGNATURE.json`` into the bundle (:func:`sign_bundle`)::

    {"format": "fedclinic-bundle-signature-v1",
     "statement": {"purpose": "onnx-bundle", "payload": "<canonical JSON, as signed>", "signature": "<base64>",
                   "certificate_pem": "<PEM>"}}

The payload is ``{"files": {path: sha256, ...}, "source": S}``: every file of the bundle but this one (paths
relative to the bundle, "/"-separated), and ``S`` the source model's ``SIGNATURES.json`` as the download wrote it
(:mod:`fedclinic.pki.model_signatures`: the aggregator's statement and the download countersignature), or null
when the model was exported without them (``--allow-unsigned``). The signer is a ``scientist`` (or ``admin``)
certificate of the CA.

:func:`verify_bundle` (``fedclinic serve`` before it loads anything) checks the signature against the CA, the
source signatures when present, and every file against its hash: a file edited (one byte is enough), missing or
added is refused, named. :class:`UnsignedBundle` is raised when the bundle has no signature file at all, so a
caller can accept it on request; every other failure is a :class:`BundleSignatureError`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from fedclinic.errors import IntegrityError
from fedclinic.pki.common import PeerIdentity, PkiError
from fedclinic.pki.model_signatures import (
    MAX_SIGNATURE_FILE_BYTES,
    ModelProvenance,
    ModelSignatures,
    statement_from_json,
    statement_to_json,
    verify_person,
)
from fedclinic.pki.signed_statement import Signer

BUNDLE_PURPOSE = "onnx-bundle"
BUNDLE_SIGNATURE_FILE = "BUNDLE_SIGNATURE.json"
BUNDLE_FORMAT = "fedclinic-bundle-signature-v1"


class BundleSignatureError(IntegrityError):
    """A bundle's signature is missing, does not verify, or a file differs from what was signed."""


class UnsignedBundle(BundleSignatureError):
    """The bundle has no ``BUNDLE_SIGNATURE.json``."""


@dataclass(frozen=True)
class BundleVerification:
    """A verified bundle: who signed it, how many files it holds, and the source model's provenance (None when it
    was exported from a model without signatures)."""

    signer: PeerIdentity
    files: int
    source: ModelProvenance | None

    def describe(self) -> str:
        text = f"signed by the {self.signer.role} {self.signer.name!r} ({self.files} files verified)"
        if self.source is None:
            return text + "; exported from a model without signatures"
        return f"{text}; {self.source.describe()}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def bundle_files(folder: Path) -> list[str]:
    """Every file of the bundle in ``folder`` but its signature file (relative "/"-paths, sorted)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder).as_posix() != BUNDLE_SIGNATURE_FILE)


def sign_bundle(folder: str | os.PathLike[str], signer: Signer, *, files: Iterable[str],
                source: ModelSignatures | None) -> Path:
    """Write ``folder``/BUNDLE_SIGNATURE.json over ``files`` (relative paths inside ``folder``) and ``source``;
    returns its path."""
    root = Path(folder)
    hashes = {name: file_sha256(root / name) for name in sorted(set(files)) if name != BUNDLE_SIGNATURE_FILE}
    statement = signer.sign_json(BUNDLE_PURPOSE, {"files": hashes,
                                                  "source": source.to_json() if source is not None else None})
    path = root / BUNDLE_SIGNATURE_FILE
    path.write_text(json.dumps({"format": BUNDLE_FORMAT, "statement": statement_to_json(statement)}, indent=2)
                    + "\n", encoding="utf-8")
    return path


def verify_bundle(folder: str | os.PathLike[str], *, ca_path: str | os.PathLike[str]) -> BundleVerification:
    """Check the bundle in ``folder`` (module docstring) against the CA certificate at ``ca_path``."""
    root = Path(folder)
    path = root / BUNDLE_SIGNATURE_FILE
    if not path.is_file():
        raise UnsignedBundle(f"the bundle {root} is not signed (it has no {BUNDLE_SIGNATURE_FILE}); export it with "
                             "`fedclinic export onnx` and a scientist's --sign-cert/--sign-key, or pass "
                             "--allow-unsigned to serve it unverified")
    if path.stat().st_size > MAX_SIGNATURE_FILE_BYTES:
        raise BundleSignatureError(f"{path} is larger than {MAX_SIGNATURE_FILE_BYTES} bytes; it is not a bundle "
                                   "signature")
    try:
        doc = json.loads(path.read_bytes())
        if not isinstance(doc, dict) or doc.get("format") != BUNDLE_FORMAT:
            raise PkiError(f"{path} is not a fedclinic bundle signature (format {BUNDLE_FORMAT!r})")
        statement = statement_from_json(doc.get("statement"), str(path))
        signer = verify_person(statement, ca_path=ca_path, purpose=BUNDLE_PURPOSE)
        payload = statement.json()
        signed = payload.get("files") if isinstance(payload, dict) else None
        if not isinstance(signed, dict) or not all(isinstance(v, str) for v in signed.values()):
            raise PkiError(f"{path} lists no files")
        source = None
        if payload.get("source") is not None:
            try:
                source = ModelSignatures.from_json(payload["source"], "the source model's signatures").verify(
                    ca_path=ca_path)
            except PkiError as exc:
                raise PkiError(f"the signatures of the model it was exported from do not verify: {exc}") from None
    except (ValueError, UnicodeDecodeError):
        raise BundleSignatureError(f"the bundle's signature {path} is not JSON; re-export the bundle") from None
    except PkiError as exc:
        raise BundleSignatureError(f"the bundle {root} is refused: its signature does not verify against the CA "
                                   f"{ca_path}: {exc}") from None
    _check_files(root, signed)
    return BundleVerification(signer, len(signed), source)


def _check_files(root: Path, signed: dict[str, str]) -> None:
    """Every signed file is there with its signed hash, and no other file is."""
    present = bundle_files(root)
    extra = sorted(set(present) - set(signed))
    if extra:
        raise BundleSignatureError(f"the bundle {root} is refused: file {extra[0]} is not covered by its signature "
                                   "(added after the bundle was signed); remove it or re-export the bundle")
    for name in sorted(signed):
        path = root / name
        if name not in present:
            raise BundleSignatureError(f"the bundle {root} is refused: file {name}, which its signature covers, is "
                                       "missing")
        if file_sha256(path) != signed[name]:
            raise BundleSignatureError(f"the bundle {root} is refused: file {name} was altered after the bundle was "
                                       "signed (its sha256 differs from the signed one); re-export the bundle from "
                                       "the signed model")
