"""DP-SGD for NER (linear head and CRF) and QA (GPT-2 with a tied head, Llama): per-example clipping is exact and
per example (never per token), only trainable tensors change, and the steps that ran are the ones the ledger
accounts; a model without a per-example objective is refused at submit time (the LSTM, logreg and image-text
models: test_dp_sgd_loop.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from fedclinic.training import trainer as training
from fedclinic.errors import ConfigError
from fedclinic.models import build_model
from fedclinic.models.causal_lm import package_qa_from_config
from fedclinic.models.token_classification import package_ner_from_config
from fedclinic.privacy.accounting import TaskAccountant, epsilon_of
from fedclinic.privacy.dp_sgd import DPSGD, explicit_ids_hook, train_local_private
from fedclinic.privacy.per_example import PerExampleObjective
from fedclinic.training.trainer import TrainConfig

from tests.helpers import ner_models as ner
from tests.helpers import qa_models as qa

NO_DROPOUT_BERT = {**ner.TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
FAMILIES = ["ner", "ner-crf", "qa-gpt2", "qa-llama-tied"]


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _model_and_data(kind: str, n: int = 6):
    if kind.startswith("ner"):
        arch = "transformer-crf" if kind == "ner-crf" else "transformer"
        loaded = build_model(package_ner_from_config(labels=ner.LABELS, tokenizer_json=ner.tokenizer(),
                                                     config=NO_DROPOUT_BERT, architecture=arch, max_length=32))
        return loaded, training.encode(ner.make_examples(n, seed=3), loaded)
    config = qa.TINY if kind == "qa-gpt2" else {**qa.TINY_LLAMA, "tie_word_embeddings": True}
    loaded = build_model(package_qa_from_config(tokenizer_json=qa.tokenizer_json(), config=config, max_length=32,
                                                max_new_tokens=4))
    examples = (qa.toy_examples() * 2)[:n]
    return loaded, training.encode(examples, loaded)


def _params(loaded) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in loaded.module.named_parameters()}


def _per_example_gradients(loaded, data, names):
    """Each example's gradient of the family's own training loss on a batch of that example alone."""
    loaded.module.train()
    params = dict(loaded.module.named_parameters())
    out = []
    for i in range(len(data)):
        inputs, y = data.batch(torch.tensor([i]), torch.device("cpu"))
        grads = torch.autograd.grad(loaded.training_loss(inputs, y), [params[n] for n in names], allow_unused=True)
        out.append([torch.zeros_like(params[n]) if g is None else g for n, g in zip(names, grads)])
    return out


@pytest.mark.parametrize("kind, batch_size", [*((k, 16) for k in FAMILIES), ("ner-crf", 4), ("qa-gpt2", 4)])
def test_one_step_clips_each_example_not_each_token(kind, batch_size):
    """Sample rate 1 and negligible noise: plain SGD at lr 1 moves the weights by -(1/n) sum_i g_i min(1, C/|g_i|),
    with g_i the gradient of example i's own loss (its tokens' mean, its CRF likelihood, its answer tokens' mean);
    the per-sample gradients Opacus clipped are exactly these g_i (including a tied embedding's two uses). With a
    batch size below the sample's 6 examples the sample runs in parts (4 + 2): the step is the same, and the
    optimizer holds only the last part's per-sample gradients when it adds the noise."""
    loaded, data = _model_and_data(kind)
    names = [n for n, _ in loaded.module.named_parameters()]
    reference = _per_example_gradients(copy.deepcopy(loaded), data, names)
    norms = torch.stack([torch.sqrt(sum((g.double() ** 2).sum() for g in grads)) for grads in reference])
    clip = float(norms.median())  # some examples are clipped, some are not
    assert (norms > clip).any() and (norms < clip).any()
    before = _params(loaded)
    seen = []

    def inspect(optimizer):  # Opacus' per-sample gradients, as the optimizer clipped them
        flat = torch.cat([g.reshape(len(g), -1) for g in optimizer.grad_samples], dim=1)
        seen.append(flat.double().norm(dim=1))

    cfg = TrainConfig(optimizer="sgd", learning_rate=1.0, max_grad_norm=0.0, device="cpu", batch_size=batch_size)
    train_local_private(loaded, data, cfg, DPSGD(1e-9, clip, 1.0, 1), trainable=names, step_hook=inspect)
    last_part = len(data) - (len(data) - 1) // batch_size * batch_size
    torch.testing.assert_close(seen[0], norms[-last_part:], rtol=1e-4, atol=1e-7)
    after = _params(loaded)
    for k, name in enumerate(names):
        want = before[name] - sum(g[k] * min(1.0, clip / float(nrm)) for g, nrm in zip(reference, norms)) / len(data)
        torch.testing.assert_close(after[name], want, rtol=1e-4, atol=1e-6, msg=name)
    step = torch.sqrt(sum(((after[n] - before[n]).double() ** 2).sum() for n in names))
    assert step <= clip + 1e-6  # the mean of vectors of norm <= C


def test_per_example_losses_do_not_depend_on_the_other_rows():
    """The property the per-row bound rests on: example b's loss in a batch equals its loss alone, for every
    family (a batch-wide token mean would fail this)."""
    for kind in FAMILIES:
        loaded, data = _model_and_data(kind, n=5)
        loaded.module.eval()
        objective = PerExampleObjective(loaded, loaded.module, multi_label=False)
        with torch.no_grad():
            together = objective.per_example(*data.batch(torch.arange(5), torch.device("cpu")))
            alone = torch.cat([objective.per_example(*data.batch(torch.tensor([i]), torch.device("cpu")))
                               for i in range(5)])
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6, msg=kind)


