"""Compressed downlink over the real services: after round 1 the agents fetch each changed global tensor as its
int8-encoded change, rebuild it bit for bit (the manifest's sha256 checks it), and the global models equal a replay
of FedAvg followed by the same broadcast rounding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.transport import downlink
from fedclinic.runtime.blobstore import blob_relpath
from fedclinic.client import state_name
from fedclinic.transport.codec_wire import params_of
from fedclinic.codecs import parse_codec

from tests.helpers.federation import aggregator_store
from tests.helpers.replay import replay_site
from tests.helpers.tasks import make_task
from tests.helpers.text_models import make_examples, tiny_package

pytestmark = pytest.mark.integration

SAMPLES = (24, 32, 40)
ROUNDS = 3


def _fedavg(start, spec, rnd):
    total, acc = 0, {name: np.zeros(base.shape, np.float64) for name, base in start.tensors.items()}
    for i, n in enumerate(SAMPLES):
        delta, count = replay_site(start, make_examples(n, seed=i), spec, site=f"site-{'abc'[i]}", rnd=rnd)
        total += count
        for name in start.tensors:
            acc[name] += count * delta[name].astype(np.float64)
    return {name: (start.tensors[name] + acc[name] / total).astype(np.float32) for name in start.tensors}


def test_agents_fetch_encoded_changes_and_rebuild_the_broadcast_model_exactly(federation_factory):
    fed = federation_factory(3, samples=SAMPLES)
    with fed.client() as client:
        compressed = client.submit(make_task(name="downlink-int8", num_rounds=ROUNDS, downlink_codec="int8"),
                                   package=tiny_package())
        plain = client.submit(make_task(name="downlink-raw", num_rounds=ROUNDS), package=tiny_package())
        finals, models = {}, {}
        for key, st in (("int8", compressed), ("raw", plain)):
            finals[key] = client.wait(st.task_id, timeout=300, progress=False)
            assert state_name(finals[key].state) == "completed", finals[key].error
            models[key] = {r: client.fetch_package(st.task_id, round=r) for r in range(-1, ROUNDS + 1) if r}
    stored = {}
    with aggregator_store(fed) as db:
        for rnd in range(1, ROUNDS + 1):
            model_hash = finals["int8"].rounds[rnd - 1].model_hash
            stored[rnd] = {r.name: (r.base_sha256, json.loads(r.header)) for r in db.all(
                "SELECT name, base_sha256, header FROM model_deltas WHERE model_hash=?", (model_hash,))}

    spec, codec = finals["int8"].spec, parse_codec("int8")
    assert spec.update.downlink_codec == "int8" and finals["raw"].spec.update.downlink_codec == ""
    ours = models["int8"]
    for rnd in range(1, ROUNDS + 1):
        start, model = ours[rnd - 1 if rnd > 1 else -1], ours[rnd]
        # the stored change rebuilds the global model exactly (the computation the agents share)
        assert set(stored[rnd]) == set(model.tensors)  # logreg: every tensor changes every round
        for name, (base_sha, header) in stored[rnd].items():
            payload = (fed.root / "aggregator-state" / "blobs" / blob_relpath(header["sha256"])).read_bytes()
            params = params_of(name, codec, [int(d) for d in header["shape"]], header.get("codecParams", {}))
            rebuilt = downlink.apply(start.tensors[name], codec, payload, params)
            np.testing.assert_array_equal(rebuilt, model.tensors[name], err_msg=f"round {rnd} {name}")
        # ... and the global model is FedAvg of what the sites trained from the previous broadcast, rounded once
        fedavg = _fedavg(start, spec, rnd)
        for name, new in fedavg.items():
            change = new - start.tensors[name]
            bound = codec.error_bound(change) + 1e-6  # float-sum order can move one stochastic rounding decision
            assert np.all(np.abs(model.tensors[name] - new) <= 2 * bound), f"round {rnd} {name}"
    # rounds 2 and 3 fetch only the encoded changes (the agents held the base tensors), not the tensors
    raw_rounds, int8_rounds = finals["raw"].rounds, finals["int8"].rounds
    for rnd in (1, 2):  # downlink of round r+1 = the sites' fetch of round r's model
        ratio = int8_rounds[rnd].downlink_bytes / raw_rounds[rnd].downlink_bytes
        assert 0 < ratio < 0.35, (rnd, int8_rounds[rnd].downlink_bytes, raw_rounds[rnd].downlink_bytes)
    for rnd in [*int8_rounds, *raw_rounds]:  # per site and on the wire: each site's fetches add up to the round's
        assert sum(rep.downlink_bytes for rep in rnd.reports) == rnd.downlink_bytes
        assert rnd.downlink_wire_bytes == sum(rep.downlink_wire_bytes for rep in rnd.reports)
        # the manifest and the message framing travel too; a site holding every tensor already does not fetch at all
        # (round 1 of the task submitted second: its initial model is the first task's)
        assert rnd.downlink_wire_bytes > rnd.downlink_bytes or rnd.downlink_wire_bytes == rnd.downlink_bytes == 0
    from fedclinic.spec.model_card import build_card

    card = build_card(ours[ROUNDS].meta, model_hash=finals["int8"].final_model_hash, status=finals["int8"])
    assert card["update"]["downlink_codec"] == "int8"
    second = card["rounds"][1]
    assert sum(b["downlink"] for b in second["site_bytes"].values()) == second["downlink_bytes"]
    for site in ("site-a", "site-b", "site-c"):
        fetched = [json.loads(line) for line in (fed.root / f"agent-{site}" / "audit.jsonl").read_text().splitlines()
                   if '"model.fetched"' in line]
        changes = [e for e in fetched if e.get("details", e).get("as_changes")]
        assert len(changes) >= ROUNDS - 1, fetched  # no change fell back to a full fetch
