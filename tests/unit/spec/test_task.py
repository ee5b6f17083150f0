import pytest

from fedclinic.errors import ConfigError
from fedclinic.proto import task_pb2
from fedclinic.spec.task import Task


def test_task_to_spec():
    spec = Task(name="t1", dataset="notes", labels=["a", "b"], num_rounds=4, min_sites=2,
                on_quorum_miss="fail", trainable=["classifier.*"]).to_spec()
    assert spec.rounds.num_rounds == 4 and spec.rounds.on_quorum_miss == task_pb2.QUORUM_POLICY_FAIL
    assert list(spec.update.trainable_patterns) == ["classifier.*"]


def test_task_validation_lists_every_problem():
    with pytest.raises(ConfigError) as exc:
        Task(name="", dataset="", labels=["a"], learning_rate=0, on_quorum_miss="maybe").validate()
    msg = str(exc.value)
    for part in ("name", "dataset", "two classes", "learning_rate", "on_quorum_miss"):
        assert part in msg


def test_task_from_toml(tmp_path):
    (tmp_path / "task.toml").write_text('''
name = "x"
dataset = "notes"
labels = ["a", "b"]
model = "models/minilm"
[training]
local_epochs = 2
[rounds]
num_rounds = 3
min_sites = 1
[update]
trainable = ['classifier\\..*']
''')
    task = Task.from_toml(tmp_path / "task.toml")
    assert task.local_epochs == 2 and task.num_rounds == 3 and task.model == str(tmp_path / "models" / "minilm")


@pytest.mark.parametrize("body, message", [
    ('name = "x"\ndataset = "d"\nlabels = ["a","b"]\ncolour = 1\n', "unknown setting"),
    ('name = "x"\ndataset = "d"\nlabels = ["a","b"]\n[training]\nepochs = 1\n', "unknown key"),
    ('name = "x"\nlabels = ["a","b"]\n', "missing required"),
    ('name = "x\n', "not valid TOML"),
])
def test_task_toml_errors(tmp_path, body, message):
    (tmp_path / "t.toml").write_text(body)
    with pytest.raises(ConfigError, match=message):
        Task.from_toml(tmp_path / "t.toml")


def test_string_strategy_options_travel_in_their_own_map_and_are_checked():
    from fedclinic.spec.task import Task

    t = Task(name="k", dataset="d", labels=["a", "b"], strategy="fedatt",
             strategy_params={"server_lr": 4, "granularity": "whole_model"})
    spec = t.to_spec()
    assert dict(spec.strategy_params) == {"server_lr": 4.0} and dict(spec.strategy_options) == {"granularity": "whole_model"}
    from fedclinic.spec.validation import strategy_of

    assert strategy_of(spec).granularity == "whole_model"
    with pytest.raises(ConfigError, match="granularity must be one of"):
        Task(name="k", dataset="d", labels=["a", "b"], strategy="fedatt", strategy_params={"granularity": "layer"}).validate()
    with pytest.raises(ConfigError, match=r"strategy parameter\(s\) \['on'\] must be numbers or strings"):
        Task(name="k", dataset="d", labels=["a", "b"], strategy="fedatt", strategy_params={"on": True}).validate()


def test_model_config_sizes_the_packaged_model(tmp_path):
    """[model_config] reaches the packager: here the FedNER tagger's sizes; a wrong key is refused."""
    from fedclinic.errors import ConfigError
    from fedclinic.models import package_for_task

    from tests.helpers.ner_models import tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer())
    (tmp_path / "task.toml").write_text(
        'name = "ner"\nfamily = "token-classification"\narchitecture = "cnn-bilstm-crf"\ndataset = "notes"\n'
        'labels = ["DRUG", "CONDITION"]\nmodel = "tok"\n'
        '[model_config]\nembedding_dim = 16\nchar_dim = 8\nchar_filters = 8\nword_filters = 16\nlstm_hidden = 8\n')
    task = Task.from_toml(tmp_path / "task.toml")
    pkg = package_for_task(task)
    assert pkg.meta["arch_config"]["embedding_dim"] == 16 and pkg.tensors["lstm.weight_hh_l0"].shape == (32, 8)
    task.model_config = {"lstm_size": 8}
    with pytest.raises(ConfigError, match="lstm_size"):
        package_for_task(task)


def test_secure_aggregation_section_travels_in_the_spec_with_defaults(tmp_path):
    (tmp_path / "task.toml").write_text('''
name = "x"
dataset = "notes"
labels = ["a", "b"]
min_sites = 4
[secure_aggregation]
enabled = true
clip = 0.25
bits = 16
''')
    spec = Task.from_toml(tmp_path / "task.toml").to_spec()
    sa = spec.secure_aggregation
    assert (sa.enabled, sa.min_cohort, sa.threshold, sa.clip, sa.bits, sa.rounding, sa.degree) == (
        True, 3, 0, 0.25, 16, "stochastic", 0)
    assert not Task(name="y", dataset="d", labels=["a", "b"]).to_spec().secure_aggregation.enabled


