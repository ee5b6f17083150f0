"""Walking an argparse command tree: every subcommand, with the help line its parent lists for it."""

from __future__ import annotations

import argparse
from typing import Iterator


def subcommands(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, str | None, argparse.ArgumentParser]]:
    """``(path, help, parser)`` for every subcommand under ``parser``, depth first (path like ``"task submit"``);
    ``help`` is None when the subcommand was added without one."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, child in action.choices.items():
            full = f"{path} {name}".strip()
            yield full, helps.get(name), child
            yield from subcommands(child, full)
