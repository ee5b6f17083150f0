"""A loopback TCP fault proxy: the network between a hospital agent and the aggregator, made bad on purpose.

:class:`FaultProxy` listens on 127.0.0.1, forwards every connection to one upstream address (the aggregator)
and can be switched at run time between faults: added latency, a bandwidth cap (a token bucket per direction,
shared by the proxy's connections like one hospital link), a reset mid-stream after N bytes (RST: SO_LINGER 0),
a half-open connection (one direction stops flowing, the sockets stay open) and a black hole (nothing flows
and new connections are accepted but not forwarded until it ends). It forwards bytes only, so TLS passes
through unchanged: the agent still checks the aggregator's certificate, whose names (127.0.0.1, localhost)
hold for the proxy's loopback address too.

Nothing is dropped: bytes held by a half-open or black-holed direction wait (the reader stops reading, so TCP
back-pressure holds the sender) and flow when the fault ends, as after a real routing outage; only a reset
loses what was in flight. :attr:`FaultProxy.connections` records what each connection carried, for tests that
prove what was sent again after a cut.

Directions: ``"up"`` is client -> upstream (an agent's uploads), ``"down"`` upstream -> client (model fetches).
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

DIRECTIONS = ("up", "down")
_READ = 64 << 10
_QUEUE_DEPTH = 64  # reads in flight per direction (bounds what the proxy holds: 4 MiB)


@dataclass
class ConnectionStats:
    """What one proxied connection carried: bytes per direction, when it opened (monotonic), if it was reset."""

    number: int
    opened: float
    up: int = 0
    down: int = 0
    reset: bool = False

    def bytes(self, direction: str) -> int:
        return self.up if direction == "up" else self.down


@dataclass
class _Faults:
    latency_s: float = 0.0
    bytes_per_s: float = 0.0
    reset_after: int = 0  # reset a connection once it carried this many more bytes in reset_direction (0: never)
    reset_direction: str = "down"
    reset_base: dict[int, int] = field(default_factory=dict)  # connection -> its bytes when the reset was armed
    reset_once: bool = True
    held: set[str] = field(default_factory=set)  # directions that do not flow (half-open / black hole)
    black_hole: bool = False


class _Bucket:
    """Token bucket: ``take(n)`` returns once n bytes fit under ``rate`` bytes/s (burst: 1/10 s of traffic)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._stamp = time.monotonic()

    def take(self, n: int, rate: float, stop: threading.Event) -> None:
        if rate <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._tokens + (now - self._stamp) * rate, rate / 10)
            self._stamp = now
            self._tokens -= n
            wait = -self._tokens / rate if self._tokens < 0 else 0.0
        if wait > 0:
            stop.wait(wait)


