"""The superblock: pinned byte layout, round trip, corruption, versions, pick()."""

from __future__ import annotations

import struct

import pytest
import xxhash

from kvblock.errors import KVBlockError, NotAStoreError, UnsupportedVersionError
from kvblock.format import FORMAT_VERSION
from kvblock.format import superblock as sbfmt
from kvblock.format.superblock import FLAG_CLEAN, MAGIC, SIZE, Superblock, pick
from kvblock.layout.geometry import DTYPES, Geometry, model_fingerprint

STORE_UUID = bytes(range(0x10, 0x20))
DEV_UUIDS = (bytes(range(0x20, 0x30)), bytes(range(0x30, 0x40)), bytes(range(0x40, 0x50)))
FINGERPRINT = model_fingerprint("meta-llama/Llama-3.1-8B@rev1")
GEOMETRY = Geometry(num_layers=62, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                    block_tokens=512, kv_parts=2, head_groups=8)

# xxh64 hex digest of the whole 4096-byte encoding of golden_superblock().
# If this changes, bump FORMAT_VERSION (tests/format/test_format_version.py enforces it).
GOLDEN_DIGEST = "2af5dc6e94c5cb7e"   # format version 2


def golden_superblock(**changes) -> Superblock:
    sb = Superblock(
        store_uuid=STORE_UUID,
        device_uuid=DEV_UUIDS[1],
        device_index=1,
        device_count=3,
        alignment=4096,
        device_bytes=0x0000_0040_0000_0000,
        region_size=256 << 20,
        region_count=1023,
        data_offset=1 << 30,
        geometry=GEOMETRY,
        fingerprint=FINGERPRINT,
        journal_offset=0x1122_3344,
        journal_bytes=64 << 20,
        checkpoint_offset=0x5566_7788_99,
        checkpoint_bytes=512 << 20,
        flags=FLAG_CLEAN,
        created_ns=1_700_000_000_123_456_789,
        sequence=0x0102_0304_0506_0708,
        device_uuids=DEV_UUIDS,
    )
    return sb.with_(**changes) if changes else sb


def rechecksum(buf: bytearray) -> bytes:
    struct.pack_into("<Q", buf, 4088, xxhash.xxh64_intdigest(bytes(buf[:4088])))
    return bytes(buf)


def u32(b, at):
    return struct.unpack_from("<I", b, at)[0]


def u64(b, at):
    return struct.unpack_from("<Q", b, at)[0]


# ------------------------------------------------------------------ golden layout
def test_golden_byte_layout():
    sb = golden_superblock()
    b = sb.encode()
    assert len(b) == SIZE == 4096
    assert b[0:8] == MAGIC == b"KVBLKSB\0"
    assert u32(b, 8) == FORMAT_VERSION == 2
    assert u32(b, 12) == 4096
    assert b[16:32] == STORE_UUID
    assert b[32:48] == DEV_UUIDS[1]
    assert struct.unpack_from("<HH", b, 48) == (1, 3)
    assert u32(b, 52) == 4096
    assert u64(b, 56) == 0x0000_0040_0000_0000
    assert u64(b, 64) == 256 << 20
    assert u32(b, 72) == 1023
    assert u32(b, 76) == FLAG_CLEAN == 1
    assert u64(b, 80) == 1 << 30
    assert u64(b, 88) == 0x1122_3344
    assert u64(b, 96) == 64 << 20
    assert u64(b, 104) == 0x5566_7788_99
    assert u64(b, 112) == 512 << 20
    assert u64(b, 120) == 1_700_000_000_123_456_789
    # geometry at 128..
    assert struct.unpack_from("<IIIII", b, 128) == (62, 8, 128, 512, 8)
    assert b[148] == DTYPES["bfloat16"][0] == 2
    assert b[149] == 2
    assert b[150:152] == b"\0\0"
    assert b[152:184] == FINGERPRINT
    assert u64(b, 184) == 0x0102_0304_0506_0708
    # device uuids table at 192: 32 slots of 16 bytes, unused ones zero
    assert b[192:192 + 48] == b"".join(DEV_UUIDS)
    assert b[192 + 48:704] == bytes(704 - 240)
    assert b[704:4088] == bytes(4088 - 704)
    assert u64(b, 4088) == xxhash.xxh64_intdigest(b[:4088])
    # the raw little-endian spelling of a couple of fields, to catch endianness slips
    assert b[8:12] == b"\x02\x00\x00\x00"
    assert b[184:192] == bytes([8, 7, 6, 5, 4, 3, 2, 1])


