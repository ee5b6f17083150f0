"""The model card: built from a hand-made TaskStatus, rendered as Markdown, and with pieces missing."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from fedclinic import __version__
from fedclinic.errors import ConfigError
from fedclinic.spec.model_card import (EVAL_NOTE, add_export, build_card, card_for_bundle, card_summary, read_card,
                                  render_markdown, write_card)
from fedclinic.transport.package import ModelPackage
from fedclinic.proto import control_pb2, task_pb2

NOW = datetime(2025, 3, 1, 12, 30, tzinfo=timezone.utc)
META = {"format": 1, "family": "text-classification", "architecture": "transformer", "labels": ["Acne", "Pain"],
        "multi_label": False, "max_length": 96, "base_model": "minilm-l6", "arch_config": {"model_type": "bert"}}
NER_META = {"format": 1, "family": "token-classification", "architecture": "transformer-crf",
            "labels": ["DRUG"], "scheme": "BIOES", "tags": ["O", "B-DRUG", "I-DRUG", "E-DRUG", "S-DRUG"],
            "max_length": 64, "base_model": "from-config", "arch_config": {"model_type": "bert"}}


def _report(site: str, n: int, loss: float) -> control_pb2.SiteReport:
    return control_pb2.SiteReport(site_id=site, num_samples=n, uplink_bytes=100, metrics={"train_loss": loss})


def _status(**spec_kw) -> control_pb2.TaskStatus:
    spec = task_pb2.TaskSpec(
        name="cc", family="text-classification", architecture="transformer", dataset="drugreviews",
        labels=["Acne", "Pain"], description="conditions from reviews",
        training=task_pb2.TrainingConfig(local_epochs=1, batch_size=16, learning_rate=2e-4, optimizer="adamw",
                                         max_length=96, seed=7),
        rounds=task_pb2.RoundConfig(num_rounds=3, min_sites=2, participation_fraction=1.0, round_timeout_s=600,
                                    on_quorum_miss=task_pb2.QUORUM_POLICY_RETRY, max_round_retries=2),
        strategy="fedatt", strategy_params={"server_lr": 1.5}, strategy_options={"granularity": "whole_model"},
        update=task_pb2.UpdateConfig(trainable_patterns=[r"classifier\..*"]), **spec_kw)
    closed = control_pb2.ROUND_STATE_CLOSED
    rounds = [
        control_pb2.RoundSummary(round=1, state=closed, attempt=1, reports=[_report("site-a", 30, 0.9),
                                                                            _report("site-b", 10, 1.1)],
                                 metrics={"train_loss": 0.95, "eval_accuracy": 0.5}, uplink_bytes=200,
                                 downlink_bytes=5000, closed_unix_ms=1_700_000_000_000, model_hash="h1"),
        control_pb2.RoundSummary(round=2, state=closed, attempt=2, reports=[_report("site-b", 10, 0.7),
                                                                            _report("site-c", 20, 0.6)],
                                 metrics={"train_loss": 0.633, "eval_accuracy": 0.75, "eval_macro_f1": 0.7},
                                 uplink_bytes=200, downlink_bytes=3000, closed_unix_ms=1_700_000_100_000,
                                 model_hash="h2"),
        control_pb2.RoundSummary(round=3, state=control_pb2.ROUND_STATE_OPEN, attempt=1),
    ]
    return control_pb2.TaskStatus(task_id="t-abc", spec=spec, state=control_pb2.TASK_STATE_RUNNING, owner="alice",
                                  rounds=rounds, created_unix_ms=1_699_999_000_000, initial_model_hash="h0")


def test_card_from_a_task_status():
    card = build_card(META, model_hash="h2", status=_status(), requested_round=0, now=NOW)
    assert card["schema_version"] == 1 and card["created"] == "2025-03-01T12:30:00Z"
    assert card["fedclinic_version"] == __version__ and card["model_hash"] == "h2"
    assert (card["family"], card["architecture"], card["labels"], card["base_model"]) == \
        ("text-classification", "transformer", ["Acne", "Pain"], "minilm-l6")
    assert card["label_map"] == "fedclinic_model.json" and "tags" not in card
    assert card["task"] == {"id": "t-abc", "name": "cc", "description": "conditions from reviews", "state": "running",
                            "owner": "alice", "dataset": "drugreviews", "submitted": "2023-11-14T21:56:40Z"}
    assert card["strategy"] == {"name": "fedatt", "params": {"server_lr": 1.5, "granularity": "whole_model"}}
    assert card["training"]["learning_rate"] == 2e-4 and card["training"]["seed"] == 7
    assert card["round_config"]["on_quorum_miss"] == "retry" and card["round_config"]["num_rounds"] == 3
    assert card["update"]["trainable"] == [r"classifier\..*"]
    # the open round 3 has not made this model; the sites are those of the closed rounds
    assert card["rounds_completed"] == 2 and card["model_round"] == 2 and card["is_final"] is False
    assert card["sites"] == ["site-a", "site-b", "site-c"] and card["num_sites"] == 3
    assert [r["round"] for r in card["rounds"]] == [1, 2]
    assert card["rounds"][1] == {"round": 2, "attempt": 2, "sites": ["site-b", "site-c"], "num_samples": 30,
                                 "metrics": {"eval_accuracy": 0.75, "eval_macro_f1": 0.7, "train_loss": 0.633},
                                 "uplink_bytes": 200, "downlink_bytes": 3000, "downlink_wire_bytes": 0,
                                 "site_bytes": {s: {"uplink": 100, "uplink_wire": 0, "downlink": 0, "downlink_wire": 0}
                                                for s in ("site-b", "site-c")},
                                 "model_hash": "h2", "closed": "2023-11-14T22:15:00Z"}
    assert card["final_round_metrics"] == {"eval_accuracy": 0.75, "eval_macro_f1": 0.7, "train_loss": 0.633}
    assert "privacy" not in card and "secure_aggregation" not in card and "export" not in card
    assert EVAL_NOTE in card["notes"]
    json.dumps(card, allow_nan=False)  # strict JSON


def test_a_round_model_and_the_initial_model_get_only_their_own_history():
    status = _status()
    round1 = build_card(META, model_hash="h1", status=status, requested_round=1)
    assert round1["rounds_completed"] == 1 and round1["sites"] == ["site-a", "site-b"]
    assert round1["final_round_metrics"] == {"eval_accuracy": 0.5, "train_loss": 0.95} and round1["model_round"] == 1
    initial = build_card(META, model_hash="h0", status=status, requested_round=-1)
    assert initial["rounds_completed"] == 0 and initial["rounds"] == [] and initial["num_sites"] == 0
    assert initial["model_round"] == 0 and initial["final_round_metrics"] == {}
    # round 0 ("the latest") is matched by hash: a model from round 1 is not credited with round 2
    assert build_card(META, model_hash="h1", status=status, requested_round=0)["rounds_completed"] == 1
    odd = build_card(META, model_hash="zz", status=status, requested_round=2)
    assert any("differs from the one round 2 recorded" in n for n in odd["notes"])


def test_privacy_sections_only_when_set_and_non_finite_metrics_become_null():
    status = _status(privacy=task_pb2.PrivacyConfig(level="client", target_epsilon=3.0, target_delta=1e-5,
                                                    max_grad_norm=1.0, noise_multiplier=0.8, accountant="rdp"),
                     secure_aggregation=task_pb2.SecureAggregationConfig(enabled=True, threshold=2, min_cohort=3))
    status.rounds[1].metrics["eval_loss"] = float("nan")
    card = build_card(META, model_hash="h2", status=status)
    asked = {"level": "client", "target_epsilon": 3.0, "target_delta": 1e-5, "max_grad_norm": 1.0,
             "noise_multiplier": 0.8, "accountant": "rdp"}
    assert {k: card["privacy"][k] for k in asked} == asked
    # every other PrivacyConfig field appears with its (default) value: the sampling settings of DP-SGD
    assert {k: card["privacy"][k] for k in ("logical_batch_size", "steps_per_round", "sample_rate")} == {
        "logical_batch_size": 0, "steps_per_round": 0, "sample_rate": 0.0}
    assert card["secure_aggregation"] == {"enabled": True, "threshold": 2, "min_cohort": 3, "clip": 1.0, "bits": 20,
                                          "rounding": "stochastic", "degree": 0, "weighting": "samples",
                                          "weight_cap": 65536, "metric_clip": 100.0}  # what ran: defaults filled in
    assert card["final_round_metrics"]["eval_loss"] is None
    json.dumps(card, allow_nan=False)
    md = render_markdown(card)
    assert "target_epsilon | 3" in md and "min_cohort | 3" in md and "No differential privacy" not in md
    # a spec with empty privacy messages (level "", enabled false) writes neither section
    empty = _status(privacy=task_pb2.PrivacyConfig(), secure_aggregation=task_pb2.SecureAggregationConfig())
    assert not {"privacy", "secure_aggregation"} & set(build_card(META, model_hash="h2", status=empty))


def test_markdown_holds_the_key_facts():
    md = render_markdown(build_card(META, model_hash="h2", status=_status(), now=NOW))
    assert md.startswith("# Model card: cc\n")
    for fact in ("transformer", "minilm-l6", "Acne, Pain", "`h2`", "t-abc", "drugreviews",
                 "fedatt (granularity=whole_model, server_lr=1.5)", "2 of 3", "3: site-a, site-b, site-c",
                 "| round | sites | samples | eval_accuracy | eval_macro_f1 | train_loss | uplink bytes | "
                 "downlink bytes |",
                 "| 2 | 2 | 30 | 0.75 | 0.7 | 0.633 | 200 | 3000 |", "| 1 | 2 | 40 | 0.5 | – | 0.95 | 200 | 5000 |",
                 "No differential privacy and no secure aggregation", EVAL_NOTE, "2025-03-01T12:30:00Z"):
        assert fact in md, fact


def test_without_status_the_card_holds_what_the_package_says():
    card = build_card(NER_META, model_hash="abc123", now=NOW)
    assert card["tag_scheme"] == "BIOES" and card["tags"] == NER_META["tags"] and card["labels"] == ["DRUG"]
    assert card["task"] is None and card["rounds"] is None and card["rounds_completed"] is None
    assert card["num_sites"] is None and card["final_round_metrics"] is None and card["model_round"] is None
    assert any("without the task's status" in n for n in card["notes"])
    md = render_markdown(card)
    assert "Unknown: this card was made without the task's status." in md
    assert "BIOES" in md and "S-DRUG" in md and "## Rounds" not in md
    # nothing at all known still renders
    assert render_markdown(build_card({}, model_hash="")).startswith("# Model card: model")


def test_export_section_and_bundle_card():
    card = build_card(META, model_hash="h2", status=_status())
    report = {"family": "text-classification", "architecture": "transformer", "opset": 18,
              "fp32": {"max_abs_diff": 1e-6, "top1_agreement": 1.0, "tolerance": 1e-4, "inputs": 12,
                       "path_agreement": None},
              "int8": {"max_abs_diff": 0.2, "top1_agreement": 0.98, "tolerance": 1.0, "inputs": 12,
                       "path_agreement": 1.0},
              "files": ["model.onnx", "model.int8.onnx"]}
    out = add_export(card, report, inputs=["input_ids", "attention_mask"], outputs=["logits"])
    assert "export" not in card  # a copy
    ex = out["export"]
    assert ex["opset"] == 18 and ex["fp32"] == {"max_abs_diff": 1e-6, "top1_agreement": 1.0, "tolerance": 1e-4,
                                                "inputs": 12}
    assert ex["int8"]["path_agreement"] == 1.0 and ex["inputs"] == ["input_ids", "attention_mask"]
    assert {"model_card.json", "MODEL_CARD.md", "export_report.json"} <= set(ex["files"])
    md = render_markdown(out)
    assert "## ONNX export" in md and "max abs diff 1e-06 (tolerance 0.0001)" in md and "CRF path agreement 1" in md
    # the bundle keeps the package's card when it describes this package, else starts afresh with a note
    assert card_for_bundle(card, META, model_hash="h2") == card
    fresh = card_for_bundle(card, META, model_hash="other")
    assert fresh["task"] is None and "describes model 'h2'" in fresh["notes"][0]
    assert card_for_bundle(None, META, model_hash="x")["labels"] == ["Acne", "Pain"]
    assert card_summary(out)["num_sites"] == 3 and card_summary(out)["task_id"] == "t-abc"


def test_written_card_round_trips_and_is_not_part_of_the_package(tmp_path):
    import numpy as np

    pkg = ModelPackage({"w": np.ones(3, np.float32)}, {"fedclinic_model.json": json.dumps(META).encode()})
    folder = pkg.save(tmp_path / "m")
    assert read_card(folder) is None
    card = build_card(pkg.meta, model_hash=pkg.manifest().model_hash, status=_status())
    write_card(folder, card)
    assert read_card(folder) == card and (folder / "MODEL_CARD.md").read_text() == render_markdown(card)
    assert ModelPackage.load(folder).manifest().model_hash == card["model_hash"]
    (folder / "model_card.json").write_text("{oops")
    with pytest.raises(ConfigError, match="model_card.json is not valid JSON"):
        read_card(folder)
