"""Journal records: pinned byte layout, commits, and scan() replay rules."""

from __future__ import annotations

import struct

import pytest
import xxhash

from kvblock.format import journal as j
from kvblock.format.journal import (BLOCK, DROP_RUN, MAGIC, PUT_RUN, RECLAIM, DropRun, PutRun,
                                    Reclaim, encode_commit, encode_record, scan)

EPOCH = 0xA1B2_C3D4_E5F6_0718
KEYS3 = bytes(range(48))  # three 16-byte keys
PUT = PutRun(run_id=0x1122334455, region=7, generation=3, offset=0x20_0000,
             keys=KEYS3, checksums=(1, 0xFFFF_FFFF_FFFF_FFFF, 0x0123_4567_89AB_CDEF))
DROP = DropRun(run_id=0x1122334455)
RECL = Reclaim(region=7, generation=4)

# xxh64 hex digests of encode_record(rec, seq=42, epoch=EPOCH).
# If these change, bump FORMAT_VERSION (tests/format/test_format_version.py enforces it).
GOLDEN = {
    "put": "84bbfed7558e88af",
    "drop": "c95dd783707597fa",
    "reclaim": "91e7fcafb7a72147",
}


def header(b: bytes, at: int = 0):
    return struct.unpack_from("<IHHIIQQQ", b, at)


def crc_of(rec: bytes) -> int:
    return xxhash.xxh64_intdigest(rec[:32] + bytes(8) + rec[40:])


def put(run_id, nblocks=2, ranges=3, region=1, generation=0, offset=0):
    keys = b"".join(struct.pack("<QQ", run_id, i) for i in range(nblocks))
    return PutRun(run_id, region, generation, offset, keys,
                  tuple(run_id * 1000 + r for r in range(ranges)))


# ------------------------------------------------------------------ golden layout
def test_golden_put_run():
    b = encode_record(PUT, 42, EPOCH)
    payload_len = 32 + 48 + 24
    assert len(b) == 40 + payload_len
    assert b[0:4] == b"KVBJ"
    assert struct.unpack_from("<I", b, 0)[0] == MAGIC == 0x4A42564B
    assert struct.unpack_from("<H", b, 4)[0] == PUT_RUN == 1
    assert b[6:8] == b"\0\0"
    assert struct.unpack_from("<I", b, 8)[0] == payload_len
    assert b[12:16] == bytes(4)
    assert struct.unpack_from("<Q", b, 16)[0] == EPOCH
    assert struct.unpack_from("<Q", b, 24)[0] == 42
    assert struct.unpack_from("<Q", b, 32)[0] == crc_of(b)
    # payload: Q run_id, I region, I generation, Q offset, I blocks, I ranges, keys, sums
    assert struct.unpack_from("<QIIQII", b, 40) == (0x1122334455, 7, 3, 0x20_0000, 3, 3)
    assert b[72:120] == KEYS3
    assert struct.unpack_from("<3Q", b, 120) == PUT.checksums
    assert xxhash.xxh64_hexdigest(b) == GOLDEN["put"]


def test_golden_drop_run():
    b = encode_record(DROP, 42, EPOCH)
    assert len(b) == 48
    assert header(b) == (MAGIC, DROP_RUN, 0, 8, 0, EPOCH, 42, crc_of(b))
    assert DROP_RUN == 2
    assert struct.unpack_from("<Q", b, 40)[0] == 0x1122334455
    assert xxhash.xxh64_hexdigest(b) == GOLDEN["drop"]


def test_golden_reclaim():
    b = encode_record(RECL, 42, EPOCH)
    assert len(b) == 48
    assert header(b) == (MAGIC, RECLAIM, 0, 8, 0, EPOCH, 42, crc_of(b))
    assert RECLAIM == 3
    assert struct.unpack_from("<II", b, 40) == (7, 4)
    assert xxhash.xxh64_hexdigest(b) == GOLDEN["reclaim"]


def test_records_are_8_byte_aligned():
    for n in range(1, 5):
        for r in range(1, 4):
            b = encode_record(put(9, nblocks=n, ranges=r), 1, 1)
            assert len(b) % 8 == 0
            assert struct.unpack_from("<I", b, 8)[0] == len(b) - 40


def test_record_bytes_is_the_encoded_length():
    """What the commit leader sizes its journal writes by (store._journal_chunks)."""
    for rec in [put(9, nblocks=n, ranges=r) for n in range(1, 5) for r in range(1, 4)] + \
            [PUT, DROP, RECL]:
        assert j.record_bytes(rec) == len(encode_record(rec, 1, EPOCH))


def test_encode_rejects_non_records():
    with pytest.raises(TypeError):
        encode_record(object(), 1, 1)


# ------------------------------------------------------------------ commits
def test_encode_commit_pads_to_block():
    c = encode_commit([PUT, DROP, RECL], 10, EPOCH)
    assert len(c) == BLOCK == 4096
    used = 144 + 48 + 48
    assert c[:used] == (encode_record(PUT, 10, EPOCH) + encode_record(DROP, 11, EPOCH)
                        + encode_record(RECL, 12, EPOCH))
    assert c[used:] == bytes(4096 - used)


def test_encode_commit_spanning_blocks():
    big = put(5, nblocks=300, ranges=4)  # 40 + 32 + 4800 + 32 bytes
    c = encode_commit([big], 1, EPOCH)
    assert len(c) == 8192
    recs, end, nxt = scan(c, 1, EPOCH)
    assert recs == [big] and end == 8192 and nxt == 2


def test_encode_commit_exact_block_needs_no_padding():
    # a DropRun is 48 bytes; a PutRun with n keys and r sums is 72 + 16n + 8r bytes.
    # 4096 = 72 + 16*n + 8*r  ->  n = 250, r = 3
    rec = put(1, nblocks=250, ranges=3)
    c = encode_commit([rec], 1, EPOCH)
    assert len(c) == 4096
    assert c == encode_record(rec, 1, EPOCH)


# ------------------------------------------------------------------ scan
def journal_of(commits, first_seq=1, epoch=EPOCH, tail=8192):
    """Back-to-back commits, followed by `tail` zero bytes; returns (data, commit ends)."""
    out, ends, seq = b"", [], first_seq
    for recs in commits:
        out += encode_commit(recs, seq, epoch)
        seq += len(recs)
        ends.append(len(out))
    return out + bytes(tail), ends


