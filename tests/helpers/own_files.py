"""A scientist's own files for ``fedclinic simulate`` and file-based experiment grids: a tiny model folder (a
word-level tokenizer; the logreg architecture needs nothing else), a task.toml naming it, and site files in JSONL
and CSV from :mod:`tests.helpers.text_models`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tests.helpers.text_models import make_examples, tiny_tokenizer_json

TASK_TOML = """name = "own-files"
dataset = "notes"
labels = ["cardio", "neuro"]
model = "model"
architecture = "logreg"

[training]
local_epochs = 1
batch_size = 8
learning_rate = 0.1
optimizer = "sgd"
max_length = 16

[rounds]
num_rounds = 2
min_sites = 3
"""


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["text", "label"])
        w.writeheader()
        w.writerows(rows)
    return path


def own_files(folder: Path) -> dict[str, Path]:
    """``folder`` with ``model/``, ``task.toml``, sites ``a.jsonl`` (30 rows), ``b.jsonl`` (20), ``c.csv`` (24)
    and a shared ``test.jsonl`` (16); returns the paths by name (task, a, b, c, test, model)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model").mkdir(exist_ok=True)
    (folder / "model" / "tokenizer.json").write_bytes(tiny_tokenizer_json())
    (folder / "task.toml").write_text(TASK_TOML)
    return {"task": folder / "task.toml", "model": folder / "model",
            "a": write_jsonl(folder / "a.jsonl", make_examples(30, 1)),
            "b": write_jsonl(folder / "b.jsonl", make_examples(20, 2)),
            "c": write_csv(folder / "c.csv", make_examples(24, 3)),
            "test": write_jsonl(folder / "test.jsonl", make_examples(16, 9))}
