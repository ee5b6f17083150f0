"""Multi-label that decides (issue 19, item 4): a rare label that ranks well but never reaches 0.5 is predicted
by a real ``fedclinic serve`` process once the thresholds tuned on the sites' summed histograms travel through the
model card and the signed ONNX bundle; a threshold edited in the signed bundle is refused."""

from __future__ import annotations

import json
import shutil

import pytest

from fedclinic import pki
from fedclinic.evaluation.thresholds import tune_thresholds, write_model_thresholds
from fedclinic.export.bundle_signing import BundleSigning
from fedclinic.export.onnx_export import export_onnx
from fedclinic.serving.bundle import ClassifierBundle
from fedclinic.spec.model_card import build_card, read_card, write_card
from fedclinic.training.trainer import encode, evaluate

from tests.helpers.multilabel_models import LABELS, SITES, rows, trained_model
from tests.helpers.serving import ServeProcesses, call

pytestmark = pytest.mark.integration

RARE_NOTE = "patient reports seizure with migraine"
COMMON_NOTE = "patient reports chest pressure since week"


def test_tuned_thresholds_travel_through_the_signed_bundle_into_serve(tmp_path):
    import grpc

    from fedclinic.proto import inference_pb2, inference_pb2_grpc

    package, model = trained_model()
    # each site evaluates the final model on its own validation rows; only the values leave it, and the pool sums
    # the count/ keys (the contract's rule)
    per_site = {site: evaluate(model, encode(rows(n, 10 + i, rare), model))
                for i, (site, (n, rare)) in enumerate(SITES.items())}
    pooled: dict[str, float] = {}
    for values in per_site.values():
        for key, value in values.items():
            if key.startswith("count/"):
                pooled[key] = pooled.get(key, 0.0) + value
    assert per_site["south"]["auc/seizure"] > 0.95 and per_site["south"]["f1/seizure"] == 0.0  # ranks, never decides
    thresholds = tune_thresholds(pooled, LABELS)
    assert thresholds[2] < 0.5 and thresholds[:2] == [0.5, 0.5]

    # the downloaded model's card gets them (with the rows they were tuned on), export carries them into the bundle
    folder = package.save(tmp_path / "model")
    write_card(folder, build_card(package.meta, model_hash=package.manifest().model_hash))
    assert write_model_thresholds(folder, "tuned", status=pooled, source="test pool") == thresholds
    card = read_card(folder)
    assert card["thresholds"]["values"] == dict(zip(LABELS, thresholds))
    assert card["thresholds"]["tuned_on"]["rows"] == sum(n for n, _ in SITES.values())
    ca = tmp_path / "ca"
    pki.init_ca(ca)
    scientist = pki.issue(ca, role="scientist", name="ml", out_dir=tmp_path / "sci")
    bundle = tmp_path / "bundle"
    export_onnx(folder, bundle, signing=BundleSigning(ca=scientist.ca_path, cert=scientist.cert_path,
                                                      key=scientist.key_path, allow_unsigned=True))
    meta = json.loads((bundle / "fedclinic_model.json").read_text())
    assert meta["thresholds"] == thresholds
    assert read_card(bundle)["thresholds"]["values"]["seizure"] == thresholds[2]
    assert "| seizure |" in (bundle / "MODEL_CARD.md").read_text()

    # an old bundle (no thresholds) keeps 0.5 for every label: the rare finding is not predicted
    old = tmp_path / "old-bundle"
    shutil.copytree(bundle, old)
    (old / "fedclinic_model.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "thresholds"}))
    untuned = ClassifierBundle(old).predict([RARE_NOTE])[0]
    assert untuned["labels"] == ["neuro"] and untuned["threshold"] == 0.5 and untuned["scores"]["seizure"] < 0.5

    with ServeProcesses(tmp_path) as procs:
        proc, ports = procs.start(bundle, "--grpc-port", "0", trust=("--trust-ca", str(scientist.ca_path)))
        status, answer = call(ports["http"], "/v1/predict", {"texts": [RARE_NOTE, COMMON_NOTE]})
        assert status == 200, answer
        rare, common = answer["predictions"]
        assert rare["labels"] == ["neuro", "seizure"] and common["labels"] == ["cardio"]
        assert rare["scores"]["seizure"] < 0.5 and rare["scores"] == pytest.approx(untuned["scores"], abs=1e-6)
        assert rare["thresholds"] == dict(zip(LABELS, thresholds)) and "threshold" not in rare
        status, ready = call(ports["http"], "/readyz")
        assert ready["model"]["thresholds"]["seizure"] == thresholds[2]
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            got = stub.Predict(inference_pb2.PredictRequest(texts=[RARE_NOTE]), timeout=30).predictions[0]
            assert list(got.labels) == ["neuro", "seizure"] and got.thresholds["seizure"] == pytest.approx(thresholds[2])
            described = stub.DescribeModel(inference_pb2.DescribeModelRequest(), timeout=30)
            assert described.thresholds["seizure"] == pytest.approx(thresholds[2]) and described.threshold == 0.0

    # a threshold edited in the signed bundle: serve refuses it before loading, naming the file
    (bundle / "fedclinic_model.json").write_text(json.dumps({**meta, "thresholds": [0.5, 0.5, 0.01]}))
    code, out = ServeProcesses.refused(bundle, "--trust-ca", str(scientist.ca_path))
    assert code == 2 and "fedclinic_model.json" in out, out


def test_a_weighted_multi_label_task_runs_at_real_agents_and_downloads_with_thresholds(tmp_path):
    from fedclinic.client import _headline, state_name
    from fedclinic.federation.local_federation import LocalFederation, SiteSetup
    from fedclinic.models import package_from_config
    from fedclinic.spec.task import Task

    from tests.helpers.text_models import tiny_tokenizer_json

    sites = []
    for i, (name, (n, rare)) in enumerate(SITES.items()):
        folder = tmp_path / "data" / name
        folder.mkdir(parents=True)
        for split, seed in (("train", i), ("val", 10 + i)):
            (folder / f"{split}.jsonl").write_text("".join(
                json.dumps({"text": ex.text, "label": list(ex.labels)}) + "\n" for ex in rows(n // 2, seed, rare)))
        sites.append(SiteSetup(name, datasets={"notes": {"path": str(folder / "train.jsonl"), "format": "jsonl",
                                                         "eval_path": str(folder / "val.jsonl")}}))
    task = Task(name="ml", dataset="notes", labels=LABELS, multi_label=True, architecture="logreg", num_rounds=2,
                min_sites=3, local_epochs=1, batch_size=8, learning_rate=0.05, optimizer="sgd", max_length=16,
                round_timeout_s=120, on_quorum_miss="fail", pos_weight=[1.0, 1.0, 30.0])
    package = package_from_config(architecture="logreg", labels=LABELS, tokenizer_json=tiny_tokenizer_json(),
                                  config={}, multi_label=True, max_length=16)
    (tmp_path / "thresholds.json").write_text(json.dumps({"cardio": 0.5, "neuro": 0.5, "seizure": 0.2}))
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            st = client.submit(task, package=package)
            final = client.wait(st.task_id, timeout=300, progress=False)
            assert state_name(final.state) == "completed", final.error
            folder = client.download(st.task_id, tmp_path / "final", thresholds=str(tmp_path / "thresholds.json"))
        # two sites have no seizure row: their AUC for it is undefined and left out, never sent as NaN (which the
        # aggregator refuses, leaving the final evaluation to wait for those sites until its deadline)
        refused = fed.log_text("aggregator").count('"result refused"')
    assert refused == 0 and not final.results.waiting and sorted({c.site_id for c in final.results.cells}) == sorted(SITES), fed.log_text("aggregator")[-2000:]
    assert list(final.spec.training.pos_weight) == [1.0, 1.0, 30.0]
    metrics = final.rounds[-1].metrics
    # the round reports per-label figures and macro-F1/AUC, never the histograms (they would overflow an update)
    assert {"eval_macro_f1", "eval_macro_auc", "eval_micro_f1", "eval_f1/seizure"} <= set(metrics)
    assert not any(k.startswith("eval_count/") for k in metrics) and "eval_accuracy" not in metrics
    assert _headline(metrics).startswith(" site-eval macro-F1 ")
    card = read_card(folder)
    assert card["training"]["pos_weight"] == [1.0, 1.0, 30.0]
    assert card["thresholds"]["values"]["seizure"] == 0.2 and card["thresholds"]["tuned_on"] is None