COMMITS = [
    [put(1), put(2)],
    [DropRun(1), Reclaim(1, 1)],
    [put(3, nblocks=300, ranges=4)],     # spans two blocks
    [put(4), DropRun(2), put(5)],
]


def test_scan_round_trip_back_to_back():
    data, ends = journal_of(COMMITS, first_seq=100)
    recs, end, nxt = scan(data, 100, EPOCH)
    flat = [r for c in COMMITS for r in c]
    assert recs == flat
    assert end == ends[-1]
    assert nxt == 100 + len(flat)
    # the same through a memoryview and a bytearray
    assert scan(memoryview(data), 100, EPOCH) == (recs, end, nxt)
    assert scan(bytearray(data), 100, EPOCH) == (recs, end, nxt)


def test_scan_empty_and_zero_journal():
    assert scan(b"", 5, EPOCH) == ([], 0, 5)
    assert scan(bytes(1 << 16), 5, EPOCH) == ([], 0, 5)


def test_scan_without_trailing_zeros():
    data, ends = journal_of(COMMITS, tail=0)
    recs, end, _ = scan(data, 1, EPOCH)
    assert len(recs) == 8 and end == ends[-1] == len(data)


@pytest.mark.parametrize("where", ["magic", "seq", "epoch", "crc", "payload", "length"])
def test_scan_stops_at_corrupt_first_record_of_second_commit(where):
    data, ends = journal_of(COMMITS)
    at = ends[0]  # the second commit's first record starts here
    field = {"magic": 0, "seq": 24, "epoch": 16, "crc": 32, "payload": 44, "length": 8}[where]
    bad = bytearray(data)
    bad[at + field] ^= 0x10
    recs, end, nxt = scan(bytes(bad), 1, EPOCH)
    assert recs == COMMITS[0]
    assert end == ends[0] == 4096
    assert nxt == 1 + len(COMMITS[0])


@pytest.mark.parametrize("cut", [1, 8, 24, 39, 40])
def test_scan_stops_at_torn_second_commit(cut):
    data, ends = journal_of(COMMITS)
    # the second commit was torn: only its first `cut` bytes reached the medium
    torn = data[:ends[0] + cut] + bytes(len(data) - ends[0] - cut)
    recs, end, nxt = scan(torn, 1, EPOCH)
    assert recs == COMMITS[0]
    assert end == ends[0]
    assert nxt == 3


def test_scan_truncated_inside_second_commit():
    data, ends = journal_of(COMMITS)
    for n in (ends[0] + 20, ends[0] + 47):
        recs, end, _ = scan(data[:n], 1, EPOCH)
        assert recs == COMMITS[0] and end == ends[0]


def test_scan_torn_later_record_keeps_earlier_records_of_that_commit():
    # records are replayed one by one: a commit torn after its first record still
    # yields that record (each record is self-contained), but nothing after the tear
    data, ends = journal_of(COMMITS)
    at = ends[0] + 48  # second record of the second commit
    bad = bytearray(data)
    bad[at + 40] ^= 1
    recs, end, nxt = scan(bytes(bad), 1, EPOCH)
    assert recs == COMMITS[0] + COMMITS[1][:1]
    assert end == ends[1] == 8192
    assert nxt == 4


def test_scan_torn_second_block_of_multi_block_commit():
    data, ends = journal_of(COMMITS)
    # COMMITS[2] spans [ends[1], ends[2]) = two blocks; lose its second block
    torn = data[:ends[1] + 4096] + bytes(len(data) - ends[1] - 4096)
    recs, end, _ = scan(torn, 1, EPOCH)
    assert recs == COMMITS[0] + COMMITS[1]
    assert end == ends[1]


def test_scan_ignores_stale_epoch_even_with_matching_sequence():
    old_epoch = EPOCH ^ 0xFFFF
    data, ends = journal_of(COMMITS[:1])
    # a stale commit from an earlier epoch, with exactly the sequence we expect next
    stale = encode_commit([put(99), DropRun(98)], 3, old_epoch)
    journal = data[:ends[0]] + stale + bytes(4096)
    recs, end, nxt = scan(journal, 1, EPOCH)
    assert recs == COMMITS[0]
    assert end == ends[0]
    assert nxt == 3
    # the very first record in the wrong epoch: nothing at all
    assert scan(stale, 3, EPOCH) == ([], 0, 3)
    # while in its own epoch it would replay
    assert scan(stale, 3, old_epoch)[0] == [put(99), DropRun(98)]


def test_scan_stops_at_unexpected_sequence():
    data, ends = journal_of(COMMITS[:1])            # seqs 1, 2
    skip = encode_commit([DropRun(7)], 4, EPOCH)     # 3 expected, 4 found
    recs, end, nxt = scan(data[:ends[0]] + skip, 1, EPOCH)
    assert recs == COMMITS[0] and end == ends[0] and nxt == 3
    back = encode_commit([DropRun(7)], 2, EPOCH)     # an older (stale) sequence
    recs, end, nxt = scan(data[:ends[0]] + back, 1, EPOCH)
    assert recs == COMMITS[0] and end == ends[0] and nxt == 3
    # starting from the wrong expected sequence: nothing
    assert scan(data, 2, EPOCH) == ([], 0, 2)
    assert scan(data, 0, EPOCH) == ([], 0, 0)


def test_scan_skips_zero_padding_inside_a_block():
    data, ends = journal_of(COMMITS[:2])
    # padding after commit 1 occupies [used, 4096): all zero, skipped
    used = 2 * len(encode_record(put(1), 1, EPOCH))
    assert data[used:ends[0]] == bytes(ends[0] - used)
    recs, _, _ = scan(data, 1, EPOCH)
    assert recs == COMMITS[0] + COMMITS[1]


def test_scan_padding_that_is_not_zero_ends_the_log():
    data, ends = journal_of(COMMITS[:2])
    bad = bytearray(data)
    bad[ends[0] - 100] = 0x01  # garbage in commit 1's padding
    recs, end, _ = scan(bytes(bad), 1, EPOCH)
    assert recs == COMMITS[0] and end == ends[0]


def test_scan_block_starting_without_record_ends_the_log():
    data, ends = journal_of(COMMITS[:1])
    # an empty block, then a perfectly valid next commit: the log ended at the gap
    gap = data[:ends[0]] + bytes(4096) + encode_commit([DropRun(1)], 3, EPOCH)
    recs, end, nxt = scan(gap, 1, EPOCH)
    assert recs == COMMITS[0] and end == ends[0] and nxt == 3


