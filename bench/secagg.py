"""Secure aggregation (SecAgg, complete graph) vs plain float aggregation: client and server time and bytes.

Workload: 10 sites x 10 M float32 parameters (40 MB per update, 400 MB in all), one session of
``fedclinic.secagg`` with in-process clients (no transport), quantizer clip 0.5 / 20 bits / stochastic
rounding. Each site's update is generated, then, interleaved so both see the same machine load:

- plain: the server folds the float32 vector into a float32 running sum (``np.add(acc, x, out=acc)``, the
  streaming FedAvg fold; "quantize-free float sum of the same vectors");
- secure: the client quantizes and masks it (k = 9 pairwise masks + 1 self mask, on ``MASK_WORKERS``
  threads over disjoint parts of its vector), the server folds the
  uint32 masked vector into its ring accumulator; after the unmask phase the server rebuilds the self-mask
  seeds and, in one pass over cache-sized chunks on ``MASK_WORKERS`` threads (2 here), removes the masks
  and dequantizes.

Only one update and one masked vector exist at a time (streaming), so memory stays ~ 4 vectors.
A second session drops one site after share-keys, to show the cost of dropout recovery (the server then
expands k more pairwise masks).

The no-dropout session runs 5 times with the default mask workers and 5 times with one (clients and server),
interleaved; each
figure is the minimum over its runs, because the benchmark machine's 2 cores are shared with other work
(the 1-minute load average is printed). Prints client ns per parameter per neighbour (client time / (P * k),
k = 9 neighbours; the self mask and quantization are charged to them), server wall time vs plain, server
CPU time (all threads) vs plain, bytes vs plain, and checks that the secure float sum equals the exact sum
within the documented bound. Target (issue #5): client <= 2 ns/param/neighbour, server <= 1.5x plain.

Where the server's time goes (profiled here): the fold is the same memory-bound ``np.add`` as plain
(~28-36 ms for 10 x 40 MB, = plain). Unmasking costs ~75 ms of CPU: the n self masks are n * P = 100 M
words of AES-256-CTR keystream (~0.5 ns/word on one core: ~51 ms), subtracting them (~0.08 ns/word: ~8 ms)
and dequantizing (~0.7 ns/param: ~8 ms). The server therefore does ~3.8x the plain fold's *work* (the
printed CPU-time ratio), whatever the code, as long as it expands n full-length AES masks; the self-mask
seeds exist only after the unmask phase, so none of it can overlap the fold.

What the threads buy: ``cryptography`` 50.0.2 releases the GIL in ``update_into`` (measured: another
thread runs at full speed during a 400 MB call; an earlier note here said it holds the GIL, which was
measured on a busy box), and the keystream splits over block-aligned CTR counter ranges, so unmasking runs
on both cores. Unmasking alone, interleaved in one process, with no other job on the box: 75.0 ms before
(two single-threaded passes), 75.0 ms fused on 1 thread, 42.3 ms on 2 (median 48.8). With the other core
busy it stays at ~75 ms (within a few %).

Why 1.5x is out of reach on 2 cores: server / plain >= 1 + (unmask CPU / cores) / plain = 1 + 37.5 / 28-36
= 2.0-2.3x even with both cores free, and ~3.8x when only one is. The keystream is the floor; per core,
``cryptography``'s OpenSSL (VAES) makes AES-256-CTR at 0.51 ns/word, against pycryptodome 1.9, the system
OpenSSL 3.0 through ctypes 0.75-0.93 and ChaCha20 0.78; only AES-128 is faster (0.44, -12 %, with half the
key), not worth weakening the masks for. 1.5x needs unmasking in <= 0.5x the plain fold, i.e. ~5 or more
cores if memory bandwidth keeps up (the threads scale to ``MASK_WORKERS`` = min(8, usable cores)), or a
cheaper self-mask construction (a protocol change, not made).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from fedclinic.secagg import ClientSession, InProcessNotary, Quantizer, ServerSession, SessionParams
from fedclinic.secagg.masks import MASK_WORKERS

P = 10_000_000
N = 10
REPEATS = 5
T = TypeVar("T")


def session(drop_after_share: set[str], mask_workers: int = MASK_WORKERS) -> dict[str, float]:
    cohort = tuple(f"hospital-{i:02d}" for i in range(N))
    model_hash = hashlib.sha256(b"bench global model").digest()
    q = Quantizer(clip=0.5, bits=20)
    params = SessionParams("bench", 1, cohort, model_hash, P, quantizer=q)
    t = {"client": 0.0, "server": 0.0, "plain": 0.0, "fold": 0.0, "finish": 0.0, "server_cpu": 0.0, "plain_cpu": 0.0,
         "up_secure": 0, "down_secure": 0}

    def timed(who: str, fn: Callable[..., T], *args: object) -> T:
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args)
        t[who] += time.perf_counter() - t0
        if who + "_cpu" in t:  # CPU time of all threads: the work done, whatever the other load on the box
            t[who + "_cpu"] += time.process_time() - c0
        return out

    server = timed("server", lambda: ServerSession(params, mask_workers=mask_workers))
    notary = InProcessNotary()  # in-process attestations; the services' signatures: docs/results/secagg-keys.md
    clients = {c: timed("client", lambda c=c: ClientSession(c, params, committed_model_hash=model_hash,
                                                            mask_workers=mask_workers, attestor=notary.for_site(c)))
               for c in cohort}
    for c, s in clients.items():
        adv = timed("client", s.advertise)
        t["up_secure"] += adv.payload_bytes()
        timed("server", server.receive_advertise, adv)
    directory = timed("server", server.close_advertise)
    for c, s in clients.items():
        t["down_secure"] += directory.payload_bytes()
        sk = timed("client", s.share_keys, directory)
        t["up_secure"] += sk.payload_bytes()
        timed("server", server.receive_share_keys, sk)
    requests = timed("server", server.close_share_keys)
    plain_acc = np.zeros(P, dtype=np.float32)
    exact = np.zeros(P, dtype=np.float64)
    survivors = [c for c in cohort if c not in drop_after_share]
    for i, c in enumerate(cohort):
        x = (np.random.default_rng(i).standard_normal(P, dtype=np.float32) * 0.05)
        if c not in survivors:
            continue
        timed("plain", np.add, plain_acc, x, plain_acc)
        t["down_secure"] += requests[c].payload_bytes()
        masked = timed("client", clients[c].masked_input, requests[c], x)
        t["up_secure"] += masked.payload_bytes()
        t0 = time.perf_counter()
        timed("server", server.receive_masked_input, masked)
        t["fold"] += time.perf_counter() - t0
        np.add(exact, np.clip(x, -0.5, 0.5), out=exact)  # float64 reference (untimed)
        del x, masked
    consistency = timed("server", server.close_masked_input)
    for c in survivors:
        t["down_secure"] += consistency.payload_bytes()
        signed = timed("client", clients[c].sign_survivors, consistency)
        t["up_secure"] += signed.payload_bytes()
        timed("server", server.receive_survivors_signature, signed)
    unmask = timed("server", server.close_consistency)
    for c in survivors:
        t["down_secure"] += unmask.payload_bytes()
        resp = timed("client", clients[c].unmask, unmask)
        t["up_secure"] += resp.payload_bytes()
        timed("server", server.receive_unmask, resp)
    t0 = time.perf_counter()
    result = timed("server", server.finish)
    t["finish"] = time.perf_counter() - t0
    err = np.abs(result.total.astype(np.float64) - exact)
    t["within_bound"] = float(np.all(err <= q.error_bound(len(survivors), exact)))
    t["max_err"], t["bound"] = float(err.max()), float(result.error_bound)
    t["plain_err"] = float(np.abs(plain_acc.astype(np.float64) - exact).max())
    t["survivors"] = len(survivors)
    return t


def main() -> int:
    k = N - 1
    warm = np.zeros(P, np.float32)
    np.add(warm, 1.0, out=warm)  # fault in allocator pages once
    del warm
    load0 = os.getloadavg()
    # the 2 cores are shared: keep the least disturbed run; the 1-worker sessions show what the threads add
    runs, runs1 = [], []
    for _ in range(REPEATS):
        runs.append(session(set()))
        if MASK_WORKERS > 1:
            runs1.append(session(set(), mask_workers=1))
    r = dict(runs[0])
    for key in ("client", "server", "plain", "fold", "finish", "server_cpu", "plain_cpu"):
        r[key] = min(x[key] for x in runs)
    r["within_bound"] = float(all(x["within_bound"] for x in runs + runs1))
    per_client = r["client"] / N
    ns_pn = per_client / (P * k) * 1e9
    ratio = r["server"] / r["plain"]
    plain_up = N * (P * 4 + len(b"hospital-00"))
    print(f"workload: {N} sites x {P / 1e6:.0f} M float32 parameters, SecAgg complete graph (k = {k} neighbours, "
          "t = 7), quantizer clip 0.5, 20 bits, stochastic rounding")
    print(f"client (per site, all phases):   {per_client * 1e3:8.1f} ms = {per_client / P * 1e9:.2f} ns/param = "
          f"{ns_pn:.3f} ns/param/neighbour ({per_client / (P * (k + 1)) * 1e9:.3f} per mask incl. self)")
    print(f"server secure (all phases):      {r['server'] * 1e3:8.1f} ms = {r['server'] / (N * P) * 1e9:.3f} "
          "ns/param/site")
    print(f"server plain float32 sum:        {r['plain'] * 1e3:8.1f} ms = {r['plain'] / (N * P) * 1e9:.3f} "
          f"ns/param/site -> ratio {ratio:.2f}x")
    print(f"  of which: fold of masked vectors {r['fold'] * 1e3:.1f} ms, unmask (rebuild seeds, expand {N} self masks, "
          f"dequantize; {MASK_WORKERS} mask worker(s)) {r['finish'] * 1e3:.1f} ms")
    print(f"  CPU time (all threads):        server {r['server_cpu'] * 1e3:.1f} ms vs plain "
          f"{r['plain_cpu'] * 1e3:.1f} ms "
          f"-> {r['server_cpu'] / r['plain_cpu']:.2f}x (the work; wall time above also depends on a free second core)")
    if runs1:
        s1, p1, f1, c1 = (min(x[key] for x in runs1) for key in ("server", "plain", "finish", "client"))
        print(f"  same with 1 mask worker:       server {s1 * 1e3:.1f} ms vs plain {p1 * 1e3:.1f} ms -> {s1 / p1:.2f}x "
              f"(unmask {f1 * 1e3:.1f} ms); client {c1 / N * 1e3:.1f} ms = {c1 / N / (P * k) * 1e9:.3f} "
              "ns/param/neighbour")
    print(f"uplink bytes: secure {r['up_secure'] / 1e6:.2f} MB vs plain {plain_up / 1e6:.2f} MB "
          f"({r['up_secure'] / plain_up:.5f}x); downlink secure control messages {r['down_secure'] / 1e3:.1f} kB")
    print(f"accuracy: max |secure - exact| = {r['max_err']:.2e} (bound {r['bound']:.2e}, within: "
          f"{bool(r['within_bound'])}); plain float32 sum max error {r['plain_err']:.2e}")
    d = session({"hospital-03"})
    ratio_d = d["server"] / d["plain"]
    print(f"one site dropped after share-keys: server {d['server'] * 1e3:.1f} ms vs plain {d['plain'] * 1e3:.1f} ms "
          f"-> {ratio_d:.2f}x (within bound: {bool(d['within_bound'])})")
    load1 = os.getloadavg()
    print(f"machine: {len(os.sched_getaffinity(0))} usable cores; 1-min load average {load0[0]:.2f} at start, "
          f"{load1[0]:.2f} at end (other work on the box: every figure is the minimum over {REPEATS} runs)")
    ok = r["within_bound"] and d["within_bound"]
    met = ns_pn <= 2.0 and ratio <= 1.5 and ok
    print(f"RESULT secagg client_ns_per_param_neighbour={ns_pn:.3f} server_ratio={ratio:.2f} "
          f"server_ratio_1drop={ratio_d:.2f} bytes_ratio={r['up_secure'] / plain_up:.5f} exact={'yes' if ok else 'no'} "
          f"target=client<=2ns/param/neighbour,server<=1.5x_plain met={'yes' if met else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
