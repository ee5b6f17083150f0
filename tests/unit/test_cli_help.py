"""Every subcommand of the three command lines has a help line, and `fedclinic task --help` lists them all."""

from __future__ import annotations

import pytest

from aggregator_service.cli import build_parser as aggregator_parser
from fedclinic.cli import build_parser as fedclinic_parser
from hospital_agent.cli import build_parser as agent_parser

from tests.helpers.cli_tree import subcommands


@pytest.mark.parametrize("build", [fedclinic_parser, agent_parser, aggregator_parser],
                         ids=["fedclinic", "hospital-agent", "fedclinic-aggregator"])
def test_every_subcommand_has_a_help_line(build):
    tree = list(subcommands(build()))
    assert len(tree) >= 4
    missing = [path for path, text, _ in tree if not (text and text.strip())]
    assert not missing, f"subcommands without help=...: {missing}"


def test_task_help_lists_every_task_command_with_a_sentence(capsys):
    parser = fedclinic_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["task", "--help"])
    shown = capsys.readouterr().out
    task = dict((path, text) for path, text, _ in subcommands(parser))
    commands = [p.split()[1] for p in task if p.startswith("task ") and len(p.split()) == 2]
    assert {"submit", "status", "watch", "cancel", "list", "download", "verify"} <= set(commands)
    for name in commands:
        line = next((x for x in shown.splitlines() if x.strip().startswith(name + " ")), "")
        assert line and task[f"task {name}"].split()[0] in line, (name, shown)