def test_scan_rejects_corrupt_payload():
    rec = encode_record(put(1, nblocks=2, ranges=2), 1, EPOCH)
    for at in range(40, len(rec)):
        bad = bytearray(rec)
        bad[at] ^= 0x04
        assert scan(bytes(bad) + bytes(4096), 1, EPOCH) == ([], 0, 1), at


def test_scan_rejects_every_covered_header_byte_corruption():
    rec = encode_record(DropRun(3), 1, EPOCH)
    for at in [*range(0, 6), *range(8, 12), *range(16, 40)]:
        bad = bytearray(rec)
        bad[at] ^= 0x20
        assert scan(bytes(bad), 1, EPOCH)[0] == [], at


def test_scan_rejects_corruption_of_reserved_header_bytes():
    rec = encode_record(DropRun(3), 1, EPOCH)
    accepted = []
    for at in [6, 7, 12, 13, 14, 15]:
        bad = bytearray(rec)
        bad[at] ^= 0x20
        if scan(bytes(bad), 1, EPOCH)[0]:
            accepted.append(at)
    assert accepted == []


def _rechecksummed(kind: int, payload: bytes, seq=1, epoch=EPOCH) -> bytes:
    head = struct.pack("<IHHIIQQQ", MAGIC, kind, 0, len(payload), 0, epoch, seq, 0)
    crc = xxhash.xxh64_intdigest(head + payload)
    return struct.pack("<IHHIIQQQ", MAGIC, kind, 0, len(payload), 0, epoch, seq, crc) + payload


@pytest.mark.parametrize("kind,payload", [
    (9, bytes(8)),                                                # unknown type
    (PUT_RUN, bytes(8)),                                          # too short for a PutRun
    (PUT_RUN, struct.pack("<QIIQII", 1, 0, 0, 0, 0, 1) + bytes(8)),   # zero blocks
    (PUT_RUN, struct.pack("<QIIQII", 1, 0, 0, 0, 1, 0) + bytes(16)),  # zero ranges
    (PUT_RUN, struct.pack("<QIIQII", 1, 0, 0, 0, 5, 1) + bytes(16)),  # keys past the end
    (PUT_RUN, struct.pack("<QIIQII", 1, 0, 0, 0, 1, 9) + bytes(24)),  # sums past the end
    (PUT_RUN, struct.pack("<QIIQII", 1, 0, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF)),
    (DROP_RUN, b""),                                              # empty payload
    (RECLAIM, b""),
])
def test_scan_rejects_well_checksummed_malformed_records(kind, payload):
    data = encode_commit([DropRun(1)], 1, EPOCH)
    rec = _rechecksummed(kind, payload, seq=2)
    journal = data[:48] + rec + bytes(4096)
    recs, end, nxt = scan(journal, 1, EPOCH)
    assert recs == [DropRun(1)] and end == 4096 and nxt == 2


def test_scan_rejects_length_not_multiple_of_8_and_past_end():
    good = _rechecksummed(DROP_RUN, struct.pack("<Q", 5) + b"\0\0\0\0")  # 12-byte payload
    assert scan(good + bytes(4096), 1, EPOCH) == ([], 0, 1)
    rec = encode_record(DropRun(5), 1, EPOCH)
    assert scan(rec[:47], 1, EPOCH) == ([], 0, 1)
    assert scan(rec, 1, EPOCH) == ([DropRun(5)], 4096, 2)


def test_scan_end_is_rounded_to_block():
    rec = encode_record(DropRun(5), 1, EPOCH)
    # the journal area is only 48 bytes long: end still rounds up to a block
    assert scan(rec, 1, EPOCH) == ([DropRun(5)], 4096, 2)
    data, ends = journal_of([[DropRun(5)], [DropRun(6)]])
    assert scan(data, 1, EPOCH)[1] == 8192 == ends[1]


def test_record_at_end_of_block_followed_by_next_commit():
    # commit 1 ends 8 bytes before the block end: the 40-byte header read at that
    # position straddles into the next block, and must still be treated as padding
    # 4096 - 8 = 72 + 16n + 8r  ->  n = 250, r = 2
    rec = put(1, nblocks=250, ranges=2)
    first = encode_commit([rec], 1, EPOCH)
    assert len(first) == 4096 and first[-8:] == bytes(8)
    data = first + encode_commit([DropRun(1)], 2, EPOCH)
    assert scan(data, 1, EPOCH) == ([rec, DropRun(1)], 8192, 3)
    assert j.KEY_BYTES == 16


def test_epoch_of_a_checkpoint_generation_is_pinned():
    """Records carry the epoch of the checkpoint they follow: a store
    written by an earlier version must still replay, so the value is fixed
    (xxh64 of the store uuid and the generation, little-endian)."""
    store_uuid = bytes(range(16))
    assert j.epoch(store_uuid, 7) == 0xFB6BE01013F04893
    assert j.epoch(store_uuid, 7) == xxhash.xxh64_intdigest(store_uuid + (7).to_bytes(8, "little"))
    assert j.epoch(store_uuid, 8) != j.epoch(store_uuid, 7)
    assert j.epoch(bytes(16), 7) != j.epoch(store_uuid, 7)


def test_damaged_at_tells_a_damaged_record_from_a_torn_one():
    """Replay stops alike at a torn record and at a damaged one; only a
    record that a crash cannot have torn (it lies in one sector, which a
    device writes whole) is proof of damage."""
    data, ends = journal_of(COMMITS)
    at = ends[0] + 48                  # the second record of the second commit
    bad = bytearray(data)
    bad[at + 40] ^= 1                  # its payload rots
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (nxt, stop) == (4, at) and j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    bad[at + 40] ^= 1
    bad[at + 3] ^= 1                   # its magic rots: garbage after an intact record
    assert j.damaged_at(bytes(bad), at, 4, EPOCH)
    # torn: the commit's first sector written, the rest not (zeros, or stale bytes)
    for cut in (0, 512):
        torn = data[:ends[1] + cut] + bytes(len(data) - ends[1] - cut)
        recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
        assert recs == COMMITS[0] + COMMITS[1] and not j.damaged_at(torn, stop, nxt, EPOCH)
    recs, end, nxt, stop = j.scan_to(data, 1, EPOCH)          # the journal's end
    assert not j.damaged_at(data, stop, nxt, EPOCH)


