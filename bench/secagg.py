"""Secure aggregation (SecAgg, complete graph) vs plain float aggregation: client and server time and bytes.

Workload: 10 sites x 10 M float32 parameters (40 MB per update, 400 MB in all), one session of
``fedclinic.secagg`` with in-process clients (no transport), quantizer clip 0.5 / 20 bits / stochastic
rounding. Each site's update is generated, then, interleaved so both see the same machine load:

- plain: the server folds the float32 vector into a float32 running sum (``np.add(acc, x, out=acc)``, the
  streaming FedAvg fold; "quantize-free float sum of the same vectors");
- secure: the client quantizes and masks it (k = 9 pairwise masks + 1 self mask), the server folds the
  uint32 masked vector into its ring accumulator; after the unmask phase the server rebuilds the self-mask
  seeds, removes the masks and dequantizes.

Only one update and one masked vector exist at a time (streaming), so memory stays ~ 4 vectors.
A second session drops one site after share-keys, to show the cost of dropout recovery (the server then
expands k more pairwise masks).

The no-dropout session runs 3 times and each time (client, server, plain) is the minimum over the runs,
because the benchmark machine's 2 cores are shared. Prints client ns per parameter per neighbour (client
time / (P * k), k = 9 neighbours; the self mask and quantization are charged to them), server time vs
plain, bytes vs plain, and checks that the secure float sum equals the exact sum within the documented
bound. Target (issue #5): client <= 2 ns/param/neighbour, server <= 1.5x plain.

Why the server target is hard on one core: besides the fold (the same memory-bound ``np.add`` as plain),
SecAgg's server must expand one self mask per survivor, i.e. n * P words of AES-256-CTR keystream
(~0.5 ns/word/core with AES-NI/VAES here), about as much time as the plain fold itself (~0.4-0.5
ns/param/site). The server is therefore >= ~2x plain by construction on one core. Python threads do not
help: ``cryptography`` holds the GIL while it encrypts (measured); the expansion splits cleanly over CTR
counter ranges, so worker processes (or a GIL-free AES) are the way to 1.5x on a many-core aggregator.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from fedclinic.secagg import ClientSession, Quantizer, ServerSession, SessionParams

P = 10_000_000
N = 10
REPEATS = 3
T = TypeVar("T")


def session(drop_after_share: set[str]) -> dict[str, float]:
    cohort = tuple(f"hospital-{i:02d}" for i in range(N))
    model_hash = hashlib.sha256(b"bench global model").digest()
    q = Quantizer(clip=0.5, bits=20)
    params = SessionParams("bench", 1, cohort, model_hash, P, quantizer=q)
    t = {"client": 0.0, "server": 0.0, "plain": 0.0, "fold": 0.0, "finish": 0.0, "up_secure": 0, "down_secure": 0}

    def timed(who: str, fn: Callable[..., T], *args: object) -> T:
        t0 = time.perf_counter()
        out = fn(*args)
        t[who] += time.perf_counter() - t0
        return out

    server = timed("server", ServerSession, params)
    clients = {c: timed("client", lambda c=c: ClientSession(c, params, committed_model_hash=model_hash))
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
        t0 = time.perf_counter()
        np.add(plain_acc, x, out=plain_acc)
        t["plain"] += time.perf_counter() - t0
        t["down_secure"] += requests[c].payload_bytes()
        masked = timed("client", clients[c].masked_input, requests[c], x)
        t["up_secure"] += masked.payload_bytes()
        t0 = time.perf_counter()
        timed("server", server.receive_masked_input, masked)
        t["fold"] += time.perf_counter() - t0
        np.add(exact, np.clip(x, -0.5, 0.5), out=exact)  # float64 reference (untimed)
        del x, masked
    unmask = timed("server", server.close_masked_input)
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
    runs = [session(set()) for _ in range(REPEATS)]  # the 2 cores are shared: keep the least disturbed
    r = dict(runs[0])
    for key in ("client", "server", "plain", "fold", "finish"):
        r[key] = min(x[key] for x in runs)
    r["within_bound"] = float(all(x["within_bound"] for x in runs))
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
          f"dequantize) {r['finish'] * 1e3:.1f} ms")
    print(f"uplink bytes: secure {r['up_secure'] / 1e6:.2f} MB vs plain {plain_up / 1e6:.2f} MB "
          f"({r['up_secure'] / plain_up:.5f}x); downlink secure control messages {r['down_secure'] / 1e3:.1f} kB")
    print(f"accuracy: max |secure - exact| = {r['max_err']:.2e} (bound {r['bound']:.2e}, within: "
          f"{bool(r['within_bound'])}); plain float32 sum max error {r['plain_err']:.2e}")
    d = session({"hospital-03"})
    ratio_d = d["server"] / d["plain"]
    print(f"one site dropped after share-keys: server {d['server'] * 1e3:.1f} ms vs plain {d['plain'] * 1e3:.1f} ms "
          f"-> {ratio_d:.2f}x (within bound: {bool(d['within_bound'])})")
    ok = r["within_bound"] and d["within_bound"]
    met = ns_pn <= 2.0 and ratio <= 1.5 and ok
    print(f"RESULT secagg client_ns_per_param_neighbour={ns_pn:.3f} server_ratio={ratio:.2f} "
          f"server_ratio_1drop={ratio_d:.2f} bytes_ratio={r['up_secure'] / plain_up:.5f} exact={'yes' if ok else 'no'} "
          f"target=client<=2ns/param/neighbour,server<=1.5x_plain met={'yes' if met else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
