"""Which tensors a task trains and sends, from its regex patterns (no torch needed: the aggregator uses it).

A tensor is selected when it fully matches some trainable pattern (or there are none) and matches no
frozen or private pattern. Private tensors are trained at the site but never leave it.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from fedclinic.errors import ConfigError


def compile_patterns(patterns: Iterable[str], what: str) -> list[re.Pattern[str]]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise ConfigError(f"{what} pattern {p!r} is not a valid regular expression: {exc}") from None
    return out


def select_names(names: Sequence[str], trainable: Iterable[str] = (), frozen: Iterable[str] = (),
                 private: Iterable[str] = ()) -> list[str]:
    """Names (in the given order) that are trained and sent; ConfigError if nothing is left."""
    keep = compile_patterns(trainable, "trainable")
    drop = compile_patterns(frozen, "frozen") + compile_patterns(private, "private")
    chosen = [n for n in names
              if (not keep or any(p.fullmatch(n) for p in keep)) and not any(p.fullmatch(n) for p in drop)]
    if not chosen:
        raise ConfigError("the task's trainable/frozen patterns select no tensor of the model; "
                          f"model tensors look like {list(names)[:4]}")
    return chosen
