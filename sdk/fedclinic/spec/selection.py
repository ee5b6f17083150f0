"""Which tensors a task trains and sends, from its regex patterns (no torch needed: the aggregator uses it).

A tensor is selected when it fully matches some trainable pattern (or there are none) and matches no
frozen or private pattern. Private tensors are trained at the site but never leave it. This is the one
implementation: the aggregator, the agent, the simulator and the trainer all call it.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from fedclinic.errors import ConfigError


def compile_patterns(patterns: Iterable[str], what: str) -> list[re.Pattern[str]]:
    if isinstance(patterns, str):
        raise ConfigError("trainable/frozen patterns must be lists of regular expressions, not one string")
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise ConfigError(f"{what} pattern {p!r} is not a valid regular expression ({exc})") from None
    return out


def select_names(names: Iterable[str], trainable: Sequence[str] = (), frozen: Sequence[str] = (),
                 private: Sequence[str] = ()) -> list[str]:
    """Names (in the given order) that are trained and sent.

    ConfigError for an invalid regex, a trainable pattern that matches no tensor (a typo would otherwise
    silently train less), or an empty selection.
    """
    names = list(names)
    keep = compile_patterns(trainable, "trainable")
    drop = compile_patterns(frozen, "frozen") + compile_patterns(private, "private")
    for pat in keep:
        if not any(pat.fullmatch(n) for n in names):
            raise ConfigError(f"trainable pattern {pat.pattern!r} matches no tensor (patterns must match the whole "
                              f"name); names look like {', '.join(repr(n) for n in names[:3])} ... "
                              f"{', '.join(repr(n) for n in names[-2:])}")
    chosen = [n for n in names
              if (not keep or any(p.fullmatch(n) for p in keep)) and not any(p.fullmatch(n) for p in drop)]
    if not chosen:
        raise ConfigError(f"no tensor is left to train: trainable={list(trainable)} frozen={list(frozen)} "
                          f"select nothing out of {len(names)} tensors")
    return chosen


def private_names(names: Iterable[str], patterns: Sequence[str], frozen: Sequence[str] = ()) -> list[str]:
    """Names (in the given order) that fully match some private pattern and no ``frozen`` pattern (a frozen
    tensor is not trained at all); [] when there are no patterns.

    ConfigError for an invalid regex or a pattern that matches no tensor (a typo would otherwise send a
    module the task meant to keep at the sites)."""
    names = list(names)
    compiled = compile_patterns(patterns, "private")
    for pat in compiled:
        if not any(pat.fullmatch(n) for n in names):
            raise ConfigError(f"private pattern {pat.pattern!r} matches no tensor of the model (patterns must match the "
                              f"whole name); names look like {', '.join(repr(n) for n in names[:3])}")
    frozen_re = compile_patterns(frozen, "frozen")
    return [n for n in names if any(p.fullmatch(n) for p in compiled) and not any(p.fullmatch(n) for p in frozen_re)]
