"""FedNER's private modules (fedclinic.training.private_modules): which tensors are private, the site's store of them, the
site's own model, and the agent's guarantee that no private tensor reaches the serialized update stream."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models.fedner import PAPER_PRIVATE_PATTERNS
from fedclinic.transport.package import ModelPackage
from fedclinic.training.private_modules import PrivateStore, outgoing_problems, private_names
from fedclinic.spec.task import Task

from tests.helpers.fedner_models import ARCH, PRIVATE, SHARED, package
from tests.helpers.ner_models import LABELS, make_examples

NAMES = ["emb.weight", "lstm.weight_ih_l0", "lstm.bias_ih_l0", "classifier.weight", "crf.transitions"]


def test_private_names_in_model_order_without_frozen_ones():
    assert private_names(NAMES, [r"(lstm|crf)\..*"]) == ["lstm.weight_ih_l0", "lstm.bias_ih_l0", "crf.transitions"]
    assert private_names(NAMES, [r"lstm\..*"], frozen=[r".*bias.*"]) == ["lstm.weight_ih_l0"]
    assert private_names(NAMES, []) == []
    assert private_names(package().tensors, PAPER_PRIVATE_PATTERNS) == [n for n in package().tensors if n in PRIVATE]


def test_a_private_pattern_that_names_nothing_or_does_not_compile_is_refused():
    with pytest.raises(ConfigError, match=r"private pattern 'lstm' matches no tensor .*whole name"):
        private_names(NAMES, ["lstm"])  # a prefix is not a full match
    with pytest.raises(ConfigError, match="private pattern '\\(' is not a valid regular expression"):
        private_names(NAMES, ["("])


def test_outgoing_problems_name_each_private_tensor():
    assert outgoing_problems(["emb.weight"], ["crf.transitions"]) == []
    problems = outgoing_problems(["emb.weight", "crf.transitions"], ["crf.transitions"])
    assert problems == ["tensor 'crf.transitions' is private to the site (the task's private_patterns) and may not "
                        "leave it"]


def test_the_store_keeps_a_task_s_private_tensors_with_their_round(tmp_path):
    store = PrivateStore(tmp_path / "private")
    assert store.load("t-1") is None
    values = {"crf.transitions": np.arange(9, dtype=np.float32).reshape(3, 3), "lstm.b": np.ones(4, np.float32)}
    path = store.save("t-1", 3, values)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    loaded, rnd = store.load("t-1", {n: (a.shape, a.dtype) for n, a in values.items()})
    assert rnd == 3 and all(np.array_equal(loaded[n], values[n]) for n in values)
    store.save("t-1", 4, {n: a + 1 for n, a in values.items()})  # replaced as a whole
    assert store.load("t-1")[1] == 4


def test_a_store_file_that_does_not_fit_is_refused_and_left_as_it_is(tmp_path):
    store = PrivateStore(tmp_path)
    store.save("t-1", 1, {"w": np.zeros((2, 2), np.float32)})
    before = store.path("t-1").read_bytes()
    with pytest.raises(IntegrityError, match=r"tensor 'w' is float32\[2, 2\], the model's is float32\[4\]"):
        store.load("t-1", {"w": ((4,), np.float32)})
    with pytest.raises(IntegrityError, match=r"the model's private set is \['v'\]"):
        store.load("t-1", {"v": ((2, 2), np.float32)})
    assert store.path("t-1").read_bytes() == before
    store.path("t-2").write_bytes(before)  # another task's file under this task's name
    with pytest.raises(IntegrityError, match="of task 't-1'.*move it away to restart"):
        store.load("t-2")
    store.path("t-3").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(IntegrityError, match="private-modules file .*t-3.safetensors' is unusable"):
        store.load("t-3")
    assert store.path("t-3").read_bytes().endswith(b"{not json")
    store.save("t-4", 1, {"w": np.full(2, np.nan, np.float32)})
    with pytest.raises(IntegrityError, match="tensor 'w' is not finite"):
        store.load("t-4")
    with pytest.raises(ConfigError, match="cannot name a private-modules file"):
        store.path("../escape")


def test_the_site_model_is_the_global_model_with_the_site_s_private_tensors(tmp_path):
    from hospital_agent.site_model import merge_private, write_site_model

    start = package(seed=1)
    store = PrivateStore(tmp_path / "private")
    plain = merge_private(start, "abc", store, "t-1")
    assert plain.package is start and plain.private_round is None  # nothing held: the global model
    mine = {n: start.tensors[n] + 1 for n in PRIVATE}
    store.save("t-1", 2, mine)
    model = merge_private(start, "abc", store, "t-1")
    assert model.private_round == 2 and sorted(model.private_tensors) == sorted(PRIVATE)
    assert all(np.array_equal(model.package.tensors[n], mine[n]) for n in PRIVATE)
    assert all(model.package.tensors[n] is start.tensors[n] for n in SHARED)
    folder = write_site_model(model, tmp_path / "out", task_id="t-1", site="site-a")
    assert np.array_equal(ModelPackage.load(folder).tensors["crf.transitions"], mine["crf.transitions"])
    with pytest.raises(ConfigError, match="not an empty folder"):
        write_site_model(model, folder, task_id="t-1", site="site-a")
    store.save("t-2", 1, {"crf.transitions": np.zeros((2, 2), np.float32)})
    with pytest.raises(IntegrityError, match=r"private tensor 'crf.transitions' .* float32\[2, 2\] against"):
        merge_private(start, "abc", store, "t-2")
    store.save("t-3", 1, {"other.weight": np.zeros(2, np.float32)})
    with pytest.raises(IntegrityError, match="'other.weight' .* is not in the task's global model"):
        merge_private(start, "abc", store, "t-3")


def test_task_toml_declares_private_patterns_and_the_aggregator_checks_them(tmp_path):
    from aggregator_service.rounds import validate_spec
    from fedclinic.errors import Refused

    toml = tmp_path / "task.toml"
    toml.write_text('name = "n"\ndataset = "ner"\nlabels = ["DRUG", "CONDITION"]\nfamily = "token-classification"\n'
                    'architecture = "cnn-bilstm-crf"\n[update]\nprivate = [\'(lstm|classifier|crf)\\..*\']\n')
    task = Task.from_toml(toml)
    assert task.private == [r"(lstm|classifier|crf)\..*"]
    spec = task.to_spec()
    assert list(spec.update.private_patterns) == [r"(lstm|classifier|crf)\..*"]
    validate_spec(spec, package().manifest())
    spec.update.private_patterns.append("lstm")
    with pytest.raises(Refused, match="private pattern 'lstm' matches no tensor"):
        validate_spec(spec, package().manifest())
    with pytest.raises(ConfigError, match="pattern '\\[' is not a valid regular expression"):
        Task(name="n", dataset="ner", labels=["A"], private=["["]).validate()


# --- the agent: nothing private in the serialized update stream ------------------------------------------------

CODECS = ["raw", "fp16", "int8", "topk:0.2", "topk:0.2+int8"]


@pytest.fixture(scope="module")
def agent_and_data(tmp_path_factory):
    from fedclinic.training import trainer as training
    from hospital_agent.config import AgentConfig
    from hospital_agent.worker import Agent

    from fedclinic import pki

    root = tmp_path_factory.mktemp("agent")
    pki.init_ca(root / "ca")  # the agent signs its round statement into every update it writes (issue 17)
    site = pki.issue(root / "ca", role="agent", name="site-a", out_dir=root / "site-a")
    cfg = AgentConfig.from_dict({"aggregator": "127.0.0.1:1", "work_dir": str(root / "work"),
                                 "tls": {"cert": str(site.cert_path), "key": str(site.key_path),
                                         "ca": str(site.ca_path)}}, base=root, source="agent.toml")
    agent = Agent(cfg)
    agent.site_id = "site-a"
    return _Site(agent, package(seed=1), make_examples(12, seed=5), training)


class _Site:
    """The fixture's agent, model and data (a short repr: hypothesis prints the arguments of a failing case)."""

    def __init__(self, agent, start, examples, training) -> None:
        self.agent, self.start, self.examples, self.training = agent, start, examples, training
        self.task_ids = itertools.count()

    def __repr__(self) -> str:
        return "<agent site-a, FedNER tiny model>"


