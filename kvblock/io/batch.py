"""A batch of direct I/Os as four parallel numpy arrays.

Higher layers build batches with vectorised numpy (one array per field), and
the engines hand the arrays to C in one call, so Python never loops per I/O.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from kvblock.errors import ConfigError
from kvblock.units import is_whole

# Linux caps one read/write at MAX_RW_COUNT (2 GiB - 4 KiB); larger requests are
# split.  Splitting at a few MiB also lets one big range use the whole queue.
DEFAULT_MAX_IO = 8 << 20


def _out_of_range(e: OverflowError | None, entry: str | None = None) -> ConfigError:
    """The ConfigError for a value that does not fit its field (numpy's
    OverflowError names the value)."""
    what = entry or str(e).replace("Python integer ", "").split(" out of bounds")[0]
    return ConfigError(f"IOBatch: {what}: a value out of range; offsets, lengths and "
                       "addresses are non-negative and below 2**64, device indices below "
                       "2**32")


def _not_integer(what: str) -> ConfigError:
    return ConfigError(f"IOBatch: {what} is not an integer; addresses, device indices, "
                       "offsets and lengths are whole numbers (cast to one, a fraction is "
                       "dropped: use // or round to the device's blocks first)")


_FIELDS = frozenset(("addrs", "devs", "offsets", "lens"))
_set = object.__setattr__
_setflags = np.ndarray.setflags       # (called so: a third of arr.flags.writeable = ...)
_U64, _U32 = np.dtype(np.uint64), np.dtype(np.uint32)
# IOBatch.single's fields, packed: arrays over bytes are read-only as made,
# and cheaper than an array each from a list
_PACK_SINGLE = struct.Struct("=QQQ").pack
_PACK_DEV = struct.Struct("=I").pack


def _frozen(arr: np.ndarray) -> np.ndarray:
    """``arr`` (a new array the batch owns) made read-only."""
    _setflags(arr, False)
    return arr


def _frozen_view(arr: np.ndarray) -> np.ndarray:
    """A read-only view of ``arr``, which may be a caller's array (left
    writable: it is the caller's to change for its next batch)."""
    view = arr.view()
    _setflags(view, False)
    return view


def _whole(v) -> bool:
    """Whether ``v`` is an integer, or a float of an integral value."""
    if isinstance(v, (int, np.integer)):
        return True
    return isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer()


def _integers(values, name: str) -> np.ndarray:
    """``values`` as an array of whole numbers: ConfigError for a value that
    is none (a fraction, cast to an integer, was dropped: an offset of
    4096.5 read the bytes at 4096; a string was parsed) or a negative one."""
    arr = np.asarray(values)
    if arr.dtype.kind == "f" and not isinstance(values, np.ndarray):
        # Python ints, one of them past 2**63: numpy made them float64
        # (rounded past 2**53); as objects they stay exact
        arr = np.asarray(values, dtype=object)
    kind = arr.dtype.kind
    if arr.size and kind not in "iub":
        if kind == "f":
            whole = bool(np.isfinite(arr).all() and (arr == np.trunc(arr)).all())
        else:
            whole = all(map(_whole, arr.reshape(-1).tolist()))
        if not whole:
            bad = next(v for v in arr.reshape(-1).tolist() if not _whole(v))
            raise _not_integer(f"{name} value {bad!r}")
        if kind == "f" and arr.max() >= 2.0 ** 64:
            raise _out_of_range(None, str(arr.max()))
    if kind in "ifO" and arr.size and arr.min() < 0:
        raise _out_of_range(None, str(arr.min()))
    return arr


