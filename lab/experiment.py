"""``safl experiment``: strategies side by side on one fleet, with results and a report.

Every strategy gets the same partitions, initial weights and seeds (one :class:`FleetSpec`)
and runs on the in-process bus through the real roles.  Outputs: ``results.csv`` (one row
per strategy), ``metrics.csv`` (per round), ``accuracy.png`` (accuracy vs round),
``accuracy_vs_bytes.png`` and ``results.md`` with the paper claims checked.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aggregator.central_dp import MECHANISMS, CentralPrivacy, tree_sensitivity
from aggregator.selection import blas_threads
from aggregator.server_optimizers import SERVER_OPTIMIZERS
from edge_client.body import body_tail, load_body_manifest
from edge_client.config import ModelConfig, TrainingSettings, check_range, load_config
from edge_client.errors import ConfigError
from edge_client.head_stats import HeadSpec, head_spec
from edge_client.privacy import noise_for_epsilon
from edge_client.trainers import BodyTail

from .attacks import ATTACKS
from .datasets import (
    Dataset,
    as_camera,
    assign_groups,
    body_folder,
    dirichlet_label_skew,
    load_dataset,
    safl_split,
    through_body,
)
from .engine import SimulationConfig
from .report import Progress, format_table, plot_accuracy, write_csv, write_metrics
from .run_report import write_run_report
from .simulation import FleetSpec, RunResult, Strategy, run_federation
from .strategies import RECIPES, RecipeSettings, build_strategy
from .summary import merge_seeds, result_rows

__all__ = ["ExperimentConfig", "RunTask", "run_task", "run_tasks", "run_experiment",
           "load_experiment", "load_simulation",
           "FULL_SCALE"]

log = logging.getLogger(__name__)

# SPEC §5, the FedGS reference settings (FEMNIST-style CNN on Fashion-MNIST here).
FULL_SCALE = {"factories": 10, "devices_per_factory": 36, "super_node": 10,
              "rand_per_group": 2, "sync_period": 50, "rounds": 500, "lr": 0.01,
              "batch_size": 32, "model": "femnist_cnn", "backend": "torch"}


# The robustness recipes are for attack studies; a plain experiment runs the papers' set.
# The robust-fusion recipes belong to the attack experiments, and issue 35's (longer local
# work, buffered stations) to time-to-accuracy ones, which name them.
DEFAULT_STRATEGIES = tuple(r for r in RECIPES if r not in (
    "median", "trimmed_mean", "krum", "multi_krum", "fedavg_unguarded", "fedgs_long",
    "fedgs_buffered", "safl_fedgs_buffered"))


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig(RecipeSettings):
    """The ``[experiment]`` table of an experiment file: the fleet, the data, the run's
    length, and (from :class:`RecipeSettings`) the knobs every recipe shares."""

    name: str
    dataset: str = "fashion-mnist"
    partition: str = "dirichlet"  # or "safl" (several classes vs one class per device)
    alpha: float = 0.5
    multi_fraction: float = 0.5
    classes_per_multi: int = 5
    devices_per_factory: int = 10
    rounds: int = 30
    # Samples to train in all: when given, every run stops after the round in which its
    # devices have trained this many, so runs are compared at the same data processed.
    # ``rounds`` becomes the nominal count (full batches every step), which SAFL's
    # temperature fraction refers to; a run may take more rounds, up to twice that.
    samples: int = 0
    eval_every: int = 1  # rounds between evaluations (the last round is always evaluated)
    lr: float = TrainingSettings.lr
    batch_size: int = TrainingSettings.batch_size
    update_stages: tuple[str, ...] = TrainingSettings.update_stages  # what an update becomes
    # Differential privacy (docs/privacy.md): each device's budget for its local DP (with a
    # noise stage in update_stages), and central DP at every station.  0: off.
    privacy_budget: float = 0.0
    central_dp_clip: float = 0.0
    central_dp_noise: float = 0.0
    # Or a budget for the run: each recipe's stations get the noise multiplier at which a
    # device in every one of their releases spends at most this epsilon at delta 1e-5
    # (a hierarchy releases once per iteration, a flat fleet once per round).
    central_dp_epsilon: float = 0.0
    # The stations' mechanism ("independent" or "tree") and participation cap (0: none),
    # both counted by central_dp_epsilon's planning (docs/privacy.md).
    central_dp_mechanism: str = "independent"
    max_participations: int = 0
    cloud_dp_clip: float = 0.0  # central DP across stations, at the cloud
    cloud_dp_noise: float = 0.0
    cloud_dp_epsilon: float = 0.0  # or its budget: a station's data is in every round
    # Local DP by budget: every device clips its step to local_dp_clip and noises it with
    # the multiplier at which an upload at every one of its chances spends at most
    # local_dp_epsilon, which is also its privacy_budget.
    local_dp_epsilon: float = 0.0
    local_dp_clip: float = 0.0
    model: str = "mlp"
    backend: str = "numpy"
    arrivals_per_step: int = 48
    initial_samples: int = 64
    buffer_capacity: int = 1024
    holdout_capacity: int = 256  # held-out slice per device: the gate's and local accuracy's
    eval_samples: int = 2000
    target_accuracy: float = 0.7
    # Under a clock: the report's accuracy at this many virtual seconds (0: no column).
    at_virtual_s: float = 0.0
    # The report's accuracy when the fleet had trained each of these many samples
    # (interpolated between evaluations; () : no columns).
    at_samples: tuple[int, ...] = ()
    # SAFL's temperature as a fraction of the run's rounds (replaces temperature_rounds when
    # > 0), so that a setting chosen on a short run means the same on a long one.
    temperature_fraction: float = 0.25  # chosen by experiments/sweep_safl.toml
    # The devices' lr decay as a fraction of the run's rounds (sets lr_decay_rounds; 0: off).
    lr_decay_fraction: float = 0.0
    seed: int = 0
    seeds: int = 1  # runs per strategy, seeds seed, seed+1, ...: tables give mean and sd
    # What the compromised devices send (lab.attacks): one report section per attack.
    attacks: tuple[str, ...] = ("none",)
    attackers: int = 1  # how many devices are compromised under an attack
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    # Prequential accuracy beside the held-out figure: every device predicts one arriving
    # sample in this many before training (0: off).  A forward pass per prediction: at 10 the
    # reference runs take longer (docs/algorithms.md has the measured cost).
    prequential_every: int = 0
    # The dataset as a camera delivers it (C, H, W): grey images resized and replicated to
    # every channel (lab.datasets.camera_frames); () keeps the images as they are.
    camera_shape: tuple[int, ...] = ()
    # A frozen pretrained body before the model (docs/bodies.md), which is then the head: the
    # dataset's camera frames are embedded once and cached, and the clock prices the body's
    # forward per arriving frame.  body_dir: its export (default: the cache, which `safl
    # experiment` fills).
    body: str = "none"
    body_dir: str = ""
    hidden: int = 128  # the mlp's hidden units (an mlp head's, with a body)
    # The body's last blocks that train with the head (torch; the data are then the
    # activations before them, cached as the embeddings are).
    train_body_blocks: int = 0
    # The head solved in closed form from the devices' statistics ([model] head_init and
    # head_resolve, [device] head_stats_every; docs/bodies.md).  The lab's default is
    # "random", as every run before heads were solved: name "ridge" or "ncm" to solve it.
    head_init: str = "random"
    head_resolve: str = "auto"
    head_stats_every: int = 10
    # Device-local accuracy of personal heads ([inference] personal) beside the global head's,
    # on each device's held-out slice at the end (head_init = "ridge").
    personal_heads: bool = False

    def __post_init__(self) -> None:
        if self.partition not in ("dirichlet", "safl"):
            raise ConfigError("partition", "must be 'dirichlet' or 'safl'")
        if self.body != "none" and not self.camera_shape:
            object.__setattr__(self, "camera_shape", (3, 64, 64))
        if self.camera_shape and (len(self.camera_shape) != 3 or min(self.camera_shape) < 1):
            raise ConfigError("camera_shape", f"must be (C, H, W), got {self.camera_shape}")
        check_range("train_body_blocks", self.train_body_blocks, 0)
        if self.train_body_blocks and (self.body == "none" or self.backend != "torch"):
            raise ConfigError("train_body_blocks", "training a body's blocks needs a body and "
                              "backend = 'torch'")
        for key in ("factories", "devices_per_factory", "super_node", "sync_period", "rounds",
                    "batch_size", "arrivals_per_step", "eval_samples", "eval_every"):
            check_range(key, getattr(self, key), 1)
        check_range("super_node", self.super_node, 1, self.devices_per_factory)
        check_range("rand_per_group", self.rand_per_group, 0, self.super_node)
        check_range("target_accuracy", self.target_accuracy, 0, 1)
        check_range("at_virtual_s", self.at_virtual_s, 0)
        if not self.attacks or any(a not in ATTACKS for a in self.attacks):
            raise ConfigError("attacks", f"must list some of {ATTACKS}")
        check_range("seeds", self.seeds, 1)
        check_range("samples", self.samples, 0)
        if self.cloud_optimizer not in SERVER_OPTIMIZERS:
            raise ConfigError("cloud_optimizer", f"must be one of {tuple(SERVER_OPTIMIZERS)}")
        if self.samples:
            object.__setattr__(self, "rounds", -(-self.samples // self.samples_per_round))
        check_range("temperature_fraction", self.temperature_fraction, 0)
        if self.temperature_fraction:
            object.__setattr__(self, "temperature_rounds", self.temperature_fraction * self.rounds)
        check_range("lr_decay_fraction", self.lr_decay_fraction, 0, 1)
        if self.lr_decay_fraction:
            object.__setattr__(self, "lr_decay_rounds", self.lr_decay_fraction * self.rounds)
        check_range("attackers", self.attackers, 0, self.factories * self.devices_per_factory)
        check_range("prequential_every", self.prequential_every, 0)
        for budget, clip, noise in (("central_dp_epsilon", "central_dp_clip", "central_dp_noise"),
                                    ("cloud_dp_epsilon", "cloud_dp_clip", "cloud_dp_noise"),
                                    ("local_dp_epsilon", "local_dp_clip", "privacy_budget")):
            check_range(budget, getattr(self, budget), 0)
            if getattr(self, budget) and (getattr(self, noise) or not getattr(self, clip)):
                raise ConfigError(budget, f"sets the noise from the budget: give {clip} and "
                                  f"leave {noise} unset")
        if self.central_dp_mechanism not in MECHANISMS:
            raise ConfigError("central_dp_mechanism", f"must be one of {MECHANISMS}")
        check_range("max_participations", self.max_participations, 0)
        unknown = [s for s in self.strategies if s not in RECIPES]
        if unknown or not self.strategies:
            raise ConfigError("strategies", f"unknown {unknown}; known: {sorted(RECIPES)}")

    @property
    def samples_per_round(self) -> int:
        """Samples every recipe trains on per round (``L x M x T`` one-step batches)."""
        return self.factories * self.super_node * self.sync_period * self.batch_size

    @property
    def settings(self) -> RecipeSettings:
        return self.recipe_settings


def _fleet(cfg: ExperimentConfig, data: Dataset, seed: int, attack: str) -> FleetSpec:
    rng = np.random.default_rng(seed)
    n = cfg.factories * cfg.devices_per_factory
    if cfg.partition == "dirichlet":
        parts = dirichlet_label_skew(data.y_train, n, cfg.alpha, rng, min_size=cfg.batch_size)
    else:
        parts = safl_split(data.y_train, n, rng, multi_fraction=cfg.multi_fraction,
                           classes_per_multi=cfg.classes_per_multi)
    return FleetSpec(partitions=tuple(parts), groups=tuple(assign_groups(n, cfg.factories, rng)),
                     rounds=2 * cfg.rounds if cfg.samples else cfg.rounds,
                     samples=cfg.samples, model=cfg.model, backends=(cfg.backend,), lr=cfg.lr,
                     seed=seed, arrivals_per_step=cfg.arrivals_per_step,
                     initial_samples=cfg.initial_samples, eval_samples=cfg.eval_samples,
                     eval_every=cfg.eval_every,
                     share_trainers=True, attack=attack,
                     attackers=tuple(range(cfg.attackers)) if attack != "none" else (),
                     prequential_every=cfg.prequential_every, body=cfg.body,
                     hidden=cfg.hidden, tail=_tail(cfg), head=_head(cfg, data.num_classes),
                     head_stats_every=cfg.head_stats_every, personal_heads=cfg.personal_heads)


# Privacy and update stages, per role, passed on only where set: a plain run keeps the cache
# key it had (central_dp_epsilon becomes the stations' central_dp_noise; the cloud's keys
# lose their "cloud_" for "central_", as CloudConfig names them).
_DEVICE_KEYS = ("update_stages", "privacy_budget")
_STATION_KEYS = ("central_dp_clip", "central_dp_noise")
_CLOUD_KEYS = ("cloud_dp_clip", "cloud_dp_noise")


def _strategy(cfg: ExperimentConfig, name: str):
    s = build_strategy(name, cfg.settings)
    device = {"batch_size": cfg.batch_size, "buffer_capacity": cfg.buffer_capacity,
              "holdout_capacity": cfg.holdout_capacity, **_set(cfg, *_DEVICE_KEYS), **s.device}
    station = {**s.station, **_set(cfg, *_STATION_KEYS)}
    if cfg.central_dp_epsilon:
        station["central_dp_noise"] = noise_for_epsilon(
            cfg.central_dp_epsilon, _releases(cfg, s), CentralPrivacy.privacy_delta)
    if "central_dp_noise" in station:  # the mechanism and the cap shape central DP only
        station.update(_set(cfg, "max_participations"))
        if cfg.central_dp_mechanism != CentralPrivacy.central_dp_mechanism:
            station["central_dp_mechanism"] = cfg.central_dp_mechanism
    if cfg.local_dp_epsilon:
        z = noise_for_epsilon(cfg.local_dp_epsilon, _releases(cfg, s, local=True),
                              CentralPrivacy.privacy_delta)
        device["update_stages"] = (*cfg.update_stages, f"clip:{cfg.local_dp_clip}",
                                   f"noise:{z:.6g}")
        device["privacy_budget"] = cfg.local_dp_epsilon
    cloud = {**s.cloud, **{k.replace("cloud_", "central_"): v
                           for k, v in _set(cfg, *_CLOUD_KEYS).items()}}
    if cfg.cloud_dp_epsilon:  # each station's data is in every round's release
        rounds = 2 * cfg.rounds if cfg.samples else cfg.rounds
        cloud["central_dp_noise"] = noise_for_epsilon(cfg.cloud_dp_epsilon, rounds,
                                                      CentralPrivacy.privacy_delta)
    return dataclasses.replace(s, device=device, station=station, cloud=cloud)


def _releases(cfg: ExperimentConfig, s: Strategy, local: bool = False) -> int:
    """The most releases one device's data can cost in a run of ``s``, in unit releases:
    every internal synchronisation of a hierarchy, every round of a flat fleet (a run
    trained to ``samples`` may take up to twice its nominal rounds, as :func:`_fleet`
    allows); at the stations at most ``max_participations`` of a round's, and with the tree
    mechanism its worst seating's charges (``local``: its own noised uploads)."""
    rounds = 2 * cfg.rounds if cfg.samples else cfg.rounds
    syncs = 1 if s.flat else cfg.sync_period
    if local:
        return rounds * syncs
    seats = min(cfg.max_participations or syncs, syncs)
    if cfg.central_dp_mechanism == "tree":
        return rounds * tree_sensitivity(syncs, seats)
    return rounds * seats


