"""The fault proxy itself, against a loopback echo server: it forwards and counts, resets with RST at the byte
asked for, and holds (never drops) what a black hole or a half-open direction keeps until the fault ends."""

from __future__ import annotations

import socket
import threading

import pytest

from campaign.fault_proxy import FaultProxy


@pytest.fixture
def echo():
    server = socket.create_server(("127.0.0.1", 0))
    received: list[int] = [0]

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=pump, args=(conn,), daemon=True).start()

    def pump(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                received[0] += len(data)
                try:
                    conn.sendall(data)
                except OSError:
                    return

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}", received
    server.close()


def _dial(proxy: FaultProxy) -> socket.socket:
    host, port = proxy.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=20)
    return s


def _read(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        data = s.recv(n - len(out))
        if not data:
            break
        out += data
    return out


def test_pass_forwards_both_ways_and_counts(echo):
    address, _ = echo
    with FaultProxy(address) as proxy, _dial(proxy) as s:
        s.sendall(b"x" * 100_000)
        assert _read(s, 100_000) == b"x" * 100_000
        assert proxy.forwarded("up") == proxy.forwarded("down") == 100_000


def test_reset_after_n_bytes_sends_a_rst_at_that_byte(echo):
    address, received = echo
    with FaultProxy(address) as proxy, _dial(proxy) as s:
        s.sendall(b"a" * 1000)
        assert _read(s, 1000) == b"a" * 1000
        proxy.reset_after(5000, "up")  # counted from now
        with pytest.raises(ConnectionResetError):
            for _ in range(100):
                s.sendall(b"b" * 1000)
                _read(s, 1000)
        assert proxy.resets == 1 and proxy.connections[0].reset
        assert proxy.connections[0].up == 6000 and received[0] <= 6000
    with FaultProxy(address) as proxy, _dial(proxy) as s:  # once: the next connection passes
        s.sendall(b"c" * 10)
        assert _read(s, 10) == b"c" * 10


def test_a_black_hole_holds_everything_until_it_ends(echo):
    address, received = echo
    with FaultProxy(address) as proxy:
        proxy.black_hole()
        s = _dial(proxy)  # accepted, not forwarded
        s.sendall(b"held")
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(4)
        assert received[0] == 0 and proxy.forwarded("up") == 0
        proxy.set_pass()
        s.settimeout(20)
        assert _read(s, 4) == b"held"
        s.close()


def test_a_half_open_downlink_lets_bytes_up_and_none_down_until_it_ends(echo):
    address, received = echo
    with FaultProxy(address) as proxy, _dial(proxy) as s:
        proxy.half_open("down")
        s.sendall(b"up-only")
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(7)
        assert proxy.forwarded("up") == 7 and proxy.forwarded("down") == 0
        proxy.set_pass()
        s.settimeout(20)
        assert _read(s, 7) == b"up-only"
