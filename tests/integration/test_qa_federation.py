"""A question-answering (causal LM) task runs across real agent processes: the sites read JSONL question/answer
files (one with its own field names), the final weights equal the FedAvg of what the sites computed, and the
generation metrics of every site's held-out split reach the SDK in the round summaries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.data.qa import QAExample
from fedclinic.federation.local_federation import SiteSetup
from fedclinic.spec.task import Task

from tests.helpers.qa_models import package, toy_examples

from tests.helpers.federation import run_task
from tests.helpers.replay import replay_site_delta

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("torch_one_thread")]

# the toy held-out split has fewer rows than the default min_cell_rows (10): the sites show their evaluations anyway
QA_POLICY = {"allowed_families": ["question-answering"], "allowed_datasets": ["qa"], "min_cell_rows": 1}


def _write(path, examples, q="question", a="answer") -> None:
    path.write_text("".join(json.dumps({q: e.question, a: e.answer}) + "\n" for e in examples))


def test_qa_task_trains_across_agents_and_reports_generation_metrics(tmp_path):
    toy = toy_examples()
    site_examples = {"site-a": toy[:3] * 2 + [QAExample("what is the drug for headache", "drug aspirin")],
                     "site-b": toy[3:] * 3}
    sites = []
    for i, (name, examples) in enumerate(site_examples.items()):
        folder = tmp_path / "data" / name
        folder.mkdir(parents=True)
        fields = {"q": "prompt", "a": "reply"} if i else {}
        _write(folder / "train.jsonl", examples, **fields)
        _write(folder / "eval.jsonl", toy, **fields)
        entry = {"path": str(folder / "train.jsonl"), "eval_path": str(folder / "eval.jsonl")}
        if i:
            entry.update(question_field="prompt", answer_field="reply")
        sites.append(SiteSetup(name, datasets={"qa": entry}, policy=QA_POLICY))
    task = Task(name="qa-it", family="question-answering", architecture="causal-lm", dataset="qa",
                num_rounds=2, min_sites=2, local_epochs=10, batch_size=4, learning_rate=5e-3, max_length=32,
                round_timeout_s=180, on_quorum_miss="fail")
    start = package()
    final, round1 = run_task(tmp_path / "fed", sites, task, start)
    # every site evaluated the global model on its held-out split by generating answers
    keys = ("eval_rougeL", "eval_bleu", "eval_meteor", "eval_exact_match", "eval_token_accuracy")
    for r in final.rounds:
        assert set(keys) <= set(r.metrics), dict(r.metrics)
        assert all(0.0 <= r.metrics[k] <= 1.0 for k in keys)
        assert r.metrics["eval_n_generated"] == len(toy)
    # round 2's sites evaluated round 1's global model: their mean equals evaluating it here on the same split
    from fedclinic.training import trainer as training
    from fedclinic.models import build_model

    model = build_model(round1)
    here = training.evaluate(model, training.encode(toy, model, max_length=32))
    for key in ("rougeL", "meteor", "loss"):
        assert final.rounds[1].metrics[f"eval_{key}"] == pytest.approx(here[key], abs=1e-6)
    # FedAvg of the replayed site deltas (n-weighted) is round 1's model
    deltas = [replay_site_delta(start, ex, final.spec, site=site) for site, ex in site_examples.items()]
    total = sum(n for _, n in deltas)
    assert "lm_head.weight" not in round1.tensors  # the tied head never travels
    n_embd = 32
    for name, base in start.tensors.items():
        expected = base + sum(n * d[name] for d, n in deltas) / total
        atol = np.full(base.shape, 1e-6, dtype=np.float64)
        if name.endswith("attn.c_attn.bias"):
            # GPT-2's fused q|k|v bias: the key part has an analytically zero gradient (softmax is shift-invariant),
            # so AdamW's normalised steps there act on float noise: equal only to that noise's scale
            atol[n_embd:2 * n_embd] = 1e-4
        np.testing.assert_array_less(np.abs(round1.tensors[name] - expected), atol + 1e-4 * np.abs(expected),
                                     err_msg=name)
    assert sorted(r.num_samples for r in final.rounds[0].reports) == [7, 9]
