"""Headless Chromium for browser tests: Debian's chromium (scripts/install_chromium.sh), driven by Playwright.

Playwright's own browser download is never used: the system binary is launched by path (``$FEDCLINIC_CHROMIUM``,
else ``chromium`` / ``chromium-browser`` on PATH), with ``--no-sandbox`` when running as root (CI), where
Chromium's sandbox refuses to start.
"""

from __future__ import annotations

import os
import shutil
from typing import Any


def chromium_path() -> str:
    """The Chromium binary to drive; an AssertionError saying how to install it when there is none."""
    path = os.environ.get("FEDCLINIC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, ("no Chromium found: run scripts/install_chromium.sh (as root; `make test` does) or set "
                  "FEDCLINIC_CHROMIUM to a Chromium binary")
    return path


def launch_chromium(playwright: Any) -> Any:
    """A headless Chromium browser from ``playwright`` (``sync_playwright()``'s object)."""
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    return playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                      args=[*args, "--disable-gpu", "--disable-dev-shm-usage"])
