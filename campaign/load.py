"""Load: many agent processes over many rounds; the aggregator's memory and open files stay flat, no update is lost.

    python -m campaign.load [--smoke] [--out FILE] [--agents N] [--rounds R]

One aggregator and N hospital-agent processes (the tiny logreg text task, real processes and certificates) run
one task of R rounds in which every site takes part in every round (min_sites = N). At each round close the
aggregator's resident memory (VmRSS) and open file descriptors (/proc/PID/fd) are sampled. After a warm-up of a
quarter of the rounds (at least two), every sample must lie within ±10 % of the median of those samples; and every
round must count the update of every site (N × R updates, each site once per round), or the part fails naming
the rounds that did not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


from campaign.fragment import Fragment
from campaign.task_watch import TERMINAL, poll_status, submit
from campaign.testbed import make_federation, start_pinned

from tests.helpers.tasks import make_task

TOLERANCE = 0.10


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def pss_bytes(pid: int) -> int:
    """Proportional memory of ``pid`` (Pss of /proc/PID/smaps_rollup: shared pages, e.g. torch's libraries,
    divided among the processes mapping them): what one more agent costs the machine."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def flat(samples: list[int], warmup: int) -> tuple[bool, float]:
    """Are the samples after ``warmup`` within ±10 % of their median? Also returns the largest deviation."""
    rest = samples[warmup:]
    if not rest:
        return True, 0.0
    med = statistics.median(rest)
    dev = max(abs(s - med) / med for s in rest) if med else 0.0
    return dev <= TOLERANCE, dev


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m campaign.load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--agents", type=int)
    ap.add_argument("--rounds", type=int)
    args = ap.parse_args(argv)
    n = args.agents or (3 if args.smoke else 50)  # the smoke: three processes (each start is most of its CPU)
    rounds = args.rounds or (3 if args.smoke else 20)
    frag = Fragment("load", "Load (agents x rounds)", args.smoke)
    samples: dict[int, tuple[int, int]] = {}  # round closed -> (rss, fds)
    agent_rss: list[int] = []
    agent_pss: list[int] = []
    with tempfile.TemporaryDirectory(prefix="campaign-load-") as tmp:
        fed = make_federation(Path(tmp), n, log_level="warning")
        with fed:
            start_pinned(fed)
            assert fed.aggregator is not None
            pid = fed.aggregator.pid
            task_id = submit(fed, make_task(name="load", num_rounds=rounds, min_sites=n, round_timeout_s=300,
                                            on_quorum_miss="retry", max_round_retries=2, local_epochs=1))
            t0 = time.monotonic()
            samples[0] = (rss_bytes(pid), open_fds(pid))
            last = 0
            while True:
                st = poll_status(fed, task_id)
                if st is not None:
                    closed = sum(1 for r in st.rounds if r.reports and (r.round < st.current_round
                                                                            or st.state in TERMINAL))
                    if closed > last:
                        samples[closed] = (rss_bytes(pid), open_fds(pid))
                        last = closed
                    if st.state in TERMINAL:
                        break
                if time.monotonic() - t0 > 1500:
                    break
                if fed.aggregator.poll() is not None:
                    break
                time.sleep(0.2)
            wall = time.monotonic() - t0
            agent_rss = [rss_bytes(p.pid) for p in fed.agents.values() if p.poll() is None]
            agent_pss = [pss_bytes(p.pid) for p in fed.agents.values() if p.poll() is None]
            crashed = [s for s, p in fed.agents.items() if p.poll() is not None]
            if fed.aggregator.poll() is not None:
                crashed.append("aggregator")
    report(frag, st, n, rounds, samples, agent_rss, agent_pss, crashed, wall)
    return frag.finish(args.out)


def report(frag: Fragment, st, n: int, rounds: int, samples: dict[int, tuple[int, int]], agent_rss: list[int],
           agent_pss: list[int], crashed: list[str], wall: float) -> None:
    from fedclinic.client import state_name

    per_round = {r.round: sorted(x.site_id for x in r.reports) for r in st.rounds} if st is not None else {}
    counted = sum(len(v) for v in per_round.values())
    short = [f"round {r}: {len(v)} of {n}" for r, v in sorted(per_round.items()) if len(v) != n]
    twice = [f"round {r}" for r, v in per_round.items() if len(set(v)) != len(v)]
    closes = [r for r in sorted(samples) if r > 0]
    rss = [samples[r][0] for r in closes]
    fds = [samples[r][1] for r in closes]
    warmup = max(2, len(closes) // 4)
    rss_ok, rss_dev = flat(rss, warmup)
    fds_ok, fds_dev = flat(fds, warmup)
    mib = 1 << 20
    frag.rows += [
        ("agents x rounds", f"{n} x {rounds}"),
        ("task", state_name(st.state) if st is not None else "no status"),
        ("updates expected / counted", f"{n * rounds} / {counted}"),
        ("aggregator RSS at start, MiB", f"{samples[0][0] / mib:.0f}"),
        ("aggregator RSS per round close, MiB (first, min, max, last)",
         ", ".join(f"{v / mib:.0f}" for v in (rss[0], min(rss), max(rss), rss[-1])) if rss else "none"),
        ("aggregator open fds per round close (first, min, max, last)",
         ", ".join(str(v) for v in (fds[0], min(fds), max(fds), fds[-1])) if fds else "none"),
        (f"largest deviation from the median after {warmup} warm-up rounds (RSS, fds)",
         f"{rss_dev * 100:.1f} %, {fds_dev * 100:.1f} %"),
        ("agent RSS, MiB (mean, max)", f"{statistics.mean(agent_rss) / mib:.0f}, {max(agent_rss) / mib:.0f}"
         if agent_rss else "none"),
        ("agent PSS (shared pages divided among the agents), MiB (mean, sum)",
         f"{statistics.mean(agent_pss) / mib:.0f}, {sum(agent_pss) / mib:.0f}" if agent_pss else "none"),
        ("wall time of the task, s", f"{wall:.0f}"),
    ]
    problems = []
    if st is None or state_name(st.state) != "completed":
        problems.append(f"the task did not complete: {st.error if st is not None else 'no status'}")
    if short:
        problems.append("rounds without every site's update: " + ", ".join(short))
    if twice:
        problems.append("a site counted twice in " + ", ".join(twice))
    if not rss_ok:
        problems.append(f"aggregator RSS not flat: {rss_dev * 100:.1f} % off the median after warm-up")
    if not fds_ok:
        problems.append(f"aggregator open fds not flat: {fds_dev * 100:.1f} % off the median after warm-up")
    if crashed:
        problems.append(f"processes exited during the run: {', '.join(crashed)}")
    frag.findings += problems
    frag.ok = not problems
    frag.figures.update(agents=n, rounds=rounds, updates_expected=n * rounds, updates_counted=counted,
                        rss_dev_pct=round(rss_dev * 100, 1), fds_dev_pct=round(fds_dev * 100, 1))
    frag.summary = (f"{n} agents x {rounds} rounds: {counted}/{n * rounds} updates counted, aggregator RSS within "
                    f"{rss_dev * 100:.1f} % and fds within {fds_dev * 100:.1f} % after warm-up"
                    + ("" if not problems else "; " + "; ".join(problems)))


if __name__ == "__main__":
    import sys

    sys.exit(main())
