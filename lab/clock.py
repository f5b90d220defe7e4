"""The simulator's virtual clock: what a fleet's boards and links cost in seconds.

FedScale's lesson (Lai et al., ICML 2022) is that a federation's ranking per sample says
little about its ranking per second: the slow boards, the round trips and the lost segments
decide that.  This module prices both.  A device has a :class:`ComputeProfile` (seconds per
local step, per held-out evaluation and per predicted sample, for the run's model), and
every participant a link to its broker (:class:`LinkSpec`: one-way latency with jitter,
bandwidth, loss); a station has one to the cloud.  :class:`TimedBus` is the in-process bus
with time in it: each publish reaches each subscriber at its virtual arrival time (the
sender's uplink, then the receiver's downlink), a role is busy for what its handling cost,
and each role's ``tick`` runs at the time its own ``wakeup()`` names, so the stations'
deadlines, quorum waits and the cloud's round timeout fire in virtual time as they would in
production.  With every cost zero, events keep the in-process bus's order exactly (time,
then publish order, then subscription order), so results are bit-identical to the clockless
simulator's.

The clock is configured in an experiment's ``[simulation]`` table (:class:`ClockConfig`,
through :class:`~lab.engine.SimulationConfig`); the shipped profiles and their sources are
in ``docs/experiments.md`` ("Virtual time").
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_client import messages as m
from edge_client.config import check_range
from edge_client.errors import ConfigError
from edge_client.transport import Handler, LocalBus

__all__ = ["ComputeProfile", "PROFILES", "HOST_HANDLING_MS", "LinkSpec", "ClockConfig",
           "Channel", "Port", "TimedBus", "assign_profiles", "check_batched_steps", "parse_mix",
           "ZERO_LINK"]

# A profile's step times are for one local step on a batch of REFERENCE_BATCH samples; a
# step on fewer costs in proportion (the small models here are compute-bound per sample), and
# a forward pass FORWARD_SHARE of a step per sample.  A rehearsed device is paced by the same
# figures (edge_client/trainers/paced.py).
# A pi4's Cortex-A72 (1.5 GHz, 2x128-bit NEON FMA: 16 FLOP/cycle/core, 24 GFLOPS a core)
# against one core of this x86 host (AVX2, 2x256-bit FMA: 32 FLOP/cycle at about 3 GHz, 96
# GFLOPS): 4x at peak, and the A72's smaller caches and memory bandwidth (about 4 GB/s
# against 20) make 6-8x usual for BLAS-bound work; 6x is taken (docs/experiments.md).
PI4_OVER_HOST = 6.0


@dataclass(frozen=True)
class ComputeProfile:
    """A board and backend: seconds per local step (batch :data:`REFERENCE_BATCH`) for
    each model it was measured or estimated on."""

    name: str
    step_s: dict[str, float]
    source: str
    # Seconds of a frozen body's forward per arriving frame, per body (docs/bodies.md).
    body_s: dict[str, float] = field(default_factory=dict)

    def step_seconds(self, model: str, input_shape: tuple[int, ...] = ()) -> float:
        """A step's seconds; a model measured at ``input_shape`` (``"small_cnn@3x64x64"``)
        is priced at that figure, else at the model's own (its default input)."""
        sized = f"{model}@{'x'.join(map(str, input_shape))}"
        if input_shape and sized in self.step_s:
            return self.step_s[sized]
        if model not in self.step_s:
            raise ConfigError("profiles", f"profile {self.name!r} has no figure for model "
                              f"{model!r}; it knows {sorted(self.step_s)}")
        return self.step_s[model]

    def body_seconds(self, body: str) -> float:
        """A frame's trip through ``body`` ("none": 0)."""
        if body == "none":
            return 0.0
        if body not in self.body_s:
            raise ConfigError("profiles", f"profile {self.name!r} has no figure for body "
                              f"{body!r}; it knows {sorted(self.body_s)}")
        return self.body_s[body]


def _scaled(name: str, base: ComputeProfile, factor: float, source: str) -> ComputeProfile:
    return ComputeProfile(name, {k: v * factor for k, v in base.step_s.items()}, source,
                          {k: v * factor for k, v in base.body_s.items()})


