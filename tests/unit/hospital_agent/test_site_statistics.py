"""A site's answer to a statistics task: the dataset read from the registry as training reads it, the tokenizer the
task declares, the ledger charged once for a noisy answer, and declines whose reasons hold no data."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from fedclinic.data.text import Example
from fedclinic.evaluation.statistics_counts import measure
from fedclinic.evaluation.statistics_dp import noisy_release
from fedclinic.proto import task_pb2
from fedclinic.strategies.secure_laplace import SecureDiscreteLaplace
from hospital_agent.config import AgentConfig
from hospital_agent.privacy_ledger import BudgetExceeded, PrivacyLedger
from hospital_agent.site_privacy import SitePrivacy
from hospital_agent.site_statistics import StatisticsDeclined, answer_statistics
from tests.helpers.distribution import dkw_margin, laplace_distance

THAI = ["ผู้ป่วยมีไข้สูงและไอ", "ปวดศีรษะรุนแรง"]


def _config(tmp_path: Path, rows: list[str], **dataset) -> AgentConfig:
    (tmp_path / "notes.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    doc = {"aggregator": "a:1", "work_dir": "w", "tls": {"cert": "c", "key": "k", "ca": "ca"},
           "datasets": {"notes": {"path": "notes.jsonl", **dataset}}}
    return AgentConfig.from_dict(doc, base=tmp_path, source="agent.toml")


def _rows(n_a: int = 30, n_b: int = 20, texts=("the patient has a fever",)) -> list[str]:
    return ([json.dumps({"text": texts[i % len(texts)], "label": "a"}) for i in range(n_a)]
            + [json.dumps({"text": texts[i % len(texts)], "label": "b"}) for i in range(n_b)])


def _spec(epsilon: float = 0.0, **kw) -> task_pb2.TaskSpec:
    return task_pb2.TaskSpec(family="text-classification", dataset="notes", labels=["a", "b"],
                             training=task_pb2.TrainingConfig(max_length=16),
                             statistics=task_pb2.StatisticsConfig(epsilon=epsilon), **kw)


@pytest.fixture(scope="module")
def minilm_json() -> bytes:
    from fedclinic.assets import minilm_path

    return (minilm_path() / "tokenizer.json").read_bytes()


def test_an_exact_answer_reads_the_registry_dataset_with_the_task_tokenizer(tmp_path, minilm_json):
    rows = _rows(texts=THAI) + ['{"text": "", "label": "a"}', "{oops"] + [json.dumps({"text": "x", "label": "q"})] * 11
    config = _config(tmp_path, rows)
    sha = hashlib.sha256(minilm_json).hexdigest()
    v = answer_statistics(_spec(tokenizer_sha256=sha), task_id="t1", config=config, min_cell=10, ledger=None,
                          tokenizer=minilm_json)
    assert (v["rows"], v["label/a"], v["label/b"], v["invalid_rows"]) == (50, 30, 20, 12)
    assert "missing_rows" not in v and v["suppressed/missing_rows"] == 1  # 1 row < k
    assert v["unk_rate"] > 0.5
    with pytest.raises(StatisticsDeclined, match="not the tokenizer the task declares"):
        answer_statistics(_spec(tokenizer_sha256="0" * 64), task_id="t1", config=config, min_cell=10,
                          ledger=None, tokenizer=minilm_json)
    assert "unk_rate" not in answer_statistics(_spec(), task_id="t1", config=config, min_cell=10, ledger=None)
    # the synced model folder (or its tokenizer.json) does as well as the bytes
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(minilm_json)
    for where in (folder, folder / "tokenizer.json", str(folder)):
        assert answer_statistics(_spec(tokenizer_sha256=sha), task_id="t1", config=config, min_cell=10, ledger=None,
                                 tokenizer=where)["unk_rate"] == v["unk_rate"]
    with pytest.raises(StatisticsDeclined, match="no readable tokenizer.json"):
        answer_statistics(_spec(), task_id="t1", config=config, min_cell=10, ledger=None, tokenizer=tmp_path / "x")


def test_a_noisy_answer_is_charged_once_to_the_dataset_ledger(tmp_path):
    config = _config(tmp_path, _rows(), privacy_epsilon=3.0, privacy_delta=1e-5)
    privacy = SitePrivacy(tmp_path / "ledger.sqlite", config.datasets)
    v = answer_statistics(_spec(1.25), task_id="s1", config=config, min_cell=10, ledger=privacy)
    assert v["rows"] > 0 and ("label/a" in v or "suppressed/label/a" in v)
    (spend,) = privacy.ledger.status()
    (task,) = spend.tasks
    assert (task.task_id, task.spent_epsilon, task.delta, task.finished) == ("s1", 1.25, 0.0, True)
    assert spend.remaining_epsilon == pytest.approx(1.75)
    # answering the same task again would release a second noisy sample: refused
    with pytest.raises(BudgetExceeded, match="finished"):
        answer_statistics(_spec(1.25), task_id="s1", config=config, min_cell=10, ledger=privacy.ledger)
    # a task whose epsilon exceeds what is left is declined with the budget left, and nothing is charged
    with pytest.raises(BudgetExceeded, match="only epsilon 1.75"):
        answer_statistics(_spec(2.0), task_id="s2", config=config, min_cell=10, ledger=privacy.ledger)
    assert [t.task_id for t in privacy.ledger.status()[0].tasks] == ["s1"]
    # an exact answer spends nothing
    answer_statistics(_spec(), task_id="s3", config=config, min_cell=10, ledger=privacy.ledger)
    assert privacy.ledger.status()[0].spent_epsilon == 1.25


def test_declines_say_why_and_hold_no_value_from_the_data(tmp_path):
    config = _config(tmp_path, _rows())
    with pytest.raises(BudgetExceeded, match="no privacy budget"):
        answer_statistics(_spec(1.0), task_id="n1", config=config, min_cell=10,
                          ledger=PrivacyLedger(tmp_path / "l.sqlite"))
    with pytest.raises(StatisticsDeclined, match="keeps no privacy ledger"):
        answer_statistics(_spec(1.0), task_id="n1", config=config, min_cell=10, ledger=None)
    with pytest.raises(StatisticsDeclined, match="'other' is not in this site's registry"):
        answer_statistics(task_pb2.TaskSpec(dataset="other", labels=["a", "b"]), task_id="n1", config=config,
                          min_cell=10, ledger=None)
    with pytest.raises(StatisticsDeclined, match="question-answering"):
        answer_statistics(task_pb2.TaskSpec(family="question-answering", dataset="notes"), task_id="n1",
                          config=config, min_cell=10, ledger=None)
    (tmp_path / "notes.jsonl").write_bytes(b'{"text": "secret \xff\xfe", "label": "a"}\n')
    with pytest.raises(StatisticsDeclined) as info:
        answer_statistics(_spec(), task_id="n1", config=config, min_cell=10, ledger=None)
    assert "not valid UTF-8" in str(info.value) and "secret" not in str(info.value) and str(tmp_path) not in str(
        info.value)


def test_a_dataset_with_patient_ids_is_protected_per_patient(tmp_path):
    # 3 rows per patient: the noise scale is 3x the per-row one (group privacy), and the ledger records "patient".
    # The DKW test fails with probability <= 1e-6 for a correct mechanism, and rejects the per-row scale.
    rows = [json.dumps({"text": "fever", "label": "ab"[i % 2], "pid": f"p{i // 3}"}) for i in range(60)]
    config = _config(tmp_path, rows, group_field="pid", privacy_epsilon=5.0, privacy_delta=1e-5)
    privacy = SitePrivacy(tmp_path / "ledger.sqlite", config.datasets)
    answer_statistics(_spec(1.0), task_id="p1", config=config, min_cell=10, ledger=privacy)
    (task,) = privacy.ledger.status()[0].tasks
    assert task.unit == "patient" and task.spent_epsilon == 1.0
    counts = measure([Example("fever", ("a",))] * 60, None, "ab", multi_label=False, max_length=16)
    sampler, n = SecureDiscreteLaplace(), 1000
    draws = np.array([noisy_release(counts, 1.5, sampler, rows_per_unit=3)["rows"] for _ in range(n)]) - 60
    assert laplace_distance(draws.astype(np.int64), 3 * 3 / 1.5) < dkw_margin(n)  # 3 groups, 3 rows per patient
    assert laplace_distance(draws.astype(np.int64), 3 / 1.5) > dkw_margin(n)
    # a row without a patient id: the site cannot bound a patient's rows, and declines
    (tmp_path / "b").mkdir()
    bad = _config(tmp_path / "b", rows + ['{"text": "x", "label": "a"}'], group_field="pid", privacy_epsilon=5.0,
                  privacy_delta=1e-5)
    with pytest.raises(StatisticsDeclined, match="row 61: a row has no patient id"):
        answer_statistics(_spec(1.0), task_id="p2", config=bad, min_cell=10,
                          ledger=SitePrivacy(tmp_path / "l2.sqlite", bad.datasets))
