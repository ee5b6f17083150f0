"""What one campaign part reports: its figures, the failures it found and its verdict, as one JSON file."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Fragment:
    """One part's report. ``rows`` are (what, figure) pairs shown as a table in reliability.md; ``findings``
    are failures the part met (each one sentence; a finding that was fixed names the test that now covers it);
    ``ok`` is the verdict of the part's own checks (e.g. 0 lost, 0 double-counted, 0 crashes)."""

    part: str
    title: str
    smoke: bool
    ok: bool = True
    summary: str = ""
    rows: list[tuple[str, str]] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    figures: dict[str, float | int | str] = field(default_factory=dict)
    wall_s: float = 0.0
    started: float = field(default_factory=time.time)

    def finish(self, out: Path | None) -> int:
        """Stamp the wall time, write the JSON to ``out`` (when given), print the RESULT line; exit status."""
        self.wall_s = round(time.time() - self.started, 1)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(asdict(self), indent=2) + "\n")
        figures = " ".join(f"{k}={v}" for k, v in self.figures.items())
        print(f"RESULT campaign-{self.part} {figures} wall_s={self.wall_s} met={'yes' if self.ok else 'no'}",
              flush=True)
        return 0 if self.ok else 1

    @classmethod
    def load(cls, path: Path) -> "Fragment":
        data = json.loads(path.read_text())
        data["rows"] = [tuple(r) for r in data.get("rows", [])]
        return cls(**data)
