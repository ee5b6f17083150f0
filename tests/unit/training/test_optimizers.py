"""Local optimizers against the papers' equations, written out in numpy; the proximal term; kept state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from fedclinic.errors import ConfigError, DatasetError
from fedclinic.models.feature_classification import build, encode_features, package_feature_model
from fedclinic.training.optimizers import add_proximal_gradient, make_optimizer
from fedclinic.training.trainer import TrainConfig, train_local


def _quadratic_grads(theta, targets):
    """Gradient of 1/2 ||theta - target_s||^2 at step s: a deterministic, changing gradient sequence."""
    return theta - targets


def _reference_adam(theta0, targets, lr, b1=0.9, b2=0.999, eps=1e-8, mu=0.0, anchor=None):
    """FLCMC Eqs. 15-20 (mu = 0) and 21-27 (PAdam) in float64, literally."""
    theta = theta0.astype(np.float64).copy()
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    for s, target in enumerate(targets, start=1):
        g = _quadratic_grads(theta, target)
        if mu:
            g = g + mu * (theta - anchor)                            # Eq. 22
        m = b1 * m + (1 - b1) * g                                    # Eqs. 16 / 23
        v = b2 * v + (1 - b2) * g ** 2                               # Eqs. 17 / 24
        m_hat, v_hat = m / (1 - b1 ** s), v / (1 - b2 ** s)          # Eqs. 18-19 / 25-26
        theta = theta - lr * m_hat / (np.sqrt(v_hat) + eps)          # Eqs. 20 / 27
    return theta


def _run_torch(name, theta0, targets, lr, mu=0.0):
    p = torch.nn.Parameter(torch.tensor(theta0, dtype=torch.float64))
    anchor = [p.detach().clone()]
    opt = make_optimizer(name, [p], lr=lr)
    for target in targets:
        opt.zero_grad()
        loss = 0.5 * ((p - torch.tensor(target)) ** 2).sum()
        loss.backward()
        if mu:
            add_proximal_gradient([p], anchor, mu)
        opt.step()
    return p.detach().numpy()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(1, 30), lr=st.sampled_from([1e-3, 1e-2, 0.3]),
       scale=st.sampled_from([1e-6, 1.0, 1e3]))
def test_self_adam_is_eqs_15_to_20(seed, steps, lr, scale):
    rng = np.random.default_rng(seed)
    theta0 = rng.normal(size=7) * scale
    targets = rng.normal(size=(steps, 7)) * scale
    np.testing.assert_allclose(_run_torch("self_adam", theta0, targets, lr), _reference_adam(theta0, targets, lr),
                               rtol=1e-10, atol=1e-12 * max(scale, 1))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(2, 30), mu=st.sampled_from([0.03, 1.0, 10.0]))
def test_padam_is_adam_on_the_perturbed_gradient_eqs_21_to_27(seed, steps, mu):
    rng = np.random.default_rng(seed)
    theta0 = rng.normal(size=5)
    targets = rng.normal(size=(steps, 5)) * 3
    got = _run_torch("padam", theta0, targets, 0.05, mu=mu)
    np.testing.assert_allclose(got, _reference_adam(theta0, targets, 0.05, mu=mu, anchor=theta0), rtol=1e-10,
                               atol=1e-12)
    # the perturbation changed the path: by far more than the 1e-10 the two implementations agree to (with mu = 0.03
    # over 2 steps the change can be ~1e-6, inside np.allclose's default tolerance)
    assert not np.allclose(got, _reference_adam(theta0, targets, 0.05), rtol=0, atol=1e-8)


def test_padam_with_mu_zero_is_self_adam_and_torch_adam_is_the_same_formula():
    rng = np.random.default_rng(1)
    theta0, targets = rng.normal(size=6), rng.normal(size=(12, 6))
    self_adam = _run_torch("self_adam", theta0, targets, 0.01)
    np.testing.assert_array_equal(_run_torch("padam", theta0, targets, 0.01, mu=0.0), self_adam)
    # torch's Adam puts eps outside sqrt(v_hat) too: it is Eqs. 15-20 up to rounding (Keras' Adam is not)
    np.testing.assert_allclose(_run_torch("adam", theta0, targets, 0.01), self_adam, rtol=1e-12)


def test_proximal_gradient_equals_autograd_of_the_proximal_term():
    rng = np.random.default_rng(2)
    p = torch.nn.Parameter(torch.tensor(rng.normal(size=(3, 4))))
    anchor = torch.tensor(rng.normal(size=(3, 4)))
    p.grad = torch.zeros_like(p)
    add_proximal_gradient([p], [anchor], 0.7)
    q = p.detach().clone().requires_grad_(True)
    (0.35 * ((q - anchor) ** 2).sum()).backward()
    np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-12)


def test_unknown_optimizer_and_state_policy_are_config_errors():
    with pytest.raises(ConfigError, match="optimizer 'lion' is unknown; choose one of adamw, adam, sgd, self_adam"):
        TrainConfig(optimizer="lion")
    with pytest.raises(ConfigError, match="optimizer_state 'forever' is unknown; choose one of reset, keep"):
        TrainConfig(optimizer_state="forever")


# ---- the feature-classification family and kept optimizer state ------------------------------------------


def _blobs(n=120, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n)
    centres = np.array([[3, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 0]], dtype=np.float32)
    return (centres[y] + rng.normal(size=(n, 4))).astype(np.float32), y


def test_feature_logreg_learns_and_keeps_optimizer_state_across_rounds():
    x, y = _blobs()
    pkg = package_feature_model(num_features=4, labels=["a", "b", "c"])
    model = build(pkg)
    data = encode_features(x, y, model)
    names = ["linear.weight", "linear.bias"]
    reset = TrainConfig(local_epochs=2, batch_size=10, learning_rate=0.05, optimizer="self_adam", max_grad_norm=0)
    first = train_local(model, data, reset, trainable=names)
    assert first.optimizer_state is None and first.steps == 24
    keep = TrainConfig(local_epochs=2, batch_size=10, learning_rate=0.05, optimizer="self_adam", max_grad_norm=0,
                       optimizer_state="keep")
    r1 = train_local(model, data, keep, trainable=names)
    r2 = train_local(model, data, keep, trainable=names, optimizer_state=r1.optimizer_state)
    assert r1.optimizer_state["linear.weight"]["step"] == 24
    assert r2.optimizer_state["linear.weight"]["step"] == 48  # the step counter s continued
    assert r2.loss < first.loss
    from fedclinic.training.trainer import evaluate

    assert evaluate(model, data)["accuracy"] > 0.9


def test_kept_state_of_another_shape_is_refused_with_advice():
    x, y = _blobs()
    model = build(package_feature_model(num_features=4, labels=["a", "b", "c"]))
    data = encode_features(x, y, model)
    keep = TrainConfig(optimizer="adam", optimizer_state="keep", max_grad_norm=0)
    wrong = {"linear.bias": {"step": torch.tensor(3.0), "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}}
    from fedclinic.errors import IntegrityError

    with pytest.raises(IntegrityError, match="optimizer_state='reset'"):
        train_local(model, data, keep, trainable=["linear.bias"], optimizer_state=wrong)


@pytest.mark.parametrize("x, y, match", [
    (np.zeros((3, 5), np.float32), np.zeros(3, int), r"features must be \[rows, 4\]"),
    (np.array([[0, 0, 0, 0], [0, np.nan, 0, 0]], np.float32), np.zeros(2, int), "row 1: non-finite"),
    (np.zeros((2, 4), np.float32), np.array([0, 3]), r"row 1: label 3 is outside 0..2"),
    (np.zeros((2, 4), np.float32), np.array([0.5, 1.0]), "class indices"),
    (np.zeros((2, 4), np.float32), np.array([0]), "2 feature rows but 1 labels"),
    (np.zeros((0, 4), np.float32), np.zeros(0, int), "empty"),
])
def test_feature_data_errors_name_the_row(x, y, match):
    model = build(package_feature_model(num_features=4, labels=["a", "b", "c"]))
    with pytest.raises(DatasetError, match=match):
        encode_features(x, y, model)


def test_feature_package_round_trips_and_bad_configs_are_refused():
    pkg = package_feature_model(num_features=6, labels=["x", "y"])
    assert sorted(pkg.tensors) == ["linear.bias", "linear.weight"] and pkg.tensors["linear.weight"].shape == (2, 6)
    assert build(pkg).num_features == 6
    with pytest.raises(ConfigError, match="labels must be at least two"):
        package_feature_model(num_features=6, labels=["x", "x"])
    with pytest.raises(ConfigError, match="unknown architecture 'mlp'"):
        package_feature_model(num_features=6, labels=["x", "y"], architecture="mlp")


def test_gradient_change_rate_is_measured_on_full_passes_before_and_after_training():
    from fedclinic.training.trainer import gradient_change_rate

    x, y = _blobs(n=40)
    model = build(package_feature_model(num_features=4, labels=["a", "b", "c"]))
    data = encode_features(x, y, model)
    names = ["linear.weight", "linear.bias"]

    def full_grads():
        model.module.zero_grad()
        logits = model.logits(data.features)
        torch.nn.functional.cross_entropy(logits, data.labels, reduction="sum").div(10).backward()
        return [model.module.linear.weight.grad.clone() / len(data), model.module.linear.bias.grad.clone() / len(data)]

    # batches of 10 over 40 rows: sum of the 4 batch means = sum of all losses / 10; then / 40, as the notebook
    before = full_grads()
    cfg = TrainConfig(local_epochs=1, batch_size=10, learning_rate=0.1, optimizer="sgd", max_grad_norm=0,
                      measure_gradient_change=True)
    result = train_local(model, data, cfg, trainable=names)
    after = full_grads()
    assert result.gradient_change_rate == pytest.approx(gradient_change_rate(before, after), rel=1e-5)
    assert result.gradient_change_rate > 0
    assert train_local(model, data, TrainConfig(max_grad_norm=0), trainable=names).gradient_change_rate is None


def test_a_tensor_joining_the_trainable_set_later_gets_its_own_step_counter():
    x, y = _blobs(n=30)
    model = build(package_feature_model(num_features=4, labels=["a", "b", "c"]))
    data = encode_features(x, y, model)
    keep = TrainConfig(local_epochs=1, batch_size=10, learning_rate=0.01, optimizer="self_adam", max_grad_norm=0,
                       optimizer_state="keep")
    first = train_local(model, data, keep, trainable=["linear.bias"])
    second = train_local(model, data, keep, trainable=["linear.weight", "linear.bias"],
                         optimizer_state=first.optimizer_state)
    assert second.optimizer_state["linear.bias"]["step"] == 6 and second.optimizer_state["linear.weight"]["step"] == 3
