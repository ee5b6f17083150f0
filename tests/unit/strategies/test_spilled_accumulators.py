"""A linear strategy's accumulators spilled to files (Strategy.spill_to): the same model, bit for bit, as in
memory, for every strategy built on FedAvg and for encoded updates; and a fold whose memory is bounded by the
largest tensor, not the model (tracemalloc: numpy's buffers are traced)."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from fedclinic.codecs import parse_codec
from fedclinic.strategies import FedAvg, make_strategy
from fedclinic.strategies.accumulators import Accumulators
from fedclinic.strategies.tensorsource import EncodedTensor, FileTensor
from fedclinic.transport.package import raw_bytes

SHAPES = {"emb": (300, 40), "w": (40, 40), "b": (40,)}


def _to_file(path, arrays):
    """Write ``arrays`` back to back into ``path``; name -> FileTensor over it."""
    out, offset = {}, 0
    with open(path, "wb") as fh:
        for name, arr in arrays.items():
            fh.write(raw_bytes(arr))
            out[name] = FileTensor(path, offset, "float32", arr.shape)
            offset += arr.nbytes
    return out


def _encoded(path, name, arr, codec_spec):
    codec = parse_codec(codec_spec)
    enc = codec.encode(arr, rng=np.random.default_rng(0))
    path.write_bytes(enc.payload)
    return {name: EncodedTensor(path, 0, len(enc.payload), json.dumps(enc.params), arr.shape)}


def _run(strategy, global_tensors, updates, folder=None):
    if folder is not None:
        strategy.spill_to(folder)
    strategy.begin(global_tensors)
    for i, (update, weight) in enumerate(updates):
        strategy.accept(update, weight, site=f"s{i}")
    return {k: (v.read() if isinstance(v, FileTensor) else v) for k, v in strategy.finalize().items()}


@pytest.mark.parametrize("name,params", [("fedavg", {}), ("fedavg", {"server_lr": 0.5}), ("fedavgm", {}),
                                         ("fedadam", {"server_lr": 0.1}), ("norm-bounded", {"max_norm": 2.0}),
                                         ("dynamic-weighting", {})])
def test_a_spilled_round_gives_the_in_memory_model_bit_for_bit(tmp_path, name, params):
    rng = np.random.default_rng(1)
    g = _to_file(tmp_path / "global.bin", {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()})
    updates = [(_to_file(tmp_path / f"u{i}.bin", {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()
                                                  if i or k != "b"}), float(3 + i)) for i in range(3)]
    in_memory = _run(make_strategy(name, params), g, updates)
    spilled = _run(make_strategy(name, params), g, updates, tmp_path / "acc")
    assert set(spilled) == set(in_memory) == set(SHAPES)
    for k in SHAPES:
        np.testing.assert_array_equal(spilled[k], in_memory[k], err_msg=k)
    assert (tmp_path / "acc").is_dir() and any((tmp_path / "acc").iterdir())


@pytest.mark.parametrize("codec", ["int8", "topk:0.1"])
def test_encoded_updates_fold_into_spilled_accumulators(tmp_path, codec):
    rng = np.random.default_rng(2)
    g = {"w": rng.normal(size=(50, 30)).astype(np.float32)}
    updates = [(_encoded(tmp_path / f"e{i}.bin", "w", rng.normal(size=(50, 30)).astype(np.float32), codec), 2.0 + i)
               for i in range(2)]
    np.testing.assert_array_equal(_run(FedAvg(), g, updates, tmp_path / "acc")["w"], _run(FedAvg(), g, updates)["w"])


def test_a_new_set_of_accumulators_starts_empty(tmp_path):
    first = Accumulators(tmp_path / "acc")
    first.store("w", np.ones(4, np.float32))
    second = Accumulators(tmp_path / "acc")  # a rebuilt round: the earlier sums are not carried over
    assert second.names() == [] and second.load("w", 4).tolist() == [0.0] * 4
    assert list((tmp_path / "acc").iterdir()) == []


def test_a_spilled_fold_holds_one_tensor_in_memory_not_the_model(tmp_path):
    """8 tensors of 2 MB (a 16 MB model), two updates: in memory the fold holds the whole 16 MB accumulator;
    spilled, the traced peak stays under two tensors (one accumulator tensor, the 1 MiB scratch, slack)."""
    n, size = 8, 1 << 19  # float32 values per tensor: 2 MiB
    tensor_bytes = size * 4
    rng = np.random.default_rng(3)
    arrays = {f"t{i}": rng.normal(size=size).astype(np.float32) for i in range(n)}
    g = _to_file(tmp_path / "global.bin", arrays)
    updates = [(_to_file(tmp_path / f"u{j}.bin", arrays), 1.0 + j) for j in range(2)]
    del arrays

    def peak_of(folder):
        strategy = FedAvg()
        tracemalloc.start()
        try:
            _run_without_reading(strategy, g, updates, folder)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    in_memory, spilled = peak_of(None), peak_of(tmp_path / "acc")
    assert in_memory >= n * tensor_bytes  # the check can fail: the unspilled fold holds the model
    assert spilled < 2 * tensor_bytes, f"spilled fold peaked at {spilled / 1e6:.1f} MB"


def _run_without_reading(strategy, g, updates, folder):
    if folder is not None:
        strategy.spill_to(folder)
    strategy.begin(g)
    for i, (update, weight) in enumerate(updates):
        strategy.accept(update, weight, site=f"s{i}")
    out = strategy.finalize()
    assert len(out) == len(g)