def test_golden_put_run_pins_block_and_checksum_counts_apart():
    """The golden PUT has 3 keys and 3 checksums, so neither its digest nor
    its field checks told the u32 block count at 24 of the payload from the
    u32 checksum count at 28: an encoder and decoder writing them the other
    way round passed every format test, though the records on the device
    change.  A PUT with 2 blocks and 5 checksums, spelled out byte by byte
    (and decoded from those bytes)."""
    keys = bytes(range(0x40, 0x60))
    rec = PutRun(run_id=0x0102030405060708, region=0x0A0B0C0D, generation=0x11121314,
                 offset=0x0000_0012_3456_7000, keys=keys, checksums=(10, 11, 12, 13, 14))
    b = encode_record(rec, 42, EPOCH)
    payload = b[40:]
    assert payload[0:8] == bytes([8, 7, 6, 5, 4, 3, 2, 1])            # run id
    assert payload[8:12] == bytes([0x0D, 0x0C, 0x0B, 0x0A])           # region
    assert payload[12:16] == bytes([0x14, 0x13, 0x12, 0x11])          # region generation
    assert payload[16:24] == bytes([0, 0x70, 0x56, 0x34, 0x12, 0, 0, 0])  # offset (2**32+)
    assert payload[24:28] == bytes([2, 0, 0, 0])                      # blocks
    assert payload[28:32] == bytes([5, 0, 0, 0])                      # checksums
    assert payload[32:64] == keys
    assert payload[64:104] == b"".join(bytes([v]) + bytes(7) for v in range(10, 15))
    assert len(payload) == 104
    assert scan(b, 42, EPOCH)[0] == [rec]


@pytest.mark.parametrize("kind,payload", [
    (PUT_RUN, struct.pack("<QIIQII", 1, 0, 0, 0, 1, 1) + bytes(16) + struct.pack("<Q", 5)
     + struct.pack("<Q", 6)),                                     # a 2nd checksum past the count
    (PUT_RUN, struct.pack("<QIIQII", 1, 0, 0, 0, 1, 1) + bytes(16) + struct.pack("<Q", 5)
     + bytes(16)),                                                # zeros past the checksums
    (DROP_RUN, struct.pack("<QQ", 5, 6)),
    (RECLAIM, struct.pack("<IIQ", 7, 4, 9)),
], ids=["put-extra-checksum", "put-zeros", "drop", "reclaim"])
def test_scan_rejects_records_longer_than_their_payload(kind, payload):
    """Every record this format writes is exactly its payload (PUT: 32
    bytes, keys and checksums; DROP and RECLAIM: 8 bytes), none needing
    padding.  A checksummed record with more bytes than that is none of
    them, but replayed as the record its first bytes spell: a PUT with one
    checksum and another one after it replayed as a run of one checksum."""
    data = encode_commit([DropRun(1)], 1, EPOCH)
    rec = _rechecksummed(kind, payload, seq=2)
    journal = data[:48] + rec + bytes(4096)
    recs, end, nxt = scan(journal, 1, EPOCH)
    assert recs == [DropRun(1)] and end == 4096 and nxt == 2


@pytest.mark.parametrize("keys,sums", [(bytes(20), (1,)), (b"", (1,)), (bytes(16), ())],
                         ids=["keys-not-whole", "no-keys", "no-checksums"])
def test_encode_refuses_a_put_that_does_not_replay(keys, sums):
    """A PutRun whose keys are not whole 16-byte keys, or that has no key or
    no checksum, was encoded as a record replay refuses (its counts do not
    match its length, or are 0), ending the log there: every later record
    of the journal was lost at the next open.  (Before the decoder required
    exact lengths, 20 key bytes came back as one key and a checksum made of
    the 4 extra bytes and the padding.)  The encoder refuses it."""
    rec = PutRun(1, 0, 0, 0, keys, sums)
    with pytest.raises(ValueError, match="PutRun"):
        encode_record(rec, 1, EPOCH)
    with pytest.raises(ValueError, match="PutRun"):
        encode_commit([DropRun(2), rec], 1, EPOCH)


@pytest.mark.parametrize("at", [0, 3, 4, 12, 24, 31], ids=["magic", "magic3", "type", "res32",
                                                         "seq", "seq-high"])
def test_a_commits_first_record_that_rots_in_its_header_is_damage_not_a_tear(at):
    """A commit's first record starts on a journal block, so on a sector:
    a byte of its header other than the epoch rotting (its magic, type,
    number...) left the record taken for a tear (a sector that starts
    without this record may be one never written), though the header
    still names this epoch, a 64-bit hash no crash and no rot forges: the
    sector was written as this record, whole."""
    data, ends = journal_of(COMMITS)
    bad = bytearray(data)
    bad[ends[0] + at] ^= 0x10            # the second commit's first record
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == (COMMITS[0], 3, ends[0])
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # its epoch rotted too: no longer tells (an older epoch's record there
    # may be what a torn write left; its epoch alone rotting, the checksum
    # tells: test_a_record_whose_epoch_field_rots_...); a zeroed (never
    # written) sector neither
    bad[ends[0] + 16] ^= 0x10
    assert not j.damaged_at(bytes(bad), ends[0], 3, EPOCH)
    torn = data[:ends[0]] + bytes(512) + data[ends[0] + 512:]
    assert not j.damaged_at(torn, ends[0], 3, EPOCH)


@pytest.mark.parametrize("at", [0, 4, 8, 24], ids=["magic", "type", "length", "seq"])
def test_a_header_of_this_epoch_that_rots_is_damage_where_its_record_crosses_a_sector(at):
    """A header naming this epoch lies in a sector written as this record,
    whole: a byte of it other than the epoch that is wrong (its magic,
    type, length, number) is damage even where the record goes on into
    the next sector.  Only a well-formed header's record crossing a sector
    may be torn (the next sector left old by a crash).  A RECLAIM whose
    header ends a sector after an intact PUT (a record of 472 bytes), its
    magic rotted, was damage (garbage after an intact record in its
    sector) until the epoch alone was trusted; then it crossed the sector
    and was taken for a tear, so the region's old runs stayed indexed."""
    first = put(1, nblocks=24, ranges=2)
    assert j.record_bytes(first) == 472
    data, ends = journal_of([[first, Reclaim(1, 1)]])
    bad = bytearray(data)
    bad[472 + at] ^= 0x10
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, 472)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # a commit's first record (a PUT over two sectors) rotting so too (a
    # PUT's length rotting to one a PUT can have: its counts tell)
    long = put(2, nblocks=40, ranges=2)
    data, ends = journal_of([[long]])
    bad = bytearray(data)
    bad[at] ^= 0x10
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([], 1, 0)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # its header whole, the second sector left old by a crash: a tear
    torn = data[:512] + bytes(512) + data[1024:]
    recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
    assert (recs, stop) == ([], 0) and not j.damaged_at(torn, stop, nxt, EPOCH)
    data, ends = journal_of([[first, Reclaim(1, 1)]])
    torn = data[:512] + bytes(512) + data[1024:]
    recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
    assert (recs, stop) == ([first], 472) and not j.damaged_at(torn, stop, nxt, EPOCH)


