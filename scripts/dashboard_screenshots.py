"""Screenshots of the real dashboard for docs/img (``make dashboard-screenshots``, about a minute on 2 cores).

A local 3-site federation (tiny logistic-regression model on the test suite's synthetic notes; site-c holds the
task for its IT's manual approval) runs a 4-round task with a final cross-site evaluation; the dashboard serves
it with the scientist's certificate and Debian's Chromium, driven by Playwright, takes:

- docs/img/dashboard-held.png: round 1 open, site-c held (awaiting approval), the others reported;
- docs/img/dashboard-completed.png: the finished task: rounds, plots, evaluation matrix, events.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "sdk")]

from fedclinic.dashboard.server import DashboardServer  # noqa: E402
from fedclinic.federation.local_federation import LocalFederation, SiteSetup, wait_until  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from tests.helpers.browser import launch_chromium  # noqa: E402
from tests.helpers.federation import streams_open  # noqa: E402
from tests.helpers.tasks import make_task  # noqa: E402
from tests.helpers.text_models import tiny_package, write_site_data  # noqa: E402

SITES = {"site-a": 40, "site-b": 32, "site-c": 24}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"), help="folder for the PNGs")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fedclinic-shots-") as tmp:
        root = Path(tmp)
        sites = [SiteSetup(name, datasets={"notes": {
                     "path": str(write_site_data(root / "data" / name, n, seed=i)), "format": "jsonl",
                     "eval_path": str(write_site_data(root / "held" / name, n // 2, seed=10 + i))}},
                           policy={"approval": "manual"} if name == "site-c" else None)
                 for i, (name, n) in enumerate(SITES.items())]
        with LocalFederation(root / "fed", sites, agent_threads=1) as fed, sync_playwright() as pw:
            fed.start()
            wait_until(lambda: streams_open(fed) == set(SITES), 60, "the agents' work streams")
            with fed.client() as client:
                server = DashboardServer(client, "127.0.0.1", 0, identity="scientist (scientist)", poll_s=0.5)
                server.start_in_thread()
                st = client.submit(make_task(name="readmission-notes", num_rounds=4, min_sites=2),
                                   package=tiny_package("logreg"))
                browser = launch_chromium(pw)
                page = browser.new_page(viewport={"width": 1280, "height": 760})
                page.goto(f"{server.url}#{st.task_id}")
                page.locator('tr.site-held[data-site="site-c"]').wait_for(timeout=120_000)
                for site in ("site-a", "site-b"):
                    page.locator(f'tr.site-reported[data-site="{site}"]').wait_for(timeout=120_000)
                page.locator("#events tr.event").nth(3).wait_for(timeout=30_000)
                page.screenshot(path=str(out / "dashboard-held.png"))
                subprocess.run([sys.executable, "-m", "hospital_agent.cli", "tasks", "approve", st.task_id,
                                "--config", str(fed.agent_config_path("site-c"))], check=True, capture_output=True)
                page.locator('body[data-state="completed"]').wait_for(state="attached", timeout=300_000)
                page.locator("table.matrix").wait_for(timeout=60_000)
                page.set_viewport_size({"width": 1280, "height": 1000})
                page.screenshot(path=str(out / "dashboard-completed.png"), full_page=True)
                browser.close()
                server.stop()
    for name in ("dashboard-held.png", "dashboard-completed.png"):
        _shrink(out / name)
        print(f"wrote {out / name} ({(out / name).stat().st_size // 1024} KiB)")
    return 0


def _shrink(path: Path) -> None:
    """Re-save ``path`` with a 256-colour palette (the page is flat colours and text: a third of the bytes)."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


if __name__ == "__main__":
    sys.exit(main())
