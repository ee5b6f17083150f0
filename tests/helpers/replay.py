"""Site replays: what a site computes in a round (delta over every tensor, its sample count), recomputed in the
test with the same shared code as the agent, the reference the federation tests compare the aggregated models
against."""

from __future__ import annotations


def replay_site(package, rows, spec, *, site, rnd, optimizer_state=None, result_out=None):
    """What site ``site`` computes for round ``rnd``, recomputed here with the same shared code (its training seed
    derived from the task's seed, the round and the site's name, fedclinic.federation.site_round.site_seed: issue 15 gave
    every site and round its own seed; agents used the task's seed unchanged before)."""
    from dataclasses import replace

    from fedclinic.training import trainer as training
    from fedclinic.data.text import Example
    from fedclinic.models import build_model, module_tensors
    from fedclinic.federation.site_round import site_seed

    loaded = build_model(package)
    examples = [Example(r["text"], (r["label"],)) for r in rows]
    cfg = training.TrainConfig.from_proto(spec.training)
    cfg = replace(cfg, seed=site_seed(cfg.seed, rnd, site))
    data = training.encode(examples, loaded, max_length=cfg.max_length)
    names = list(package.tensors)
    before = module_tensors(loaded.module, names)
    result = training.train_local(loaded, data, cfg, trainable=names, optimizer_state=optimizer_state)
    if result_out is not None:
        result_out.append(result)
    return training.compute_delta(before, module_tensors(loaded.module, names), names), result.num_samples


def replay_site_delta(start_package, examples, spec, *, site, rnd=1):
    """What site ``site`` computes in round ``rnd`` (delta over every tensor, its sample count), recomputed here
    with the same shared code from the task's spec: the reference the family federation tests compare against.
    The training seed is the site's own for the round (fedclinic.federation.site_round.site_seed; issue 15: agents used the
    task's seed unchanged before)."""
    from dataclasses import replace

    from fedclinic.training import trainer as training
    from fedclinic.models import build_model, module_tensors
    from fedclinic.federation.site_round import site_seed

    loaded = build_model(start_package)
    cfg = training.TrainConfig.from_proto(spec.training)
    cfg = replace(cfg, seed=site_seed(cfg.seed, rnd, site))
    data = training.encode(examples, loaded, max_length=cfg.max_length)
    names = list(start_package.tensors)
    before = module_tensors(loaded.module, names)
    result = training.train_local(loaded, data, cfg, trainable=names)
    return training.compute_delta(before, module_tensors(loaded.module, names), names), result.num_samples