_FIELDS = {"magic": 0, "type": 4, "length": 8, "epoch": 16, "seq": 24}
_ENDS = {480: (24, 3), 488: (24, 4), 496: (25, 3), 504: (25, 4)}   # first record: (blocks, ranges)


def _second_sector_old_is_a_tear(data: bytes, end: int, first, stop: int) -> None:
    """The journal ``data`` with its second sector left old (zeros, or an
    earlier write's bytes) and nothing past ``end`` (its last commit's end)
    reads as a tear after ``first``, stopping at ``stop``: no damage."""
    for old in (bytes(512), b"\xa5" * 512):
        torn = data[:512] + old + data[1024:end] + bytes(len(data) - end)
        recs, _, nxt, at = j.scan_to(torn, 1, EPOCH)
        assert (recs, at) == ([first], stop) and not j.damaged_at(torn, at, nxt, EPOCH)


@pytest.mark.parametrize("pos, field", [(pos, f) for pos in _ENDS for f, at in _FIELDS.items()
                                        if at < 512 - pos])
def test_a_header_crossing_a_sector_that_rots_in_its_first_part_is_damage(pos, field):
    """A record ending inside a sector after an intact one: that sector was
    written whole, as the commit's next record (or as zero padding where the
    commit ended), so its part of the next header is that header's.  Bytes
    there that no header of this epoch numbered next can hold are damage,
    even where the header crosses into the next sector (which a crash may
    have left old): they were taken for a tear, and the journal cut there."""
    blocks, ranges = _ENDS[pos]
    first, at = put(1, nblocks=blocks, ranges=ranges), _FIELDS[field]
    assert j.record_bytes(first) == pos and pos + j.HEADER_BYTES > 512
    data, ends = journal_of([[first, Reclaim(1, 1)], [put(2)]])
    bad = bytearray(data)
    bad[pos + at] ^= 0x10
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, pos)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # the header whole in its first sector, the next one left old: a tear
    # (of the last commit: a later one shows this one flushed whole)
    _second_sector_old_is_a_tear(data, ends[0], first, pos)
    # the commit ended there (zero padding), the next sector of its block old
    data, ends = journal_of([[first]])
    torn = data[:512] + b"\xa5" * 512 + data[1024:]
    recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
    assert (recs, stop) == ([first], pos) and not j.damaged_at(torn, stop, nxt, EPOCH)


@pytest.mark.parametrize("pos, nblocks, ranges, bit",
                         [(0, 2, 3, 0x10), (0, 2, 3, 0x01), (472, 2, 3, 0x10),
                          (0, 40, 2, 0x10), (464, 20, 2, 0x10)],
                         ids=["in-sector", "in-sector-high", "header-ends-sector",
                              "crossing", "counts-in-next-sector"])
def test_a_put_whose_length_rots_to_another_put_length_is_damage(pos, nblocks, ranges, bit):
    """A PUT record's length field rotting to another length a PUT can have
    (a multiple of 8, room for a key and a checksum) that runs past its
    sector left a well-formed header whose record seemed to cross into a
    sector a crash may have left old: taken for a tear, the committed run
    was lost silently (the last record) or with a gap fsck blamed on a
    crash.  The record's true length follows from its payload's counts:
    they disagree with a header written whole in the same sector, or the
    record's checksum passes with the length they give."""
    rec = put(2, nblocks=nblocks, ranges=ranges)
    if pos:
        first = put(1, nblocks=24, ranges={472: 2, 464: 1}[pos])
        assert j.record_bytes(first) == pos
        recs = [first, rec, DropRun(1)]
    else:
        recs = [rec, DropRun(1)]
    data, ends = journal_of([recs, [put(3)]])
    bad = bytearray(data)
    bad[pos + (9 if bit == 0x10 else 10)] ^= bit      # the length, 4 KiB or 64 KiB more
    assert j.header_at(bytes(bad), pos)[2] > j.record_bytes(rec)
    got, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (got, stop) == (recs[:1] if pos else [], pos)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # the same PUT torn: its header's sector written, the next left old
    for old in (bytes(512), b"\xa5" * 512):
        torn = data[:512] + old + data[1024:]
        got, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
        if stop == pos:
            assert not j.damaged_at(torn, stop, nxt, EPOCH)


@pytest.mark.parametrize("rec", [Reclaim(1, 1), DropRun(1)], ids=["reclaim", "drop"])
def test_a_drop_or_reclaim_whose_type_rots_into_the_other_is_damage(rec):
    """A DROP's type and a RECLAIM's differ in one bit and both have 8
    payload bytes: one rotting into the other leaves a well-formed header.
    Where that header ends a sector (after a 472-byte PUT), its payload
    lies in the next sector, so the record was taken for one a crash tore
    there: a rotted last RECLAIM left the region's old runs indexed.  The
    record's checksum passing with the other type proves it whole."""
    first = put(1, nblocks=24, ranges=2)
    data, ends = journal_of([[first, rec]])
    bad = bytearray(data)
    bad[472 + 4] ^= 1                        # RECLAIM (3) <-> DROP (2)
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, 472)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    for old in (bytes(512), b"\xa5" * 512):   # torn: the next sector left old
        torn = data[:512] + old + data[1024:]
        recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
        assert (recs, stop) == ([first], 472) and not j.damaged_at(torn, stop, nxt, EPOCH)


