"""Metadata journal records.

The journal is an append-only area on device 0.  Each commit writes one or
more records and pads to the next journal block (4 KiB); records carry
consecutive sequence numbers, so replay stops at the first record that is
torn, corrupt, or older than the checkpoint (a stale record left from before
the journal was restarted).  Records also carry the journal's epoch (the
generation of the checkpoint it follows): records left on the medium by an
earlier epoch, even with a matching sequence number, are never replayed.

Record layout (little-endian; bump FORMAT_VERSION when changing it)::

    0   I  magic 0x4A42564B ("KVBJ")   8   I  payload bytes
    4   H  type                        12  I  0
    6   H  0                           16  Q  epoch
                                       24  Q  sequence
                                       32  Q  xxh64(header with this field 0 + payload)
    40  payload, zero-padded to a multiple of 8

Payloads:
    PUT_RUN (1):  Q run_id, I region, I region generation, Q byte offset in region,
                  I blocks, I checksums (ranges + 1), then blocks x 16-byte keys,
                  checksums x Q: one per range, then the block digest trailer's
    DROP_RUN (2): Q run_id
    RECLAIM (3):  I region, I new generation
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from kvblock.format.checksum import meta_checksum

MAGIC = 0x4A42564B
BLOCK = 4096
SECTOR = 512          # what a device writes whole (damaged_at)
KEY_BYTES = 16

PUT_RUN, DROP_RUN, RECLAIM = 1, 2, 3

_HEADER = struct.Struct("<IHHIIQQQ")
_PUT = struct.Struct("<QIIQII")
_DROP = struct.Struct("<Q")
_RECLAIM = struct.Struct("<II")
assert _HEADER.size == 40
HEADER_BYTES = _HEADER.size
# A PUT record's bytes besides its keys and checksums, with the padding of the
# record and of a commit holding it alone.
PUT_RECORD_OVERHEAD = _HEADER.size + _PUT.size + 7 + BLOCK - 1


@dataclass(frozen=True)
class PutRun:
    run_id: int
    region: int
    generation: int
    offset: int
    keys: bytes          # nblocks * 16 bytes, in token order
    checksums: tuple     # one per (layer, head group) range, then the trailer's

    @property
    def nblocks(self) -> int:
        return len(self.keys) // KEY_BYTES


@dataclass(frozen=True)
class DropRun:
    run_id: int


@dataclass(frozen=True)
class Reclaim:
    region: int
    generation: int


Record = PutRun | DropRun | Reclaim


def _payload(rec: Record) -> tuple[int, bytes]:
    if isinstance(rec, PutRun):
        # what replay reads back: whole keys, at least one, and a checksum
        if not rec.keys or len(rec.keys) % KEY_BYTES or not len(rec.checksums):
            raise ValueError(f"PutRun of run {rec.run_id}: {len(rec.keys)} key bytes (whole "
                             f"{KEY_BYTES}-byte keys, at least one) and {len(rec.checksums)} "
                             "checksums (at least one) cannot be journaled")
        sums = np.asarray(rec.checksums, dtype="<u8").tobytes()
        return PUT_RUN, _PUT.pack(rec.run_id, rec.region, rec.generation, rec.offset,
                                  rec.nblocks, len(rec.checksums)) + rec.keys + sums
    if isinstance(rec, DropRun):
        return DROP_RUN, _DROP.pack(rec.run_id)
    if isinstance(rec, Reclaim):
        return RECLAIM, _RECLAIM.pack(rec.region, rec.generation)
    raise TypeError(f"not a journal record: {rec!r}")


def epoch(store_uuid: bytes, generation: int) -> int:
    """The journal epoch of a store's checkpoint generation: unique per
    (store, generation), so records of an earlier epoch never replay."""
    return meta_checksum(store_uuid + generation.to_bytes(8, "little"))


def record_bytes(rec: Record) -> int:
    """The journal bytes a record takes (before its commit's block padding)."""
    if isinstance(rec, PutRun):
        payload = _PUT.size + len(rec.keys) + 8 * len(rec.checksums)
    else:
        payload = len(_payload(rec)[1])
    return _HEADER.size + -(-payload // 8) * 8


def encode_record(rec: Record, seq: int, epoch: int) -> bytes:
    kind, payload = _payload(rec)
    payload += bytes(-len(payload) % 8)
    header = _HEADER.pack(MAGIC, kind, 0, len(payload), 0, epoch, seq, 0)
    crc = meta_checksum(header + payload)
    return _HEADER.pack(MAGIC, kind, 0, len(payload), 0, epoch, seq, crc) + payload


def encode_commit(records: list[Record], first_seq: int, epoch: int) -> bytes:
    """The bytes of one commit: records with consecutive sequence numbers,
    zero-padded to a whole number of journal blocks."""
    data = b"".join(encode_record(r, first_seq + i, epoch) for i, r in enumerate(records))
    return data + bytes(-len(data) % BLOCK)


def _decode_payload(kind: int, payload: bytes) -> Record | None:
    # Every record is exactly its payload (all of them multiples of 8: no
    # padding): one with more bytes is none this format writes.
    if kind == PUT_RUN and len(payload) >= _PUT.size:
        run_id, region, gen, offset, nblocks, ranges = _PUT.unpack_from(payload)
        end = _PUT.size + nblocks * KEY_BYTES + ranges * 8
        if nblocks == 0 or ranges == 0 or end != len(payload):
            return None
        keys = payload[_PUT.size:_PUT.size + nblocks * KEY_BYTES]
        sums = np.frombuffer(payload, dtype="<u8", count=ranges,
                             offset=_PUT.size + nblocks * KEY_BYTES)
        return PutRun(run_id, region, gen, offset, keys, tuple(int(x) for x in sums))
    if kind == DROP_RUN and len(payload) == _DROP.size:
        return DropRun(*_DROP.unpack_from(payload))
    if kind == RECLAIM and len(payload) == _RECLAIM.size:
        return Reclaim(*_RECLAIM.unpack_from(payload))
    return None


def scan(data: bytes | memoryview, expected_seq: int,
         epoch: int) -> tuple[list[Record], int, int]:
    """Parse journal bytes from their start.

    Returns (records, end offset rounded to a block, next sequence number).
    Stops at the first position that holds no valid record with the expected
    sequence; zero padding after a commit is skipped to the next block.
    """
    return scan_to(data, expected_seq, epoch)[:3]


def scan_to(data: bytes | memoryview, expected_seq: int,
            epoch: int) -> tuple[list[Record], int, int, int]:
    """:func:`scan`, and the offset where it stopped (for :func:`damaged_at`)."""
    data = memoryview(data)
    pos, seq, records, end = 0, expected_seq, [], 0
    while pos + _HEADER.size <= len(data):
        magic, kind, res16, length, res32, repoch, rseq, crc = _HEADER.unpack_from(data, pos)
        if magic != MAGIC:
            nxt = (pos // BLOCK + 1) * BLOCK
            if pos % BLOCK == 0 or not _is_zero(data[pos:nxt]):
                break  # a block that starts without a record: end of the log
            pos = nxt
            continue
        stop = pos + _HEADER.size + length
        if repoch != epoch or rseq != seq or length % 8 or stop > len(data) or res16 or res32:
            break
        header = _HEADER.pack(MAGIC, kind, 0, length, 0, repoch, rseq, 0)
        payload = bytes(data[pos + _HEADER.size:stop])
        if meta_checksum(header + payload) != crc:
            break
        rec = _decode_payload(kind, payload)
        if rec is None:
            break
        records.append(rec)
        seq += 1
        pos = stop
        end = -(-pos // BLOCK) * BLOCK
    return records, end, seq, pos


def damaged_at(data: bytes | memoryview, pos: int, seq: int, epoch: int) -> bool:
    """Whether the record where :func:`scan_to` stopped (``pos``, ``seq``)
    was written whole and damaged since, not torn by a crash: a device
    writes a sector whole, so a crash leaves each one old or new.  Proof is
    a header of ``epoch`` numbered ``seq`` whose record lies in one sector
    (or in two, the second holding the commit's next header), or bytes other than a record or zero padding after an intact record's
    end in its sector where a header of ``epoch`` shows that sector new
    (elsewhere, bytes no header of any epoch holds), or a later commit
    after a well-formed header's record (:func:`_later_commit`; without
    one, a record over three or more sectors, or the last of its commit
    over two, may have a sector a crash left old: a tear).  A header naming ``epoch`` is this record's even
    where its other bytes (magic, number) rotted: within an epoch each
    journal offset is written once, and no crash or rot forges the 64-bit
    epoch hash (a commit's first record starts a sector, where a header
    without its magic was taken for a sector never written).  A header
    naming another epoch is this record's where the record passes its
    checksum with ``epoch`` in its place (:func:`_epoch_rotted`)."""
    data = memoryview(data)
    if _epoch_rotted(data, pos, epoch):
        return True
    sector_end = min((pos // SECTOR + 1) * SECTOR, len(data))
    if pos + _HEADER.size > sector_end:
        # The header crosses into a sector a crash may have left old.  Its
        # part in this sector is still proof where an intact record ends
        # here (pos not on a sector): the sector was written whole, as the
        # commit's next record or as its zero padding, so bytes there that
        # no header of ``epoch`` numbered ``seq`` holds are damage -- where
        # a header of ``epoch`` shows the sector new (an intact record's
        # tail may be an earlier epoch's same bytes, see below: then only
        # bytes no header of any epoch holds).
        if pos % SECTOR == 0:
            return False
        part = bytes(data[pos:sector_end])
        # (the header's own epoch field, where it lies in this sector and
        # names ``epoch``, shows the sector new as one before it would)
        new = _new_sector(data, pos, epoch) or (
            pos + 24 <= sector_end and epoch_field_at(data, pos) == epoch)
        if not _header_prefix_fits(part, seq, epoch if new else None):
            return True
        # Its epoch field wholly in the next sector, naming ``epoch``: that
        # sector was written by this commit too (each offset once per
        # epoch), so the header is whole where its first sector is new:
        # judged as a header in one sector (the two of them)
        if not new:
            # This sector perhaps old (an earlier epoch's same record tail,
            # see below), but an epoch field of ``epoch`` in the next one
            # shows that one written by this commit: the header's fields
            # there are as written, numbered ``seq`` (the record after the
            # one replay read last: each offset once per epoch), its
            # reserved word zero
            if pos + 16 < sector_end or epoch_field_at(data, pos) != epoch:
                return False
            rseq = struct.unpack_from("<Q", data, pos + 24)[0]
            res32 = struct.unpack_from("<I", data, pos + 12)[0] if pos + 12 >= sector_end else 0
            return rseq != seq or res32 != 0
        if pos + 16 < sector_end:
            # Its first sector new, its length is this record's: a header
            # of this epoch in the sector where the record ends, or a later
            # commit, shows the rest written too (as for a whole header)
            length = struct.unpack_from("<I", part, 8)[0]
            # ... unless the length rotted, to another a PUT can have: its
            # payload's counts give the length it was written with, and its
            # checksum passing with that one shows it whole
            if struct.unpack_from("<H", part, 4)[0] == PUT_RUN and \
                    _put_length_rotted(data, pos, length, sector_end):
                return True
            end = pos + _HEADER.size + length
            if end // SECTOR == sector_end // SECTOR and end + 24 <= sector_end + SECTOR \
                    and epoch_field_at(data, end) == epoch:
                return True
            return _later_commit(data, end, seq, epoch)
        if epoch_field_at(data, pos) != epoch:
            return False
        sector_end = min(sector_end + SECTOR, len(data))
    magic, kind, res16, length, res32, repoch, rseq, _ = _HEADER.unpack_from(data, pos)
    if repoch == epoch:
        # the header's sector was written as this record, whole: a header
        # wrong in any other field is damage, wherever its record ends;
        # only a well-formed one's record may cross into a sector left old
        sane = magic == MAGIC and rseq == seq and not res16 and not res32 and (
            length == 8 if kind in (DROP_RUN, RECLAIM) else
            kind == PUT_RUN and length % 8 == 0 and length >= _PUT.size + KEY_BYTES + 8)
        if not sane or pos + _HEADER.size + length <= sector_end:
            return True
        # A PUT's length may rot to another a PUT can have, past the sector:
        # its payload's counts give the length it was written with
        if kind == PUT_RUN:
            if _put_length_rotted(data, pos, length, sector_end):
                return True
        # a DROP's type and a RECLAIM's differ in one bit, their lengths not
        elif _whole_as(data, pos, DROP_RUN + RECLAIM - kind, length):
            return True
        # A record over two sectors, the commit's next header starting in
        # the second one: that header's epoch says the second sector was
        # written by this commit too (each offset once per epoch), so the
        # record is whole there and its checksum failing is damage
        end = pos + _HEADER.size + length
        if end < sector_end + SECTOR and epoch_field_at(data, end) == epoch and \
                end + 24 <= sector_end + SECTOR:
            return True
        # A later commit on the device: this one was flushed whole before
        # it was written (a record over three or more sectors, or the last
        # of its commit, is judged so; without one it stays a tear: the
        # crash may have left a sector of it old, which rot reads alike)
        return _later_commit(data, end, seq, epoch)
    # a sector that starts without this record may be one never written
    if pos % SECTOR == 0 or _is_zero(data[pos:sector_end]):
        return False
    if _new_sector(data, pos, epoch):
        return True
    # An intact record's tail alone does not show its sector new: an
    # earlier epoch may have written the same record (a run re-put after a
    # crash: same id, keys, checksums and place) at the same offset, and a
    # torn commit left that sector old, the old next header after the
    # tail.  Only bytes that no header of any epoch holds are damage then;
    # a well-formed header of another epoch there is a tear (or, alike on
    # the device, this commit's next header with its epoch rotted).
    return not _header_prefix_fits(bytes(data[pos:pos + _HEADER.size]), seq, None)


def _epoch_rotted(data, pos: int, epoch: int) -> bool:
    """Whether the record at ``pos``, its header naming another epoch,
    passes its checksum with ``epoch`` in place of that one: written whole
    in ``epoch``, its epoch field rotted since.  Only where the epoch field
    and the checksum lie in one sector (a crash leaves both old or both
    new: an earlier epoch's record there, what a crash leaves, carries a
    checksum over its own epoch)."""
    if pos + _HEADER.size > len(data) or (pos + 16) // SECTOR != (pos + 39) // SECTOR:
        return False
    magic, kind, res16, length, res32, repoch, rseq, crc = _HEADER.unpack_from(data, pos)
    stop = pos + _HEADER.size + length
    if repoch == epoch or magic != MAGIC or length % 8 or stop > len(data):
        return False
    header = _HEADER.pack(magic, kind, res16, length, res32, epoch, rseq, 0)
    return meta_checksum(header + bytes(data[pos + _HEADER.size:stop])) == crc


def _new_sector(data, pos: int, epoch: int) -> bool:
    """Whether the sector holding ``pos`` (an intact record ends there, not
    on the sector's start) was written in ``epoch``: the epoch field of a
    header of ``epoch`` lies in it before ``pos`` (the records there are
    intact: one whose header lies in an earlier sector shows nothing)."""
    start = pos // SECTOR * SECTOR
    for at in range(start + (-start % 8), pos - 7, 8):
        if at >= 16 and epoch_field_at(data, at - 16) == epoch and \
                struct.unpack_from("<I", data, at - 16)[0] == MAGIC:
            return True
    return False


def _later_commit(data, end: int, seq: int, epoch: int) -> bool:
    """Whether a commit written after the one holding record ``seq`` (its
    header whole, saying it ends at ``end``) lies on the device: an intact
    record of ``epoch`` numbered past ``seq`` that starts elsewhere than
    where the one before it ends.  A commit's records lie back to back, so
    such a record starts a later commit, and a commit's write is flushed
    before the next one is written (within an epoch each journal offset is
    written once: the record is this epoch's)."""
    after = _intact_after(data, end, seq + 1, epoch)
    for k in range(seq + 1, seq + 1 + len(after)):
        at = after.get(k)
        if at is None:
            return False
        if at[0] != end:
            return True
        end = at[0] + _HEADER.size + at[1]
    return False


def _intact_after(data, start: int, seq: int, epoch: int) -> dict[int, tuple[int, int]]:
    """{number: (offset, payload bytes)} of the intact records of ``epoch``
    numbered ``seq`` or later from ``start`` on (8-aligned, found as
    :func:`records_after` finds them)."""
    data = memoryview(data)
    start -= start % 8
    n = (len(data) - start) // 8
    if n < _HEADER.size // 8:
        return {}
    words = np.frombuffer(data, dtype="<u8", count=n, offset=start)
    idx = np.nonzero((words[:n - 4] & np.uint64(0xFFFFFFFF)) == np.uint64(MAGIC))[0]
    idx = idx[(words[idx + 2] == np.uint64(epoch)) & (words[idx + 3] >= np.uint64(seq))]
    found = {}
    for i in idx:
        pos, rseq = start + 8 * int(i), int(words[i + 3])
        if rseq not in found and record_at(data, pos) == (epoch, rseq):
            found[rseq] = (pos, header_at(data, pos)[2])
    return found


def _put_length_rotted(data, pos: int, length: int, sector_end: int) -> bool:
    """Whether the PUT record at ``pos`` (a well-formed header of ``length``
    payload bytes whose record crosses ``sector_end``) was written with
    another length: its payload's block and checksum counts, where they lie
    in the header's sector (written whole, as this record), give another;
    or the record's checksum passes with the length they give (its bytes
    all there: written whole)."""
    counts = pos + _HEADER.size + _PUT.size
    if counts > len(data):
        return False
    nblocks, ranges = struct.unpack_from("<II", data, counts - 8)
    true = _PUT.size + nblocks * KEY_BYTES + ranges * 8
    if true == length:
        return False
    if counts <= sector_end:
        return True
    return nblocks > 0 and ranges > 0 and _whole_as(data, pos, PUT_RUN, true)


def _whole_as(data, pos: int, kind: int, length: int) -> bool:
    """Whether the record at ``pos`` passes its checksum with ``kind`` and
    ``length`` in place of its header's: it was written whole so, and its
    header rotted since."""
    stop = pos + _HEADER.size + length
    if stop > len(data):
        return False
    _, _, _, _, _, repoch, rseq, crc = _HEADER.unpack_from(data, pos)
    header = _HEADER.pack(MAGIC, kind, 0, length, 0, repoch, rseq, 0)
    return meta_checksum(header + bytes(data[pos + _HEADER.size:stop])) == crc


def _header_prefix_fits(part: bytes, seq: int, epoch: int | None) -> bool:
    """Whether ``part`` (the first bytes of a header, cut at a sector's end:
    a multiple of 8 short of the whole) is zero padding or can begin a
    well-formed header of ``epoch`` numbered ``seq`` (of any epoch and
    number where ``epoch`` is None)."""
    if part == bytes(len(part)):
        return True
    whole = part + bytes(_HEADER.size - len(part))
    magic, kind, res16, length, res32, repoch, rseq, _ = _HEADER.unpack(whole)
    fields = [magic == MAGIC]
    if len(part) >= 8:
        fields.append(kind in (PUT_RUN, DROP_RUN, RECLAIM) and not res16)
    if len(part) >= 16:
        fields.append(not res32 and (
            length == 8 if kind in (DROP_RUN, RECLAIM) else
            length % 8 == 0 and length >= _PUT.size + KEY_BYTES + 8))
    if len(part) >= 24 and epoch is not None:
        fields.append(repoch == epoch)
    if len(part) >= 32 and epoch is not None:
        fields.append(rseq == seq)
    return all(fields)


def header_at(data: bytes | memoryview, pos: int) -> tuple[int, int, int] | None:
    """(epoch, sequence number, payload bytes) of a well-formed record
    header at ``pos``, its payload not checked (it may be cut or
    unreadable), else None."""
    if pos + _HEADER.size > len(data):
        return None
    magic, _, res16, length, res32, repoch, rseq, _ = _HEADER.unpack_from(data, pos)
    if magic != MAGIC or length % 8 or res16 or res32:
        return None
    return repoch, rseq, length


def epoch_field_at(data: bytes | memoryview, pos: int = 0) -> int | None:
    """The epoch field of a record header at ``pos``, whatever its other
    bytes hold (rot there leaves it: no rot forges a 64-bit epoch hash),
    or None when the data ends first."""
    if pos + _HEADER.size > len(data):
        return None
    return _HEADER.unpack_from(data, pos)[5]


def record_at(data: bytes | memoryview, pos: int = 0) -> tuple[int, int] | None:
    """(epoch, sequence number) of an intact record at ``pos``, else None.
    Recovery reads the journal's first record: its epoch says which
    checkpoint generation last restarted the journal."""
    data = memoryview(data)
    if pos + _HEADER.size > len(data):
        return None
    magic, kind, res16, length, res32, repoch, rseq, crc = _HEADER.unpack_from(data, pos)
    stop = pos + _HEADER.size + length
    if magic != MAGIC or length % 8 or stop > len(data) or res16 or res32:
        return None
    header = _HEADER.pack(MAGIC, kind, 0, length, 0, repoch, rseq, 0)
    if meta_checksum(header + bytes(data[pos + _HEADER.size:stop])) != crc:
        return None
    return repoch, rseq


def records_after(data: bytes | memoryview, end: int, seq: int,
                  epoch: int) -> tuple[int, int, int] | None:
    """Intact records of ``epoch`` numbered ``seq`` or later anywhere past
    the point where :func:`scan` stopped (``end``, ``seq``: what it
    returned): (offset of the first, its sequence number, how many), or
    None.  Replay never reaches them.  A crash inside a commit whose blocks
    were written out of order can leave a few; more mean the journal was
    damaged and the runs they published are lost.

    Records start 8-aligned (commits start on blocks, records are whole
    multiples of 8), so the headers are found with numpy over 8-byte words:
    a journal of old epochs costs one pass, not a parse per record."""
    data = memoryview(data)
    start = max(0, end - BLOCK)      # the stop may lie in the last replayed block
    n = (len(data) - start) // 8
    if n < _HEADER.size // 8:
        return None
    words = np.frombuffer(data, dtype="<u8", count=n, offset=start)
    idx = np.nonzero((words[:n - 4] & np.uint64(0xFFFFFFFF)) == np.uint64(MAGIC))[0]
    idx = idx[(words[idx + 2] == np.uint64(epoch)) & (words[idx + 3] >= np.uint64(seq))]
    found = [(start + 8 * int(i), int(words[i + 3])) for i in idx]
    found = [(pos, rseq) for pos, rseq in found if record_at(data, pos) == (epoch, rseq)]
    if not found:
        return None
    pos, first = found[0]
    return pos, first, len({rseq for _, rseq in found})


def _is_zero(view) -> bool:
    return bytes(view) == bytes(len(view))
