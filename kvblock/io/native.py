"""cffi (ABI mode) binding of the native core built from native/ by CMake.

The declarations below mirror native/kvblock_io.h; ``kvb_abi_version`` guards
against a stale library left over from an older build.
"""

from __future__ import annotations

import errno
import os
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
from cffi import FFI

from kvblock.errors import ConfigError, DeviceError, NativeLibraryError

ABI_VERSION = 7
LIB_NAME = "libkvblock_io.so"

CDEF = """
typedef struct kvb_ring kvb_ring;
typedef struct kvb_hasher kvb_hasher;
kvb_ring *kvb_ring_create(unsigned entries, int *err);
void kvb_ring_destroy(kvb_ring *ring);
int kvb_ring_set_files(kvb_ring *ring, const int *fds, unsigned n);
int kvb_ring_set_buffers(kvb_ring *ring, const uint64_t *addrs, const uint64_t *lens, unsigned n);
int64_t kvb_ring_run(kvb_ring *ring, int op, uint64_t n, const uint64_t *addrs,
                     const uint32_t *devs, const uint64_t *offsets, const uint64_t *lens,
                     unsigned qd, int64_t *results, int64_t *latency_ns, kvb_hasher *hasher);
int64_t kvb_pio_run(int op, uint64_t n, const uint64_t *addrs, const uint32_t *devs,
                    const int *fds, unsigned nfds, const uint64_t *offsets,
                    const uint64_t *lens, int64_t *results, int64_t *latency_ns,
                    uint64_t *cursor, kvb_hasher *hasher);
kvb_hasher *kvb_hasher_create(uint64_t n, const uint64_t *addrs, const uint64_t *lens,
                              const uint32_t *streams, uint32_t nstreams,
                              const uint64_t *seeds, int64_t *results, uint64_t *digests,
                              int *err);
int64_t kvb_hasher_finish(kvb_hasher *hasher);
int64_t kvb_hash_pieces(uint64_t n, const uint64_t *addrs, const uint64_t *lens,
                        const uint32_t *streams, uint32_t nstreams, const uint64_t *seeds,
                        uint64_t *digests);
int64_t kvb_hash_blocks_ranges(uint64_t nranges, uint64_t nblocks, const uint64_t *addrs,
                               uint64_t block_len, uint64_t pad, uint64_t seed,
                               uint64_t *block_digests, uint64_t *range_digests);
void kvb_copy_rows(uint64_t n, const uint64_t *dst, const uint64_t *src,
                   uint64_t m, int64_t dst_step, int64_t src_step, uint64_t len,
                   unsigned threads);
int64_t kvb_mem_read(uint64_t n, const uint64_t *addrs, const uint32_t *devs,
                     const uint64_t *bases, const uint64_t *sizes, unsigned nbases,
                     const uint64_t *offsets, const uint64_t *lens, int64_t *results,
                     int64_t *latency_ns, kvb_hasher *hasher);
int64_t kvb_mem_write(uint64_t n, const uint64_t *addrs, const uint32_t *devs,
                      const uint64_t *bases, const uint64_t *sizes, unsigned nbases,
                      const uint64_t *offsets, const uint64_t *lens, int64_t *results,
                      int64_t *latency_ns, kvb_hasher *hasher);
int64_t kvb_mem_copy_hashed(int to_map, uint64_t n, const uint64_t *addrs,
                            const uint32_t *devs, const uint64_t *bases, const uint64_t *sizes,
                            unsigned nbases, const uint64_t *offsets, const uint64_t *lens,
                            int64_t *results, int64_t *latency_ns, const uint32_t *streams,
                            uint32_t nstreams, const uint64_t *seeds, uint64_t *digests);
int kvb_mem_prefault(uint64_t addr, uint64_t len);
int64_t kvb_fs_type(int fd);
int kvb_abi_version(void);
"""

ffi = FFI()
ffi.cdef(CDEF)


def _candidates() -> list[Path]:
    env = os.environ.get("KVBLOCK_NATIVE_LIB")
    found = [Path(env)] if env else []
    here = Path(__file__).resolve().parent.parent  # the kvblock package
    found.append(here / "_native" / LIB_NAME)
    # Editable installs put the built library in site-packages, not next to the source.
    found += [Path(p) / "kvblock" / "_native" / LIB_NAME for p in sys.path if p]
    return found


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:   # a sys.path entry this user may not search (another user's home)
        return False


