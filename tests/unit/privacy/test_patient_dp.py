"""Per-patient DP-SGD: a patient's rows are sampled together, a patient's summed gradient is clipped once (ghost and
hooks, against a brute-force per-patient computation), and the parts of a sample are whole patients."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fedclinic.errors import DatasetError
from fedclinic.privacy.dp_sgd import DPSGD, explicit_ids_hook, train_local_private
from fedclinic.privacy.ghost import GhostClipping
from fedclinic.privacy.patient_groups import PatientGroups
from fedclinic.training.trainer import TrainConfig, _batch_loss, encode, select_tensors
from tests.helpers.symptom_models import examples, model

#: 9 rows of 4 patients of different sizes, interleaved as in a real file (rows are not sorted by patient)
PATIENTS = ["p1", "p2", "p1", "p3", "p2", "p1", "p4", "p3", "p1"]


def _brute_force_step(reference, data, ids: list[str], clip: float) -> list[torch.Tensor]:
    """sum over patients k of clip(grad of sum_{i in k} loss_i): one autograd call per patient."""
    reference.module.train()
    loss_fn = _batch_loss(reference, data.multi_label)
    params = [p for _, p in reference.module.named_parameters()]
    total = [torch.zeros_like(p) for p in params]
    for pid in dict.fromkeys(ids):
        rows = [i for i, v in enumerate(ids) if v == pid]
        loss = sum(loss_fn(*data.batch(torch.tensor([i]), torch.device("cpu"))) for i in rows)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        scale = min(1.0, clip / float(norm))
        for acc, g in zip(total, grads):
            acc += g * scale
    return total


@pytest.mark.parametrize("mode, batch_size, pooling", [("ghost", 9, "cls"), ("ghost", 3, "mean"),
                                                       ("hooks", 9, "cls"), ("hooks", 3, "cls")])
def test_one_step_clips_each_patient_once(mode, batch_size, pooling):
    """q = 1 (every patient in the sample), negligible noise: the step is -lr * sum_k clip(g_k) / G with g_k the
    gradient of patient k's summed losses; with batch 3 the sample runs in parts of whole patients (p1's 4 rows
    alone, as a part bigger than the batch size)."""
    _, loaded = model("transformer", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooling=pooling)
    data = encode(examples(len(PATIENTS)), loaded, max_length=16)
    clip = 0.05
    reference = copy.deepcopy(loaded)
    before = {n: p.detach().clone() for n, p in loaded.module.named_parameters()}
    cfg = TrainConfig(optimizer="sgd", learning_rate=1.0, batch_size=batch_size, max_grad_norm=0.0, seed=0)
    train_local_private(loaded, data, cfg, DPSGD(1e-9, clip, 1.0, 1),
                        trainable=select_tensors(loaded.module.state_dict()), mode=mode,
                        groups=PatientGroups(PATIENTS))
    total = _brute_force_step(reference, data, PATIENTS, clip)
    groups = len(set(PATIENTS))
    for (name, p), g in zip(reference.module.named_parameters(), total):
        want = before[name] - g / groups
        torch.testing.assert_close(dict(loaded.module.named_parameters())[name].detach(), want, rtol=1e-4,
                                   atol=1e-6, msg=name)


def test_ghost_group_norms_are_norms_of_summed_gradients_not_sums_of_norms():
    """GhostClipping with groups returns ||sum_{i in k} g_i|| per patient (checked against autograd), which differs
    from the sum of the rows' norms."""
    _, loaded = model("transformer", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    data = encode(examples(len(PATIENTS)), loaded, max_length=16)
    module = loaded.module.train()
    params = [p for n, p in module.named_parameters() if n in set(select_tensors(module.state_dict()))]
    from fedclinic.privacy.per_example import PerExampleObjective

    objective = PerExampleObjective(loaded, module, False)
    inputs, y = data.batch(torch.arange(len(PATIENTS)), torch.device("cpu"))
    groups = PatientGroups(PATIENTS)
    handles = explicit_ids_hook(module)
    clip = GhostClipping(module, params, 1e9)
    with clip.recording():
        losses = objective.per_example(inputs, y)
    norms = clip.add_clipped_sum(losses, groups.row_group)
    clip.close()
    for h in handles:
        h.remove()
    want, row_sums = [], []
    for k in range(groups.num_groups):
        rows = (groups.row_group == k).nonzero().flatten()
        per_row = [torch.autograd.grad(objective.per_example(*data.batch(r.reshape(1), torch.device("cpu"))).sum(),
                                       params, allow_unused=True) for r in rows]
        summed = [sum(g[j] for g in per_row if g[j] is not None) for j in range(len(params))]
        want.append(math.sqrt(sum(float((s.double() ** 2).sum()) for s in summed if torch.is_tensor(s))))
        row_sums.append(sum(math.sqrt(sum(float((x.double() ** 2).sum()) for x in g if x is not None))
                            for g in per_row))
    torch.testing.assert_close(norms.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-7)
    assert row_sums[0] > want[0] * 1.01  # p1 (4 rows): the sum of row norms would over-clip


def test_a_patients_rows_enter_and_leave_the_sample_together():
    """Over 4000 Poisson draws at q = 0.3, every draw's rows are exactly the rows of the drawn patients, each
    group's rows contiguous; each of the 4 patients is drawn in a fraction of steps within 0.3 +- 0.05. That bound
    is 6.9 standard deviations (sqrt(0.3*0.7/4000) = 0.00725): false failure < 4 x 2 x 3e-12 < 1e-6."""
    groups = PatientGroups(PATIENTS)
    gen = torch.Generator().manual_seed(1)
    drawn = torch.zeros(groups.num_groups)
    steps = 4000
    for _ in range(steps):
        keep = torch.rand(groups.num_groups, generator=gen) < 0.3
        idx = groups.sample(keep)
        expect = {i for i, g in enumerate(groups.row_group.tolist()) if keep[g]}
        assert set(idx.tolist()) == expect and len(idx) == len(expect)
        seq = groups.row_group[idx].tolist()
        assert seq == sorted(seq)  # a patient's rows are contiguous
        drawn += keep.float()
    frac = drawn / steps
    assert bool(((frac - 0.3).abs() < 0.05).all()), frac


def test_parts_are_whole_patients():
    groups = PatientGroups(PATIENTS)  # sizes: p1 4, p2 2, p3 2, p4 1
    idx = groups.sample(torch.ones(4, dtype=torch.bool))
    parts = list(groups.parts(idx, 3))
    sizes = [len(rows) for rows, _ in parts]
    assert sizes == [4, 2, 3]  # p1 alone (bigger than 3); p2 (p2 + p3 would be 4); p3 + p4
    for rows, local in parts:
        ids = groups.row_group[rows]
        for k in local.unique():
            # each local group is one patient, and that patient's rows are all in this part
            members = ids[local == k].unique()
            assert len(members) == 1
            assert int((groups.row_group == members[0]).sum()) == int((local == k).sum())
    assert sum(sizes) == len(PATIENTS)


def test_patient_ids_must_match_the_rows():
    _, loaded = model("transformer")
    data = encode(examples(4), loaded, max_length=16)
    with pytest.raises(DatasetError, match="patient ids"):
        train_local_private(loaded, data, TrainConfig(optimizer="sgd"), DPSGD(1.0, 1.0, 0.5, 1),
                            trainable=select_tensors(loaded.module.state_dict()), groups=PatientGroups(["a", "b"]))


@pytest.mark.parametrize("groups", [[0, 1, 0, 2, 1, 0, 3], [2, 2, 0, 1, 0, 2, 2], [0, 1, 2, 3, 4, 5, 6]])
def test_group_clipping_is_exact_for_every_layer_kind(groups):
    """The ghost test network (Embedding with padding and a repeated id, LayerNorm, q/k/v sharing an input, both
    Linear norm formulas, a head on [B, d]): per-group norms and the clipped sum equal clip(grad of the group's
    summed losses) summed over groups, one autograd call per group; singletons give the per-example case."""
    import torch.nn.functional as F

    from tests.unit.privacy.test_ghost import Net, _data

    torch.manual_seed(0)
    net = Net()
    ids, y = _data(len(groups))
    g = torch.tensor(groups)
    params = [p for p in net.parameters()]
    want_norms, want = [], [torch.zeros_like(p) for p in params]
    for k in range(int(g.max()) + 1):
        rows = (g == k).nonzero().flatten()
        loss = F.cross_entropy(net(ids[rows]), y[rows], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((x.double() ** 2).sum() for x in grads))
        want_norms.append(float(norm))
        for acc, x in zip(want, grads):
            acc += x * min(1.0, 0.5 / float(norm))
    clip = GhostClipping(net, params, 0.5)
    with clip.recording():
        losses = F.cross_entropy(net(ids), y, reduction="none")
    norms = clip.add_clipped_sum(losses, g)
    clip.close()
    torch.testing.assert_close(norms.double(), torch.tensor(want_norms, dtype=torch.float64), rtol=1e-4, atol=1e-6)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)
