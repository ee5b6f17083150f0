"""``make campaign``: every part in full, one after the other, then docs/results/reliability.md.

    python -m campaign.run [--smoke] [--parts fuzz,kills,...] [--out-dir build/campaign] [--no-report]

A part that fails its checks does not stop the others; the exit status is 1 when any part failed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

#: in the order they run (and appear in reliability.md)
PARTS = ("fuzz", "kills", "faults", "disk_full", "load")
ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m campaign.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a few cases per part (seconds), as make test runs them")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "build" / "campaign")
    ap.add_argument("--no-report", action="store_true", help="do not (re)write docs/results/reliability.md")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    status = 0
    for part in parts:
        t0 = time.time()
        print(f"== campaign part {part} ({'smoke' if args.smoke else 'full'})", flush=True)
        module = importlib.import_module(f"campaign.{part}")
        rc = module.main((["--smoke"] if args.smoke else []) + ["--out", str(args.out_dir / f"{part}.json")])
        print(f"== campaign part {part}: {'ok' if rc == 0 else 'FAILED'} in {time.time() - t0:.0f} s", flush=True)
        status |= 1 if rc else 0
    if not args.no_report and not args.smoke:
        from campaign.report import write_report

        path = write_report(args.out_dir, ROOT / "docs" / "results" / "reliability.md")
        print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
