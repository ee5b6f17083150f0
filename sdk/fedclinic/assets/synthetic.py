"""Synthetic(alpha, beta): the federated benchmark of FedProx (Li et al., MLSys 2020), used by FLCMC.

For K clients, d = 60 features and C = 10 classes, per client k::

    n_k = int(LogNormal(4, 2)) + 50
    u_k ~ N(0, alpha^2)      (mean of W_k and of b_k)          B_k ~ N(0, beta^2)
    v_k ~ N(B_k, 1)^d        (mean of x; v_k = 0 for the IID variant)
    W_k ~ N(u_k, 1)^(d x C),  b_k ~ N(u_k, 1)^C                (one shared W, b ~ N(0, 1) when IID)
    x ~ N(v_k, Sigma),  Sigma = diag(j^-1.2), j = 1..d
    y = argmax(softmax(x W_k + b_k)) = argmax(x W_k + b_k)

alpha and beta are standard deviations; beta skews the clients' feature distributions. The papers say
alpha skews the labelling functions, but in this generator it cannot. u_k is added to *every* entry of
W_k and b_k, so it adds u_k * (sum_j x_j + 1) to every class logit alike, and the argmax (the label) does
not change. With the same seed, Synthetic(alpha, beta) and Synthetic(0, beta) are identical (tested). The
published Synthetic datasets differ across alpha only through different random draws. Label skew comes
from the per-client noise in W_k and b_k, which exists at every alpha. Each client's samples are shuffled and split 90/10 into train and test, as in
FedProx's released data.

Random draws follow the order of FedProx's ``generate_synthetic.py`` on one ``numpy.random.RandomState``
seeded with ``seed``, so seeding that script's NumPy the same way gives the same features and labels.
The script itself sets no seed, and its shuffle uses Python's ``random``, so FedProx's released files
cannot be regenerated bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedclinic.errors import ConfigError


@dataclass(frozen=True)
class ClientData:
    x_train: np.ndarray  # (n_train, d) float32
    y_train: np.ndarray  # (n_train,) int64
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_samples(self) -> int:
        return len(self.y_train) + len(self.y_test)


def synthetic(alpha: float, beta: float, *, num_clients: int = 30, dim: int = 60, num_classes: int = 10,
              seed: int = 0, iid: bool = False, train_fraction: float = 0.9) -> list[ClientData]:
    """Generate Synthetic(alpha, beta) (or the IID variant) for ``num_clients`` clients; see the module doc."""
    if alpha < 0 or beta < 0:
        raise ConfigError(f"alpha and beta are standard deviations and must be >= 0, got {alpha}, {beta}")
    if num_clients < 1 or dim < 1 or num_classes < 2:
        raise ConfigError("num_clients and dim must be >= 1 and num_classes >= 2")
    if not 0 < train_fraction < 1:
        raise ConfigError("train_fraction must be in (0, 1)")
    rs = np.random.RandomState(seed)
    samples = rs.lognormal(4, 2, num_clients).astype(int) + 50
    mean_w = rs.normal(0, alpha, num_clients)
    mean_b = mean_w
    b_shift = rs.normal(0, beta, num_clients)
    cov_diag = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2)
    mean_x = np.zeros((num_clients, dim))
    for k in range(num_clients):
        mean_x[k] = np.ones(dim) * b_shift[k] if iid else rs.normal(b_shift[k], 1, dim)
    if iid:
        mean_x[:] = 0.0
        w_global = rs.normal(0, 1, (dim, num_classes))
        b_global = rs.normal(0, 1, num_classes)
    clients = []
    for k in range(num_clients):
        w = rs.normal(mean_w[k], 1, (dim, num_classes))
        b = rs.normal(mean_b[k], 1, num_classes)
        if iid:
            w, b = w_global, b_global
        # x ~ N(mean, diag(cov)): same distribution as multivariate_normal with a diagonal covariance
        x = mean_x[k] + rs.standard_normal((samples[k], dim)) * np.sqrt(cov_diag)
        y = np.argmax(x @ w + b, axis=1)
        order = rs.permutation(samples[k])
        x, y = x[order].astype(np.float32), y[order].astype(np.int64)
        n_train = int(train_fraction * samples[k])
        clients.append(ClientData(x[:n_train], y[:n_train], x[n_train:], y[n_train:]))
    return clients