def test_golden_digest():
    # if this changes, bump FORMAT_VERSION
    assert xxhash.xxh64_hexdigest(golden_superblock().encode()) == GOLDEN_DIGEST


def test_dtype_codes_are_pinned():
    # on-device dtype codes: part of the format, never renumber
    assert {k: v[0] for k, v in DTYPES.items()} == {
        "float16": 1, "bfloat16": 2, "float32": 3, "float8_e4m3fn": 4,
        "float8_e5m2": 5, "int8": 6, "uint8": 7}


# ------------------------------------------------------------------ round trip
def test_round_trip():
    sb = golden_superblock()
    assert Superblock.decode(sb.encode()) == sb
    assert Superblock.decode(sb.encode()).clean


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kv_parts", [1, 2])
def test_round_trip_geometries(dtype, kv_parts):
    g = Geometry(num_layers=3, num_kv_heads=6, head_dim=64, dtype=dtype, block_tokens=16,
                 kv_parts=kv_parts, head_groups=3)
    sb = golden_superblock(geometry=g, flags=0, device_count=1, device_index=0,
                           device_uuids=DEV_UUIDS[:1], fingerprint=bytes(32))
    back = Superblock.decode(sb.encode())
    assert back == sb
    assert back.geometry == g
    assert not back.clean


def test_decode_accepts_longer_buffers_and_memoryview():
    b = golden_superblock().encode()
    assert Superblock.decode(b + b"junk" * 100) == golden_superblock()
    assert Superblock.decode(memoryview(bytearray(b))) == golden_superblock()


def test_encode_is_deterministic_and_sequence_changes_bytes():
    a = golden_superblock().encode()
    assert a == golden_superblock().encode()
    b = golden_superblock(sequence=2).encode()
    assert a != b
    assert u64(b, 184) == 2


# ------------------------------------------------------------------ corruption
SAMPLE_POSITIONS = sorted(set(
    list(range(0, 192))                          # the whole fixed header
    + list(range(192, 704, 7))                   # device uuid table
    + list(range(704, 4088, 97))                 # zero area
    + list(range(4088, 4096))                    # the checksum itself
))


def test_every_single_byte_corruption_is_rejected():
    good = golden_superblock().encode()
    for pos in SAMPLE_POSITIONS:
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(good)
            bad[pos] ^= flip
            with pytest.raises(NotAStoreError) as ei:
                Superblock.decode(bytes(bad), "/dev/x", 4096)
            assert ei.value.path == "/dev/x"
            assert ei.value.offset == 4096
            assert "/dev/x" in str(ei.value)


@pytest.mark.parametrize("data", [b"", b"\0" * 4096, b"KVBLKSB\0", MAGIC + bytes(4000),
                                  b"\xff" * 4096])
def test_foreign_or_short_data_is_not_a_store(data):
    with pytest.raises(NotAStoreError):
        Superblock.decode(data, "/dev/y", 0)


def test_truncated_valid_superblock_is_not_a_store():
    good = golden_superblock().encode()
    for n in (8, 192, 4088, 4095):
        with pytest.raises(NotAStoreError):
            Superblock.decode(good[:n])


def test_wrong_version_rechecksummed_raises_unsupported_version():
    buf = bytearray(golden_superblock().encode())
    struct.pack_into("<I", buf, 8, 7)
    data = rechecksum(buf)
    with pytest.raises(UnsupportedVersionError) as ei:
        Superblock.decode(data, "/dev/nvme0n1", 0)
    msg = str(ei.value)
    assert "7" in msg and str(FORMAT_VERSION) in msg
    assert "version 7" in msg and f"version {FORMAT_VERSION}" in msg
    assert "/dev/nvme0n1" in msg
    assert isinstance(ei.value, KVBlockError)
    assert not isinstance(ei.value, NotAStoreError)


@pytest.mark.parametrize("older", [True, False])
def test_a_version_error_says_which_release_wrote_the_store_and_the_fix(older):
    """A superblock of another format version said "use a matching kvblock
    release or reformat": not which (older or newer), nor how, nor which
    copy.  It names the copy's offset, whether an older or a newer release
    wrote it, and the fix for that: reformat (or that older release), or
    upgrade kvblock."""
    version = FORMAT_VERSION - 1 if older else FORMAT_VERSION + 1
    buf = bytearray(golden_superblock().encode())
    struct.pack_into("<I", buf, 8, version)
    with pytest.raises(UnsupportedVersionError) as ei:
        Superblock.decode(rechecksum(buf), "/dev/nvme0n1", 4096)
    msg = str(ei.value)
    assert ei.value.version == version and ei.value.offset == 4096
    assert msg.startswith(f"/dev/nvme0n1: superblock at offset 4096 has on-device format "
                          f"version {version}, this kvblock reads version {FORMAT_VERSION}; ")
    if older:
        assert "written by an older kvblock release" in msg
        assert "reformat it (kvblock format --force" in msg
        assert f"a kvblock release that reads version {version}" in msg
    else:
        assert "written by a newer kvblock release" in msg
        assert f"upgrade kvblock to a release that reads format version {version}" in msg