@lru_cache(maxsize=1)
def lib():
    """The loaded native library (raises :class:`NativeLibraryError`)."""
    tried = []
    # A core named on purpose (another build to test) loads, or it is an
    # error: passing over it ran the package's own core, unsaid.
    env = os.environ.get("KVBLOCK_NATIVE_LIB")
    chosen = (f"KVBLOCK_NATIVE_LIB={env}: {{}}; give the path of a built {LIB_NAME}, "
              "or unset it to load the package's own") if env else None
    for path in _candidates():
        named = chosen if env and path == Path(env) else None
        if named and not _is_file(path):
            raise NativeLibraryError(named.format("no such file"))
        if _is_file(path):
            try:
                # a path as the file system takes it: dlopen searches the
                # library path for a name without a slash (KVBLOCK_NATIVE_LIB=
                # libkvblock_io.so), never the working directory the file is in
                handle = ffi.dlopen(str(path.absolute()))
            except OSError as e:
                if named:
                    raise NativeLibraryError(named.format(f"cannot be loaded ({e})")) from None
                tried.append(f"{path} ({e})")
                continue
            try:
                version = handle.kvb_abi_version()
            except AttributeError as e:
                # A shared library, but not kvblock's core (cffi's
                # AttributeError names the symbol it lacks): the error
                # README promises (exit 10), not a traceback.
                if named:
                    raise NativeLibraryError(named.format(
                        f"is not kvblock's native core ({e})")) from None
                raise NativeLibraryError(f"{path}: not kvblock's native core ({e}); rebuild "
                                         "with `pip install -e .` (or `make install`)") from None
            if version != ABI_VERSION:
                raise NativeLibraryError(
                    f"{path}: native ABI version {version}, this package needs {ABI_VERSION}; "
                    "rebuild with `pip install -e .` (or `make install`)")
            return handle
        tried.append(str(path))
    raise NativeLibraryError(
        f"{LIB_NAME} not found (looked in: {', '.join(tried[:4])}); build it with "
        "`pip install -e .` (needs cmake and liburing-dev), or set KVBLOCK_NATIVE_LIB")


def ptr(ctype: str, array):
    """A cffi pointer to a contiguous numpy array's data (or NULL for None).
    ``ctype`` is a pointer type ("uint64_t *"); the array is passed as a
    buffer of that element type (ffi.from_buffer: no ctypes round trip)."""
    if array is None:
        return ffi.NULL
    return ffi.from_buffer(_ARRAY_TYPES.get(ctype) or _array_type(ctype), array)


_ARRAY_TYPES: dict[str, str] = {}


def _array_type(ctype: str) -> str:
    _ARRAY_TYPES[ctype] = ctype.replace("*", "[]").replace(" []", "[]")
    return _ARRAY_TYPES[ctype]


class Hasher:
    """A native kvb_hasher over numpy arrays it keeps alive until finish():
    a batch run given ``handle`` fills ``digests`` as its reads land (see
    native/kvblock_io.h)."""

    __slots__ = ("handle", "_keep")

    def __init__(self, addrs, lens, streams, seeds, results, digests):
        check_pieces("kvb_hasher_create", addrs, lens, streams, seeds, digests, results)
        err = ffi.new("int *")
        self._keep = (addrs, lens, streams, seeds, results, digests)
        self.handle = lib().kvb_hasher_create(
            len(addrs), ptr("uint64_t *", addrs), ptr("uint64_t *", lens),
            ptr("uint32_t *", streams), len(seeds), ptr("uint64_t *", seeds),
            ptr("int64_t *", results), ptr("uint64_t *", digests), err)
        if self.handle == ffi.NULL:
            raise _hasher_error("kvb_hasher_create", len(addrs), -err[0])

    def finish(self) -> int:
        """Hash what is left and free the native hasher (once)."""
        handle, self.handle = self.handle, ffi.NULL
        return lib().kvb_hasher_finish(handle) if handle != ffi.NULL else 0


