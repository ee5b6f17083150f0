"""Length limits on every string, bytes, list and map field of every request the aggregator takes.

One table, :data:`FIELD_LIMITS`, keyed by the field's full protobuf name, holds the fields whose limit differs
from the defaults of :class:`~aggregator_service.limits.Limits` (``string_chars``, ``bytes_field``,
``list_entries``); :class:`FieldLimits` walks a request message recursively (nested messages, lists, map keys and
values) and

- **truncates** the free-text fields of :data:`FREE_TEXT` (a site's Decline/Hold reason, a CancelTask reason)
  longer than ``reason_chars``, keeping their start and appending :data:`MARKER` with the original length: such
  a reason is shown to people, and its start says what happened; a NUL character in them becomes U+FFFD;
- **refuses** everything else (names, hashes, keys, metric maps, secure-aggregation payloads, task specs) with
  :class:`~fedclinic.errors.Refused` INVALID_ARGUMENT naming the field, its size and the limit: these values must
  be exact, a shortened one would be wrong; likewise any other string field holding a NUL character (U+0000),
  which neither a name nor an id has and PostgreSQL's text type cannot store.

Tensor and file chunk data are not read here (:data:`UNREAD`): they are bounded by the chunk size where they are
assembled (``fedclinic.transport.wire.MAX_CHUNK_BYTES``).
"""

from __future__ import annotations

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from fedclinic.errors import Refused
from fedclinic.transport.wire import MAX_TENSORS

from aggregator_service.limits import Limits

#: fields truncated (with :data:`MARKER`) instead of refused
FREE_TEXT = frozenset({"fedclinic.v1.DeclineRequest.reason", "fedclinic.v1.HoldRequest.reason",
                       "fedclinic.v1.CancelTaskRequest.reason"})
#: appended to a truncated free-text field; ``{n}`` is its original length in characters
MARKER = " [... truncated by the aggregator: {n} characters]"
#: U+0000 in a string field: refused, or in free text replaced by :data:`NUL_SHOWN_AS`. The state database must
#: hold every string a request carries, and PostgreSQL's text type cannot hold NUL (SQLite's can): without this a
#: task id or key with a NUL was "not found" on SQLite and an INTERNAL error on PostgreSQL (found by the fuzz
#: campaign on PostgreSQL); now both answer the same
NUL = "\x00"
NUL_SHOWN_AS = "\ufffd"

#: limits that differ from the defaults: characters (string), bytes (bytes) or entries (list, map)
FIELD_LIMITS: dict[str, int] = {
    "fedclinic.v1.ModelManifest.tensors": MAX_TENSORS,
    "fedclinic.v1.UpdateHeader.tensors": MAX_TENSORS,
    "fedclinic.v1.FetchModelRequest.have_sha256": MAX_TENSORS,
    "fedclinic.v1.FetchModelRequest.delta_names": MAX_TENSORS,
    "fedclinic.v1.ControlFetchModelRequest.have_sha256": MAX_TENSORS,
    "fedclinic.v1.TaskSpec.labels": MAX_TENSORS,
    "fedclinic.v1.TrainingConfig.pos_weight": MAX_TENSORS,  # one per label
    "fedclinic.v1.TaskSpec.description": 16_384,
    "fedclinic.v1.TaskSpec.name": 256,
    "fedclinic.v1.TaskSpec.dataset": 256,
    "fedclinic.v1.UpdateHeader.task_id": 64,
    "fedclinic.v1.UpdateHeader.idempotency_key": 255,
    "fedclinic.v1.UpdateHeader.metrics": 256,
    "fedclinic.v1.UpdateHeader.eval_metrics": 256,
    "fedclinic.v1.DpReport.accountant": 64,
    "fedclinic.v1.DpReport.unit": 64,
    "fedclinic.v1.DeclineRequest.task_id": 64,
    "fedclinic.v1.HoldRequest.task_id": 64,
    "fedclinic.v1.SubmitResultRequest.task_id": 64,
    "fedclinic.v1.SubmitResultRequest.work": 32,
    "fedclinic.v1.SubmitResultRequest.model_hash": 128,
    "fedclinic.v1.SubmitResultRequest.results": 8,
    "fedclinic.v1.ResultValues.model": 64,
    "fedclinic.v1.ResultValues.values": 16_384,     # aggregator_service.results.MAX_RESULT_KEYS
    "fedclinic.v1.EvaluationConfig.model_task": 64,
    "fedclinic.v1.SecAggPhase.task_id": 64,
    "fedclinic.v1.SecAggPhase.session_id": 128,
    "fedclinic.v1.HelloRequest.agent_version": 128,
    "fedclinic.v1.WatchWorkRequest.open_tasks": 1000,  # task ids (64 characters) the site holds open
    "fedclinic.v1.Capabilities.devices": 256,
    "fedclinic.v1.Capabilities.codecs": 256,
    "fedclinic.v1.Capabilities.families": 256,
    "fedclinic.v1.Capabilities.features": 256,
    # secure aggregation: keys are 32 bytes, Shamir shares 33, a ciphertext of shares a few hundred
    "fedclinic.v1.SecAggPublicKeys.mask_public_key": 64,
    "fedclinic.v1.SecAggPublicKeys.encryption_public_key": 64,
    "fedclinic.v1.SecAggShareKeys.ciphertexts": 1000,
    "fedclinic.v1.SecAggUnmaskResponse.self_mask_shares": 1000,
    "fedclinic.v1.SecAggUnmaskResponse.mask_key_shares": 1000,
}
#: the limit of a map's keys and (for string or bytes values) its values: the map's own name plus this suffix
MAP_VALUE = ".value"
FIELD_LIMITS.update({
    "fedclinic.v1.SecAggShareKeys.ciphertexts" + MAP_VALUE: 16_384,
    "fedclinic.v1.SecAggUnmaskResponse.self_mask_shares" + MAP_VALUE: 64,
    "fedclinic.v1.SecAggUnmaskResponse.mask_key_shares" + MAP_VALUE: 64,
})

