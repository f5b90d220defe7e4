"""``DeviceConfig``: the ``[device]`` table (SPEC §2-3: buffer, SAFL, upload gate)."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from ..pipeline import UpdatePipeline
from .loading import check_id, check_range

__all__ = ["DeviceConfig", "TrainingSettings"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """How a device trains: ``local_steps`` SGD steps at ``lr`` on one-shot batches of
    ``batch_size``, and how its update travels (``update_stages``).  Declared once: the
    device trains by them, the station bounds its devices' claims and decodes their updates
    by them (``StationConfig`` extends this too), the lab's fleets start from them."""

    batch_size: int = 32  # samples in one local step's one-shot batch
    local_steps: int = 1  # SGD steps a device takes each time it is selected
    lr: float = 0.05  # the devices' SGD step size
    # What an update passes through before it leaves the device (edge_client/pipeline.py):
    # for example ["clip:2", "topk:0.1", "int8:256"]; none: the trained model itself.  The
    # station decodes by the same list and refuses an update encoded otherwise.
    update_stages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_range("batch_size", self.batch_size, 1)
        check_range("local_steps", self.local_steps, 1)
        check_range("lr", self.lr, 0, low_open=True)
        UpdatePipeline(self.update_stages)  # a bad stage is named at start-up


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceConfig(TrainingSettings):
    """Settings of one device (SPEC §2-3)."""

    device_id: str  # this device's id: its topics and its certificate's name
    station: str  # the base station it belongs to
    fleet: str = "default"  # the fleet's name, the first level of every topic
    # Labelled samples the device waits for before it reports a batch ready: a live camera
    # whose labels trickle in would otherwise be picked for one-sample steps (1: any).
    min_batch: int = 1
    # Step decay: from station iteration ``lr_decay_at`` on, train at ``lr * lr_decay``
    # (0: never).  Late in a run a smaller step settles the model the noise keeps moving.
    lr_decay_at: int = 0
    lr_decay: float = 0.1  # the factor lr is multiplied by from iteration lr_decay_at on
    temperature: float = 50.0  # SAFL's maximum temperature L, in iterations
    mix: float = 0.5  # SAFL's eps: 1 recovers FedAvg/FedGS exactly
    granularity: str = "element"  # annealed merge mask: element, tensor or model
    nu: float = 0.0  # upload-gate regulariser; 0 always uploads
    # The annealed merge uses the local model only while it is this many station
    # iterations old or younger; an older one starts from the aggregate (docs/algorithms.md).
    merge_max_age: int = 20
    gate_min_holdout: int = 100  # held-out samples before the upload gate may hold back
    # Device-local accuracy: the deployable (merged) model on the held-out slice, measured
    # when selected at most once per this many iterations and reported with the stats; 0: off.
    local_eval_interval: int = 50
    prox_mu: float = 0.0  # FedProx proximal weight; 0 disables
    buffer_capacity: int = 1024  # samples the stream buffer keeps (the oldest leave first)
    holdout_every: int = 10  # one sample in this many is held out for local accuracy (0: none)
    holdout_capacity: int = 256  # held-out samples kept
    seed: int = 0  # of the merge masks and upload-gate draws
    # Local differential privacy (a "noise" stage in update_stages, docs/privacy.md): the
    # epsilon at privacy_delta this device may spend before it stops uploading (0: no limit).
    privacy_budget: float = 0.0
    privacy_delta: float = 1e-5  # the delta at which privacy_budget's epsilon is counted
    # Draw the privacy noise from ``seed`` (reproducible simulations) instead of the
    # operating system's entropy: whoever knows the seed could subtract the noise.
    noise_seeded: bool = False
    hello_interval: float = 2.0  # seconds between stats repeats until a model arrives
    # Seconds of hellos no station answers before the device warns (then at each doubling
    # of the silence); 0: never.
    unanswered_warning: float = 30.0
    # Station models between two sends of the closed-form head's statistics (where [model]
    # head_init comes to a solve), each the increment since the last; sooner while the
    # increment is at least everything sent before it, once at the device's start, and
    # after that never with fewer than 16 labelled samples (they wait for more).
    head_stats_every: int = 10

    def __post_init__(self) -> None:
        from ..safl import GRANULARITIES
        super().__post_init__()
        for key in ("device_id", "station", "fleet"):
            check_id(key, getattr(self, key))
        check_range("min_batch", self.min_batch, 1, self.batch_size)
        check_range("lr_decay_at", self.lr_decay_at, 0)
        check_range("lr_decay", self.lr_decay, 0, 1, low_open=True)
        check_range("temperature", self.temperature, 0, low_open=True)
        check_range("mix", self.mix, 0, 1)
        check_range("nu", self.nu, 0)
        check_range("merge_max_age", self.merge_max_age, 0)
        check_range("gate_min_holdout", self.gate_min_holdout, 0)
        check_range("local_eval_interval", self.local_eval_interval, 0)
        check_range("prox_mu", self.prox_mu, 0)
        check_range("buffer_capacity", self.buffer_capacity, 1)
        check_range("holdout_every", self.holdout_every, 0)
        check_range("holdout_capacity", self.holdout_capacity, 1)
        check_range("hello_interval", self.hello_interval, 0, low_open=True)
        check_range("unanswered_warning", self.unanswered_warning, 0)
        check_range("head_stats_every", self.head_stats_every, 1)
        check_range("privacy_budget", self.privacy_budget, 0)
        check_range("privacy_delta", self.privacy_delta, 0, 1, low_open=True)
        if self.privacy_budget and not UpdatePipeline(self.update_stages).noise:
            raise ConfigError("privacy_budget", "needs a noise stage in update_stages (as "
                              "[\"clip:1\", \"noise:1.1\"]): without noise nothing is private")
        if self.granularity not in GRANULARITIES:
            raise ConfigError("granularity", f"must be one of {GRANULARITIES}")
