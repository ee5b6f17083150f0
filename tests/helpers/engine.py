"""Drivers for the aggregator's Engine in-process (no gRPC): an engine on a fresh store, a submitted task, sites
connected and assigned, and updates streamed in as an agent sends them."""

from __future__ import annotations

import numpy as np

from aggregator_service.engine import Engine
from aggregator_service.store import SqliteStore
from fedclinic.proto import agent_pb2, task_pb2, tensors_pb2
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.spec.task import Task
from fedclinic.transport.package import raw_bytes, tensor_sha256
from fedclinic.transport.wire import tensor_chunks


def make_engine(root, store=None):
    """``(store, engine)`` on ``store`` (default: a fresh SQLite store under ``root``; the ``open_test_store``
    fixture gives either backend) and a blob store under ``root``."""
    store = store if store is not None else SqliteStore(root)
    return store, Engine(store, BlobStore(root / "blobs"))


def submit_task(engine, package, key="key-1", **kw):
    """Put ``package``'s tensors in the blob store and create a task for it (``kw``: Task fields); its id. The same
    idempotency ``key`` again returns the first task."""
    for t in package.manifest().tensors:
        engine.blobs.put(raw_bytes(package.tensors[t.name]))
    spec = Task(name="e", dataset="d", labels=["a", "b"], round_timeout_s=600, **kw).to_spec()
    return engine.create_task("alice", key, spec, package.manifest())


def update_stream(site, a: agent_pb2.Assignment, deltas: dict[str, np.ndarray], n=10, key=None, declared=None):
    """An update's header and the rest of its stream (tensor chunks, commit); ``declared``: the commit's byte
    count when it should lie."""
    h = agent_pb2.UpdateHeader(task_id=a.task_id, round=a.round, attempt=a.attempt, idempotency_key=key or site,
                               base_model_hash=a.model.model_hash, kind=task_pb2.UPDATE_KIND_DELTA, num_samples=n)
    messages = []
    for name, d in deltas.items():
        th = tensors_pb2.TensorHeader(name=name, dtype="float32", shape=list(d.shape), codec="raw",
                                      sha256=tensor_sha256(d), encoded_nbytes=d.nbytes)
        h.tensors.append(th)
        messages += [agent_pb2.UpdateChunk(tensor=c) for c in tensor_chunks(th, raw_bytes(d))]
    total = sum(d.nbytes for d in deltas.values()) if declared is None else declared
    messages.append(agent_pb2.UpdateChunk(commit=agent_pb2.UpdateCommit(total_encoded_nbytes=total)))
    return h, messages


def send_update(engine, site, a: agent_pb2.Assignment, deltas: dict[str, np.ndarray], n=10, key=None) -> str:
    """Stream ``deltas`` from ``site`` for assignment ``a`` into the engine; the update's id."""
    h, messages = update_stream(site, a, deltas, n, key)
    return engine.submit_update(site, h, iter(messages)).update_id


def assign_sites(engine, sites):
    """Connect ``sites`` and hand each its one assignment; site -> assignment."""
    out = {}
    for s in sites:
        engine.site_connected(s)
    for s in sites:
        (item,) = engine.next_work(s, {})
        out[s] = item.assignment
    return out
