"""Small helpers to read TOML configuration with environment overrides and clear errors."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Iterable

from fedclinic.errors import ConfigError


def load_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"configuration file {p} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{p} is a folder; give the configuration file inside it (e.g. {p / 'agent.toml'})") from None
    except PermissionError:
        raise ConfigError(f"{p} cannot be read by this user; run as the service's user or fix its permissions") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from None


def env_overrides(doc: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Apply ``PREFIX_SECTION__KEY=value`` (or ``PREFIX_KEY``) environment variables onto ``doc``.

    Values are parsed as TOML scalars when possible (``7``, ``true``, ``"x"``), else taken as strings.
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}
    for name, raw in os.environ.items():
        if not name.startswith(prefix + "_"):
            continue
        path = name[len(prefix) + 1:].lower().split("__")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment variable {name} addresses a value, not a section")
        node[path[-1]] = value
    return out


def require(doc: dict[str, Any], dotted: str, kind: type, source: str) -> Any:
    node: Any = doc
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"{source}: missing required setting {dotted!r}")
        node = node[part]
    if not isinstance(node, kind):
        raise ConfigError(f"{source}: setting {dotted!r} must be a {kind.__name__}, got {type(node).__name__}")
    return node


def refuse_unknown(section: Any, known: Iterable[str], where: str, env_prefix: str = "") -> None:
    """Raise :class:`ConfigError` if ``section`` (a TOML table) has keys outside ``known``: a misspelt key
    (``aproval``, ``crl_path``) would otherwise be ignored and its default used without a word. ``env_prefix``
    names the environment overrides (:func:`env_overrides`) the key may also have come from."""
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a table, got {type(section).__name__}")
    known = sorted(known)
    unknown = sorted(set(section) - set(known))
    if unknown:
        env = f" (in the file or from a {env_prefix}_* environment variable)" if env_prefix else ""
        raise ConfigError(f"{where}: unknown setting(s) {unknown}{env}; known: {', '.join(known)}")
