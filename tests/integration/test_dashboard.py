"""``fedclinic dashboard`` (issue 20 item 2) in a real headless Chromium, over a real federation.

Two sites train a tiny task; site-b holds it for its IT's manual approval, so round 1 waits with site-b marked
held. The page (served by the `fedclinic dashboard` command in its own process, with the scientist's certificate)
is watched in Chromium as the hold shows, then site-b is approved and the rounds close: the same page load shows
them appear, their plots, the cross-site evaluation matrix and the task's events. Requests without the launch
token, with a foreign Host (DNS rebinding) or writing anything are refused.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import subprocess
import sys
import threading
import urllib.parse
from typing import Callable

import pytest
from playwright import sync_api as playwright_api

from fedclinic.client import held_sites
from fedclinic.federation.local_federation import LocalFederation, SiteSetup, wait_until
from hospital_agent.gates import HOLD_AWAITING_APPROVAL

from tests.helpers.browser import launch_chromium
from tests.helpers.federation import streams_open
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package, write_site_data

pytestmark = pytest.mark.integration

ROUNDS = 2


def _start_dashboard(fed: LocalFederation) -> tuple[subprocess.Popen, Callable[[], str]]:
    """`fedclinic dashboard --port 0` as the scientist (settings from the environment, as for `task status`);
    returns the process and a function waiting for the URL it prints (so the agents start meanwhile)."""
    c = fed.creds("scientist")
    env = {**os.environ, "FEDCLINIC_ADDRESS": fed.address, "FEDCLINIC_CERT": c["cert"], "FEDCLINIC_KEY": c["key"],
           "FEDCLINIC_CA": c["ca"], "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fedclinic.cli", "dashboard", "--port", "0", "--poll", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []

    def url_printed() -> bool:
        while not lines.empty():
            seen.append(lines.get())
        return any("?token=" in line for line in seen)

    def url() -> str:
        wait_until(url_printed, 60, "the dashboard to print its URL",
                   check=lambda: proc.poll() is None or pytest.fail("dashboard exited:\n" + "".join(seen)))
        return next(line.strip() for line in seen if "?token=" in line)

    return proc, url


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the federation, the dashboard's URL): two agents (site-b with manual approval) and the dashboard process."""
    root = tmp_path_factory.mktemp("dashboard")
    sites = []
    for i, name in enumerate(("site-a", "site-b")):
        train = write_site_data(root / "data" / name, 24, seed=i)
        held = write_site_data(root / "held" / name, 16, seed=10 + i)
        sites.append(SiteSetup(name, datasets={"notes": {"path": str(train), "format": "jsonl",
                                                         "eval_path": str(held)}},
                               policy={"approval": "manual"} if name == "site-b" else None))
    with LocalFederation(root / "fed", sites, agent_threads=1) as f:
        f.make_pki()
        f.start_aggregator()
        proc, url = _start_dashboard(f)  # its start overlaps the agents'
        try:
            for site in f.sites:
                f.start_agent(site)
            printed = url()
            wait_until(lambda: streams_open(f) == {"site-a", "site-b"}, 60, "both agents' work streams")
            yield f, printed
        finally:
            proc.terminate()
            proc.wait(20)


@pytest.fixture(scope="module")
def fed(served):
    return served[0]


@pytest.fixture(scope="module")
def dashboard(served):
    return served[1]


@pytest.fixture(scope="module")
def page():
    with playwright_api.sync_playwright() as pw:
        browser = launch_chromium(pw)
        yield browser.new_page(viewport={"width": 1280, "height": 900})
        browser.close()


def _get(url: str, path: str, *, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, headers=headers or {})
        answer = conn.getresponse()
        body = answer.read()
        return answer.status, json.loads(body) if body.startswith(b"{") else {"body": body.decode()}
    finally:
        conn.close()


