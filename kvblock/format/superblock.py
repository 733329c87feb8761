"""The superblock: what a device holds, written twice at the start of every device.

Layout (4096 bytes, little-endian; bump FORMAT_VERSION when changing it)::

    0    8s  magic "KVBLKSB\\0"        120  Q  created (ns since epoch)
    8    I   format version            128  I  num_layers
    12   I   header bytes (4096)       132  I  num_kv_heads
    16   16s store uuid                136  I  head_dim
    32   16s device uuid               140  I  block_tokens
    48   H   device index              144  I  head_groups
    50   H   device count              148  B  dtype code, B kv_parts, H 0
    52   I   alignment                 152  32s model fingerprint
    56   Q   device bytes used         184  Q  superblock sequence
    64   Q   region size               192  32 x 16s device uuids
    72   I   regions on this device    704  ... zero
    76   I   flags (bit 0: clean)      4088 Q  xxh64 of bytes [0, 4088)
    80   Q   data offset
    88   Q   journal offset   96 Q journal bytes   (device 0 only)
    104  Q   checkpoint offset 112 Q checkpoint slot bytes (device 0 only)

Copy A sits at byte 0, copy B at byte 4096.  A reader takes the valid copy
with the highest sequence; both invalid means "not a kvblock device"; both
valid but of two stores, or different at one sequence, is refused (nothing
on the device tells which copy is its own); a copy of a newer format version
beside a valid one is refused too (a newer release's upgrade of the store,
cut short between the copies: the store is that release's).

Flag bit 0 (clean) is kept in the layout but not written by this release:
superblocks are written only by format(); whether a store was closed
cleanly is told by its checkpoint and journal (recovery's clean_at_open).
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields

from kvblock.errors import NotAStoreError, SuperblockConflictError, UnsupportedVersionError
from kvblock.format import FORMAT_VERSION
from kvblock.format.checksum import meta_checksum
from kvblock.layout.geometry import DTYPE_BY_CODE, DTYPES, Geometry

MAGIC = b"KVBLKSB\0"
SIZE = 4096
COPY_OFFSETS = (0, 4096)
MAX_DEVICES = 32
FLAG_CLEAN = 1

_HEAD = struct.Struct("<8sII16s16sHHIQQIIQQQQQQIIIIIBBH32sQ")
_UUIDS = struct.Struct("<" + "16s" * MAX_DEVICES)
_UUIDS_AT = 192
_CRC = struct.Struct("<Q")
_CRC_AT = SIZE - 8
assert _HEAD.size == 192


@dataclass(frozen=True)
class Superblock:
    store_uuid: bytes
    device_uuid: bytes
    device_index: int
    device_count: int
    alignment: int
    device_bytes: int
    region_size: int
    region_count: int
    data_offset: int
    geometry: Geometry
    fingerprint: bytes
    journal_offset: int = 0
    journal_bytes: int = 0
    checkpoint_offset: int = 0
    checkpoint_bytes: int = 0
    flags: int = 0
    created_ns: int = 0
    sequence: int = 1
    device_uuids: tuple = field(default_factory=tuple)
    version: int = FORMAT_VERSION

    @property
    def clean(self) -> bool:
        return bool(self.flags & FLAG_CLEAN)

    def with_(self, **changes) -> "Superblock":
        return replace(self, **changes)

    def layout_problem(self) -> str | None:
        """What makes this superblock's layout impossible (a checksum proves
        it was written whole, not that the writer was right), or None.  The
        areas a store reads and writes by it must be aligned, lie within the
        device and not overlap each other or the superblock copies."""
        a = self.alignment
        if a < 4096 or a & (a - 1):
            return f"alignment {a} is not a power of two of at least 4096"
        if self.region_size <= 0 or self.region_size % a:
            return (f"region_size {self.region_size} is not a positive multiple of the "
                    f"alignment {a}")
        areas = [("the superblock copies", "", 0, COPY_OFFSETS[-1] + SIZE)]
        if self.device_index == 0:
            for name, off, size, least in (
                    ("checkpoint", self.checkpoint_offset, self.checkpoint_bytes, 4096),
                    ("journal", self.journal_offset, self.journal_bytes, 4096)):
                if off % a or size % a or size < least:
                    return (f"{name}_offset {off}, {name}_bytes {size}: not multiples of the "
                            f"alignment {a} of at least {least} bytes")
                slots = 2 if name == "checkpoint" else 1
                areas.append((f"the {name} area", f" ({name}_offset {off}, {name}_bytes "
                              f"{size}{' x 2 slots' if slots > 1 else ''})",
                              off, off + slots * size))
        if self.data_offset % a:
            return f"data_offset {self.data_offset} is not a multiple of the alignment {a}"
        areas.append(("the data regions", f" (data_offset {self.data_offset} + region_count "
                      f"{self.region_count} x region_size {self.region_size})",
                      self.data_offset, self.data_offset + self.region_count * self.region_size))
        for i, (name, fields, start, end) in enumerate(areas):
            if end > self.device_bytes:
                return (f"{name}{fields} would end at byte {end}, past the device's end "
                        f"(device_bytes {self.device_bytes})")
            for other, ofields, ostart, oend in areas[:i]:
                if start < oend and ostart < end:
                    return (f"{name}{fields} [{start}, {end}) and {other}{ofields} "
                            f"[{ostart}, {oend}) overlap")
        return None

    def encode(self) -> bytes:
        g = self.geometry
        buf = bytearray(SIZE)
        _HEAD.pack_into(
            buf, 0, MAGIC, self.version, SIZE, self.store_uuid, self.device_uuid,
            self.device_index, self.device_count, self.alignment, self.device_bytes,
            self.region_size, self.region_count, self.flags, self.data_offset,
            self.journal_offset, self.journal_bytes, self.checkpoint_offset,
            self.checkpoint_bytes, self.created_ns, g.num_layers, g.num_kv_heads, g.head_dim,
            g.block_tokens, g.head_groups, DTYPES[g.dtype][0], g.kv_parts, 0,
            self.fingerprint, self.sequence)
        uuids = list(self.device_uuids) + [bytes(16)] * (MAX_DEVICES - len(self.device_uuids))
        _UUIDS.pack_into(buf, _UUIDS_AT, *uuids)
        _CRC.pack_into(buf, _CRC_AT, meta_checksum(bytes(buf[:_CRC_AT])))
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes, path: str = "?", offset: int = 0) -> "Superblock":
        """Parse one copy; raises NotAStoreError / UnsupportedVersionError."""
        data = bytes(data[:SIZE])
        if len(data) < SIZE or data[:8] != MAGIC:
            raise NotAStoreError(f"{path}: no kvblock superblock at offset {offset} "
                                 "(not formatted, or overwritten)", path, offset)
        if _CRC.unpack_from(data, _CRC_AT)[0] != meta_checksum(data[:_CRC_AT]):
            raise NotAStoreError(f"{path}: superblock at offset {offset} fails its checksum "
                                 "(corrupt)", path, offset)
        f = _HEAD.unpack_from(data, 0)
        version = f[1]
        if version != FORMAT_VERSION:
            if version > FORMAT_VERSION:
                how = ("the store was written by a newer kvblock release: "
                       + _upgrade_fix(version))
            else:
                how = ("the store was written by an older kvblock release: reformat it (kvblock "
                       "format --force; its cached KV is lost), or use a kvblock release that "
                       f"reads version {version}")
            raise UnsupportedVersionError(
                f"{path}: superblock at offset {offset} has on-device format version {version}, "
                f"this kvblock reads version {FORMAT_VERSION}; {how}", path, offset, version)
        if f[2] != SIZE:
            raise NotAStoreError(f"{path}: superblock at offset {offset} has header bytes "
                                 f"{f[2]}, not {SIZE} (not a superblock this format writes)",
                                 path, offset)
        dtype = DTYPE_BY_CODE.get(f[23])
        if dtype is None:
            raise NotAStoreError(f"{path}: superblock at offset {offset} names unknown dtype "
                                 f"code {f[23]}", path, offset)
        try:
            geometry = Geometry(num_layers=f[18], num_kv_heads=f[19], head_dim=f[20],
                                block_tokens=f[21], head_groups=f[22], dtype=dtype,
                                kv_parts=f[24])
        except Exception as e:  # a checksummed but nonsensical block: treat as foreign
            raise NotAStoreError(f"{path}: superblock at offset {offset} has an invalid "
                                 f"geometry ({e})", path, offset) from None
        count = f[6]
        if not 1 <= count <= MAX_DEVICES or f[5] >= count:
            raise NotAStoreError(f"{path}: superblock at offset {offset} has device "
                                 f"{f[5]} of {count}", path, offset)
        uuids = _UUIDS.unpack_from(data, _UUIDS_AT)[:count]
        return cls(store_uuid=f[3], device_uuid=f[4], device_index=f[5], device_count=count,
                   alignment=f[7], device_bytes=f[8], region_size=f[9], region_count=f[10],
                   flags=f[11], data_offset=f[12], journal_offset=f[13], journal_bytes=f[14],
                   checkpoint_offset=f[15], checkpoint_bytes=f[16], created_ns=f[17],
                   geometry=geometry, fingerprint=f[26], sequence=f[27],
                   device_uuids=tuple(uuids), version=version)


def _conflict(valid: list, path: str) -> SuperblockConflictError | None:
    """The error for valid copies that cannot be one store's (another
    store's written over one, or a field changed without a new sequence),
    or None.  A lower sequence of the same store is an update cut short."""
    (a, at), (b, bt) = valid
    if a.store_uuid != b.store_uuid:
        name = lambda sb: (f"store {uuid.UUID(bytes=sb.store_uuid)} (device {sb.device_index} "
                           f"of {sb.device_count}, {sb.geometry.describe()})")
        what = f"offset {at} names {name(a)}, offset {bt} another store, {name(b)}"
    elif a.sequence == b.sequence and a != b:
        names = [f.name for f in dataclass_fields(a) if getattr(a, f.name) != getattr(b, f.name)]
        what = (f"both name store {uuid.UUID(bytes=a.store_uuid)}, sequence {a.sequence}, "
                f"but differ in {', '.join(names)}")
    else:
        return None
    return SuperblockConflictError(
        f"{path}: the superblock copies at offsets {at} and {bt} are both valid but disagree "
        f"({what}); which is this device's cannot be told, so it is not opened. Reformat "
        f"the store (kvblock format --force with all its devices; its cached KV is lost)",
        path, (at, bt))


def _upgrade_fix(version: int) -> str:
    """The fix for a store of a newer format ``version`` (both refusals of one)."""
    return (f"upgrade kvblock to a release that reads format version {version} (or reformat "
            "the store with this one: kvblock format --force, its cached KV is lost)")


def pick(copies: list[bytes], path: str) -> Superblock:
    """The newest valid copy; the error of the first copy when none is
    valid; SuperblockConflictError when the valid copies disagree;
    UnsupportedVersionError when a copy is of a newer format version."""
    valid, errors = [], []
    for data, offset in zip(copies, COPY_OFFSETS):
        try:
            valid.append((Superblock.decode(data, path, offset), offset))
        except (NotAStoreError, UnsupportedVersionError) as e:
            errors.append(e)
    newer = [e for e in errors if isinstance(e, UnsupportedVersionError)
             and (e.version or 0) > FORMAT_VERSION]
    if valid and newer:
        # A later release's in-place upgrade cut short between the copies:
        # the store is that release's now, the older copy only its past.
        e, (sb, at) = newer[0], valid[0]
        raise UnsupportedVersionError(
            f"{path}: the superblock copy at offset {e.offset} has on-device format version "
            f"{e.version} (written by a newer kvblock release), the copy at offset {at} "
            f"version {sb.version}, which this kvblock reads: the newer release began to "
            "upgrade the store in place, so the store is not opened by the older copy; "
            + _upgrade_fix(e.version), path, e.offset, e.version)
    if len(valid) == 2 and (conflict := _conflict(valid, path)) is not None:
        raise conflict
    if valid:
        return max(valid, key=lambda v: v[0].sequence)[0]
    if not errors:
        raise NotAStoreError(f"{path}: no superblock copies to read", path, 0)
    version_errors = [e for e in errors if isinstance(e, UnsupportedVersionError)]
    if version_errors:
        raise version_errors[0]
    corrupt = [e for e in errors if "fails its checksum" in str(e)]
    if len(corrupt) > 1:
        raise NotAStoreError(f"{path}: every superblock copy (offsets "
                             f"{' and '.join(str(o) for o in COPY_OFFSETS)}) fails its checksum "
                             "(corrupt); the store cannot be opened: reformat it", path, 0)
    blank = [e.offset for e in errors if "no kvblock superblock" in str(e)]
    if corrupt and len(blank) + 1 == len(COPY_OFFSETS):
        blank = " and ".join(map(str, blank))
        raise NotAStoreError(f"{corrupt[0]} and the copy at offset {blank} holds none; the "
                             "store cannot be opened (a format cut short, or overwritten): "
                             "reformat it (kvblock format --force)", path, corrupt[0].offset)
    raise corrupt[0] if corrupt else errors[0]
