"""``fedclinic serve``'s check of a bundle's signature before anything of it is loaded.

:func:`check_bundle_trust` verifies the bundle's ``BUNDLE_SIGNATURE.json`` (:func:`fedclinic.pki.bundle_signature.
verify_bundle`: a scientist of the CA signed it, the source model's signatures verify, every file hashes to what was
signed and no file was added) against the CA given by ``--trust-ca`` (else ``--ca``, else ``$FEDCLINIC_CA``).
A bundle whose signature fails is always refused (:class:`~fedclinic.pki.bundle_signature.BundleSignatureError`,
naming the file that differs). ``--allow-unsigned`` lets through only what cannot be checked: a bundle with no
signature file, or a signed bundle when no CA is given; each is served with a warning.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedclinic.errors import ConfigError
from fedclinic.pki.bundle_signature import BUNDLE_SIGNATURE_FILE, UnsignedBundle, verify_bundle


def trust_ca(trust_ca_arg: str | None, ca_arg: str | None) -> Path | None:
    """The CA bundles are checked against: ``--trust-ca``, else ``--ca``, else ``$FEDCLINIC_CA``, else None."""
    chosen = trust_ca_arg or ca_arg or os.environ.get("FEDCLINIC_CA")
    return Path(chosen) if chosen else None


def check_bundle_trust(folder: str | os.PathLike[str], *, ca: Path | None, allow_unsigned: bool) -> tuple[str, bool]:
    """(what to print, whether it is a warning) for the bundle in ``folder`` ("" for a folder without a graph, which
    the loader refuses); raises BundleSignatureError when its
    signature fails, UnsignedBundle or ConfigError when it cannot be checked and ``allow_unsigned`` is not set."""
    root = Path(folder)
    if not any((root / name).is_file() for name in ("model.onnx", "model.int8.onnx")):
        return "", False  # not a bundle: the loader says what is missing
    if ca is None:
        if not allow_unsigned:
            raise ConfigError("serve checks the bundle's signature against the fedclinic CA: give --trust-ca CA.crt "
                              "(or --ca, or FEDCLINIC_CA), or --allow-unsigned to serve it unverified")
        signed = (root / BUNDLE_SIGNATURE_FILE).is_file()
        return (f"warning: serving {root} UNVERIFIED (--allow-unsigned): "
                + ("no CA given to check its signature against" if signed else "it is not signed"), True)
    try:
        verdict = verify_bundle(root, ca_path=ca)
    except UnsignedBundle:
        if not allow_unsigned:
            raise
        return f"warning: serving {root} UNVERIFIED (--allow-unsigned): it is not signed", True
    return f"bundle {root} verified: {verdict.describe()}", False
