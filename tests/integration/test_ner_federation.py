"""An NER (token-classification + CRF) task runs across real agent processes: one site holds CoNLL, the others
JSONL spans; the final weights equal the FedAvg of what the sites computed, and entity metrics reach the SDK."""

from __future__ import annotations

import numpy as np
import pytest

from fedclinic.federation.local_federation import SiteSetup
from fedclinic.spec.task import Task

from tests.helpers.federation import run_task
from tests.helpers.ner_models import LABELS, NER_POLICY, make_examples, package, write_jsonl
from tests.helpers.replay import replay_site_delta

pytestmark = pytest.mark.integration


def _write_conll(path, examples) -> None:
    """One token per line (texts are single-space separated words), BIO tags."""
    lines = []
    for e in examples:
        pos = 0
        for word in e.text.split(" "):
            start, end = pos, pos + len(word)
            tag = "O"
            for s in e.entities:
                if s.start <= start and end <= s.end:
                    tag = ("B-" if start == s.start else "I-") + s.label
            lines.append(f"{word}\t{tag}")
            pos = end + 1
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def test_ner_task_trains_across_agents_with_conll_and_jsonl_sites(tmp_path):
    site_examples = {f"site-{c}": make_examples(n, seed=20 + i) for i, (c, n) in enumerate(zip("abc", (16, 20, 24)))}
    eval_examples = make_examples(12, seed=77)
    sites = []
    for i, (name, examples) in enumerate(site_examples.items()):
        folder = tmp_path / "data" / name
        folder.mkdir(parents=True)
        train = folder / ("train.conll" if i == 0 else "train.jsonl")
        (_write_conll if i == 0 else write_jsonl)(train, examples)
        write_jsonl(folder / "eval.jsonl", eval_examples)
        sites.append(SiteSetup(name, datasets={"ner": {"path": str(train), "eval_path": str(folder / "eval.jsonl")}},
                               policy=NER_POLICY))
    task = Task(name="ner-it", family="token-classification", architecture="transformer-crf", dataset="ner",
                labels=LABELS, num_rounds=2, min_sites=3, local_epochs=2, batch_size=8, learning_rate=5e-3,
                optimizer="adamw", max_length=32, round_timeout_s=180, on_quorum_miss="fail")
    start = package("transformer-crf")
    final, round1 = run_task(tmp_path / "fed", sites, task, start)
    # every site evaluated the global model on its held-out split: entity metrics arrive in the round summary
    for r in final.rounds:
        assert {"eval_strict_f1", "eval_relaxed_f1", "eval_token_accuracy"} <= set(r.metrics), dict(r.metrics)
        assert all(0.0 <= r.metrics[k] <= 1.0 for k in ("eval_strict_f1", "eval_relaxed_f1", "eval_token_accuracy"))
    # round 2's sites evaluated round 1's global model: their mean equals evaluating it here on the same split
    from fedclinic.training import trainer as training
    from fedclinic.models import build_model

    model = build_model(round1)
    here = training.evaluate(model, training.encode(eval_examples, model))
    assert final.rounds[1].metrics["eval_strict_f1"] == pytest.approx(here["strict_f1"], abs=1e-9)
    # the CoNLL site read the same examples as its JSONL twin would: FedAvg of the replayed deltas matches
    deltas = [replay_site_delta(start, ex, final.spec, site=site) for site, ex in site_examples.items()]
    total = sum(n for _, n in deltas)
    for name, base in start.tensors.items():
        expected = base + sum(n * d[name] for d, n in deltas) / total
        # an attention key bias has an analytically zero gradient (softmax is shift-invariant), so AdamW's
        # normalised steps there act on float noise: equal only to that noise's scale
        atol = 1e-5 if name.endswith("attention.self.key.bias") else 1e-6
        np.testing.assert_allclose(round1.tensors[name], expected, rtol=1e-4, atol=atol, err_msg=name)
    assert sorted(r.num_samples for r in final.rounds[0].reports) == [16, 20, 24]