def test_the_page_marks_the_held_site_then_shows_rounds_plots_and_results_as_the_task_runs(fed, dashboard, page):
    with fed.client() as client:
        st = client.submit(make_task(name="dashboard-it", num_rounds=ROUNDS, min_sites=1, local_epochs=1),
                           package=tiny_package("logreg"))
        page.goto(f"{dashboard}#{st.task_id}")
        # round 1 waits: site-a reports, site-b holds the task for its IT's approval, and the page says so
        held_row = page.locator('tr.site-held[data-site="site-b"]')
        held_row.wait_for(timeout=60_000)
        assert HOLD_AWAITING_APPROVAL in held_row.inner_text()
        page.locator('tr.site-reported[data-site="site-a"]').wait_for(timeout=60_000)
        assert held_sites(client.status(st.task_id)) == {"site-b": HOLD_AWAITING_APPROVAL}
        assert page.locator("tr.round-closed").count() == 0
        assert page.locator('li.task.selected[data-task="%s"]' % st.task_id).count() == 1

        approve = subprocess.run([sys.executable, "-m", "hospital_agent.cli", "tasks", "approve", st.task_id,
                                  "--config", str(fed.agent_config_path("site-b"))],
                                 capture_output=True, text=True, timeout=120)
        assert approve.returncode == 0, approve.stderr

        # the same page load (no navigation) shows the rounds close, the task complete and its final results
        # (locators, not wait_for_function: the page's Content-Security-Policy forbids evaluating strings)
        page.locator("tr.round-closed").nth(ROUNDS - 1).wait_for(timeout=90_000)
        page.locator('body[data-state="completed"]').wait_for(state="attached", timeout=90_000)
        page.locator("table.matrix").wait_for(timeout=60_000)
        final = client.status(st.task_id)

    assert page.locator("tr.site-held").count() == 0  # the hold is gone once site-b approved and reported
    assert page.locator('tr.site-reported[data-site="site-b"]').count() == 1
    # plots: one point per closed round and series, server-rendered SVG in the page
    assert page.locator('svg[data-plot="bytes"] circle.pt').count() == 2 * ROUNDS  # up and down
    up = page.locator('svg[data-plot="bytes"] polyline[data-series="up"]').get_attribute("points")
    assert len(up.split()) == ROUNDS
    sites_plot = page.locator('svg[data-plot="sites"]')
    assert sites_plot.locator("circle.pt").count() == 2 * ROUNDS  # both sites, every round
    assert {sites_plot.locator("polyline").nth(i).get_attribute("data-series") for i in range(2)} == \
        {"site-a", "site-b"}
    assert page.locator('svg[data-plot="global"] circle.pt').count() >= ROUNDS
    # the round table carries the same byte counts the control API reports
    first = page.locator('tr.round[data-round="1"]').inner_text()
    assert "closed" in first and f"{len(final.rounds[0].reports)}/{final.rounds[0].sites_target}" in first
    # the cross-site evaluation matrix: both sites x the final model, and the pooled row
    matrix = page.locator("table.matrix").inner_text()
    assert "site-a" in matrix and "site-b" in matrix and "pooled" in matrix and "final" in matrix
    # the task's events, from its trail
    events = page.locator("#events").text_content()  # the newest listed, the earlier ones folded
    assert "held" in events and "round-closed" in events and "completed" in events


def test_requests_without_the_token_with_a_foreign_host_or_writing_are_refused(fed, dashboard, page):
    parts = urllib.parse.urlsplit(dashboard)
    token = urllib.parse.parse_qs(parts.query)["token"][0]
    with fed.client() as client:  # a task of its own (site-b holds it; cancelled at the end)
        task_id = client.submit(make_task(name="dashboard-guard", num_rounds=1, min_sites=2),
                                package=tiny_package("logreg")).task_id
    try:
        _check_refusals(dashboard, page, token, task_id)
    finally:
        with fed.client() as client:
            client.cancel(task_id, "end of the test")


def _check_refusals(dashboard: str, page, token: str, task_id: str) -> None:
    parts = urllib.parse.urlsplit(dashboard)
    ok, doc = _get(dashboard, f"/api/tasks/{task_id}", headers={"X-Fedclinic-Token": token})
    assert ok == 200 and doc["task"]["task_id"] == task_id, doc
    for path, headers in (("/api/tasks", {}), (f"/api/tasks/{task_id}", {}), ("/", {}),
                          ("/static/dashboard.js", {}), ("/api/tasks?token=wrong" + token[5:], {}),
                          ("/api/tasks", {"X-Fedclinic-Token": token[:-1]})):
        status, doc = _get(dashboard, path, headers=headers)
        assert status == 403 and "token" in doc["error"], (path, status, doc)
        assert task_id not in json.dumps(doc)
    # DNS rebinding: the right token from a page whose name resolved to 127.0.0.1 still carries its own Host
    status, doc = _get(dashboard, f"/api/tasks/{task_id}",
                       headers={"X-Fedclinic-Token": token, "Host": f"attacker.example:{parts.port}"})
    assert status == 403 and "Host" in doc["error"]
    # read-only: no method but GET (and HEAD) is answered, whatever the path
    for method in ("POST", "PUT", "DELETE"):
        status, doc = _get(dashboard, f"/api/tasks/{task_id}", method=method, headers={"X-Fedclinic-Token": token})
        assert status == 405 and "read-only" in doc["error"]
    # in the browser: the page without its token shows the refusal and nothing of the tasks
    answer = page.goto(f"{parts.scheme}://{parts.netloc}/#{task_id}")
    assert answer.status == 403 and task_id not in page.content()
    assert answer.headers["content-security-policy"].startswith("default-src 'none'")


def test_https_serves_the_same_page_with_a_server_certificate_and_still_needs_the_token(fed):
    """The HTTPS path `--allow-remote` requires, tried on loopback (tests never bind beyond it)."""
    import ssl

    from fedclinic.dashboard.server import DashboardServer

    c = fed.creds("aggregator")  # a server certificate of the federation's CA, for localhost
    with fed.client() as client:
        server = DashboardServer(client, "127.0.0.1", 0, https_cert=c["cert"], https_key=c["key"], poll_s=1.0)
        server.start_in_thread()
        try:
            assert server.url.startswith("https://127.0.0.1:")
            ctx = ssl.create_default_context(cafile=c["ca"])
            ctx.check_hostname = False  # the certificate names localhost; the URL has the address
            for token, expected in ((server.token, 200), ("", 403)):
                conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=ctx, timeout=30)
                conn.request("GET", "/api/tasks", headers={"X-Fedclinic-Token": token})
                answer = conn.getresponse()
                body = json.loads(answer.read())
                conn.close()
                assert answer.status == expected, body
            plain = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
                plain.request("GET", "/api/tasks", headers={"X-Fedclinic-Token": server.token})
                plain.getresponse().read()
            plain.close()
        finally:
            server.stop()
