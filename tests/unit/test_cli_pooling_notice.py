"""`fedclinic task submit` names the pooling a model folder declares when the task chose another."""

from __future__ import annotations

import pytest

from fedclinic.cli import main
from fedclinic.models import wordlevel_tokenizer_json

from tests.helpers.pretrained import WORDS, declare_pooling, pretrained_bert_folder

TASK = """
name = "pooled"
dataset = "notes"
labels = ["a", "b"]
model = "{model}"
{extra}
"""


@pytest.fixture
def folder(tmp_path):
    folder, _ = pretrained_bert_folder(tmp_path, wordlevel_tokenizer_json(WORDS))
    declare_pooling(folder, mean_tokens=True)
    return folder


@pytest.mark.parametrize("extra, noticed", [("", True), ('[model_config]\npooling = "mean"', False),
                                            ('[model_config]\npooling = "cls"', True)])
def test_submit_prints_the_declared_pooling_when_the_task_chose_another(folder, tmp_path, monkeypatch, capsys,
                                                                          extra, noticed):
    for name in ("FEDCLINIC_ADDRESS", "FEDCLINIC_CERT", "FEDCLINIC_KEY", "FEDCLINIC_CA"):
        monkeypatch.delenv(name, raising=False)
    toml = tmp_path / "task.toml"
    toml.write_text(TASK.format(model=folder, extra=extra))
    assert main(["task", "submit", str(toml)]) == 2  # no aggregator given: the notice comes first, then the error
    err = capsys.readouterr().err
    assert "missing connection setting" in err
    assert ("was trained with mean pooling (its sentence-transformers config) but the task uses cls pooling" in err
            and 'set [model_config] pooling = "mean"' in err) is noticed, err
