"""Service configuration: every mistake is named with what to do; environment overrides apply."""

import pytest

from aggregator_service.config import AggregatorConfig
from fedclinic.errors import ConfigError
from fedclinic.proto import task_pb2
from hospital_agent.config import AgentConfig

from tests.helpers.agent_toml import AGENT_TOML

AGENT = AGENT_TOML + '''[datasets.notes]
path = "notes.jsonl"
'''


def test_agent_config_defaults_and_relative_paths(tmp_path):
    (tmp_path / "agent.toml").write_text(AGENT)
    cfg = AgentConfig.load(tmp_path / "agent.toml")
    assert cfg.work_dir == tmp_path / "work" and cfg.datasets["notes"].path == tmp_path / "notes.jsonl"
    assert cfg.policy.allowed_datasets == ("notes",) and cfg.policy.allowed_families == ("text-classification",)


def test_agent_torch_threads_default_all_cores_and_override(tmp_path, monkeypatch):
    from hospital_agent.torch_threads import resolve_threads
    from fedclinic.runtime.cpu_cores import available_cores, cores_per_process

    (tmp_path / "agent.toml").write_text(AGENT)
    assert AgentConfig.load(tmp_path / "agent.toml").torch_threads == 0
    assert AgentConfig.load(tmp_path / "agent.toml").preload_training_stack is True
    assert resolve_threads(0) == available_cores() and resolve_threads(3) == 3
    assert [cores_per_process(n, cores=2) for n in (1, 2, 3)] == [2, 1, 1]
    assert cores_per_process(3, cores=16) == 5
    monkeypatch.setenv("FEDCLINIC_AGENT_TORCH_THREADS", "2")
    assert AgentConfig.load(tmp_path / "agent.toml").torch_threads == 2


def test_agent_env_override(tmp_path, monkeypatch):
    (tmp_path / "agent.toml").write_text(AGENT)
    monkeypatch.setenv("FEDCLINIC_AGENT_AGGREGATOR", "other:1")
    monkeypatch.setenv("FEDCLINIC_AGENT_TLS__CA", "/etc/ca.crt")
    cfg = AgentConfig.load(tmp_path / "agent.toml")
    assert cfg.aggregator == "other:1" and str(cfg.tls.ca) == "/etc/ca.crt"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('aggregator = "agg:7443"\n', ""), "missing required setting 'aggregator'"),
    (lambda t: t.replace('ca = "ca.crt"\n', ""), "missing required setting 'tls.ca'"),
    (lambda t: 'colour = "blue"\n' + t, "unknown setting"),
    (lambda t: t.replace('path = "notes.jsonl"', 'path = "n.x"\nformat = "xml"'), "format must be one of"),
    (lambda t: t.replace('path = "notes.jsonl"', 'file = "n"'), "needs a 'path'"),
    (lambda t: t.replace('work_dir = "work"', "work_dir = 3"), "must be a str"),
    (lambda t: t + "[broken", "not valid TOML"),
    (lambda t: "torch_threads = -1\n" + t, "torch_threads must be a whole number"),
    (lambda t: "torch_threads = 1.5\n" + t, "torch_threads must be a whole number"),
    (lambda t: 'preload_training_stack = "yes"\n' + t, "preload_training_stack must be true or false"),
])
def test_agent_config_errors(tmp_path, edit, message):
    (tmp_path / "agent.toml").write_text(edit(AGENT))
    with pytest.raises(ConfigError, match=message):
        AgentConfig.load(tmp_path / "agent.toml")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        AgentConfig.load(tmp_path / "nope.toml")


