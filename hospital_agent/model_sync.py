"""Model sync: bring a task's warm model to an assignment's global weights, fetching only unknown tensors.

Tensors are content-addressed in the site's cache (fedclinic.runtime.blobstore). ``sync`` first copies in the
tensors the site's pretrained folders hold (hospital_agent.local_models), then fetches the manifest's tensors the
cache lacks (``FetchModel`` with the hashes held), those with a usable encoded change (compressed downlink:
base held, a downlink codec this agent knows) as that change, rebuilt on the base and checked against the
manifest's sha256 — a change that does not rebuild the tensor exactly is fetched again in full. The first
round builds the model and encodes the site's data once; later rounds load only the tensors whose hash changed.
Either way the tensors go from the cache into the module one at a time (:class:`CachedTensors`): the agent
holds the module and one tensor's pages, never a second copy of the model.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Callable, Iterator, Mapping, Sequence

import grpc
import numpy as np
import structlog

from fedclinic.transport import codec_wire
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.runtime.heap_trim import mapped_while_streaming
from fedclinic.codecs import parse_codec
from fedclinic.errors import FedclinicError, IntegrityError
from fedclinic.transport.package import Manifest, ModelPackage, TensorEntry, raw_bytes
from fedclinic.proto import agent_pb2, agent_pb2_grpc, tensors_pb2
from fedclinic.transport.wire import ChunkAssembler, FileAssembler, MemoryWriter, header_of

from hospital_agent.local_models import LocalModelFolders
from hospital_agent.metrics import AgentMetrics
from hospital_agent.task_state import Stopped, TaskState
from hospital_agent.uploader import Audit
from fedclinic.transport import downlink, resume

log = structlog.get_logger("fedclinic.agent")


class CachedTensors(Mapping[str, np.ndarray]):
    """Tensors of the site's cache by name, each read when it is looked up: a fresh read-only memory map that is
    unmapped once the caller drops it. Loading a module from it (``load_tensors`` copies one item at a time)
    keeps one tensor's pages resident beside the module, not the model a dict of copies would."""

    def __init__(self, cache: BlobStore, entries: Sequence[TensorEntry]) -> None:
        self._cache = cache
        self._entries = {t.name: t for t in entries}

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._entries[name]
        return self._cache.array(t.sha256, t.dtype, tuple(t.shape))

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class ModelSync:
    def __init__(self, cache: BlobStore, stub: Callable[[], agent_pb2_grpc.AgentServiceStub], metrics: AgentMetrics,
                 audit: Audit, stop_event: threading.Event, local: LocalModelFolders | None = None) -> None:
        self.cache = cache
        #: the site's pretrained folders: tensors they hold are copied into the cache, not downloaded
        self.local = local
        self._stub = stub
        self.metrics = metrics
        self.audit = audit
        self.stop_event = stop_event

    def sync(self, a: agent_pb2.Assignment, manifest: Manifest, state: TaskState) -> None:
        """Bring ``state``'s model to the assignment's global weights (built and its data encoded on the first
        round), fetching only unknown tensors."""
        # torch-heavy modules, imported when a model is first needed (keeps the agent's start light)
        from fedclinic.training import trainer as training
        from fedclinic.models import build_model, load_tensors

        if self.local is not None:
            self.local.seed(self.cache, manifest.tensors)
        missing = [t for t in manifest.tensors if not self.cache.has(t.sha256)]
        need_files = any(not self.cache.has(f.sha256) for f in manifest.files)
        if missing or need_files:
            self.fetch(a.task_id, manifest, need_files, deltas=self.usable_deltas(a, {t.name for t in missing}))
        if state.loaded is None:
            package = ModelPackage(tensors=CachedTensors(self.cache, manifest.tensors),  # type: ignore[arg-type]
                                   files={f.path: self.cache.read(f.sha256) for f in manifest.files})
            state.loaded = build_model(package)
            state.package_files = dict(package.files)
            state.tensor_sha = {t.name: t.sha256 for t in manifest.tensors}
            state.global_tensors = CachedTensors(self.cache, manifest.tensors)
            cfg = training.TrainConfig.from_proto(a.spec.training)
            state.train_data = training.encode(state.raw_train, state.loaded, max_length=cfg.max_length)
            if state.raw_eval is not None:
                state.eval_data = training.encode(state.raw_eval, state.loaded, max_length=cfg.max_length)
            return
        changed = CachedTensors(self.cache, [t for t in manifest.tensors if state.tensor_sha.get(t.name) != t.sha256])
        if len(changed):
            load_tensors(state.loaded.module, changed)
            state.tensor_sha.update({t.name: t.sha256 for t in manifest.tensors})
        state.global_tensors = CachedTensors(self.cache, manifest.tensors)

    def usable_deltas(self, a: agent_pb2.Assignment, missing: set[str]) -> dict[str, tensors_pb2.DownlinkDelta]:
        """The assignment's encoded changes (compressed downlink) for missing tensors whose base this agent holds
        and whose codec is a downlink codec it knows; the other missing tensors are fetched in full."""
        return {d.name: d for d in a.downlink_deltas
                if d.name in missing and self.cache.has(d.base_sha256) and not downlink.spec_problems(d.header.codec)
                and d.header.dtype == "float32"}

    def fetch(self, task_id: str, manifest: Manifest, include_files: bool,
              deltas: dict[str, tensors_pb2.DownlinkDelta] | None = None) -> None:
        """Download the tensors (and files) of ``manifest`` this agent does not hold; those in ``deltas`` as their
        encoded change, rebuilt on the base tensor (fedclinic.transport.downlink.apply) and checked against the manifest's
        sha256; a change that does not rebuild the tensor exactly is fetched again in full.

        The stream's chunks are mapped and unmapped (fedclinic.runtime.heap_trim.mapped_while_streaming): left to
        the heap, a share of the bytes fetched stayed resident as free heap for the rest of the round
        (docs/results/large-model.md)."""
        with mapped_while_streaming():
            self._fetch(task_id, manifest, include_files, deltas)

    def _fetch(self, task_id: str, manifest: Manifest, include_files: bool,
               deltas: dict[str, tensors_pb2.DownlinkDelta] | None) -> None:
        deltas = deltas or {}
        have = [t.sha256 for t in manifest.tensors if self.cache.has(t.sha256)]
        expect = {t.name: deltas[t.name].header if t.name in deltas else header_of(t)
                  for t in manifest.tensors if t.sha256 not in set(have)}
        changes: dict[str, MemoryWriter] = {}

        def begin(h: tensors_pb2.TensorHeader):
            if h.name in deltas:
                changes[h.name] = MemoryWriter()
                return changes[h.name]
            return self.cache.writer(h.sha256, h.encoded_nbytes, verified_by_caller=True)

        order = [t.name for t in manifest.tensors if t.name in expect]
        tensors = ChunkAssembler(begin, expect=expect)
        files = FileAssembler()
        point: tuple[str, int] = ("", 0)
        resumes, sent_again = 0, 0
        while True:
            try:
                self._receive(task_id, manifest, include_files and not point[0], have, deltas, tensors, files, point)
                break
            except _StartOver:  # the aggregator does not resume (an older one): start the transfer over
                tensors.abort()
                changes.clear()
                tensors, files, point = ChunkAssembler(begin, expect=expect), FileAssembler(), ("", 0)
                sent_again += 1
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DATA_LOSS:  # the aggregator found its own copy damaged before sending it
                    tensors.abort()
                    raise IntegrityError(f"the aggregator's stored copy of model {manifest.model_hash[:12]} is damaged "
                                         f"(the aggregator says: {exc.details()}); this is not a network error and "
                                         "fetching again will not help: its operator must restore it from backup"
                                         ) from None
                if not resume.is_cut(exc) or resumes >= resume.MAX_RESUMES or self.stop_event.is_set():
                    tensors.abort()
                    raise
                resumes += 1
                if include_files and not files.files.keys() >= {f.path for f in manifest.files}:
                    files, point = FileAssembler(), ("", 0)  # cut inside the (small) files: ask for them again
                    tensors.abort()
                    tensors = ChunkAssembler(begin, expect=expect)
                else:
                    point = resume.resume_point(tensors, order) or ("", 0)
                    if not point[0]:
                        break  # every tensor arrived; the stream broke after the last one
                log.warning("model stream cut; resuming from the last verified chunk", tensor=point[0],
                            offset=point[1], attempt=resumes, error=exc.details())
                self.metrics.fetch_resumed(task_id)
                self.stop_event.wait(min(0.5 * 2 ** resumes, 8.0))
            except BaseException:
                tensors.abort()
                raise
        tensors.finish()
        files.finish()
        declared = {f.path: f.sha256 for f in manifest.files}
        for path, data in files.files.items():
            if path not in declared:
                raise IntegrityError(f"the aggregator sent file {path!r}, which is not in the model manifest")
            self.cache.put(data, declared[path])
        log.info("model fetched", tensors=len(expect), bytes=tensors.nbytes, skipped=len(have), as_changes=len(deltas),
                 resumed=resumes)
        self.metrics.fetched(task_id, tensors.nbytes + sum(len(data) for data in files.files.values()))
        self.audit("model.fetched", task_id, model_hash=manifest.model_hash, bytes=int(tensors.nbytes),
                   tensors=len(expect), skipped=len(have), files=len(files.files), as_changes=len(deltas),
                   resumed=resumes, started_over=sent_again)
        failed = self.rebuild_from_changes(manifest, deltas, changes)
        if failed:
            log.warning("encoded changes did not rebuild the global tensors; fetching them in full", tensors=failed)
            self.fetch(task_id, manifest, include_files=False)

    def _receive(self, task_id: str, manifest: Manifest, include_files: bool, have: list[str],
                 deltas: dict[str, tensors_pb2.DownlinkDelta], tensors: ChunkAssembler, files: FileAssembler,
                 point: tuple[str, int]) -> None:
        """One FetchModel call feeding ``tensors`` and ``files``, resumed at ``point`` (tensor, byte) unless it is
        ("", 0). _StartOver when the aggregator did not resume where it was asked to."""
        stream = self._stub().FetchModel(agent_pb2.FetchModelRequest(
            task_id=task_id, model_hash=manifest.model_hash, have_sha256=have, include_files=include_files,
            delta_names=sorted(deltas), resume_tensor=point[0], resume_offset=point[1]))
        first = bool(point[0])
        for chunk in stream:
            if self.stop_event.is_set():
                stream.cancel()
                raise Stopped("agent is stopping")
            kind = chunk.WhichOneof("item")
            if kind == "manifest":
                if chunk.manifest.model_hash != manifest.model_hash:
                    raise IntegrityError("the aggregator sent a different model than the one assigned")
            elif kind == "tensor":
                if first and not resume.honoured(chunk.tensor, point):
                    stream.cancel()
                    raise _StartOver()
                first = False
                tensors.add(chunk.tensor)
            elif kind == "file":
                if first:
                    stream.cancel()
                    raise _StartOver()
                files.add(chunk.file)

    def rebuild_from_changes(self, manifest: Manifest, deltas: dict[str, tensors_pb2.DownlinkDelta],
                             changes: dict[str, MemoryWriter]) -> list[str]:
        """Cache each tensor fetched as an encoded change: base + decode(change), when it hashes to the manifest's
        sha256. Returns the names that did not (left uncached)."""
        failed = []
        for name, writer in changes.items():
            entry, h = manifest.tensor(name), deltas[name].header
            try:
                codec = parse_codec(h.codec)
                params = codec_wire.params_of(name, codec, list(h.shape), dict(h.codec_params))
                base = self.cache.array(deltas[name].base_sha256, "float32", tuple(entry.shape))
                tensor = downlink.apply(base, codec, writer.data, params)
            except (FedclinicError, ValueError) as exc:
                log.warning("encoded change unusable", tensor=name, error=str(exc))
                failed.append(name)
                continue
            data = raw_bytes(tensor)
            if hashlib.sha256(data).hexdigest() != entry.sha256:
                failed.append(name)
                continue
            self.cache.put(data, entry.sha256, verified=True)  # hashed just above
        return failed


class _StartOver(Exception):
    """The aggregator answered a resumed FetchModel from the start (it does not know the resume fields)."""
