"""Load a bench script of ``bench/`` (or a tool of ``scripts/``) as a module, so a test can call its ``main`` (the
benches and tools are scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS_DIR = BENCH_DIR.parent / "scripts"


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` loaded as a fresh module named ``<name>_bench``."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (and pickling-free introspection) look the module up by name
    spec.loader.exec_module(module)
    return module


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` loaded as the module ``<name>`` (registered in sys.modules, as the scripts import each
    other by name; loaded once)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
