"""The privacy planner (fedclinic.privacy.privacy_planner): logical batches, fixed sampling rates and steps in the plan
the sites make, golden values, the proposal, and that the epsilon it shows is the one a site admits."""

from __future__ import annotations

import math
import re

import pytest

from fedclinic.errors import ConfigError
from fedclinic.privacy.privacy_planner import (
    PrivacyPlanner,
    TrainableSet,
    bert_trainable_sets,
    parse_params,
    sets_from_sizes,
)
from fedclinic.proto import task_pb2
from fedclinic.spec.task import privacy_config, privacy_input_problems
from fedclinic.spec.validation import bounds_problems
from fedclinic.strategies.dp_accounting import plan_for_config, plan_task


def _gaussian_rdp_epsilon(sigma: float, steps: int, delta: float) -> float:
    """Full-batch DP-GD is the Gaussian mechanism composed ``steps`` times: RDP ``alpha * steps / (2 sigma^2)``
    (Mironov 2017, Prop. 7), converted to (epsilon, delta) as Opacus does (Balle et al. 2020, Thm. 21), over
    Opacus' default orders. An independent closed form for the golden value below."""
    alphas = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    return min(steps * a / (2 * sigma ** 2) + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
               for a in alphas)


def test_full_batch_dp_gd_golden():
    """q = 1: every row in every step; 5 steps x 5 rounds at sigma 3 is 25 Gaussian mechanisms."""
    plan = plan_task(num_examples=72, batch_size=16, local_epochs=1, rounds=5, delta=1e-5, sample_rate=1.0,
                     steps_per_round=5, noise_multiplier=3.0)
    assert (plan.sample_rate, plan.steps_per_round, plan.total_steps) == (1.0, 5, 25)
    assert plan.planned_epsilon == pytest.approx(8.6033, abs=1e-3)
    assert plan.planned_epsilon == pytest.approx(_gaussian_rdp_epsilon(3.0, 25, 1e-5), rel=1e-9)
    target = plan_task(num_examples=72, batch_size=16, local_epochs=1, rounds=5, delta=1e-5, sample_rate=1.0,
                       steps_per_round=5, target_epsilon=8.0)
    assert target.noise_multiplier == pytest.approx(3.191, abs=0.002)
    assert 7.99 <= target.planned_epsilon <= 8.0


def test_logical_batch_sets_the_sampling_rate_and_steps():
    plan = plan_task(num_examples=72, batch_size=16, local_epochs=1, rounds=5, delta=1e-5, logical_batch_size=64,
                     noise_multiplier=2.0)
    assert plan.sample_rate == pytest.approx(64 / 72) and plan.steps_per_round == 2  # ceil(72 / 64)
    default = plan_task(num_examples=72, batch_size=16, local_epochs=1, rounds=5, delta=1e-5, noise_multiplier=2.0)
    assert default.sample_rate == pytest.approx(16 / 72) and default.steps_per_round == 5
    huge = plan_task(num_examples=72, batch_size=16, local_epochs=3, rounds=1, delta=1e-5, logical_batch_size=500,
                     noise_multiplier=2.0)
    assert (huge.sample_rate, huge.steps_per_round) == (1.0, 3)  # a logical batch above n is the full batch


@pytest.mark.parametrize("kw", [dict(sample_rate=1.5), dict(sample_rate=-0.1), dict(logical_batch_size=-1),
                                dict(steps_per_round=-2), dict(sample_rate=1e-9)])
def test_bad_sampling_settings_are_refused(kw):
    with pytest.raises(ConfigError, match="sample_rate|logical_batch_size"):
        plan_task(num_examples=72, batch_size=16, local_epochs=1, rounds=5, delta=1e-5, noise_multiplier=2.0, **kw)


def test_task_privacy_section_carries_the_sampling_settings():
    section = {"level": "sample", "target_epsilon": 3.0, "sample_rate": 1.0, "steps_per_round": 7,
               "logical_batch_size": 0}
    assert privacy_input_problems(section) == []
    pc = privacy_config(section)
    assert (pc.sample_rate, pc.steps_per_round, pc.logical_batch_size) == (1.0, 7, 0)
    plan = plan_for_config(pc, num_examples=50, batch_size=8, local_epochs=1, rounds=2)
    assert (plan.sample_rate, plan.steps_per_round) == (1.0, 7)
    assert privacy_input_problems({**section, "sample_rate": 2}) and privacy_input_problems(
        {**section, "steps_per_round": 1.5}) and privacy_input_problems({**section, "logical_batch_size": -3})
    spec = task_pb2.TaskSpec(privacy=task_pb2.PrivacyConfig(level="sample", sample_rate=1.5, steps_per_round=-1))
    problems = bounds_problems(spec)
    assert any("privacy.sample_rate" in p for p in problems) and any("privacy.steps_per_round" in p for p in problems)


