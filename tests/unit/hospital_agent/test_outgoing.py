"""outgoing_reason: what leaves the site names the rule and the row, never a path or a value of the data."""

from __future__ import annotations

from fedclinic.data.text import read_classification
from fedclinic.errors import DatasetError, IntegrityError

from hospital_agent.outgoing import outgoing_reason


def test_dataset_error_leaves_as_rule_and_row_only(tmp_path):
    path = tmp_path / "SECRET-site.jsonl"
    path.write_text('{"text": "ok", "label": "a"}\n{"text": "Jane Roe", "label": ["a", "b"]}\n')
    try:
        read_classification(path, label_set=["a", "b"])
    except DatasetError as exc:
        local, sent = str(exc), outgoing_reason(exc, dataset="notes")
    assert str(path) in local and "['a', 'b']" in local  # the site's log keeps the detail
    assert sent.startswith("the dataset 'notes' does not meet the task's data contract: row 2: more than one label")
    assert "SECRET" not in sent and "['a', 'b']" not in sent and "Jane" not in sent


def test_without_a_rule_only_a_generic_sentence_and_other_text_loses_its_paths():
    sent = outgoing_reason(DatasetError("/srv/data/x.jsonl: row 4: 'Jane Roe'"))
    assert "row 4" not in sent and "/srv" not in sent and "Jane" not in sent and "data contract" in sent
    sent = outgoing_reason(IntegrityError("spill file /var/lib/agent/out/t-1.bin and C:\\data\\x damaged"))
    assert sent == "spill file <site path> and <site path> damaged"
    assert outgoing_reason("tokenizer.json and/or 1/2 differ") == "tokenizer.json and/or 1/2 differ"
    assert outgoing_reason("") == "" and len(outgoing_reason("x" * 5000)) == 500