@pytest.mark.parametrize("at", [32, 40], ids=["checksum", "payload"])
@pytest.mark.parametrize("rec", [Reclaim(1, 1), DropRun(1), put(2)], ids=["reclaim", "drop", "put"])
def test_a_record_over_two_sectors_both_written_that_rots_is_damage(rec, at):
    """A record crossing from one sector into the next, where the commit's
    next record starts in that next sector: its header names this epoch (its
    sector was written as this record) and so does the next header (the
    second sector was written by the same commit: within an epoch each
    journal offset is written once).  Both sectors new, the record is
    whole: a checksum failing there is damage, not a tear.  It was taken for
    a tear, so with the next record intact the store recorded only a gap
    and a rotted RECLAIM's region kept its old runs indexed."""
    first = put(1, nblocks=24, ranges=2)            # 472 bytes: rec's header ends a sector
    data, ends = journal_of([[first, rec, DropRun(9)]])
    nxt_at = 472 + j.record_bytes(rec)
    assert 512 < nxt_at and nxt_at + 24 <= 1024
    bad = bytearray(data)
    bad[472 + at] ^= 0x10
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, 472)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # the second sector left old by a crash (zeros, or stale bytes): a tear
    for old in (bytes(512), b"\xa5" * 512):
        torn = data[:512] + old + data[1024:]
        recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
        assert (recs, stop) == ([first], 472) and not j.damaged_at(torn, stop, nxt, EPOCH)
    # the commit ended with it (zero padding after it): nothing shows the
    # second sector new, a tear
    data, ends = journal_of([[first, rec]])
    bad = bytearray(data)
    bad[472 + at] ^= 0x10
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, stop) == ([first], 472) and not j.damaged_at(bytes(bad), stop, nxt, EPOCH)


@pytest.mark.parametrize("blocks, ranges, after", [(10, 2, 656), (31, 3, 1000)],
                         ids=["header-in-sector", "header-crossing-sector"])
def test_a_tear_leaving_a_sector_of_an_earlier_journal_that_held_the_same_record_is_no_damage(
        blocks, ranges, after):
    """A commit written again after a crash (the restarted process re-puts
    the same run: same run id, keys, checksums, region and offset, at the
    same journal offset in a later epoch) and torn again: its record over
    two sectors is whole, its second sector old -- the earlier epoch's
    bytes are this record's tail byte for byte (a record's epoch lies in
    its header only), so its checksum passes.  What follows it in that old
    sector is the earlier epoch's next header (another epoch, or another
    kind of record): taken for bytes after an intact record's end in a
    sector written whole, a genuine tear was called damage and every run
    was dropped.  An intact record's tail alone does not show its sector
    new; a header of this epoch there does (then rot is still damage)."""
    old_epoch = EPOCH ^ 0x5A5A
    first = put(1, nblocks=20, ranges=2)         # 408 bytes: rec's header in sector 0
    rec = put(2, nblocks=blocks, ranges=ranges)
    assert j.record_bytes(first) + 40 <= 512
    assert j.record_bytes(first) + j.record_bytes(rec) == after
    old, _ = journal_of([[first, rec, DropRun(7)]], epoch=old_epoch)
    new, _ = journal_of([[first, rec, Reclaim(1, 1)]])
    assert old[512:after] == new[512:after] and old[after:1024] != new[after:1024]
    torn = new[:512] + old[512:]
    recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
    assert (recs, nxt, stop) == ([first, rec], 3, after)
    assert not j.damaged_at(torn, stop, nxt, EPOCH)
    # The new sector whose next header's epoch field rotted reads as that
    # old sector does (a well-formed header of another epoch after an
    # intact record's tail): the next record's checksum tells, where its
    # epoch field and checksum share a sector; else undecidable, a tear
    bad = bytearray(new)
    bad[after + 16] ^= 0x10
    assert j.damaged_at(bytes(bad), after, 3, EPOCH) == (after + 40 <= 1024)
    # ... but bytes that no header of any epoch and no padding hold are
    # damage still (an old sector holds a header there, or zeros)
    bad = bytearray(new)
    bad[after] ^= 0x10                          # its magic
    if after + 40 <= 1024:
        bad[after + 16] ^= 0x10                 # and its epoch
    assert j.damaged_at(bytes(bad), after, 3, EPOCH)


@pytest.mark.parametrize("rec, at", [(Reclaim(1, 1), 40), (put(2, nblocks=60, ranges=2), 600),
                                     (put(2, nblocks=60, ranges=2), 1000)],
                         ids=["last-reclaim-over-two-sectors", "put-over-three-sectors-middle",
                              "put-over-three-sectors-last"])
