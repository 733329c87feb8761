"""Native page copies (kvb_copy_rows): the same bytes as numpy's indexing for
any page order and strided view, and a clean refusal (nothing written) where
a row copy does not apply."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblock.tensors import pagecopy
from kvblock.tensors.pagecopy import MIN_ROW_BYTES, copy_pages

RNG = np.random.default_rng(7)


def pages(n, *shape, dtype=np.int16):
    return RNG.integers(-30000, 30000, (n, *shape)).astype(dtype)


def test_scatter_random_ids_matches_numpy():
    cache = pages(64, 16, 8, 32)
    want = cache.copy()
    src = pages(20, 16, 8, 32)
    ids = RNG.permutation(64)[:20]
    want[ids] = src
    assert copy_pages(cache, src, dst_ids=ids)
    assert np.array_equal(cache, want)


def test_gather_from_strided_views_matches_numpy():
    # staging [group][page][kv][token][head][dim] <- cache pages, one head group at a time
    cache = pages(40, 16, 8, 64)
    staged = np.zeros((2, 10, 2, 16, 4, 64), np.int16)
    ids = RNG.permutation(40)[:10]
    for g in range(2):
        assert copy_pages(staged[g, :, 1], cache[:, :, g * 4:(g + 1) * 4], src_ids=ids)
    want = cache[ids].reshape(10, 16, 2, 4, 64).transpose(2, 0, 1, 3, 4)
    assert np.array_equal(staged[:, :, 1], want)
    assert not staged[:, :, 0].any()  # the other KV part is untouched


def test_both_sides_indexed_and_transposed_source():
    src_base = pages(30, 4, 16, 256)                   # (page, head, token, dim): HND
    src = src_base.transpose(0, 2, 1, 3)               # viewed as NHD: rows of one head
    dst = np.zeros((30, 16, 4, 256), np.int16)
    a, b = RNG.permutation(30)[:12], RNG.permutation(30)[:12]
    want = dst.copy()
    want[a] = src[b]
    assert copy_pages(dst, src, dst_ids=a, src_ids=b)
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("case", ["short rows", "id out of range", "negative id", "read-only",
                                  "shape", "itemsize", "count"])
def test_refuses_without_writing(case):
    dst = np.zeros((8, 16, 8, 32), np.int16)
    src = pages(4, 16, 8, 32)
    ids = np.array([1, 3, 5, 7])
    if case == "short rows":
        dst, src = np.zeros((8, 2, 8), np.int16), pages(4, 2, 8)  # 32-byte pages
        assert dst[0].nbytes < MIN_ROW_BYTES
    elif case == "id out of range":
        ids = np.array([1, 3, 5, 8])
    elif case == "negative id":
        ids = np.array([1, 3, -1, 7])
    elif case == "read-only":
        dst.flags.writeable = False
    elif case == "shape":
        src = pages(4, 16, 8, 16)
    elif case == "itemsize":
        src = src.astype(np.int32)
    else:
        ids = np.array([1, 3, 5])
    assert copy_pages(dst, src, dst_ids=ids) is False
    assert not dst.any()


def test_empty_copy_is_done():
    assert copy_pages(np.zeros((4, 512), np.int8), np.zeros((0, 512), np.int8),
                      dst_ids=np.array([], np.int64))


def test_without_native_library_numpy_is_left_to_copy(monkeypatch):
    monkeypatch.setattr(pagecopy, "_lib", lambda: None)
    dst = np.zeros((4, 16, 8, 32), np.int16)
    assert copy_pages(dst, pages(4, 16, 8, 32)) is False
    assert not dst.any()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), extra=st.integers(0, 6), tokens=st.sampled_from([1, 4, 16]),
       heads=st.sampled_from([1, 2, 8]), dim=st.sampled_from([8, 64, 128]),
       head_slice=st.booleans(), dst_side=st.booleans(), seed=st.integers(0, 2**31))
def test_any_page_order_and_head_slice_matches_numpy(n, extra, tokens, heads, dim, head_slice,
                                                     dst_side, seed):
    rng = np.random.default_rng(seed)
    total = n + extra
    cache = rng.integers(-100, 100, (total, tokens, heads, dim)).astype(np.int16)
    ids = rng.permutation(total)[:n]
    h = slice(0, max(1, heads // 2)) if head_slice else slice(None)
    view = cache[:, :, h]
    other = rng.integers(-100, 100, (n, *view.shape[1:])).astype(np.int16)
    sliced = view.shape[2]
    row = sliced * dim * 2 * (tokens if sliced == heads else 1)  # bytes contiguous in both
    if dst_side:       # scatter: cache[ids] = other
        want = cache.copy()
        want[:, :, h][ids] = other
        before = cache.copy()
        done = copy_pages(view, other, dst_ids=ids)
        assert np.array_equal(cache, want if done else before)
    else:              # gather: other = cache[ids]
        out = np.zeros_like(other)
        done = copy_pages(out, view, src_ids=ids)
        assert np.array_equal(out, view[ids]) if done else not out.any()
    assert done == (row >= MIN_ROW_BYTES)


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_copy_split_over_threads_matches_numpy(monkeypatch, threads):
    """A copy cut over several native threads lands every page once."""
    monkeypatch.setattr(pagecopy, "SPLIT_BYTES", 4096)
    cache = np.zeros((50, 16, 4, 64), np.int16)
    src = pages(37, 16, 4, 64)
    ids = RNG.permutation(50)[:37]
    want = cache.copy()
    want[ids] = src
    assert copy_pages(cache, src, dst_ids=ids, threads=threads)
    assert np.array_equal(cache, want)


@pytest.mark.parametrize("shift", [0, 1], ids=["aligned", "dst-off-by-2-bytes"])
def test_streamed_rows_with_tails_and_unaligned_destinations(shift):
    """Long rows are written with non-temporal stores when the destination is
    16-byte aligned (else memcpy); a row whose length is not a multiple of
    64 bytes ends with an ordinary copy.  Same bytes either way."""
    flat = np.zeros(40 * 4 * 518 + 8, np.int16)
    cache = flat[shift:shift + 40 * 4 * 518].reshape(40, 4, 518)   # rows of 4144 bytes
    src = pages(13, 4, 518)
    ids = RNG.permutation(40)[:13]
    want = cache.copy()
    want[ids] = src
    assert copy_pages(cache, src, dst_ids=ids)
    assert np.array_equal(cache, want)
    assert not flat[:shift].any() and not flat[shift + cache.size:].any()   # nothing around


def test_repeated_destination_pages_keep_numpy_order(monkeypatch):
    """A destination page named twice ends up with the later source page, as
    with numpy, even when the copy would be split over threads."""
    class Spy:                         # records how many threads each copy used
        def __init__(self, real):
            self.real, self.threads = real, []

        def kvb_copy_rows(self, *args):
            self.threads.append(args[-1])
            return self.real.kvb_copy_rows(*args)

    spy = Spy(pagecopy._lib())
    monkeypatch.setattr(pagecopy, "_lib", lambda: spy)
    monkeypatch.setattr(pagecopy, "SPLIT_BYTES", 4096)
    cache = np.zeros((8, 16, 4, 64), np.int16)
    src = pages(6, 16, 4, 64)
    ids = np.array([1, 5, 2, 5, 7, 5])
    want = cache.copy()
    want[ids] = src
    assert copy_pages(cache, src, dst_ids=ids, threads=4)
    assert np.array_equal(cache, want) and np.array_equal(cache[5], src[5])
    assert copy_pages(cache, src, dst_ids=np.array([1, 5, 2, 0, 7, 6]), threads=4)
    assert spy.threads == [1, 4]      # split only where no page is written twice


@pytest.mark.parametrize("case", ["2-d dst ids", "2-d src ids", "float ids", "bool ids"])
def test_ids_numpy_indexes_otherwise_are_left_to_numpy(monkeypatch, case):
    """Ids that are not one flat list of integers: 2-d ids made more row
    addresses on their side than on the other, and the native copy read
    the shorter address array past its end (addresses out of the heap:
    a crash, or bytes copied to or from anywhere).  Float and bool ids
    were cast (a bool mask became pages 0 and 1).  Such ids are refused
    (nothing written), and numpy's indexing does what it does with them."""
    calls = []
    real = pagecopy._lib()

    class Spy:
        def kvb_copy_rows(self, count, dst, src, *rest):
            calls.append((count, len(dst), len(src)))
            if count > min(len(dst), len(src)):
                return None           # (past an array's end: not run)
            return real.kvb_copy_rows(count, dst, src, *rest)

    monkeypatch.setattr(pagecopy, "_lib", lambda: Spy())
    dst = np.zeros((8, 512), np.int8)
    src = pages(2, 512, dtype=np.int8)
    dst_ids, src_ids = np.array([1, 6]), None
    if case == "2-d dst ids":
        dst_ids = np.array([[0, 1], [2, 3]])       # numpy: src broadcast to (2, 2, 512)
    elif case == "2-d src ids":
        dst, src = np.zeros((2, 512), np.int8), pages(8, 512, dtype=np.int8)
        dst_ids, src_ids = None, np.array([[0, 1], [2, 3]])   # numpy: a shape error
    elif case == "float ids":
        dst_ids = np.array([1.0, 6.0])
    else:
        src = pages(8, 512, dtype=np.int8)
        dst_ids = np.zeros(8, bool)
        dst_ids[[1, 6]] = True
    assert all(count <= min(d, s) for count, d, s in calls)
    assert copy_pages(dst, src, dst_ids=dst_ids, src_ids=src_ids) is False
    assert not dst.any() and not calls
