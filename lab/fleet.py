"""A fleet's shape and its plan: what every engine and the process launcher build from.

:class:`Strategy` (a recipe's overrides per role), :class:`FleetSpec` (partitions, stations,
model, budget, clock) and :func:`plan_fleet` (ids, rosters and integer seeds: one source of
truth for the in-process simulation and for processes).  Below the factory and the engines
(``lab/factory.py``, ``lab/engine.py``, ``lab/ray_engine.py``) and the driver above them
(``lab/simulation.py``), which all import it and none of which it imports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_client.config import DeviceConfig, TrainingSettings
from edge_client.head_stats import HeadSpec
from edge_client.trainers import BodyTail

from .clock import ClockConfig, assign_profiles, check_batched_steps

__all__ = ["Strategy", "FleetSpec", "FleetPlan", "plan_fleet", "device_id",
           "PREQUENTIAL_PROMOTE"]


# An experiment's prequential accuracy scores the federation's models as they arrive, as
# the figures in docs/results.md always have; safe promotion (a device's default) would
# score the line's choice among them instead, at a forward pass over its window per model.
PREQUENTIAL_PROMOTE = "always"

@dataclass(frozen=True)
class Strategy:
    """A named federation recipe: overrides for each role's config."""

    name: str
    device: Mapping[str, Any] = field(default_factory=dict)
    station: Mapping[str, Any] = field(default_factory=dict)
    cloud: Mapping[str, Any] = field(default_factory=dict)
    flat: bool = False  # one station for the whole fleet (the SAFL paper's setting)


@dataclass(frozen=True)
class FleetSpec:
    """Fleet shape, model and streaming rate shared by every strategy of a run."""

    partitions: tuple[np.ndarray, ...]  # sample indices per device
    groups: tuple[np.ndarray, ...]  # device numbers per station
    rounds: int  # the cloud's rounds; only a cap when ``samples`` is set
    # Stop after the round in which the devices have trained this many samples in all
    # (0: run ``rounds``).  Budgets count samples trained, not batches scheduled: a device
    # that has sensed fewer than a batch trains on what it has.
    samples: int = 0
    model: str = "mlp"
    backends: tuple[str, ...] = ("numpy",)  # assigned to devices in turn: a mixed fleet
    artifacts: str | None = None  # exported model folder, for the "ort" backend
    lr: float = TrainingSettings.lr
    seed: int = 0
    arrivals_per_step: int = 32  # samples sensed per local-step time, fleet mean per device
    initial_samples: int = 64
    eval_samples: int | None = None  # test samples per evaluation (None: all)
    eval_every: int = 1  # rounds between evaluations of the global model (and the last)
    # Devices of one backend share one trainer: a device's model lives in its flat vectors,
    # the trainer is only compute.  Memory per simulated device then excludes the model.
    share_trainers: bool = False
    # Compromised devices (by number) and what they send (lab.attacks.ATTACKS).
    attack: str = "none"
    attackers: tuple[int, ...] = ()
    # Prequential accuracy: each device predicts one arriving sample in this many with its
    # deployable model before it may be trained on (0: off; each prediction is a forward pass).
    prequential_every: int = 0
    # Where the torch backend trains: "auto" (CUDA where torch sees one), "cpu", "cuda:N".
    torch_device: str = "auto"
    # A super node's members take their local steps in one batched call (torch's
    # train_members, vmap over their weights: the GPU's way); float-close to one by one.
    batched_steps: bool = False
    # Virtual time (lab/clock.py): the devices' boards and every link, priced; None: no
    # clock (every message arrives at once, no deadline fires, as before).
    clock: ClockConfig | None = None
    # The frozen body the devices' frames pass before the model (the data are its embeddings
    # already): the clock prices its forward on every arriving frame.
    body: str = "none"
    # Where set (an exported body's folder), launched devices run the body themselves on the
    # frames they replay: the data's training samples are frames, its test samples the
    # body's embeddings (the cloud scores the head).  Unset, the data are embeddings already.
    body_dir: str = ""
    hidden: int = 128  # the mlp's hidden units
    # The body's last blocks that train with the head ([model] train_body_blocks): the data
    # are then the activations before them, and the model is those blocks and the head.
    tail: BodyTail | None = None
    # A head solved in closed form from the statistics every device sums ([model] head_init
    # ridge or ncm, edge_client/head_stats.py); None: the head starts random.
    head: HeadSpec | None = None
    head_stats_every: int = 10  # station models between a device's sends of them
    # Each device keeps its own sums too, and the last row measures its personal head
    # (edge_client/personal_head.py) against the global one on its held-out slice.
    personal_heads: bool = False

    def __post_init__(self) -> None:
        check_batched_steps(self.batched_steps, self.clock is not None)

    @property
    def priced_model(self) -> str:
        """The model as the clock's profiles name it: with a body's blocks training,
        ``"efficientnet-lite0[-1:]+linear"`` (its last block and the head)."""
        return f"{self.tail.body}[-{self.tail.blocks}:]+{self.model}" if self.tail \
            else self.model


