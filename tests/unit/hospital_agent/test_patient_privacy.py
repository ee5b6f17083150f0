"""Per-patient DP at the site: the dataset's group_field, the patient ids read with the rows, the policy's refusal of
a per-patient task on a dataset without one, and the ledger charging patients (q over patients, unit recorded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedclinic.data.patient_ids import patient_ids_for, read_patient_ids
from fedclinic.errors import ConfigError, DatasetError
from fedclinic.privacy.accounting import epsilon_of
from fedclinic.proto import task_pb2
from hospital_agent.config import AgentConfig
from hospital_agent.site_privacy import SitePrivacy


def _config(tmp_path: Path, **dataset) -> AgentConfig:
    doc = {"aggregator": "a:1", "work_dir": "w", "tls": {"cert": "c", "key": "k", "ca": "ca"},
           "datasets": {"notes": {"path": "notes.jsonl", **dataset}}}
    return AgentConfig.from_dict(doc, base=tmp_path, source="agent.toml")


def _spec(unit: str = "patient", **privacy) -> task_pb2.TaskSpec:
    pc = dict(level="sample", target_delta=1e-5, max_grad_norm=1.0, accountant="rdp", unit=unit)
    pc.update(privacy or {"target_epsilon": 3.0})
    return task_pb2.TaskSpec(family="text-classification", architecture="transformer", dataset="notes",
                             rounds=task_pb2.RoundConfig(num_rounds=2), privacy=task_pb2.PrivacyConfig(**pc))


def test_group_field_is_a_dataset_setting_and_a_patient_task_needs_it(tmp_path):
    plain = _config(tmp_path)
    grouped = _config(tmp_path, group_field="patient_id")
    assert plain.datasets["notes"].group_field is None and grouped.datasets["notes"].group_field == "patient_id"
    reason = plain.policy.refusal(_spec(), plain.datasets)
    assert reason and "group_field under [datasets.notes]" in reason and 'unit "example"' in reason
    assert grouped.policy.refusal(_spec(), grouped.datasets) is None
    assert plain.policy.refusal(_spec(unit="example"), plain.datasets) is None
    with pytest.raises(ConfigError, match="group_field must name the column"):
        _config(tmp_path, group_field="")
    with pytest.raises(ConfigError, match="CoNLL has no patient id column"):
        _config(tmp_path, group_field="patient_id", format="conll")


def test_patient_ids_line_up_with_the_rows(tmp_path):
    jsonl = tmp_path / "notes.jsonl"
    jsonl.write_text('{"text": "a", "label": "x", "pid": "p1"}\n\n{"text": "b", "label": "y", "pid": 7}\n'
                     '{"text": "c", "label": "x", "pid": "7"}\n')
    assert read_patient_ids(jsonl, group_field="pid") == ["p1", "7", "7"]  # blank line skipped; 7 == "7"
    csv = tmp_path / "notes.csv"
    csv.write_text("text,label,pid\na,x,p1\n,,\nb,y,p2\n")
    assert read_patient_ids(csv, group_field="pid") == ["p1", "p2"]
    assert patient_ids_for(jsonl, group_field="pid", format=None, rows=3) == ["p1", "7", "7"]
    with pytest.raises(DatasetError, match="patient ids for 4 examples"):
        patient_ids_for(jsonl, group_field="pid", format=None, rows=4)


def test_a_row_without_a_patient_id_names_the_rule_and_row_never_the_data(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text('{"text": "SECRET-1", "label": "x", "pid": "p1"}\n{"text": "SECRET-2", "label": "x"}\n')
    with pytest.raises(DatasetError) as exc:
        read_patient_ids(path, group_field="pid")
    assert exc.value.row == 2 and exc.value.public == "row 2: " + exc.value.rule
    assert "SECRET" not in str(exc.value) and "patient id" in exc.value.rule
    csv = tmp_path / "notes.csv"
    csv.write_text("text,label\na,x\n")
    with pytest.raises(DatasetError, match="no patient id column 'pid'"):
        read_patient_ids(csv, group_field="pid")


def test_the_ledger_charges_patients_with_q_over_patients(tmp_path):
    """200 rows of 40 patients, batch 10, sigma 1: a per-patient task runs q = 10/40 = 0.25, 4 steps a round (one
    expected pass over the patients); the charge is that mechanism's epsilon, not the rows' (q 0.05, 20 steps),
    and the ledger and the DpReport say "patient"."""
    site = SitePrivacy(tmp_path / "ledger.sqlite", {})
    site.ledger.set_budget("notes", 100.0, 1e-3)
    spec = _spec(noise_multiplier=1.0)
    private = site.admit("t-patients", spec, 200, batch_size=10, local_epochs=1, num_patients=40)
    assert (private.unit, private.plan.sample_rate, private.plan.steps_per_round) == ("patient", 0.25, 4)
    report = site.charge("t-patients", spec, 1, private)
    assert report.unit == "patient"
    assert report.epsilon == pytest.approx(epsilon_of([(1.0, 0.25, 4)], 1e-5))
    assert report.epsilon != pytest.approx(epsilon_of([(1.0, 0.05, 20)], 1e-5))
    rows = _spec(unit="", noise_multiplier=1.0)
    row_plan = site.admit("t-rows", rows, 200, batch_size=10, local_epochs=1, num_patients=40)
    assert (row_plan.unit, row_plan.plan.sample_rate) == ("example", 0.05)  # the task asks for rows: rows it is
    assert site.charge("t-rows", rows, 1, row_plan).unit == "example"
    [spend] = site.ledger.status()
    assert {t.task_id: t.unit for t in spend.tasks} == {"t-patients": "patient", "t-rows": "example"}
    state = json.loads(site.ledger.accountant_state("notes", "t-patients"))
    assert state["unit"] == "patient" and state["history"] == [[1.0, 0.25, 4]]


def test_a_patient_task_on_a_dataset_without_patients_is_refused_at_admission(tmp_path):
    site = SitePrivacy(tmp_path / "ledger.sqlite", {})
    site.ledger.set_budget("notes", 100.0, 1e-3)
    with pytest.raises(ConfigError, match="declares no patient id column"):
        site.admit("t", _spec(), 200, batch_size=10, local_epochs=1, num_patients=None)
    assert site.ledger.status()[0].tasks == ()  # nothing reserved


def test_tasks_show_plans_a_patient_task_over_patients(tmp_path):
    """What the site admin reviews before approving (`hospital-agent tasks show`) is the plan the agent admits."""
    from hospital_agent.tasks_cli import _planned_epsilon

    rows = "".join(json.dumps({"text": f"note {i}", "label": "a", "pid": f"p{i % 5}"}) + "\n" for i in range(20))
    (tmp_path / "notes.jsonl").write_text(rows)
    spec = _spec(noise_multiplier=1.0)
    spec.labels.extend(["a", "b"])
    spec.training.batch_size = 2
    grouped = _config(tmp_path, group_field="pid")
    text = _planned_epsilon(grouped, spec)
    assert "on 5 local patients (20 rows)" in text and "sampling rate 0.4000" in text
    assert "declares no group_field" in _planned_epsilon(_config(tmp_path), spec)
    assert "on 20 local examples" in _planned_epsilon(grouped, _with(spec, unit=""))


def _with(spec: task_pb2.TaskSpec, **privacy) -> task_pb2.TaskSpec:
    out = task_pb2.TaskSpec()
    out.CopyFrom(spec)
    for k, v in privacy.items():
        setattr(out.privacy, k, v)
    return out
