"""`fedclinic serve` as a real process for tests: start it on a free port, call it, watch its memory; or run it
on a bundle it must refuse."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Sequence

from fedclinic.federation.local_federation import wait_until


def call(port: int, path: str, body=None, raw: bytes | None = None, headers: dict[str, str] | None = None):
    """(status, JSON answer) of a GET (no body) or POST to 127.0.0.1:port over plain HTTP."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class ServeProcesses:
    """Starts `fedclinic serve` processes (their port files under ``folder``) and kills what is left at exit."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen] = []

    def start(self, bundle, *extra: str, trust: Sequence[str] = ("--allow-unsigned",)):
        """(process, HTTP port) without extra arguments, (process, {"http": ..., "grpc": ...}) with them.

        ``trust`` are the bundle-signature arguments (default ``--allow-unsigned``: the bundles of tests about
        something else are exported unsigned; e.g. ``("--trust-ca", CA)`` to have the signature checked)."""
        port_file = self.folder / f"port-{len(self.procs)}"
        proc = subprocess.Popen([sys.executable, "-m", "fedclinic.cli", "serve", str(bundle), "--port", "0",
                                 "--port-file", str(port_file), "--threads", "1", *trust, *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        wait_until(lambda: port_file.exists() or proc.poll() is not None, timeout=60, what="the server to start")
        assert proc.poll() is None, proc.stdout.read()
        ports = json.loads(port_file.read_text())
        return (proc, ports["http"]) if not extra else (proc, ports)

    @staticmethod
    def refused(bundle, *args: str) -> tuple[int, str]:
        """Run `fedclinic serve BUNDLE ARGS` expecting it to refuse the bundle before it listens: (exit code,
        output). A server that starts anyway is killed and reported with exit code None."""
        proc = subprocess.Popen([sys.executable, "-m", "fedclinic.cli", "serve", str(bundle), "--port", "0",
                                 "--threads", "1", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            return None, out
        return proc.returncode, out

    def __enter__(self) -> ServeProcesses:
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


class PeakRss:
    """The highest resident memory of process ``pid`` while the ``with`` block runs (sampled continuously)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.before = self.process.memory_info().rss
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except Exception:  # the process ended: the peak so far stands
                return

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.before) / (1 << 20)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def png_header_bomb(width: int, height: int) -> bytes:
    """A valid 8-bit grayscale PNG of ``width x height`` black pixels, built row by row (small when compressed,
    huge when decoded; never held decoded here)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    compressor = zlib.compressobj(9)
    row = b"\x00" * (width + 1)  # filter byte 0, then the row
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 0, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