def test_site_policy_refusals(tmp_path):
    (tmp_path / "agent.toml").write_text(AGENT + '[policy]\nallowed_families = ["text-classification"]\n'
                                                 'allowed_datasets = ["notes"]\n')
    cfg = AgentConfig.load(tmp_path / "agent.toml")
    spec = task_pb2.TaskSpec(family="text-classification", dataset="notes")
    assert cfg.policy.refusal(spec, cfg.datasets) is None
    assert "family 'qa'" in cfg.policy.refusal(task_pb2.TaskSpec(family="qa", dataset="notes"), cfg.datasets)
    assert "dataset 'x'" in cfg.policy.refusal(task_pb2.TaskSpec(family="text-classification", dataset="x"),
                                               cfg.datasets)
    dp = task_pb2.TaskSpec(family="text-classification", dataset="notes", privacy=task_pb2.PrivacyConfig(level="sample"))
    assert cfg.policy.refusal(dp, cfg.datasets) is None  # the privacy ledger decides (budget) when the task arrives
    odd = task_pb2.TaskSpec(family="text-classification", dataset="notes", privacy=task_pb2.PrivacyConfig(level="x"))
    assert "privacy level 'x'" in cfg.policy.refusal(odd, cfg.datasets)


def test_dataset_privacy_budget_settings(tmp_path):
    (tmp_path / "agent.toml").write_text(AGENT.replace("[datasets.notes]\n", "[datasets.notes]\nprivacy_epsilon = 8.0\n"
                                                       "privacy_delta = 1e-5\n"))
    entry = AgentConfig.load(tmp_path / "agent.toml").datasets["notes"]
    assert (entry.privacy_epsilon, entry.privacy_delta) == (8.0, 1e-5)
    (tmp_path / "half.toml").write_text(AGENT.replace("[datasets.notes]\n", "[datasets.notes]\nprivacy_epsilon = 8.0\n"))
    with pytest.raises(ConfigError, match="set both privacy_epsilon and privacy_delta"):
        AgentConfig.load(tmp_path / "half.toml")
    (tmp_path / "bad.toml").write_text(AGENT.replace("[datasets.notes]\n", "[datasets.notes]\nprivacy_epsilon = -1\n"
                                                     "privacy_delta = 1e-5\n"))
    with pytest.raises(ConfigError, match="privacy_epsilon must be > 0"):
        AgentConfig.load(tmp_path / "bad.toml")


def test_aggregator_config(tmp_path, monkeypatch):
    body = 'listen = "127.0.0.1:0"\nstate_dir = "state"\n[tls]\ncert = "a"\nkey = "b"\nca = "c"\n'
    (tmp_path / "agg.toml").write_text(body)
    monkeypatch.setenv("FEDCLINIC_AGGREGATOR_MAX_WORKERS", "16")
    cfg = AggregatorConfig.load(tmp_path / "agg.toml")
    assert cfg.state_dir == tmp_path / "state" and cfg.max_workers == 16 and cfg.crl is None
    monkeypatch.setenv("FEDCLINIC_AGGREGATOR_MAX_WORKERS", "2")
    with pytest.raises(ConfigError, match="max_workers must be at least 4"):
        AggregatorConfig.load(tmp_path / "agg.toml")
    monkeypatch.delenv("FEDCLINIC_AGGREGATOR_MAX_WORKERS")
    (tmp_path / "bad.toml").write_text(body.replace('listen = "127.0.0.1:0"\n', ""))
    with pytest.raises(ConfigError, match="missing required setting 'listen'"):
        AggregatorConfig.load(tmp_path / "bad.toml")


def test_aggregator_without_a_crl_needs_the_explicit_dev_switch(tmp_path, monkeypatch):
    body = 'listen = "127.0.0.1:0"\nstate_dir = "state"\n[tls]\ncert = "a"\nkey = "b"\nca = "c"\n'
    (tmp_path / "agg.toml").write_text(body)
    cfg = AggregatorConfig.load(tmp_path / "agg.toml")
    assert cfg.crl is None and cfg.allow_no_crl is False
    with pytest.raises(ConfigError, match=r"no revocation list configured.*refusing to start.*\[tls\] crl.*"
                                          r"allow_no_crl = true"):
        cfg.require_crl_or_dev_mode()
    (tmp_path / "dev.toml").write_text(body + "allow_no_crl = true\n")
    AggregatorConfig.load(tmp_path / "dev.toml").require_crl_or_dev_mode()
    monkeypatch.setenv("FEDCLINIC_AGGREGATOR_TLS__ALLOW_NO_CRL", "true")
    assert AggregatorConfig.load(tmp_path / "agg.toml").allow_no_crl is True
    monkeypatch.setenv("FEDCLINIC_AGGREGATOR_TLS__ALLOW_NO_CRL", "yes")
    with pytest.raises(ConfigError, match="allow_no_crl must be true or false"):
        AggregatorConfig.load(tmp_path / "agg.toml")
    monkeypatch.delenv("FEDCLINIC_AGGREGATOR_TLS__ALLOW_NO_CRL")
    (tmp_path / "crl.toml").write_text(body + 'crl = "crl.pem"\n')
    AggregatorConfig.load(tmp_path / "crl.toml").require_crl_or_dev_mode()


