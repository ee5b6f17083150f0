"""The site admin's table from codes (OMOP concept ids, FHIR codings) to the label names tasks use, and the
per-patient held-out split, shared by the OMOP and FHIR sources.

::

    [datasets.notes.labels]        # code -> label name
    "201826" = "diabetes"
    "316866" = "hypertension"
    unmapped_label = "other"       # optional (in [datasets.notes]): the label of a row none of whose codes is
                                   # mapped; without it such rows are left out (check-config counts them)
    eval_share = 0.2               # optional: patients whose id hashes below 0.2 form the held-out split
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

from fedclinic.errors import ConfigError


def parse_label_map(value: Any, where: str, key_ok: Callable[[str], bool], key_example: str) -> dict[str, str]:
    """``[...labels]`` as ``{code: label}`` (ConfigError when empty, a key fails ``key_ok``, or a label is not a
    non-empty string)."""
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{where}: a [labels] table mapping codes to label names is required, e.g. "
                          f"{key_example} = \"diabetes\"")
    out = {}
    for code, label in value.items():
        if not key_ok(str(code)):
            raise ConfigError(f"{where} labels: key {code!r} is not a code this source knows; e.g. {key_example}")
        if not isinstance(label, str) or not label.strip():
            raise ConfigError(f"{where} labels: {code!r} must map to a label name (a non-empty string), got {label!r}")
        out[str(code)] = label.strip()
    return out


def optional_label(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where} unmapped_label must be a label name, got {value!r}")
    return value.strip()


def eval_share(value: Any, where: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ConfigError(f"{where} eval_share must be a fraction of patients in (0, 1), e.g. 0.2, got {value!r}")
    return float(value)


def in_eval(patient_id: object, share: float) -> bool:
    """The patient's rows belong to the held-out split: sha256 of the id, read as a fraction in [0, 1), is below
    ``share`` (the same patient always lands in the same split, on every read and at every site)."""
    digest = hashlib.sha256(str(patient_id).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < share


def split_of(patient_id: object, share: float) -> str:
    return "eval" if share and in_eval(patient_id, share) else "train"


__all__ = ["eval_share", "in_eval", "optional_label", "parse_label_map", "split_of"]
