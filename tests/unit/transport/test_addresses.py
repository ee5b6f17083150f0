"""Several aggregator addresses (fedclinic.transport.addresses): the accepted forms, clear errors, the ring."""

from __future__ import annotations

import pytest

from fedclinic.errors import ConfigError
from fedclinic.transport.addresses import AddressRing, parse_addresses


def test_one_address_a_comma_list_or_a_list():
    assert parse_addresses("agg:7443", "x") == ("agg:7443",)
    assert parse_addresses("a:7443, b:7443", "x") == ("a:7443", "b:7443")
    assert parse_addresses(["a:7443", "[::1]:7443"], "x") == ("a:7443", "[::1]:7443")


@pytest.mark.parametrize("bad, message", [("", "empty"), ("a:7443,", "empty"), ("a", "not \"host:port\""),
                                          ("a:0", "port 1-65535"), ("a:x", "not \"host:port\""),
                                          ("a:1,a:1", "listed twice"), (7443, "must be"), ([1], "must be")])
def test_bad_addresses_are_refused_naming_the_setting(bad, message):
    with pytest.raises(ConfigError, match="agent.toml: aggregator") as exc:
        parse_addresses(bad, "agent.toml: aggregator")
    assert message in str(exc.value)


def test_the_ring_wraps_after_every_address_was_tried():
    ring = AddressRing(("a:1", "b:2", "c:3"))
    assert ring.current == "a:1"
    assert ring.advance() is False and ring.current == "b:2"
    assert ring.advance() is False and ring.advance() is True and ring.current == "a:1"


def _agent_config(tmp_path, aggregator):
    from hospital_agent.config import AgentConfig

    doc = {"aggregator": aggregator, "work_dir": str(tmp_path / "work"),
           "tls": {"cert": "s.crt", "key": "s.key", "ca": "ca.crt"},
           "datasets": {"notes": {"path": str(tmp_path / "notes.jsonl")}}}
    return AgentConfig.from_dict(doc, base=tmp_path, source="agent.toml")


def test_the_agent_takes_a_list_of_aggregator_addresses(tmp_path):
    assert _agent_config(tmp_path, ["a:7443", "b:7443"]).aggregator == "a:7443,b:7443"
    assert _agent_config(tmp_path, "a:7443").aggregator == "a:7443"
    with pytest.raises(ConfigError, match=r"agent.toml: aggregator: aggregator address 'b' is not"):
        _agent_config(tmp_path, ["a:7443", "b"])