def test_a_dataset_pinned_to_a_tokenizer_refuses_other_tokenizers(tmp_path):
    pinned = "ab" * 32
    (tmp_path / "agent.toml").write_text(AGENT + f'tokenizer_sha256 = "{pinned}"\n')
    cfg = AgentConfig.load(tmp_path / "agent.toml")
    ok = task_pb2.TaskSpec(family="text-classification", dataset="notes", tokenizer_sha256=pinned)
    assert cfg.policy.refusal(ok, cfg.datasets) is None
    other = task_pb2.TaskSpec(family="text-classification", dataset="notes", tokenizer_sha256="cd" * 32)
    assert "pinned to tokenizer abababababab" in cfg.policy.refusal(other, cfg.datasets)
    (tmp_path / "bad.toml").write_text(AGENT + 'tokenizer_sha256 = "not-a-hash"\n')
    with pytest.raises(ConfigError, match=r"\[datasets.notes\] tokenizer_sha256 must be 64 lowercase hex digits"):
        AgentConfig.load(tmp_path / "bad.toml")


def test_aggregator_refuses_a_spec_whose_tokenizer_hash_is_not_the_models():
    from aggregator_service.rounds import validate_spec
    from fedclinic.errors import Refused
    from fedclinic.spec.task import Task

    from tests.helpers.text_models import tiny_package

    pkg = tiny_package("logreg")
    task = Task(name="t", dataset="notes", labels=["cardio", "neuro"], architecture="logreg")
    import hashlib

    good = task.to_spec(tokenizer_sha256=hashlib.sha256(pkg.files["tokenizer.json"]).hexdigest())
    validate_spec(good, pkg.manifest())
    with pytest.raises(Refused, match="tokenizer_sha256 does not match the model's tokenizer.json"):
        validate_spec(task.to_spec(tokenizer_sha256="00" * 32), pkg.manifest())


def test_a_folder_or_unreadable_file_given_as_config_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="is a folder; give the configuration file inside it"):
        AgentConfig.load(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t + '[policy]\naproval = "manual"\n', r"\[policy\]: unknown setting\(s\) \['aproval'\].*known: "
                                                     r"allow_evaluation, allow_statistics, allowed_datasets, allowed_families, "
                                                     r"allowed_owners, approval"),
    (lambda t: t.replace('path = "notes.jsonl"', 'path = "notes.jsonl"\neval_pth = "val.jsonl"'),
     r"\[datasets.notes\]: unknown setting\(s\) \['eval_pth'\]"),
    (lambda t: t.replace('ca = "ca.crt"', 'ca = "ca.crt"\ncrl = "crl.pem"'),
     r"\[tls\]: unknown setting\(s\) \['crl'\]"),
])
def test_agent_refuses_misspelt_keys_instead_of_using_defaults(tmp_path, edit, message):
    """A misspelt key must not silently fall back to its default: `aproval = "manual"` would mean auto approval."""
    (tmp_path / "agent.toml").write_text(edit(AGENT))
    with pytest.raises(ConfigError, match=message):
        AgentConfig.load(tmp_path / "agent.toml")


