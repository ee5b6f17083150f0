"""fedclinic.data.text: site dataset readers accept the documented formats and reject bad rows clearly."""

from __future__ import annotations

import json

import pytest

from fedclinic.data.text import Example, infer_format, read_classification
from fedclinic.errors import ConfigError, DatasetError

LABELS = ["flu", "rash", "ulcer"]


def _jsonl(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return p


def _text(tmp_path, content, name):
    p = tmp_path / name
    p.write_text(content, encoding="utf-8")
    return p


def read(path, **kw):
    kw.setdefault("label_set", LABELS)
    return read_classification(path, **kw)


# ------------------------------------------------------------------------------------------------ happy paths


def test_jsonl_single_label(tmp_path):
    p = _jsonl(tmp_path, [{"text": "fever and cough", "label": "flu"}, "", {"text": "red skin", "label": "rash"}])
    assert read(p) == [Example("fever and cough", ("flu",)), Example("red skin", ("rash",))]


def test_jsonl_multi_label_lists_and_labels_field(tmp_path):
    p = _jsonl(tmp_path, [{"text": "a", "labels": ["ulcer", "flu", "flu"]}, {"text": "b", "label": "rash"},
                          {"text": "c", "label": ["rash"]}])
    # labels are de-duplicated and put in label-set order
    assert read(p, multi_label=True) == [Example("a", ("flu", "ulcer")), Example("b", ("rash",)),
                                         Example("c", ("rash",))]


def test_jsonl_custom_fields_and_integer_labels(tmp_path):
    p = _jsonl(tmp_path, [{"note": "x", "y": 1}, {"note": "z", "y": 0}])
    assert read(p, text_field="note", label_field="y", label_set=["0", "1"]) == [Example("x", ("1",)),
                                                                                  Example("z", ("0",))]


def test_csv_and_tsv(tmp_path):
    csv_path = _text(tmp_path, 'id,text,label\n1,"fever, cough",flu\n2,"line one\nline two",rash\n', "d.csv")
    assert read(csv_path) == [Example("fever, cough", ("flu",)), Example("line one\nline two", ("rash",))]
    tsv_path = _text(tmp_path, "text\tlabel\nfever\tflu|ulcer\n", "d.tsv")
    assert read(tsv_path, multi_label=True) == [Example("fever", ("flu", "ulcer"))]


def test_csv_with_utf8_bom_and_explicit_format(tmp_path):
    p = tmp_path / "data.txt"
    p.write_bytes("\ufefftext,label\nfièvre,flu\n".encode("utf-8"))
    assert read(p, format="csv") == [Example("fièvre", ("flu",))]


def test_infer_format():
    assert infer_format("a/b.JSONL") == "jsonl" and infer_format("x.ndjson") == "jsonl"
    assert infer_format("x.csv") == "csv" and infer_format("x.tsv") == "tsv"


# ------------------------------------------------------------------------------------------------ errors


def test_unknown_label_lists_the_allowed_ones(tmp_path):
    p = _jsonl(tmp_path, [{"text": "a", "label": "flu"}, {"text": "b", "label": "gout"}])
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 2: unknown label 'gout'; allowed labels are "
                                           r"\['flu', 'rash', 'ulcer'\]"):
        read(p)


def test_unknown_label_in_csv_counts_the_header_as_row_1(tmp_path):
    p = _text(tmp_path, "text,label\na,flu\nb,flu\nc,gout\n", "d.csv")
    with pytest.raises(DatasetError, match=r"d\.csv: row 4: unknown label 'gout'"):
        read(p)


def test_row_numbers_count_records_not_lines_in_csv(tmp_path):
    p = _text(tmp_path, 'text,label\n"multi\nline",flu\nc,\n', "d.csv")
    with pytest.raises(DatasetError, match=r"row 3: missing label \(field 'label'\)"):
        read(p)