def _set(cfg: ExperimentConfig, *keys: str) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in keys if getattr(cfg, k)}


@functools.lru_cache(maxsize=2)
def _dataset(name: str, camera_shape: tuple[int, ...] = (), body: str = "none",
             body_dir: str = "", blocks: int = 0) -> Dataset:
    """The run's data, once per process, not once per strategy: the images, or a camera's
    frames of them, or a body's embeddings of those (cached on disk)."""
    data = load_dataset(name)
    if body == "none":
        return as_camera(data, camera_shape) if camera_shape else data
    return through_body(data, camera_shape, body, body_dir, blocks)


def experiment_data(cfg: ExperimentConfig) -> Dataset:
    return _dataset(cfg.dataset, tuple(cfg.camera_shape), cfg.body, cfg.body_dir,
                    cfg.train_body_blocks)


def _tail(cfg: ExperimentConfig) -> BodyTail | None:
    """The body's blocks that train, as a field device's [model] makes them (its head fixed
    where a solve starts it: ``edge_client.body.body_tail``)."""
    if not cfg.train_body_blocks:
        return None
    classes = 10  # a [model] table needs some; where the body is cut does not depend on them
    return body_tail(_field_model(cfg.model, cfg.body, tuple(cfg.camera_shape), cfg.body_dir,
                                  classes, cfg.head_init, cfg.head_resolve, cfg.train_body_blocks))


