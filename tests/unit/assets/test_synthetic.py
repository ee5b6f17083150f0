import numpy as np
import pytest

from fedclinic.assets.synthetic import synthetic
from fedclinic.errors import ConfigError


def _label_entropy(clients):
    ents = []
    for c in clients:
        p = np.bincount(c.y_train, minlength=10) / len(c.y_train)
        p = p[p > 0]
        ents.append(-(p * np.log(p)).sum())
    return float(np.mean(ents))


def test_shapes_sizes_and_split():
    clients = synthetic(0.5, 0.5, seed=1)
    assert len(clients) == 30
    for c in clients:
        n = c.num_samples
        assert n >= 50 and len(c.y_train) == int(0.9 * n)
        assert c.x_train.shape == (len(c.y_train), 60) and c.x_train.dtype == np.float32
        assert c.y_train.min() >= 0 and c.y_train.max() <= 9


def test_seeded_and_deterministic():
    a, b, c = synthetic(1, 1, seed=3), synthetic(1, 1, seed=3), synthetic(1, 1, seed=4)
    assert all(np.array_equal(x.x_train, y.x_train) and np.array_equal(x.y_test, y.y_test) for x, y in zip(a, b))
    assert not all(np.array_equal(x.y_train[:5], y.y_train[:5]) for x, y in zip(a, c) if len(x.y_train) > 5)


def test_beta_skews_features_iid_is_centred():
    means = lambda cs: np.array([np.concatenate([c.x_train, c.x_test]).mean(axis=0) for c in cs])  # noqa: E731
    assert np.abs(means(synthetic(0, 0, iid=True, seed=0))).mean() < 0.2  # every client centred at 0
    assert np.abs(means(synthetic(0, 2, seed=0))).mean() > 0.8            # beta moves client means apart


@pytest.mark.parametrize("alpha", [0.5, 1.0, 5.0])
def test_alpha_cannot_change_labels_in_this_generator(alpha):
    """u_k shifts every class logit equally, so argmax is invariant: same seed, same data (see module doc)."""
    base, skewed = synthetic(0, 0.5, seed=2), synthetic(alpha, 0.5, seed=2)
    assert all(np.array_equal(a.y_train, b.y_train) and np.array_equal(a.x_train, b.x_train)
               for a, b in zip(base, skewed))
    assert _label_entropy(base) < np.log(10)  # clients are label-skewed anyway (per-client noise in W, b)


def test_bad_parameters():
    with pytest.raises(ConfigError, match="standard deviations"):
        synthetic(-1, 0)
    with pytest.raises(ConfigError, match="train_fraction"):
        synthetic(0, 0, train_fraction=1.0)