@pytest.mark.parametrize("row,msg", [
    ({"text": "", "label": "flu"}, r"row 1: empty text in field 'text'"),
    ({"text": "   ", "label": "flu"}, r"row 1: empty text"),
    ({"label": "flu"}, r"row 1: missing text field 'text'"),
    ({"text": 5, "label": "flu"}, r"row 1: text field 'text' must be a string"),
    ({"text": "a"}, r"row 1: missing label \(field 'label'\); every row needs a label from \['flu'"),
    ({"text": "a", "label": ""}, r"row 1: missing label"),
    ({"text": "a", "label": 1.5}, r"row 1: label 1.5 in field 'label' must be a label name"),
    ({"text": "a", "label": {"x": 1}}, r"must be a string or a list of strings, got dict"),
    ({"text": "a", "label": ["flu", None]}, r"label list in field 'label' holds None"),
])
def test_jsonl_row_errors(tmp_path, row, msg):
    with pytest.raises(DatasetError, match=msg):
        read(_jsonl(tmp_path, [row]))


def test_csv_empty_text_and_short_row(tmp_path):
    with pytest.raises(DatasetError, match=r"row 2: empty text"):
        read(_text(tmp_path, "text,label\n,flu\n", "a.csv"))
    with pytest.raises(DatasetError, match=r"row 2: missing label"):
        read(_text(tmp_path, "text,label\nonly text\n", "b.csv"))


def test_invalid_json_names_row(tmp_path):
    p = _jsonl(tmp_path, [{"text": "a", "label": "flu"}, '{"text": "b", "label": '])
    with pytest.raises(DatasetError, match=r"row 2: invalid JSON .*each line must be one JSON object"):
        read(p)
    with pytest.raises(DatasetError, match=r"row 1: expected a JSON object with 'text' and 'label', got list"):
        read(_jsonl(tmp_path, ['["a", "flu"]'], name="e.jsonl"))


def test_unreadable_files(tmp_path):
    with pytest.raises(DatasetError, match=r"missing\.jsonl: file not found; check the dataset path"):
        read(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="is a directory"):
        read(tmp_path, format="jsonl")
    bad = tmp_path / "latin1.csv"
    bad.write_bytes("text,label\nfi\xe8vre,flu\n".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1\.csv: unreadable file: not valid UTF-8 .*save it as UTF-8"):
        read(bad)


def test_empty_datasets(tmp_path):
    with pytest.raises(DatasetError, match=r"empty\.jsonl: the dataset is empty"):
        read(_text(tmp_path, "\n\n", "empty.jsonl"))
    with pytest.raises(DatasetError, match=r"header\.csv: the dataset is empty \(no example rows\)"):
        read(_text(tmp_path, "text,label\n", "header.csv"))
    with pytest.raises(DatasetError, match=r"nothing\.csv: the dataset is empty \(no header row\)"):
        read(_text(tmp_path, "", "nothing.csv"))


def test_multi_label_row_in_single_label_task(tmp_path):
    with pytest.raises(DatasetError, match=r"row 1: 2 labels \['flu', 'rash'\] in a single-label task; .*multi_label"):
        read(_jsonl(tmp_path, [{"text": "a", "label": ["rash", "flu"]}]))
    with pytest.raises(DatasetError, match=r"row 2: 2 labels \['flu', 'ulcer'\] in a single-label task"):
        read(_text(tmp_path, "text,label\na,flu|ulcer\n", "d.csv"))


def test_csv_missing_columns(tmp_path):
    p = _text(tmp_path, "body,label\na,flu\n", "d.csv")
    with pytest.raises(DatasetError, match=r"row 1: the header has no column\(s\) \['text'\]; found columns "
                                           r"\['body', 'label'\]"):
        read(p)


def test_format_errors(tmp_path):
    with pytest.raises(DatasetError, match=r"cannot tell the format from the suffix '\.xlsx'.*\.jsonl/\.csv/\.tsv"):
        read(tmp_path / "d.xlsx")
    with pytest.raises(DatasetError, match="unknown dataset format 'parquet'"):
        read(tmp_path / "d.csv", format="parquet")


def test_label_set_is_validated():
    with pytest.raises(ConfigError, match="label_set must be a non-empty list"):
        read_classification("x.csv", label_set=[])
    with pytest.raises(ConfigError, match="unique non-empty strings"):
        read_classification("x.csv", label_set=["a", "a"])
