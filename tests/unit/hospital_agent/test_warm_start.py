"""The agent's start-up import of its training stack (hospital_agent/warm_start.py), in a fresh interpreter each
(what a process has imported cannot be undone)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import gc, json, sys
    import hospital_agent.warm_start as w
    w.MODULES = tuple(sys.argv[1:])
    ok = w.preload_training_stack()
    print(json.dumps({"ok": ok, "frozen": gc.get_freeze_count(), "loaded": [m in sys.modules for m in w.MODULES]}))
""")


def _preload(*modules: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_stack_is_imported_and_kept_out_of_later_collections():
    result = _preload("json", "fedclinic.training.trainer")
    assert result["ok"] and result["loaded"] == [True, True]
    assert result["frozen"] > 10_000  # the imported objects sit in the permanent generation


def test_a_module_that_fails_to_import_leaves_the_round_to_report_it():
    result = _preload("json", "fedclinic.no_such_module")
    assert result == {"ok": False, "frozen": 0, "loaded": [True, False]}
