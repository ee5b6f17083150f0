"""The one way the agent reads a registered dataset, whatever holds it: a file (JSONL, CSV, TSV, CoNLL, image
manifest) or a data source (SQL, OMOP, FHIR NDJSON, Parquet: fedclinic.data.sources).

Training (hospital_agent.training_step), statistics (hospital_agent.site_statistics), evaluation and `tasks
show` read through here, so a source gives them the same ``Example`` rows its file twin would. A source serves
text-classification tasks (single- and multi-label); a task of another family on it is declined with a reason.
"""

from __future__ import annotations

from typing import Callable

from fedclinic.errors import DatasetError

from hospital_agent.config import DatasetEntry

SOURCE_FAMILIES = ("text-classification",)
MISSING_ID = "a row has no patient id (the column the site's group_field names)"


def has_eval(entry: DatasetEntry) -> bool:
    """The dataset has a held-out split (``eval_path``, or a source's eval query / eval share / eval export)."""
    return entry.source.has_eval if entry.source is not None else entry.eval_path is not None


def read_rows(entry: DatasetEntry, spec, *, split: str = "train",
              on_bad_row: Callable[[DatasetError], None] | None = None) -> list:
    """The examples of ``entry``'s ``split`` ("train" or "eval") for a task of ``spec`` (its family, labels and
    multi_label), validated against the task's data contract (DatasetError names the file or source and the
    row). ``on_bad_row``: the tolerant reading of the statistics (fedclinic.data.text.read_classification)."""
    from fedclinic.data.text import read_dataset, read_source_classification  # the data modules, when first needed

    if entry.source is not None:
        if spec.family not in SOURCE_FAMILIES:
            raise DatasetError(f"{entry.source.where}: a {entry.source.kind} source feeds text-classification tasks; "
                               f"this task is {spec.family}", rule="the dataset's source does not serve this task's "
                               "family")
        return read_source_classification(entry.source, split=split, label_set=list(spec.labels),
                                          multi_label=spec.multi_label, on_bad_row=on_bad_row)
    path = entry.path if split == "train" else entry.eval_path
    kwargs = reader_kwargs(entry, spec)
    return read_dataset(spec.family, path, **kwargs, on_bad_row=on_bad_row)


def reader_kwargs(entry: DatasetEntry, spec) -> dict:
    """The keyword arguments of ``fedclinic.data.text.read_dataset`` for a file entry and a task spec: the
    entry's format and column names, the task's label set."""
    return dict(format=entry.format, text_field=entry.text_field, label_field=entry.label_field,
                entities_field=entry.entities_field, question_field=entry.question_field,
                answer_field=entry.answer_field, context_field=entry.context_field,
                image_field=entry.image_field, label_set=list(spec.labels), multi_label=spec.multi_label)


def read_ids(entry: DatasetEntry, *, rows: int | None = None) -> list[str]:
    """The patient id of every row of ``entry``'s training data (the ``group_field``; OMOP: person_id, FHIR:
    subject.reference), in row order; with ``rows``, checked to line up with that many examples."""
    if entry.source is None:
        from fedclinic.data.patient_ids import patient_ids_for, read_patient_ids

        if rows is None:
            return read_patient_ids(entry.path, group_field=entry.group_field, format=entry.format)
        return patient_ids_for(entry.path, group_field=entry.group_field, format=entry.format, rows=rows)
    ids = []
    for r in entry.source.records("train"):
        value = r.patient_id
        if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
            raise DatasetError(f"{r.where}: no patient id; every row of a dataset protected per patient needs its "
                               "patient's id", rule=MISSING_ID, row=r.row)
        ids.append(str(value).strip())
    if rows is not None and len(ids) != rows:
        raise DatasetError(f"{entry.source.where}: {len(ids)} patient ids for {rows} examples; the source changed "
                           "between two reads, or some rows are not examples", rule="the patient ids do not line up "
                           "with the examples")
    return ids


__all__ = ["SOURCE_FAMILIES", "has_eval", "read_ids", "read_rows", "reader_kwargs"]
