"""fedclinic.data.ner: NER dataset readers accept JSONL and CoNLL files and reject bad rows clearly."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from fedclinic.data.ner import NER_FORMATS, EntitySpan, NerExample, infer_ner_format, read_ner
from fedclinic.errors import ConfigError, DatasetError

LABELS = ["DRUG", "DOSE", "DISEASE"]


def _jsonl(tmp_path, rows, name="d.jsonl", **dump_kw):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r, **dump_kw) for r in rows) + "\n",
                 encoding="utf-8")
    return p


def _text(tmp_path, content, name):
    p = tmp_path / name
    p.write_bytes(content.encode("utf-8"))
    return p


def read(path, **kw):
    kw.setdefault("label_set", LABELS)
    return read_ner(path, **kw)


def span_texts(ex: NerExample):
    return [(ex.text[e.start:e.end], e.label) for e in ex.entities]


# ------------------------------------------------------------------------------------------------ happy paths


def test_jsonl_dict_and_list_entities_are_sorted(tmp_path):
    p = _jsonl(tmp_path, [
        {"text": "ibuprofen 200 mg for migraine",
         "entities": [[21, 29, "DISEASE"], {"start": 0, "end": 9, "label": "DRUG"}, [10, 16, "DOSE"]]},
        "",
        {"text": "no findings today", "entities": []},
        {"text": "patient stable"},
        {"text": "also stable", "entities": None},
    ])
    got = read(p)
    assert got[0] == NerExample("ibuprofen 200 mg for migraine", (
        EntitySpan(0, 9, "DRUG"), EntitySpan(10, 16, "DOSE"), EntitySpan(21, 29, "DISEASE")))
    assert span_texts(got[0]) == [("ibuprofen", "DRUG"), ("200 mg", "DOSE"), ("migraine", "DISEASE")]
    assert got[1:] == [NerExample("no findings today", ()), NerExample("patient stable", ()),
                       NerExample("also stable", ())]


def test_jsonl_adjacent_entities_and_extra_keys_are_fine(tmp_path):
    p = _jsonl(tmp_path, [{"text": "aspirin81mg", "id": 7,
                           "entities": [{"start": 0, "end": 7, "label": "DRUG", "text": "aspirin"},
                                        [7, 11, "DOSE"]]}])
    assert span_texts(read(p)[0]) == [("aspirin", "DRUG"), ("81mg", "DOSE")]


def test_jsonl_custom_fields(tmp_path):
    p = _jsonl(tmp_path, [{"note": "take aspirin", "spans": [[5, 12, "DRUG"]]}])
    assert read(p, text_field="note", entities_field="spans") == [
        NerExample("take aspirin", (EntitySpan(5, 12, "DRUG"),))]


def test_jsonl_non_ascii_offsets_are_str_indices(tmp_path):
    text = "Pt 🙂 took Ibuprofène 400 mg; fièvre ↓"
    start = text.index("Ibuprofène")
    ent = [[start, start + len("Ibuprofène"), "DRUG"], [text.index("fièvre"), text.index("fièvre") + 6, "DISEASE"]]
    for name, ensure_ascii in (("a.jsonl", True), ("b.jsonl", False)):
        got = read(_jsonl(tmp_path, [{"text": text, "entities": ent}], name=name, ensure_ascii=ensure_ascii))
        assert got[0].text == text
        assert span_texts(got[0]) == [("Ibuprofène", "DRUG"), ("fièvre", "DISEASE")]


def test_jsonl_u2028_inside_a_string_does_not_split_the_row(tmp_path):
    text = "line\u2028sep aspirin"
    p = _jsonl(tmp_path, [{"text": text, "entities": [[9, 16, "DRUG"]]}], ensure_ascii=False)
    assert span_texts(read(p)[0]) == [("aspirin", "DRUG")]


def test_jsonl_crlf_and_bom(tmp_path):
    rows = [json.dumps({"text": "take aspirin", "entities": [[5, 12, "DRUG"]]}),
            json.dumps({"text": "nothing"})]
    p = tmp_path / "crlf.ndjson"
    p.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(rows).encode("utf-8") + b"\r\n\r\n")
    assert read(p) == [NerExample("take aspirin", (EntitySpan(5, 12, "DRUG"),)), NerExample("nothing", ())]


def test_conll_bio_with_extra_columns_docstart_and_empty_sentence(tmp_path):
    content = ("-DOCSTART- -X- -X- O\n\n"
               "Patient\tNN\tO\ngiven\tVBN\tO\nibuprofen\tNN\tB-DRUG\n200\tCD\tB-DOSE\nmg\tNN\tI-DOSE\n\n\n"
               "No   NN  O\nfindings NNS O\n\n"
               "Type\tNN\tB-DISEASE\n2\tCD\tI-DISEASE\ndiabetes\tNN\tI-DISEASE\n")
    got = read(_text(tmp_path, content, "d.conll"))
    assert [ex.text for ex in got] == ["Patient given ibuprofen 200 mg", "No findings", "Type 2 diabetes"]
    assert span_texts(got[0]) == [("ibuprofen", "DRUG"), ("200 mg", "DOSE")]
    assert got[0].entities == (EntitySpan(14, 23, "DRUG"), EntitySpan(24, 30, "DOSE"))
    assert got[1].entities == ()
    assert span_texts(got[2]) == [("Type 2 diabetes", "DISEASE")]


def test_conll_bioes(tmp_path):
    content = ("aspirin S-DRUG\nand O\nvitamin B-DRUG\nD I-DRUG\n3 E-DRUG\nfor O\nheart B-DISEASE\n"
               "failure E-DISEASE\n10 S-DOSE\nmg S-DOSE\n")
    got = read(_text(tmp_path, content, "d.bio"))
    assert span_texts(got[0]) == [("aspirin", "DRUG"), ("vitamin D 3", "DRUG"), ("heart failure", "DISEASE"),
                                  ("10", "DOSE"), ("mg", "DOSE")]


def test_conll_lenient_chunking_like_conlleval(tmp_path):
    # IOB1 (I- opens a chunk; B- only between two same-type chunks), a type switch inside I- runs, E- after O,
    # I- after E-, a dangling chunk at the end of the sentence
    content = ("a I-DRUG\nb I-DRUG\nc B-DRUG\nd I-DOSE\ne O\nf E-DRUG\ng I-DRUG\nh E-DRUG\ni I-DISEASE\n"
               "j S-DRUG\nk I-DRUG\n")
    got = read(_text(tmp_path, content, "d.iob"))
    assert span_texts(got[0]) == [("a b", "DRUG"), ("c", "DRUG"), ("d", "DOSE"), ("f", "DRUG"), ("g h", "DRUG"),
                                  ("i", "DISEASE"), ("j", "DRUG"), ("k", "DRUG")]


def test_conll_crlf_bom_non_ascii_and_explicit_format(tmp_path):
    p = tmp_path / "notes.data"
    p.write_bytes(b"\xef\xbb\xbf" + "Fièvre\tB-DISEASE\r\n🙂\tO\r\nparacétamol\tB-DRUG\r\n\r\nok\tO\r\n".encode())
    got = read(p, format="CoNLL")
    assert got[0].text == "Fièvre 🙂 paracétamol"
    assert got[0].entities == (EntitySpan(0, 6, "DISEASE"), EntitySpan(9, 20, "DRUG"))
    assert span_texts(got[0]) == [("Fièvre", "DISEASE"), ("paracétamol", "DRUG")]
    assert got[1] == NerExample("ok", ())


def test_conll_whitespace_only_lines_end_sentences(tmp_path):
    got = read(_text(tmp_path, "a O\n \t \nb S-DRUG\n", "d.txt"))
    assert got == [NerExample("a", ()), NerExample("b", (EntitySpan(0, 1, "DRUG"),))]


def test_infer_ner_format():
    assert NER_FORMATS == ("jsonl", "conll")
    assert infer_ner_format("a/b.JSONL") == "jsonl" and infer_ner_format("x.ndjson") == "jsonl"
    for suffix in (".conll", ".bio", ".IOB", ".txt"):
        assert infer_ner_format(f"x{suffix}") == "conll"


# ------------------------------------------------------------------------------------------------ JSONL errors


def _raises(path, pattern, **kw):
    with pytest.raises(DatasetError, match=pattern) as info:
        read(path, **kw)
    assert str(path) in str(info.value)
    return str(info.value)


def test_jsonl_invalid_json(tmp_path):
    p = _jsonl(tmp_path, [{"text": "a"}, '{"text": "b", "entities": '])
    _raises(p, r"d\.jsonl: row 2: invalid JSON .*each line must be one JSON object")


def test_jsonl_not_an_object(tmp_path):
    p = _jsonl(tmp_path, [{"text": "a"}, "", '["a", []]'])
    _raises(p, r"d\.jsonl: row 3: expected a JSON object with 'text' and 'entities', got list")


@pytest.mark.parametrize("row,pattern", [
    ({"entities": []}, r"row 1: missing text field 'text'; every row needs the text"),
    ({"text": None}, r"row 1: missing text field 'text'"),
    ({"text": 5}, r"row 1: text field 'text' must be a string, got int"),
    ({"text": ""}, r"row 1: empty text in field 'text'; remove the row or fill in the text"),
    ({"text": " \t "}, r"row 1: empty text in field 'text'"),
])
def test_jsonl_bad_text(tmp_path, row, pattern):
    _raises(_jsonl(tmp_path, [row]), r"d\.jsonl: " + pattern)


def test_jsonl_entities_not_a_list(tmp_path):
    p = _jsonl(tmp_path, [{"text": "a"}, {"text": "aspirin", "entities": {"start": 0, "end": 7, "label": "DRUG"}}])
    _raises(p, r"d\.jsonl: row 2: entities field 'entities' must be a list of entities \(use \[\] for a text "
               r"without entities\), got dict")


@pytest.mark.parametrize("entity,pattern", [
    ("DRUG", r"entity 2 in field 'entities' is malformed: got str 'DRUG'; write each entity as"),
    ([0, 7], r"entity 2 .* is malformed: a list entity needs exactly 3 items \[start, end, label\], got 2"),
    ({"start": 0, "label": "DRUG"}, r"entity 2 .* is malformed: no 'end' in .*write each entity as"),
    ([0, 7, None], r"entity 2 .* is malformed: label must be a non-empty string \(the entity type\), got None"),
    ([0, 7, ""], r"entity 2 .* is malformed: label must be a non-empty string"),
])
def test_jsonl_malformed_entity(tmp_path, entity, pattern):
    p = _jsonl(tmp_path, [{"text": "aspirin 81 mg", "entities": [[8, 13, "DOSE"], entity]}])
    _raises(p, r"d\.jsonl: row 1: " + pattern)


@pytest.mark.parametrize("entity,pattern", [
    ([0.0, 7, "DRUG"], r"start must be an integer character offset, got 0\.0"),
    ([0, "7", "DRUG"], r"end must be an integer character offset, got '7'"),
    ([False, 7, "DRUG"], r"start must be an integer character offset, got False"),
    ({"start": 0, "end": True, "label": "DRUG"}, r"end must be an integer character offset, got True"),
])
def test_jsonl_offsets_must_be_ints(tmp_path, entity, pattern):
    p = _jsonl(tmp_path, [{"text": "x"}, {"text": "aspirin", "entities": [entity]}])
    _raises(p, r"d\.jsonl: row 2: entity 1 in field 'entities': " + pattern)


def test_jsonl_negative_start(tmp_path):
    p = _jsonl(tmp_path, [{"text": "aspirin", "entities": [[-1, 7, "DRUG"]]}])
    _raises(p, r"d\.jsonl: row 1: entity 1 .*: start -1 is negative; offsets count characters from 0")


def test_jsonl_end_past_text(tmp_path):
    p = _jsonl(tmp_path, [{"text": "fièvre", "entities": [[0, 8, "DISEASE"]]}])
    _raises(p, r"d\.jsonl: row 1: entity 1 .*: end 8 is past the end of the text \(6 characters\); offsets are "
               r"character \(code point\) indices")


@pytest.mark.parametrize("entity", [[3, 3, "DRUG"], [5, 2, "DRUG"]])
def test_jsonl_start_not_before_end(tmp_path, entity):
    p = _jsonl(tmp_path, [{"text": "aspirin", "entities": [entity]}])
    _raises(p, rf"d\.jsonl: row 1: entity 1 .*: start {entity[0]} must be less than end {entity[1]} \(end is "
               r"exclusive\); fix the offsets or remove the empty entity")


def test_jsonl_whitespace_only_span(tmp_path):
    p = _jsonl(tmp_path, [{"text": "take   aspirin", "entities": [[4, 7, "DRUG"]]}])
    _raises(p, r"d\.jsonl: row 1: entity 1 .*: the span \[4, 7\) '   ' is only whitespace; remove the entity or "
               r"fix its offsets")


@pytest.mark.parametrize("entity,pattern", [
    ([4, 12, "DRUG"], r"the span \[4, 12\) ' aspirin' has leading or trailing whitespace; trim it to "
                      r"\[5, 12\) 'aspirin'"),
    ([5, 14, "DRUG"], r"the span \[5, 14\) 'aspirin\\n\\t' has leading or trailing whitespace; trim it to "
                      r"\[5, 12\) 'aspirin'"),
])
def test_jsonl_span_needs_trimming(tmp_path, entity, pattern):
    p = _jsonl(tmp_path, [{"text": "take aspirin\n\tdaily", "entities": [entity]}])
    _raises(p, r"d\.jsonl: row 1: entity 1 .*: " + pattern)


def test_jsonl_overlapping_spans_name_both(tmp_path):
    p = _jsonl(tmp_path, [{"text": "a"},
                          {"text": "ibuprofen 200 mg", "entities": [[10, 16, "DOSE"], [0, 13, "DRUG"]]}])
    _raises(p, r"d\.jsonl: row 2: overlapping entities \[0, 13\) 'DRUG' 'ibuprofen 200' and \[10, 16\) 'DOSE' "
               r"'200 mg'; entities must not overlap")


def test_jsonl_same_span_twice_overlaps(tmp_path):
    p = _jsonl(tmp_path, [{"text": "aspirin", "entities": [[0, 7, "DRUG"], [0, 7, "DRUG"]]}])
    _raises(p, r"row 1: overlapping entities \[0, 7\) 'DRUG' 'aspirin' and \[0, 7\) 'DRUG' 'aspirin'")


def test_jsonl_unknown_label_lists_allowed(tmp_path):
    p = _jsonl(tmp_path, [{"text": "a"}, {"text": "aspirin", "entities": [[0, 7, "MEDICATION"]]}])
    _raises(p, r"d\.jsonl: row 2: entity 1 .*: unknown label 'MEDICATION'; allowed labels are "
               r"\['DRUG', 'DOSE', 'DISEASE'\] \(fix the row or add the label to the task's label set\)")


def test_jsonl_empty_file(tmp_path):
    _raises(_text(tmp_path, "", "empty.jsonl"), r"empty\.jsonl: the dataset is empty \(no example rows\); "
                                                r"point the site at a file with data")
    _raises(_text(tmp_path, "\n \r\n\n", "blank.jsonl"), r"blank\.jsonl: the dataset is empty")


# ------------------------------------------------------------------------------------------------ CoNLL errors


def test_conll_single_column_line(tmp_path):
    p = _text(tmp_path, "Patient O\ngiven O\n\naspirin\n", "d.conll")
    _raises(p, r"d\.conll: line 4: only one column \('aspirin'\); each line needs the token and its tag "
               r"separated by a tab or spaces")


@pytest.mark.parametrize("tag", ["X-DRUG", "B-", "DRUG", "b-DRUG", "U-DRUG", "o"])
def test_conll_unknown_prefix(tmp_path, tag):
    p = _text(tmp_path, f"-DOCSTART- O\n\ntake O\naspirin\t{tag}\n", "d.conll")
    _raises(p, rf"d\.conll: line 4: unknown tag '{tag}'; a tag is O or B-/I-/E-/S- followed by the entity type")


def test_conll_unknown_entity_type(tmp_path):
    p = _text(tmp_path, "take O\naspirin B-MEDICATION\n", "d.conll")
    _raises(p, r"d\.conll: line 2: unknown label 'MEDICATION' in tag 'B-MEDICATION'; allowed labels are "
               r"\['DRUG', 'DOSE', 'DISEASE'\] \(fix the line or add the label to the task's label set\)")


def test_conll_line_numbers_count_crlf_lines_and_the_bom(tmp_path):
    p = tmp_path / "d.conll"
    p.write_bytes(b"\xef\xbb\xbfa O\r\n\r\nb O\r\nc Z-DRUG\r\n")
    _raises(p, r"d\.conll: line 4: unknown tag 'Z-DRUG'")


@pytest.mark.parametrize("content", ["", "\n\n  \n", "-DOCSTART- -X- O O\n\n"])
def test_conll_no_sentences(tmp_path, content):
    _raises(_text(tmp_path, content, "empty.conll"), r"empty\.conll: the dataset is empty \(no sentences")


# ------------------------------------------------------------------------------------------------ other errors


def test_unreadable_files(tmp_path):
    _raises(tmp_path / "missing.conll", r"missing\.conll: file not found; check the dataset path")
    with pytest.raises(DatasetError, match="is a directory"):
        read(tmp_path, format="jsonl")
    bad = tmp_path / "latin1.conll"
    bad.write_bytes("fi\xe8vre B-DISEASE\n".encode("latin-1"))
    _raises(bad, r"latin1\.conll: unreadable file: not valid UTF-8 .*save it as UTF-8")


def test_format_errors(tmp_path):
    _raises(tmp_path / "d.csv", r"cannot tell the NER dataset format from the suffix '\.csv'; rename the file "
                                r"to \.jsonl/\.ndjson or \.conll/\.bio/\.iob/\.txt or pass format=")
    _raises(tmp_path / "d.jsonl", r"unknown NER dataset format 'brat'; use one of jsonl, conll", format="brat")


def test_label_set_is_validated():
    with pytest.raises(ConfigError, match="label_set must be a non-empty list"):
        read_ner("x.conll", label_set=[])
    with pytest.raises(ConfigError, match="unique non-empty strings"):
        read_ner("x.conll", label_set=["DRUG", "DRUG"])


# ------------------------------------------------------------------------------------------------ properties

_NON_SPACE = st.characters(exclude_categories=("Cs",)).filter(lambda c: not c.isspace())
_ANY_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
_ENTITY_TEXT = st.one_of(
    _NON_SPACE,
    st.tuples(_NON_SPACE, _ANY_TEXT, _NON_SPACE).map("".join),
)


@st.composite
def _ner_rows(draw):
    """A text with non-overlapping, trimmed entity spans (adjacent spans allowed)."""
    pieces = draw(st.lists(st.tuples(_ANY_TEXT, st.one_of(st.none(), st.tuples(_ENTITY_TEXT,
                                                                                st.sampled_from(LABELS)))),
                           max_size=6))
    text, spans = "", []
    for gap, ent in pieces:
        text += gap
        if ent is not None:
            spans.append(EntitySpan(len(text), len(text) + len(ent[0]), ent[1]))
            text += ent[0]
    text += draw(_ANY_TEXT)
    if not text.strip():
        text += "x"
    return NerExample(text, tuple(spans))


@settings(max_examples=150, deadline=None)
@given(examples=st.lists(_ner_rows(), min_size=1, max_size=4), as_lists=st.booleans(),
       ensure_ascii=st.booleans(), shuffle=st.randoms(use_true_random=False))
def test_property_jsonl_roundtrip(tmp_path_factory, examples, as_lists, ensure_ascii, shuffle):
    rows = []
    for ex in examples:
        ents = [[e.start, e.end, e.label] if as_lists else {"start": e.start, "end": e.end, "label": e.label}
                for e in ex.entities]
        shuffle.shuffle(ents)
        rows.append({"text": ex.text, "entities": ents})
    p = _jsonl(tmp_path_factory.mktemp("ner"), rows, ensure_ascii=ensure_ascii)
    assert read(p) == examples


_TOKEN = st.text(_NON_SPACE, min_size=1, max_size=6).filter(lambda t: not t.startswith("-DOCSTART-"))
_TAG = st.one_of(st.just("O"), st.tuples(st.sampled_from("BIES"), st.sampled_from(LABELS)).map("-".join))
_SEP = st.sampled_from(["\t", " ", "  ", " \t "])


def _write_conll(tmp_path, sentences, newline, sep, name="d.conll"):
    lines = []
    for sent in sentences:
        lines += [f"{tok}{sep}{tag}" for tok, tag in sent] + [""]
    return _text(tmp_path, newline.join(lines), name)


@settings(max_examples=150, deadline=None)
@given(sentences=st.lists(st.lists(st.tuples(_TOKEN, _TAG), min_size=1, max_size=10), min_size=1, max_size=4),
       newline=st.sampled_from(["\n", "\r\n"]), sep=_SEP)
def test_property_conll_spans_are_token_chunks(tmp_path_factory, sentences, newline, sep):
    got = read(_write_conll(tmp_path_factory.mktemp("ner"), sentences, newline, sep))
    assert len(got) == len(sentences)
    for ex, sent in zip(got, sentences):
        tokens = [tok for tok, _ in sent]
        assert ex.text == " ".join(tokens)
        starts = {sum(len(t) + 1 for t in tokens[:i]): i for i in range(len(tokens))}
        covered = []
        for e in ex.entities:
            first = starts[e.start]
            last = first
            while sum(len(t) + 1 for t in tokens[:last]) + len(tokens[last]) < e.end:
                last += 1
            # the span's text is exactly the joined tokens of the chunk, all tagged with the span's type
            assert ex.text[e.start:e.end] == " ".join(tokens[first:last + 1])
            assert all(tag.endswith("-" + e.label) for _, tag in sent[first:last + 1])
            covered += range(first, last + 1)
        # sorted, non-overlapping, and every tagged token (and no O token) belongs to exactly one entity
        assert covered == sorted(set(covered))
        assert covered == [i for i, (_, tag) in enumerate(sent) if tag != "O"]


_CHUNKS = st.lists(st.tuples(st.sampled_from([None, *LABELS]), st.integers(1, 4)), min_size=1, max_size=8)


def _encode(chunks, scheme):
    """Tags for well-formed chunks (type or None = outside, length) in BIO/IOB1, IOB2 or BIOES."""
    tags, prev = [], None
    for etype, n in chunks:
        if etype is None:
            tags += ["O"] * n
        elif scheme == "IOB2":
            tags += [f"B-{etype}"] + [f"I-{etype}"] * (n - 1)
        elif scheme == "IOB1":
            tags += [f"{'B' if prev == etype else 'I'}-{etype}"] + [f"I-{etype}"] * (n - 1)
        elif n == 1:
            tags += [f"S-{etype}"]
        else:
            tags += [f"B-{etype}"] + [f"I-{etype}"] * (n - 2) + [f"E-{etype}"]
        prev = etype
    return tags


@settings(max_examples=150, deadline=None)
@given(chunks=_CHUNKS, scheme=st.sampled_from(["IOB1", "IOB2", "BIOES"]), data=st.data())
def test_property_conll_well_formed_schemes_decode_to_their_chunks(tmp_path_factory, chunks, scheme, data):
    tags = _encode(chunks, scheme)
    tokens = data.draw(st.lists(_TOKEN, min_size=len(tags), max_size=len(tags)))
    (ex,) = read(_write_conll(tmp_path_factory.mktemp("ner"), [list(zip(tokens, tags))], "\n", "\t"))
    expected, i = [], 0
    for etype, n in chunks:
        if etype is not None:
            expected.append((" ".join(tokens[i:i + n]), etype))
        i += n
    assert span_texts(ex) == expected
