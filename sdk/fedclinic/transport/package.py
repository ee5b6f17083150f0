"""A model package: the tensors and files that define one model version, and nothing executable.

On disk a package is a folder holding ``model.safetensors`` plus plain files (``config.json``, tokenizer
JSON/vocab, ``fedclinic_model.json`` with the family/architecture/labels). For the transformer architecture
the folder is also a normal Hugging Face model folder (``from_pretrained(folder)`` works offline).

Content addressing: a tensor's id is the sha256 of its raw little-endian C-order bytes; a model version's
id (``model_hash``) is the sha256 of the canonical JSON of its manifest (tensor names, dtypes, shapes,
hashes and file hashes). Two packages with equal ``model_hash`` are byte-identical.

The model card a download writes beside the files (``model_card.json``, ``MODEL_CARD.md``; see
:mod:`fedclinic.spec.model_card`) describes the package and is not part of it: :meth:`ModelPackage.load` leaves
them out, so a downloaded folder still hashes to the ``model_hash`` its card states.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from fedclinic.errors import IntegrityError
from fedclinic.runtime.safetensors_file import safetensors_with_metadata  # noqa: F401  (re-exported)
from fedclinic.runtime.array_blocks import flat_blocks
from fedclinic.runtime.safetensors_file import MappedSafetensors

WEIGHTS_FILE = "model.safetensors"
META_FILE = "fedclinic_model.json"
CARD_FILE = "model_card.json"
CARD_MARKDOWN_FILE = "MODEL_CARD.md"
#: the signatures a download writes beside the package (fedclinic.pki.model_signatures); not a package file
SIGNATURES_FILE = "SIGNATURES.json"


def meta_bytes(meta: Mapping[str, Any]) -> bytes:
    """``fedclinic_model.json`` as stored in a package: sorted keys, 2-space indent, trailing newline."""
    return (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode("utf-8")


def tensor_sha256(array: np.ndarray) -> str:
    """Hex sha256 of the array's raw little-endian C-order bytes (the tensor's content id), hashed block by block
    (a memory-mapped array keeps one block's pages resident: fedclinic.runtime.array_blocks)."""
    digest = hashlib.sha256()
    for (block,) in flat_blocks([np.asarray(array)]):
        digest.update(raw_bytes(block))
    return digest.hexdigest()


def packaged_form(array: np.ndarray) -> np.ndarray:
    """A checkpoint tensor as a package holds it: floating point as contiguous float32, anything else contiguous as
    it is (so a site's copy of the same checkpoint hashes to the package's sha256: hospital_agent.local_models)."""
    if np.issubdtype(array.dtype, np.floating):
        return np.ascontiguousarray(array, dtype=np.float32)
    return np.ascontiguousarray(array)


def raw_bytes(array: np.ndarray) -> memoryview:
    """Zero-copy little-endian C-order byte view of ``array`` (copies only if it is not already so)."""
    arr = np.ascontiguousarray(array)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.size == 0:
        return memoryview(b"")
    return memoryview(arr.reshape(-1)).cast("B")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str
    nbytes: int


@dataclass(frozen=True)
class FileEntry:
    path: str
    sha256: str
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """What a model version is made of, in a fixed order (tensors by name, files by path)."""

    tensors: tuple[TensorEntry, ...]
    files: tuple[FileEntry, ...]

    @property
    def model_hash(self) -> str:
        doc = {
            "tensors": [[t.name, t.dtype, list(t.shape), t.sha256] for t in self.tensors],
            "files": [[f.path, f.sha256] for f in self.files],
        }
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors) + sum(f.nbytes for f in self.files)

    def tensor(self, name: str) -> TensorEntry:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass
class ModelPackage:
    """Tensors (name -> numpy array) and files (relative path -> bytes) of one model version."""

    tensors: dict[str, np.ndarray]
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def meta(self) -> dict[str, Any]:
        """The parsed ``fedclinic_model.json`` (family, architecture, labels, ...); {} when absent."""
        raw = self.files.get(META_FILE)
        return json.loads(raw) if raw else {}

    def manifest(self) -> Manifest:
        tensors = tuple(_tensor_entry(name, self.tensors[name]) for name in sorted(self.tensors))  # one at a time
        files = tuple(
            FileEntry(path, hashlib.sha256(data).hexdigest(), len(data)) for path, data in sorted(self.files.items())
        )
        return Manifest(tensors, files)

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write the package into ``folder`` (created if needed); returns the folder."""
        from safetensors.numpy import save_file

        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        for rel, data in self.files.items():
            dst = _safe_join(out, rel)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)
        save_file({k: np.ascontiguousarray(v) for k, v in self.tensors.items()}, str(out / WEIGHTS_FILE))
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike[str], *, mapped: bool = False) -> "ModelPackage":
        """Read a package folder written by :meth:`save` (or a Hugging Face folder with safetensors).

        The model card files and the download's ``SIGNATURES.json`` at the top of the folder are not package
        files and are left out. With ``mapped`` the tensors are not read: ``tensors`` is a read-only mapping
        whose every lookup memory-maps one tensor of the file (:class:`~fedclinic.runtime.safetensors_file.
        MappedSafetensors`), so hashing and submitting a model larger than memory holds one tensor at a time
        (the file must not change while the package is in use)."""
        from safetensors.numpy import load_file

        root = Path(folder)
        weights = root / WEIGHTS_FILE
        if not weights.is_file():
            raise IntegrityError(f"{root} holds no {WEIGHTS_FILE}; expected a model package folder")
        files = {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != WEIGHTS_FILE and not p.name.startswith(".")
            and not (p.parent == root and p.name in (CARD_FILE, CARD_MARKDOWN_FILE, SIGNATURES_FILE))
        }
        if mapped:
            try:
                return cls(tensors=MappedSafetensors(weights), files=files)  # type: ignore[arg-type]
            except ValueError as exc:
                raise IntegrityError(f"cannot read {weights}: {exc}") from None
        return cls(tensors=dict(load_file(str(weights))), files=files)


def _tensor_entry(name: str, a: np.ndarray) -> TensorEntry:
    return TensorEntry(name, str(a.dtype), tuple(int(s) for s in a.shape), tensor_sha256(a), int(a.nbytes))


def _safe_join(root: Path, rel: str) -> Path:
    """Join a package-relative path, refusing absolute paths and '..' (a package never writes outside)."""
    candidate = (root / rel).resolve()
    if rel.startswith(("/", "\\")) or ".." in Path(rel).parts or not candidate.is_relative_to(root.resolve()):
        raise IntegrityError(f"refusing package file path {rel!r}: it must stay inside the package folder")
    return candidate


def check_finite(arrays: Mapping[str, np.ndarray]) -> None:
    """Raise IntegrityError naming the first tensor that holds NaN or Inf."""
    for name, a in arrays.items():
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise IntegrityError(f"tensor {name!r} contains NaN or Inf values")