def _head(cfg: ExperimentConfig, classes: int) -> HeadSpec | None:
    return closed_form_head(cfg.model, cfg.body, tuple(cfg.camera_shape), cfg.body_dir, classes,
                            cfg.head_init, cfg.head_resolve, cfg.train_body_blocks)


def closed_form_head(model: str, body: str, shape: tuple[int, ...], body_dir: str,
                     classes: int, head_init: str = "auto", head_resolve: str = "auto",
                     train_body_blocks: int = 0) -> HeadSpec | None:
    """The closed-form head ``head_init`` asks for on ``body``, as a field fleet's [model]
    would (None: the head starts random)."""
    if head_init == "random" or body == "none":
        return None
    return head_spec(_field_model(model, body, shape, body_dir, classes, head_init,
                                  head_resolve, train_body_blocks))


def _field_model(model: str, body: str, shape: tuple[int, ...], body_dir: str, classes: int,
                 head_init: str, head_resolve: str, train_body_blocks: int) -> ModelConfig:
    """The [model] table of a field fleet with the body the lab exported (its cache)."""
    return ModelConfig(name=model, body=body, body_dir=str(body_folder(body, shape, body_dir)),
                       input_shape=shape, num_classes=classes, head_init=head_init,
                       head_resolve=head_resolve, train_body_blocks=train_body_blocks,
                       backend="torch" if train_body_blocks else "numpy")


