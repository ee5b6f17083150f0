"""The agent's per-tensor work on its largest tensors costs a block of memory, not the tensor: the round's delta
(``compute_delta`` from the trained module, ``ModuleTensorView``, against the read-only memory-mapped global
tensors, into ``SpilledTensors``) and loading a module from memory-mapped tensors (``load_tensors``, the agent's
sync from its cache). Measured as the peak resident set (Linux ``VmHWM`` after ``clear_refs``) of a child process
holding a Llama whose embedding and head are 102 MB each; the values are checked against whole-array numpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

_CHILD = r"""
import json, sys
from collections.abc import Mapping
from pathlib import Path
import numpy as np
import torch
from fedclinic.federation.spilled_tensors import SpilledTensors
from fedclinic.models import build_model, load_tensors, module_tensors
from fedclinic.models.base import ModuleTensorView
from fedclinic.training.trainer import compute_delta
from tests.helpers.qa_models import TINY_LLAMA, package

torch.set_num_threads(1)

def kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])

def peak_growth(job):
    Path("/proc/self/clear_refs").write_text("5")
    start = kb("VmRSS")
    job()
    return (kb("VmHWM") - start) * 1024

folder = Path(sys.argv[1])
pkg = package(config={**TINY_LLAMA, "hidden_size": 128, "vocab_size": 200_000})
names = list(pkg.tensors)
for i, name in enumerate(names):  # the global tensors as the agent keeps them: files, read through read-only maps
    np.save(folder / f"{i}.npy", pkg.tensors[name])
base = {name: np.load(folder / f"{i}.npy", mmap_mode="r") for i, name in enumerate(names)}
largest = max(a.nbytes for a in pkg.tensors.values())
loaded = build_model(pkg)
del pkg
with torch.no_grad():  # the trained module
    for p in loaded.module.parameters():
        p.mul_(1.5).add_(0.25)
out = {"largest": largest}
spilled = SpilledTensors(folder / "spill")
out["delta"] = peak_growth(lambda: compute_delta(base, ModuleTensorView(loaded.module), names, into=spilled))
trained = module_tensors(loaded.module, names)
out["delta_exact"] = all(np.array_equal(spilled[n], np.subtract(trained[n], base[n], dtype=np.float32))
                         for n in names)
del trained


class Cached(Mapping):  # as the agent's cache gives them: a fresh read-only map per lookup, dropped after use
    def __getitem__(self, name):
        return np.load(folder / f"{names.index(name)}.npy", mmap_mode="r")

    def __iter__(self):
        return iter(names)

    def __len__(self):
        return len(names)


del base
out["load"] = peak_growth(lambda: load_tensors(loaded.module, Cached()))
base = Cached()
out["load_exact"] = all(np.array_equal(a, base[n]) for n, a in module_tensors(loaded.module, names).items())
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak reset")
def test_the_delta_and_the_sync_of_a_large_tensor_need_a_block_of_memory_not_the_tensor(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "sdk"), str(ROOT)]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("FEDCLINIC_MEMTRACE", None)
    run = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["largest"] > 100e6 and got["delta_exact"] and got["load_exact"], got
    # whole tensors would be 3x the largest for the delta (the trained copy, the difference, the mapped global
    # pages) and 1x for the load (the mapped pages); a block is 8 MB
    assert got["delta"] <= 0.4 * got["largest"], got
    assert got["load"] <= 0.4 * got["largest"], got