@pytest.mark.parametrize("kind", FAMILIES)
def test_private_training_changes_only_the_trainable_tensors(kind):
    loaded, data = _model_and_data(kind, n=12)
    names = [n for n, _ in loaded.module.named_parameters()]
    frozen = {n for n in names if "embed" in n or ".wpe." in n or "layer.0.attention" in n or ".h.0." in n
              or "layers.0." in n}
    trainable = [n for n in names if n not in frozen]
    assert frozen and trainable
    before = _params(loaded)
    losses = []
    result = train_local_private(loaded, data, TrainConfig(optimizer="adamw", learning_rate=1e-2, device="cpu"),
                                 DPSGD(0.5, 1.0, 0.5, 4), trainable=trainable,
                                 progress=lambda step, total, loss: losses.append(loss))
    after = _params(loaded)
    assert result.steps == 4 and result.num_samples == 12 and len(losses) == 4
    assert all(torch.equal(before[n], after[n]) for n in frozen)
    assert all(not torch.equal(before[n], after[n]) for n in trainable)
    assert all(getattr(p, "grad_sample", None) is None and p.requires_grad for p in loaded.module.parameters())
    assert not any(m._forward_pre_hooks for m in loaded.module.modules())  # the id hooks are gone
    metrics = loaded.evaluate(data, batch_size=4, **({"max_generate": 2} if kind.startswith("qa") else {}))
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_the_steps_that_ran_are_the_steps_the_ledger_charges():
    """Opacus' own accountant, fed by the optimizer after every noisy step, ends where fedclinic's accounting of
    (sigma, q, steps) does: empty Poisson samples are noise-only steps, counted by both."""
    from opacus.accountants import RDPAccountant

    loaded, data = _model_and_data("ner", n=6)
    sigma, q, steps, delta = 1.3, 0.05, 8, 1e-5  # (1 - q)^6 = 0.74: most samples are empty
    opacus_accountant = RDPAccountant()
    before = _params(loaded)
    train_local_private(loaded, data, TrainConfig(optimizer="sgd", learning_rate=0.1, device="cpu"),
                        DPSGD(sigma, 1.0, q, steps),
                        trainable=[n for n, _ in loaded.module.named_parameters()],
                        step_hook=opacus_accountant.get_optimizer_hook_fn(sample_rate=q))
    assert opacus_accountant.history == [(sigma, q, steps)]
    ours = epsilon_of([(sigma, q, steps)], delta)
    assert opacus_accountant.get_epsilon(delta) == pytest.approx(ours, rel=1e-9)
    assert TaskAccountant("rdp", delta).with_steps(sigma, q, steps).epsilon() == pytest.approx(ours, rel=1e-9)
    assert any(not torch.equal(before[n], p) for n, p in loaded.module.named_parameters())


def test_an_all_empty_round_still_releases_only_noise():
    loaded, data = _model_and_data("ner-crf", n=3)
    before = _params(loaded)
    result = train_local_private(loaded, data, TrainConfig(optimizer="sgd", learning_rate=0.1, device="cpu"),
                                 DPSGD(1.0, 1.0, 1e-9, 2), trainable=["crf.transitions", "classifier.bias"])
    after = _params(loaded)
    assert result.loss == 0.0 and result.steps == 2
    assert not torch.equal(before["crf.transitions"], after["crf.transitions"])  # noise, sigma C / (q n) per step
    assert all(torch.equal(before[n], after[n]) for n in before if n not in ("crf.transitions", "classifier.bias"))


@pytest.mark.parametrize("kind", ["ner", "qa-gpt2"])
def test_ghost_clipping_is_refused_where_it_is_unsound(kind):
    loaded, data = _model_and_data(kind, n=2)
    with pytest.raises(ConfigError, match="use mode 'hooks'"):
        train_local_private(loaded, data, TrainConfig(), DPSGD(1.0, 1.0, 0.5, 1),
                            trainable=[n for n, _ in loaded.module.named_parameters()], mode="ghost")


@pytest.mark.parametrize("config", [
    {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
     "intermediate_size": 32},
    {"model_type": "roberta", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
     "intermediate_size": 32, "pad_token_id": 1, "max_position_embeddings": 40},
    {"model_type": "distilbert", "dim": 16, "n_layers": 1, "n_heads": 2, "hidden_dim": 32},
    {"model_type": "electra", "hidden_size": 16, "embedding_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
     "intermediate_size": 32},
    qa.TINY, qa.TINY_LLAMA,
], ids=lambda c: c["model_type"])
def test_explicit_ids_leave_every_allowed_model_type_unchanged(config):
    """The ids the hook passes are the ones each model would have used (RoBERTa positions from the padding, no
    token types for GPT-2): the outputs with and without the hook are equal."""
    from transformers import AutoConfig, AutoModel

    cfg = dict(config)
    model = AutoModel.from_config(AutoConfig.for_model(cfg.pop("model_type"), vocab_size=30, **cfg)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 1, 1, 1]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
        handles = explicit_ids_hook(model)
        try:
            hooked = model(input_ids=ids, attention_mask=mask).last_hidden_state
        finally:
            for h in handles:
                h.remove()
    on = mask.bool()
    torch.testing.assert_close(hooked[on], plain[on])


def test_a_task_asking_for_dp_sgd_learns_at_submit_time():
    from fedclinic.spec.task import privacy_problems

    ok = {"level": "sample", "target_epsilon": 8.0}
    assert privacy_problems(ok, "token-classification", "transformer-crf", "fedavg") == []
    assert privacy_problems(ok, "question-answering", "causal-lm", "fedavg") == []
    assert privacy_problems(ok, "image-text-classification", "resnet-bilstm", "fedavg") == []
    [problem] = privacy_problems(ok, "image-text-classification", "vit", "fedavg")
    assert "no per-example objective" in problem and "dp-fedavg" in problem