@dataclass(frozen=True)
class RunTask:
    """One run of an experiment: a strategy of ``cfg`` on one seed under one attack, with
    the cores it may use (``threads``) and whether it draws a progress bar."""

    cfg: ExperimentConfig
    strategy: str
    seed: int
    attack: str = "none"
    threads: int = 1
    show_progress: bool = False
    engine: SimulationConfig = SimulationConfig()  # where its federation runs

    @property
    def key(self) -> tuple[str, int]:
        return self.strategy, self.seed


def run_task(task: RunTask) -> RunResult:
    """Train ``task`` (in a worker process, or here)."""
    cfg = task.cfg
    if cfg.backend == "torch":
        import torch  # the lab may load torch; the device package never must
        torch.set_num_threads(task.threads)  # parallel jobs each get their share of the cores
    data = experiment_data(cfg)
    # A torch run keeps numpy's BLAS on one thread: its BLAS work is the stations' small
    # selection problems, and OpenBLAS threads spinning beside torch's took FedGS from 0.28
    # to 0.45 s per 1,000 samples (bench/simulator.py).  A numpy run trains through BLAS.
    with blas_threads(1 if cfg.backend == "torch" else task.threads):
        progress = Progress(f"{task.strategy}/{task.seed}", cfg.rounds) \
            if task.show_progress else None
        spec = dataclasses.replace(_fleet(cfg, data, task.seed, task.attack),
                                   torch_device=task.engine.torch_device,
                                   batched_steps=task.engine.batched_steps,
                                   clock=task.engine.clock(task.seed))
        return run_federation(data, _strategy(cfg, task.strategy), spec, progress,
                              engine=task.engine)


