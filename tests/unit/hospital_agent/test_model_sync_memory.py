"""The agent's first sync builds the task's model straight from its tensor cache, one tensor at a time
(hospital_agent.model_sync.CachedTensors): no dict of copies of the whole model beside the module (numpy's
buffers are traced by tracemalloc; torch's module is not), and the module holds exactly the cached weights."""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest

from fedclinic.models import module_tensors
from fedclinic.proto import agent_pb2
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.spec.task import Task
from fedclinic.transport.package import raw_bytes

from hospital_agent.model_sync import ModelSync
from hospital_agent.task_state import TaskState
from tests.helpers.qa_models import TINY_LLAMA, package, toy_examples

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def test_the_first_sync_loads_the_model_without_a_second_copy(tmp_path):
    pkg = package(config={**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 6000})
    manifest = pkg.manifest()
    model_bytes = sum(t.nbytes for t in manifest.tensors)
    cache = BlobStore(tmp_path / "cache")
    for t in manifest.tensors:
        cache.put(raw_bytes(pkg.tensors[t.name]))
    for f in manifest.files:
        cache.put(pkg.files[f.path])
    spec = Task(name="qa", family="question-answering", architecture="causal-lm", dataset="qa", max_length=16,
                batch_size=2).to_spec()
    a = agent_pb2.Assignment(task_id="t1", round=1, spec=spec)
    state = TaskState(raw_train=toy_examples())
    sync = ModelSync(cache, lambda: None, None, lambda *a, **k: None, threading.Event())  # all cached: no fetch
    tracemalloc.start()
    try:
        sync.sync(a, manifest, state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < model_bytes / 2, f"sync traced {peak / 1e6:.2f} MB for a {model_bytes / 1e6:.2f} MB model"
    loaded = module_tensors(state.loaded.module, list(pkg.tensors))
    for name, arr in pkg.tensors.items():
        np.testing.assert_array_equal(loaded[name], arr, err_msg=name)
