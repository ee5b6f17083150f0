"""Pretrained model folders installed at the site, used by content: the tensors of a task's model that a local
folder already holds are copied into the agent's cache instead of being downloaded.

A task built on a pretrained checkpoint (``fedclinic task submit`` with ``model = FOLDER``) ships the checkpoint's
encoder tensors unchanged (float32), so a site that has the same folder installed (``[models] folders`` in
agent.toml) holds most of round 1's download already: for MiniLM-L6 91 MB of 91 MB less the new head, for a 7 B
model 28 GB. Tensors are matched by sha256 only (a manifest names tensors by content: the name inside the folder
does not matter), and each one is hashed again as it is written into the cache (fedclinic.runtime.blobstore), so a
folder that changed or an index that lies can only cost a download, never put a wrong tensor in the model.

The sha256 of every tensor of every ``*.safetensors`` file of the folders is kept in an index in the agent's work
folder (``local-models.json``, per file: size, modification time, name -> sha256), so each file is hashed once and
again only when it changes. Only safetensors are read (never pickle); a tensor numpy cannot hold (bf16) is skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import structlog

from fedclinic.errors import IntegrityError
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.transport.package import TensorEntry, packaged_form, raw_bytes, tensor_sha256

log = structlog.get_logger("fedclinic.agent")

INDEX_FILE = "local-models.json"


class LocalModelFolders:
    """The site's pretrained folders (module docstring); ``index_path``: where the tensors' hashes are kept."""

    def __init__(self, folders: Sequence[Path], index_path: Path) -> None:
        self.folders = [Path(f) for f in folders]
        self.index_path = index_path

    def seed(self, cache: BlobStore, wanted: Iterable[TensorEntry]) -> tuple[int, int]:
        """Copy into ``cache`` every tensor of ``wanted`` the cache lacks and a local folder holds; returns (tensors,
        bytes) copied."""
        want = {t.sha256 for t in wanted if not cache.has(t.sha256)}
        if not want or not self.folders:
            return 0, 0
        index = self._load_index()
        copied = nbytes = 0
        changed = False
        for path in self._weight_files():
            try:
                st = path.stat()
            except OSError:
                continue
            known = index.get(str(path))
            fresh = not (isinstance(known, dict) and known.get("size") == st.st_size
                         and known.get("mtime_ns") == st.st_mtime_ns and isinstance(known.get("tensors"), dict))
            if not fresh and not want & set(known["tensors"].values()):
                continue
            try:
                tensors, found, size = self._read(path, want, cache, None if fresh else known["tensors"])
            except IntegrityError:  # the file no longer holds what the index says: hashed afresh next time
                index.pop(str(path), None)
                changed = True
                continue
            copied, nbytes = copied + found, nbytes + size
            if fresh:
                index[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "tensors": tensors}
                changed = True
            want -= {sha for sha in tensors.values() if cache.has(sha)}
            if not want:
                break
        if changed:
            self._save_index(index)
        if copied:
            log.info("model tensors taken from local folders", tensors=copied, bytes=nbytes)
        return copied, nbytes

    def _read(self, path: Path, want: set[str], cache: BlobStore, known: dict[str, str] | None
              ) -> tuple[dict[str, str], int, int]:
        """Hash the file's tensors (all of them when ``known`` is None, else only those ``known`` says are wanted) and
        copy the wanted ones into ``cache``; (name -> sha256, tensors copied, bytes copied)."""
        from safetensors import safe_open  # numpy frames only: no pickle, no torch

        hashes: dict[str, str] = {}
        copied = nbytes = 0
        try:
            handle = safe_open(str(path), framework="numpy")
        except Exception as exc:  # noqa: BLE001 - not a readable safetensors file: nothing of it is used
            log.warning("local model file unreadable; skipped", path=str(path), error=str(exc))
            return {}, 0, 0
        with handle as f:
            names = list(f.keys()) if known is None else [n for n, sha in known.items() if sha in want]
            for name in names:
                try:
                    array = packaged_form(f.get_tensor(name))
                except Exception:  # noqa: BLE001 - a dtype numpy cannot hold (bf16): downloaded instead
                    continue
                sha = tensor_sha256(array) if known is None else known[name]
                hashes[name] = sha
                if sha in want and not cache.has(sha):
                    # hashed just above when the file was indexed now; otherwise the write hashes it (IntegrityError
                    # when the file changed under the index)
                    cache.put(raw_bytes(array), sha, verified=known is None)
                    copied, nbytes = copied + 1, nbytes + array.nbytes
        return (hashes if known is None else known), copied, nbytes

    def _weight_files(self) -> list[Path]:
        files: list[Path] = []
        for folder in self.folders:
            try:
                files.extend(sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" and p.is_file()))
            except OSError as exc:
                log.warning("local model folder unreadable; skipped", folder=str(folder), error=str(exc))
        return files

    def _load_index(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.index_path.read_text())
        except (OSError, ValueError):
            return {}
        files = doc.get("files") if isinstance(doc, dict) else None
        return dict(files) if isinstance(files, dict) else {}

    def _save_index(self, index: dict[str, Any]) -> None:
        tmp = self.index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"files": index}, sort_keys=True))
        os.replace(tmp, self.index_path)