def test_a_rotted_record_whose_commit_a_later_commit_follows_is_damage(rec, at):
    """A commit's journal write is flushed before the next commit is
    written: a later commit of this epoch on the device shows every sector
    of the earlier one written, so a record of it failing its checksum
    rotted, wherever its sectors lie.  A record over three or more sectors
    (a middle one holds payload only, which a crash may leave old) or the
    last record of its commit over two (zero padding follows, not a header
    of this epoch) was taken for a tear: the gap it left was blamed on a
    crash, and a rotted RECLAIM's region kept its old runs indexed.  The
    later commit is known by the next record's place: a commit's records
    lie back to back, so the next number starting elsewhere than where the
    stopped record's header says it ends starts a later commit.

    Without a later commit the same bytes stay a tear (undecidable: the
    commit may be the one a crash tore, its sector left old)."""
    first = put(1, nblocks=24, ranges=2)            # 472 bytes: rec's header ends sector 0
    size = j.record_bytes(rec)
    assert 472 + size > 512 and (size < 512 or 472 + size > 1024)
    data, ends = journal_of([[first, rec], [DropRun(9)]])
    bad = bytearray(data)
    bad[472 + at] ^= 0x10
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, 472)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # the later commit's record damaged or absent: nothing shows it
    gone = bytes(bad[:ends[0]]) + bytes(len(bad) - ends[0])
    assert not j.damaged_at(gone, stop, nxt, EPOCH)
    # a tear of the last commit, a sector of the record left old
    data, ends = journal_of([[first, rec, DropRun(9)]])
    for sector in range(1, -(-(472 + size) // 512)):
        torn = data[:512 * sector] + bytes(512) + data[512 * (sector + 1):]
        recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
        if stop == 472:
            assert not j.damaged_at(torn, stop, nxt, EPOCH), sector


@pytest.mark.parametrize("pos", [0, 472, 496, 4096], ids=["commit-start", "in-sector",
                                                         "epoch-past-sector", "later-commit"])
def test_a_record_whose_epoch_field_rots_is_damage_where_its_checksum_proves_it(pos):
    """A record's epoch field rotting (one flipped bit) left a well-formed
    header of another epoch: taken for an earlier epoch's record that a
    crash left in an old sector, so a tear, and the records of later
    commits a gap blamed on a crash -- a DROP or RECLAIM lost so brought a
    deleted run back.  The record's checksum passing with this epoch in
    place of its own shows it written whole in this epoch (an earlier
    epoch's record there carries a checksum over that epoch), where the
    epoch field and the checksum share a sector (both old or both new)."""
    lead = {0: [], 472: [[put(1, nblocks=24, ranges=2)]], 496: [[put(1, nblocks=25, ranges=3)]],
            4096: [[put(1)], []]}[pos]
    commits = [c for c in lead if c]
    commits = commits[:-1] + [commits[-1] + [DropRun(7)]] if pos % BLOCK else \
        commits + [[DropRun(7)]]
    data, ends = journal_of(commits + [[put(9)]])
    replayed = [r for c in commits for r in c][:-1]
    assert j.header_at(data, pos)[1] == len(replayed) + 1
    bad = bytearray(data)
    bad[pos + 16] ^= 0x04                      # the DROP's epoch field
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == (replayed, len(replayed) + 1, pos)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    if pos == 472:
        return      # the DROP's sector holds the PUT's header: never an earlier epoch's
    # an earlier epoch's record there (what a crash leaves in an old
    # sector, its checksum over its own epoch) stays a tear
    old, _ = journal_of(commits, epoch=EPOCH ^ 0x04)
    sector = pos // 512 * 512 + (512 if pos % 512 + 16 >= 512 else 0)
    torn = data[:sector] + old[sector:sector + 512] + data[sector + 512:ends[len(commits) - 1]]
    torn += bytes(len(data) - len(torn))
    recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
    assert (recs, stop) == (replayed, pos) and not j.damaged_at(torn, stop, nxt, EPOCH)


@pytest.mark.parametrize("at", [41, 85, 100], ids=["payload-start", "keys", "checksums"])
@pytest.mark.parametrize("later", [True, False], ids=["later-commit", "last-commit"])
def test_a_record_whose_header_crosses_into_a_sector_its_epoch_shows_new_that_rots_is_damage(
        at, later):
    """A record after an intact one whose header begins 16 bytes before a
    sector's end: its epoch field lies wholly in the next sector and names
    this epoch, so that sector was written by this commit (each offset once
    per epoch), and the first one too (a header of this epoch before the
    record in it).  Its record, within those two sectors, was written whole:
    a payload byte rotting was taken for a tear (the header's first part
    fits one), the run lost with a gap blamed on a crash."""
    first = put(1, nblocks=25, ranges=3)
    assert j.record_bytes(first) == 496
    rec = put(2, nblocks=3, ranges=2)
    assert 496 + j.record_bytes(rec) <= 1024
    data, ends = journal_of([[first, rec]] + ([[DropRun(9)]] if later else []))
    bad = bytearray(data)
    bad[496 + at] ^= 0x04
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, 496)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # the second sector left old (zeros, or an earlier epoch's bytes): a tear
    _second_sector_old_is_a_tear(data, ends[0], first, 496)


@pytest.mark.parametrize("pos", [480, 488])
@pytest.mark.parametrize("follow", ["next-record", "later-commit"])
def test_a_record_whose_header_crosses_a_sector_after_its_epoch_that_rots_is_damage(pos, follow):
    """A header crossing a sector after its epoch field (its checksum in
    the next sector, which a crash may leave old), after an intact record
    in a new sector: its length is this record's, so the commit's next
    header of this epoch in the sector where the record ends, or a later
    commit, shows the record written whole; a payload byte rotting was
    taken for a tear (a gap blamed on a crash, the run lost)."""
    blocks, ranges = _ENDS[pos]
    first, rec = put(1, nblocks=blocks, ranges=ranges), put(2, nblocks=3, ranges=2)
    assert j.record_bytes(first) == pos
    commits = [[first, rec, DropRun(5)]] if follow == "next-record" else \
        [[first, rec], [DropRun(9)]]
    data, ends = journal_of(commits)
    bad = bytearray(data)
    bad[pos + 85] ^= 0x04
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, pos)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # the second sector left old, nothing after: a tear
    _second_sector_old_is_a_tear(data, ends[0], first, pos)


@pytest.mark.parametrize("pos", [480, 488])
@pytest.mark.parametrize("bit", [(8, 6), (9, 0), (10, 3), (11, 7)],
                         ids=["byte8", "byte9", "byte10", "byte11"])
@pytest.mark.parametrize("later", [True, False], ids=["later-commit", "last-commit"])
def test_a_put_whose_header_crosses_a_sector_and_whose_length_rots_longer_is_damage(
        pos, bit, later):
    """A PUT over three sectors whose header crosses a sector after its
    epoch field, after an intact record in a new sector: its length rotting
    to a longer one a PUT can have was taken for a tear (the rotted length
    was trusted to find where the record ends, past any proof).  Its
    payload's counts give the length it was written with, and the record
    passes its checksum with that one: written whole, damaged since."""
    blocks, ranges = _ENDS[pos]
    first, rec = put(1, nblocks=blocks, ranges=ranges), put(2, nblocks=40, ranges=3)
    assert j.record_bytes(first) == pos
    data, ends = journal_of([[first, rec, DropRun(5)]] + ([[DropRun(9)]] if later else []))
    byte, b = bit
    bad = bytearray(data)
    bad[pos + byte] ^= 1 << b
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, pos)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # the second sector left old (the commit the last): a tear still
    _second_sector_old_is_a_tear(data, ends[0], first, pos)


# A first record whose header lies in an earlier sector than its end (57 or
# 58 blocks): the sector where it ends holds only its payload, nothing
# before the next header there shows that sector written in this epoch.
_LONG_FIRST = {992: (57, 1), 1000: (57, 2), 1008: (58, 1), 1016: (58, 2)}