@dataclass
class IOBatch:
    """The fields are fixed once the batch is built: read-only arrays, which
    cannot be replaced either (ConfigError).  The native calls index every
    field up to the address count, as the batch was built and checked: a
    field replaced by a shorter array, or one of another dtype, was read past
    its end, and lengths changed in place ran I/Os past the caller's
    buffers.  Build a new batch instead.  A batch built from a caller's
    array of the fields' dtype (uint64; devs uint32) holds a read-only view
    of it: the caller may still change that array, and the batch with it
    (a length changed so is the caller's own I/O past its buffers): change
    it only between submits, or build the batch from a copy."""

    addrs: np.ndarray    # uint64 host buffer addresses
    devs: np.ndarray     # uint32 index into the engine's device table
    offsets: np.ndarray  # uint64 byte offsets on the device
    lens: np.ndarray     # uint64 byte counts
    # Objects whose memory entries point into (a write's small buffers), held
    # as long as the batch is; concat() carries them over.
    keep = None

    def __setattr__(self, name, value):
        # (the dataclass __init__ sets each field once; a field has no class
        # attribute, so it is there only once set)
        if name in _FIELDS and hasattr(self, name):
            raise ConfigError(f"IOBatch: its {name} cannot be replaced: a batch's fields are "
                              "fixed once it is built and checked; build a new IOBatch")
        _set(self, name, value)

    def __post_init__(self):
        try:
            self._convert()
        except OverflowError as e:   # a negative Python int (or one past 2**64)
            raise _out_of_range(e) from None

    def _convert(self):
        # A signed array's negative values would wrap to near 2**64 in the cast
        # (numpy raises OverflowError for Python ints only): refuse them alike.
        addrs = np.ascontiguousarray(_integers(self.addrs, "addrs"), dtype=np.uint64).reshape(-1)
        n = addrs.size
        devs = _integers(self.devs, "devs")
        if devs.dtype != np.uint32 and devs.size and (devs.min() < 0 or devs.max() > 0xFFFFFFFF):
            raise ConfigError(f"IOBatch: device index {int(devs.min())}..{int(devs.max())} "
                              "out of range")
        lens = _integers(self.lens, "lens")
        for name, field in (("devs", devs), ("lens", lens)):
            if field.size != 1 and field.shape != (n,):
                raise ConfigError(f"IOBatch: {n} addresses but {field.size} {name}: give "
                                  f"one per address, or one for all")
        devs = np.ascontiguousarray(np.broadcast_to(devs.reshape(-1), (n,)), dtype=np.uint32)
        offsets = np.ascontiguousarray(_integers(self.offsets, "offsets"),
                                       dtype=np.uint64).reshape(-1)
        lens = np.ascontiguousarray(np.broadcast_to(lens.reshape(-1), (n,)), dtype=np.uint64)
        if offsets.size != n:
            raise ConfigError(f"IOBatch: {n} addresses but {offsets.size} offsets: "
                              "give one offset per address")
        for name, field in (("addrs", addrs), ("devs", devs), ("offsets", offsets),
                            ("lens", lens)):
            _set(self, name, _frozen_view(field))

    def __len__(self) -> int:
        return int(self.addrs.size)

    @property
    def nbytes(self) -> int:
        return int(self.lens.sum())

    @classmethod
    def single(cls, address: int, dev: int, offset: int, length: int) -> "IOBatch":
        # Built field by field: __post_init__'s conversions cost more than the
        # I/O itself for a small read.
        if not (type(address) is int and type(dev) is int and type(offset) is int
                and type(length) is int):
            for name, value in (("address", address), ("device", dev), ("offset", offset),
                                ("length", length)):
                if not _whole(value):
                    raise _not_integer(f"{name} {value!r}")
            address, dev, offset, length = int(address), int(dev), int(offset), int(length)
        b = object.__new__(cls)
        try:
            if min(address, offset, length, dev) < 0:
                raise struct.error
            raw = np.frombuffer(_PACK_SINGLE(address, offset, length), _U64)
            devs = np.frombuffer(_PACK_DEV(dev), _U32)
        except struct.error:   # a value below 0, or past 2**64 (a device past 2**32)
            raise _out_of_range(None, f"offset {offset}, length {length}, address {address}, "
                                f"device {dev}") from None
        _set(b, "addrs", raw[0:1])
        _set(b, "devs", devs)
        _set(b, "offsets", raw[1:2])
        _set(b, "lens", raw[2:3])
        return b

    @classmethod
    def listed(cls, addrs: list[int], dev: int | list[int], offsets: list[int],
               lens: list[int]) -> "IOBatch":
        """A batch from lists of ints of equal length, on one device (an int)
        or one per entry (a list), built field by field, as single()."""
        n = len(addrs)
        # (the native calls index every field up to len(addrs): a short one
        # would be read past its end, and _validate's zip would stop there)
        for name, field in (("devs", dev if isinstance(dev, list) else [dev] * n),
                            ("offsets", offsets), ("lens", lens)):
            if len(field) != n:
                raise ConfigError(f"IOBatch: {n} addresses but {len(field)} {name}: give "
                                  "one per address")
        for name, field in (("addrs", addrs), ("devs", dev if isinstance(dev, list) else [dev]),
                            ("offsets", offsets), ("lens", lens)):
            if not set(map(type, field)) <= {int} and not all(map(_whole, field)):
                bad = next(v for v in field if not _whole(v))
                raise _not_integer(f"{name} value {bad!r}")
        low = min(min(field, default=0) for field in (addrs, offsets, lens))
        if low < 0:     # a numpy scalar would wrap in the cast, not raise
            raise _out_of_range(None, str(low))
        b = object.__new__(cls)
        try:
            _set(b, "addrs", _frozen(np.array(addrs, dtype=np.uint64)))
            _set(b, "devs", _frozen(np.array(dev if isinstance(dev, list) else [dev] * n,
                                             dtype=np.uint32)))
            _set(b, "offsets", _frozen(np.array(offsets, dtype=np.uint64)))
            _set(b, "lens", _frozen(np.array(lens, dtype=np.uint64)))
        except OverflowError as e:
            raise _out_of_range(e) from None
        return b

    @classmethod
    def concat(cls, batches: list["IOBatch"]) -> "IOBatch":
        """One batch of the entries of ``batches``, in order."""
        b = object.__new__(cls)
        for name in ("addrs", "devs", "offsets", "lens"):
            _set(b, name, _frozen(np.concatenate([getattr(x, name) for x in batches])))
        keep = [x.keep for x in batches if x.keep is not None]
        if keep:
            b.keep = keep
        return b

    @classmethod
    def contiguous(cls, address: int, dev: int, offset: int, length: int,
                   io_size: int) -> "IOBatch":
        """One device range and one host range cut into ``io_size`` pieces."""
        if not (isinstance(length, (int, np.integer)) and isinstance(io_size, (int, np.integer))
                and length >= 0 and io_size > 0):
            raise ConfigError(f"IOBatch.contiguous: a range of {length!r} bytes in pieces of "
                              f"{io_size!r}: the length must be a whole number of bytes from "
                              "0, the piece size one from 1")
        # as single(): cast by np.uint64, a fraction was dropped (an offset
        # of 4096.5 read the bytes at 4096) and a negative value raised
        # numpy's OverflowError
        for name, value in (("address", address), ("device", dev), ("offset", offset)):
            if not _whole(value):
                raise _not_integer(f"{name} {value!r}")
            if not 0 <= value < 1 << 64:
                raise _out_of_range(None, f"{name} {value}")
        address, offset = int(address), int(offset)
        starts = np.arange(0, length, io_size, dtype=np.uint64)
        lens = np.minimum(np.uint64(io_size), np.uint64(length) - starts)
        return cls(starts + np.uint64(address), dev, starts + np.uint64(offset), lens)

    def split(self, max_io: int) -> tuple["IOBatch", np.ndarray | None]:
        """Cut entries longer than ``max_io`` into pieces.

        Returns the new batch and, when anything was cut, ``parent``: for each
        piece the index of the entry it came from (None when nothing was cut).
        """
        if not is_whole(max_io) or not 1 <= max_io < 1 << 64:
            # (0 or less raised numpy's OverflowError; 1.5 cut 1-byte pieces)
            raise ConfigError(f"IOBatch.split: pieces of {max_io!r} bytes: the piece size "
                              "must be a whole number of bytes from 1 (the engine's max_io)")
        max_io = int(max_io)
        if len(self) == 0 or self.lens.max() <= max_io:
            return self, None
        # ceil(len / max_io) without lens + max_io - 1, which wrapped past
        # 2**64 (an entry cut into no piece: dropped)
        pieces = (self.lens // np.uint64(max_io)
                  + (self.lens % np.uint64(max_io) != 0)).astype(np.int64)
        parent = np.repeat(np.arange(len(self)), pieces)
        first = np.cumsum(pieces) - pieces
        within = (np.arange(parent.size) - first[parent]).astype(np.uint64) * np.uint64(max_io)
        lens = np.minimum(np.uint64(max_io), self.lens[parent] - within)
        return IOBatch(self.addrs[parent] + within, self.devs[parent],
                       self.offsets[parent] + within, lens), parent