def test_rechecksummed_nonsense_is_not_a_store():
    good = golden_superblock().encode()
    cases = {
        "unknown dtype": (148, "<B", 99),
        "zero layers": (128, "<I", 0),
        "kv_parts 3": (149, "<B", 3),
        "heads not divisible": (144, "<I", 3),
        "device count 0": (50, "<H", 0),
        "device count 33": (50, "<H", 33),
        "index >= count": (48, "<H", 3),
    }
    for name, (at, fmt, value) in cases.items():
        buf = bytearray(good)
        struct.pack_into(fmt, buf, at, value)
        with pytest.raises(NotAStoreError) as ei:
            Superblock.decode(rechecksum(buf), "/dev/q", 0)
        assert "/dev/q" in str(ei.value), name


# ------------------------------------------------------------------ pick()
def _copy(seq, **kw):
    return golden_superblock(sequence=seq, **kw).encode()


def _corrupt(data: bytes, at: int = 300) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x5A
    return bytes(b)


def test_pick_highest_sequence():
    a, b = _copy(5), _copy(6)
    assert pick([a, b], "p").sequence == 6
    assert pick([b, a], "p").sequence == 6
    assert pick([_copy(9), _copy(2)], "p").sequence == 9


def test_pick_falls_back_to_the_valid_copy():
    newer_corrupt = _corrupt(_copy(10))
    older = _copy(3)
    assert pick([newer_corrupt, older], "p").sequence == 3
    assert pick([older, newer_corrupt], "p").sequence == 3
    # a torn copy (zeros after the first sector) is corrupt too
    torn = _copy(11)[:512] + bytes(4096 - 512)
    assert pick([torn, older], "p").sequence == 3
    assert pick([older, torn], "p").sequence == 3


def test_pick_both_corrupt_raises_not_a_store():
    with pytest.raises(NotAStoreError) as ei:
        pick([_corrupt(_copy(1)), _corrupt(_copy(2))], "/dev/z")
    assert ei.value.path == "/dev/z"
    assert ei.value.offset == 0  # the first copy's error
    with pytest.raises(NotAStoreError):
        pick([bytes(4096), bytes(4096)], "/dev/z")


def test_pick_both_unreadable_with_one_newer_version_reports_the_version():
    buf = bytearray(_copy(4))
    struct.pack_into("<I", buf, 8, FORMAT_VERSION + 1)
    future = rechecksum(buf)
    with pytest.raises(UnsupportedVersionError):
        pick([_corrupt(_copy(3)), future], "p")
    with pytest.raises(UnsupportedVersionError):
        pick([future, bytes(4096)], "p")
    # and a valid copy of our version beside it is not taken either (below)
    with pytest.raises(UnsupportedVersionError):
        pick([future, _copy(1)], "p")


@pytest.mark.parametrize("future_at", [0, 4096])
def test_pick_refuses_a_newer_version_copy_beside_a_valid_older_one(future_at):
    """A copy with a valid checksum but a newer format version beside a
    valid copy of this version is what a later release's in-place upgrade
    cut short between the two copies leaves: the store is that release's
    now.  pick() took the older copy silently (the open failed later as
    "metadata corrupt", and fsck --repair wrote the older copy over the
    newer one).  It is refused, naming the device, both copies' versions
    and the fix (upgrade kvblock)."""
    buf = bytearray(_copy(4))
    struct.pack_into("<I", buf, 8, FORMAT_VERSION + 1)
    future = rechecksum(buf)
    copies = [future, _copy(3)] if future_at == 0 else [_copy(3), future]
    with pytest.raises(UnsupportedVersionError) as ei:
        pick(copies, "/dev/u")
    msg = str(ei.value)
    assert ei.value.path == "/dev/u" and ei.value.offset == future_at
    assert msg.startswith("/dev/u: ")
    assert f"offset {future_at}" in msg and f"format version {FORMAT_VERSION + 1}" in msg
    assert f"version {FORMAT_VERSION}" in msg
    assert "newer kvblock release" in msg and "upgrade kvblock" in msg
    assert "reformat" not in msg.split("upgrade kvblock")[0]


