"""Server optimisers: what the cloud does with a round's fused model.

Each treats ``Delta = fused - current`` as a pseudo-gradient (Reddi et al., "Adaptive
Federated Optimization", ICLR 2021; FedAvgM: Hsu et al., 2019) and is a small class in
:data:`SERVER_OPTIMIZERS`, like the selectors and fusion rules: ``none`` adopts the fused
model; ``fedavgm`` keeps momentum ``v = beta1 v + Delta``; the adaptive ones keep
``m = beta1 m + (1 - beta1) Delta`` and a second moment ``v``, differ only in how ``v``
follows ``Delta^2`` (one hook), and step ``lr m / (sqrt v + tau)``.

Their settings are declared once, in :class:`ServerOptimizerSettings`, which
``CloudConfig`` extends (the ``[cloud]`` table keeps them as flat keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_client.config import check_range
from edge_client.errors import ConfigError

__all__ = ["ServerOptimizerSettings", "ServerOptimizer", "SERVER_OPTIMIZERS",
           "build_server_optimizer"]


@dataclass(frozen=True, kw_only=True)
class ServerOptimizerSettings:
    """The cloud's server optimiser and its hyper-parameters."""

    server_optimizer: str = "none"  # none, fedavgm, fedadam, fedyogi or fedadagrad
    server_lr: float = 1.0  # the server optimiser's step size
    beta1: float = 0.9  # first-moment decay (momentum)
    beta2: float = 0.99  # second-moment decay (adaptive optimisers)
    tau: float = 1e-3  # adaptivity floor of the adaptive optimisers

    def __post_init__(self) -> None:
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            raise ConfigError("server_optimizer", f"must be one of {tuple(SERVER_OPTIMIZERS)}")
        check_range("server_lr", self.server_lr, 0, low_open=True)
        check_range("beta1", self.beta1, 0, 1)
        check_range("beta2", self.beta2, 0, 1)
        check_range("tau", self.tau, 0, low_open=True)


class ServerOptimizer:
    """Adopts the fused model (``none``); the base of the others."""

    def __init__(self, settings: ServerOptimizerSettings) -> None:
        self.settings = settings
        self._m: np.ndarray | None = None
        self._v: np.ndarray | None = None

    def state(self) -> dict[str, np.ndarray]:
        """The moments, for a checkpoint (empty before the first step)."""
        return {} if self._m is None or self._v is None else {"m": self._m, "v": self._v}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        if state:
            self._m = np.array(state["m"], dtype=np.float64)
            self._v = np.array(state["v"], dtype=np.float64)

    def step(self, current: np.ndarray, fused: np.ndarray) -> np.ndarray:
        """Return the next global model; ``current`` and ``fused`` are left untouched."""
        return np.asarray(fused, dtype=np.float32).copy()

    def _delta(self, current: np.ndarray, fused: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``current`` and ``Delta`` in float64, and the moments ``m`` and ``v`` so far."""
        current = np.asarray(current, dtype=np.float64)
        delta = np.asarray(fused, dtype=np.float64) - current
        if self._m is None or self._v is None:
            self._m = np.zeros_like(delta)
            # Reddi et al. initialise v to tau^2 so the first steps are bounded.
            self._v = np.full_like(delta, self.settings.tau**2)
        return current, delta, self._m, self._v


class FedAvgM(ServerOptimizer):
    def step(self, current: np.ndarray, fused: np.ndarray) -> np.ndarray:
        current, delta, m, _ = self._delta(current, fused)
        self._m = m = self.settings.beta1 * m + delta
        return (current + self.settings.server_lr * m).astype(np.float32)


class _Adaptive(ServerOptimizer):
    def _second_moment(self, v: np.ndarray, sq: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def step(self, current: np.ndarray, fused: np.ndarray) -> np.ndarray:
        s = self.settings
        current, delta, m, v = self._delta(current, fused)
        self._m = m = s.beta1 * m + (1 - s.beta1) * delta
        self._v = v = self._second_moment(v, delta**2)
        return (current + s.server_lr * m / (np.sqrt(v) + s.tau)).astype(np.float32)


class FedAdagrad(_Adaptive):
    def _second_moment(self, v: np.ndarray, sq: np.ndarray) -> np.ndarray:
        return v + sq


class FedAdam(_Adaptive):
    def _second_moment(self, v: np.ndarray, sq: np.ndarray) -> np.ndarray:
        return self.settings.beta2 * v + (1 - self.settings.beta2) * sq


class FedYogi(_Adaptive):
    def _second_moment(self, v: np.ndarray, sq: np.ndarray) -> np.ndarray:
        return v - (1 - self.settings.beta2) * sq * np.sign(v - sq)


SERVER_OPTIMIZERS: dict[str, type[ServerOptimizer]] = {
    "none": ServerOptimizer,
    "fedavgm": FedAvgM,
    "fedadagrad": FedAdagrad,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
}


def build_server_optimizer(settings: ServerOptimizerSettings) -> ServerOptimizer:
    """The registered server optimiser ``settings`` names."""
    return SERVER_OPTIMIZERS[settings.server_optimizer](settings)