@pytest.mark.parametrize("section, message", [
    ({"enabled": True, "min_cohort": 2}, "min_cohort is 2; it must be at least 3"),
    ({"enabled": True, "threshold": 2}, "threshold 2 is unsafe or unreachable"),        # 2t > h fails for 4 sites
    ({"enabled": True, "threshold": 5}, "threshold 5 is unsafe or unreachable"),        # more than the 4 holders
    ({"enabled": True, "bits": 30}, "bits must be an integer in [1, 24]"),
    ({"enabled": True, "degree": 3}, "even integer"),
    ({"enabled": "yes"}, "enabled must be true or false"),
    ({"enabled": True, "rounds": 3}, "unknown setting 'rounds'"),
])
def test_secure_aggregation_settings_the_library_rejects_are_refused(section, message):
    task = Task(name="x", dataset="d", labels=["a", "b"], min_sites=4, secure_aggregation=section)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        task.validate()


def test_secure_aggregation_refuses_strategies_that_need_each_update():
    for name in ("median", "fedatt", "dp-fedavg"):
        extra = {"privacy": {"level": "client"}} if name == "dp-fedavg" else {}
        with pytest.raises(ConfigError, match=f"strategy '{name}' looks at each site's update"):
            Task(name="x", dataset="d", labels=["a", "b"], min_sites=3, strategy=name,
                 secure_aggregation={"enabled": True}, **extra).validate()
    Task(name="x", dataset="d", labels=["a", "b"], min_sites=3, strategy="fedadam",
         secure_aggregation={"enabled": True}).validate()  # works on the sum: accepted


def test_pooling_is_checked_at_the_task_for_the_family_it_applies_to():
    """[model_config] pooling: only a text-classification transformer has it; an unknown value is named."""
    Task(name="t", dataset="d", labels=["a", "b"], model_config={"pooling": "mean"}).validate()
    with pytest.raises(ConfigError, match=r"pooling must be one of \['cls', 'mean'\], got 'max'"):
        Task(name="t", dataset="d", labels=["a", "b"], model_config={"pooling": "max"}).validate()
    with pytest.raises(ConfigError, match="pooling applies to text-classification transformer models only, not "
                                          "token-classification transformer-crf; remove it"):
        Task(name="t", dataset="d", labels=["DRUG"], family="token-classification", architecture="transformer-crf",
             model_config={"pooling": "mean"}).validate()
    with pytest.raises(ConfigError, match="not text-classification lstm"):
        Task(name="t", dataset="d", labels=["a", "b"], architecture="lstm", model_config={"pooling": "mean"}).validate()


def _private(**privacy) -> Task:
    return Task(name="t", dataset="notes", labels=["a", "b"], privacy=privacy)


def test_privacy_unit_patient_is_a_setting_of_sample_level_dp():
    """privacy.unit: "patient" or "example" under level "sample" reach the spec; anything else, or a unit under
    client-level DP, is refused by the one validator with what to change."""
    ok = {"level": "sample", "target_epsilon": 4.0}
    assert _private(**ok, unit="patient").to_spec().privacy.unit == "patient"
    assert _private(**ok, unit="example").to_spec().privacy.unit == "example"
    assert _private(**ok).to_spec().privacy.unit == ""  # the default: one example
    with pytest.raises(ConfigError, match='unit must be "example"'):
        _private(**ok, unit="ward").validate()
    with pytest.raises(ConfigError, match="unit must be a string"):
        _private(**ok, unit=3).validate()
    with pytest.raises(ConfigError, match="unit is a setting of level"):
        Task(name="t", dataset="notes", labels=["a", "b"], strategy="dp-fedavg",
             privacy={"level": "client", "unit": "patient"}).validate()
    from fedclinic.spec.validation import privacy_problems

    assert any("needs level" in p for p in privacy_problems(task_pb2.TaskSpec(
        privacy=task_pb2.PrivacyConfig(unit="patient"))))


def test_privacy_unit_patient_is_refused_for_models_clipped_one_row_at_a_time():
    """The per-example loop (LSTM, bag-of-tokens, CNN-BiLSTM-CRF, ResNet + BiLSTM) clips each row as it
    differentiates it: a per-patient task on such a model is refused at submit, naming the architecture."""
    ok = {"level": "sample", "target_epsilon": 4.0}
    with pytest.raises(ConfigError, match='unit "patient" is not available for text-classification / lstm'):
        Task(name="t", dataset="notes", labels=["a", "b"], architecture="lstm", privacy={**ok, "unit": "patient"}
             ).validate()
    Task(name="t", dataset="notes", labels=["a", "b"], architecture="lstm", privacy={**ok, "unit": "example"}
         ).validate()
    Task(name="t", dataset="notes", labels=["a", "b"], privacy={**ok, "unit": "patient"}).validate()