class FaultProxy:
    """Forwards ``127.0.0.1:port`` (``port`` 0: a free one, see :attr:`address`) to ``upstream`` ("host:port"),
    with the faults set by the ``set_*`` methods (each replaces the previous fault; :meth:`set_pass` ends it).
    Use as a context manager or call :meth:`start` and :meth:`close`."""

    def __init__(self, upstream: str, *, port: int = 0) -> None:
        host, _, up_port = upstream.rpartition(":")
        self.upstream = (host, int(up_port))
        self._listener = socket.create_server(("127.0.0.1", port))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._faults = _Faults()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._buckets = {d: _Bucket() for d in DIRECTIONS}
        self._sockets: list[tuple[ConnectionStats, socket.socket, socket.socket | None]] = []
        #: every connection accepted so far, in order
        self.connections: list[ConnectionStats] = []
        #: connections reset by the proxy
        self.resets = 0
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)

    # life cycle --------------------------------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting and close every connection."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            conns = list(self._sockets)
        try:
            self._listener.close()
        except OSError:
            pass
        for _, a, b in conns:
            for s in (a, b):
                if s is not None:
                    _close(s)

    # faults ------------------------------------------------------------------------------------------------
    def _set(self, **changes: object) -> None:
        with self._cond:
            self._faults = _Faults(**changes)  # type: ignore[arg-type]
            self._cond.notify_all()

    def set_pass(self) -> None:
        """Forward everything at once."""
        self._set()

    def set_latency(self, seconds: float) -> None:
        """Deliver every byte ``seconds`` after it was read (each direction)."""
        self._set(latency_s=seconds)

    def set_bandwidth(self, bytes_per_s: float, latency_s: float = 0.0) -> None:
        """Cap each direction at ``bytes_per_s`` (all connections together), optionally with latency too."""
        self._set(bytes_per_s=bytes_per_s, latency_s=latency_s)

    def reset_after(self, nbytes: int, direction: str = "down", *, once: bool = True, bytes_per_s: float = 0.0
                    ) -> None:
        """Reset (RST both ends) the first connection that carries ``nbytes`` more bytes in ``direction`` (counted
        from now; a new connection from its start); with ``once`` the proxy then passes again, otherwise every
        connection is reset at that point. ``bytes_per_s`` caps the link meanwhile."""
        assert direction in DIRECTIONS
        with self._cond:
            base = {c.number: c.bytes(direction) for c in self.connections}
        self._set(reset_after=nbytes, reset_direction=direction, reset_once=once, bytes_per_s=bytes_per_s,
                  reset_base=base)

    def half_open(self, direction: str = "down") -> None:
        """Stop ``direction`` on every connection (the sockets stay open; the other direction flows)."""
        assert direction in DIRECTIONS
        self._set(held={direction})

    def black_hole(self) -> None:
        """Nothing flows either way; new connections are accepted and not forwarded until the fault ends."""
        self._set(held=set(DIRECTIONS), black_hole=True)

    def forwarded(self, direction: str) -> int:
        """Bytes forwarded in ``direction`` over all connections so far."""
        with self._cond:
            return sum(c.bytes(direction) for c in self.connections)

    # forwarding --------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._cond:
                stats = ConnectionStats(len(self.connections) + 1, time.monotonic())
                self.connections.append(stats)
            threading.Thread(target=self._open, args=(stats, client), daemon=True,
                             name=f"fault-proxy-{stats.number}").start()

    def _open(self, stats: ConnectionStats, client: socket.socket) -> None:
        with self._cond:  # a black hole accepts and waits: the client's handshake times out or waits it out
            self._cond.wait_for(lambda: self._stop.is_set() or not self._faults.black_hole)
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
            upstream.settimeout(None)
        except OSError:
            _close(client)
            return
        with self._cond:
            if self._stop.is_set():
                _close(client)
                _close(upstream)
                return
            self._sockets.append((stats, client, upstream))
        for direction, src, dst in (("up", client, upstream), ("down", upstream, client)):
            q: "queue.Queue[tuple[float, bytes] | None]" = queue.Queue(_QUEUE_DEPTH)
            threading.Thread(target=self._read, args=(src, q), daemon=True).start()
            threading.Thread(target=self._write, args=(stats, direction, q, client, upstream, dst), daemon=True).start()

    def _read(self, src: socket.socket, q: "queue.Queue[tuple[float, bytes] | None]") -> None:
        while True:
            try:
                data = src.recv(_READ)
            except OSError:
                data = b""
            q.put((time.monotonic(), data) if data else None)
            if not data:
                return

    def _write(self, stats: ConnectionStats, direction: str, q: "queue.Queue[tuple[float, bytes] | None]",
               client: socket.socket, upstream: socket.socket, dst: socket.socket) -> None:
        while True:
            item = q.get()
            if stats.reset:
                return
            if item is None:  # the source closed: pass the close on
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            read_at, data = item
            while data:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop.is_set() or direction not in self._faults.held
                                        or stats.reset)
                    f = self._faults
                    if self._stop.is_set() or stats.reset:
                        return
                    piece = data
                    if f.reset_after and f.reset_direction == direction:
                        left = f.reset_after - (stats.bytes(direction) - f.reset_base.get(stats.number, 0))
                        piece = data[:max(left, 0)]
                delay = read_at + f.latency_s - time.monotonic()
                if delay > 0:
                    self._stop.wait(delay)
                self._buckets[direction].take(len(piece), f.bytes_per_s, self._stop)
                if piece:
                    with self._cond:  # counted before it is sent: whoever reads it sees it counted
                        if direction == "up":
                            stats.up += len(piece)
                        else:
                            stats.down += len(piece)
                    try:
                        dst.sendall(piece)
                    except OSError:
                        self._reset(stats, client, upstream)
                        return
                data = data[len(piece):]
                if data:  # the reset point was reached inside this read
                    self._reset(stats, client, upstream, planned=True)
                    return

    def _reset(self, stats: ConnectionStats, client: socket.socket, upstream: socket.socket,
               planned: bool = False) -> None:
        with self._cond:
            if stats.reset:
                return
            stats.reset = True
            if planned:
                self.resets += 1
                if self._faults.reset_once:
                    self._faults = _Faults()
            self._cond.notify_all()
        for s in (client, upstream):
            _close(s, rst=True)


def _close(s: socket.socket, rst: bool = False) -> None:
    """Close ``s``; with ``rst`` the peer gets a RST, not a FIN. SO_LINGER on with a zero timeout makes the last
    close of the socket send RST; SHUT_RD first wakes this proxy's own thread blocked in recv on it (Linux keeps
    a socket open while a call uses it), without sending anything, so that last close comes at once."""
    try:
        if rst:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
