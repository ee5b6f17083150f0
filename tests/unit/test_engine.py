"""The round engine driven directly (no gRPC): refused folds leave no trace; state survives a new engine; update
admission owns its spill files."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from aggregator_service.engine import Engine
from aggregator_service.store import SqliteStore
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.errors import Refused
from fedclinic.transport.package import ModelPackage, raw_bytes, tensor_sha256
from fedclinic.proto import agent_pb2, control_pb2, task_pb2, tensors_pb2
from fedclinic.spec.task import Task
from fedclinic.transport.wire import tensor_chunks


def _engine(root):
    store = SqliteStore(root)
    return store, Engine(store, BlobStore(root / "blobs"))


def _submit(engine, package, **kw):
    for t in package.manifest().tensors:
        engine.blobs.put(raw_bytes(package.tensors[t.name]))
    spec = Task(name="e", dataset="d", labels=["a", "b"], round_timeout_s=600, **kw).to_spec()
    return engine.create_task("alice", "key-1", spec, package.manifest())


def _update(site, a: agent_pb2.Assignment, deltas: dict[str, np.ndarray], n=10, key=None, declared=None):
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


def _send(engine, site, a: agent_pb2.Assignment, deltas: dict[str, np.ndarray], n=10, key=None) -> str:
    h, messages = _update(site, a, deltas, n, key)
    return engine.submit_update(site, h, iter(messages)).update_id


def _spill_files(root):
    return sorted(p for p in (root / "updates").rglob("*") if p.is_file())


def _assign(engine, sites):
    out = {}
    for s in sites:
        engine.site_connected(s)
    for s in sites:
        (item,) = engine.next_work(s, {})
        out[s] = item.assignment
    return out


def test_refused_fold_leaves_no_trace_and_the_round_completes(tmp_path):
    store, engine = _engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)})
    task_id = _submit(engine, pkg, min_sites=3, num_rounds=1, strategy="multi-krum", strategy_params={"byzantine": 0})
    a = _assign(engine, ["s1", "s2", "s3"])
    full = {"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)}
    _send(engine, "s1", a["s1"], full)
    with pytest.raises(Refused, match="same tensors") as exc:
        _send(engine, "s2", a["s2"], {"w": np.ones(4, np.float32)}, key="bad")
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert store.update_count(task_id, 1) == 1
    assert len([p for p in (tmp_path / "updates").rglob("*.bin")]) == 1
    _send(engine, "s2", a["s2"], full)
    _send(engine, "s3", a["s3"], {k: 3 * v for k, v in full.items()})
    status = store.task(task_id)
    assert status.state == control_pb2.TASK_STATE_COMPLETED
    final = store.model(status.final_model)
    w = engine.blobs.array(final.tensor("w").sha256, "float32", (4,))
    np.testing.assert_allclose(w, (1 + 1 + 3) / 3, rtol=1e-6)  # f=0 keeps all n-f=3, equal sample weights


def test_strategy_state_and_open_round_survive_a_new_engine(tmp_path):
    store, engine = _engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(3, np.float32)})
    task_id = _submit(engine, pkg, min_sites=2, num_rounds=2, strategy="fedadam", strategy_params={"server_lr": 0.1})
    a = _assign(engine, ["s1", "s2"])
    _send(engine, "s1", a["s1"], {"w": np.ones(3, np.float32)})
    _send(engine, "s2", a["s2"], {"w": np.ones(3, np.float32)})
    row = store.round(task_id, 1)
    assert "m/w" in row.strategy_state and "v/w" in row.strategy_state
    b = _assign(engine, ["s1", "s2"])
    _send(engine, "s1", b["s1"], {"w": np.ones(3, np.float32)}, key="r2-s1")
    store.close()
    store2, engine2 = _engine(tmp_path)  # a restart mid-round 2: rebuilt from disk
    engine2.recover()
    engine2.site_connected("s2")
    _send(engine2, "s2", b["s2"], {"w": np.ones(3, np.float32)}, key="r2-s2")
    final = store2.model(store2.task(task_id).final_model)
    got = engine2.blobs.array(final.tensor("w").sha256, "float32", (3,))
    # FedAdam by hand: two rounds with Delta = 1, eta 0.1, beta1 0.9, beta2 0.99, tau 1e-3, v0 = tau^2
    x, m, v = 0.0, 0.0, 1e-6
    for _ in range(2):
        m = 0.9 * m + 0.1
        v = 0.99 * v + 0.01
        x += 0.1 * m / (np.sqrt(v) + 1e-3)
    np.testing.assert_allclose(got, x, rtol=1e-5)


def test_a_task_fails_at_once_when_its_named_sites_decline_it_below_quorum(tmp_path):
    """Permanent refusals (policy, privacy budget, data contract) by the sites a task names: the task fails when
    fewer than min_sites are left, with every reason, instead of waiting out its deadlines and retries."""
    store, engine = _engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32)})
    named = _submit(engine, pkg, min_sites=2, num_rounds=2, sites=["s1", "s2", "s3"])
    a = _assign(engine, ["s1", "s2"])  # the round's target is 2 sites
    engine.decline("s1", named, a["s1"].round, "dataset 'd' is not allowed by this site's policy", permanent=True)
    engine.decline("s2", named, a["s2"].round, "busy this week", permanent=False)
    assert store.task(named).state == control_pb2.TASK_STATE_RUNNING
    engine.decline("s2", named, a["s2"].round, "privacy budget exhausted", permanent=True)
    task = store.task(named)
    assert task.state == control_pb2.TASK_STATE_FAILED
    assert ("quorum can no longer be reached: 2 of the task's 3 site(s) declined it for good (s1: dataset 'd' is not "
            "allowed by this site's policy; s2: privacy budget exhausted), which leaves 1 (s3) for min_sites 2"
            in task.error)
    store, engine = _engine(tmp_path / "second")
    open_to_all = _submit(engine, pkg, min_sites=2, num_rounds=1)  # any site may still connect: it waits
    b = _assign(engine, ["s1", "s2"])
    for site in ("s1", "s2"):
        engine.decline(site, open_to_all, b[site].round, "no", permanent=True)
    assert store.task(open_to_all).state == control_pb2.TASK_STATE_RUNNING


def test_a_hold_is_shown_until_the_site_reports_and_is_refused_without_an_open_assignment(tmp_path):
    """A site holding its assignment (awaiting approval) is shown to the owner with its reason, once per change;
    the hold ends when the site releases it or reports; a hold without an open assignment is refused."""
    from aggregator_service.status import status_of

    store, engine = _engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32)})
    task_id = _submit(engine, pkg, min_sites=2, num_rounds=1)
    a = _assign(engine, ["s1", "s2"])
    engine.hold("s1", task_id, a["s1"].round, "awaiting approval  by\nits IT")
    engine.hold("s1", task_id, a["s1"].round, "awaiting approval by its IT")  # the same again: no new event
    engine.hold("s2", task_id, a["s2"].round, "awaiting approval by its IT")
    assert list(status_of(store, task_id).rounds[0].held) == ["s1: awaiting approval by its IT",
                                                            "s2: awaiting approval by its IT"]
    events = [e.message for e in store.events_of(task_id) if e.kind == "held"]
    assert events == ["s1 holds round 1: awaiting approval by its IT", "s2 holds round 1: awaiting approval by its IT"]
    engine.hold("s2", task_id, a["s2"].round, "")
    assert list(status_of(store, task_id).rounds[0].held) == ["s1: awaiting approval by its IT"]
    _send(engine, "s1", a["s1"], {"w": np.ones(4, np.float32)})  # reported: no longer shown as held
    assert list(status_of(store, task_id).rounds[0].held) == []
    with pytest.raises(Refused, match="s3 has no open assignment to round 1 of task .*; nothing to hold"):
        engine.hold("s3", task_id, 1, "awaiting approval")
    with pytest.raises(Refused, match="no open assignment to round 2"):
        engine.hold("s1", task_id, 2, "awaiting approval")
    with pytest.raises(Refused, match="no task"):
        engine.hold("s1", "t-000000000000", 1, "awaiting approval")


def test_admission_removes_the_spill_file_of_every_refused_upload(tmp_path):
    """Update admission owns its spill files: a stream that breaks its commit, a refusal after the bytes arrived
    (the strategy's), and a duplicate with a new key leave no file behind; an accepted update keeps exactly one."""
    store, engine = _engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)})
    _submit(engine, pkg, min_sites=3, num_rounds=1, strategy="multi-krum", strategy_params={"byzantine": 0})
    a = _assign(engine, ["s1", "s2", "s3"])
    full = {"w": np.ones(4, np.float32), "b": np.ones(2, np.float32)}
    h, messages = _update("s1", a["s1"], full, declared=7)  # the commit lies about the byte count
    with pytest.raises(Refused, match="update rejected: commit declares 7 bytes, 24 arrived") as exc:
        engine.submit_update("s1", h, iter(messages))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert _spill_files(tmp_path) == [] and store.update_count(a["s1"].task_id, 1) == 0
    h, messages = _update("s1", a["s1"], full)
    with pytest.raises(Refused, match="ended before its commit message"):
        engine.submit_update("s1", h, iter(messages[:-1]))
    assert _spill_files(tmp_path) == []
    first = _send(engine, "s1", a["s1"], full)
    assert len(_spill_files(tmp_path)) == 1
    with pytest.raises(Refused, match="same tensors"):  # refused by the strategy once the bytes are durable
        _send(engine, "s2", a["s2"], {"w": np.ones(4, np.float32)}, key="partial")
    with pytest.raises(Refused, match="already sent an update") as exc:  # refused at the header
        _send(engine, "s1", a["s1"], full, key="another-key")
    assert exc.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert len(_spill_files(tmp_path)) == 1
    h, messages = _update("s1", a["s1"], full)  # a retry: acknowledged, nothing read or kept
    receipt = engine.submit_update("s1", h, iter(messages))
    assert receipt.duplicate and receipt.update_id == first and len(_spill_files(tmp_path)) == 1


def test_a_stream_that_breaks_midway_leaves_no_spill_file(tmp_path):
    store, engine = _engine(tmp_path)
    pkg = ModelPackage({"w": np.zeros(4, np.float32)})
    _submit(engine, pkg, min_sites=2, num_rounds=1)
    a = _assign(engine, ["s1", "s2"])
    h, messages = _update("s1", a["s1"], {"w": np.ones(4, np.float32)})

    def broken():
        yield from messages[:-1]
        raise ConnectionResetError("the agent went away")

    with pytest.raises(ConnectionResetError):
        engine.submit_update("s1", h, broken())
    assert _spill_files(tmp_path) == [] and store.update_count(a["s1"].task_id, 1) == 0


def test_the_engine_parts_import_without_the_engine_and_the_validator_without_torch():
    """No cycle through the engine: secure aggregation and the metrics know it only by Protocol; the task-spec
    validator the aggregator runs at submit does not load torch (the aggregator image has none)."""
    import subprocess
    import sys

    code = ("import sys; import aggregator_service.secure_rounds, aggregator_service.metrics, "
            "aggregator_service.update_admission, aggregator_service.rounds, fedclinic.spec; "
            "assert 'aggregator_service.engine' not in sys.modules, 'engine imported'; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