def run_tasks(tasks: list[RunTask], jobs: int, ray: str | None,
              finished: Callable[[RunTask, RunResult], None]) -> None:
    """Run ``tasks`` here one after another, in ``jobs`` processes, or as Ray tasks on the
    cluster at ``ray`` (each declaring its engine's ``cpus_per_run`` and ``gpus_per_run``),
    calling ``finished`` as each ends (so its result is cached at once)."""
    if ray:  # the tasks' engine has the cluster's address (load_simulation)
        if tasks:
            from .ray_engine import run_tasks as on_ray
            on_ray(tasks, run_task, tasks[0].engine, finished)
        return
    if jobs == 1:
        for t in tasks:
            finished(t, run_task(t))
        return
    if tasks and tasks[0].engine.engine == "ray" and tasks[0].engine.address == "local":
        raise ConfigError("address", "each of --jobs processes would start a Ray instance of "
                          "its own: start one (`ray start --head`) and give address 'auto'")
    # Workers are never forked from this process: a fork copies its threads' locks as they
    # are (Ray's, torch's), and forked workers hung so in CI beside a Ray instance.
    with ProcessPoolExecutor(max_workers=jobs,
                             mp_context=multiprocessing.get_context("forkserver")) as pool:
        futures = {pool.submit(run_task, t): t for t in tasks}
        for future in as_completed(futures):  # cached as each finishes
            finished(futures[future], future.result())


