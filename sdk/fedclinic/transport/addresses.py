"""Several aggregator addresses (a hot-standby pair, aggregator_service.leader_election): parsed once, tried in
turn.

Accepted forms, everywhere an aggregator address is taken (agent ``aggregator``, ``fedclinic.connect``):
``"host:port"``, ``"a:7443,b:7443"`` (comma-separated) or a list of ``"host:port"`` strings. Order is
preference: the first is tried first. A standby refuses calls with UNAVAILABLE, as does an address nobody
listens on, so a caller that gets UNAVAILABLE moves to the next address (:meth:`AddressRing.advance`).
"""

from __future__ import annotations

from collections.abc import Sequence

from fedclinic.errors import ConfigError


def parse_addresses(value: str | Sequence[str], where: str) -> tuple[str, ...]:
    """The addresses in ``value`` (see the module docstring); ConfigError naming ``where`` when one is empty,
    has no ``:port``, or is repeated."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
    elif isinstance(value, Sequence) and all(isinstance(p, str) for p in value):
        parts = [p.strip() for p in value]
    else:
        raise ConfigError(f"{where}: the aggregator address must be \"host:port\", \"a:port,b:port\" or a list of "
                          f"\"host:port\" strings, got {type(value).__name__}")
    if not parts or any(not p for p in parts):
        raise ConfigError(f"{where}: an empty aggregator address in {value!r}; give \"host:port\" (several: "
                          "a list or comma-separated)")
    for p in parts:
        host, sep, port = p.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{where}: aggregator address {p!r} is not \"host:port\" (port 1-65535)")
    if len(set(parts)) != len(parts):
        raise ConfigError(f"{where}: aggregator address listed twice in {value!r}")
    return tuple(parts)


class AddressRing:
    """The addresses and which one is in use; :meth:`advance` moves to the next (wrapping round)."""

    def __init__(self, addresses: tuple[str, ...]) -> None:
        self.addresses = addresses
        self.index = 0

    @property
    def current(self) -> str:
        return self.addresses[self.index]

    def advance(self) -> bool:
        """Move to the next address; True when that wrapped back to the first (every address was tried once)."""
        self.index = (self.index + 1) % len(self.addresses)
        return self.index == 0

    def __str__(self) -> str:
        return ",".join(self.addresses)
