"""A FHIR R4 bulk-data export (NDJSON) as a data source: DocumentReference and DiagnosticReport texts and codes.

Settings (``[datasets.NAME]`` of agent.toml)::

    source = "fhir"
    path = "/data/fhir-export"        # the export's folder (its *.ndjson files) or one .ndjson file
    eval_path = "/data/fhir-heldout"  # optional: another export, the held-out split (or eval_share, label_map)
    resource_types = ["DocumentReference", "DiagnosticReport"]   # default: both
    unmapped_label = "other"          # optional (label_map)

    [datasets.NAME.labels]            # a coding -> label name: "system|code", or "code" for any system
    "http://snomed.info/sct|53741008" = "cardio"

Each resource is parsed with ``fhir.resources`` (the R4B models: R4's DocumentReference and DiagnosticReport
with R4's fields) and becomes one row:

    text     = the first text/* attachment: DocumentReference.content[].attachment,
               DiagnosticReport.presentedForm[]; its base64 ``data``, or its ``url`` "Binary/ID" resolved against a
               Binary resource of the same export; a DiagnosticReport without one: its ``conclusion`` (inline text)
    labels   = the mapped codings of DocumentReference.type / .category, DiagnosticReport.code / .category /
               .conclusionCode
    patient  = subject.reference (e.g. "Patient/123")

Rows come in file-name order, then line order. A line that is not JSON, not a valid resource of its type, or
has no text is a bad row: DatasetError naming the file, the line and the reason (with ``on_bad_row``: handed
to it and skipped). Resources of other types (Patient, Encounter...) are ignored; a resource none of whose
codings is mapped is left out (or labelled ``unmapped_label``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

from fedclinic.data.files import decode_guard, open_text
from fedclinic.data.sources.label_map import eval_share, optional_label, parse_label_map, split_of
from fedclinic.data.sources.records import DataSource, Record, SourceCheck
from fedclinic.errors import ConfigError, DatasetError, FedclinicError

FHIR_KEYS = ("path", "eval_path", "resource_types", "labels", "unmapped_label", "eval_share")
RESOURCE_TYPES = ("DocumentReference", "DiagnosticReport")
BAD_JSON = "the row is not valid JSON"
BAD_RESOURCE = "the row is not a valid FHIR R4 resource of its type"
NO_TEXT = "the resource has no text attachment"


class FhirNdjsonSource(DataSource):
    kind = "fhir"
    has_patient_ids = True

    def __init__(self, name: str, path: Path, labels: dict[str, str], *, eval_path: Path | None = None,
                 resource_types: tuple[str, ...] = RESOURCE_TYPES, unmapped_label: str | None = None,
                 eval_share: float = 0.0) -> None:
        super().__init__(name)
        self.path, self.eval_path, self.labels = path, eval_path, labels
        self.resource_types, self.unmapped_label, self.eval_share = resource_types, unmapped_label, eval_share

    @classmethod
    def from_entry(cls, name: str, entry: dict[str, Any], base: Path, where: str) -> "FhirNdjsonSource":
        def p(key: str) -> Path | None:
            value = entry.get(key)
            if value is None:
                return None
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where} {key} must be the path of an NDJSON export folder or file")
            q = Path(value).expanduser()
            return q if q.is_absolute() else base / q

        path = p("path")
        if path is None:
            raise ConfigError(f"{where}: a FHIR source needs path = the bulk export's folder (its *.ndjson files)")
        labels = parse_label_map(entry.get("labels"), where, lambda k: bool(k.strip()),
                                 '"http://snomed.info/sct|53741008"')
        types = entry.get("resource_types", list(RESOURCE_TYPES))
        if not isinstance(types, list) or not types or any(t not in RESOURCE_TYPES for t in types):
            raise ConfigError(f"{where} resource_types must list some of {', '.join(RESOURCE_TYPES)}, got {types!r}")
        share = eval_share(entry.get("eval_share"), where)
        if share and "eval_path" in entry:
            raise ConfigError(f"{where}: set eval_path (a separate export) or eval_share (a share of the patients), "
                              "not both")
        return cls(name, path, labels, eval_path=p("eval_path"), resource_types=tuple(types),
                   unmapped_label=optional_label(entry.get("unmapped_label"), where), eval_share=share)

    @property
    def where(self) -> str:
        return f"dataset {self.name!r} (FHIR NDJSON {self.path})"

    @property
    def has_eval(self) -> bool:
        return self.eval_path is not None or self.eval_share > 0

    def files(self, root: Path) -> list[Path]:
        """The export's NDJSON files (DatasetError when there are none)."""
        if root.is_file():
            return [root]
        if not root.is_dir():
            raise DatasetError(f"{root}: no such export folder or file; check path / eval_path",
                               rule="the dataset file is missing")
        found = sorted(q for q in root.iterdir() if q.suffix.lower() in (".ndjson", ".jsonl") and q.is_file())
        if not found:
            raise DatasetError(f"{root}: the folder holds no .ndjson file; point path at the bulk export's output "
                               "folder", rule="the dataset file is missing")
        return found

    def records(self, split: str = "train",
                on_bad_row: Callable[[DatasetError], None] | None = None) -> list[Record]:
        self._split(split)
        root = self.eval_path if split == "eval" and self.eval_path is not None else self.path
        out = []
        for row in self._rows(root, on_bad_row):
            text, labels, patient, where, row_no = row
            if self.eval_share and split_of(patient, self.eval_share) != split:
                continue
            if not labels and self.unmapped_label is None:
                continue
            out.append(Record(row_no, text, labels or [self.unmapped_label], patient, where=where))
        return out

    def _rows(self, root: Path, on_bad_row: Callable[[DatasetError], None] | None
              ) -> Iterator[tuple[str, list[str], str | None, str, int]]:
        """(text, mapped labels, patient, where, row) of every resource of the configured types."""
        lines = [(f, n, obj) for f in self.files(root) for n, obj in _objects(f, on_bad_row)]
        binaries = {obj.get("id"): obj for _, _, obj in lines if obj.get("resourceType") == "Binary"}
        row_no = 0
        for f, n, obj in lines:
            if obj.get("resourceType") not in self.resource_types:
                continue
            row_no += 1
            try:
                yield self._row(obj, binaries, f"{f}: line {n}", row_no)
            except DatasetError as exc:
                if on_bad_row is None:
                    raise
                on_bad_row(exc)

    def _row(self, obj: dict, binaries: dict, where: str, row_no: int) -> tuple[str, list[str], str | None, str, int]:
        model = _model(obj["resourceType"])
        try:
            res = model.model_validate(obj)
        except Exception as exc:  # pydantic.ValidationError: the first problem, by field
            raise DatasetError(f"{where}: not a valid FHIR R4 {obj['resourceType']}: {_reason(exc)}",
                               rule=BAD_RESOURCE, row=row_no) from None
        if obj["resourceType"] == "DocumentReference":
            attachments = [c.attachment for c in res.content or ()]
            concepts = [res.type] + list(res.category or ())
            fallback = None
        else:
            attachments = list(res.presentedForm or ())
            concepts = [res.code] + list(res.category or ()) + list(res.conclusionCode or ())
            fallback = res.conclusion
        text = _text(attachments, binaries, where, row_no) or fallback
        if not text:
            raise DatasetError(f"{where}: the {obj['resourceType']} has no text/* attachment with data (or a "
                               "Binary of this export) and no conclusion; export the note texts with the resources",
                               rule=NO_TEXT, row=row_no)
        found = []
        for concept in concepts:
            for coding in (concept.coding or ()) if concept is not None else ():
                label = self.labels.get(f"{coding.system}|{coding.code}") or self.labels.get(str(coding.code))
                if label and label not in found:
                    found.append(label)
        patient = res.subject.reference if res.subject is not None else None
        return text, found, patient, where, row_no

    def check(self) -> SourceCheck:
        report = SourceCheck()
        for split, root in (("train", self.path), ("eval", self.eval_path)):
            if root is None:
                continue
            bad: list[DatasetError] = []
            try:
                files = self.files(root)
                rows = list(self._rows(root, bad.append))
            except FedclinicError as exc:
                report.problems.append(str(exc))
                continue
            which = "path" if split == "train" else "eval_path"
            types = Counter()
            for f in files:
                for _, obj in _objects(f, lambda e: None):
                    types[obj.get("resourceType", "?")] += 1
            report.facts.append(f"{which}: {len(files)} NDJSON file(s) in {root}; resources: "
                                + ", ".join(f"{t} {k}" for t, k in sorted(types.items())))
            labelled = [r for r in rows if r[1]]
            per_label = Counter(lab for r in labelled for lab in r[1])
            report.facts.append(f"{which}: {len(rows)} usable {'/'.join(self.resource_types)} row(s), {len(labelled)} "
                                "with a mapped code; per label: "
                                + (", ".join(f"{lab} {k}" for lab, k in sorted(per_label.items())) or "none"))
            for exc in bad[:5]:
                report.problems.append(str(exc))
            if len(bad) > 5:
                report.problems.append(f"... and {len(bad) - 5} more bad row(s) in {root}")
            if len(rows) > len(labelled) and self.unmapped_label is None:
                report.notes.append(f"{which}: {len(rows) - len(labelled)} row(s) have no mapped code and are left out "
                                    "(set unmapped_label to keep them)")
            if not labelled and self.unmapped_label is None and not bad:
                report.problems.append(f"{self.where}: no {'/'.join(self.resource_types)} of {root} has a mapped "
                                       "code; check the [labels] table (\"system|code\" or \"code\")")
        return report


