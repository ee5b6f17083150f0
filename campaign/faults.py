"""Campaign part ``faults``: real tasks over a bad network, every task ending within its deadlines.

    python -m campaign.faults [--smoke] [--out FILE] [--aggregator-state JSON]

One aggregator and several hospital agents (real processes, real certificates, loopback only:
:class:`~fedclinic.federation.local_federation.LocalFederation`), each agent dialing the aggregator through
its own :class:`~campaign.fault_proxy.FaultProxy` (one hospital link each). Each scenario sets a fault on
every link, runs one task (a small LSTM whose 7.7 MB embedding makes model fetches and updates several
2 MiB chunks; short round timeouts), optionally heals the links after a while, and checks:

- the task ends (completed, or failed with a reason) within its deadlines: every round closed by its
  deadline (plus the deadline ticker's grace), the task by ``num_rounds x round_timeout_s`` (plus grace);
- no update lost or counted twice: each round's reports name a site at most once, the aggregator's audit
  records at most one ``update.received`` per (site, round), and every update an agent saw acknowledged
  for a round that closed is among that round's reports;
- resumption: transfers continued after a cut (the agents' logs), the bytes sent again because of the cuts
  (what the links forwarded beyond the fault-free baseline scenario) and the bytes a restart from the first
  byte would have sent again (what had passed before each cut): the difference is what resumption saved.

The figures go to the fragment's rows (per scenario: faults injected, tasks, outcome, resumed transfers,
bytes re-sent, bytes saved) and to docs/results/reliability.md through ``campaign.report``. ``--smoke`` runs
three scenarios with two agents (under a minute); the full part runs every scenario with three (a few
minutes).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from campaign.fault_proxy import DIRECTIONS, FaultProxy
from campaign.fragment import Fragment

ROUND_TIMEOUT_S = 40.0
GRACE_S = 8.0  # the aggregator's deadline ticker and the task's final write
CUT_LINK_BYTES_PER_S = 8e6  # a link's pace while a cut is armed: the receiver takes in each chunk as it comes


@dataclass
class Scenario:
    """One fault on every link, set when the task is submitted: ``arm(proxy)``, or with ``cut`` = (direction,
    fractions) a reset of link i at fraction ``fractions[i % len]`` of the transfer in that direction (several
    cut points across the links). After ``heal_after_s`` (if set) the links pass again."""

    name: str
    arm: Callable[[FaultProxy], None] | None = None
    cut: tuple[str, tuple[float, ...]] | None = None
    heal_after_s: float | None = None
    num_rounds: int = 1

    def cut_points(self, n_links: int, sizes: "Sizes") -> list[int]:
        """The byte at which each link is cut (empty without ``cut``)."""
        if self.cut is None:
            return []
        direction, fractions = self.cut
        size = sizes.model if direction == "down" else sizes.update
        return [int(size * fractions[i % len(fractions)]) for i in range(n_links)]

    def apply(self, proxies: list[FaultProxy], sizes: "Sizes") -> None:
        for proxy, at in zip(proxies, self.cut_points(len(proxies), sizes)):
            proxy.reset_after(at, self.cut[0], bytes_per_s=CUT_LINK_BYTES_PER_S)  # type: ignore[index]
        if self.arm is not None:
            for proxy in proxies:
                self.arm(proxy)


@dataclass
class Sizes:
    model: int   # bytes of a model fetch (its tensors: the files are the same every task, cached after the first)
    update: int  # bytes of one update (raw float32 deltas of every tensor)


@dataclass
class Outcome:
    scenario: str
    state: str
    error: str = ""
    ended_in_time: bool = True
    rounds_in_time: bool = True
    double_counted: int = 0
    lost: int = 0
    resumed: int = 0
    resets: int = 0
    injected: int = 0  # faults set on the links: resets done, or one per link for the other faults
    forwarded: dict[str, int] = field(default_factory=dict)  # direction -> bytes the links forwarded
    cut_direction: str = ""
    restart_would_resend: int = 0
    problems: list[str] = field(default_factory=list)


def scenarios(smoke: bool) -> list[Scenario]:
    """The scenarios of a run, the fault-free baseline first (its bytes are what every other is compared with)."""
    base = [
        Scenario("pass (baseline)", FaultProxy.set_pass),
        Scenario("reset mid-fetch", cut=("down", (0.35, 0.6, 0.85))),
        Scenario("reset mid-upload", cut=("up", (0.3, 0.55, 0.8))),
        Scenario("black hole 4 s, then pass", FaultProxy.black_hole, heal_after_s=4.0),
    ]
    if smoke:
        return base
    return base + [
        Scenario("latency 200 ms", lambda p: p.set_latency(0.2)),
        Scenario("bandwidth 1 MB/s", lambda p: p.set_bandwidth(1e6)),
        Scenario("reset mid-fetch, early and late", cut=("down", (0.15, 0.95, 0.5))),
        Scenario("reset mid-upload, early and late", cut=("up", (0.1, 0.9, 0.45))),
        Scenario("half-open downlink 8 s, then pass", lambda p: p.half_open("down"), heal_after_s=8.0),
        Scenario("half-open uplink 8 s, then pass", lambda p: p.half_open("up"), heal_after_s=8.0),
        Scenario("black hole past the round timeout", FaultProxy.black_hole, heal_after_s=ROUND_TIMEOUT_S + 10),
        Scenario("two rounds at 1 MB/s", lambda p: p.set_bandwidth(1e6), num_rounds=2),
    ]


def _audit(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FaultRun:
    """The federation, its links and the checks of one campaign run (module docstring)."""

    def __init__(self, root: Path, n_sites: int, state: dict | None = None) -> None:
        from fedclinic.federation.local_federation import LocalFederation, SiteSetup
        from tests.helpers.text_models import wide_package, write_site_data

        self.wide_package = wide_package
        tensors = sum(t.nbytes for t in wide_package().manifest().tensors)
        self.sizes = Sizes(tensors, tensors)  # a fetch after the first: the package files are cached already
        self.tasks = 0
        self.sites = [f"site-{chr(ord('a') + i)}" for i in range(n_sites)]
        setups = [SiteSetup(s, datasets={"notes": {"path": str(write_site_data(root / "data" / s, 24, seed=i)),
                                                   "format": "jsonl"}}) for i, s in enumerate(self.sites)]
        self.fed = LocalFederation(root / "fed", setups, agent_threads=1,
                                   aggregator_settings={"state": state} if state else None)
        self.proxies: list[FaultProxy] = []

    def start(self) -> None:
        from fedclinic.federation.local_federation import wait_until

        self.fed.make_pki()
        self.fed.start_aggregator()
        for site in self.sites:
            proxy = FaultProxy(self.fed.address).start()
            self.proxies.append(proxy)
            self.fed.start_agent(site, address=proxy.address)
        wait_until(lambda: all("connected" in self.fed.log_text(f"agent-{s}") for s in self.sites), 120,
                   "every agent to connect through its link")
        self.run(Scenario("warm-up", FaultProxy.set_pass))  # the package files (the same every task) get cached

    def close(self) -> None:
        self.fed.close()
        for p in self.proxies:
            p.close()

    def _resumed(self) -> int:
        return sum(self.fed.log_text(f"agent-{s}").count("; resuming from") for s in self.sites)

    def run(self, sc: Scenario) -> Outcome:
        """Run one task under ``sc`` and check it (module docstring)."""
        from fedclinic.client import state_name
        from fedclinic.federation.local_federation import wait_until
        from tests.helpers.tasks import make_task

        resumed0 = self._resumed()
        resets0 = sum(p.resets for p in self.proxies)
        fwd0 = {d: sum(p.forwarded(d) for p in self.proxies) for d in DIRECTIONS}
        task = make_task(architecture="lstm", num_rounds=sc.num_rounds, min_sites=len(self.sites), local_epochs=1,
                         round_timeout_s=ROUND_TIMEOUT_S, on_quorum_miss="fail")
        heal = None
        with self.fed.client() as client:
            sc.apply(self.proxies, self.sizes)
            if sc.heal_after_s is not None:
                heal = threading.Timer(sc.heal_after_s, lambda: [p.set_pass() for p in self.proxies])
                heal.start()
            self.tasks += 1  # a fresh model each task: the agents hold none of its tensors, every link fetches it
            st = client.submit(task, package=self.wide_package(seed=self.tasks))
            budget = sc.num_rounds * ROUND_TIMEOUT_S + 2 * GRACE_S

            def ended() -> bool:
                return state_name(client.status(st.task_id).state) in ("completed", "failed", "cancelled")

            try:
                wait_until(ended, budget + 60, f"task of scenario {sc.name!r} to end")
            except Exception as exc:  # noqa: BLE001 - reported as the scenario's failure, the run goes on
                return Outcome(sc.name, "did not end", str(exc), ended_in_time=False)
            finally:
                if heal is not None:
                    heal.cancel()
                for p in self.proxies:
                    p.set_pass()
            final = client.status(st.task_id)
        out = Outcome(sc.name, state_name(final.state), final.error)
        out.ended_in_time = (final.updated_unix_ms - final.created_unix_ms) / 1000 <= budget
        out.rounds_in_time = all(r.closed_unix_ms <= r.deadline_unix_ms + GRACE_S * 1000
                                 for r in final.rounds if r.closed_unix_ms)
        wait_until(lambda: self._quiet(), 60, "the links to go quiet", interval=0.5)
        self._check_counts(final, out)  # after the links went quiet: the agents' audit records are written
        out.resumed = self._resumed() - resumed0
        out.resets = sum(p.resets for p in self.proxies) - resets0
        out.forwarded = {d: sum(p.forwarded(d) for p in self.proxies) - fwd0[d] for d in DIRECTIONS}
        out.cut_direction = sc.cut[0] if sc.cut else ""
        out.injected = out.resets if sc.cut else (0 if sc.arm is FaultProxy.set_pass else len(self.proxies))
        out.restart_would_resend = sum(sc.cut_points(len(self.proxies), self.sizes))
        if out.state != "completed" and not out.error:
            out.problems.append("the task failed without a reason")
        return out

    def _quiet(self) -> bool:
        """No agent is still receiving or sending a transfer of the last task (the links forwarded little lately)."""
        before = sum(p.forwarded("up") + p.forwarded("down") for p in self.proxies)
        time.sleep(0.5)
        return sum(p.forwarded("up") + p.forwarded("down") for p in self.proxies) - before < 64 << 10

    def _check_counts(self, final, out: Outcome) -> None:
        """No update counted twice, none acknowledged and lost (module docstring)."""
        task_id = final.task_id
        for rnd in final.rounds:
            names = [r.site_id for r in rnd.reports]
            out.double_counted += len(names) - len(set(names))
        received: dict[tuple[str, int], int] = {}
        for e in _audit(self.fed.root / "aggregator-state" / "audit.jsonl"):
            if e["kind"] == "update.received" and e.get("task_id") == task_id:
                key = (e["actor"], int(e["details"].get("round", 0)))
                received[key] = received.get(key, 0) + 1
        out.double_counted += sum(n - 1 for n in received.values() if n > 1)
        closed = {r.round: {x.site_id for x in r.reports} for r in final.rounds if r.model_hash}
        for site in self.sites:
            for e in _audit(self.fed.root / f"agent-{site}" / "audit.jsonl"):
                if e["kind"] == "update.sent" and e.get("task_id") == task_id:
                    rnd = int(e["details"]["round"])
                    if rnd in closed and site not in closed[rnd]:
                        out.lost += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m campaign.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="three scenarios, two agents (under a minute)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--aggregator-state", type=json.loads, default=None, metavar="JSON",
                    help="the aggregator's [state] table as JSON (default: the embedded SQLite database)")
    args = ap.parse_args(argv)
    frag = Fragment("faults", "Network faults", smoke=args.smoke)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="fedclinic-faults-") as tmp:
        run = FaultRun(Path(tmp), 2 if args.smoke else 3, args.aggregator_state)
        try:
            run.start()
            for sc in scenarios(args.smoke):
                t0 = time.monotonic()
                out = run.run(sc)
                outcomes.append(out)
                print(f"  {sc.name}: {out.state} in {time.monotonic() - t0:.0f} s, resets={out.resets} "
                      f"resumed={out.resumed} forwarded={out.forwarded}", flush=True)
        finally:
            run.close()
    _report(frag, outcomes, run)
    return frag.finish(args.out)


def _report(frag: Fragment, outcomes: list[Outcome], run: FaultRun) -> None:
    baseline = outcomes[0].forwarded if outcomes else {}
    resets = resumed = resent_total = saved_total = 0
    for o in outcomes:
        d = o.cut_direction
        resent = max(0, o.forwarded.get(d, 0) - baseline.get(d, 0)) if d and o.resets else 0
        saved = max(0, o.restart_would_resend - resent) if o.resets else 0
        resets += o.resets
        resumed += o.resumed
        resent_total += resent
        saved_total += saved
        ok = (o.state in ("completed", "failed") and o.ended_in_time and o.rounds_in_time and not o.double_counted
              and not o.lost and not o.problems and (o.state == "completed" or o.error))
        verdict = "ok" if ok else "FAILED"
        frag.rows.append((o.scenario, f"{o.state}{': ' + o.error[:160] if o.error else ''}; "
                                      f"faults injected {o.injected} ({len(run.sites)} links), resumed transfers "
                                      f"{o.resumed}, "
                                      f"re-sent {resent / 1e6:.1f} MB vs {o.restart_would_resend / 1e6:.1f} MB "
                                      f"by a restart; lost {o.lost}, double-counted {o.double_counted}; {verdict}"))
        if not ok:
            frag.ok = False
            frag.findings.append(f"{o.scenario}: {o.state} {o.error[:120]} (ended in time: {o.ended_in_time}, rounds "
                                 f"in time: {o.rounds_in_time}, lost {o.lost}, double-counted {o.double_counted}"
                                 f"{', ' + '; '.join(o.problems) if o.problems else ''})")
        if o.resets and not o.resumed:
            frag.ok = False
            frag.findings.append(f"{o.scenario}: {o.resets} cut(s) and no transfer resumed")
    frag.figures.update(scenarios=len(outcomes), tasks=len(outcomes), links=len(run.sites),
                        faults_injected=sum(o.injected for o in outcomes), resets=resets,
                        resumed_transfers=resumed, resent_mb=round(resent_total / 1e6, 2),
                        saved_mb=round(saved_total / 1e6, 2),
                        completed=sum(o.state == "completed" for o in outcomes),
                        failed_with_reason=sum(o.state == "failed" and bool(o.error) for o in outcomes),
                        lost=sum(o.lost for o in outcomes), double_counted=sum(o.double_counted for o in outcomes))
    frag.summary = (f"{len(outcomes)} tasks over {len(run.sites)} faulty links: every one ended within its deadlines, "
                    f"0 lost, 0 double-counted; {resumed} transfers resumed after {resets} resets, "
                    f"{saved_total / 1e6:.1f} MB not sent again" if frag.ok else
                    f"{len(frag.findings)} scenario(s) failed their checks")


if __name__ == "__main__":
    raise SystemExit(main())
