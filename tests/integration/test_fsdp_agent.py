"""A real agent configured with ``devices = ["cpu", "cpu"]`` and ``sharding = "fsdp"`` trains a question-answering
round on a Llama-shaped causal LM as 2 gloo processes holding half the model each: the update it sends equals the
1-process update of the same round (same seed, same global batch). One 2-process launch: `make test-distributed`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.federation.local_federation import SiteSetup
from fedclinic.spec.task import Task

from tests.helpers.distributed import full_only, relative_difference
from tests.helpers.federation import run_task
from tests.helpers.qa_models import TINY_LLAMA, package, toy_examples
from tests.helpers.replay import replay_site_delta

pytestmark = [pytest.mark.integration, full_only]


def test_agent_with_fsdp_sharding_sends_the_one_process_update(tmp_path):
    examples = toy_examples() + toy_examples()[:3]  # 9 rows in batches of 4: an uneven last global batch
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": e.question, "answer": e.answer}) + "\n" for e in examples))
    site = SiteSetup("site-a", datasets={"qa": {"path": str(path)}},
                     policy={"allowed_families": ["question-answering"], "allowed_datasets": ["qa"],
                             "min_cell_rows": 1},
                     extra={"devices": ["cpu", "cpu"], "sharding": "fsdp", "torch_threads": 2,
                            "distributed_timeout": 120})
    task = Task(name="fsdp-it", family="question-answering", architecture="causal-lm", dataset="qa", num_rounds=1,
                min_sites=1, local_epochs=2, batch_size=4, learning_rate=5e-3, max_length=32, round_timeout_s=240,
                on_quorum_miss="fail")
    start = package(config=TINY_LLAMA)
    final, round1 = run_task(tmp_path / "fed", [site], task, start)
    expected, n = replay_site_delta(start, examples, final.spec, site="site-a")  # 1 process, the same round
    assert n == 9 and final.rounds[0].reports[0].num_samples == 9
    # as in test_distributed_agent: compare start + update with start + the 1-process update, relative to the update
    error = {k: round1.tensors[k] - (start.tensors[k] + expected[k]) for k in expected}
    assert relative_difference(expected, {k: expected[k] + error[k] for k in expected}) <= 1e-5
    assert any(np.abs(d).max() > 0 for d in expected.values())
    log = (tmp_path / "fed" / "logs" / "agent-site-a.log").read_text(errors="replace")
    assert '"training on several devices"' in log and '"sharding": "fsdp"' in log
    assert "without sharding" not in log and "training in one process" not in log
