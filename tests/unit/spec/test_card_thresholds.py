"""Per-label thresholds in the model card (fedclinic.spec.card_thresholds) and how the CLI shows multi-label rounds."""

from __future__ import annotations

import json

import pytest

from fedclinic.errors import ConfigError
from fedclinic.evaluation.thresholds import set_card_thresholds, write_model_thresholds
from fedclinic.proto import control_pb2, task_pb2
from fedclinic.spec.card_thresholds import card_thresholds
from fedclinic.spec.model_card import build_card, read_card, render_markdown, write_card

from tests.helpers.multilabel_models import LABELS


def _package(multi_label: bool = True):
    from fedclinic.models import package_from_config
    from tests.helpers.text_models import tiny_tokenizer_json

    return package_from_config(architecture="logreg", labels=LABELS, tokenizer_json=tiny_tokenizer_json(), config={},
                               multi_label=multi_label, max_length=16)


def _status(metrics: dict[str, float]) -> control_pb2.TaskStatus:
    spec = task_pb2.TaskSpec(name="ml", family="text-classification", labels=LABELS, multi_label=True,
                             training=task_pb2.TrainingConfig(pos_weight=[1.0, 1.0, 30.0],
                                                              pos_weight_source="from-statistics:s1"))
    r = control_pb2.RoundSummary(round=1, state=control_pb2.ROUND_STATE_CLOSED, metrics=metrics,
                                 reports=[control_pb2.SiteReport(site_id="north", num_samples=10)])
    return control_pb2.TaskStatus(task_id="t1", spec=spec, rounds=[r])


def test_the_card_carries_thresholds_and_per_label_figures(tmp_path):
    pkg = _package()
    folder = pkg.save(tmp_path / "model")
    metrics = {"eval_macro_f1": 0.6, "eval_macro_auc": 0.9, "eval_f1/seizure": 0.0, "eval_auc/seizure": 0.97,
               "eval_f1/cardio": 0.99, "eval_auc/cardio": 1.0, "eval_f1/neuro": 0.98, "eval_auc/neuro": 1.0}
    card = build_card(pkg.meta, model_hash=pkg.manifest().model_hash, status=_status(metrics))
    assert card["training"]["pos_weight"] == [1.0, 1.0, 30.0]
    assert card["training"]["pos_weight_source"] == "from-statistics:s1"
    write_card(folder, card)
    assert card_thresholds(read_card(folder)) is None
    md = render_markdown(card)
    assert "Every label is predicted at probability >= 0.5" in md and "| seizure | 0.5 | 0 | 0.97 |" in md
    assert "eval_f1/seizure" not in md  # per-label figures are in their own table, not a column each

    # by hand (a mapping), from a file (a list in label order), tuned from pooled histograms
    card = set_card_thresholds(folder, {"cardio": 0.5, "neuro": 0.5, "seizure": 0.05}, source="me")
    assert card["thresholds"] == {"rule": "probability >= threshold", "values": {"cardio": 0.5, "neuro": 0.5,
                                  "seizure": 0.05}, "tuned_on": None, "source": "me"}
    assert "| seizure | 0.05 | 0 | 0.97 |" in (folder / "MODEL_CARD.md").read_text()
    (tmp_path / "t.json").write_text(json.dumps([0.4, 0.6, 0.1]))
    assert write_model_thresholds(folder, str(tmp_path / "t.json")) == [0.4, 0.6, 0.1]
    assert read_card(folder)["thresholds"]["source"] == str(tmp_path / "t.json")
    pooled = {"count/thr/2/10/pos": 2.0, "count/thr/2/3/neg": 8.0, "count/thr/0/30/pos": 10.0,
              "count/thr/1/30/neg": 10.0, "count/thr/0/30/neg": 0.0}
    tuned = write_model_thresholds(folder, "tuned", status=pooled)
    assert tuned[2] < 0.5 and read_card(folder)["thresholds"]["tuned_on"] == {"rows": 10, "sites": ["north"],
                                                                               "bins": 50}
    assert "tuned for F1 on 10 validation rows of 1 site(s) (north)" in (folder / "MODEL_CARD.md").read_text()
    for bad in ([0.5, 0.5], {"cardio": 0.5}, [0.5, 0.5, 1.5]):
        with pytest.raises(ConfigError):
            set_card_thresholds(folder, bad, source="x")
    with pytest.raises(ConfigError, match="no threshold histograms"):
        write_model_thresholds(folder, "tuned", status={"macro_f1": 0.3})
    single = _package(multi_label=False).save(tmp_path / "single")
    with pytest.raises(ConfigError, match="not multi-label"):
        set_card_thresholds(single, [0.5, 0.5, 0.5], source="x")


def test_rounds_show_macro_f1_and_macro_auc_not_exact_match(capsys):
    from fedclinic.cli import _print_status
    from fedclinic.client import _headline

    metrics = {"eval_exact_match": 0.0, "eval_macro_f1": 0.077, "eval_macro_auc": 0.81, "eval_f1/seizure": 0.0,
               "eval_auc/seizure": 0.9}
    assert _headline(metrics) == " site-eval macro-F1 0.077 macro-AUC 0.810"
    _print_status(_status(metrics), False)
    out = capsys.readouterr().out
    assert "eval_exact_match=0 eval_macro_auc=0.81 eval_macro_f1=0.077 (+2 per-label: --json)" in out
    assert "(+2 per-label: --json)" in out and "eval_f1/seizure" not in out
