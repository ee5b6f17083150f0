"""`fedclinic serve` under the abuse of issue 16 (item 5): figures for one server, e.g. main's and this one's.

Runs `fedclinic serve BUNDLE` (from the SDK at ``--sdk``, default this checkout's) as a real process on
127.0.0.1 and measures, one abuse at a time:

- ``negative_cl``: ``Content-Length: -1`` followed by 50 MB of JSON: the status and the server's RSS growth
  (peak while it is sent, sampled every 10 ms; MiB);
- ``concurrent``: 200 simultaneous ``POST /v1/predict`` on fresh connections: how many failed at the connection
  level (reset, refused), how many got 200 and how many 503;
- ``slow``: 300 clients that send a partial request line and headers: the server's thread count while they are
  open, whether an honest request is answered meanwhile, and how many of the 300 the server closed within 30 s.

Only the options both servers know are used (the defaults), so old and new can be compared on the same run:
``python bench/serve_abuse.py --bundle B --sdk /path/to/old/sdk`` then without ``--sdk``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
PREDICT = json.dumps({"texts": ["fever cough"]})


def start(bundle: Path, sdk: Path, folder: Path, extra: list[str]) -> tuple[subprocess.Popen, int]:
    port_file = folder / "port"
    env = {**os.environ, "PYTHONPATH": f"{sdk}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "fedclinic.cli", "serve", str(bundle), "--port", "0",
                             "--port-file", str(port_file), "--threads", "1", *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        time.sleep(0.1)
    return proc, json.loads(port_file.read_text())["http"]


def negative_cl(pid: int, port: int) -> dict:
    body = json.dumps({"texts": ["x" * 170_000] * 300}).encode()
    process = psutil.Process(pid)
    before = peak = process.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.01):
            peak = max(peak, process.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    try:
        for start_ in range(0, len(body), 1 << 20):
            sock.sendall(body[start_:start_ + (1 << 20)])
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    answer = b""
    try:
        while piece := sock.recv(65536):
            answer += piece
    except OSError:
        pass
    sock.close()
    done.set()
    sampler.join()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    return {"status": status, "rss_growth_mib": round((peak - before) / (1 << 20))}


def concurrent(port: int, n: int = 200) -> dict:
    barrier = threading.Barrier(n)
    outcomes: list[str] = []

    def one() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            barrier.wait(timeout=60)
            conn.request("POST", "/v1/predict", PREDICT, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            outcomes.append(str(resp.status))
        except Exception:  # noqa: BLE001 - a connection-level failure is the figure
            outcomes.append("failed")
        finally:
            conn.close()

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {k: outcomes.count(k) for k in ("200", "503", "failed")}


def slow(pid: int, port: int, n: int = 300, wait_s: float = 30.0) -> dict:
    clients = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\n")
        clients.append(s)
    threads = psutil.Process(pid).num_threads()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/predict", PREDICT, {"Content-Type": "application/json"})
        honest = conn.getresponse().status
    except Exception:  # noqa: BLE001
        honest = 0
    conn.close()
    open_ = set(clients)
    deadline = time.monotonic() + wait_s
    while open_ and time.monotonic() < deadline:
        for s in list(open_):
            try:
                s.send(b"X")  # keep trickling
            except OSError:
                open_.discard(s)
        for s in select.select(list(open_), [], [], 0.5)[0] if open_ else []:
            try:
                if not s.recv(4096):
                    open_.discard(s)
            except OSError:
                open_.discard(s)
    for s in clients:
        s.close()
    return {"threads": threads, "honest_status": honest, "closed_within_s": n - len(open_), "wait_s": wait_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", required=True, type=Path, help="a text bundle (fedclinic export onnx)")
    ap.add_argument("--sdk", type=Path, default=ROOT / "sdk", help="the SDK folder whose server to run")
    ap.add_argument("--serve-args", default="", help="extra flags for serve, e.g. '--trust-ca ca.crt', or "
                    "'--allow-unsigned' for an unsigned bundle (an SDK that checks bundle signatures refuses one "
                    "otherwise; an older SDK does not know these flags)")
    args = ap.parse_args(argv)
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("negative_cl", "concurrent", "slow"):
            folder = Path(tmp) / name
            folder.mkdir()
            proc, port = start(args.bundle, args.sdk, folder, args.serve_args.split())
            try:
                figures[name] = (negative_cl(proc.pid, port) if name == "negative_cl" else
                                 concurrent(port) if name == "concurrent" else slow(proc.pid, port))
            finally:
                proc.kill()
                proc.wait()
            print(name, json.dumps(figures[name]), flush=True)
    f = figures
    print(f"RESULT serve_abuse negative_cl_status={f['negative_cl']['status']} "
          f"negative_cl_rss_growth_mib={f['negative_cl']['rss_growth_mib']} "
          f"concurrent_failed={f['concurrent']['failed']} concurrent_200={f['concurrent']['200']} "
          f"concurrent_503={f['concurrent']['503']} slow_threads={f['slow']['threads']} "
          f"slow_honest_status={f['slow']['honest_status']} slow_closed={f['slow']['closed_within_s']}/300")
    return 0


if __name__ == "__main__":
    sys.exit(main())
