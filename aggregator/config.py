"""Validated, frozen configuration of the base station and the cloud."""

from __future__ import annotations

from dataclasses import dataclass

from edge_client.config import check_id, check_range
from edge_client.errors import ConfigError

from .fusion import FUSION_RULES, build_server_optimizer
from .selection import SELECTORS

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
class StationConfig:
    """One base station: its roster and FedGS settings (SPEC §4)."""

    station_id: str
    devices: tuple[str, ...]
    fleet: str = "default"
    super_node_size: int = 4  # FedGS's L
    rand_per_group: int = 1
    selector: str = "gbp_cs"
    fusion: str = "fedavg"
    sync_period: int = 5  # FedGS's T: iterations between external syncs
    iteration_timeout: float = 30.0  # seconds a super node has to reply
    min_quorum: int = 1  # updates needed for an internal sync to change w^m
    min_devices: int = 0  # devices whose stats start the station; 0 means the whole roster
    gbp_max_iter: int = 100
    seed: int = 0  # of the random part of each super node
    hello_interval: float = 2.0  # seconds between join repeats until the cloud answers

    def __post_init__(self) -> None:
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
        if self.min_devices == 0:
            object.__setattr__(self, "min_devices", len(self.devices))
        if self.selector not in SELECTORS:
            raise ConfigError("selector", f"must be one of {sorted(SELECTORS)}")
        if self.fusion not in FUSION_RULES:
            raise ConfigError("fusion", f"must be one of {sorted(FUSION_RULES)}")


@dataclass(frozen=True, kw_only=True)
class CloudConfig:
    """The cloud: its stations, the number of rounds and the external-sync rule."""

    stations: tuple[str, ...]
    rounds: int
    fleet: str = "default"
    round_timeout: float = 600.0
    min_stations: int = 1
    station_weighting: str = "samples"  # or "equal", as the FedGS reference code does
    server_optimizer: str = "none"
    server_lr: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        check_id("fleet", self.fleet)
        _check_roster("stations", self.stations)
        check_range("rounds", self.rounds, 1)
        check_range("round_timeout", self.round_timeout, 0, low_open=True)
        check_range("min_stations", self.min_stations, 1, len(self.stations))
        if self.station_weighting not in ("samples", "equal"):
            raise ConfigError("station_weighting", "must be 'samples' or 'equal'")
        # The optimiser owns its checks (kind, lr, betas, tau): build one to run them.
        build_server_optimizer(self.server_optimizer, lr=self.server_lr, beta1=self.beta1,
                               beta2=self.beta2, tau=self.tau)