@pytest.mark.parametrize("pos", [992, 1000])
@pytest.mark.parametrize("rec", [DropRun(7), put(2, nblocks=3, ranges=2)], ids=["drop", "put"])
@pytest.mark.parametrize("at", [24, 32, 40, 44], ids=["seq", "checksum", "payload", "payload+4"])
def test_a_header_crossing_a_sector_after_its_own_epoch_field_shows_that_sector_new(pos, rec, at):
    """A header that crosses a sector after its epoch field, the record
    before it long (its header in an earlier sector): the header's own
    epoch field, in the first sector and naming this epoch, shows that
    sector written by this commit -- only fields before the header were
    looked at, so its bytes there (its number) and, with a later commit on
    the device, the rest of the record rotting were taken for a tear: the
    later commits a gap blamed on a crash, a rotted DROP's run (a delete()
    acknowledged) indexed again."""
    blocks, ranges = _LONG_FIRST[pos]
    first = put(1, nblocks=blocks, ranges=ranges)
    assert j.record_bytes(first) == pos and pos % 512 + 24 <= 512 < pos % 512 + 40
    for later in (True, False):
        data, ends = journal_of([[first, rec]] + ([[DropRun(9)]] if later else []))
        bad = bytearray(data)
        bad[pos + at] ^= 0x04
        recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
        assert (recs, nxt, stop) == ([first], 2, pos)
        # its number in the sector its epoch shows new (992): damage even
        # in the last commit; what lies in the next sector, where a later
        # commit shows that sector written too
        in_first = pos % 512 + at + 8 <= 512
        assert j.damaged_at(bytes(bad), stop, nxt, EPOCH) == (later or in_first), later
    # the sector after the header's epoch left old by a crash: a tear
    for old in (bytes(512), b"\xa5" * 512):
        torn = data[:1024] + old + data[1536:ends[0]] + bytes(len(data) - ends[0])
        recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
        assert (recs, stop) == ([first], pos) and not j.damaged_at(torn, stop, nxt, EPOCH)



@pytest.mark.parametrize("pos", [1008, 1016])
@pytest.mark.parametrize("rec", [DropRun(7), put(2, nblocks=3, ranges=2)], ids=["drop", "put"])
def test_a_header_whose_epoch_field_lies_in_the_next_sector_and_whose_number_rots_is_damage(
        pos, rec):
    """A header crossing a sector before its epoch field, the record before
    it long (nothing in the first sector shows it new): its epoch field
    names this epoch, so the next sector was written by this commit, the
    header's number there with it -- the record following the one replay
    read last, numbered next (each journal offset is written once per
    epoch).  Its number rotting was taken for a tear: the run (or the
    DROP: a deleted run back) and every later commit lost to a gap blamed
    on a crash."""
    blocks, ranges = _LONG_FIRST[pos]
    first = put(1, nblocks=blocks, ranges=ranges)
    assert j.record_bytes(first) == pos and pos % 512 + 16 >= 512
    data, ends = journal_of([[first, rec], [DropRun(9)]])
    bad = bytearray(data)
    bad[pos + 24] ^= 0x04                       # its number, in the next sector
    recs, end, nxt, stop = j.scan_to(bytes(bad), 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, pos)
    assert j.damaged_at(bytes(bad), stop, nxt, EPOCH)
    # a crash that left the first sector an earlier epoch's (the same run
    # re-put there, another record after it) and the next one new: its
    # number is the one expected, a tear
    old, _ = journal_of([[first, Reclaim(3, 3), DropRun(4)]], epoch=EPOCH ^ 0x5A5A)
    assert old[512:pos] == data[512:pos] and old[pos:1024] != data[pos:1024]
    torn = data[:512] + old[512:1024] + data[1024:ends[0]] + bytes(len(data) - ends[0])
    recs, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
    assert (recs, nxt, stop) == ([first], 2, pos) and not j.damaged_at(torn, stop, nxt, EPOCH)


@pytest.mark.parametrize("pos", [496, 504])
@pytest.mark.parametrize("old_kind", ["zeros", "earlier-epoch", "earlier-epoch-same-records"])
def test_every_sector_tear_of_a_commit_with_a_three_sector_record_near_a_sectors_end(pos,
                                                                                    old_kind):
    """A commit whose second record is a PUT over three sectors with its
    header 16 or 8 bytes before the first sector's end (the header crosses
    into the next sector), and a DROP after it (at 496: its header crosses
    the third sector's end too).  Written whole it replays whole; torn at
    any subset of its sectors (a device writes sectors whole, in any order;
    the others keep what an earlier write left: zeros, an earlier epoch's
    other records, or the same records of an earlier epoch), replay yields
    the records that read back as written, in order, up to the first that
    does not -- never another record -- and a tear is never damage."""
    import itertools

    first = put(1, nblocks=25, ranges=3 if pos == 496 else 4)
    big = put(2, nblocks=59, ranges=2)
    recs = [first, big, DropRun(9)]
    assert j.record_bytes(first) == pos and pos + j.HEADER_BYTES > 512
    starts = [0, pos, pos + j.record_bytes(big)]
    ends = starts[1:] + [starts[2] + j.record_bytes(recs[2])]
    assert starts[1] // 512 == 0 and (ends[1] - 1) // 512 == 2     # over three sectors
    new, _ = journal_of([recs])
    assert scan(new, 1, EPOCH) == (recs, BLOCK, 4)                 # written whole
    old = {"zeros": bytes(len(new)),
           "earlier-epoch": journal_of([[put(7, nblocks=9), put(8, nblocks=80, ranges=3),
                                         Reclaim(2, 5)]], epoch=EPOCH ^ 0x77)[0],
           "earlier-epoch-same-records": journal_of([recs], epoch=EPOCH ^ 0x77)[0]}[old_kind]
    sectors = -(-ends[-1] // 512)
    for landed in itertools.product([False, True], repeat=sectors):
        torn = bytearray(old)
        for s, ok in enumerate(landed):
            if ok:
                torn[s * 512:(s + 1) * 512] = new[s * 512:(s + 1) * 512]
        torn = bytes(torn)
        whole = 0          # the records before the first that does not read back as written
        while whole < len(recs) and \
                torn[starts[whole]:ends[whole]] == new[starts[whole]:ends[whole]]:
            whole += 1
        got, end, nxt, stop = j.scan_to(torn, 1, EPOCH)
        assert got == recs[:whole], landed
        assert nxt == 1 + whole
        if whole < len(recs):
            # (or past zeros there: read as the commit's padding)
            assert stop == starts[whole] or not any(torn[starts[whole]:stop]), landed
            assert not j.damaged_at(torn, stop, nxt, EPOCH), landed
