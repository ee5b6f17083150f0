"""The agent's ``devices`` setting (multi-device rounds): what it accepts, what it refuses and how it says so."""

from __future__ import annotations

import pytest

from fedclinic.errors import ConfigError
from hospital_agent.config import AgentConfig

from tests.helpers.agent_toml import AGENT_TOML


def _load(tmp_path, top: str) -> AgentConfig:
    (tmp_path / "agent.toml").write_text(top + AGENT_TOML)
    return AgentConfig.load(tmp_path / "agent.toml")


def test_devices_default_to_one_process(tmp_path):
    cfg = _load(tmp_path, "")
    assert (cfg.devices, cfg.distributed_timeout, cfg.gradient_checkpointing) == (None, 600.0, False)
    assert cfg.sharding == "none"  # the default: every process holds the whole model (all-reduce data parallel)


@pytest.mark.parametrize("line, expected", [
    ('devices = "all"', "all"), ('devices = ["cpu", "cpu"]', ["cpu", "cpu"]),
    ('devices = ["cuda:0", "cuda:1"]', ["cuda:0", "cuda:1"]),
])
def test_devices_are_read(tmp_path, line, expected):
    cfg = _load(tmp_path, line + "\ndistributed_timeout = 30\ngradient_checkpointing = true\n")
    assert (cfg.devices, cfg.distributed_timeout, cfg.gradient_checkpointing) == (expected, 30.0, True)


def test_fsdp_sharding_is_read_with_devices(tmp_path):
    cfg = _load(tmp_path, 'devices = ["cpu", "cpu"]\nsharding = "fsdp"\n')
    assert (cfg.devices, cfg.sharding) == (["cpu", "cpu"], "fsdp")


@pytest.mark.parametrize("top, message", [
    ('devices = ["gpu0"]', "unknown device"),
    ('devices = ["cpu", "cuda:0"]', "mixes CPU and GPU"),
    ('devices = "every"', 'must be "all" or a list'),
    ('devices = ["cuda:0", "cuda:1"]\ndevice = "cuda:0"', "either device"),
    ('distributed_timeout = 0', "distributed_timeout must be a number of seconds"),
    ('gradient_checkpointing = "yes"', "gradient_checkpointing"),
    ('devices = ["cpu", "cpu"]\nsharding = "FSDP2"', 'sharding must be "none" .* or "fsdp"'),
    ('devices = ["cpu", "cpu"]\nsharding = true', 'sharding must be "none" .* or "fsdp"'),
    ('sharding = "fsdp"', "set devices too"),
])
def test_bad_device_settings_say_what_to_write(tmp_path, top, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, top + "\n")


def test_check_config_says_when_named_gpus_are_not_visible(tmp_path):
    import torch

    from hospital_agent.cli import check_config

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    (tmp_path / "agent.toml").write_text(f'devices = ["cuda:{count}"]\n' + AGENT_TOML)
    problems = check_config(str(tmp_path / "agent.toml"))
    assert any(f"cuda:{count}" in p and ("CUDA_VISIBLE_DEVICES" in p or "torch sees none" in p) for p in problems)
    (tmp_path / "agent.toml").write_text('devices = ["cpu", "cpu"]\n' + AGENT_TOML)
    assert not any("device" in p for p in check_config(str(tmp_path / "agent.toml")))

