"""Validated, frozen configuration of the base station and the cloud."""

from __future__ import annotations

from dataclasses import dataclass

from edge_client.config import TrainingSettings, check_id, check_range
from edge_client.errors import ConfigError

from .central_dp import CentralPrivacy
from .fusion import FUSION_RULES
from .selection import SELECTORS
from .server_optimizers import ServerOptimizerSettings
from .trust import fair_seat_share

STATION_MODES = ("sync", "buffered")
STALENESS_WEIGHTS = ("sqrt", "constant")

__all__ = ["StationConfig", "CloudConfig"]


def _check_roster(key: str, ids: tuple[str, ...]) -> None:
    if not ids:
        raise ConfigError(key, "must list at least one id")
    for i in ids:
        check_id(key, i)
    if len(set(ids)) != len(ids):
        dupes = sorted(i for i in set(ids) if ids.count(i) > 1)
        raise ConfigError(key, f"has duplicate ids: {dupes}")


@dataclass(frozen=True, kw_only=True)
class StationConfig(TrainingSettings, CentralPrivacy):
    """One base station: its roster and FedGS settings (SPEC §4).

    From :class:`TrainingSettings` it knows its devices' training: an update may claim at
    most ``local_steps x batch_size`` samples, a next-batch histogram at most ``batch_size``.
    """

    station_id: str  # this station's id: its topics and its certificate's name
    devices: tuple[str, ...]  # the roster: every device that may join
    fleet: str = "default"  # the fleet's name, the first level of every topic
    super_node_size: int = 4  # FedGS's L
    rand_per_group: int = 1  # members of a super node drawn at random
    selector: str = "gbp_cs"  # how the super node is chosen: gbp_cs (FedGS), random or greedy
    # Internal sync rule: fedavg, or a robust one (median, trimmed_mean, krum).
    fusion: str = "fedavg"
    sync_period: int = 5  # FedGS's T: iterations between external syncs
    iteration_timeout: float = 30.0  # seconds a super node has to reply
    min_quorum: int = 1  # updates needed for an internal sync to change w^m
    min_devices: int = 0  # devices whose stats start the station; 0 means the whole roster
    gbp_max_iter: int = 100  # GBP-CS iterations per selection
    seed: int = 0  # of the random part of each super node
    hello_interval: float = 2.0  # seconds between join repeats until the cloud answers
    # Update-distance guard (docs/reliability.md): a fixed bound on ||z - w^m||, or (0) an
    # adaptive one, update_norm_factor x the median accepted distance; before 8 updates,
    # lr x local_steps x grad_norm_bound.  Both 0: off.  An update beyond the bound is
    # clipped onto it; beyond update_norm_hard_factor x the bound it is refused (1: refuse
    # whatever passes the bound).
    update_norm_bound: float = 0.0
    # the adaptive bound: this x the median accepted update distance
    update_norm_factor: float = 10.0
    # refuse an update beyond this x the bound (clip below it)
    update_norm_hard_factor: float = 10.0
    # per-step gradient bound behind the first 8 updates' distance bound
    grad_norm_bound: float = 100.0
    # Seen-count claims: growth per local step of each station iteration (and the most a
    # device may claim while the roster's median is small), and the multiple of the roster's
    # median it may reach (honest Dirichlet-0.1 fleets streaming in proportion to their data
    # reach 8.8x).  Apart from these, no device weighs more than the rest of the roster
    # together in the counts that feed P_real (trust.majority_capped).
    max_seen_rate: int = 1024
    seen_share: float = 10.0  # the multiple of the roster's median seen count a device may claim
    # Share of the last share_window super nodes one device may sit in; 0: 1.5 L / roster,
    # at most halfway from L / roster to 1 (trust.fair_seat_share).
    max_selection_share: float = 0.0
    share_window: int = 20  # super nodes over which max_selection_share is counted
    # An update closer than this to one of the device's recent updates, relative to its
    # distance from w^m, is a replay and refused (0: off).
    replay_tolerance: float = 1e-3
    # A member whose reply was refused (replay, distance, count, a refused frame) is left out
    # of this many super nodes, unless it is needed to fill one (0: never).
    refused_sit_out: int = 10
    # Stragglers (aggregator/stragglers.py): an iteration closes at straggler_factor x the
    # median reply time (at least straggler_min_wait s, at most iteration_timeout), and a
    # member that missed it sits out straggler_sit_out super nodes, doubling per miss in a
    # row.  straggler_factor = 0: wait for every member up to iteration_timeout.
    # Station mode (aggregator/fedbuff.py): "sync", FedGS's super node answering each
    # internal sync together; or "buffered", FedBuff (Nguyen et al., AISTATS 2022): up to
    # super_node_size devices train at once from the latest model each has, and every
    # buffer_size admitted updates are folded into w^m, each weighted by its samples and by
    # staleness_weight of its staleness s (iterations since its model): "sqrt", the paper's
    # 1/sqrt(1+s), or "constant"; updates staler than max_staleness are dropped.
    # buffer_size = 0: half the super node (at least 1), so that the devices in flight
    # outnumber a buffer, as FedBuff's concurrency does its K.
    mode: str = "sync"  # "sync" (FedGS: the super node answers together) or "buffered"
    buffer_size: int = 0  # buffered mode: admitted updates per fold (0: half the super node)
    max_staleness: int = 4  # buffered mode: updates staler than this many iterations are dropped
    staleness_weight: str = "sqrt"  # buffered mode: "sqrt" (1/sqrt(1+s)) or "constant"
    # close an iteration at this x the median reply time (0: wait for all)
    straggler_factor: float = 3.0
    # seconds an iteration waits at least before it cuts stragglers
    straggler_min_wait: float = 0.25
    # super nodes a member that missed the cut sits out (doubling per miss)
    straggler_sit_out: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id("station_id", self.station_id)
        check_id("fleet", self.fleet)
        _check_roster("devices", self.devices)
        check_range("super_node_size", self.super_node_size, 1, len(self.devices))
        check_range("rand_per_group", self.rand_per_group, 0, self.super_node_size)
        check_range("sync_period", self.sync_period, 1)
        check_range("iteration_timeout", self.iteration_timeout, 0, low_open=True)
        check_range("min_quorum", self.min_quorum, 1, self.super_node_size)
        check_range("gbp_max_iter", self.gbp_max_iter, 0)
        check_range("min_devices", self.min_devices, 0, len(self.devices))
        check_range("hello_interval", self.hello_interval, 0, low_open=True)
        check_range("update_norm_bound", self.update_norm_bound, 0)
        check_range("update_norm_factor", self.update_norm_factor, 0)
        check_range("update_norm_hard_factor", self.update_norm_hard_factor, 1)
        check_range("grad_norm_bound", self.grad_norm_bound, 0, low_open=True)
        check_range("max_seen_rate", self.max_seen_rate, 1)
        check_range("seen_share", self.seen_share, 1)
        check_range("max_selection_share", self.max_selection_share, 0, 1)
        check_range("share_window", self.share_window, 1)
        check_range("replay_tolerance", self.replay_tolerance, 0, 1)
        check_range("refused_sit_out", self.refused_sit_out, 0)
        if self.mode not in STATION_MODES:
            raise ConfigError("mode", f"must be one of {STATION_MODES}, got {self.mode!r}")
        if self.staleness_weight not in STALENESS_WEIGHTS:
            raise ConfigError("staleness_weight", f"must be one of {STALENESS_WEIGHTS}, got "
                              f"{self.staleness_weight!r}")
        check_range("buffer_size", self.buffer_size, 0, self.super_node_size)
        if self.buffer_size == 0:
            object.__setattr__(self, "buffer_size", max(1, self.super_node_size // 2))
        check_range("max_staleness", self.max_staleness, 0)
        check_range("straggler_factor", self.straggler_factor, 0)
        if self.straggler_factor:
            check_range("straggler_factor", self.straggler_factor, 1)
        check_range("straggler_min_wait", self.straggler_min_wait, 0)
        check_range("straggler_sit_out", self.straggler_sit_out, 0)
        self.check_privacy(self.fusion)
        if self.mode == "buffered":
            _internal_syncs_only(self)
        if self.max_selection_share == 0:
            object.__setattr__(self, "max_selection_share",
                               fair_seat_share(self.super_node_size, len(self.devices)))
        if self.min_devices == 0:
            object.__setattr__(self, "min_devices", len(self.devices))
        if self.selector not in SELECTORS:
            raise ConfigError("selector", f"must be one of {sorted(SELECTORS)}")
        if self.fusion not in FUSION_RULES:
            raise ConfigError("fusion", f"must be one of {sorted(FUSION_RULES)}")


@dataclass(frozen=True, kw_only=True)
class CloudConfig(ServerOptimizerSettings, CentralPrivacy):
    """The cloud: its stations, the number of rounds, the external-sync rule, (from
    :class:`ServerOptimizerSettings`) the server optimiser, and (from :class:`CentralPrivacy`)
    central DP across stations: each station's update clipped, the noise at the cloud."""

    stations: tuple[str, ...]  # the stations whose updates the cloud fuses
    rounds: int  # external syncs before the final model (0: none, learn until stopped)
    fleet: str = "default"  # the fleet's name, the first level of every topic
    round_timeout: float = 600.0  # seconds the cloud waits for a round's station updates
    min_stations: int = 1  # station updates a round needs to close at its timeout
    # Seconds a round waits for a station whose Last Will fired to come back before it
    # closes without it: a station restarted by systemd (RestartSec=5) resumes within it.
    station_grace: float = 30.0
    station_weighting: str = "samples"  # "samples" or "equal" (as the FedGS reference code does)
    fusion: str = "fedavg"  # external sync rule; a robust one bounds a compromised station
    # Seconds round 0 waits, once every station has reported, for the head statistics of
    # the frames the devices started with (a closed-form head, [model] head_init): 3.3 MB
    # a device, forwarded by its station.
    head_join_wait: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id("fleet", self.fleet)
        _check_roster("stations", self.stations)
        check_range("head_join_wait", self.head_join_wait, 0)
        check_range("rounds", self.rounds, 0)
        check_range("round_timeout", self.round_timeout, 0, low_open=True)
        check_range("station_grace", self.station_grace, 0)
        check_range("min_stations", self.min_stations, 1, len(self.stations))
        if self.fusion not in FUSION_RULES:
            raise ConfigError("fusion", f"must be one of {sorted(FUSION_RULES)}")
        if self.station_weighting not in ("samples", "equal"):
            raise ConfigError("station_weighting", "must be 'samples' or 'equal'")
        self.check_privacy(self.fusion)
        _internal_syncs_only(self)


def _internal_syncs_only(cfg: CentralPrivacy) -> None:
    """The tree mechanism and the participation cap shape a round of internal syncs; the
    cloud's rounds and a buffered station's folds have none to shape."""
    if cfg.central_dp_mechanism != "independent":
        raise ConfigError("central_dp_mechanism", "the tree is over a synchronous station's "
                          "internal syncs: only 'independent' here")
    if cfg.max_participations:
        raise ConfigError("max_participations", "caps seats in a synchronous station's "
                          "internal syncs: leave it 0 here")
