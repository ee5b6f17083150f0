"""An image + text (IU-CXR family) task runs across real agent processes: one site holds DICOM images behind a CSV
manifest, the others PNG behind JSONL and CSV manifests. The final weights equal the FedAvg of what the sites
computed, and per-label F1 and ROC AUC reach the SDK in the round summaries.

Images are the stand-in set (real CT/MR slices from pydicom's bundled test files, augmented; not chest X-rays)."""

from __future__ import annotations

import numpy as np
import pytest

from fedclinic.data.text import read_dataset
from fedclinic.assets.imaging_standin import STANDIN_LABELS, write_standin
from fedclinic.federation.local_federation import SiteSetup
from fedclinic.spec.task import Task

from fedclinic.models.image_text import FAMILY

from tests.helpers.federation import run_task
from tests.helpers.image_text_models import package
from tests.helpers.replay import replay_site_delta

pytestmark = pytest.mark.integration

LABELS = list(STANDIN_LABELS)
POLICY = {"allowed_families": [FAMILY], "allowed_datasets": ["cxr"]}
#: (site, image format, manifest format, PNG bits, training examples)
SITES = (("site-a", "dicom", "csv", 8, 12), ("site-b", "png", "jsonl", 16, 16), ("site-c", "png", "csv", 8, 20))


def test_image_text_task_trains_across_agents_with_dicom_and_png_sites(tmp_path):
    sites, train_manifests = [], []
    for i, (name, image_format, manifest_format, bits, n) in enumerate(SITES):
        folder = tmp_path / "data" / name
        train = write_standin(folder, n=n, seed=30 + i, image_format=image_format, manifest_format=manifest_format,
                              png_bits=bits, name="train")
        # every site holds the same held-out split (same seed), so their evaluations agree with one made here
        held_out = write_standin(folder, n=16, seed=77, name="eval")
        train_manifests.append(train)
        sites.append(SiteSetup(name, datasets={"cxr": {"path": str(train), "eval_path": str(held_out),
                                                       "label_field": "labels", "image_field": "image"}},
                               policy=POLICY))
    task = Task(name="cxr-it", family=FAMILY, architecture="resnet-bilstm", dataset="cxr", labels=LABELS,
                multi_label=True, num_rounds=2, min_sites=3, local_epochs=2, batch_size=8, learning_rate=3e-3,
                optimizer="adamw", max_length=16, round_timeout_s=240, on_quorum_miss="fail")
    start = package()
    final, round1 = run_task(tmp_path / "fed", sites, task, start)

    # every site evaluated the global model on its held-out split: per-label F1 and AUC arrive in the summary
    per_label = {f"eval_{m}/{lab}" for m in ("f1", "auc") for lab in LABELS}
    for r in final.rounds:
        assert per_label | {"eval_macro_f1", "eval_macro_auc", "eval_loss", "train_loss"} <= set(r.metrics), \
            dict(r.metrics)
        assert all(0.0 <= r.metrics[k] <= 1.0 for k in per_label | {"eval_macro_f1", "eval_macro_auc"})
    # round 2's sites evaluated round 1's global model: their mean equals evaluating it here on the same split
    from fedclinic.training import trainer as training
    from fedclinic.models import build_model

    model = build_model(round1)
    eval_rows = read_dataset(FAMILY, tmp_path / "data" / "site-a" / "eval.csv", label_set=LABELS)
    here = training.evaluate(model, training.encode(eval_rows, model))
    for key in ("macro_auc", "macro_f1", "auc/marker", "f1/ct", "loss"):
        assert final.rounds[1].metrics[f"eval_{key}"] == pytest.approx(here[key], abs=1e-5), key

    # the DICOM site and the PNG sites computed what the shared code computes: FedAvg of the replayed deltas
    deltas = [replay_site_delta(start, read_dataset(FAMILY, m, label_set=LABELS), final.spec, site=site[0])
              for site, m in zip(SITES, train_manifests)]
    total = sum(n for _, n in deltas)
    for name, base in start.tensors.items():
        expected = base + sum(n * d[name] for d, n in deltas) / total
        np.testing.assert_allclose(round1.tensors[name], expected, rtol=1e-4, atol=1e-5, err_msg=name)
    assert sorted(r.num_samples for r in final.rounds[0].reports) == [12, 16, 20]
