"""Server-side optimizers over the weighted mean delta (momentum and adaptive federated optimization).

Notation: for each tensor, Delta_t is the sample-weighted mean of the sites' deltas in round t (exactly what
FedAvg would add), x_t the global tensor, eta the server learning rate.

FedAvgM (Hsu, Qi, Brown 2019)::

    v_t = beta * v_{t-1} + Delta_t          x_{t+1} = x_t + eta * v_t

FedAdagrad / FedAdam / FedYogi (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Alg. 2)::

    m_t = beta1 * m_{t-1} + (1 - beta1) * Delta_t
    v_t = v_{t-1} + Delta_t^2                                        (FedAdagrad)
    v_t = beta2 * v_{t-1} + (1 - beta2) * Delta_t^2                  (FedAdam)
    v_t = v_{t-1} - (1 - beta2) * Delta_t^2 * sign(v_{t-1} - Delta_t^2)   (FedYogi)
    x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + tau)

with m_{-1} = 0 and v_{-1} = tau^2, as the paper's algorithm allows (v_{-1} >= tau^2), and no bias
correction (the paper has none). Defaults are the paper's: eta = 1e-2 (FedAvgM: 1.0), beta1 = 0.9,
beta2 = 0.99, tau = 1e-3. The moments are per tensor, float32, kept as strategy state between rounds.
A tensor that no site sent in a round keeps its moments unchanged.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import numpy as np

from fedclinic.strategies.fedavg import FedAvg


class _Stateful(FedAvg):
    def __init__(self, server_lr: float) -> None:
        super().__init__(server_lr=server_lr)
        self._state: dict[str, np.ndarray] = {}

    def state(self) -> dict[str, np.ndarray]:
        return dict(self._state)

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self._state = {k: np.array(v, dtype=np.float32).reshape(-1) for k, v in state.items()}

    def _slot(self, key: str, size: int, init: float = 0.0) -> np.ndarray:
        arr = self._state.get(key)
        if arr is None or arr.size != size:
            arr = self._state[key] = np.full(size, init, dtype=np.float32)
        return arr


class FedAvgM(_Stateful):
    name: ClassVar[str] = "fedavgm"

    def __init__(self, server_lr: float = 1.0, momentum: float = 0.9) -> None:
        super().__init__(server_lr)
        self.momentum = float(momentum)

    def _server_step(self, name: str, mean_delta: np.ndarray) -> None:
        v = self._slot(f"v/{name}", mean_delta.size)
        v *= np.float32(self.momentum)
        v += mean_delta
        np.multiply(v, np.float32(self.server_lr), out=mean_delta)


class _FedOpt(_Stateful):
    def __init__(self, server_lr: float = 1e-2, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__(server_lr)
        self.beta1, self.beta2, self.tau = float(beta1), float(beta2), float(tau)

    def _second_moment(self, v: np.ndarray, sq: np.ndarray) -> None:
        raise NotImplementedError

    def _server_step(self, name: str, mean_delta: np.ndarray) -> None:
        m = self._slot(f"m/{name}", mean_delta.size)
        v = self._slot(f"v/{name}", mean_delta.size, init=self.tau ** 2)
        m *= np.float32(self.beta1)
        m += np.float32(1 - self.beta1) * mean_delta
        np.square(mean_delta, out=mean_delta)  # reuse the buffer: it holds Delta^2 now
        self._second_moment(v, mean_delta)
        np.sqrt(v, out=mean_delta)
        mean_delta += np.float32(self.tau)
        np.divide(m, mean_delta, out=mean_delta)
        mean_delta *= np.float32(self.server_lr)


class FedAdagrad(_FedOpt):
    name: ClassVar[str] = "fedadagrad"

    def _second_moment(self, v: np.ndarray, sq: np.ndarray) -> None:
        v += sq


class FedAdam(_FedOpt):
    name: ClassVar[str] = "fedadam"

    def _second_moment(self, v: np.ndarray, sq: np.ndarray) -> None:
        v *= np.float32(self.beta2)
        v += np.float32(1 - self.beta2) * sq


class FedYogi(_FedOpt):
    name: ClassVar[str] = "fedyogi"

    def _second_moment(self, v: np.ndarray, sq: np.ndarray) -> None:
        v -= np.float32(1 - self.beta2) * sq * np.sign(v - sq)
