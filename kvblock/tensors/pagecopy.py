"""Page copies between an engine's host KV cache and kvblock's staging in one
native pass: one ``memcpy`` per contiguous row (``kvb_copy_rows``), rows
addressed from the page ids with numpy, the copy itself without the GIL.

On the gather side ``cache[ids]`` first builds a fresh array (fresh memory
is slow to touch on small VMs) that then has to be copied again into
staging; a row copy moves each byte once, whatever the page order, and
rows of 1 KiB or more are written with non-temporal stores (no
read-for-ownership of destination lines nobody reads soon).  Measured on
the 2-core dev VM, 2048 random 32 KiB pages (a microbenchmark,
medians of 7): gather 3.8 GiB/s with numpy (cache[ids] then a copy), 9.7 on
one native thread with memcpy, 12.7 with streamed stores; scatter 9.7 with
numpy (a fancy assignment), 10.3 with memcpy, 16 with streamed stores.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

# Rows shorter than this go to numpy: a memcpy call per row of a few dozen
# bytes costs more than numpy's inner loops.
MIN_ROW_BYTES = 256
# One core's memcpy does not saturate memory bandwidth: a copy is split over
# up to COPY_THREADS threads (the caller's and threads the native call starts),
# one per SPLIT_BYTES at least.
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
SPLIT_BYTES = 1 << 20


def _lib():
    from kvblock.errors import NativeLibraryError
    from kvblock.io.native import lib

    try:
        return lib()
    except NativeLibraryError:  # not built: numpy does the copy
        return None


def _outer(base: int, first_offsets: np.ndarray, shape, strides) -> np.ndarray:
    """Absolute addresses of every row start over the outer dims (first axis
    already turned into byte offsets)."""
    off = first_offsets
    for size, stride in zip(shape, strides):
        off = (off[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
    return (off + base).view(np.uint64)


def copy_pages(dst: np.ndarray, src: np.ndarray, dst_ids=None, src_ids=None, *,
               threads: int | None = None) -> bool:
    """``dst[dst_ids] = src[src_ids]`` along the first axis (``None``: every
    page, in order) of two host numpy arrays with the same trailing shape and
    item size.  Returns False, having copied nothing, when the layout does not
    suit a row copy (rows under MIN_ROW_BYTES, ids out of range or negative,
    shapes that differ, a read-only destination, no native library); the
    caller copies with numpy then and keeps numpy's semantics and errors.
    ``threads``: how many threads may share a large copy (default COPY_THREADS)."""
    rows = row_plan(dst, src, dst_ids, src_ids)
    if rows is None:
        return False
    if rows.dst.size == 0:
        return True
    lib = _lib()
    if lib is None:
        return False
    copy_rows(lib, rows, rows.dst, rows.src, threads, dst_ids)
    return True


class Rows(NamedTuple):
    """A row copy: ``dst[i] + j * steps[0]`` <- ``src[i] + j * steps[1]``,
    ``row`` bytes, for every address i and j < ``m``."""
    dst: np.ndarray      # uint64 row addresses
    src: np.ndarray
    m: int
    steps: tuple[int, int]
    row: int


def row_plan(dst: np.ndarray, src: np.ndarray, dst_ids=None, src_ids=None, *,
             min_row: int = MIN_ROW_BYTES) -> Rows | None:
    """The rows :func:`copy_pages` copies (no library needed, nothing
    copied): None where it would refuse the layout (rows under ``min_row``
    bytes among its reasons); no rows for no pages.  A caller copying the
    same layout many times (a block at a time) plans once and moves the
    addresses (:func:`copy_rows`)."""
    if (dst.dtype.itemsize != src.dtype.itemsize or dst.shape[1:] != src.shape[1:]
            or not dst.flags.writeable):
        return None
    n = dst.shape[0] if dst_ids is None else len(dst_ids)
    if n != (src.shape[0] if src_ids is None else len(src_ids)):
        return None
    if n == 0:
        none = np.zeros(0, np.uint64)
        return Rows(none, none, 0, (0, 0), 0)
    firsts = []
    for ids, arr in ((dst_ids, dst), (src_ids, src)):
        if ids is None:
            ids = np.arange(n, dtype=np.int64)
        else:
            ids = np.asarray(ids)
            # One flat list of integers, as the copy takes them: 2-d ids
            # made more row addresses on their side than on the other, and
            # the native copy read the shorter list past its end; a float
            # or bool (mask) id cast to int64 named other pages than numpy's
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                return None
            ids = ids.astype(np.int64, copy=False)
            if ids.min() < 0 or ids.max() >= arr.shape[0]:
                return None
        firsts.append(ids * arr.strides[0])
    # The trailing dims contiguous in both arrays make one row.
    d, row = dst.ndim - 1, dst.dtype.itemsize
    while d >= 1 and (dst.shape[d] == 1 or (dst.strides[d] == row and src.strides[d] == row)):
        row *= dst.shape[d]
        d -= 1
    if row < min_row:
        return None
    # The innermost outer dim becomes (m rows, byte steps); the rest are addressed.
    m, steps = (dst.shape[d], (dst.strides[d], src.strides[d])) if d >= 1 else (1, (0, 0))
    outer = slice(1, d) if d >= 1 else slice(1, 1)
    dst_at = _outer(dst.__array_interface__["data"][0], firsts[0], dst.shape[outer],
                    dst.strides[outer])
    src_at = _outer(src.__array_interface__["data"][0], firsts[1], src.shape[outer],
                    src.strides[outer])
    return Rows(dst_at, src_at, m, steps, row)


def copy_rows(lib, rows: Rows, dst_at: np.ndarray, src_at: np.ndarray,
              threads: int | None = None, dst_ids=None) -> None:
    """Copy ``rows`` (a :func:`row_plan`'s layout) at row addresses
    ``dst_at`` and ``src_at`` (uint64, contiguous, as many of each: the
    plan's own, or moved to other pages of the same layout).  ``dst_ids``:
    the plan's destination page ids, if any (a page written twice is
    copied in order)."""
    from kvblock.io.native import ptr

    count = dst_at.size
    parts = min(COPY_THREADS if threads is None else max(1, threads), count,
                max(1, count * rows.m * rows.row // SPLIT_BYTES))
    if parts > 1 and dst_ids is not None and np.unique(dst_ids).size < len(dst_ids):
        parts = 1   # a page written twice: in order, the last write wins (as numpy's)
    lib.kvb_copy_rows(count, ptr("uint64_t *", dst_at), ptr("uint64_t *", src_at),
                      rows.m, rows.steps[0], rows.steps[1], rows.row, parts)
