"""DP-SGD over LoRA adapters on the real services: two sites train one round of a LoRA text task with ``privacy.level =
"sample"`` (ghost clipping of the adapters and the head), charge their ledgers and report epsilon; only the
adapters and the head travel."""

from __future__ import annotations

import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import LocalFederation, SiteSetup
from fedclinic.models import lora
from fedclinic.spec.task import Task
from hospital_agent.privacy_ledger import PrivacyLedger

from tests.helpers.federation import stored_update_tensors
from tests.helpers.text_models import LABELS, tiny_package, write_site_data

pytestmark = pytest.mark.integration


def test_a_private_lora_task_runs_at_both_sites_and_reports_epsilon(tmp_path):
    sites = []
    for i, name in enumerate(("site-a", "site-b")):
        path = write_site_data(tmp_path / "data" / name, 16, seed=i)
        sites.append(SiteSetup(name, datasets={"notes": {"path": str(path), "format": "jsonl",
                                                         "privacy_epsilon": 10.0, "privacy_delta": 1e-4}}))
    package = lora.add_adapters(tiny_package("transformer"), lora.LoraSpec(rank=2, alpha=4.0))
    task = Task(name="dp-lora", dataset="notes", labels=LABELS, architecture="transformer", num_rounds=1,
                min_sites=2, local_epochs=1, batch_size=8, learning_rate=0.05, optimizer="sgd", max_length=16,
                round_timeout_s=180, on_quorum_miss="fail", trainable=lora.trainable_patterns(),
                privacy={"level": "sample", "target_epsilon": 4.0, "target_delta": 1e-5, "max_grad_norm": 1.0})
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            st = client.submit(task, package=package)
            final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        sent = stored_update_tensors(fed, st.task_id)
    assert 0 < final.rounds[0].metrics["dp_epsilon"] <= 4.0 + 1e-6
    assert sorted(r.site_id for r in final.rounds[0].reports) == ["site-a", "site-b"]
    for report in final.rounds[0].reports:
        assert 0 < report.metrics["dp_epsilon"] <= 4.0 + 1e-6
    adapters = {n for n in package.tensors if lora.is_adapter(n)}
    for names in sent.values():  # every update carries the adapters and the head, never an encoder weight
        assert adapters <= names and all(lora.is_adapter(n) or n.startswith("classifier.") for n in names)
    for site in ("site-a", "site-b"):
        [spend] = PrivacyLedger(tmp_path / "fed" / f"agent-{site}" / "privacy-ledger.sqlite").status()
        assert spend.tasks[0].rounds_charged == 1 and spend.spent_epsilon > 0
