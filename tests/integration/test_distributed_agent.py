"""A real agent configured with ``devices = ["cpu", "cpu"]`` trains its round as 2 gloo processes (torch elastic
launch): the update it sends equals the 1-process update of the same round (same seed, same global batch)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.federation.local_federation import SiteSetup
from fedclinic.spec.task import Task

from tests.helpers.distributed import classification_package, full_only, relative_difference
from tests.helpers.federation import run_task
from tests.helpers.replay import replay_site
from tests.helpers.text_models import LABELS, make_examples

# a real agent launching its round on 2 gloo processes (about a minute on 2 cores): `make test-distributed`;
# `make test` runs the same 2-process round without the agent (tests/unit/federation/test_distributed_round.py)
pytestmark = [pytest.mark.integration, full_only]


def test_agent_with_two_cpu_devices_sends_the_one_process_update(tmp_path):
    rows = make_examples(19, seed=11)  # 19 rows in batches of 4: an uneven last global batch
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    site = SiteSetup("site-a", datasets={"notes": {"path": str(path), "format": "jsonl"}},
                     extra={"devices": ["cpu", "cpu"], "torch_threads": 2, "distributed_timeout": 120})
    task = Task(name="ddp-it", dataset="notes", labels=LABELS, architecture="transformer", num_rounds=1, min_sites=1,
                local_epochs=2, batch_size=4, learning_rate=0.05, optimizer="sgd", max_length=16, round_timeout_s=240,
                on_quorum_miss="fail")
    # SGD: BERT's attention key biases have an analytically zero gradient, whose float noise AdamW would normalise
    # into full-size steps (as in tests/integration/test_ner_federation.py); SGD keeps noise at its own scale
    start = classification_package()
    final, round1 = run_task(tmp_path / "fed", [site], task, start)
    expected, n = replay_site(start, rows, final.spec, site="site-a", rnd=1)  # 1 process, the same round
    assert n == 19 and final.rounds[0].reports[0].num_samples == 19
    # FedAvg of one site is the start plus its update (float32): compare with the start plus the 1-process update,
    # relative to that update (subtracting the start again would add float32 rounding of the weights themselves)
    error = {k: round1.tensors[k] - (start.tensors[k] + expected[k]) for k in expected}
    assert relative_difference(expected, {k: expected[k] + error[k] for k in expected}) <= 1e-5
    assert any(np.abs(d).max() > 0 for d in expected.values())
    log = (tmp_path / "fed" / "logs" / "agent-site-a.log").read_text(errors="replace")
    assert '"training on several devices"' in log and "training in one process" not in log