def hash_blocks_ranges(addrs, nranges: int, nblocks: int, block_len: int, pad: int,
                       seed: int):
    """A run's block digests ((nranges, nblocks) uint64) and range checksums
    (nranges uint64) in one pass: ``addrs`` holds each block's address,
    range-major; a range is its blocks in order, then ``pad`` zero bytes.
    Each is XXH3-64 with ``seed`` (format.checksum.data_checksum's)."""
    addrs = np.ascontiguousarray(addrs, dtype=np.uint64)
    if addrs.size != nranges * nblocks:
        raise ValueError(f"hash_blocks_ranges: {addrs.size} addresses for {nranges} ranges "
                         f"x {nblocks} blocks")
    blocks = np.zeros((nranges, nblocks), dtype=np.uint64)
    ranges = np.zeros(nranges, dtype=np.uint64)
    ret = lib().kvb_hash_blocks_ranges(nranges, nblocks, ptr("uint64_t *", addrs), block_len,
                                       pad, seed, ptr("uint64_t *", blocks),
                                       ptr("uint64_t *", ranges))
    if ret < 0:
        raise MemoryError(f"kvb_hash_blocks_ranges: {os.strerror(-ret)}")
    return blocks, ranges


def hash_pieces(addrs, lens, streams, seeds, digests) -> None:
    """digests[s] = XXH3-64 (seed seeds[s]) of stream s's pieces, which are
    in memory already (same numbering rules as Hasher)."""
    check_pieces("kvb_hash_pieces", addrs, lens, streams, seeds, digests)
    ret = lib().kvb_hash_pieces(len(addrs), ptr("uint64_t *", addrs), ptr("uint64_t *", lens),
                                ptr("uint32_t *", streams), len(seeds), ptr("uint64_t *", seeds),
                                ptr("uint64_t *", digests))
    if ret < 0:
        raise _hasher_error("kvb_hash_pieces", len(addrs), -ret)


_U64, _U32, _I64 = np.dtype(np.uint64), np.dtype(np.uint32), np.dtype(np.int64)


def check_pieces(call: str, addrs, lens, streams, seeds, digests, results=None,
                 n: int | None = None) -> None:
    """ConfigError unless the arrays of a hashed batch fit what the native
    hasher does with them: it reads ``lens`` and ``streams`` (and writes
    ``results``) up to the piece count, writes ``digests`` up to the
    stream count (``seeds``), and takes each as its C type, through its
    buffer.  One shorter was read or written past its end (the heap), one
    of another dtype read as that type, a read-only one written; a strided
    one was cffi's bare ValueError, seeds without a length (an int, a
    generator) a bare TypeError out of len()."""
    arrays = (("addresses", addrs, _U64, False), ("lengths", lens, _U64, False),
              ("stream indices", streams, _U32, False), ("seeds", seeds, _U64, False),
              ("digests", digests, _U64, True), ("results", results, _I64, True))
    for name, arr, dtype, out in arrays:
        if arr is None and name in ("addresses", "results"):
            continue
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.ndim != 1 or \
                not arr.flags.c_contiguous or (out and not arr.flags.writeable):
            got = (f"{'non-contiguous ' if not arr.flags.c_contiguous else ''}{arr.dtype} "
                   f"array of shape {arr.shape}" if isinstance(arr, np.ndarray)
                   else type(arr).__name__)
            raise ConfigError(f"{call}: the {name} must be a 1-d contiguous"
                              f"{' writable' if out else ''} {dtype} array, got a {got}; "
                              f"pass np.ascontiguousarray(..., dtype=np.{dtype})"
                              f"{' (a copy of a read-only one)' if out else ''}")
    n = addrs.size if n is None else n
    for name, arr, size in (("addresses", addrs, n), ("lengths", lens, n),
                            ("stream indices", streams, n), ("digests", digests, seeds.size),
                            ("results", results, n)):
        if arr is not None and arr.size != size:
            raise ConfigError(f"{call}: the {name} must be a 1-d {arr.dtype} array of "
                              f"{size} entries (one per {'stream' if name == 'digests' else 'piece'}), "
                              f"got {arr.size}")


def _hasher_error(call: str, pieces: int, code: int):
    """A native hasher that could not be made: bad stream numbering
    (EINVAL, the caller's) is a ConfigError; no memory for it a DeviceError
    (as a mapped copy's hasher), not an I/O of any run."""
    text = f"{call} for a hashed read of {pieces} piece(s): {os.strerror(code)}"
    if code == errno.EINVAL:
        return ConfigError(text + " (stream numbers must count 0, 1, ... in piece order)")
    return DeviceError(text, None, code)