# Measured on this project's CI host (one x86_64 core, docs/install-edge.md's probe table:
# numpy MLP 0.4 ms, numpy small_cnn 21.1 ms, torch small_cnn 10.3 ms a step at batch 32).
# "linear" is a body's head on 1,280 features (numpy 0.05 ms a step).  A body's forward runs
# on ONNX Runtime on every CPU board (edge_client/body.py), one frame at a time as a camera
# delivers them: EfficientNet-Lite0 at 3x64x64, 1.05 ms a frame on one core
# (bench/body.py, docs/bodies.md).
# The small CNN on camera frames (3x64x64) is priced at its 1x28x28 figure times the ratio
# measured in one run on one core: torch 51.7 / 8.0 ms (6.5x), numpy 137.7 / 17.9 ms (7.7x).
# EfficientNet-Lite0's last block(s) and a linear head training on torch ([model]
# train_body_blocks, 1,030,410 and 1,506,570 parameters): 18.0-21.6 and 45.6-48.8 ms a step
# of 32 on one core, measured beside another job (docs/bodies.md).
_BODIES_X86 = {"efficientnet-lite0": 0.00105}
_TUNED_X86_TORCH = {"efficientnet-lite0[-1:]+linear": 0.019,
                    "efficientnet-lite0[-2:]+linear": 0.047}
_X86_NUMPY = ComputeProfile("x86-numpy", {"softmax": 0.0002, "linear": 0.00005, "mlp": 0.0004,
                                          "small_cnn": 0.0211, "small_cnn@3x64x64": 0.162},
                            "measured (install-edge.md)", _BODIES_X86)
_X86_TORCH = ComputeProfile("x86-torch", {"softmax": 0.0003, "linear": 0.0001, "mlp": 0.0005,
                                          "small_cnn": 0.0103, "small_cnn@3x64x64": 0.0666,
                                          **_TUNED_X86_TORCH},
                            "measured (install-edge.md)", _BODIES_X86)
PROFILES: dict[str, ComputeProfile] = {p.name: p for p in (
    ComputeProfile("zero", {"softmax": 0.0, "linear": 0.0, "mlp": 0.0, "small_cnn": 0.0,
                            "small_cnn@3x64x64": 0.0,
                            **{k: 0.0 for k in _TUNED_X86_TORCH}},
                   "no cost: the clockless simulator's order, with links priced",
                   {"efficientnet-lite0": 0.0}),
    _X86_NUMPY, _X86_TORCH,
    _scaled("pi4-numpy", _X86_NUMPY, PI4_OVER_HOST, "x86-numpy x PI4_OVER_HOST"),
    _scaled("pi4-torch", _X86_TORCH, PI4_OVER_HOST, "x86-torch x PI4_OVER_HOST"),
    # A small model on a Jetson's GPU is bound by kernel launches (about 30 for a step of the
    # small CNN at 10-20 us each on Orin, plus the host-device copies of a batch), not FLOPs.
    # A tuned body's block and head: about 60 kernels a step (forward, backward, update).
    ComputeProfile("jetson-orin-cuda", {"softmax": 0.0008, "linear": 0.0008, "mlp": 0.0010,
                                        "small_cnn": 0.0025, "small_cnn@3x64x64": 0.004,
                                        "efficientnet-lite0[-1:]+linear": 0.003,
                                        "efficientnet-lite0[-2:]+linear": 0.0045},
                   "estimate: launch-bound (docs/experiments.md)",
                   # about 60 kernels a frame at 10-20 us each, batch 1 (an estimate)
                   {"efficientnet-lite0": 0.0012}),
)}


@dataclass(frozen=True)
class LinkSpec:
    """One participant's link to its broker, the same both ways."""

    latency_ms: float = 0.0  # one way
    jitter_ms: float = 0.0  # added per message, uniform in [0, jitter]; order is kept (TCP)
    bandwidth_mbps: float = 0.0  # 0: unlimited
    loss: float = 0.0  # per TCP segment

    def __post_init__(self) -> None:
        for key in ("latency_ms", "jitter_ms", "bandwidth_mbps"):
            check_range(key, getattr(self, key), 0)
        check_range("loss", self.loss, 0, 0.5)

    @property
    def free(self) -> bool:
        return not (self.latency_ms or self.jitter_ms or self.bandwidth_mbps or self.loss)


ZERO_LINK = LinkSpec()

# Milliseconds of its own time a role on this project's x86 host spends on each message it
# handles, beyond its training (decoding and checks, bookkeeping, its answer's encoding,
# and the emulating relay's own hop): fitted by `bench/rehearsal.py --calibrate` on a
# real fleet with links of no latency (docs/experiments.md "The clock against a real fleet").
HOST_HANDLING_MS = 2.6

SEGMENT = 1448  # TCP payload per segment on a 1500-byte MTU with timestamps
FRAME_OVERHEAD = 120  # the MQTT fixed header, topic and the wire format's header, about
MIN_RTO = 0.2  # Linux's minimum retransmission timeout