# Settings that shape no single run: the list of runs, the report, and the recipe knobs
# (a run's recipe enters its cache key whole, as the Strategy it built).
_NOT_RUN_KEYS = frozenset({"name", "strategies", "seeds", "seed", "attacks", "target_accuracy",
                           "at_virtual_s", "at_samples",
                           "temperature_rounds", "temperature_fraction", "mix", "nu",
                           "merge_max_age", "prox_mu", "server_lr", "momentum",
                           "cloud_optimizer", "lr_decay_fraction", "lr_decay_rounds",
                           "lr_decay", "prequential_every", "buffer_size", "max_staleness",
                           "long_local_steps"})


# Keys that a run without them never had: left out of the cache key at their default.
_OFF_UNLESS_SET = frozenset({*_DEVICE_KEYS, *_STATION_KEYS, *_CLOUD_KEYS, "central_dp_epsilon",
                             "central_dp_mechanism", "max_participations", "cloud_dp_epsilon",
                             "local_dp_epsilon", "local_dp_clip", "camera_shape", "body",
                             "body_dir", "hidden", "train_body_blocks", "head_init",
                             "head_resolve", "head_stats_every", "personal_heads"})
_DEFAULT = {f.name: f.default for f in dataclasses.fields(ExperimentConfig)}


class _RunCache:
    """Finished runs of an experiment as JSON beside its outputs, so an interrupted
    experiment resumes, a strategy added later runs alone, and a report can be rebuilt
    without retraining.  A run is reused only when its fleet settings, its recipe as built
    (every role's config values), its seed and attack are the same; after changing the
    code, pass ``fresh`` (``--fresh``) or delete the folder."""

    def __init__(self, folder: Path, cfg: ExperimentConfig, fresh: bool,
                 engine: SimulationConfig | None = None) -> None:
        self.folder = folder / "runs"
        self.cfg = cfg
        self.tag = engine.cache_tag if engine else ""
        self.fleet = repr({k: v for k, v in sorted(vars(cfg).items())
                           if k not in _NOT_RUN_KEYS
                           and (k not in _OFF_UNLESS_SET or v != _DEFAULT[k])})
        if cfg.body != "none":  # a body exported again into the same folder is another body
            folder = body_folder(cfg.body, tuple(cfg.camera_shape), cfg.body_dir)
            self.fleet += f"|body-{load_body_manifest(folder).hash}"
        self.fresh = fresh

    def _key(self, name: str, seed: int, attack: str) -> str:
        # ``samples`` once counted batches scheduled; runs cached then are not reused.
        budget = "|samples-trained" if self.cfg.samples else ""
        # Prequential scoring changes no training, but its runs carry more columns: they are
        # keyed apart, and a run without it keeps the key it always had.
        every = self.cfg.prequential_every
        budget += f"|prequential-{every}" if every else ""
        text = f"{self.fleet}{budget}{self.tag}|{_strategy(self.cfg, name)!r}|{seed}|{attack}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _path(self, name: str, seed: int, attack: str) -> Path:
        return self.folder / f"{name}-seed{seed}-{attack}.json"

    def get(self, name: str, seed: int, attack: str) -> RunResult | None:
        path = self._path(name, seed, attack)
        if self.fresh or not path.exists():
            return None
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if doc.get("key") != self._key(name, seed, attack):
            return None
        return RunResult(doc["strategy"], doc["rows"], doc["counters"], doc["wall_s"],
                         p_real=doc.get("p_real", []), devices=doc.get("devices", []))

    def put(self, result: RunResult, seed: int, attack: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        doc = {"key": self._key(result.strategy, seed, attack), "seed": seed,
               "attack": attack, **dataclasses.asdict(result)}
        path = self._path(result.strategy, seed, attack)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)


