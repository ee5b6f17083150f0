"""Streaming a stored model through a task, for both gRPC services (agents' and scientists' ``FetchModel``).

Contract of :func:`stream_task_model`: a model is streamed through task T only when it is one of T's models
(:meth:`~aggregator_service.store.Store.task_models`) and every blob it sends is referenced by T
(:meth:`~aggregator_service.store.Store.task_blobs`); otherwise the call ends NOT_FOUND with the caller's
``not_found`` message, the same whether or not the model or blob exists elsewhere (a hash is not a capability).
Every blob is verified as it is read (:func:`aggregator_service.transfer.send_model`): a damaged stored copy
ends the call DATA_LOSS "stored copy damaged: ..., restore from backup", fails the task if it is running
(:meth:`aggregator_service.engine.Engine.stored_copy_damaged`) and names the file in the operator's log only.
A resumed stream (``resume`` = the request's resume_tensor and resume_offset) starts where the receiver's
verified prefix ends; a resume point the stream cannot start at ends the call INVALID_ARGUMENT
(:func:`aggregator_service.transfer.check_resume` says why).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import grpc
import structlog

from fedclinic.proto import tensors_pb2

from aggregator_service.engine import Engine
from aggregator_service.stored_data import BlobNotAuthorised, StoredCopyDamaged
from aggregator_service.transfer import BadResume, send_model

log = structlog.get_logger("fedclinic.aggregator.models")


def stream_task_model(engine: Engine, context: grpc.ServicerContext, task_id: str, model_hash: str, *,
                      not_found: str, have: set[str], include_files: bool, counter: list[int],
                      deltas: Mapping[str, tensors_pb2.DownlinkDelta] | None = None,
                      wire: list[int] | None = None, resume: tuple[str, int] = ("", 0)
                      ) -> Iterator[tensors_pb2.ModelChunk]:
    """The chunks of model ``model_hash`` read through task ``task_id`` (module docstring); the caller has
    already checked that its peer may read the task."""
    store = engine.store
    manifest = store.model(model_hash) if model_hash in store.task_models(task_id) else None
    if manifest is None:
        context.abort(grpc.StatusCode.NOT_FOUND, not_found)
    try:
        yield from send_model(engine.blobs, manifest, allowed=store.task_blobs(task_id), have=have,
                              include_files=include_files, counter=counter, deltas=deltas, wire=wire,
                              resume=resume)
    except BadResume as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot resume the model stream: {exc}")
    except BlobNotAuthorised as exc:
        log.warning("model stream refused", task_id=task_id, model_hash=model_hash, reason=str(exc))
        context.abort(grpc.StatusCode.NOT_FOUND, not_found)
    except StoredCopyDamaged as exc:
        engine.stored_copy_damaged(task_id, exc)
        context.abort(grpc.StatusCode.DATA_LOSS, exc.message)
