"""The one rule that combines sites' evaluations (aggregator and simulator): rows-weighted means, summed counts,
small cells suppressed and left out of every pool."""

from __future__ import annotations

import math

from fedclinic.evaluation.combine import is_suppressed, pool_evaluations, suppress_cell, weighted_metrics

from aggregator_service.round_metrics import evaluation_metrics
from aggregator_service.store import SiteResultRecord, UpdateRecord


def test_means_are_weighted_by_rows_evaluated_and_counts_are_summed():
    pooled = weighted_metrics({"a": {"eval_rows": 30.0, "accuracy": 0.9, "count/thr/0/1/pos": 4.0},
                               "b": {"eval_rows": 10.0, "accuracy": 0.5, "count/thr/0/1/pos": 6.0, "loss": 2.0,
                                     "bad": math.nan}})
    assert pooled == {"eval_rows": 40.0, "accuracy": (30 * 0.9 + 10 * 0.5) / 40, "count/thr/0/1/pos": 10.0,
                      "loss": 2.0}


def test_a_small_cell_is_suppressed_and_in_no_pool():
    assert suppress_cell({"eval_rows": 9.0, "accuracy": 1.0}, 10) == {"eval_rows_suppressed": 1.0}
    assert suppress_cell({"eval_rows": 10.0, "accuracy": 1.0}, 10) == {"eval_rows": 10.0, "accuracy": 1.0}
    assert suppress_cell({"eval_rows": 3.0}, 0) == {"eval_rows_suppressed": 1.0}  # 0 = the default k, 10
    assert is_suppressed(suppress_cell({"eval_rows": 50.0}, 100))
    cells = {"a": {"eval_rows": 20.0, "accuracy": 0.5}, "b": {"eval_rows": 20.0, "accuracy": 0.7},
             "small": {"eval_rows": 4.0, "accuracy": 0.0}}
    pooled = pool_evaluations(cells, {"a": 10, "b": 10, "small": 10})
    assert pooled.sites == 2 and pooled.values == {"eval_rows": 40.0, "accuracy": 0.6}
    # a site's own k decides its cell: site b asks for 25 rows, so only a is left
    alone = pool_evaluations(cells, {"a": 10, "b": 25, "small": 10})
    assert alone.sites == 1 and alone.values == {"eval_rows": 20.0, "accuracy": 0.5}
    empty = pool_evaluations({"small": cells["small"]}, 10)
    assert not empty.values and "not pooled" in empty.note


def test_a_round_combines_late_evaluations_with_header_ones_by_the_same_rule():
    def update(site, rows, acc):
        return UpdateRecord(f"u-{site}", "t", 1, site, "k", 100, 1, "", "[]", {},
                            {"eval_rows": rows, "accuracy": acc} if rows else {}, 0, 0, 0)

    updates = [update("a", 30.0, 0.9), update("b", 0, 0), update("c", 10.0, 0.1)]
    late = [SiteResultRecord("t", 1, "b", "round", "round-eval", "m", {"eval_rows": 10.0, "accuracy": 0.5}, 10, 0),
            SiteResultRecord("t", 1, "c", "round", "round-eval", "m", {"eval_rows": 5.0, "accuracy": 0.0}, 10, 0)]
    m = evaluation_metrics(updates, late)  # c's later answer replaces its header's, and is too small to count
    assert m == {"eval_rows": 40.0, "eval_accuracy": (30 * 0.9 + 10 * 0.5) / 40, "eval_sites": 2.0}


def test_thresholds_read_the_final_evaluation_pooled_in_a_task_status():
    from fedclinic.evaluation.thresholds import evaluation_values
    from fedclinic.proto import control_pb2

    st = control_pb2.TaskStatus()
    st.results.pooled.add(model="own", values={"count/thr/0/1/pos": 9.0})
    st.results.pooled.add(model="final", values={"count/thr/0/1/pos": 3.0, "eval_rows": 40.0})
    assert evaluation_values(st) == {"count/thr/0/1/pos": 3.0, "eval_rows": 40.0}
