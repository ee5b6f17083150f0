"""A site round as 2 gloo processes (torch elastic launch, data-parallel) equals the 1-process round with the same
global batch; its settings are checked; a failing or cancelled worker ends the round with a clear error.

`make test` runs the classification equality, the error path and the checks; `make test-distributed` adds
NER-CRF, QA (causal LM), DP-SGD, cancellation and the FSDP-sharded QA round (one 2-process launch each)."""

from __future__ import annotations

import subprocess

import pytest

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.federation.distributed_round import (check_devices, check_sharding, resolve_devices,
                                                   run_site_round_distributed)
from fedclinic.federation.site_round import SiteRoundInput
from fedclinic.training.trainer import TrainConfig

from tests.helpers.distributed import (TWO_CPUS, both_rounds, classification_examples, classification_package,
                                       full_only, ner_package, relative_difference)

TOLERANCE = 1e-5


def _assert_same_round(one, two) -> None:
    assert two.send == one.send and two.seed == one.seed
    assert relative_difference(one.delta, two.delta) <= TOLERANCE
    assert two.train.num_samples == one.train.num_samples and two.train.steps == one.train.steps
    assert two.train.loss == pytest.approx(one.train.loss, rel=TOLERANCE)
    assert two.metrics.keys() == one.metrics.keys()
    # the update leaves once, encoded here from rank 0's replica: the same bytes the 1-process round encodes
    assert [h.name for h in two.update.headers] == [h.name for h in one.update.headers]


def test_classification_round_on_two_gloo_processes_equals_one_process():
    # 21 rows in batches of 4: the last global batch (1 row) leaves rank 1 empty; 6 steps over 2 epochs
    train = TrainConfig(batch_size=4, learning_rate=1e-2, local_epochs=2, max_steps=7, seed=7, device="cpu")
    one, two = both_rounds(classification_package(), classification_examples(21, seed=3), train)
    _assert_same_round(one, two)
    assert one.train.steps == 7


@full_only
def test_a_failing_worker_fails_the_round_with_its_error():
    from fedclinic.models import build_model
    from fedclinic.training import trainer as training

    package = classification_package()
    loaded = build_model(package)
    data = training.encode(classification_examples(8, seed=1), loaded)
    before = {k: v.copy() for k, v in package.tensors.items()}
    inp = SiteRoundInput(task_id="t", site="s", round=1, send=["no.such.tensor"], train=TrainConfig(device="cpu"))
    with pytest.raises(IntegrityError, match="no.such.tensor"):  # raised by rank 0's trainer, re-raised here
        run_site_round_distributed(loaded, data, inp, files=package.files, devices=TWO_CPUS)
    from fedclinic.models import module_tensors

    after = module_tensors(loaded.module)
    assert all((after[k] == before[k]).all() for k in before)  # nothing trained, nothing loaded


@pytest.mark.parametrize("value, message", [
    ("some", "must be \"all\" or a list"), ([], "must be \"all\" or a list"), (["gpu:0"], "unknown device"),
    (["cpu", "cuda:0"], "mixes CPU and GPU"), (["cuda:1", "cuda:1"], "names a GPU twice"),
    (["cpu"] * 65, "at most 64"),
])
def test_bad_devices_are_refused_with_what_to_write(value, message):
    with pytest.raises(ConfigError, match=message):
        check_devices(value)


def test_devices_resolve_against_what_torch_sees():
    import torch

    assert check_devices(["CPU", "cpu"]) == ["cpu", "cpu"]
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert resolve_devices("all") == [f"cuda:{i}" for i in range(count)]
        with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
            resolve_devices([f"cuda:{count}"])
    else:
        assert resolve_devices("all") == ["cpu"]  # no GPU: the one-process CPU round
        with pytest.raises(ConfigError, match="torch sees none"):
            resolve_devices(["cuda:0"])
    assert resolve_devices(["cpu", "cpu", "cpu"]) == ["cpu"] * 3


def test_one_device_is_not_a_distributed_round():
    with pytest.raises(ConfigError, match="at least 2 devices"):
        run_site_round_distributed(None, None, SiteRoundInput(task_id="t", site="s", round=1, send=[],
                                                              train=TrainConfig()), files={}, devices=["cpu"])


@full_only
def test_ner_crf_round_on_two_gloo_processes_equals_one_process():
    from tests.helpers import ner_models

    train = TrainConfig(batch_size=5, learning_rate=5e-3, max_steps=4, max_length=32, seed=3, device="cpu")
    one, two = both_rounds(ner_package(), ner_models.make_examples(17, seed=4), train)
    _assert_same_round(one, two)