def _objects(path: Path, on_bad_row: Callable[[DatasetError], None] | None) -> Iterator[tuple[int, dict]]:
    with open_text(path) as fh:
        lines = decode_guard(path, fh.read).splitlines()
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict) or not isinstance(obj.get("resourceType"), str):
                raise ValueError("not a FHIR resource (no resourceType)")
        except ValueError as exc:
            error = DatasetError(f"{path}: line {n}: not a FHIR resource in JSON ({exc}); each line of an NDJSON "
                                 "export is one resource", rule=BAD_JSON, row=n)
            if on_bad_row is None:
                raise error from None
            on_bad_row(error)
            continue
        yield n, obj


def _model(resource_type: str):
    if resource_type == "DocumentReference":
        from fhir.resources.R4B.documentreference import DocumentReference

        return DocumentReference
    from fhir.resources.R4B.diagnosticreport import DiagnosticReport

    return DiagnosticReport


def _text(attachments: list, binaries: dict, where: str, row_no: int) -> str | None:
    for att in attachments:
        ctype = (att.contentType or "text/plain").split(";")[0].strip().lower()
        if not ctype.startswith("text/"):
            continue
        data = att.data
        if data is None and att.url and att.url.startswith("Binary/"):
            data = _binary(binaries.get(att.url.removeprefix("Binary/")), where, row_no)
        if data is None:
            continue
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise DatasetError(f"{where}: the attachment's text is not UTF-8; export the notes as UTF-8",
                               rule="the attachment's text is not UTF-8", row=row_no) from None
    return None


def _binary(obj: dict | None, where: str, row_no: int) -> bytes | None:
    if obj is None:
        return None
    from fhir.resources.R4B.binary import Binary

    try:
        return Binary.model_validate(obj).data
    except Exception as exc:
        raise DatasetError(f"{where}: its Binary is not valid: {_reason(exc)}", rule=BAD_RESOURCE, row=row_no) from None


def _reason(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            return f"{'.'.join(str(x) for x in first.get('loc', ()))}: {first.get('msg', '')}".strip(": ")
        except Exception:
            pass
    return str(exc).splitlines()[0]


__all__ = ["FHIR_KEYS", "FhirNdjsonSource", "RESOURCE_TYPES"]
