"""A link emulator for a real fleet: a user-space TCP relay between an MQTT client and its broker.

The virtual clock (``lab/clock.py``) is a claim about how long a fleet takes; this module
is how it is checked against processes, sockets and a real broker.  A :class:`LinkRelay`
listens on a loopback port and forwards every connection made to it to the broker; each
direction of each connection delivers what a socket read gives it after the link's costs
(latency with jitter, the bandwidth cap, a lost segment's retransmission), priced by the
clock's own :class:`~lab.clock.Channel`, in order, in wall-clock time.  A user-space relay
cannot lose a segment of a loopback TCP stream (the kernel would never retransmit it), so
loss is the retransmission delay the clock assumes; what the check tests is everything
else: MQTT's acknowledgements and chunking, the roles' handling, the processes' scheduling,
the deadlines firing in real time.  Where ``tc netem`` exists (not on these machines: the
kernel lacks ``sch_netem``), the kernel's own TCP would check the loss model too.

:meth:`LinkRelay.partition` holds every byte both ways while the connections stay up (TCP
retransmits until the link heals: nothing sent is lost), :meth:`LinkRelay.heal` lets them
go, and :meth:`LinkRelay.reset` aborts every connection through the relay, as a long
partition or a NAT's timeout does: the client sees its link drop and reconnects.

:func:`relayed_fleet` puts a launched fleet (``lab/launch.py``) on the links its clock
prices: each device behind a relay with ``device_link``, the cloud behind one with
``cloud_link``, each station beside the broker (as the simulator places them).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .clock import Channel, LinkSpec
from .datasets import Dataset
from .launch import Fleet, launch_fleet
from .simulation import FleetSpec, Strategy, plan_fleet

__all__ = ["LinkRelay", "relayed_fleet", "launch_relayed"]

READ_SIZE = 64 * 1024


class LinkRelay:
    """One link, as a loopback port in front of ``upstream`` (``host, port``)."""

    def __init__(self, upstream: tuple[str, int], link: LinkSpec, *, seed: int = 0,
                 name: str = "relay") -> None:
        self.upstream, self.link, self.name = upstream, link, name
        self.counters: Counter[str] = Counter()
        self.port = 0
        self._seeds = np.random.SeedSequence(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._open: asyncio.Event | None = None  # clear while partitioned
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._cut_in: int | None = None  # bytes up until the link drops (cut_after)

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> LinkRelay:
        """Listen (on a free port unless one was set) in a thread of its own."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._listen())
            except BaseException as exc:  # reported to start(), which raises it
                failed.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self

    async def _listen(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def partition(self) -> None:
        """Hold every byte, both ways, until :meth:`heal`."""
        self.counters["partitions"] += 1
        self._call(lambda: self._gate().clear())

    def heal(self) -> None:
        self._call(lambda: self._gate().set())

    def reset(self) -> None:
        """Abort every connection through the relay (what was in flight is gone)."""
        self.counters["resets"] += 1
        self._call(self._abort)

    def cut_after(self, nbytes: int) -> None:
        """Drop the link once ``nbytes`` more bytes have gone up it: the first part of
        what the client was sending arrives, the rest never does (a link lost mid-upload)."""
        def arm() -> None:
            self._cut_in = nbytes
        self._call(arm)

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        loop = self._loop
        asyncio.run_coroutine_threadsafe(self._close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
        self._loop = None

    async def _close(self) -> None:
        if self._server:
            self._server.close()
        self._abort()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> LinkRelay:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _call(self, action: Callable[[], object]) -> None:
        """Run ``action`` on the relay's loop, and wait for it."""
        if self._loop is None:
            raise RuntimeError(f"{self.name} is not running")
        done = threading.Event()

        def run() -> None:
            try:
                action()
            finally:
                done.set()
        self._loop.call_soon_threadsafe(run)
        done.wait(5)

    def _gate(self) -> asyncio.Event:
        assert self._open is not None
        return self._open

    def _abort(self) -> None:
        for pair in list(self._links):
            for writer in pair:
                writer.transport.abort()

    def _cut(self, data: bytes) -> bytes:
        assert self._cut_in is not None
        data = data[:self._cut_in]
        self._cut_in -= len(data)
        return data

    async def _accept(self, client_r: asyncio.StreamReader,
                      client_w: asyncio.StreamWriter) -> None:
        self.counters["connections"] += 1
        try:
            broker_r, broker_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            self.counters["refused"] += 1
            client_w.transport.abort()
            return
        pair = (client_w, broker_w)
        self._links.add(pair)
        up, down = (np.random.default_rng(s) for s in self._seeds.spawn(2))
        pipes = [asyncio.ensure_future(self._pipe(client_r, broker_w, Channel(self.link, up),
                                                  "bytes_up")),
                 asyncio.ensure_future(self._pipe(broker_r, client_w,
                                                  Channel(self.link, down), "bytes_down"))]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # the relay stops: asyncio's server callback must not see the cancellation
        finally:
            for task in pipes:
                task.cancel()
            for writer in pair:
                writer.transport.abort()
            self._links.discard(pair)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    channel: Channel, counter: str) -> None:
        """One direction: what arrives is priced when it is read and written when due."""
        due: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await src.read(READ_SIZE):
                    due.put_nowait((channel.wire_arrival(time.monotonic(), len(data)), data))
            except (ConnectionError, OSError):
                pass
            finally:
                due.put_nowait(None)  # the link is down: the writer ends too

        reader = asyncio.ensure_future(read())
        try:
            while (item := await due.get()) is not None:
                at, data = item
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not self._gate().is_set():  # partitioned: sent once the link heals
                    await self._gate().wait()
                    await asyncio.sleep(self.link.latency_ms / 1e3)
                if counter == "bytes_up" and self._cut_in is not None:
                    data = self._cut(data)
                dst.write(data)
                await dst.drain()
                self.counters[counter] += len(data)
                if self._cut_in == 0:
                    self._cut_in = None
                    self.counters["cuts"] += 1
                    self._abort()
        except (ConnectionError, OSError):
            pass
        finally:
            reader.cancel()


@contextlib.contextmanager
def relayed_fleet(strategy: Strategy, spec: FleetSpec, broker: tuple[str, int]
                  ) -> Iterator[dict[str, LinkRelay]]:
    """A running relay per device and for the cloud, on the links of ``spec.clock``; give
    ``launch_fleet`` ``extra_args={name: ["--broker", relay.url]}``."""
    if spec.clock is None:
        raise ValueError("a relayed fleet needs the spec's clock (its links)")
    clock = spec.clock
    seeds = iter(np.random.SeedSequence([clock.seed, 0x5E1A]).generate_state(
        1 + len(spec.partitions)).tolist())
    relays = {"cloud": LinkRelay(broker, clock.cloud_link, seed=next(seeds), name="cloud")}
    for values in plan_fleet(strategy, spec).devices:
        did = values["device_id"]
        relays[did] = LinkRelay(broker, clock.device_link, seed=next(seeds), name=did)
    try:
        for relay in relays.values():
            relay.start()
        yield relays
    finally:
        for relay in relays.values():
            relay.stop()


def launch_relayed(run_dir: Path, data: Dataset, strategy: Strategy, spec: FleetSpec,
                   broker_url: str, *, credentials: Callable[[str], tuple[str, str]] | None = None,
                   during: Callable[[Fleet, dict[str, LinkRelay]], None] | None = None,
                   timeout: float = 600.0) -> tuple[list[dict[str, Any]], dict[str, LinkRelay]]:
    """:func:`~lab.launch.launch_fleet` with every device and the cloud behind its relay;
    ``during`` is also handed the relays (to partition, reset or cut one).  Returns the
    cloud's rows and the relays (stopped, their counters kept)."""
    where = urlsplit(broker_url)
    with relayed_fleet(strategy, spec, (where.hostname or "127.0.0.1", where.port or 1883)
                       ) as relays:
        rows = launch_fleet(run_dir, data, strategy, spec, broker_url, credentials=credentials,
                            extra_args={n: ["--broker", r.url] for n, r in relays.items()},
                            during=(lambda fleet: during(fleet, relays)) if during else None,
                            timeout=timeout)
    return rows, relays