@full_only
def test_qa_causal_lm_round_on_two_gloo_processes_equals_one_process():
    from tests.helpers import qa_models

    # answers of different lengths: the loss is a mean over answer tokens, weighted per rank by its tokens
    examples = qa_models.toy_examples() + qa_models.toy_examples()[:3]
    train = TrainConfig(batch_size=4, learning_rate=5e-3, local_epochs=2, max_length=32, seed=5, device="cpu")
    one, two = both_rounds(qa_models.package(), examples, train)
    _assert_same_round(one, two)


def test_gradient_checkpointing_is_turned_on_and_keeps_the_update():
    import numpy as np

    from fedclinic.models import build_model, module_tensors
    from fedclinic.models.base import enable_gradient_checkpointing
    from fedclinic.training import trainer as training
    from tests.helpers import qa_models

    package, examples = qa_models.package(), qa_models.toy_examples()
    cfg = TrainConfig(batch_size=3, learning_rate=5e-3, max_length=32, seed=8, device="cpu")
    out = []
    for checkpointing in (False, True):
        loaded = build_model(package)
        if checkpointing:
            assert enable_gradient_checkpointing(loaded.module) == 1
        assert loaded.module.base_model.gradient_checkpointing == checkpointing
        training.train_local(loaded, training.encode(examples, loaded), cfg, trainable=list(package.tensors))
        out.append(module_tensors(loaded.module, list(package.tensors)))
    assert all(np.array_equal(out[0][k], out[1][k]) for k in out[0])
    assert enable_gradient_checkpointing(build_model(classification_package()).module) == 1  # BERT too


@full_only
def test_gradient_checkpointing_on_two_processes_gives_the_one_process_update():
    from tests.helpers import qa_models

    train = TrainConfig(batch_size=3, learning_rate=5e-3, max_length=32, seed=8, device="cpu")
    one, two = both_rounds(qa_models.package(), qa_models.toy_examples(), train, gradient_checkpointing=True)
    _assert_same_round(one, two)


@full_only
def test_dp_sgd_round_on_two_gloo_processes_equals_one_process():
    from fedclinic.privacy.dp_sgd import DPSGD

    # the same replayed entropy: the same Poisson samples and noise; ghost clipping per shard, sums added
    dp = DPSGD(noise_multiplier=0.8, max_grad_norm=0.5, sample_rate=0.4, steps=4)
    train = TrainConfig(batch_size=4, learning_rate=1e-2, seed=2, device="cpu")
    one, two = both_rounds(classification_package(), classification_examples(20, seed=6), train, dp=dp,
                           dp_entropy=99)
    _assert_same_round(one, two)
    assert one.train.steps == two.train.steps == dp.steps  # what the accountant charges: (sigma, q, steps)


def test_dp_sgd_with_opacus_hooks_is_refused_on_several_processes():
    from fedclinic.privacy.dp_sgd import DPSGD
    from tests.helpers import ner_models

    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.5, steps=1)
    with pytest.raises(ConfigError, match="Opacus' hooks"):  # refused before anything starts
        both_rounds(ner_package(), ner_models.make_examples(6, seed=1), TrainConfig(device="cpu", max_length=32),
                    dp=dp, dp_entropy=1)
    from fedclinic.models import build_model
    from fedclinic.privacy.dp_sgd import distributed_problem

    package = classification_package()  # ghost clipping: data-parallel
    assert distributed_problem(build_model(package), list(package.tensors)) is None
    assert "per-patient" in distributed_problem(build_model(package), list(package.tensors), groups=["p1"])


class _Cancel(Exception):
    pass


@full_only
def test_cancelling_stops_every_process(monkeypatch):
    from fedclinic.models import build_model
    from fedclinic.training import trainer as training

    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kw):
        started.append(real_popen(*args, **kw))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    package = classification_package()
    loaded = build_model(package)
    data = training.encode(classification_examples(40, seed=1), loaded)

    def progress(step, total, loss):
        if step >= 2:
            raise _Cancel()

    inp = SiteRoundInput(task_id="t", site="s", round=1, send=list(package.tensors), progress=progress,
                         train=TrainConfig(batch_size=2, local_epochs=50, device="cpu"))
    with pytest.raises(_Cancel):
        run_site_round_distributed(loaded, data, inp, files=package.files, devices=TWO_CPUS)
    assert started and started[0].poll() is not None  # the launcher is gone (its workers die with it)


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    import os

    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


