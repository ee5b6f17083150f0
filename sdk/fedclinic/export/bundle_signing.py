"""What ``fedclinic export onnx`` does about signatures: check the source model's, sign the bundle.

:class:`BundleSigning` is handed to :func:`fedclinic.export.onnx_export.export_onnx` (the command always builds one;
a library caller that passes none gets the unchecked, unsigned export of release 0.1):

- before the export, :meth:`BundleSigning.check_source` verifies the model folder's ``SIGNATURES.json`` (the
  aggregator's statement and the download countersignature, :mod:`fedclinic.pki.model_signatures`) against the
  CA and against the package as it is now: a tensor or file edited since the download, a folder without
  signatures, or signatures from another CA are refused (IntegrityError naming what failed) unless
  ``allow_unsigned``, which exports anyway, says so in the log, and records no source signatures;
- after the parity checks, :meth:`BundleSigning.sign` writes ``BUNDLE_SIGNATURE.json``
  (:mod:`fedclinic.pki.bundle_signature`): every file's sha256 and the source signatures, signed with the
  exporting scientist's key. Without a key the bundle is written unsigned only with ``allow_unsigned``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.pki import check_own_certificate
from fedclinic.pki.bundle_signature import BUNDLE_SIGNATURE_FILE, sign_bundle
from fedclinic.pki.common import PkiError
from fedclinic.pki.model_signatures import PERSON_ROLES, ModelSignatures
from fedclinic.pki.signed_statement import Signer
from fedclinic.transport.package import SIGNATURES_FILE, ModelPackage


@dataclass(frozen=True)
class BundleSigning:
    """The CA the source model's signatures are checked against (``ca``), the exporter's certificate and key
    (``cert``/``key``: the bundle is signed with them) and whether a model or bundle without valid signatures is
    accepted (``allow_unsigned``)."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    allow_unsigned: bool = False

    @classmethod
    def from_args(cls, args: Any) -> "BundleSigning":
        """From ``fedclinic export onnx``'s ``--ca``, ``--sign-cert``, ``--sign-key``, ``--allow-unsigned``."""
        def path(value: str | None) -> Path | None:
            return Path(value) if value else None

        return cls(path(args.ca), path(args.sign_cert), path(args.sign_key), bool(args.allow_unsigned))

    def check_arguments(self) -> None:
        """Before any work: the credentials given are usable, and what is missing is allowed (ConfigError)."""
        if bool(self.cert) != bool(self.key):
            raise ConfigError("give both --sign-cert and --sign-key, or neither")
        if not self.allow_unsigned:
            if self.ca is None:
                raise ConfigError("export checks the model's signatures against the fedclinic CA: give --ca (or "
                                  "FEDCLINIC_CA), or --allow-unsigned to export a model without checking them")
            if self.cert is None:
                raise ConfigError("export signs the bundle with your certificate: give --sign-cert and --sign-key "
                                  "(or FEDCLINIC_CERT and FEDCLINIC_KEY), or --allow-unsigned for an unsigned bundle")
        if self.cert is not None and self.ca is not None:
            try:
                ident = check_own_certificate(self.cert, self.key, self.ca)
            except PkiError as exc:
                raise ConfigError(f"cannot sign the bundle: {exc}") from None
            if ident.role not in PERSON_ROLES:
                raise ConfigError(f"certificate {self.cert} has role {ident.role!r}; a bundle is signed with a "
                                  f"{' or '.join(PERSON_ROLES)} certificate")

    def check_source(self, folder: Path, package: ModelPackage, log: Callable[[str], None]) -> ModelSignatures | None:
        """The folder's verified signatures over ``package`` (as loaded from it), or None when they are missing
        or fail and ``allow_unsigned`` (logged); IntegrityError otherwise."""
        try:
            if self.ca is None:
                raise PkiError("no CA was given to check its signatures against")
            signatures = ModelSignatures.load(folder)
            if signatures is None:
                raise PkiError(f"it has no {SIGNATURES_FILE}: it was not downloaded with `fedclinic task download`, "
                               "or the file was removed")
            provenance = signatures.verify(ca_path=self.ca, manifest=package.manifest())
        except PkiError as exc:
            if not self.allow_unsigned:
                raise IntegrityError(f"export of {folder} refused: {exc}; export only a model as it was downloaded, "
                                     "or pass --allow-unsigned to export it without signatures") from None
            log(f"warning: the model's signatures are not checked ({exc}); --allow-unsigned: the bundle records "
                "no source signatures")
            return None
        log(f"model signatures verified: {provenance.describe()}")
        return signatures

    def sign(self, stage: Path, files: Sequence[str], source: ModelSignatures | None,
             log: Callable[[str], None]) -> list[str]:
        """Sign the bundle staged in ``stage`` (its ``files``); returns the files written ([] when unsigned)."""
        if self.cert is None or self.key is None:
            log("warning: the bundle is not signed (no --sign-cert/--sign-key); `fedclinic serve` refuses it "
                "unless given --allow-unsigned")
            return []
        try:
            sign_bundle(stage, Signer(key_path=self.key, cert_path=self.cert), files=files, source=source)
        except PkiError as exc:
            raise ConfigError(f"cannot sign the bundle: {exc}") from None
        log(f"bundle signed with {self.cert} ({len(files)} files)")
        return [BUNDLE_SIGNATURE_FILE]


def add_signing_arguments(p: Any) -> None:
    """``--ca``, ``--sign-cert``, ``--sign-key``, ``--allow-unsigned`` of ``fedclinic export onnx``."""
    g = p.add_argument_group("signatures (docs/data-scientist.md, signed downloads and bundles)")
    g.add_argument("--ca", default=os.environ.get("FEDCLINIC_CA"),
                   help="the fedclinic CA certificate the model's SIGNATURES.json is checked against "
                        "(default: $FEDCLINIC_CA)")
    g.add_argument("--sign-cert", default=os.environ.get("FEDCLINIC_CERT"),
                   help="your (scientist) certificate: signs the bundle (default: $FEDCLINIC_CERT)")
    g.add_argument("--sign-key", default=os.environ.get("FEDCLINIC_KEY"),
                   help="its private key (default: $FEDCLINIC_KEY)")
    g.add_argument("--allow-unsigned", action="store_true",
                   help="export a model whose signatures are missing or do not verify, and/or write an unsigned "
                        "bundle (said in the log; `fedclinic serve` then needs --allow-unsigned)")
