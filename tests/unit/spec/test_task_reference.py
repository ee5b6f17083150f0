"""docs/task-reference.md lists every task.toml key with the default the code has (fedclinic.spec.task and the
tables it reads): a key added to the code, or a default changed there, fails here until the page says it."""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from fedclinic.secagg import task_config
from fedclinic.spec import task as task_module
from fedclinic.spec.task import PRIVACY_KEYS, Task, privacy_config
from fedclinic.strategies import STRATEGIES

PAGE = Path(__file__).resolve().parents[3] / "docs" / "task-reference.md"
#: Task fields that are not keys of their own: the [strategy] table's parameters
NOT_KEYS = {"strategy_params"}
#: tables whose keys are listed in a section of their own (the top level shows each as an empty table)
TABLES = ("model_config", "privacy", "secure_aggregation", "verification")


def _toml(value: Any) -> str:
    """A default as the page writes it (TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else repr(value)
    return repr(value)


def _sections() -> dict[str, list[list[str]]]:
    """Heading ("Top level", "[training]", ...) -> its table rows, cells stripped of backticks."""
    out: dict[str, list[list[str]]] = {}
    current = ""
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            out[current] = []
        elif line.startswith("| `") and current:
            out[current].append([c.strip().strip("`") for c in line.strip().strip("|").split("|")])
    return out


def _page(section: str) -> dict[str, str]:
    return {row[0]: row[2] for row in _sections()[section]}


def _default(f) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _code_defaults(names) -> dict[str, str]:
    by_name = {f.name: f for f in fields(Task)}
    return {n: "required" if _default(by_name[n]) is None else _toml(_default(by_name[n])) for n in names}


def test_training_rounds_and_update_keys_and_defaults():
    for section, keys in (("[training]", task_module._TRAIN), ("[rounds]", task_module._ROUNDS),
                          ("[update]", task_module._UPDATE)):
        assert _page(section) == _code_defaults(keys), section


def test_top_level_keys_and_defaults():
    sectioned = {*task_module._TRAIN, *task_module._ROUNDS, *task_module._UPDATE, *NOT_KEYS}
    top = [f.name for f in fields(Task) if f.name not in sectioned]
    assert set(TABLES) <= set(top)
    assert _page("Top level") == _code_defaults(top)


def test_strategy_parameters_and_defaults():
    page = {(row[0], row[1]): row[3] for row in _sections()["[strategy]"]}
    code = {}
    for name, cls in STRATEGIES.items():
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            code[(name, p.name)] = _toml(p.default)
    assert page == code


def test_privacy_keys_and_defaults():
    cfg = privacy_config({"level": "sample"})
    code = {k: "required" if k == "level" else _toml(getattr(cfg, k)) for k in PRIVACY_KEYS}
    assert _page("[privacy]") == code


def test_secure_aggregation_keys_and_defaults():
    cfg = task_config.config_from_dict({"enabled": True})
    code = {k: _toml(getattr(cfg, k)) for k in task_config.KEYS}
    # 0 / "" in the spec mean the effective defaults below; the page shows those
    code.update(enabled="false", weighting=_toml(task_config.WEIGHTINGS[0]),
                weight_cap=_toml(task_config.DEFAULT_WEIGHT_CAP), metric_clip=_toml(task_config.DEFAULT_METRIC_CLIP))
    assert _page("[secure_aggregation]") == code


def test_verification_and_model_config_keys():
    assert _page("[verification]") == {"publish_updates": "false"}
    assert task_module.verification_input_problems({"publish_updates": True}) == []
    from fedclinic.spec.capabilities import POOLINGS

    assert _page("[model_config]") == {"pooling": _toml(POOLINGS[0])}


def test_the_data_scientist_guide_links_the_reference():
    guide = (PAGE.parent / "data-scientist.md").read_text()
    assert re.search(r"\]\(task-reference\.md\)", guide)