@full_only
def test_a_killed_worker_fails_the_round_and_leaves_no_process(monkeypatch):
    import os
    import signal

    from fedclinic.errors import FedclinicError
    from fedclinic.models import build_model
    from fedclinic.training import trainer as training

    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kw):
        started.append(real_popen(*args, **kw))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    package = classification_package()
    loaded = build_model(package)
    data = training.encode(classification_examples(40, seed=1), loaded)
    killed = []

    def progress(step, total, loss):  # rank 1 dies mid-round (the OOM killer, a segfault)
        if not killed:
            workers = [p for p in _children(started[0].pid) if b"distributed_worker" in open(
                f"/proc/{p}/cmdline", "rb").read()]
            if len(workers) == 2:
                os.kill(max(workers), signal.SIGKILL)
                killed.extend(workers)

    inp = SiteRoundInput(task_id="t", site="s", round=1, send=list(package.tensors), progress=progress,
                         train=TrainConfig(batch_size=2, local_epochs=50, device="cpu"))
    with pytest.raises(FedclinicError, match="distributed round"):
        run_site_round_distributed(loaded, data, inp, files=package.files, devices=TWO_CPUS)
    assert killed and started[0].poll() is not None
    assert not [p for p in killed if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]



@full_only
@pytest.mark.parametrize("optimizer, clip", [("adamw", 1.0), ("sgd", 0.0)])
def test_fsdp_qa_causal_lm_round_on_two_gloo_processes_equals_one_process(optimizer, clip):
    from tests.helpers import qa_models

    # 9 rows in batches of 4 over 2 epochs: the last global batch (1 row) leaves rank 1 a zero-weight stand-in row;
    # answers of different lengths: each rank's loss weighted by its answer tokens; FSDP sums the gradient shards.
    # AdamW with clipping (DTensor gradients' global norm) is the usual run; plain SGD without clipping would show
    # a gradient of the wrong scale (e.g. FSDP's default mean over ranks), which Adam and clipping hide.
    examples = qa_models.toy_examples() + qa_models.toy_examples()[:3]
    train = TrainConfig(batch_size=4, learning_rate=5e-3 if optimizer == "adamw" else 0.5, optimizer=optimizer,
                        max_grad_norm=clip, local_epochs=2, max_length=32, seed=5, device="cpu")
    one, two = both_rounds(qa_models.package(config=qa_models.TINY_LLAMA), examples, train, sharding="fsdp")
    _assert_same_round(one, two)
    assert one.train.steps == 6


@pytest.mark.parametrize("value", ["FSDP", "ddp", "", None, 1])
def test_bad_sharding_is_refused_with_what_to_write(value):
    with pytest.raises(ConfigError, match='must be "none" .* or "fsdp"'):
        check_sharding(value)
    assert check_sharding("fsdp") == "fsdp" and check_sharding("none") == "none"


def test_fsdp_refuses_rounds_it_cannot_shard_before_anything_starts(tmp_path):
    from fedclinic.models import build_model
    from fedclinic.training import trainer as training
    from fedclinic.training.fully_sharded import sharding_problem

    package = classification_package()
    loaded = build_model(package)
    data = training.encode(classification_examples(4, seed=1), loaded)
    inp = SiteRoundInput(task_id="t", site="s", round=1, send=list(package.tensors), train=TrainConfig(device="cpu"))
    with pytest.raises(ConfigError, match="causal language models"):
        run_site_round_distributed(loaded, data, inp, files=package.files, devices=TWO_CPUS, sharding="fsdp",
                                   workdir=tmp_path)
    assert not list(tmp_path.iterdir())  # no job was written, no process started
    ok = {"tied": False, "dp": False, "measure_gradient_change": False}
    assert sharding_problem("question-answering", **ok) is None
    assert "DP-SGD" in sharding_problem("question-answering", **{**ok, "dp": True})
    assert "gradient-change" in sharding_problem("question-answering", **{**ok, "measure_gradient_change": True})
    from tests.helpers import qa_models

    gpt2 = qa_models.package()  # its output layer is its input embedding
    loaded = build_model(gpt2)
    inp = SiteRoundInput(task_id="t", site="s", round=1, send=list(gpt2.tensors), train=TrainConfig(device="cpu"))
    with pytest.raises(ConfigError, match="ties its output layer"):
        run_site_round_distributed(loaded, training.encode(qa_models.toy_examples(), loaded), inp, files=gpt2.files,
                                   devices=TWO_CPUS, sharding="fsdp", workdir=tmp_path)
    assert not list(tmp_path.iterdir())
