"""Mutated wire frames for the admission fuzz tests (test support, not a test module).

Frames are mutated where the checks are: header fields get hostile values (wrong
types, out-of-range numbers, NaN/Infinity literals, 20,000-deep nesting, ids with MQTT
wildcards), the array table gets impossible counts and dtypes, the prefix gets
random type and length fields, and bytes are flipped, cut and appended.  Every
mutation is resealed (checksum recomputed) so it reaches the checks behind it.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from edge_client import messages as m
from edge_client.codec import WIRE_VERSION, encode, reseal, split

FIXED = 20  # magic, version, type, dtype, reserved, header and payload lengths
DIGEST = {1: 32, 2: 4}  # sha256 after the fixed prefix (v1), CRC-32 ending the frame (v2)
FLEET = "f"


def base_messages(n_params: int = 6) -> list[tuple[str, m.Message]]:
    """One valid message of every type, each with the topic it belongs on."""
    w = np.linspace(-1, 1, n_params).astype(np.float32)
    h = np.array([3, 0, 2, 1], np.int64)
    common = dict(fleet=FLEET, round=1, iteration=2)
    msgs = [
        m.DeviceStats(sender="d0", station="s0", seen_counts=h, next_batch_counts=h, **common),
        m.DeviceUpdate(sender="d0", station="s0", weights=w, num_samples=6, **common),
        # Encoded steps (edge_client/pipeline.py): positions with int8 codes, and float16.
        m.DeviceUpdate(sender="d0", station="s0", weights=w[:0], num_samples=6,
                       encoding="topk:0.5-int8:2", indices=np.array([0, 2, 5], np.uint32),
                       codes=np.array([3, -127, 50], np.int8),
                       scales=np.array([0.01, 0.02], np.float32), **common),
        m.DeviceUpdate(sender="d0", station="s0", weights=w[:0], num_samples=6,
                       encoding="float16", half=w.astype(np.float16), **common),
        m.SkipNotice(sender="d0", station="s0", gap=0.25, **common),
        m.StationModel(sender="s0", weights=w, **common),
        m.Selection(sender="s0", members=("d0", "d1"), deadline=12.5, **common),
        m.StationStats(sender="s0", seen_counts=h, **common),
        m.StationUpdate(sender="s0", weights=w, num_samples=12, seen_counts=h, **common),
        m.GlobalModel(sender="cloud", weights=w, p_real=np.full(4, 0.25), **common),
        m.Presence(sender="d0", role="dev", online=True, **common),
    ]
    from edge_client.topics import topic_for
    return [(topic_for(msg), msg) for msg in msgs]


HOSTILE = [-1, 2**53, 2**64, 10**400, 1.5, -0.0, 1e308, True, False, None, "", "a/b", "+", "#",
           "x" * 300, [], {}, [1, [2]], {"a": 1}, ["ok", 3], "Infinity", 0, 7]
LITERALS = ["NaN", "Infinity", "-Infinity", "1e999", "[" * 20000 + "]" * 20000,
            "{\"a\":" * 5000 + "1" + "}" * 5000, "\"\\ud800\"", "1" + "0" * 5000]


def frame_parts(frame: bytes) -> tuple[bytes, bytes, bytes]:
    """A valid frame's fixed prefix, JSON header and payload, in either wire version."""
    version, hlen = frame[4], int.from_bytes(frame[8:12], "little")
    start = FIXED + (DIGEST[1] if version == 1 else 0)
    end = len(frame) - (DIGEST[2] if version == 2 else 0)
    return frame[:FIXED], frame[start:start + hlen], frame[start + hlen:end]


def assemble(prefix: bytes, header: bytes, payload: bytes) -> bytes:
    """A frame of ``prefix``'s version from these parts, its lengths and checksum made right."""
    fixed = prefix[:8] + struct.pack("<IQ", len(header), len(payload))
    if prefix[4] == 1:
        return reseal(fixed + bytes(DIGEST[1]) + header + payload)
    return reseal(fixed + header + payload + bytes(DIGEST[2]))


def mutate(frame: bytes, rng: np.random.Generator) -> bytes:
    """One mutated copy of a valid frame."""
    prefix, header, payload = frame_parts(frame)
    kind = rng.integers(9)
    if kind <= 2:  # a header field gets a hostile value (or a raw literal)
        doc = json.loads(header)
        target = doc["fields"] if kind < 2 else doc
        key = list(target)[rng.integers(len(target))]
        if rng.random() < 0.3:
            marker = "__LITERAL__"
            target[key] = marker
            text = json.dumps(doc).replace(f'"{marker}"', LITERALS[rng.integers(len(LITERALS))])
            return assemble(prefix, text.encode(), payload)
        choice = HOSTILE[rng.integers(len(HOSTILE))]
        if rng.random() < 0.1:
            target.pop(key)
        elif rng.random() < 0.1:
            target["extra_" + str(rng.integers(9))] = choice
        else:
            target[key] = choice
        return assemble(prefix, json.dumps(doc).encode(), payload)
    if kind == 3:  # the array table
        doc = json.loads(header)
        if doc["arrays"]:
            entry = doc["arrays"][rng.integers(len(doc["arrays"]))]
            slot = rng.integers(3)
            entry[slot] = [HOSTILE[rng.integers(len(HOSTILE))], "|O", ">f4", "<U8", "<i8",
                           "<f8", "weights", "round", 2**62, -5][rng.integers(10)]
        else:
            doc["arrays"] = [["weights", "<f4", int(rng.integers(0, 100))]]
        text = json.dumps(doc)
        if rng.random() < 0.2:
            text = text.replace(str(doc["arrays"][0][2]) + "]", "Infinity]", 1)
        return assemble(prefix, text.encode(), payload)
    if kind == 4:  # prefix fields: type, dtype, version, lengths
        data = bytearray(frame)
        pos = [4, 5, 6, 7, 8, 12, 16][rng.integers(7)]
        data[pos] = int(rng.integers(256))
        return reseal(data)
    if kind == 5:  # flipped bytes in the header or payload
        data = bytearray(frame)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(FIXED, len(data)))
            data[i] ^= int(rng.integers(1, 256))
        return reseal(data)
    if kind == 6:  # cut or grown
        if rng.random() < 0.5:
            return reseal(frame[:int(rng.integers(0, len(frame)))])
        return reseal(frame + bytes(rng.integers(0, 256, int(rng.integers(1, 64)),
                                                 dtype=np.uint8)))
    if kind == 7:  # payload length vs the array table
        return assemble(prefix, header, payload[:-4] if rng.random() < 0.5 else payload * 2)
    # random bytes, sometimes dressed as a chunk
    junk = bytes(rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8))
    return (b"SAFC" + bytes([frame[4]]) + junk) if rng.random() < 0.5 else junk


def chunked(frame: bytes, rng: np.random.Generator) -> list[bytes]:
    """The frame's chunks with one of them damaged."""
    chunks = split(frame + bytes(2048), 1100)
    i = int(rng.integers(len(chunks)))
    data = bytearray(chunks[i])
    data[int(rng.integers(len(data)))] ^= 0xFF
    chunks[i] = bytes(data)
    return chunks


def encoded(message: m.Message, wire_version: int = WIRE_VERSION) -> bytes:
    return encode(message, layout_hash="ab12", wire_version=wire_version)
