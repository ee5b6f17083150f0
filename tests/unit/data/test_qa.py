"""The question-answering dataset reader: JSONL question/answer(/context) rows, each bad row named."""

from __future__ import annotations

import json

import pytest

from fedclinic.data.text import read_dataset
from fedclinic.data.qa import QAExample, read_qa
from fedclinic.errors import DatasetError


def write(tmp_path, lines, name="qa.jsonl"):
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines), encoding="utf-8")
    return path


def test_reads_rows_in_order_with_optional_context(tmp_path):
    path = write(tmp_path, [
        {"question": "What treats headache?", "answer": "Aspirin.", "id": 7},
        "",
        {"question": "  Dose?  ", "answer": " 500 mg ", "context": " The leaflet says 500 mg. "},
        {"question": "胃癌的症状？", "answer": "上腹痛。", "context": None},
        {"question": "Line\u2028separator inside", "answer": "kept"},
    ])
    rows = read_qa(path)
    assert rows == [QAExample("What treats headache?", "Aspirin."),
                    QAExample("Dose?", "500 mg", "The leaflet says 500 mg."),
                    QAExample("胃癌的症状？", "上腹痛。"),
                    QAExample("Line\u2028separator inside", "kept")]


def test_custom_field_names_and_read_dataset_dispatch(tmp_path):
    path = write(tmp_path, [{"q": "What is it?", "a": "A test.", "passage": "ctx"}], name="qa.ndjson")
    rows = read_qa(path, question_field="q", answer_field="a", context_field="passage")
    assert rows == [QAExample("What is it?", "A test.", "ctx")]
    # the family dispatch: label_set does not apply (a QA task has none) and may be empty or absent
    assert read_dataset("question-answering", path, question_field="q", answer_field="a",
                        context_field="passage", label_set=[]) == rows
    assert read_dataset("question-answering", path, label_set=None, question_field="q", answer_field="a",
                        context_field="passage") == rows


@pytest.mark.parametrize("line, message", [
    ('{"question": "q", "answer": ', "row 2: invalid JSON"),
    ('["q", "a"]', "row 2: expected a JSON object with 'question' and 'answer', got list"),
    ('{"answer": "a"}', "row 2: missing question field 'question'"),
    ('{"question": null, "answer": "a"}', "row 2: missing question field 'question'"),
    ('{"question": "q"}', "row 2: missing answer field 'answer'"),
    ('{"question": "  ", "answer": "a"}', "row 2: empty question in field 'question'"),
    ('{"question": "q", "answer": ""}', "row 2: empty answer in field 'answer'"),
    ('{"question": 3, "answer": "a"}', "row 2: question field 'question' must be a string, got int"),
    ('{"question": "q", "answer": ["a"]}', "row 2: answer field 'answer' must be a string, got list"),
    ('{"question": "q", "answer": "a", "context": 5}', "row 2: context field 'context' must be a string"),
])
def test_bad_rows_name_the_file_and_row(tmp_path, line, message):
    path = write(tmp_path, [{"question": "ok?", "answer": "ok"}, line])
    with pytest.raises(DatasetError) as exc:
        read_qa(path)
    assert message in str(exc.value)
    assert str(path) in str(exc.value)


def test_missing_field_lists_the_fields_found(tmp_path):
    path = write(tmp_path, [{"prompt": "q", "answer": "a"}])
    with pytest.raises(DatasetError, match=r"fields found: 'prompt', 'answer'.*set question_field"):
        read_qa(path)


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "qa.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match="the dataset is empty"):
        read_qa(path)


def test_file_problems(tmp_path):
    with pytest.raises(DatasetError, match="file not found"):
        read_qa(tmp_path / "nope.jsonl")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"question": "caf\xe9", "answer": "a"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match="not valid UTF-8"):
        read_qa(bad)
    csv = tmp_path / "qa.csv"
    csv.write_text("question,answer\nq,a\n")
    with pytest.raises(DatasetError, match=r"suffix '\.csv'.*JSONL"):
        read_qa(csv)
    with pytest.raises(DatasetError, match="must be JSONL"):
        read_qa(write(tmp_path, [{"question": "q", "answer": "a"}]), format="csv")
    # format="jsonl" reads a file whatever its suffix
    odd = tmp_path / "qa.txt"
    odd.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    assert read_qa(odd, format="jsonl") == [QAExample("q", "a")]