def device_id(k: int) -> str:
    return f"dev{k:03d}"


@dataclass(frozen=True)
class FleetPlan:
    """Every role's config values for one strategy on one fleet (plain mappings).

    The in-process simulation builds its roles from these, and the process launcher
    writes the same values into TOML files, so both run the same federation.
    """

    fleet: str
    cloud: dict[str, Any]
    stations: list[dict[str, Any]]
    devices: list[dict[str, Any]]  # each with its partition index "_k" and backend "_backend"
    replay_seeds: list[int]
    # Samples each device senses per local-step time: in proportion to its share of the
    # fleet's data, so that the seen counts behind P_real are the fleet's distribution.
    stream_rates: list[float]


_DEVICE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DeviceConfig)}


def plan_fleet(strategy: Strategy, spec: FleetSpec) -> FleetPlan:
    """Ids, rosters and integer seeds of a fleet: one source of truth for sim and processes."""
    n_dev = len(spec.partitions)
    seeds = [int(s.generate_state(1)[0]) for s in
             np.random.SeedSequence(spec.seed).spawn(3 * n_dev + len(spec.groups))]
    fleet = strategy.device.get("fleet", "sim")
    groups = (np.arange(n_dev),) if strategy.flat else spec.groups
    station_ids = [f"st{g}" for g in range(len(groups))]
    cloud = {"fleet": fleet, "stations": tuple(station_ids), "rounds": spec.rounds,
             **strategy.cloud}
    stations, devices, replay = [], [], [0] * n_dev
    profiles = assign_profiles(spec.clock, n_dev) if spec.clock else None
    # The station bounds its devices' claims by their settings, so it is told them.
    device_values = {"lr": spec.lr, **strategy.device}
    known = {f.name: device_values.get(f.name, _DEVICE_DEFAULTS[f.name])
             for f in dataclasses.fields(TrainingSettings)}
    for g, (sid, members) in enumerate(zip(station_ids, groups, strict=True)):
        stations.append({"fleet": fleet, "station_id": sid, "seed": seeds[-1 - g],
                         "devices": tuple(device_id(k) for k in members), **known,
                         **strategy.station})
        for k in members:
            devices.append({"device_id": device_id(k), "station": sid, "lr": spec.lr,
                            "seed": seeds[3 * k], **strategy.device, "fleet": fleet,
                            "_k": int(k), "_backend": spec.backends[k % len(spec.backends)],
                            **({"_profile": profiles[k]} if profiles else {})})
            replay[k] = seeds[3 * k + 1]
    sizes = np.array([len(p) for p in spec.partitions], dtype=np.float64)
    rates = spec.arrivals_per_step * sizes * n_dev / sizes.sum()
    return FleetPlan(fleet, cloud, stations, devices, replay, [float(r) for r in rates])
