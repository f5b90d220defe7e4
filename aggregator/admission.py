"""Update admission at a station: what an arriving update stands for, whether it can be
honest, and how far it may move the model.

An update is its weights, or its step through the fleet's update stages decoded onto the
model it was trained from; its sample count must fit ``local_steps x batch_size`` and it
may not repeat a recent update of its sender (:class:`~aggregator.trust.ReplayGuard`);
its distance from that model is bounded by :class:`~aggregator.trust.NormGuard`, which
clips onto the bound and refuses past ``update_norm_hard_factor`` times it.  Every refusal
and clip goes to the station's ``reject`` and ``clip``, which count it against the sender.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from edge_client import messages as m
from edge_client.errors import MessageError
from edge_client.pipeline import Encoded, UpdatePipeline

from .checkpoint import group, grouped
from .config import StationConfig
from .trust import NormGuard, ReplayGuard

__all__ = ["UpdateAdmission"]

log = logging.getLogger(__name__)


class UpdateAdmission:
    """A station's checks of each update, with the guards' state they keep."""

    def __init__(self, config: StationConfig, num_params: int, *,
                 reject: Callable[[str, str], Any], clip: Callable[[str], None]) -> None:
        self.config, self.num_params = config, num_params
        self._reject, self._clip = reject, clip
        self.pipeline = UpdatePipeline(config.update_stages)
        # Under local DP every honest step carries its noise: the guard starts from that
        # length (else it would refuse every noised update before any joined its history).
        self.guard = NormGuard(bound=config.update_norm_bound, factor=config.update_norm_factor,
                               initial=max(config.lr * config.local_steps
                                           * config.grad_norm_bound,
                                           self.pipeline.noised_step_bound(num_params)),
                               hard_factor=config.update_norm_hard_factor)
        self.replay = ReplayGuard(num_params, seed=config.seed,
                                  tolerance=config.replay_tolerance)

    def arrays(self) -> dict[str, np.ndarray]:
        """The checkpoint's share of arrays: each device's recent updates (the replay
        guard's); the norm guard's history is :meth:`norms`."""
        return grouped("replay", self.replay.state())

    def norms(self) -> list[float]:
        return self.guard.state()

    def restore(self, arrays: Mapping[str, np.ndarray], norms: list[float]) -> None:
        """Back to :meth:`arrays` and :meth:`norms`, for the roster's devices only."""
        self.guard.restore(norms)
        self.replay.restore({d: v for d, v in group(arrays, "replay").items()
                             if d in self.config.devices})

    def admit(self, msg: m.DeviceUpdate, base: np.ndarray) -> np.ndarray | None:
        """The weights of ``msg`` to fuse (clipped onto the distance bound where beyond it),
        or None, counted and logged, where its counts, size or distance cannot be honest.
        ``base``: the model it was trained from, which its step is measured and decoded
        from."""
        z = self._trained_model(msg, base)
        if z is None:
            return None
        problem = self._implausible(msg, z, base)
        if problem:
            self._reject(*problem)
            return None
        limit = self.guard.limit
        bounded = self.guard.check(z, base)
        if bounded.update is None:
            self._reject("update_norm", f"moved the model {bounded.distance:.4g} from w^m, the "
                         f"hard bound is {self.config.update_norm_hard_factor:g} x {limit:.4g}")
        elif bounded.clipped:
            self._clip("update_norm")
            log.debug("station %s: update of %s clipped from %.4g to %.4g",
                      self.config.station_id, msg.sender, bounded.distance, limit)
        return bounded.update

    def _trained_model(self, msg: m.DeviceUpdate, base: np.ndarray) -> np.ndarray | None:
        """The model ``z`` an update stands for: its weights, or its encoded step (the fleet's
        update stages) added to ``base``; None, counted, where it is neither."""
        pipeline = self.pipeline
        if msg.encoding != pipeline.id:
            self._reject("wrong_encoding", f"update encoded as {msg.encoding!r}, the fleet's "
                         f"update stages are {pipeline.id!r}")
            return None
        if not pipeline.active:
            if msg.indices.size or msg.half.size or msg.codes.size or msg.scales.size:
                self._reject("bad_encoding", "a model update carries encoded arrays too")
                return None
            if msg.weights.size != self.num_params:
                self._reject("wrong_length", f"{msg.weights.size} weights, expected "
                             f"{self.num_params}")
                return None
            return msg.weights
        try:
            step = pipeline.decode(Encoded(indices=msg.indices, values=msg.weights,
                                           half=msg.half, codes=msg.codes, scales=msg.scales),
                                   self.num_params)
        except MessageError as exc:
            self._reject(exc.reason, str(exc))
            return None
        z = base + step
        if not np.isfinite(z).all():  # finite codes times finite scales can still overflow
            self._reject("non_finite", "the decoded step is not finite")
            return None
        return z

    def _implausible(self, msg: m.DeviceUpdate, z: np.ndarray, base: np.ndarray
                     ) -> tuple[str, str] | None:
        """Why an update's claims (its counts, freshness) cannot be honest, or None."""
        cfg = self.config
        most = cfg.local_steps * cfg.batch_size
        if not 1 <= msg.num_samples <= most:
            return "bad_count", (f"claims {msg.num_samples} samples; a device trains on 1.."
                                 f"{most} (local_steps x batch_size) per iteration: its "
                                 "[device] batch_size and local_steps must not exceed this "
                                 "station's (safl provision writes both from [training])")
        fresh, ratio = self.replay.check(msg.sender, z, base)
        if not fresh:
            return "replay", (f"repeats one of its recent updates (distance {ratio:.2g} x its "
                              f"step from w^m)")
        return None
