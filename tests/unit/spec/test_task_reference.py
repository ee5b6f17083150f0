"""docs/task-reference.md lists every task.toml key with the default the code has (fedclinic.spec.task and the
tables it reads): a key added to the code, or a default changed there, fails here until the page says it. (A row
for a key the code does not have is not caught by the field check: the sections' own key tuples are compared
exactly.)"""

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
#: Task fields that are not keys written by hand: the [strategy] table's parameters; where a pos_weight of
#: "from-statistics:..." came from (the SDK sets it when it resolves one)
NOT_KEYS = {"strategy_params", "pos_weight_source"}
#: tables whose keys are listed in a section of their own (the top level shows each as an empty table)
TABLES = ("model_config", "privacy", "secure_aggregation", "verification")
#: the sections a plain Task field may be written in
FIELD_SECTIONS = ("Top level", "[training]", "[rounds]", "[update]")


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


def test_every_task_field_is_listed_with_its_default():
    page = {key: (section, default) for section in FIELD_SECTIONS for key, default in _page(section).items()}
    code = _code_defaults([f.name for f in fields(Task) if f.name not in NOT_KEYS])
    assert {k: page[k][1] if k in page else "(not on the page)" for k in code} == code
    for section, keys in (("[training]", task_module._TRAIN), ("[rounds]", task_module._ROUNDS),
                          ("[update]", task_module._UPDATE)):
        assert {k for k, (where, _) in page.items() if k in keys} == set(keys)
        assert all(page[k][0] == section for k in keys), section
    assert all(page[t] == ("Top level", "{}") for t in TABLES)


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


def test_evaluation_and_statistics_tables():
    for section, keys_name, config in (("[evaluation]", "EVALUATION_KEYS", "evaluation_config"),
                                       ("[statistics]", "STATISTICS_KEYS", "statistics_config")):
        keys = getattr(task_module, keys_name, None)
        if keys is None:  # the table does not exist in this code yet
            continue
        cfg = getattr(task_module, config)({})
        assert _page(section) == {k: _toml(getattr(cfg, k)) for k in keys}, section


def test_verification_and_model_config_keys():
    assert _page("[verification]") == {"publish_updates": "false"}
    assert task_module.verification_input_problems({"publish_updates": True}) == []
    from fedclinic.spec.capabilities import POOLINGS

    assert _page("[model_config]") == {"pooling": _toml(POOLINGS[0])}


def test_the_data_scientist_guide_links_the_reference():
    guide = (PAGE.parent / "data-scientist.md").read_text()
    assert re.search(r"\]\(task-reference\.md\)", guide)