def test_aggregator_refuses_misspelt_keys_from_the_file_and_the_environment(tmp_path, monkeypatch):
    body = 'listen = "127.0.0.1:0"\nstate_dir = "state"\n[tls]\ncert = "a"\nkey = "b"\nca = "c"\ncrl = "crl.pem"\n'
    (tmp_path / "agg.toml").write_text(body)
    assert AggregatorConfig.load(tmp_path / "agg.toml").crl == tmp_path / "crl.pem"
    (tmp_path / "typo.toml").write_text(body.replace("crl =", "crl_path ="))  # would turn revocation checks off
    with pytest.raises(ConfigError, match=r"\[tls\]: unknown setting\(s\) \['crl_path'\].*known: allow_no_crl, ca, cert, crl, key"):
        AggregatorConfig.load(tmp_path / "typo.toml")
    monkeypatch.setenv("FEDCLINIC_AGGREGATOR_METRICS_ADRESS", "127.0.0.1:9464")
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['metrics_adress'\] \(in the file or from a "
                                          r"FEDCLINIC_AGGREGATOR_\* environment variable\)"):
        AggregatorConfig.load(tmp_path / "agg.toml")


def test_aggregator_accepts_sample_level_dp_exactly_where_the_sites_can_run_it():
    """The aggregator's own check (an SDK of another version may skip it) is the sites' table
    (fedclinic.spec.capabilities): DP-SGD for an LSTM is accepted (the sites differentiate each example alone), a
    model without a per-example objective is refused at submit with the reason and the alternative."""
    from aggregator_service.rounds import validate_spec
    from fedclinic.errors import Refused
    from fedclinic.spec.task import Task

    from tests.helpers.text_models import tiny_package

    private = {"level": "sample", "target_epsilon": 8.0, "target_delta": 1e-5, "max_grad_norm": 1.0}
    task = Task(name="t", dataset="notes", labels=["cardio", "neuro"], architecture="lstm", privacy=private)
    validate_spec(task.to_spec(), tiny_package("lstm").manifest())
    spec = task.to_spec()
    spec.architecture = "gru"  # what Task.validate would refuse: a client that skipped it
    with pytest.raises(Refused, match=r"sample-level DP-SGD is not available for text-classification / gru: .*"
                                      r"client-level DP instead"):
        validate_spec(spec, tiny_package("lstm").manifest())


def test_aggregator_limits_table(tmp_path, monkeypatch):
    body = 'listen = "127.0.0.1:0"\nstate_dir = "state"\n[tls]\ncert = "a"\nkey = "b"\nca = "c"\n'
    (tmp_path / "agg.toml").write_text(body + "[limits]\nuploads_per_peer = 2\nidle_timeout_s = 5\n")
    cfg = AggregatorConfig.load(tmp_path / "agg.toml")
    assert cfg.limits.uploads_per_peer == 2 and cfg.limits.idle_timeout_s == 5.0
    assert cfg.limits.downloads_per_peer == 4  # the defaults stay
    assert cfg.limits.long_lived_cap(cfg.max_workers) == cfg.max_workers - cfg.limits.unary_reserve
    assert cfg.limits.long_lived_cap(4) == 2  # the reserve never takes more than half the threads
    monkeypatch.setenv("FEDCLINIC_AGGREGATOR_LIMITS__UPLOADS_PER_PEER", "7")
    assert AggregatorConfig.load(tmp_path / "agg.toml").limits.uploads_per_peer == 7
    monkeypatch.delenv("FEDCLINIC_AGGREGATOR_LIMITS__UPLOADS_PER_PEER")
    for table, message in [("uploads_per_peer = 0", "uploads_per_peer must be at least 1"),
                           ("uploads_per_peer = 1.5", "uploads_per_peer must be a whole number"),
                           ("idle_timeout_s = -1", "idle_timeout_s must be between 0.1 and 86400"),
                           ('idle_timeout_s = "soon"', "idle_timeout_s must be a number of seconds"),
                           ("upload_per_peer = 2", r"unknown key\(s\) \['upload_per_peer'\]"),
                           ("max_concurrent_rpcs = 8", "max_concurrent_rpcs = 8 is below max_workers")]:
        (tmp_path / "bad.toml").write_text(body + f"[limits]\n{table}\n")
        with pytest.raises(ConfigError, match=message):
            AggregatorConfig.load(tmp_path / "bad.toml")
