"""fedclinic.evaluation.thresholds and class_weights: per-label thresholds from summed histograms, pos_weight from
label counts."""

from __future__ import annotations


import numpy as np
import pytest

from fedclinic.errors import ConfigError
from fedclinic.evaluation.class_weights import POS_WEIGHT_CAP, pos_weight_from_statistics, resolve_task_pos_weight
from fedclinic.evaluation.multilabel import multilabel_scores, round_report_metrics
from fedclinic.proto import control_pb2
from fedclinic.evaluation.thresholds import (
    BINS,
    DEFAULT_THRESHOLD,
    best_threshold,
    bin_edges,
    check_thresholds,
    probability_bins,
    threshold_histogram,
    thresholds_from_evaluation,
    tune_thresholds,
    tune_thresholds_from_scores,
    tuned_rows,
)


def _sites(seed: int = 0):
    """Three skewed sites: label 0 common, label 1 rare and always scored below 0.5 but ranked well."""
    rng = np.random.default_rng(seed)
    out = []
    for n, rare_rate in ((300, 0.02), (120, 0.10), (60, 0.0)):
        truth = np.zeros((n, 2), dtype=np.int64)
        truth[:, 0] = rng.random(n) < 0.5
        truth[:, 1] = rng.random(n) < rare_rate
        probs = np.empty((n, 2))
        probs[:, 0] = np.clip(0.5 + 0.3 * (truth[:, 0] - 0.5) + rng.normal(0, 0.15, n), 0, 1)
        probs[:, 1] = np.where(truth[:, 1] == 1, rng.uniform(0.25, 0.45, n), rng.uniform(0.0, 0.3, n))
        out.append((truth, probs))
    return out


def _pool(values_per_site):
    """The contract's rule for count/ keys: summed across sites."""
    pooled: dict[str, float] = {}
    for values in values_per_site:
        for k, v in values.items():
            pooled[k] = pooled.get(k, 0.0) + v
    return pooled