def test_copy_offsets():
    assert sbfmt.COPY_OFFSETS == (0, 4096)
    # each copy's error names its own offset; pick reports the first copy's
    with pytest.raises(NotAStoreError) as ei:
        Superblock.decode(_corrupt(_copy(2)), "p", sbfmt.COPY_OFFSETS[1])
    assert ei.value.offset == 4096


def test_pick_with_no_copies_raises_kvblock_error():
    # pick() must only raise kvblock errors, even when handed no copies at all.
    with pytest.raises(KVBlockError):
        pick([], "p")


@pytest.mark.parametrize("value", [0, 512, 8192])
def test_a_header_bytes_field_other_than_4096_is_not_a_store(value):
    """Offset 12 holds the superblock's size, 4096 in every superblock this
    format writes (the golden layout); another value was accepted."""
    buf = bytearray(golden_superblock().encode())
    struct.pack_into("<I", buf, 12, value)
    with pytest.raises(NotAStoreError, match=f"/dev/q: superblock at offset 4096 .*header bytes "
                                             f"{value}") as ei:
        Superblock.decode(rechecksum(buf), "/dev/q", 4096)
    assert ei.value.path == "/dev/q" and ei.value.offset == 4096


def test_pick_refuses_valid_copies_that_disagree():
    """Copies of two stores, or of one differing at one sequence, are a
    SuperblockConflictError naming both offsets (the first valid copy won)."""
    from kvblock.errors import SuperblockConflictError

    foreign = _copy(1, store_uuid=bytes(16 * [7]))
    for copies in ([_copy(1), foreign], [foreign, _copy(1)], [_copy(2), foreign],
                   [_copy(1), _copy(1, created_ns=5)]):
        with pytest.raises(SuperblockConflictError) as ei:
            pick(copies, "/dev/s")
        assert isinstance(ei.value, NotAStoreError)
        assert ei.value.path == "/dev/s" and ei.value.offsets == (0, 4096)
        assert "/dev/s: the superblock copies at offsets 0 and 4096" in str(ei.value)
    assert "differ in created_ns" in str(ei.value)
    assert pick([_copy(1), _copy(1)], "p") == golden_superblock(sequence=1)


@pytest.mark.parametrize("torn_at", [0, 4096])
def test_one_damaged_copy_beside_a_blank_one_names_the_fix(torn_at):
    """A copy failing its checksum beside one holding no superblock (a
    format cut short inside its first write) said only "fails its checksum
    (corrupt)": nothing to do, though the store cannot be opened.  It names
    the damaged copy's offset, the blank one's, and the fix."""
    torn = _copy(1)[:512] + bytes(4096 - 512)
    copies = [torn, bytes(4096)] if torn_at == 0 else [bytes(4096), torn]
    with pytest.raises(NotAStoreError) as ei:
        pick(copies, "/dev/t")
    blank = 4096 - torn_at
    assert ei.value.path == "/dev/t" and ei.value.offset == torn_at
    assert str(ei.value) == (
        f"/dev/t: superblock at offset {torn_at} fails its checksum (corrupt) and the copy at "
        f"offset {blank} holds none; the store cannot be opened (a format cut short, or "
        "overwritten): reformat it (kvblock format --force)")


def test_golden_geometry_fields_are_pinned_apart():
    """The golden superblock has num_kv_heads == head_groups == 8, so
    neither its digest nor its field checks told the u32 at 132 from the
    u32 at 144: an encoder and decoder writing the two the other way round
    passed every format test, though the superblock on the device changes.
    (Its dtype code and kv_parts, alignment and header bytes are equal too.)
    A superblock whose geometry fields all differ, spelled out byte by byte
    (and decoded from those bytes)."""
    g = Geometry(num_layers=5, num_kv_heads=12, head_dim=96, dtype="float32",
                 block_tokens=32, kv_parts=1, head_groups=4)
    sb = golden_superblock(geometry=g, alignment=8192, region_size=3 << 20)
    b = sb.encode()
    assert b[12:16] == bytes([0, 0x10, 0, 0])           # header bytes 4096
    assert b[52:56] == bytes([0, 0x20, 0, 0])           # alignment 8192
    assert b[128:148] == bytes([5, 0, 0, 0, 12, 0, 0, 0, 96, 0, 0, 0, 32, 0, 0, 0,
                                4, 0, 0, 0])             # layers, heads, dim, tokens, groups
    assert b[148:152] == bytes([3, 1, 0, 0])             # dtype code (float32), kv_parts, 0
    back = Superblock.decode(b)
    assert back == sb and back.geometry == g and back.alignment == 8192