def _assignment(start: ModelPackage, private_patterns: list[str], codec: str, send: list[str], task_id: str):
    from fedclinic.proto import agent_pb2

    spec = Task(name="p", dataset="ner", family="token-classification", architecture=ARCH, labels=LABELS,
                local_epochs=1, batch_size=4, learning_rate=1e-2, max_length=32, codec=codec,
                private=private_patterns).to_spec()
    return agent_pb2.Assignment(task_id=task_id, round=1, spec=spec, send_tensors=send)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(private_set=st.sets(st.sampled_from(sorted(package().tensors)), min_size=1, max_size=12),
       codec=st.sampled_from(CODECS))
def test_no_private_tensor_appears_in_the_agent_s_serialized_update_stream(agent_and_data, private_set, codec):
    """The agent trains a round with the aggregator's send list (the static selection, which leaves private
    tensors out), then encodes, stores and streams the update exactly as it uploads it: the bytes on the wire
    name no private tensor and carry neither a private tensor's trained values nor its change."""
    from aggregator_service.update_admission import sent_tensors
    from fedclinic.models import build_model, module_tensors
    from fedclinic.proto import agent_pb2
    from hospital_agent.task_state import TaskState
    from hospital_agent.uploader import Uploader

    agent, start, examples, training = (agent_and_data.agent, agent_and_data.start, agent_and_data.examples,
                                        agent_and_data.training)
    names = list(start.tensors)
    if set(private_set) == set(names):
        private_set = set(names[1:])  # at least one tensor must be left to send
    patterns = [re.escape(n) for n in sorted(private_set)]
    task_id = f"t-{next(agent_and_data.task_ids)}"
    probe = _assignment(start, patterns, codec, [], task_id)
    send = sent_tensors(probe.spec, start.manifest())  # the aggregator's list
    a = _assignment(start, patterns, codec, send, task_id)
    private = private_names(names, patterns)
    assert sorted(private) == sorted(private_set) and not set(private) & set(send)
    state = TaskState(loaded=build_model(start))
    state.train_data = training.encode(examples, state.loaded, max_length=32)
    agent.training.restore_private(task_id, state, private)
    before = module_tensors(state.loaded.module, private)
    trained = agent.training.run(a, state, training.TrainConfig.from_proto(a.spec.training), private)
    header = agent_pb2.UpdateHeader(task_id=task_id, round=1, num_samples=trained.site.train.num_samples)
    header.tensors.extend(trained.site.update.headers)
    entry = agent.outbox.put(header, trained.site.update.payloads)
    try:
        wire = b"".join(Uploader.update_stream(entry))
    finally:
        agent.outbox.remove(entry)
    assert [t.name for t in header.tensors] == send
    for name in private:
        assert len(name) < 128 and bytes([len(name)]) + name.encode() not in wire, name  # as protobuf writes a string
        kept = state.private_values[name]
        for arr in (kept, kept - before[name]):
            flat = np.ascontiguousarray(arr, dtype=np.float32).ravel()
            if flat.size >= 4 and np.count_nonzero(flat[:4]):
                assert flat[:4].tobytes() not in wire, name
    stored, rnd = agent.private_store.load(task_id)
    assert rnd == 1 and all(np.array_equal(stored[k], state.private_values[k]) for k in private)


