"""docs/results/reliability.md from the parts' JSON fragments (campaign.fragment.Fragment)."""

from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path

from campaign.fragment import Fragment

HEADER = """# Reliability campaign

`make campaign` (issue 16) runs every part below on one machine, loopback only, against real processes (the
aggregator, hospital agents and `fedclinic serve`, with certificates from fedclinic's own PKI). `make test` runs a
smoke of each part (tests/campaign/). Figures below are from the last full run; rerun with `make campaign`.
"""


def _machine() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import os

    return (f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at commit {commit} on {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, {platform.system()} {platform.machine()}.")


def write_report(fragments_dir: Path, out: Path) -> Path:
    from campaign.run import PARTS

    lines = [HEADER, _machine(), ""]
    total = 0.0
    summary = ["| part | verdict | wall time |", "|---|---|---|"]
    sections: list[str] = []
    for part in PARTS:
        path = fragments_dir / f"{part}.json"
        if not path.exists():
            summary.append(f"| {part} | not run | |")
            continue
        frag = Fragment.load(path)
        total += frag.wall_s
        verdict = ("ok: " if frag.ok else "FAILED: ") + frag.summary
        summary.append(f"| {frag.title} | {verdict} | {frag.wall_s / 60:.1f} min |")
        sec = [f"## {frag.title}", ""]
        if frag.rows:
            sec += ["| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in frag.rows] + [""]
        if frag.findings:
            sec += ["Found and handled:", ""] + [f"- {f}" for f in frag.findings] + [""]
        sections += sec
    summary.append(f"| **all** | | **{total / 60:.1f} min** |")
    lines += summary + [""] + sections
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out
