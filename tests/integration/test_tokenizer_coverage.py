"""Tokenizer coverage over real processes: a site whose text is in a script the task's tokenizer does not cover
reports its [UNK] rate (a rate, never text) with its first update of a training task, and ``fedclinic task
watch``'s progress warns the scientist naming the site and the rate; a statistics task on the same sites reports
that site's ``unk_rate`` above 50 % and the SDK's statistics warnings name it."""

from __future__ import annotations

import io
import json
import math

import pytest

from fedclinic.client import state_name
from fedclinic.evaluation.statistics_table import statistics_warnings

from tests.helpers.tasks import make_task
from tests.helpers.text_models import LABELS, tiny_package

pytestmark = pytest.mark.integration

DEVANAGARI = ["रोगी को तेज बुखार है", "सीने में दर्द और धड़कन", "सिरदर्द और चक्कर आना", "हाथ में सुन्नपन"]


def test_a_site_the_tokenizer_does_not_cover_is_named_with_its_unk_rate(federation_factory, tmp_path):
    fed = federation_factory(2, samples=(24, 24), start=False)
    rows = [{"text": DEVANAGARI[i % 4] + " patient", "label": LABELS[i % 2]} for i in range(24)]
    (tmp_path / "data" / "site-b" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fed.start()
    out = io.StringIO()
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=2, min_sites=2), package=tiny_package("logreg"))
        final = client.wait(st.task_id, timeout=120, progress=True, out=out)
    assert state_name(final.state) == "completed", final.error
    first = {r.site_id: dict(r.metrics) for r in final.rounds[0].reports}
    second = {r.site_id: dict(r.metrics) for r in final.rounds[1].reports}
    assert first["site-a"]["tokenizer_unk_rate"] == 0.0
    # every Devanagari word is [UNK] to the word-level tokenizer; "patient" is known: 4 or 5 words of which 1 known
    assert 0.7 < first["site-b"]["tokenizer_unk_rate"] < 0.85
    assert all("tokenizer_unk_rate" not in m for m in second.values())  # the first update only
    warnings = [line for line in out.getvalue().splitlines() if "warning:" in line]
    assert len(warnings) == 1, out.getvalue()  # once, for site-b only
    rate = 100 * first["site-b"]["tokenizer_unk_rate"]
    assert f"site site-b: {rate:.1f}% of its tokens are the tokenizer's unknown token" in warnings[0]
    assert not any(word in out.getvalue() for word in DEVANAGARI)  # the rate, never text

    # the same sites asked for statistics before any training: the coverage is in the table, per site
    with fed.client() as client:
        st = client.submit(make_task(kind="statistics", min_sites=2), package=tiny_package("logreg"))
        done = client.wait(st.task_id, timeout=120, progress=False)
    assert state_name(done.state) == "completed", done.error
    per_site = {s: dict(v.values) for s, v in done.site_statistics.items()}
    assert set(per_site) == {"site-a", "site-b"}
    assert per_site["site-a"]["unk_rate"] == 0.0 and per_site["site-b"]["unk_rate"] > 0.5
    assert math.isclose(per_site["site-b"]["unk_rate"], first["site-b"]["tokenizer_unk_rate"], rel_tol=1e-9)
    warned = statistics_warnings(per_site, dict(done.pooled_statistics), list(done.spec.labels))
    assert [w for w in warned if "unknown token" in w] and all("site-a" not in w for w in warned if "unknown" in w)
