"""Named federation recipes for experiments, each built from the existing roles.

Every recipe is a :class:`Strategy`: overrides of the device, station and cloud configs, and
whether the fleet is flat (one station, the SAFL paper's setting) or hierarchical (one
station per factory, FedGS's).  Compute per round is equal across recipes: a hierarchical
round is ``T`` one-step iterations on super nodes of ``L`` devices per factory; a flat round
is one iteration in which ``L x M`` random devices take ``T`` local steps each.

Papers: FedAvg (McMahan et al., 2017); FedProx (Li et al., 2020); FedAvgM (Hsu et al.,
2019); FedAdagrad, FedAdam, FedYogi (Reddi et al., 2021); IDA (Yeganeh et al., 2020);
SAFL (Gradual FL with Simulated Annealing); FedGS (Li et al., 2022); coordinate-wise median
and trimmed mean (Yin et al., 2018); Krum and Multi-Krum (Blanchard et al., 2017).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from edge_client.errors import ConfigError

from .simulation import Strategy

__all__ = ["RecipeSettings", "RECIPES", "build_strategy"]


@dataclass(frozen=True, kw_only=True)
class RecipeSettings:
    """The knobs recipes share (one experiment fixes them for every strategy; an
    experiment's config extends this class, so each knob is declared here only)."""

    factories: int = 4
    super_node: int = 5  # L per factory
    rand_per_group: int = 1
    sync_period: int = 10  # T
    temperature_rounds: float = 10.0  # SAFL's L, in rounds
    mix: float = 0.8  # SAFL's eps
    nu: float = 0.5  # upload gate (the gated recipes: safl_gated, safl_fedgs_gated)
    merge_max_age: int = 20  # iterations a local model stays fresh enough to merge
    prox_mu: float = 0.01
    server_lr: float = 0.03  # adaptive server optimisers
    momentum: float = 0.9  # FedAvgM
    # Every recipe's devices train at lr * lr_decay from this round on (0: a constant lr).
    lr_decay_rounds: float = 0.0
    lr_decay: float = 0.1
    # Server optimiser of the hierarchical recipes at the cloud (FedGS, SAFL+FedGS), any of
    # aggregator.server_optimizers: "fedavgm" applies the momentum above to the external
    # synchronisation, the adaptive ones step at server_lr.
    cloud_optimizer: str = "fedavgm"
    # The buffered recipes' station (FedBuff: aggregator/fedbuff.py; 0: half the super
    # node) and FedGS with longer local work (local steps per internal sync: fewer round
    # trips for the same samples, more drift).
    buffer_size: int = 0
    max_staleness: int = 4
    long_local_steps: int = 5

    @property
    def recipe_settings(self) -> RecipeSettings:
        """Just these knobs (of an experiment config, say)."""
        return RecipeSettings(**{f.name: getattr(self, f.name)
                                 for f in dataclasses.fields(RecipeSettings)})


def _cloud(s: RecipeSettings) -> dict:
    """The hierarchical recipes' server optimiser: by default FedAvgM, momentum over the
    external synchronisations (docs/algorithms.md gives the measurement that made it the
    default); any registered one (``aggregator.server_optimizers``) may be chosen."""
    return _server(s, s.cloud_optimizer)


def _server(s: RecipeSettings, kind: str) -> dict:
    """The cloud's settings for server optimiser ``kind`` (FedAvgM: a unit step with the
    momentum above; the adaptive ones: ``server_lr``)."""
    if kind == "none":
        return {}
    if kind == "fedavgm":
        return {"server_optimizer": "fedavgm", "server_lr": 1.0, "beta1": s.momentum}
    return {"server_optimizer": kind, "server_lr": s.server_lr}


def _schedule(s: RecipeSettings, per_round: float) -> dict:
    """The device lr decay in iterations (``T`` per round in a hierarchy, one when flat);
    nothing when off, so a recipe without it is the recipe it always was."""
    if not s.lr_decay_rounds:
        return {}
    # A decay within the first iteration starts at iteration 1; a negative one is left for
    # DeviceConfig to refuse by name, not hidden.
    at = round(s.lr_decay_rounds * per_round)
    return {"lr_decay_at": at if at else 1, "lr_decay": s.lr_decay}


def _hier(s: RecipeSettings, selector: str, **device) -> Strategy:
    return Strategy(selector, device={"mix": 1.0, "nu": 0.0, **_schedule(s, s.sync_period),
                                      **device},
                    station={"super_node_size": s.super_node, "rand_per_group": s.rand_per_group,
                             "selector": selector, "sync_period": s.sync_period},
                    cloud=_cloud(s))


def _buffered(built: Strategy, s: RecipeSettings) -> Strategy:
    """A hierarchical recipe with its stations in buffered mode (FedBuff)."""
    return dataclasses.replace(built, station={**built.station, "mode": "buffered",
                                               "buffer_size": s.buffer_size,
                                               "max_staleness": s.max_staleness})


def _flat(s: RecipeSettings, *, device=None, station=None, cloud=None) -> Strategy:
    return Strategy("flat", flat=True,
                    device={"mix": 1.0, "nu": 0.0, "local_steps": s.sync_period,
                            **_schedule(s, 1), **(device or {})},
                    station={"super_node_size": s.super_node * s.factories, "rand_per_group": 0,
                             "selector": "random", "sync_period": 1, **(station or {})},
                    cloud=cloud or {})


def _safl(s: RecipeSettings, hierarchical: bool, gated: bool) -> dict:
    # t counts iterations: T per round in a hierarchy, one per round when flat.
    per_round = s.sync_period if hierarchical else 1
    return {"mix": s.mix, "temperature": s.temperature_rounds * per_round,
            "nu": s.nu if gated else 0.0, "merge_max_age": s.merge_max_age}


def _server_recipe(kind: str) -> Callable[[RecipeSettings], Strategy]:
    return lambda s: _flat(s, cloud=_server(s, kind))


RECIPES: dict[str, Callable[[RecipeSettings], Strategy]] = {
    "fedgs": lambda s: _hier(s, "gbp_cs"),
    "fedgs_random": lambda s: _hier(s, "random"),
    "fedavg": lambda s: _flat(s),
    "fedprox": lambda s: _flat(s, device={"prox_mu": s.prox_mu}),
    "fedavgm": _server_recipe("fedavgm"),  # FedAvg with server momentum
    "fedadagrad": _server_recipe("fedadagrad"),
    "fedadam": _server_recipe("fedadam"),
    "fedyogi": _server_recipe("fedyogi"),
    "ida": lambda s: _flat(s, station={"fusion": "ida"}),
    # Byzantine-robust fusion at the station (aggregator/fusion.py cites each paper), and
    # FedAvg with the update-distance guard off, to show what the guard prevents.
    "median": lambda s: _flat(s, station={"fusion": "median"}),
    "trimmed_mean": lambda s: _flat(s, station={"fusion": "trimmed_mean"}),
    "krum": lambda s: _flat(s, station={"fusion": "krum"}),
    "multi_krum": lambda s: _flat(s, station={"fusion": "multi_krum"}),
    "fedavg_unguarded": lambda s: _flat(s, station={"update_norm_factor": 0.0}),
    "safl": lambda s: _flat(s, device=_safl(s, False, False)),
    "safl_gated": lambda s: _flat(s, device=_safl(s, False, True)),
    # The upload gate is off in SAFL+FedGS by default: it discards device steps already paid
    # for and bought no accuracy in the sweep (docs/algorithms.md); the gated variant keeps it.
    "safl_fedgs": lambda s: _hier(s, "gbp_cs", **_safl(s, True, False)),
    "safl_fedgs_gated": lambda s: _hier(s, "gbp_cs", **_safl(s, True, True)),
    # Issue 35: FedGS's round trips traded for local work, and its stations buffered.
    # (its lr decay, in iterations, comes as many times sooner as each trains more)
    "fedgs_long": lambda s: _hier(s, "gbp_cs", local_steps=s.long_local_steps,
                                  **_schedule(s, s.sync_period / s.long_local_steps)),
    "fedgs_buffered": lambda s: _buffered(_hier(s, "gbp_cs"), s),
    "safl_fedgs_buffered": lambda s: _buffered(_hier(s, "gbp_cs", **_safl(s, True, False)), s),
}


def build_strategy(name: str, settings: RecipeSettings) -> Strategy:
    """The recipe ``name`` with this experiment's settings, named ``name``."""
    if name not in RECIPES:
        raise ConfigError("strategies", f"unknown strategy {name!r}; known: {sorted(RECIPES)}")
    built = RECIPES[name](settings)
    return Strategy(name, device=built.device, station=built.station, cloud=built.cloud,
                    flat=built.flat)
