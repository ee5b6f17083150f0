"""The aggregator folds updates into accumulators spilled beside the round's updates (aggregator_service.folding)
and streams the closed round's model from them into the blob store: the engine's traced memory while it admits,
folds and closes a round stays under a few tensors, not the model, and the model is the FedAvg of the updates."""

from __future__ import annotations

import tracemalloc

import numpy as np

from fedclinic.proto import control_pb2
from fedclinic.transport.package import ModelPackage

from tests.helpers.engine import assign_sites, make_engine, submit_task, update_stream

N_TENSORS, SIZE = 12, 1 << 19  # 12 tensors of 2 MiB: a 24 MiB model


def test_the_engine_folds_and_closes_a_round_with_one_tensor_in_memory(tmp_path):
    rng = np.random.default_rng(0)
    base = {f"t{i:02d}": rng.normal(size=SIZE).astype(np.float32) for i in range(N_TENSORS)}
    store, engine = make_engine(tmp_path)
    task_id = submit_task(engine, ModelPackage(dict(base)), min_sites=2, num_rounds=1)
    a = assign_sites(engine, ["s1", "s2"])
    d1 = {k: np.full(SIZE, 1.0, np.float32) for k in base}
    d2 = {k: np.full(SIZE, 4.0, np.float32) for k in base}
    # both streams are built before tracing: they are the agents' memory, not the aggregator's
    (h1, m1), (h2, m2) = update_stream("s1", a["s1"], d1, n=10), update_stream("s2", a["s2"], d2, n=30)
    del d1, d2
    acc_dir = tmp_path / "updates" / task_id / "1" / "accumulator"
    tracemalloc.start()
    try:
        engine.submit_update("s1", h1, iter(m1))  # admit, spill, fold
        assert len(list(acc_dir.glob("*.f32"))) == N_TENSORS  # the round's sums live on disk, one file a tensor
        engine.submit_update("s2", h2, iter(m2))  # ... and close: finalize, publish the model
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    tensor_bytes = SIZE * 4
    assert peak < 4 * tensor_bytes, f"admit + fold + close peaked at {peak / 1e6:.1f} MB (model {N_TENSORS * tensor_bytes / 1e6:.0f} MB)"
    status = store.task(task_id)
    assert status.state == control_pb2.TASK_STATE_COMPLETED
    final = store.model(status.final_model)
    for name, b in base.items():
        got = engine.blobs.array(final.tensor(name).sha256, "float32", (SIZE,))
        np.testing.assert_allclose(got, b + (10 * 1.0 + 30 * 4.0) / 40, rtol=1e-6, err_msg=name)
    assert not acc_dir.exists()  # dropped with the round's spill folder
