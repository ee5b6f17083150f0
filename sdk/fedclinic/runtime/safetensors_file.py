"""Reading a safetensors file's bytes together with its ``__metadata__`` header (never pickle), and reading one
memory-mapped tensor at a time (:class:`MappedSafetensors`), so a model-sized file never has to be in memory.

Model packages (:mod:`fedclinic.transport.package`), a site's private tensors
(:mod:`fedclinic.training.private_modules`) and the error-feedback residuals of the codecs
(:mod:`fedclinic.codecs.feedback`) are all stored this way.
"""

from __future__ import annotations

import json
from typing import Iterator, Mapping

import numpy as np
import safetensors.numpy


def safetensors_with_metadata(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors of a safetensors file's bytes and its ``__metadata__`` ({} when absent). Malformed bytes
    raise whatever safetensors or json raises: callers turn that into their own IntegrityError."""
    tensors = safetensors.numpy.load(data)
    header_len = int.from_bytes(data[:8], "little")
    return tensors, json.loads(data[8:8 + header_len]).get("__metadata__") or {}



#: the safetensors dtype names numpy can read
_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32", "int16": "I16",
           "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}

class MappedSafetensors(Mapping[str, np.ndarray]):
    """The tensors of a safetensors file by name, each a fresh read-only memory map when it is looked up (unmapped
    once the caller drops it): a caller that handles one tensor at a time (hashing, streaming it to a server)
    keeps one tensor's pages resident, not the file. The header is checked when the file is opened: known
    dtypes, sizes that match the shapes, data back to back and ending where the file ends (ValueError
    otherwise)."""

    def __init__(self, path) -> None:
        self.path = path
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ValueError(f"{path} is too short to be a safetensors file")
            header_len = int.from_bytes(head, "little")
            if header_len > 100 << 20:
                raise ValueError(f"{path}: a safetensors header of {header_len} bytes is not plausible")
            header = json.loads(fh.read(header_len))
            fh.seek(0, 2)
            size = fh.tell()
        if not isinstance(header, dict):
            raise ValueError(f"{path}: the safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        kinds = {v: np.dtype(k) for k, v in _DTYPES.items()}
        self._start = 8 + header_len
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        end = 0
        for name, info in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]
                                 if isinstance(kv[1], dict) else 0):
            try:
                dtype, shape = kinds[info["dtype"]], tuple(int(s) for s in info["shape"])
                begin, stop = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path}: tensor {name!r} has a malformed header entry") from None
            if begin != end or stop - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize \
                    or min(shape, default=0) < 0:
                raise ValueError(f"{path}: tensor {name!r} does not lie where its shape and the tensors before it say")
            self._entries[name] = (dtype, shape, begin)
            end = stop
        if self._start + end != size:
            raise ValueError(f"{path}: the tensors end at byte {self._start + end}, the file at {size}")

    def __getitem__(self, name: str) -> np.ndarray:
        dtype, shape, begin = self._entries[name]
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(self.path, dtype=dtype.newbyteorder("<"), mode="r", offset=self._start + begin, shape=shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