def test_bins_are_the_thresholds_serving_applies():
    edges = bin_edges()
    assert len(edges) == BINS - 1 and np.all(np.diff(edges) > 0) and edges[BINS // 2 - 1] == 0.5
    assert edges[0] == pytest.approx(1 / (1 + np.exp(8 * 48 / 50)))  # logit -7.68: fine steps near 0
    probs = np.array([0.0, edges[0] / 2, edges[0], 0.4999, 0.5, 1.0, *edges, *(edges - 1e-12)])
    b = probability_bins(probs)
    assert list(b[:6]) == [0, 0, 1, 24, 25, 49]
    # predicting p >= t_k selects exactly the rows of bins >= k, for every edge
    for k in range(1, BINS):
        assert np.array_equal(probs >= edges[k - 1], b >= k)


def test_summed_site_histograms_tune_exactly_as_the_concatenated_rows():
    sites = _sites()
    pooled = _pool(threshold_histogram(t, p) for t, p in sites)
    truth = np.concatenate([t for t, _ in sites])
    probs = np.concatenate([p for _, p in sites])
    assert pooled == threshold_histogram(truth, probs)
    tuned = tune_thresholds(pooled, ["common", "rare"])
    assert tuned == tune_thresholds_from_scores(truth, probs)
    assert tuned_rows(pooled, 2) == len(truth) == 480
    # the rare label never reaches 0.5 but ranks well: its threshold drops below its positives' scores and finds
    # most of them, where 0.5 found none
    assert tuned[1] < 0.45
    rare = truth[:, 1] == 1
    assert (probs[rare, 1] >= tuned[1]).mean() > 0.5 and not (probs[:, 1] >= 0.5).any()
    # at bin resolution it is the F1-best threshold of the rows themselves: no bin edge does better on them
    def f1(cut):
        pred = probs[:, 1] >= cut
        tp = (pred & rare).sum()
        return 2 * tp / (2 * tp + (pred & ~rare).sum() + (~pred & rare).sum())
    assert f1(tuned[1]) == max(f1(c) for c in bin_edges()) > f1(0.5) == 0.0
    served = multilabel_scores(truth, probs, ["common", "rare"], threshold=tuned, at_least=True)
    assert served["f1/rare"] == f1(tuned[1]) > multilabel_scores(truth, probs, ["common", "rare"],
                                                                 threshold=0.5)["f1/rare"] == 0.0
    assert tune_thresholds_from_scores(truth, np.log(probs / (1 - probs + 1e-12) + 1e-12), logits=True) == tuned


def test_tuning_by_hand_and_the_tie_rule():
    t = bin_edges()  # t[k - 1] is the cut at the lower edge of bin k
    pos = np.zeros(BINS)
    neg = np.zeros(BINS)
    pos[20] = 3
    neg[5] = 10
    # every cut at edges 6..20 keeps the 3 positives and drops the 10 negatives (F1 1.0): the one closest to 0.5
    assert best_threshold(pos, neg) == t[20 - 1]
    pos[:] = 0
    pos[30] = 2
    neg[:] = 0
    neg[10] = 4
    # F1 1.0 for every cut at edges 11..30: 0.5 (edge 25) is among them, so it stays
    assert best_threshold(pos, neg) == DEFAULT_THRESHOLD
    # equal distance from 0.5: the higher cut wins. 1 positive in bin 20 and 1 in bin 30, 2 negatives in bin 29, 10
    # in bin 5: F1 2/3 for cuts at edges 6..20 (TP 2, FP 2) and at edge 30 (TP 1, FP 0), 0.4 between; edges 20 and
    # 30 are both 5 bins from 0.5
    pos[:] = 0
    neg[:] = 0
    pos[20], pos[30], neg[29], neg[5] = 1, 1, 2, 10
    assert best_threshold(pos, neg) == t[30 - 1]
    # a label without positives keeps 0.5; a histogram key out of range is refused
    assert tune_thresholds({"count/thr/0/3/neg": 7.0}, ["a", "b"]) == [DEFAULT_THRESHOLD, DEFAULT_THRESHOLD]
    with pytest.raises(ValueError, match="outside 2 labels"):
        tune_thresholds({"count/thr/5/3/neg": 1.0}, ["a", "b"])
    with pytest.raises(ValueError, match="not a count"):
        tune_thresholds({"count/thr/0/3/neg": -1.0}, ["a", "b"])


def test_thresholds_from_an_evaluation_and_their_checks():
    sites = _sites(1)
    pooled = {"macro_f1": 0.1, "eval_rows": 480.0, **_pool(threshold_histogram(t, p) for t, p in sites)}
    assert thresholds_from_evaluation(pooled, ["common", "rare"]) == tune_thresholds(pooled, ["common", "rare"])

    status = control_pb2.TaskStatus()  # as the aggregator sends it: the final model's pooled evaluation
    status.results.pooled.add(model="final", values=pooled)
    assert thresholds_from_evaluation(status, ["common", "rare"]) == tune_thresholds(pooled, ["common", "rare"])
    with pytest.raises(ValueError, match="no threshold histograms"):
        thresholds_from_evaluation({"macro_f1": 0.3}, ["a", "b"])
    assert check_thresholds({"b": 0.2, "a": 0.7}, ["a", "b"]) == [0.7, 0.2]
    for bad in ([0.5], [0.5, 1.0], [0.5, float("nan")], {"a": 0.5}, "0.5,0.5", [0.5, True]):
        with pytest.raises(ConfigError):
            check_thresholds(bad, ["a", "b"])


def test_round_reports_leave_the_histograms_out():
    values = {"macro_f1": 0.5, "f1/a": 0.4, "count/thr/0/1/pos": 3.0}
    assert round_report_metrics(values) == {"macro_f1": 0.5, "f1/a": 0.4}
    many = {**{f"f1/l{i}": 0.1 for i in range(150)}, **{f"auc/l{i}": 0.1 for i in range(150)}, "macro_f1": 0.2}
    assert round_report_metrics(many) == {"macro_f1": 0.2}


def test_an_undefined_auc_is_left_out_of_what_a_site_sends_not_sent_as_nan():
    import numpy as np

    truth = np.array([[1, 0], [0, 0], [1, 0]])  # label b never occurs in these rows: its AUC is undefined
    values = multilabel_scores(truth, np.array([[2.0, -1.0], [-1.0, -2.0], [1.0, 0.5]]), ["a", "b"])
    assert np.isnan(values["auc/b"])  # in process the undefined value stays visible as NaN
    sent = round_report_metrics(values)
    assert "auc/b" not in sent and sent["auc/a"] == 1.0 and sent["macro_auc"] == 1.0
    assert all(np.isfinite(v) for v in sent.values())


def test_pos_weight_from_statistics():
    pooled = {"rows": 1000.0, "label/common": 400.0, "label/rare": 5.0, "label/majority": 900.0}
    w = pos_weight_from_statistics(pooled, ["common", "rare", "majority", "absent"])
    assert w == [pytest.approx(600 / 400), pytest.approx(POS_WEIGHT_CAP), 1.0, POS_WEIGHT_CAP]
    assert pos_weight_from_statistics({"rows": 1000.0, "label/rare": 50.0}, ["rare"]) == [19.0]
    with pytest.raises(ConfigError, match="no positive 'rows'"):
        pos_weight_from_statistics({"label/a": 3.0}, ["a"])


def test_task_pos_weight_from_a_statistics_task_is_resolved_at_submit():
    from fedclinic.spec.task import Task

    task = Task(name="t", dataset="d", labels=["a", "b"], multi_label=True, architecture="logreg",
                pos_weight="from-statistics:stats-1")
    with pytest.raises(ConfigError, match="resolved when the task is submitted"):
        task.to_spec()
    asked = []
    resolved = resolve_task_pos_weight(task, lambda tid: asked.append(tid) or {"rows": 10.0, "label/a": 2.0,
                                                                              "label/b": 5.0})
    spec = resolved.to_spec()
    assert asked == ["stats-1"] and list(spec.training.pos_weight) == [4.0, 1.0]
    assert spec.training.pos_weight_source == "from-statistics:stats-1"
    with pytest.raises(ConfigError, match="one number per label"):
        Task(name="t", dataset="d", labels=["a", "b"], multi_label=True, architecture="logreg",
             pos_weight=[2.0]).validate()
    with pytest.raises(ConfigError, match="positive finite"):
        Task(name="t", dataset="d", labels=["a", "b"], multi_label=True, architecture="logreg",
             pos_weight=[2.0, -1.0]).validate()
    with pytest.raises(ConfigError, match="multi-label text-classification tasks only"):
        Task(name="t", dataset="d", labels=["a", "b"], architecture="logreg", pos_weight=[2.0, 1.0]).validate()
    with pytest.raises(ConfigError, match="list of numbers"):
        Task(name="t", dataset="d", labels=["a", "b"], multi_label=True, pos_weight="heavy").validate()


def test_pos_weight_in_a_task_file(tmp_path):
    from fedclinic.spec.task import Task

    path = tmp_path / "task.toml"
    path.write_text('name = "t"\ndataset = "d"\nlabels = ["a", "b", "c"]\nmulti_label = true\narchitecture = "logreg"\n'
                    '[training]\npos_weight = [1, 2.5, 40]\n')
    assert list(Task.from_toml(path).to_spec().training.pos_weight) == [1.0, 2.5, 40.0]
    path.write_text(path.read_text().replace("[1, 2.5, 40]", '"from-statistics:abc"'))
    assert Task.from_toml(path).pos_weight == "from-statistics:abc"
    path.write_text(path.read_text().replace('"from-statistics:abc"', "[1, 2]"))
    with pytest.raises(ConfigError, match=r"needs one number per label \(3\), got 2"):
        Task.from_toml(path)