#: not read here (each read of a protobuf bytes field copies it): chunk data, bounded by the chunk size where the
#: chunks are assembled (fedclinic.transport.wire.MAX_CHUNK_BYTES, aggregator_service.declared_files)
UNREAD = frozenset({"fedclinic.v1.TensorChunk.data", "fedclinic.v1.FileChunk.data"})

_STRING, _BYTES, _MESSAGE = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE


def _short(full_name: str) -> str:
    return full_name.removeprefix("fedclinic.v1.")


class FieldLimits:
    """Checks (and for free text, truncates) a request's fields against :data:`FIELD_LIMITS` and the defaults."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def apply(self, message: Message) -> None:
        """Check ``message`` in place: free-text fields over the limit are truncated with :data:`MARKER`;
        Refused (INVALID_ARGUMENT, naming the field and its limit) for any other field over its limit."""
        for field in message.DESCRIPTOR.fields:
            name = field.full_name
            if name in UNREAD:
                continue
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                value = getattr(message, field.name)
                self._count(name, len(value), self.limits.list_entries)
                val_f = field.message_type.fields_by_name["value"]
                for k, v in value.items():
                    self._scalar(name + " key", FieldDescriptor.TYPE_STRING, k)
                    if val_f.type == _MESSAGE:
                        self.apply(v)
                    else:
                        self._scalar(name + MAP_VALUE, val_f.type, v)
            elif field.is_repeated:
                value = getattr(message, field.name)
                self._count(name, len(value), self.limits.list_entries)
                for item in value:
                    if field.type == _MESSAGE:
                        self.apply(item)
                    else:
                        self._scalar(name, field.type, item)
            elif field.type == _MESSAGE:
                if message.HasField(field.name):
                    self.apply(getattr(message, field.name))
            elif field.type in (_STRING, _BYTES):
                value = getattr(message, field.name)
                keep = self.limits.reason_chars
                if name in FREE_TEXT:
                    text = value.replace(NUL, NUL_SHOWN_AS)
                    if len(text) > keep:
                        text = text[:keep] + MARKER.format(n=len(value))
                    if text != value:
                        setattr(message, field.name, text)
                else:
                    self._scalar(name, field.type, value)

    def _count(self, name: str, n: int, default: int) -> None:
        limit = FIELD_LIMITS.get(name, default)
        if n > limit:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"field {_short(name)} has {n} entries; at most {limit} are allowed (aggregator limit)")

    def _scalar(self, name: str, kind: int, value) -> None:
        if kind == _STRING:  # a map's keys: the default string limit
            default = self.limits.string_chars
            limit = default if name.endswith(" key") else FIELD_LIMITS.get(name, default)
            unit = "characters"
        elif kind == _BYTES:
            limit = FIELD_LIMITS.get(name, self.limits.bytes_field)
            unit = "bytes"
        else:
            return
        if len(value) > limit:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"field {_short(name)} has {len(value)} {unit}; at most {limit} are allowed (aggregator "
                          "limit); send a shorter value")
        if kind == _STRING and NUL in value:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"field {_short(name)} contains a NUL character (U+0000) at position {value.index(NUL)}; "
                          "no name, id, key or label may hold one: send the value without it")
