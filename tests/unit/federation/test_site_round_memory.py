"""A site round whose caller keeps the global tensors outside the module (``SiteRoundInput.base``: the agent's tensor
cache) computes the same delta as one that copies the model before training, without that copy and with one
trained tensor copied out at a time (numpy's buffers are traced by tracemalloc; torch's module and gradients are
not, so the traced peak is the round's numpy copies). With ``SiteRoundInput.spill_dir`` (the agent) the delta goes
to files as each tensor is computed and the update reads them back one at a time: no model-sized delta in memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fedclinic.federation.site_round import SiteRoundInput, run_site_round
from fedclinic.federation.spilled_tensors import SpilledTensors
from fedclinic.models import build_model
from fedclinic.training import trainer as training

from tests.helpers.qa_models import TINY_LLAMA, package, toy_examples

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _round(pkg, base, spill_dir=None):
    loaded = build_model(pkg)
    data = training.encode(toy_examples()[:2], loaded, max_length=16)
    names = list(pkg.tensors)
    inp = SiteRoundInput(task_id="t", site="s", round=1, send=names, base=base, spill_dir=spill_dir,
                         train=training.TrainConfig(optimizer="sgd", learning_rate=0.1, batch_size=2, seed=1))
    tracemalloc.start()
    try:
        out = run_site_round(loaded, data, inp)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out, peak


def test_the_delta_against_kept_base_tensors_equals_the_copied_one_without_the_copies():
    pkg = package(config={**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 6000})
    model_bytes = sum(a.nbytes for a in pkg.tensors.values())
    copied, copied_peak = _round(pkg, None)
    kept, kept_peak = _round(pkg, pkg.tensors)
    assert set(kept.delta) == set(copied.delta) == set(pkg.tensors)
    for name in pkg.tensors:
        np.testing.assert_array_equal(kept.delta[name], copied.delta[name], err_msg=name)
    assert any(np.abs(d).max() > 0 for d in kept.delta.values())  # it trained
    # the delta itself (one model) plus one tensor, against the copy made before training + the delta
    assert copied_peak >= 2 * model_bytes
    assert kept_peak < 1.5 * model_bytes, f"{kept_peak / 1e6:.2f} MB traced for a {model_bytes / 1e6:.2f} MB model"


def test_a_spilled_delta_is_the_same_update_without_the_delta_in_memory(tmp_path):
    pkg = package(config={**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 6000})
    model_bytes = sum(a.nbytes for a in pkg.tensors.values())
    largest = max(a.nbytes for a in pkg.tensors.values())
    kept, kept_peak = _round(pkg, pkg.tensors)
    spilled, spilled_peak = _round(pkg, pkg.tensors, spill_dir=tmp_path / "spill")
    assert isinstance(spilled.delta, SpilledTensors) and spilled.update.payloads is spilled.delta
    assert list(spilled.delta) == list(kept.delta)
    for name in pkg.tensors:
        np.testing.assert_array_equal(spilled.delta[name], kept.delta[name], err_msg=name)
    assert [h.SerializeToString() for h in spilled.update.headers] == \
        [h.SerializeToString() for h in kept.update.headers]  # same names, shapes and hashes
    assert len(list((tmp_path / "spill").iterdir())) == len(pkg.tensors)
    # the kept delta is one model in memory; the spilled one at most a tensor and its difference at a time
    assert kept_peak >= model_bytes
    assert spilled_peak <= 2.2 * largest < kept_peak, (spilled_peak, largest, model_bytes)
