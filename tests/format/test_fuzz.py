"""Bounded property tests of the on-device decoders.

Whatever bytes a device holds, the decoders must only return normally or raise
a kvblock error (never struct.error, IndexError, numpy's ValueError...), and a
damaged journal must never replay a record that differs from what was written.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblock.errors import (KVBlockError, NotAStoreError, SuperblockConflictError,
                            UnsupportedVersionError)
from kvblock.format import FORMAT_VERSION
from kvblock.format import checkpoint as cpfmt
from kvblock.format import journal as jfmt
from kvblock.format import superblock as sbfmt
from kvblock.format.superblock import Superblock
from kvblock.layout.geometry import DTYPES, Geometry

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

U8 = st.integers(0, 0xFF)
U16 = st.integers(0, 0xFFFF)
U32 = st.integers(0, 0xFFFF_FFFF)
U64 = st.integers(0, 0xFFFF_FFFF_FFFF_FFFF)


# ------------------------------------------------------------------ helpers
@st.composite
def geometries(draw):
    groups = draw(st.sampled_from([1, 2, 4, 8]))
    return Geometry(num_layers=draw(st.integers(1, 200)),
                    num_kv_heads=groups * draw(st.integers(1, 16)),
                    head_dim=draw(st.sampled_from([64, 96, 128, 192, 256, 576])),
                    dtype=draw(st.sampled_from(sorted(DTYPES))),
                    block_tokens=draw(st.sampled_from([1, 16, 64, 256, 512])),
                    kv_parts=draw(st.sampled_from([1, 2])),
                    head_groups=groups)


@st.composite
def superblocks(draw):
    count = draw(st.integers(1, sbfmt.MAX_DEVICES))
    uuids = tuple(draw(st.lists(st.binary(min_size=16, max_size=16), min_size=count,
                                max_size=count)))
    index = draw(st.integers(0, count - 1))
    return Superblock(
        store_uuid=draw(st.binary(min_size=16, max_size=16)), device_uuid=uuids[index],
        device_index=index, device_count=count, alignment=draw(U32),
        device_bytes=draw(U64), region_size=draw(U64), region_count=draw(U32),
        data_offset=draw(U64), geometry=draw(geometries()),
        fingerprint=draw(st.binary(min_size=32, max_size=32)),
        journal_offset=draw(U64), journal_bytes=draw(U64), checkpoint_offset=draw(U64),
        checkpoint_bytes=draw(U64), flags=draw(U32), created_ns=draw(U64),
        sequence=draw(U64), device_uuids=uuids)


def mutate(data: bytes, edits) -> bytes:
    buf = bytearray(data)
    for pos, x in edits:
        if buf:
            buf[pos % len(buf)] ^= x
    return bytes(buf)


# positions biased towards the fixed-layout headers at the start of each structure
EDITS = st.lists(st.tuples(st.one_of(st.integers(0, 191), st.integers(0, 1 << 20)),
                           st.integers(1, 0xFF)), min_size=1, max_size=4)


def rechecksum_sb(data: bytes) -> bytes:
    buf = bytearray(data)
    struct.pack_into("<Q", buf, 4088, xxhash.xxh64_intdigest(bytes(buf[:4088])))
    return bytes(buf)


def decode_sb(data):
    try:
        return Superblock.decode(data, "fuzz", 0)
    except KVBlockError:
        return None


# ------------------------------------------------------------------ superblock
@FUZZ
@given(superblocks())
def test_superblock_round_trip(sb):
    data = sb.encode()
    assert len(data) == 4096
    assert Superblock.decode(data) == sb


@FUZZ
@given(st.one_of(st.binary(max_size=5000),
                 st.binary(min_size=4096, max_size=4096).map(lambda b: sbfmt.MAGIC + b[8:]),
                 st.binary(min_size=4096, max_size=4096).map(
                     lambda b: rechecksum_sb(sbfmt.MAGIC + b[8:]))))
def test_superblock_decode_arbitrary_bytes(data):
    decode_sb(data)


@FUZZ
@given(st.binary(min_size=176, max_size=176), st.sampled_from([1, 1, 1, 0, 2, 0xFFFFFFFF]),
       st.integers(0, 9), st.integers(0, 4), st.integers(0, 40), st.integers(0, 40),
       st.binary(min_size=3900, max_size=3900))
def test_superblock_decode_checksummed_random_fields(head, version, dtype, kv_parts, index,
                                                     count, rest):
    """Magic right, checksum right, every field random (small values made likely for
    the ones the decoder validates): only a Superblock or a kvblock error."""
    buf = bytearray(sbfmt.MAGIC + struct.pack("<I", version) + head + rest + bytes(8))
    assert len(buf) == 4096
    struct.pack_into("<HH", buf, 48, index, count)
    struct.pack_into("<BB", buf, 148, dtype, kv_parts)
    out = decode_sb(rechecksum_sb(bytes(buf)))
    if out is not None:
        assert 1 <= out.device_count <= sbfmt.MAX_DEVICES
        assert out.device_index < out.device_count
        assert len(out.device_uuids) == out.device_count
        assert Superblock.decode(out.encode()) == out


@FUZZ
@given(superblocks(), EDITS, st.booleans())
def test_superblock_decode_mutated(sb, edits, rechecksum):
    good = sb.encode()
    bad = mutate(good, edits)
    if rechecksum:
        bad = rechecksum_sb(bad)
    out = decode_sb(bad)
    if not rechecksum and bad != good:
        # the checksum catches every change we made
        try:
            Superblock.decode(bad)
            raise AssertionError("mutated superblock decoded")
        except NotAStoreError:
            pass
    if out is not None:
        # whatever decodes, decodes the same after a re-encode
        assert Superblock.decode(out.encode()) == out


@FUZZ
@given(st.lists(st.one_of(st.binary(max_size=4200),
                          superblocks().map(lambda s: s.encode()),
                          st.tuples(superblocks(), EDITS, st.booleans()).map(
                              lambda t: (rechecksum_sb if t[2] else bytes)(
                                  mutate(t[0].encode(), t[1])))),
                min_size=1, max_size=3))
def test_superblock_pick(copies):
    # (pick([]) is covered in test_superblock.py)
    decoded = [decode_sb(c) for c in copies[:2]]
    valid = [d for d in decoded if d is not None]
    try:
        got = sbfmt.pick(copies, "fuzz")
    except SuperblockConflictError:
        # two valid copies that cannot be one store's: of two stores, or
        # different at one sequence
        a, b = decoded
        assert a is not None and b is not None
        assert a.store_uuid != b.store_uuid or (a.sequence == b.sequence and a != b)
        return
    except KVBlockError as e:
        # none valid; or a copy of a newer format version beside a valid
        # one (a newer release's upgrade cut short): refused
        assert not valid or (isinstance(e, UnsupportedVersionError)
                             and e.version > FORMAT_VERSION
                             and e.version in [struct.unpack_from("<I", c, 8)[0]
                                               for c in copies[:2] if len(c) >= 12])
        return
    assert valid
    assert got.sequence == max(d.sequence for d in valid)
    assert got in valid


# ------------------------------------------------------------------ journal
@st.composite
def records(draw):
    kind = draw(st.sampled_from(["put", "drop", "reclaim"]))
    if kind == "put":
        n = draw(st.integers(1, 40))
        r = draw(st.integers(1, 12))
        return jfmt.PutRun(draw(U64), draw(U32), draw(U32), draw(U64),
                           draw(st.binary(min_size=16 * n, max_size=16 * n)),
                           tuple(draw(st.lists(U64, min_size=r, max_size=r))))
    if kind == "drop":
        return jfmt.DropRun(draw(U64))
    return jfmt.Reclaim(draw(U32), draw(U32))


@st.composite
def journals(draw):
    """(bytes, flat records, record byte spans, first seq, epoch)."""
    first = draw(st.integers(0, 1 << 40))
    epoch = draw(U64)
    commits = draw(st.lists(st.lists(records(), min_size=1, max_size=4), min_size=1,
                            max_size=5))
    data, flat, spans, seq = b"", [], [], first
    for recs in commits:
        start = len(data)
        for i, rec in enumerate(recs):
            enc = jfmt.encode_record(rec, seq + i, epoch)
            spans.append((start, start + len(enc)))
            start += len(enc)
        data += jfmt.encode_commit(recs, seq, epoch)
        flat += recs
        seq += len(recs)
    data += bytes(draw(st.integers(0, 2)) * 4096)
    return data, flat, spans, first, epoch


def check_scan_result(data, first, result):
    recs, end, nxt = result
    assert isinstance(recs, list)
    assert end % jfmt.BLOCK == 0
    assert 0 <= end <= -(-len(data) // jfmt.BLOCK) * jfmt.BLOCK
    assert nxt == first + len(recs)
    assert (end == 0) == (not recs)


@FUZZ
@given(st.binary(max_size=9000), U64, U64)
def test_scan_arbitrary_bytes(data, seq, epoch):
    check_scan_result(data, seq, jfmt.scan(data, seq, epoch))


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 0x7FFF), st.integers(0, 0xFFFF), U32,
                          st.binary(max_size=64)), max_size=6), U64, st.integers(0, 4))
def test_scan_plausible_headers(parts, epoch, seq):
    """Records with the right magic, epoch and sequence but arbitrary type, length and
    payload (sometimes with a correct checksum): never an exception."""
    data = b""
    for i, (kind, _, length, payload) in enumerate(parts):
        length = length % 128 if i % 2 else len(payload) + (-len(payload) % 8)
        payload = payload + bytes(-len(payload) % 8)
        head = struct.pack("<IHHIIQQQ", jfmt.MAGIC, kind % 5, 0, length, 0, epoch, seq + i, 0)
        crc = xxhash.xxh64_intdigest(head + payload)
        data += head[:32] + struct.pack("<Q", crc) + payload
    check_scan_result(data, seq, jfmt.scan(data, seq, epoch))


@FUZZ
@given(journals())
def test_scan_round_trip(j):
    data, flat, spans, first, epoch = j
    recs, end, nxt = jfmt.scan(data, first, epoch)
    assert recs == flat
    assert nxt == first + len(flat)
    assert end == -(-spans[-1][1] // jfmt.BLOCK) * jfmt.BLOCK


@FUZZ
@given(journals(), st.one_of(
    st.tuples(st.just("flip"), EDITS),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
    st.tuples(st.just("tear"), st.integers(0, 1 << 20), st.integers(1, 4096)),
))
def test_scan_mutated_journal_returns_only_original_records(j, how):
    data, flat, spans, first, epoch = j
    if how[0] == "flip":
        bad = mutate(data, how[1])
    elif how[0] == "truncate":
        bad = data[:how[1] % (len(data) + 1)]
    else:  # a torn write: a span zeroed
        at = how[1] % len(data)
        bad = data[:at] + bytes(min(how[2], len(data) - at)) + data[at + how[2]:]
    assert len(bad) <= len(data)
    diff = next((i for i in range(len(bad)) if bad[i] != data[i]), len(bad))
    result = jfmt.scan(bad, first, epoch)
    check_scan_result(bad, first, result)
    recs = result[0]
    # every returned record is the one written at that position...
    assert recs == flat[:len(recs)]
    # ...and every record lying wholly before the first damaged byte is returned
    intact = sum(1 for (_, stop) in spans if stop <= diff)
    assert len(recs) >= intact


@FUZZ
@given(journals(), U64)
def test_scan_other_epoch_replays_nothing(j, other):
    data, flat, spans, first, epoch = j
    if other == epoch:
        other ^= 1
    assert jfmt.scan(data, first, other) == ([], 0, first)


# ------------------------------------------------------------------ checkpoint
def rechecksum_cp_header(buf: bytearray) -> bytes:
    struct.pack_into("<Q", buf, 4088, xxhash.xxh64_intdigest(bytes(buf[:4088])))
    return bytes(buf)


@st.composite
def checkpoints(draw):
    ranges = draw(st.integers(0, 8))
    nregions = draw(st.integers(0, 8))
    nblocks = draw(st.lists(st.integers(0, 6), max_size=6))
    regions = np.zeros(nregions, dtype=cpfmt.REGION_DTYPE)
    regions["generation"] = draw(st.lists(U32, min_size=nregions, max_size=nregions))
    regions["seal_seq"] = draw(st.lists(U64, min_size=nregions, max_size=nregions))
    runs = np.zeros(len(nblocks), dtype=cpfmt.RUN_DTYPE)
    for i, n in enumerate(nblocks):
        runs[i] = (draw(U64), draw(U32), draw(U32), draw(U64), n, 0)
    total = sum(nblocks)
    keys = np.frombuffer(draw(st.binary(min_size=16 * total, max_size=16 * total)),
                         dtype=np.uint8).reshape(total, 16)
    sums = np.array(draw(st.lists(U64, min_size=len(nblocks) * ranges,
                                  max_size=len(nblocks) * ranges)),
                    dtype=np.uint64).reshape(len(nblocks), ranges)
    return cpfmt.Checkpoint(draw(U64), draw(U64), draw(U64), ranges, regions, runs, keys, sums)


def decode_cp(data: bytes):
    h = cpfmt.decode_header(data[:cpfmt.HEADER_BYTES])
    if h is None:
        return None, None
    return h, cpfmt.decode_payload(h, data[cpfmt.HEADER_BYTES:])


@FUZZ
@given(checkpoints())
def test_checkpoint_round_trip(cp):
    h, back = decode_cp(cp.encode())
    assert back is not None
    np.testing.assert_array_equal(back.runs, cp.runs)
    np.testing.assert_array_equal(back.regions, cp.regions)
    np.testing.assert_array_equal(back.keys, cp.keys)
    np.testing.assert_array_equal(back.checksums, cp.checksums)
    assert (back.generation, back.journal_seq, back.next_run_id, back.ranges) == \
        (cp.generation, cp.journal_seq, cp.next_run_id, cp.ranges)


@FUZZ
@given(st.one_of(st.binary(max_size=6000),
                 st.binary(min_size=4096, max_size=5000).map(
                     lambda b: rechecksum_cp_header(bytearray(cpfmt.MAGIC + b[8:4096]))
                     + b[4096:])))
def test_checkpoint_decode_arbitrary_bytes(data):
    h, _ = decode_cp(data)
    if h is not None:
        assert h.payload_bytes == (h.region_count * 16 + h.run_count * 32
                                   + h.key_count * 16 + h.run_count * h.ranges * 8)


@FUZZ
@given(checkpoints(), EDITS, st.sampled_from(["none", "header", "both"]))
def test_checkpoint_decode_mutated(cp, edits, rechecksum):
    good = cp.encode()
    bad = bytearray(mutate(good, edits))
    if rechecksum == "both":
        payload = bytes(bad[cpfmt.HEADER_BYTES:])
        struct.pack_into("<Q", bad, 72, xxhash.xxh64_intdigest(payload))
    if rechecksum in ("header", "both"):
        bad = bytearray(rechecksum_cp_header(bad))
    h, back = decode_cp(bytes(bad))
    if rechecksum == "none" and bytes(bad) != good:
        assert back is None  # one of the two checksums catches every change
    if back is not None:
        assert back.keys.shape == (h.key_count, 16)
        assert back.checksums.shape == (h.run_count, h.ranges)
        assert int(back.runs["nblocks"].sum()) == h.key_count


@FUZZ
@given(U32, st.integers(0, 6), st.integers(0, 6), st.integers(0, 6), st.data())
def test_checkpoint_consistent_header_arbitrary_payload(ranges, runs, keys, regions, data):
    """A header that passes every check, over payload bytes of the right size and
    checksum but arbitrary content: decode_payload returns a Checkpoint or None."""
    ranges %= 9
    size = regions * 16 + runs * 32 + keys * 16 + runs * ranges * 8
    payload = data.draw(st.binary(min_size=size, max_size=size))
    head = bytearray(cpfmt.HEADER_BYTES)
    struct.pack_into("<8sIIQQQQQIIQQ", head, 0, cpfmt.MAGIC, FORMAT_VERSION, ranges, 1, 1, 1,
                     runs, keys,
                     regions, 0, size, xxhash.xxh64_intdigest(payload))
    h = cpfmt.decode_header(rechecksum_cp_header(head))
    assert h is not None
    back = cpfmt.decode_payload(h, payload)
    if back is not None:
        assert int(back.runs["nblocks"].sum()) == keys
