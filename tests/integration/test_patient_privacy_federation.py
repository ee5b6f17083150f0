"""Per-patient DP over the real services: a task with privacy.unit = "patient" is declined, with the reason, by a
site whose dataset declares no patient id column, and trained by one that does, which charges its ledger in
patients (q over patients) and reports the unit."""

from __future__ import annotations

import json

import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import LocalFederation, SiteSetup, wait_until
from fedclinic.privacy.accounting import epsilon_of
from fedclinic.spec.task import Task
from hospital_agent.privacy_ledger import PrivacyLedger

from tests.helpers.federation import streams_open
from tests.helpers.text_models import LABELS, tiny_package, write_site_data

pytestmark = pytest.mark.integration

ROWS, ROWS_PER_PATIENT = 24, 3


def _site(tmp_path, name: str, grouped: bool) -> SiteSetup:
    path = write_site_data(tmp_path / "data" / name, ROWS, seed=len(name))
    if grouped:  # each patient has 3 rows, interleaved through the file
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        patients = ROWS // ROWS_PER_PATIENT
        path.write_text("".join(json.dumps({**r, "patient_id": f"p{i % patients}"}) + "\n" for i, r in enumerate(rows)))
    dataset = {"path": str(path), "format": "jsonl", "privacy_epsilon": 50.0, "privacy_delta": 1e-4}
    if grouped:
        dataset["group_field"] = "patient_id"
    return SiteSetup(name, datasets={"notes": dataset})


def test_a_patient_level_task_is_charged_in_patients_and_declined_without_patient_ids(tmp_path):
    sites = [_site(tmp_path, "site-a", grouped=True), _site(tmp_path, "site-b", grouped=False)]
    task = Task(name="dp-patients", dataset="notes", labels=LABELS, architecture="transformer", num_rounds=1,
                min_sites=1, sites=["site-a", "site-b"], local_epochs=1, batch_size=2, learning_rate=0.05,
                optimizer="sgd", max_length=16, round_timeout_s=180, on_quorum_miss="fail",
                privacy={"level": "sample", "unit": "patient", "noise_multiplier": 1.0, "target_delta": 1e-5,
                         "max_grad_norm": 1.0})
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        # both sites in the round: a site that connects after round 1 opened would not be asked (min_sites = 1)
        wait_until(lambda: streams_open(fed) >= {"site-a", "site-b"}, 60, "both agents' work streams")
        with fed.client() as client:
            st = client.submit(task, package=tiny_package("transformer"))
            final = client.wait(st.task_id, timeout=300, progress=False)
            folder = client.download(st.task_id, tmp_path / "final-model")
    assert state_name(final.state) == "completed", final.error
    refusal = [d for d in final.rounds[0].declined if d.startswith("site-b")]
    assert refusal and 'privacy.unit = "patient"' in refusal[0] and "group_field" in refusal[0]
    [b] = PrivacyLedger(tmp_path / "fed" / "agent-site-b" / "privacy-ledger.sqlite").status()
    assert b.tasks == ()  # nothing reserved or spent at the site that declined

    # site-a: 8 patients, 2 expected per step -> q = 0.25 and 4 steps (one pass over the patients), not the rows'
    # q = 2/24 and 12 steps
    [a] = PrivacyLedger(tmp_path / "fed" / "agent-site-a" / "privacy-ledger.sqlite").status()
    [spend] = a.tasks
    assert spend.unit == "patient" and spend.rounds_charged == 1
    want = epsilon_of([(1.0, 0.25, 4)], 1e-5)
    assert spend.spent_epsilon == pytest.approx(want)
    assert spend.spent_epsilon != pytest.approx(epsilon_of([(1.0, 2 / 24, 12)], 1e-5))
    [report] = final.rounds[0].reports
    assert report.site_id == "site-a" and report.metrics["dp_epsilon"] == pytest.approx(want)
    card = json.loads((folder / "model_card.json").read_text())
    assert card["privacy"]["unit"] == "patient"
    assert any(n.startswith("privacy unit: one patient") for n in card["notes"])