def test_the_agent_refuses_to_send_a_private_tensor_even_when_the_aggregator_asks(agent_and_data):
    from fedclinic.models import build_model
    from hospital_agent.task_state import TaskState

    agent, start, examples, training = (agent_and_data.agent, agent_and_data.start, agent_and_data.examples,
                                        agent_and_data.training)
    a = _assignment(start, list(PAPER_PRIVATE_PATTERNS), "raw", list(start.tensors), "t-asks")  # every tensor
    state = TaskState(loaded=build_model(start))
    state.train_data = training.encode(examples, state.loaded, max_length=32)
    private = private_names(start.tensors, PAPER_PRIVATE_PATTERNS)
    with pytest.raises(IntegrityError, match=r"refusing to send: tensor 'lstm.weight_ih_l0' is private"):
        agent.training.run(a, state, training.TrainConfig.from_proto(a.spec.training), private)
    assert not list(agent.outbox.entries())


def test_a_restarted_agent_trains_on_from_the_private_tensors_it_kept(agent_and_data):
    """A new process has no warm model: the private tensors come back from the store, not from the global model
    (whose private tensors hold the initial values)."""
    from fedclinic.models import build_model, module_tensors
    from hospital_agent.task_state import TaskState

    agent, start = agent_and_data.agent, agent_and_data.start
    private = private_names(start.tensors, PAPER_PRIVATE_PATTERNS)
    kept = {n: start.tensors[n] + 0.5 for n in private}
    agent.private_store.save("t-restart", 3, kept)
    state = TaskState(loaded=build_model(start))  # as a restarted agent builds it from the global model
    agent.training.restore_private("t-restart", state, private)
    now = module_tensors(state.loaded.module, private)
    assert all(np.array_equal(now[n], kept[n]) for n in private)
    shrunk = {**kept, "crf.transitions": kept["crf.transitions"][:2]}
    agent.private_store.save("t-other-model", 1, shrunk)
    with pytest.raises(IntegrityError, match="tensor 'crf.transitions' is float32\\[2, 5\\], the model's is"):
        agent.training.restore_private("t-other-model", TaskState(loaded=build_model(start)), private)
