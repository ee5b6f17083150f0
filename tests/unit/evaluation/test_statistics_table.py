"""The scientist's view of federated statistics: the table (labels as rows, sites as columns, withheld cells as
"<k") and the warnings (a label a site lacks, a tokenizer that does not cover a site's text)."""

from __future__ import annotations

from fedclinic.evaluation.statistics import pool_statistics
from fedclinic.evaluation.statistics_table import coverage_warning, statistics_table, statistics_warnings

LABELS = ["Birth Control", "Depression", "Pain"]


def _sites():
    a = {"rows": 120.0, "missing_rows": 0.0, "invalid_rows": 0.0, "label/Birth Control": 70.0,
         "label/Depression": 50.0, "label/Pain": 0.0, "chars_q50": 310.0, "unk_rate": 0.002, "truncated_rate": 0.25,
         "count/tokens": 1000.0, "count/unk_tokens": 2.0, "min_cell_rows": 10.0}
    b = {"rows": 60.0, "missing_rows": 0.0, "suppressed/invalid_rows": 1.0, "label/Birth Control": 30.0,
         "suppressed/label/Depression": 1.0, "suppressed/label/Pain": 1.0, "chars_q50": 95.5, "unk_rate": 0.41,
         "count/tokens": 900.0, "count/unk_tokens": 369.0, "min_cell_rows": 20.0}
    return {"site-a": a, "site-b": b}


def test_the_table_has_labels_as_rows_sites_as_columns_and_withheld_cells_as_less_than_k():
    sites = _sites()
    pooled = pool_statistics(sites, min_cell=10)
    text = statistics_table(sites, pooled, LABELS)
    lines = text.splitlines()
    assert lines[0].split() == ["site-a", "site-b", "pooled"]
    row = {line[:16].strip(): line[16:].split() for line in lines[1:]}
    assert row["rows"] == ["120", "60", "180"]
    assert row["invalid rows"] == ["0", "<20", ">=0"]       # b's own k; the pool leaves b's cell out
    assert row["label Depression"] == ["50", "<20", ">=50"]
    assert row["label Pain"] == ["0", "<20", ">=0"]
    assert any(line.startswith("label Birth Control") and line.split()[-3:] == ["70", "30", "100"] for line in lines)
    assert row["[UNK] rate"] == ["0.2%", "41.0%", "19.5%"]  # pooled: 371 / 1900 tokens
    assert row["chars p50"] == ["310", "95.5", "238"]        # row-weighted: (120*310 + 60*95.5) / 180
    assert row["truncated"] == ["25.0%", "-", "-"]           # b reported none; the pool has no truncation count
    assert "tokens p05" not in text                          # rows no site reports are left out


def test_multi_label_pairs_appear_when_reported():
    v = {"rows": 40.0, "label/a": 30.0, "label/b": 25.0, "label_pair/a|b": 15.0}
    text = statistics_table({"s": v}, None, ["a", "b"], multi_label=True)
    assert "both a & b" in text and "pooled" not in text


def test_warnings_name_a_label_a_site_lacks_and_a_tokenizer_that_does_not_cover_a_site():
    sites = _sites()
    warnings = statistics_warnings(sites, pool_statistics(sites, min_cell=10), LABELS)
    assert len(warnings) == 2
    assert warnings[0].startswith("site site-a has no rows labelled 'Pain'")
    assert warnings[1].startswith("site site-b: 41.0% of its tokens are the tokenizer's unknown token")
    # a withheld cell is 1..k-1 rows, not a lack: no warning for b's Depression; Pain is withheld at b, so
    # the pool does not claim that no site has it
    assert not any("Depression" in w for w in warnings) and not any(w.startswith("no site") for w in warnings)
    lone = {"s": {"rows": 50.0, "label/a": 50.0, "label/b": 0.0}}
    assert statistics_warnings(lone, pool_statistics(lone, min_cell=10), ["a", "b"])[-1].startswith(
        "no site has rows labelled 'b'")


def test_the_coverage_warning_fires_above_five_percent_only():
    assert coverage_warning("h1", 0.05) is None and coverage_warning("h1", 0.0) is None
    text = coverage_warning("h1", 0.37)
    assert text and "site h1" in text and "37.0%" in text


def test_task_status_prints_the_table_and_warnings_of_a_statistics_task(capsys):
    from fedclinic.cli import _print_status
    from fedclinic.proto import control_pb2, task_pb2

    st = control_pb2.TaskStatus(task_id="t1", spec=task_pb2.TaskSpec(name="stats", labels=LABELS), signed=True)
    for site, values in _sites().items():
        st.site_statistics[site].values.update(values)
    _print_status(st, False)  # no pooled values from the aggregator: pooled here, with the largest k (20)
    out = capsys.readouterr().out
    assert "site-a  site-b  pooled" in out and "label Depression" in out and "<20" in out
    assert "warning: site site-b: 41.0% of its tokens" in out
