"""Compressed downlink (fedclinic.transport.downlink): which codecs a task may broadcast with, the broadcast tensor and its
rebuild being the same bits, the error bound, the store's record of the changes and the agent's rebuild check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedclinic.transport import downlink
from fedclinic.transport.codec_wire import header_params, params_of
from fedclinic.codecs import parse_codec
from fedclinic.errors import ConfigError
from fedclinic.transport.package import ModelPackage, raw_bytes, tensor_sha256
from fedclinic.proto import tensors_pb2
from fedclinic.spec.task import Task


@pytest.mark.parametrize("spec", ["", "raw", "fp16", "bf16", "int8", "int4", "int8:block=64"])
def test_dense_codecs_are_accepted(spec):
    assert downlink.spec_problems(spec) == []


@pytest.mark.parametrize("spec, message", [("topk:0.01", "not a dense codec"), ("topk:0.1+int8", "not a dense codec"),
                                           ("int8+fp16", "a pipeline is one value codec"), ("zstd", "downlink_codec: ")])
def test_sparse_composed_or_unknown_codecs_are_refused_with_the_choices(spec, message):
    problems = downlink.spec_problems(spec)
    assert len(problems) == 1 and message in problems[0]
    if "dense" in message:
        assert "fp16, bf16, int8, int4" in problems[0]


finite = st.floats(-4, 4, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(base=hnp.arrays(np.float32, st.integers(1, 300), elements=finite), scale=st.floats(1e-4, 1.0),
       codec_spec=st.sampled_from(["fp16", "bf16", "int8", "int4", "int8:block=16,rounding=nearest"]),
       seed=st.integers(0, 2**32 - 1))
def test_the_broadcast_tensor_is_what_a_site_rebuilds_and_within_the_codec_bound(base, scale, codec_spec, seed):
    codec = parse_codec(codec_spec)
    new = (base + scale * np.random.default_rng(seed).standard_normal(base.shape)).astype(np.float32)
    broadcast, enc = downlink.compress(base, new, codec, np.random.default_rng(seed))
    assert broadcast.dtype == np.float32 and broadcast.shape == base.shape
    # what an agent computes from the header it receives: the same bits
    params = params_of("w", codec, list(base.shape), header_params(enc))
    rebuilt = downlink.apply(base.copy(), codec, bytes(enc.payload), params)
    assert tensor_sha256(rebuilt) == tensor_sha256(broadcast)
    change = new - base
    assert np.all(np.abs(broadcast - new) <= codec.error_bound(change) + 4 * np.finfo(np.float32).eps * np.abs(new))
    again, _ = downlink.compress(base, new, codec, np.random.default_rng(seed))
    assert np.array_equal(again, broadcast)  # closing the same round twice gives the same model


def test_round_rng_depends_on_task_round_and_tensor():
    draw = lambda *key: downlink.tensor_rng(*key).integers(0, 2**62)  # noqa: E731
    assert draw("t", 1, "w") == draw("t", 1, "w")
    assert len({draw("t", 1, "w"), draw("t", 2, "w"), draw("u", 1, "w"), draw("t", 1, "v")}) == 4


def test_task_declares_a_downlink_codec_and_bad_ones_are_refused(tmp_path):
    from aggregator_service.rounds import validate_spec
    from fedclinic.errors import Refused
    from tests.helpers.text_models import tiny_package

    toml = tmp_path / "task.toml"
    toml.write_text('name = "n"\ndataset = "d"\nlabels = ["a", "b"]\narchitecture = "logreg"\n'
                    '[update]\ndownlink_codec = "int4"\n')
    spec = Task.from_toml(toml).to_spec()
    assert spec.update.downlink_codec == "int4"
    with pytest.raises(ConfigError, match="downlink_codec 'topk:0.01' is not a dense codec"):
        Task(name="n", dataset="d", labels=["a", "b"], downlink_codec="topk:0.01").validate()
    spec.update.downlink_codec = "topk:0.01"  # a client that skipped the SDK's checks
    with pytest.raises(Refused, match="downlink_codec 'topk:0.01' is not a dense codec"):
        validate_spec(spec, tiny_package().manifest())


def test_the_store_keeps_each_model_s_changes_and_a_backup_copies_their_payloads(tmp_path):
    from aggregator_service.backup import _references, _snapshot
    from aggregator_service.store import SqliteStore

    store = SqliteStore(tmp_path / "state")
    header = tensors_pb2.TensorHeader(name="w", dtype="float32", shape=[3, 2], codec="int8:block=128", sha256="ab" * 32,
                                      encoded_nbytes=10, codec_params={"scale": "\"fp32\""})
    delta = tensors_pb2.DownlinkDelta(name="w", base_sha256="cd" * 32, header=header)
    with store.transaction() as tx:
        tx.put_model_deltas("m1", [delta])
    assert store.model_deltas("m1") == {"w": delta} and store.model_deltas("m2") == {}
    _snapshot(store.db_path, tmp_path / "snap.sqlite")
    version, _, blobs, _ = _references(tmp_path / "snap.sqlite")
    assert version >= 4 and "ab" * 32 in blobs


def test_an_agent_caches_only_the_tensors_a_change_rebuilds_exactly(tmp_path):
    """A change that does not rebuild the manifest's tensor (another base, a corrupt payload) is not cached: the
    agent fetches that tensor again in full."""
    from fedclinic.transport.wire import MemoryWriter
    from hospital_agent.config import AgentConfig
    from hospital_agent.worker import Agent

    cfg = AgentConfig.from_dict({"aggregator": "127.0.0.1:1", "work_dir": str(tmp_path / "work"),
                                 "tls": {"cert": "a", "key": "b", "ca": "c"}}, base=tmp_path, source="agent.toml")
    agent = Agent(cfg)
    codec = parse_codec("int8")
    base = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "v": np.ones(5, np.float32)}
    new = {"w": base["w"] + 0.01, "v": base["v"] - 0.02}
    deltas, changes, broadcast = {}, {}, {}
    for name in base:
        agent.cache.put(raw_bytes(base[name]))
        broadcast[name], enc = downlink.compress(base[name], new[name], codec, np.random.default_rng(0))
        header = tensors_pb2.TensorHeader(name=name, dtype="float32", shape=list(base[name].shape), codec=codec.spec,
                                          sha256="00" * 32, encoded_nbytes=len(enc.payload),
                                          codec_params=header_params(enc))
        deltas[name] = tensors_pb2.DownlinkDelta(name=name, base_sha256=tensor_sha256(base[name]), header=header)
        changes[name] = MemoryWriter()
        changes[name].write(bytes(enc.payload))
        changes[name].commit()
    manifest = ModelPackage(broadcast).manifest()
    changes["v"].data = bytes(len(changes["v"].data))  # a payload that decodes to another tensor
    failed = agent.model_sync.rebuild_from_changes(manifest, deltas, changes)
    assert failed == ["v"]
    assert agent.cache.has(tensor_sha256(broadcast["w"])) and not agent.cache.has(tensor_sha256(broadcast["v"]))
    assert agent.model_sync.usable_deltas(_assignment(deltas), {"w", "v"}) == deltas  # both bases are held
    agent_without_base = Agent(AgentConfig.from_dict({"aggregator": "127.0.0.1:1", "work_dir": str(tmp_path / "w2"),
                                                      "tls": {"cert": "a", "key": "b", "ca": "c"}},
                                                     base=tmp_path, source="agent.toml"))
    assert agent_without_base.model_sync.usable_deltas(_assignment(deltas), {"w", "v"}) == {}  # new agents fetch in full


def _assignment(deltas):
    from fedclinic.proto import agent_pb2

    return agent_pb2.Assignment(task_id="t", round=2, downlink_deltas=list(deltas.values()))
