"""Checkpoints: a full snapshot of the store's metadata, in two slots on device 0.

The slot with the highest valid generation wins; the journal written after a
checkpoint carries that generation as its epoch.  A checkpoint is written to
the slot not holding the newest one, so a torn checkpoint write leaves the
previous one intact.

Layout (little-endian; bump FORMAT_VERSION when changing it)::

    header block (4096 bytes)
    0   8s magic "KVBLKCP\\0"      40  Q run count
    8   I  format version          48  Q key count
    12  I  checksums per run       56  I region count, I 0
    16  Q  generation (= epoch)    64  Q payload bytes
    24  Q  next journal sequence   72  Q xxh64 of payload
    32  Q  next run id             4088 Q xxh64 of bytes [0, 4088)
    payload (from byte 4096)
    regions   region count x {I generation, I sealed at (s since epoch), Q seal sequence}
    runs      run count x {Q run id, I region, I generation, Q offset, I blocks, I 0}
    keys      key count x 16 bytes (runs' keys in run order)
    checksums run count x checksums per run x Q (per range, then the trailer's)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvblock.format import FORMAT_VERSION
from kvblock.format.checksum import meta_checksum

MAGIC = b"KVBLKCP\0"
HEADER_BYTES = 4096
_HEAD = struct.Struct("<8sIIQQQQQIIQQ")
_CRC_AT = HEADER_BYTES - 8

REGION_DTYPE = np.dtype([("generation", "<u4"), ("sealed_at", "<u4"), ("seal_seq", "<u8")])
RUN_DTYPE = np.dtype([("run_id", "<u8"), ("region", "<u4"), ("generation", "<u4"),
                      ("offset", "<u8"), ("nblocks", "<u4"), ("pad", "<u4")])
assert REGION_DTYPE.itemsize == 16 and RUN_DTYPE.itemsize == 32


@dataclass
class Checkpoint:
    generation: int
    journal_seq: int
    next_run_id: int
    ranges: int
    regions: np.ndarray     # REGION_DTYPE
    runs: np.ndarray        # RUN_DTYPE
    keys: np.ndarray        # (key count, 16) uint8
    checksums: np.ndarray   # (run count, ranges + 1) uint64

    def payload(self) -> bytes:
        return b"".join((self.regions.astype(REGION_DTYPE).tobytes(),
                         self.runs.astype(RUN_DTYPE).tobytes(),
                         np.ascontiguousarray(self.keys, dtype=np.uint8).tobytes(),
                         np.ascontiguousarray(self.checksums, dtype="<u8").tobytes()))

    def encode(self) -> bytes:
        payload = self.payload()
        head = bytearray(HEADER_BYTES)
        _HEAD.pack_into(head, 0, MAGIC, FORMAT_VERSION, self.ranges, self.generation,
                        self.journal_seq, self.next_run_id, len(self.runs), len(self.keys),
                        len(self.regions), 0, len(payload), meta_checksum(payload))
        struct.pack_into("<Q", head, _CRC_AT, meta_checksum(bytes(head[:_CRC_AT])))
        return bytes(head) + payload


@dataclass(frozen=True)
class CheckpointHeader:
    generation: int
    journal_seq: int
    next_run_id: int
    ranges: int
    run_count: int
    key_count: int
    region_count: int
    payload_bytes: int
    payload_checksum: int


def decode_header(data: bytes) -> CheckpointHeader | None:
    """The header of a slot, or None when the slot holds no valid checkpoint."""
    data = bytes(data[:HEADER_BYTES])
    if len(data) < HEADER_BYTES or data[:8] != MAGIC:
        return None
    if struct.unpack_from("<Q", data, _CRC_AT)[0] != meta_checksum(data[:_CRC_AT]):
        return None
    f = _HEAD.unpack_from(data, 0)
    if f[1] != FORMAT_VERSION or f[9] != 0:    # the u32 at 60 is always written 0
        return None
    h = CheckpointHeader(generation=f[3], journal_seq=f[4], next_run_id=f[5], ranges=f[2],
                         run_count=f[6], key_count=f[7], region_count=f[8],
                         payload_bytes=f[10], payload_checksum=f[11])
    expected = (h.region_count * REGION_DTYPE.itemsize + h.run_count * RUN_DTYPE.itemsize
                + h.key_count * 16 + h.run_count * h.ranges * 8)
    return h if expected == h.payload_bytes else None


def decode_payload(h: CheckpointHeader, payload: bytes | memoryview) -> Checkpoint | None:
    """The checkpoint, or None when the payload does not match its checksum."""
    payload = memoryview(payload)[:h.payload_bytes]
    if len(payload) != h.payload_bytes or meta_checksum(payload) != h.payload_checksum:
        return None
    at = 0

    def take(dtype, count, shape=None):
        nonlocal at
        arr = np.frombuffer(payload, dtype=dtype, count=count, offset=at).copy()
        at += arr.nbytes
        return arr if shape is None else arr.reshape(shape)

    regions = take(REGION_DTYPE, h.region_count)
    runs = take(RUN_DTYPE, h.run_count)
    keys = take(np.uint8, h.key_count * 16, (h.key_count, 16))
    sums = take("<u8", h.run_count * h.ranges, (h.run_count, h.ranges))
    if int(runs["nblocks"].sum()) != h.key_count:
        return None
    return Checkpoint(h.generation, h.journal_seq, h.next_run_id, h.ranges, regions, runs,
                      keys, sums)
