"""Chunked frames put back together: once per message, within a timeout and a memory cap,
hashed as the chunks arrive so that a frame's checksum is mostly done when its last chunk
lands (the chunks themselves are cut by ``codec.split`` and ``codec.stream``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

from .codec import _CHUNK, _VERSIONS, CHUNK_MAGIC, _Check, _version_of
from .errors import MessageError

__all__ = ["Reassembler", "is_chunk"]


def is_chunk(data: bytes) -> bool:
    return data[:4] == CHUNK_MAGIC


@dataclass
class _Partial:
    """A chunked frame being put back together."""

    count: int  # chunks the frame was cut into
    total: int  # bytes of the whole frame
    started: float  # when its first chunk arrived (for the timeout)
    chunks: dict[int, memoryview] = dataclasses.field(default_factory=dict)
    bytes: int = 0  # buffered so far
    # The running checksum over the chunks received in order from the first (``hashed`` of
    # them, ``offset`` bytes), over the byte ranges ``span`` the frame's version checks.
    hash: _Check | None = None
    span: tuple[tuple[int, int], ...] = ()
    hashed: int = 0
    offset: int = 0
    unhashable: bool = False  # the first chunk names no version: decode checks it whole


class Reassembler:
    """Puts chunks back together: once per message, within a timeout and a memory cap.

    ``add`` returns the whole frame when its last missing chunk arrives, and
    None otherwise; duplicate chunks (QoS 1 redelivery) are ignored.  Chunks are hashed
    as they arrive, in order, so a frame's checksum is mostly computed while its last
    chunks are still in flight: :attr:`last_digest` is the checksum of the frame ``add``
    last returned, by the frame's own wire version (None where the first chunk was too short
    to name that version), for :func:`decode`.
    """

    def __init__(self, *, max_size: int, memory_cap: int, timeout: float) -> None:
        self.max_size, self.memory_cap, self.timeout = max_size, memory_cap, timeout
        self._parts: OrderedDict[tuple[str, bytes], _Partial] = OrderedDict()
        self._done: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self.buffered = 0
        self.counters: dict[str, int] = {}
        self.last_digest: bytes | None = None

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def expire(self, now: float) -> None:
        """Drop partial messages older than the timeout."""
        for key in [k for k, v in self._parts.items() if now - v.started > self.timeout]:
            self._drop(key)
            self._count("chunk_timeout")

    def _drop(self, key: tuple[str, bytes]) -> None:
        entry = self._parts.pop(key)
        self.buffered -= entry.bytes

    def add(self, source: str, data: bytes, now: float) -> bytes | None:
        if len(data) < _CHUNK.size:
            raise MessageError("truncated", "chunk shorter than its header")
        magic, version, mid, index, count, total = _CHUNK.unpack_from(data)
        if magic != CHUNK_MAGIC or version not in _VERSIONS:
            raise MessageError("bad_magic", "not a chunk of a wire version this code reads")
        if total > self.max_size:
            raise MessageError("oversize", f"chunked message of {total} bytes exceeds "
                               f"{self.max_size}")
        if not 0 <= index < count or count > total:
            raise MessageError("bad_chunk", f"chunk {index} of {count}")
        key = (source, mid)
        if key in self._done:
            self._count("duplicate_chunks")
            return None
        self.expire(now)
        entry = self._parts.get(key)
        if entry is None:
            entry = self._parts[key] = _Partial(count=count, total=total, started=now)
        if entry.count != count or entry.total != total:
            raise MessageError("bad_chunk", "chunks of one message disagree on its size")
        if index in entry.chunks:
            self._count("duplicate_chunks")
            return None
        piece = memoryview(data)[_CHUNK.size:]  # joined once, below
        while self.buffered + len(piece) > self.memory_cap and len(self._parts) > 1:
            oldest = next(k for k in self._parts if k != key)
            self._drop(oldest)
            self._count("chunk_memory_evictions")
        if self.buffered + len(piece) > self.memory_cap:
            self._drop(key)
            raise MessageError("oversize", "chunked message exceeds the reassembly memory cap")
        entry.chunks[index] = piece
        entry.bytes += len(piece)
        self.buffered += len(piece)
        self._hash_in_order(entry)
        if len(entry.chunks) < count:
            return None
        self._drop(key)
        self._done[key] = None
        while len(self._done) > 4096:
            self._done.popitem(last=False)
        frame = b"".join(entry.chunks[i] for i in range(count))
        if len(frame) != total:
            raise MessageError("wrong_length", f"chunks add up to {len(frame)}, expected {total}")
        self.last_digest = (entry.hash.digest() if entry.hash is not None
                            and entry.hashed == count else None)
        return frame

    @staticmethod
    def _hash_in_order(entry: _Partial) -> None:
        """Fold in the chunks that continue the checked prefix of the frame (the span
        :func:`decode` checks: all of the frame but its checksum)."""
        while not entry.unhashable and entry.hashed in entry.chunks:
            piece = entry.chunks[entry.hashed]
            if entry.hashed == 0:
                try:  # the first chunk says which check the frame carries
                    version = _version_of(piece)
                except MessageError:
                    entry.unhashable = True  # decode checks the whole frame (or refuses it)
                    return
                entry.hash, entry.span = version.check(), version.span(entry.total)
            start, check = entry.offset, entry.hash
            for lo, hi in entry.span:
                lo, hi = max(lo, start), min(hi, start + len(piece))
                if lo < hi and check is not None:
                    check.update(piece[lo - start:hi - start])
            entry.offset += len(piece)
            entry.hashed += 1