class Channel:
    """One direction of a link: messages leave in order, each after the one before has
    been serialised onto the wire, and arrive in order (TCP), a lost segment costing its
    retransmission: about one round trip where later segments trigger fast retransmit, an
    RTO (at least 200 ms, doubling) at a message's tail, where none follow."""

    def __init__(self, spec: LinkSpec, rng: np.random.Generator) -> None:
        self.spec = spec
        self.rng = rng
        self._free_at = 0.0  # when the wire is done with what it was sending
        self._last = 0.0  # the last arrival: TCP delivers in order

    def arrival(self, sent: float, nbytes: int) -> float:
        """When a message of ``nbytes`` of payload sent at ``sent`` has arrived whole."""
        return self.wire_arrival(sent, nbytes + FRAME_OVERHEAD)

    def wire_arrival(self, sent: float, size: int) -> float:
        """When ``size`` bytes on the wire, written at ``sent``, have arrived whole (the
        relay of lab/relay.py prices what a socket read gives it this way)."""
        spec = self.spec
        if spec.free:
            return sent
        wire = size * 8 / (spec.bandwidth_mbps * 1e6) if spec.bandwidth_mbps else 0.0
        start = max(sent, self._free_at)
        self._free_at = start + wire
        latency = spec.latency_ms / 1e3
        if spec.jitter_ms:
            latency += float(self.rng.random()) * spec.jitter_ms / 1e3
        delay = self._retransmissions(size) if spec.loss else 0.0
        self._last = max(self._last, self._free_at + latency + delay)
        return self._last

    def _retransmissions(self, size: int) -> float:
        segments = -(-size // SEGMENT)
        rtt = 2 * self.spec.latency_ms / 1e3
        lost = self.rng.random(segments) < self.spec.loss
        delay = rtt if lost[:-3].any() else 0.0  # SACK recovers a window's losses in one RTT
        rto = max(MIN_RTO, 2 * rtt)
        for tail in lost[-3:]:
            while tail:  # a retransmission may be lost too: the RTO doubles
                delay += rto
                rto *= 2
                tail = bool(self.rng.random() < self.spec.loss)
        return delay


@dataclass(frozen=True)
class ClockConfig:
    """Virtual time for a simulated fleet: the devices' profiles by fraction, and links."""

    profiles: tuple[tuple[str, float], ...]  # (name, fraction of the devices)
    device_link: LinkSpec = ZERO_LINK  # each device to its factory's broker (the station's)
    cloud_link: LinkSpec = ZERO_LINK  # each station to the cloud's broker
    # Devices numbered here (0-based) are this many times slower than their profile: the
    # straggler a field test meets.
    slow_devices: tuple[int, ...] = ()
    slow_factor: float = 1.0
    seed: int = 0  # of the links' jitter and loss, and of which device gets which profile
    # What each message costs the role that handles it, beyond the compute its profile
    # prices: the frame's decoding and checks, the role's bookkeeping, its answer's
    # encoding (HOST_HANDLING_MS is this host's, measured by bench/rehearsal.py).
    handling_ms: float = 0.0
    # A stalled fleet (the cloud below quorum forever) ends here instead of ticking forever.
    max_virtual_s: float = 30 * 86400.0

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ConfigError("profiles", "name at least one profile")
        for name, share in self.profiles:
            if name not in PROFILES:
                raise ConfigError("profiles", f"unknown profile {name!r}; shipped: "
                                  f"{sorted(PROFILES)}")
            check_range("profiles", share, 0, 1, low_open=True)
        if not math.isclose(sum(s for _, s in self.profiles), 1.0, abs_tol=1e-6):
            raise ConfigError("profiles", "fractions must sum to 1, got "
                              f"{sum(s for _, s in self.profiles):g}")
        check_range("slow_factor", self.slow_factor, 1)
        check_range("handling_ms", self.handling_ms, 0)

    @property
    def tag(self) -> str:
        """What a run's cache key adds: every setting that changes its numbers (handling
        only where set, so that runs cached before it keep their keys)."""
        text = repr(self)
        if not self.handling_ms:
            text = text.replace(", handling_ms=0.0", "")
        return f"|clock-{text}"


def check_batched_steps(batched_steps: bool, clocked: bool) -> None:
    """A super node stepped in one batched call has no per-device clock: refuse both."""
    if batched_steps and clocked:
        raise ConfigError("batched_steps", "steps a super node in one call, which has no "
                          "per-device clock: leave it off with profiles")


def parse_mix(items: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    """``("pi4-numpy=0.4", "pi4-torch=0.6")`` as (name, fraction) pairs."""
    out = []
    for item in items:
        name, _, share = item.partition("=")
        try:
            out.append((name.strip(), float(share) if share else 1.0))
        except ValueError:
            raise ConfigError("profiles", f"expected NAME=FRACTION, got {item!r}") from None
    return tuple(out)


def assign_profiles(clock: ClockConfig, n_devices: int) -> list[str]:
    """Each device's profile: the fractions as whole counts (largest remainders), spread over
    the fleet by a seeded shuffle so that no factory gets all of one kind."""
    shares = np.array([s for _, s in clock.profiles]) * n_devices
    counts = np.floor(shares).astype(int)
    for i in np.argsort(-(shares - counts), kind="stable")[: n_devices - counts.sum()]:
        counts[i] += 1
    names = [name for (name, _), c in zip(clock.profiles, counts, strict=True) for _ in range(c)]
    order = np.random.default_rng([clock.seed, 0xC10C]).permutation(n_devices)
    return [names[i] for i in order]


@dataclass
class Port:
    """One participant on a :class:`TimedBus`: its links both ways, what its handling costs,
    and when it is next free.  A runner uses a port as its transport and ``port.now`` as its
    clock."""

    bus: TimedBus
    name: str
    up: Channel
    down: Channel
    cost: Callable[[], float] = lambda: 0.0  # seconds of work since it was last asked
    wakeup: Callable[[], float | None] = lambda: None  # the role's next timed action
    tick: Callable[[], None] = lambda: None
    now: float = 0.0
    busy_until: float = 0.0
    immediate: bool = False  # handed each message when sent (TimedBus's docstring)
    _outgoing: list[tuple[tuple[int, int], str, m.Message]] | None = None
    _timer: float | None = field(default=None)

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        self.bus.subscribe_port(topic_filter, handler, self)

    def publish(self, topic: str, message: m.Message) -> None:
        seq = self.bus.reserve(message)
        if self._outgoing is not None:  # sent when the handling is done
            self._outgoing.append((seq, topic, message))
        else:
            self.bus.schedule(seq, topic, message, max(self.now, self.busy_until), self)

    def run(self, at: float, work: Callable[[], None], handling: float = 0.0) -> None:
        """Do ``work`` as this participant at virtual time ``at`` (or once it is free): what
        it publishes leaves when the work's cost (and ``handling``, a message's) has passed."""
        start = max(at, self.busy_until)
        self.now = start
        self._outgoing = []
        try:
            work()
        finally:
            outgoing, self._outgoing = self._outgoing, None
            self.busy_until = start + self.cost() + handling
            for seq, topic, message in outgoing:
                self.bus.schedule(seq, topic, message, self.busy_until, self)
        self.bus.arm(self)

    # The rest of the transport contract, as the in-process bus keeps it.
    def connect(self) -> None:
        """Nothing to reach."""

    def deliver(self, limit: int | None = None) -> int:
        return self.bus.deliver(limit)

    def wait(self, timeout: float) -> None:
        """Returns at once, as the in-process bus does."""

    def close(self, final: bool = False) -> None:
        self.bus.close()

    @property
    def idle(self) -> bool:
        return self.bus.idle


_MESSAGE, _TICK = 0, 1


class TimedBus(LocalBus):
    """The in-process bus in virtual time (see the module's docstring).

    ``deliver`` runs events in time order until no message is in flight; the roles' timers
    then run only while ``keep_time()`` says something waits on them (a station's deadline
    mid-iteration; not a join repeat while the federation waits for the cloud).  While
    ``hold()`` (a factory whose station waits for the cloud's model), nothing later than
    now runs: what the devices do meanwhile must come after the model if the model comes
    first, and only the driver knows when it comes (``deliver(through=...)``).  A port made
    ``immediate`` (the factory's outbox to the cloud) is handed each message at once, with
    ``now`` its arrival time, since it only records what reaches the cloud and when.
    """

    def __init__(self, keep_time: Callable[[], bool] = lambda: False,
                 max_virtual_s: float = math.inf, hold: Callable[[], bool] = lambda: False,
                 handling_s: float = 0.0) -> None:
        super().__init__()
        self._events: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._in_flight = 0
        self._ports: dict[int, Port] = {}  # subscription index -> its port
        self.keep_time = keep_time
        self.hold = hold
        self.max_virtual_s = max_virtual_s
        self.handling_s = handling_s  # each message a port handles (ClockConfig.handling_ms)
        self.now = 0.0  # the time of the event being handled
        # The driver's, on the cloud's bus: called with an event's time before the event, so
        # that what the factories did until then (held while their stations wait for the
        # cloud) reaches this bus first.
        self.before: Callable[[float], None] | None = None
        self._direct = Port(self, "bus", Channel(ZERO_LINK, np.random.default_rng(0)),
                            Channel(ZERO_LINK, np.random.default_rng(0)))

    def port(self, name: str, link: LinkSpec = ZERO_LINK, *, rng: np.random.Generator | None
             = None, down: LinkSpec | None = None) -> Port:
        rng = rng or np.random.default_rng(0)
        return Port(self, name, Channel(link, rng), Channel(link if down is None else down, rng))

    def subscribe_port(self, topic_filter: str, handler: Handler, port: Port) -> None:
        self._ports[self._routes.add(topic_filter, handler)] = port

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        self.subscribe_port(topic_filter, handler, self._direct)

    def reserve(self, message: m.Message) -> tuple[int, int]:
        """A publish's place in the order (taken when it is made, as the FIFO bus does), and
        its payload's size (counted once, priced on each link)."""
        if self.closed:
            from edge_client.errors import SaflError
            raise SaflError("publish on a closed bus")
        kind = m.traffic_kind(message)
        self.messages[kind] += 1
        nbytes = m.payload_nbytes(message)
        self.payload_bytes[kind] += nbytes
        self._seq += 1
        return self._seq, nbytes

    def publish(self, topic: str, message: m.Message) -> None:
        self.publish_at(topic, message, self.now)

    def publish_at(self, topic: str, message: m.Message, at: float) -> tuple[int, int]:
        """Publish from outside the bus's participants (the cloud's model reaching a
        factory, a station's upload reaching the cloud) to arrive at ``at``; returns its
        place in the order and how many subscribers it reaches (``deliver(through=)``)."""
        seq = self.reserve(message)
        return seq[0], self.schedule(seq, topic, message, at, self._direct)

    def schedule(self, seq: tuple[int, int], topic: str, message: m.Message, sent: float,
                 sender: Port) -> int:
        order, nbytes = seq
        at_broker = sender.up.arrival(sent, nbytes)
        queued = 0
        for index, handler in self._routes.find(topic):
            receiver = self._ports[index]
            at = receiver.down.arrival(at_broker, nbytes)
            if receiver.immediate:
                now, self.now = self.now, at
                try:
                    handler(topic, message)
                finally:
                    self.now = now
                continue
            heapq.heappush(self._events, (at, order, index, _MESSAGE,
                                          (topic, message, handler)))
            self._in_flight += 1
            queued += 1
        return queued

    def arm(self, port: Port) -> None:
        """Set ``port``'s timer to its role's next timed action (one pending per port)."""
        at = port.wakeup()
        if at is None or at == port._timer:
            return
        port._timer = at
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, 0, _TICK, port))

    @property
    def idle(self) -> bool:
        return not self._in_flight

    def deliver(self, limit: int | None = None, through: tuple[int, int] | None = None,
                until: float | None = None) -> int:
        """Handle events in time order until none is in flight (or ``limit`` messages have
        reached a subscriber), or with ``through`` (a :meth:`publish_at`'s answer) until
        that message and everything before it has, held or not, or with ``until`` every
        event up to that virtual time, held or not."""
        count = 0
        events = self._events
        left = through[1] if through else 0
        while events and not self._stopping and (limit is None or count < limit):
            if self.before is not None and events[0][0] > self.now:
                self.before(events[0][0])  # may put earlier events first
            at, seq, index, kind, what = events[0]
            if through is not None:
                if not left:
                    break
                left -= seq == through[0]
            elif until is not None:
                if at > until:
                    break
            elif at > self.now and self.hold():
                break  # the driver brings what comes next
            if kind == _TICK:
                port: Port = what
                due = port.wakeup()
                if port._timer != at or due is None or due > at:
                    heapq.heappop(events)  # superseded: the role moved on
                    if port._timer == at:
                        port._timer = None
                        self.arm(port)
                    continue
                if (not self._in_flight and not self.keep_time()) or at > self.max_virtual_s:
                    break  # only timers left, and nothing waits on them
                heapq.heappop(events)
                port._timer = None
                self.now = at
                port.run(at, port.tick)
                continue
            heapq.heappop(events)
            self._in_flight -= 1
            topic, message, handler = what
            self.now = at
            receiver = self._ports[index]
            receiver.run(at, functools.partial(handler, topic, message), self.handling_s)
            count += 1
        if self._stopping:
            events.clear()
            self._in_flight = 0
        return count

    def close(self, final: bool = False) -> None:
        super().close()
        self._events.clear()
        self._in_flight = 0

