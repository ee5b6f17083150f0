"""Fixtures for integration tests: real processes, real certificates, loopback only, tiny models."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from fedclinic.federation.local_federation import LocalFederation, SiteSetup

pytestmark = pytest.mark.integration

LABELS = ["cardio", "neuro"]
WORDS = {
    "cardio": ["heart", "chest", "pressure", "beta", "statin", "arrhythmia", "palpitations", "angina"],
    "neuro": ["migraine", "seizure", "tremor", "numbness", "aura", "dizziness", "neuropathy", "stroke"],
}
FILLER = ["patient", "reports", "the", "after", "with", "daily", "mild", "severe", "since", "week"]


def tiny_tokenizer_json() -> bytes:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + sorted({w for ws in WORDS.values() for w in ws} | set(FILLER))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


def tiny_package(architecture: str = "logreg", seed: int = 0):
    from fedclinic.models import package_from_config

    config = {}
    if architecture == "transformer":
        config = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "intermediate_size": 32, "max_position_embeddings": 64}
    elif architecture == "lstm":
        config = {"embedding_dim": 16, "hidden_size": 16, "num_layers": 1, "bidirectional": True}
    return package_from_config(architecture=architecture, labels=LABELS, tokenizer_json=tiny_tokenizer_json(),
                               config=config, max_length=16, seed=seed)


def make_examples(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = LABELS[i % 2]
        words = rng.sample(WORDS[label], 3) + rng.sample(FILLER, 3)
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def stored_update_tensors(fed: LocalFederation, task_id: str) -> dict[tuple[str, int], set[str]]:
    """(site, round) -> the tensor names of the update the aggregator stored (its state database, read-only)."""
    import sqlite3

    db = sqlite3.connect(f"file:{fed.root / 'aggregator-state' / 'aggregator.sqlite'}?mode=ro", uri=True)
    try:
        return {(site, rnd): {t[0] for t in json.loads(layout)} for site, rnd, layout in db.execute(
            "SELECT site, round, layout FROM updates WHERE task_id=?", (task_id,))}
    finally:
        db.close()


def write_site_data(folder: Path, n: int, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_examples(n, seed)))
    return path


def run_task(root: Path, sites, task, package):
    """Start a federation of ``sites`` under ``root``, submit ``task`` with ``package``, wait for it to
    complete (asserting it did) and return ``(final status, round-1 global package)``."""
    from fedclinic.client import state_name

    with LocalFederation(root, sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            status = client.submit(task, package=package)
            final = client.wait(status.task_id, timeout=300, progress=False)
            assert state_name(final.state) == "completed", final.error
            return final, client.fetch_package(status.task_id, round=1)


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


@pytest.fixture
def federation_factory(tmp_path, request):
    """Build LocalFederations with N sites holding synthetic clinical-ish text; torn down after the test."""
    made: list[LocalFederation] = []

    def make(n_sites: int = 3, *, samples=(24, 32, 40), start: bool = True, **kwargs) -> LocalFederation:
        sites = []
        for i in range(n_sites):
            name = f"site-{chr(ord('a') + i)}"
            path = write_site_data(tmp_path / "data" / name, samples[i % len(samples)], seed=i)
            sites.append(SiteSetup(name, datasets={"notes": {"path": str(path), "format": "jsonl"}}))
        fed = LocalFederation(tmp_path / "fed", sites, agent_threads=1, **kwargs)
        made.append(fed)
        if start:
            fed.start()
        return fed

    yield make
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for fed in made:
        fed.close()
        if failed:
            for log in sorted(fed.logs.glob("*.log")):
                print(f"----- {log.name} -----\n{log.read_text(errors='replace')[-4000:]}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