def _planner(epsilon=8.0, rows=(73, 72, 72), sets=None) -> PrivacyPlanner:
    sets = sets or [TrainableSet("head", 1925, (r"classifier\..*",), "head"),
                    TrainableSet("head+top2", 3_550_853, (r"classifier\..*", r"bert\.encoder\.layer\.[45]\..*"))]
    return PrivacyPlanner(epsilon=epsilon, delta=1e-5, rows=list(rows), rounds=5, epochs=1, batch_size=16, sets=sets)


def test_the_demo_proposal_is_the_head_with_full_batches():
    planner = _planner()
    cands = planner.candidates()
    assert {(c.trainable.name, c.sampling) for c in cands} == {
        (n, s) for n in ("head", "head+top2") for s in ("batch", "logical", "full")}
    best = planner.propose(cands)
    assert (best.trainable.name, best.sampling) == ("head", "full")
    assert best.privacy["sample_rate"] == 1.0 and best.privacy["steps_per_round"] == 5  # ceil(72/16) x 1 epoch
    assert best.snr == max(c.snr for c in cands)
    assert all(c.epsilon <= 8.0 for c in cands)
    p = best.smallest
    assert best.snr == pytest.approx(math.sqrt(25) * 72 / (p.noise_multiplier * math.sqrt(1925)))


def test_the_proposal_is_what_a_site_admits(tmp_path):
    """The planner's epsilon and noise are the site's: SitePrivacy.admit on the proposal's [privacy] section."""
    from hospital_agent.site_privacy import SitePrivacy

    best = _planner(epsilon=3.0).propose()
    spec = task_pb2.TaskSpec(family="text-classification", architecture="transformer", dataset="notes",
                             rounds=task_pb2.RoundConfig(num_rounds=5), privacy=privacy_config(best.privacy))
    for i, n in enumerate((73, 72, 72)):  # three hospitals, each with its own ledger
        site = SitePrivacy(tmp_path / f"ledger-{i}.sqlite", {})
        site.ledger.set_budget("notes", 3.0, 1e-5)
        admitted = site.admit(f"t{i}", spec, n, batch_size=16, local_epochs=1).plan
        assert admitted == best.plans[i]
    assert best.epsilon <= 3.0


def test_trainable_sets_count_the_model():
    from tests.helpers.text_models import tiny_package

    package = tiny_package("transformer")
    sizes = {name: int(t.size) for name, t in package.tensors.items()}
    [head, layer0] = sets_from_sizes(sizes, {"head": ([r"classifier\..*"], "head"),
                                             "layer0": ([r"bert\.encoder\.layer\.0\..*"], "layers")})
    assert head.parameters == 16 * 2 + 2
    # the closed form of bert_trainable_sets against the real tensors (hidden 16, intermediate 32, 1 layer)
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps({"hidden_size": 16, "num_hidden_layers": 1,
                                                        "intermediate_size": 32}))
        sets = {s.name: s for s in bert_trainable_sets(folder, num_labels=2, lora_rank=4)}
    assert sets["head"].parameters == head.parameters
    assert sets["all"].parameters == head.parameters + layer0.parameters
    assert sets["lora-r4"].parameters == head.parameters + 4 * 4 * 16
    with pytest.raises(ConfigError, match="no tensor"):
        sets_from_sizes(sizes, {"x": ([r"nothing\..*"], "layers")})


def test_params_and_rows_are_checked():
    assert [(s.name, s.parameters, s.kind) for s in parse_params(["head=10", "head+top2=99", "lora=5"])] == [
        ("head", 10, "head"), ("head+top2", 99, "layers"), ("lora", 5, "lora")]
    for bad in ("head", "head=0", "=5", "x=y"):
        with pytest.raises(ConfigError, match=re.escape("NAME=COUNT")):
            parse_params([bad])
    with pytest.raises(ConfigError, match="row count"):
        _planner(rows=())
    with pytest.raises(ConfigError, match="row count"):
        _planner(rows=(10, 0))
