"""A task's public records, as ``Control.GetTaskRecords`` answers them (and ``AgentService.GetTaskRecords`` to the
task's sites), and the blobs they let a reader fetch.

Per round: the model it was opened with and the one it published, the sites' signed round statements as they
arrived (fedclinic.verification.round_statement), and for a secure round the unmasked ring sum (a blob), its
survivors and its vector layout. Readable blobs (``Control.FetchTaskBlob``): every secure round's sum, and the
tensors the statements name only when the task publishes its updates (``TaskSpec.verification.publish_updates``):
a hash is never a capability by itself.
"""

from __future__ import annotations

import json

from fedclinic.proto import control_pb2, task_pb2

from aggregator_service.status import task_of
from aggregator_service.store import Store


#: an answer stops adding rounds past this many bytes (gRPC clients take 4 MiB by default); the caller asks again
#: from ``next_round``
ANSWER_BYTES = 2 << 20


def task_records(store: Store, task_id: str, first_round: int = 1, *, updates_readable: bool = True
                 ) -> control_pb2.TaskRecords:
    """The records of ``task_id`` (which must exist) from round ``first_round`` on: as many rounds as fit in
    :data:`ANSWER_BYTES` (at least one), ``next_round`` naming where the rest starts (0: nothing left).
    ``updates_readable`` False (a site's view): no round says its updates are published to the reader."""
    task = task_of(store, task_id)
    publish = task.spec.verification.publish_updates and updates_readable
    out = control_pb2.TaskRecords(task_id=task_id, spec=task.spec, initial_model_hash=task.initial_model,
                                  final_model_hash=task.final_model, state=task.state)
    for r in store.rounds_of(task_id):
        if r.round < first_round:
            continue
        if out.rounds and out.ByteSize() > ANSWER_BYTES:
            out.next_round = r.round
            break
        rec = out.rounds.add(round=r.round, attempt=r.attempt, base_model_hash=r.base_model, model_hash=r.model_hash,
                             state=r.state)
        rec.statements.extend(task_pb2.SignedStatement.FromString(b) for b in store.statements_of(task_id, r.round))
        secure = store.secure_sum(task_id, r.round)
        if secure is not None:
            survivors, sha, params = secure
            rec.secure, rec.secure_sum_sha256, rec.secure_params_json = True, sha, params
            rec.survivors.extend(survivors)
        rec.updates_published = publish and not rec.secure
    return out


def readable_blobs(store: Store, task_id: str) -> set[str]:
    """The blobs of ``task_id``'s records its owner may fetch (module docstring)."""
    task = task_of(store, task_id)
    out: set[str] = set()
    for r in store.rounds_of(task_id):
        secure = store.secure_sum(task_id, r.round)
        if secure is not None:
            out.add(secure[1])
        elif task.spec.verification.publish_updates:
            for raw in store.statements_of(task_id, r.round):
                try:
                    doc = json.loads(task_pb2.SignedStatement.FromString(raw).payload)
                    out.update(str(t["sha256"]) for t in doc["tensors"])
                except (ValueError, KeyError, TypeError):
                    continue  # admitted statements parse; a damaged row names nothing
    return out
