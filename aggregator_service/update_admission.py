"""Update admission: one call takes a site's update from its header to a durable, folded update (or a refusal).

:meth:`UpdateAdmission.admit` is the whole path of a plain ``SubmitUpdate``:

1. a retried upload (same task and idempotency key) is acknowledged with the stored update, nothing read;
2. the header is checked before any byte is read (:meth:`UpdateAdmission.check_header`: task running, round
   open, site assigned and not yet reported, base model, tensor names/shapes/dtypes/codec, SAFL layers), and so
   is the site's signed round statement (:meth:`UpdateAdmission.check_statement`);
3. the tensor chunks are verified (hash, size, finite values) and spilled to one fsync'd file; a task that
   publishes its updates (``TaskSpec.verification.publish_updates``) keeps each tensor's bytes as received as a
   blob named by its sha256 (which the statement signs), for ``fedclinic task verify``;
4. encoded payloads are checked completely, then kept encoded for a linear strategy or decoded into a float32
   spill file for a strategy that looks at each update;
5. under the engine's lock the header is checked again (the round may have closed meanwhile), the update is
   folded into the round's accumulator, and only then recorded in the store (with its event and its statement)
   and acknowledged.

A resumable upload (``upload_id`` set) that breaks keeps its verified prefix for a resumed stream
(:mod:`aggregator_service.upload_partials`: bounded per site, expired, cleaned with the round); a resumed
stream (``resume_offset`` > 0) has that prefix replayed from disk through the same checks (step 3) before its
own bytes. Ownership of spill files: admission creates them and deletes every one it created unless the update was
recorded; the caller never touches them. Every refusal is :class:`~fedclinic.errors.Refused` with its gRPC
code (a malformed stream or payload: INVALID_ARGUMENT ``update rejected: ...``); the stream breaking
(any other exception) propagates after the files are gone.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator

import grpc
import numpy as np
import structlog

from fedclinic.transport import codec_wire
from fedclinic.training import safl
from fedclinic.runtime.audit_log import update_digest
from fedclinic.runtime.blobstore import fsync_dir
from fedclinic.codecs import open_payload
from fedclinic.runtime.durable_file import DurableFile
from fedclinic.runtime.failpoints import failpoint
from fedclinic.errors import IntegrityError, Refused
from fedclinic.pki.common import PkiError
from fedclinic.pki.signed_statement import SignedStatement
from fedclinic.verification.round_statement import FEATURE as STATEMENT_FEATURE, check_against_header
from fedclinic.transport.package import Manifest, TensorEntry
from fedclinic.proto import agent_pb2, control_pb2, task_pb2
from fedclinic.spec.selection import select_names
from fedclinic.spec.validation import strategy_of
from fedclinic.strategies.tensorsource import dense_blocks
from fedclinic.transport.wire import ChunkAssembler, PipelinedAssembler

from aggregator_service.folding import Folding, UpdateLayout
from aggregator_service.metrics import AggregatorMetrics
from aggregator_service.status import task_of
from aggregator_service.store import Store, UpdateRecord, now_ms
from aggregator_service.stored_data import StoredCopyDamaged
from aggregator_service.transfer import SpillWriter
from aggregator_service.upload_partials import UploadPartials, replay

log = structlog.get_logger("fedclinic.aggregator.engine")

S = control_pb2
GRPC_MESSAGE_PREFIX = 5  # bytes gRPC puts before each message (compressed flag + length)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def sent_tensors(spec: task_pb2.TaskSpec, manifest: Manifest) -> list[str]:
    """The tensors a site may send for ``spec``: the static selection (trainable/frozen/private patterns), and
    under SAFL only its layer and head tensors (each update then carries the head and at most top-k layers)."""
    names = select_names([t.name for t in manifest.tensors], spec.update.trainable_patterns,
                         spec.update.frozen_patterns, spec.update.private_patterns)
    return safl.sendable(names, spec.family) if spec.update.selection == safl.SAFL else names


def read_update_stream(request_iterator: Iterable, assembler, what: str, consequence: str) -> int:
    """Feed an update stream's tensor chunks to ``assembler`` up to its commit message, check the commit's byte
    count, and return the serialized bytes the messages took on the wire (each with gRPC's message prefix).
    IntegrityError for anything else in the stream, a count mismatch, or a stream without its commit."""
    wire_bytes = 0
    for msg in request_iterator:
        wire_bytes += msg.ByteSize() + GRPC_MESSAGE_PREFIX
        kind = msg.WhichOneof("item")
        if kind == "tensor":
            assembler.add(msg.tensor)
            failpoint("aggregator.update.chunk")  # kill campaign: mid-upload
        elif kind == "commit":
            assembler.finish()
            if msg.commit.total_encoded_nbytes != assembler.nbytes:
                raise IntegrityError(f"commit declares {msg.commit.total_encoded_nbytes} bytes, "
                                     f"{assembler.nbytes} arrived")
            return wire_bytes
        else:
            raise IntegrityError(f"unexpected {kind!r} message inside {what}")
    raise StreamEnded(f"{what} ended before its commit message; {consequence}")


class StreamEnded(IntegrityError):
    """An update stream ended before its commit message: a client that stopped early, or a connection that broke
    in a way gRPC reports as an end (a reset seen by the server): a resumable upload keeps its prefix."""


def check_resume_fields(h: agent_pb2.UpdateHeader) -> None:
    """The resumable-upload fields of a header: an upload id of at most 255 characters, and a resume offset
    that is non-negative, within the update's size and given only with an upload id (INVALID_ARGUMENT)."""
    if len(h.upload_id) > 255:
        raise Refused(INVALID, "upload_id must be at most 255 characters")
    total = sum(int(t.encoded_nbytes) for t in h.tensors)
    if h.resume_offset < 0 or h.resume_offset > total or (h.resume_offset and not h.upload_id):
        raise Refused(INVALID, f"resume_offset {h.resume_offset} is not a byte of this update ({total} bytes) of "
                               "a resumable upload (upload_id set); resume at what QueryUpload answers, or from 0")


def _check_tensor_codec(spec: task_pb2.TaskSpec, t) -> None:
    """A tensor of an update must use the task's codec with the task's parameters (INVALID_ARGUMENT)."""
    want = codec_wire.canonical(spec.update.codec)
    got = t.codec or codec_wire.RAW
    if got != want:
        raise Refused(INVALID, f"tensor {t.name!r} is encoded with codec {got!r}, but the task's updates use {want!r}")
    codec = codec_wire.task_codec(want)
    try:
        if codec is None:
            if t.codec_params:
                raise IntegrityError(f"tensor {t.name!r}: codec 'raw' takes no codec_params")
        else:
            codec_wire.check_header(t.name, t.codec, t.dtype, list(t.shape), int(t.encoded_nbytes))
            codec_wire.params_of(t.name, codec, list(t.shape), dict(t.codec_params))
    except IntegrityError as exc:
        raise Refused(INVALID, str(exc)) from None


class UpdateAdmission:
    """Admits plain updates (module docstring). ``on_accepted(task_id)`` runs under the lock after an update was
    recorded (the round machine closes the round when it has what it waits for); ``on_damaged(task_id, exc)``
    when the round's stored state cannot be read back intact (the task then fails; the update is refused
    FAILED_PRECONDITION with the "stored copy damaged" reason and not stored)."""

    def __init__(self, store: Store, folding: Folding, spill_root: Path, lock: threading.RLock,
                 changed: threading.Condition, metrics: AggregatorMetrics, on_accepted: Callable[[str], None],
                 on_damaged: Callable[[str, StoredCopyDamaged], None] | None = None) -> None:
        self.store = store
        self.folding = folding
        self.spill_root = spill_root
        self.lock = lock
        self.changed = changed
        self.metrics = metrics
        self._on_accepted = on_accepted
        self._on_damaged = on_damaged
        #: verified prefixes of interrupted resumable uploads (QueryUpload reads them)
        self.partials = UploadPartials(spill_root, self.round_open)
        #: the CA that issued the sites' certificates: round statements are checked against it (None: their
        #: content is checked, not their signature; an engine without a server, in unit tests)
        self.ca_path: Path | None = None
        self._signs_statements: set[str] = set()  # sites that announced the round-statements feature at Hello

    def hello(self, site: str, features: Iterable[str]) -> None:
        """Remember whether ``site`` signs round statements (then its updates without one are refused)."""
        if STATEMENT_FEATURE in set(features):
            self._signs_statements.add(site)
        else:
            self._signs_statements.discard(site)

    def check_statement(self, site: str, h: agent_pb2.UpdateHeader) -> None:
        """The update's signed round statement (fedclinic.verification.round_statement) states what ``h`` declares
        and is signed by ``site``'s agent certificate; required from a site that announced it signs them. Refused
        INVALID_ARGUMENT saying what is wrong."""
        if not h.HasField("statement"):
            if site in self._signs_statements:
                raise Refused(INVALID, "update rejected: it carries no signed round statement (UpdateHeader."
                                       "statement), which this site's agent announced it signs; nothing was stored")
            return
        try:
            check_against_header(SignedStatement.from_proto(h.statement), h, site, self.ca_path)
        except PkiError as exc:
            log.warning("round statement refused", site=site, task_id=h.task_id, round=h.round, reason=str(exc))
            raise Refused(INVALID, f"update rejected: its round statement is not valid: {exc}; nothing was "
                                   "stored") from None

    @staticmethod
    def statement_bytes(h: agent_pb2.UpdateHeader) -> bytes:
        """The header's statement as stored (b"" when it has none)."""
        return h.statement.SerializeToString() if h.HasField("statement") else b""

    def admit(self, site: str, h: agent_pb2.UpdateHeader, messages: Iterator, header_wire_bytes: int = 0
              ) -> agent_pb2.UpdateReceipt:
        """Take one update from ``site``: ``h`` its header, ``messages`` the rest of its stream (tensor chunks
        and the commit), ``header_wire_bytes`` what the header message took on the wire. Returns the receipt;
        Refused for every refusal (module docstring)."""
        prior = self.store.update_by_key(h.task_id, h.idempotency_key)
        if prior is not None:
            if prior.site != site:
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, "this idempotency key belongs to another site's update")
            log.info("duplicate update acknowledged", site=site, task_id=h.task_id, round=h.round)
            return agent_pb2.UpdateReceipt(update_id=prior.update_id, duplicate=True, stored_nbytes=prior.nbytes,
                                           round=prior.round)
        self.check_header(site, h)
        self.check_statement(site, h)
        check_resume_fields(h)
        kept = self.partials.take(site, h)  # the verified prefix a resumed stream continues (None: from byte 0)
        spill = SpillWriter(self._spill_path(h.task_id, h.round))
        assembler = PipelinedAssembler(ChunkAssembler(spill.begin, expect={t.name: t for t in h.tensors}, finite=True))
        if kept is not None:
            messages = itertools.chain(replay(kept, h, h.resume_offset), messages)
        try:
            wire_bytes = header_wire_bytes + read_update_stream(messages, assembler, "the update stream",
                                                                "nothing was stored")
            nbytes = spill.finish()
            self._publish(h, spill.path, spill.layout)
            path, layout, sha = self._decode(h, spill.path, spill.layout, spill.sha256)  # codec payloads checked
        except StreamEnded as exc:
            if not (h.upload_id and self._keep_prefix(site, h, assembler, spill)):
                assembler.abort()
                spill.discard()
                spill.path.unlink(missing_ok=True)
                raise Refused(INVALID, f"update rejected: {exc}") from None
            raise Refused(INVALID, f"the update stream ended before its commit message; the bytes received are "
                                   f"kept: resume upload {h.upload_id[:64]!r} where QueryUpload says") from None
        except IntegrityError as exc:
            assembler.abort()
            spill.discard()
            spill.path.unlink(missing_ok=True)
            log.warning("update rejected", site=site, task_id=h.task_id, round=h.round, reason=str(exc),
                        resumed_at=h.resume_offset)
            again = ("; the bytes kept from its interrupted upload were dropped: send it again from its first byte"
                     if kept is not None else "")
            raise Refused(INVALID, f"update rejected: {exc}{again}") from None
        except BaseException:
            if not (h.upload_id and self._keep_prefix(site, h, assembler, spill)):
                assembler.abort()
                spill.discard()
                spill.path.unlink(missing_ok=True)
            raise
        finally:
            if kept is not None:
                kept.unlink(missing_ok=True)
        update_id = self._accept(site, h, path, layout, sha, nbytes, wire_bytes)
        failpoint("aggregator.update.before-ack")  # kill campaign: durable, not acknowledged
        return agent_pb2.UpdateReceipt(update_id=update_id, duplicate=False, stored_nbytes=nbytes, round=h.round)

    def _keep_prefix(self, site: str, h: agent_pb2.UpdateHeader, assembler: PipelinedAssembler,
                     spill: SpillWriter) -> bool:
        """The stream of resumable upload ``h`` broke: keep the bytes the assembler accepted for a resumed stream
        (UploadPartials.keep). False (the caller discards everything) when a chunk already handed over was bad or
        the prefix cannot be kept; never raises."""
        try:
            if assembler.settle() is not None:
                return False
            self.partials.keep(site, h, spill.keep_prefix())
            return True
        except Exception:  # noqa: BLE001 - the stream's own failure is what the caller re-raises
            log.exception("could not keep the interrupted upload's prefix", site=site, task_id=h.task_id)
            spill.tmp.unlink(missing_ok=True)
            return True  # its file is gone (or kept): nothing left for the caller to discard

    def round_open(self, task_id: str, rnd: int) -> bool:
        """Whether round ``rnd`` of ``task_id`` is the task's open round."""
        r = self.store.open_round_of(task_id)
        return r is not None and r.round == rnd

    def check_header(self, site: str, h: agent_pb2.UpdateHeader) -> dict[str, TensorEntry]:
        """Validate an update header before its bytes are read; returns the expected global tensors."""
        with self.lock:
            task = task_of(self.store, h.task_id)
            if task.state != S.TASK_STATE_RUNNING:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"task {h.task_id} is {S.TaskState.Name(task.state)}; it takes no more updates")
            rnd = self.store.open_round_of(h.task_id)
            if rnd is None or rnd.round != h.round:
                current = rnd.round if rnd is not None else task.current_round
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"round {h.round} of task {h.task_id} is closed (the task is at round {current}); "
                              "the update was not stored")
            a = self.store.assignment(h.task_id, h.round, site)
            if a is None or a.declined:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"site {site} is not a participant of round "
                                                                 f"{h.round} of task {h.task_id}; wait for an assignment")
            if self.store.has_update(h.task_id, h.round, site):
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"site {site} already sent an update for round "
                                                              f"{h.round} of task {h.task_id} with another "
                                                              "idempotency key")
            if h.base_model_hash != rnd.base_model:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the update was computed against model {h.base_model_hash[:12]} but round {h.round} "
                              f"started from {rnd.base_model[:12]}")
            if h.num_samples <= 0:
                raise Refused(INVALID, "num_samples must be positive (it is the FedAvg weight)")
            if h.kind != task_pb2.UPDATE_KIND_DELTA:
                raise Refused(INVALID, "only delta updates (UPDATE_KIND_DELTA) are accepted")
            spec = task.spec
            if spec.privacy.level == "sample" and spec.privacy.unit == "patient" and h.dp.unit != "patient":
                # an agent that predates per-patient DP reads the task as per-row and reports no unit
                raise Refused(INVALID, "the task protects each patient (privacy.unit = \"patient\") but the update's "
                                       f"DP report states unit {h.dp.unit or 'none'!r}: the site did not sample and "
                                       "clip per patient (upgrade its agent); the update is not used")
            manifest = self.store.model(rnd.base_model)
            assert manifest is not None
            allowed = set(sent_tensors(spec, manifest))
            by_name = {t.name: t for t in manifest.tensors}
            seen: set[str] = set()
            for t in h.tensors:
                ref = by_name.get(t.name)
                if ref is None or t.name not in allowed:
                    raise Refused(INVALID, f"tensor {t.name!r} is not one this task trains and sends")
                if t.name in seen:
                    raise Refused(INVALID, f"tensor {t.name!r} appears twice in the update")
                seen.add(t.name)
                if tuple(t.shape) != tuple(ref.shape):
                    raise Refused(INVALID, f"tensor {t.name!r} has shape {list(t.shape)}; the model's is "
                                           f"{list(ref.shape)}")
                if t.dtype != "float32":
                    raise Refused(INVALID, f"tensor {t.name!r}: deltas must be float32, got {t.dtype}")
                _check_tensor_codec(spec, t)
            if not seen:
                raise Refused(INVALID, "the update carries no tensor")
            if spec.update.selection == safl.SAFL:
                try:
                    safl.check_update_layers(seen, spec.update.select_top_k_layers)
                except IntegrityError as exc:
                    raise Refused(INVALID, str(exc)) from None
            return {n: by_name[n] for n in seen}

    def _publish(self, h: agent_pb2.UpdateHeader, spill: Path, layout: UpdateLayout) -> None:
        """A task that publishes its updates keeps each received tensor's bytes (as sent, encoded) as a blob named by
        the sha256 its header and the site's statement give (Control.FetchTaskBlob serves them to the owner)."""
        task = self.store.task(h.task_id)
        if task is None or not task.spec.verification.publish_updates:
            return
        by_name = {t.name: t for t in h.tensors}
        with open(spill, "rb") as fh:
            for name, _, _, offset, nbytes in layout.tensors:
                fh.seek(offset)
                self.folding.blobs.put(fh.read(nbytes), by_name[name].sha256)

    def _spill_path(self, task_id: str, rnd: int) -> Path:
        d = self.spill_root / task_id / str(rnd)
        d.mkdir(parents=True, exist_ok=True)
        return d / f"u-{uuid.uuid4().hex}.bin"

    def _decode(self, h: agent_pb2.UpdateHeader, spill: Path, layout: UpdateLayout, sha256: str
                ) -> tuple[Path, UpdateLayout, str]:
        """Check the payload of every encoded tensor of a received (durable) update completely; then keep it
        encoded for a linear strategy (decoded into the accumulator when folded) or decode it, chunk by chunk,
        into a float32 spill file for a strategy that looks at each update (the encoded file goes). Raw updates
        pass unchanged. Returns the file kept, its layout and its sha256 (``sha256``: the received file's).
        IntegrityError (no decoded file left) for a malformed payload."""
        task = self.store.task(h.task_id)
        assert task is not None
        spec = task.spec
        codec = codec_wire.task_codec(spec.update.codec)
        if codec is None:
            return spill, layout, sha256
        by_name = {t.name: t for t in h.tensors}
        params = {name: codec_wire.params_of(name, codec, list(by_name[name].shape), dict(by_name[name].codec_params))
                  for name, *_ in layout.tensors}
        encoded = UpdateLayout(list(layout.tensors), {n: json.dumps(p, separators=(",", ":")) for n, p in params.items()})
        for name, _, _, _, _ in layout.tensors:  # full validation before anything is folded or kept
            t = encoded.tensors_in(spill)[name]
            try:
                open_payload(t.payload(), params[name])
            except IntegrityError as exc:
                raise IntegrityError(f"tensor {name!r}: {exc}") from None
        if not strategy_of(spec).needs_per_site_updates:
            return spill, encoded, sha256
        dense_path = spill.with_name(spill.stem + ".f32")
        out = DurableFile(dense_path.with_suffix(".part"))
        dense = UpdateLayout([])
        scratch = np.empty(1 << 16, dtype=np.float32)
        offset = 0
        digest = hashlib.sha256()
        try:
            for name, _, shape, _, _ in layout.tensors:
                t = encoded.tensors_in(spill)[name]
                reader = open_payload(t.payload(), params[name], chunk=scratch.size)
                for _, block in dense_blocks(reader.chunks(), t.size, scratch):
                    out.write(memoryview(block).cast("B"))
                    digest.update(memoryview(block).cast("B"))
                dense.tensors.append((name, "float32", shape, offset, 4 * t.size))
                offset += 4 * t.size
            out.close()
        except BaseException:
            out.discard()
            dense_path.with_suffix(".part").unlink(missing_ok=True)
            raise
        os.replace(dense_path.with_suffix(".part"), dense_path)
        fsync_dir(dense_path.parent)
        spill.unlink(missing_ok=True)
        return dense_path, dense, digest.hexdigest()

    def _accept(self, site: str, h: agent_pb2.UpdateHeader, spill: Path, layout: UpdateLayout, spill_sha256: str,
                nbytes: int, wire_bytes: int) -> str:
        """Fold a verified, fsync'd update into the round, then record it durably with ``spill_sha256`` (the
        spill file's hash, checked at recovery); returns its update id. The spill file is deleted unless the
        update was recorded. ``nbytes``: the tensors' payload bytes as sent (encoded); ``wire_bytes``: the
        serialized SubmitUpdate messages; the fp32-equivalent size comes from the shapes."""
        with self.lock:
            recorded = False
            try:
                prior = self.store.update_by_key(h.task_id, h.idempotency_key)
                if prior is not None:
                    return prior.update_id
                self.check_header(site, h)  # the round may have closed while the bytes streamed in
                update_id = "u-" + uuid.uuid4().hex[:16]
                try:
                    acc = self.folding.accumulator(h.task_id)
                except StoredCopyDamaged as exc:
                    if self._on_damaged is not None:
                        self._on_damaged(h.task_id, exc)
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"task {h.task_id} cannot take updates: {exc.message}; the update was not "
                                  "stored") from None
                try:  # fold first: a strategy that rejects an update leaves itself unchanged (Strategy contract)
                    acc.fold(update_id, spill, layout, acc.strategy.weight_for(h.num_samples, h.metrics), site)
                    failpoint("aggregator.fold")  # kill campaign: folded, not yet recorded
                except (IntegrityError, ValueError) as exc:
                    raise Refused(INVALID, f"update rejected by the {acc.strategy.name} strategy: {exc}") from None
                try:
                    with self.store.transaction() as tx:
                        tx.record_update(UpdateRecord(
                            update_id, h.task_id, h.round, site, h.idempotency_key, h.num_samples, nbytes, str(spill),
                            layout.to_json(), dict(h.metrics), dict(h.eval_metrics), now_ms(),
                            sum(4 * math.prod(t.shape) for t in h.tensors), wire_bytes, spill_sha256))
                        tx.add_event(h.task_id, "update-received", f"{site} sent its round {h.round} update "
                                     f"({nbytes} bytes, {h.num_samples} samples)", actor=site, round=h.round,
                                     update_id=update_id, size=nbytes, sha256=update_digest(h.tensors),
                                     num_samples=h.num_samples)
                        if h.HasField("statement"):
                            tx.record_statement(h.task_id, h.round, h.attempt, site, self.statement_bytes(h))
                except BaseException:
                    self.folding.drop(h.task_id)  # it holds an update the store does not: rebuild from disk
                    raise
                recorded = True
            finally:
                if not recorded:
                    spill.unlink(missing_ok=True)
            log.info("update accepted", task_id=h.task_id, round=h.round, site=site, nbytes=nbytes)
            self.metrics.update_stored(h.task_id, site, nbytes, wire_bytes)
            self._on_accepted(h.task_id)
            self.changed.notify_all()
            return update_id