def _plot_against(results: list[RunResult], path: Path, title: str,
                  x: Callable[[dict[str, Any]], float], xlabel: str) -> None:
    """Test accuracy against ``x`` of each row (bytes uploaded, virtual seconds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        ax.plot([x(row) for row in r.rows], [row["accuracy"] for row in r.rows],
                label=r.strategy)
    ax.set_xscale("symlog")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mb_up(row: dict[str, Any]) -> float:
    return (row["bytes_device_up"] + row["bytes_station_up"]) / 1e6


def _virtual_s(row: dict[str, Any]) -> float:
    return row.get("virtual_s", 0.0)  # runs cached before the clock have none


def load_experiment(path: str | Path, full: bool = False) -> ExperimentConfig:
    """The ``[experiment]`` table of ``path`` (with the papers' unscaled values if ``full``)."""
    return load_config(ExperimentConfig, "experiment", path, dict(FULL_SCALE) if full else {})


def load_simulation(path: str | Path, ray: str | None = None) -> SimulationConfig:
    """The ``[simulation]`` table of ``path`` (where each run's federation runs), with the
    ``--ray`` cluster's address, if given, as its Ray address."""
    return load_config(SimulationConfig, "simulation", path, {"address": ray})


def run_experiment(path: str | Path, *, out: Path | None = None, jobs: int = 1,
                   full: bool = False, attack: str | None = None, fresh: bool = False,
                   finished_only: bool = False, ray: str | None = None,
                   ) -> tuple[ExperimentConfig, list[RunResult], Path]:
    """Run every strategy of an experiment file (over its seeds, under one ``attack``, by
    default its first) here, or as Ray tasks on the cluster at ``ray``; returns the config,
    every run (per strategy and seed), the folder."""
    cfg = load_experiment(path, full)
    attack = attack or cfg.attacks[0]
    label = cfg.name + ("" if attack == "none" else f" under attack '{attack}'")
    out = Path(out or Path("runs") / f"{cfg.name}{'-full' if full else ''}")
    out.mkdir(parents=True, exist_ok=True)
    length = f"{cfg.samples:,} samples trained each" if cfg.samples else f"{cfg.rounds} rounds"
    print(f"experiment {label}: {len(cfg.strategies)} strategies x {cfg.seeds} seed(s), "
          f"{cfg.factories} factories x {cfg.devices_per_factory} devices, {length}, "
          f"{cfg.model} on {cfg.dataset}, "
          + (f"as Ray tasks on {ray}" if ray else f"{jobs} job(s)"), file=sys.stderr)
    engine = load_simulation(path, ray)
    cache = _RunCache(out, cfg, fresh, engine)
    threads = int(engine.cpus_per_run) if ray else max(1, (os.cpu_count() or 1) // jobs)
    tasks = [RunTask(cfg, name, cfg.seed + k, attack, max(1, threads),
                     show_progress=jobs == 1 and not ray, engine=engine)
             for name in cfg.strategies for k in range(cfg.seeds)]
    done = {t.key: cache.get(t.strategy, t.seed, attack) for t in tasks}
    todo = [t for t in tasks if done[t.key] is None]
    if len(todo) < len(tasks):
        print(f"reusing {len(tasks) - len(todo)} finished run(s) from {cache.folder}",
              file=sys.stderr)
    if finished_only:  # a report of what is done; the tables give each strategy's seeds
        if todo:
            print("not run yet (left out): " + ", ".join(f"{t.strategy} seed {t.seed}"
                                                         for t in todo), file=sys.stderr)
        todo, tasks = [], [t for t in tasks if done[t.key] is not None]
        if not tasks:
            raise ConfigError("strategies", f"no finished runs in {cache.folder}")

    def finished(task: RunTask, r: RunResult) -> None:
        cache.put(r, task.seed, attack)
        done[task.key] = r
        print(f"{r.strategy:<14} seed {task.seed} final {r.final_accuracy:.4f} "
              f"({r.wall_s:.0f} s)", file=sys.stderr)

    run_tasks(todo, jobs, ray, finished)
    per_seed = [r for r in (done[t.key] for t in tasks) if r is not None]  # all done by now
    results = merge_seeds(per_seed)
    rows = result_rows(per_seed, cfg.target_accuracy, cfg.at_virtual_s, cfg.at_samples)
    write_csv(out / "results.csv", rows)
    write_metrics(results, out)
    title = f"{label}: {cfg.dataset}, {cfg.partition}"
    plot_accuracy(results, out / "accuracy.png", title)
    _plot_against(results, out / "accuracy_vs_bytes.png", title, _mb_up,
                  "MB uploaded (devices to stations, and stations to cloud)")
    if all(_virtual_s(r.rows[-1]) for r in results):
        _plot_against(results, out / "accuracy_vs_time.png", title, _virtual_s,
                      "virtual seconds (lab/clock.py: the boards' compute and the links)")
    (out / "config.toml").write_text(Path(path).read_text())
    write_run_report(out)
    print(format_table(rows))
    return cfg, per_seed, out

