"""Save pages of an engine's KV cache as a run; load a stored prefix back,
layer by layer, into any tensor-parallel slice.

Save gathers every layer's pages into one aligned buffer in the store's order
``[layer][group][block][kv][token][head][dim]`` (one native row copy per layer
and KV part, kvblock.tensors.pagecopy) and writes it as one run.  Load is a two-stage pipeline: a reader
thread reads each layer's range(s) of every run of the prefix in units of
about 8 MiB (32 MiB into a CUDA cache; the first unit read alone, later ones up to two
to an I/O batch while buffers are free); a scatter thread checks each unit against
the ranges' streaming checksums and copies its pages into the cache while the
next unit is read.  ``LoadHandle.wait_layer(l)`` returns as soon as layer l is in
place, while later layers are still being read.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import math
import operator
import queue
import threading
import time

import numpy as np

from kvblock.errors import (ConfigError, IOFailedError, KVBlockError, ServerGoneError,
                             StoreClosedError)
from kvblock.format.checksum import data_hasher
from kvblock.index import normalize_keys
from kvblock.io import IOBatch
from kvblock.memory import HostBuffer
from kvblock.tensors import pagecopy
from kvblock.tensors.layouts import CacheLayout, _is_torch, _StridedPages
from kvblock.tensors.pagecopy import Rows, copy_pages, copy_rows, row_plan
from kvblock.units import is_whole, timeout_setting

logger = logging.getLogger("kvblock")
_NP_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _torch_int(itemsize):
    import torch

    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def _raw(x, itemsize):
    """Reinterpret elements as same-size integers (bytes move, values don't matter)."""
    if _is_torch(x):
        return x.view(_torch_int(itemsize))
    return x.view(_NP_INT[itemsize])


def _ids_for(view, page_ids):
    if _is_torch(view) or isinstance(view, _StridedPages):
        import torch

        device = view.device if _is_torch(view) else view.t.device
        ids = torch.from_numpy(np.asarray(page_ids, dtype=np.int64))
        if device.type == "cuda":
            # Page-locked and copied without a wait, in order on the
            # stream before the scatter that uses it: from pageable memory
            # the copy waited for the stream, each unit's queued scatters
            # included (torch keeps the page-locked copy until it is done).
            return ids.pin_memory().to(device, non_blocking=True)
        return ids.to(device)
    return np.asarray(page_ids, dtype=np.int64)


def _host_np(view, itemsize):
    """A numpy view (raw ints, no copy) of a page view that lives in host
    memory (a CPU torch tensor, a numpy array, or HF's strided pages of a
    CPU tensor), else None (GPU tensors keep the torch path).  Gather and
    scatter copy through it once, straight between the cache and staging:
    indexing into a fresh tensor first and copying that doubled the bytes
    moved (and torch's threaded copy contends with the model's own threads on
    small machines)."""
    if isinstance(view, np.ndarray):
        return _raw(view, itemsize)
    if _is_torch(view) and view.device.type == "cpu" and not view.requires_grad:
        return _raw(view, itemsize).numpy()
    if isinstance(view, _StridedPages) and view.t.device.type == "cpu" and \
            not view.t.requires_grad:
        hd = _raw(view.t[0], itemsize).numpy()             # (heads, tokens, dim)
        pages, bt, heads, dim = view.shape
        s_h, s_t, s_d = hd.strides
        return np.lib.stride_tricks.as_strided(             # (pages, bt, heads, dim)
            hd, shape=(pages, bt, heads, dim), strides=(bt * s_t, s_t, s_h, s_d))
    return None


def _spans(ids: np.ndarray):
    """[(a, b)]: ids[a:b] are consecutive page numbers, for slice copies; None
    when an id is negative (then the indexing path keeps its semantics)."""
    if ids.size == 0 or ids.min() < 0:
        return None
    cuts = (np.nonzero(np.diff(ids) != 1)[0] + 1).tolist()
    return list(zip([0] + cuts, cuts + [ids.size]))


def _is_cupy(x) -> bool:
    """A cupy array (or one like it: CUDA memory with an explicit host copy,
    ``.get()``), which numpy's implicit conversion refuses."""
    return not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__") \
        and hasattr(x, "get")


def _copy_into(dst_np: np.ndarray, src) -> None:
    """dst (a numpy view of host staging) <- src (numpy, torch on any
    device, or cupy)."""
    if _is_torch(src):
        import torch

        torch.from_numpy(dst_np).copy_(src)
    elif _is_cupy(src):
        # cupy refuses numpy's implicit conversion (TypeError): its host
        # copy is explicit
        dst_np[...] = src.get()
    else:
        dst_np[...] = src


def _as_like(host_np: np.ndarray, like):
    """A host staging array as the cache's array type (a CPU torch tensor
    shares its memory; CUDA torch and cupy get a device copy)."""
    if _is_torch(like) or isinstance(like, _StridedPages):
        import torch

        t = torch.from_numpy(host_np)
        device = like.device if _is_torch(like) else like.t.device
        return t if device.type == "cpu" else t.to(device, non_blocking=False)
    if _is_cupy(like):
        # cupy copies no host array implicitly: a setitem from one raised
        # ValueError, failing every load into a cupy cache (seen on an
        # H200); copied to the thread's current device, the cache's
        import cupy

        return cupy.asarray(host_np)
    return host_np


def save_blocks(store, keys, layout: CacheLayout, page_ids) -> int:
    """Store the cache pages ``page_ids`` (one per key, in token order) as a run.

    Returns the blocks written (0 when admission declines).  The cache must
    hold every head (save from an unsharded cache, or from rank 0 of a store
    with one head group per rank).
    """
    g = store.geometry
    _check_layout(layout, "save")
    layout.check(g)
    keys = normalize_keys(keys)
    n = len(keys)
    ids = _page_id_array(page_ids, "save")
    if len(ids) != n:
        raise ConfigError(f"save: {n} keys but {len(ids)} page ids")
    if n == 0:
        return 0
    ids = _check_page_ids(layout, ids, "save")
    # Inside the store's InFlight: close() frees the staging buffer gathered
    # into below, so it waits for the gather (put_run is then refused).
    token = []
    try:     # entered inside the try, left with its token (see the note below)
        store._inflight.enter(token)
        return _gather_and_put(store, keys, layout, ids)
    finally:
        try:
            store._inflight.leave(token)
        except BaseException:     # cut as it left: again (note after save_blocks)
            store._inflight.leave(token)
            raise


# The store's InFlight is entered (or held) with a token, inside the try
# whose cleanup leaves it with that token, in a try of its own: cut as it
# leaves (a KeyboardInterrupt), it leaves again (it counts out once), then
# the interrupt is raised.  Entered before the try or left with no token, a
# Ctrl-C as enter returned (the call counted) or as leave began kept the
# call counted for good: close() waited CLOSE_WAIT_S (30 s), then left the
# devices open and locked (as in_flight's wrapper does for the store's calls).


def _gather_and_put(store, keys, layout: CacheLayout, ids: np.ndarray) -> int:
    """save_blocks' copy of the pages into staging and its put_run."""
    g, n = store.geometry, len(keys)
    if store._stored_whole(keys):
        # put_run would write nothing (a duplicate, counted there): its
        # pages are not copied for it
        return n
    itemsize = g.itemsize
    G, Hg, BS, D, kv = g.head_groups, g.heads_per_group, g.block_tokens, g.head_dim, g.kv_parts
    spans = _spans(ids)
    top = int(ids.max()) if ids.size else -1
    # A per-thread buffer kept by the store: a fresh one per save would be
    # touched anew every time (slow for multi-GiB prefixes).
    buf = store._staging(n * g.block_bytes, "gather")
    staged = buf.array[:n * g.block_bytes].view(_NP_INT[itemsize]).reshape(
        g.num_layers, G, n, kv, BS, Hg, D)
    for layer in range(g.num_layers):
        for k, view in enumerate(layout.layer_views(layer)):
            host = _host_np(view, itemsize)
            if host is not None and all(
                    copy_pages(staged[layer, gi, :, k], host[:, :, gi * Hg:(gi + 1) * Hg],
                               src_ids=ids) for gi in range(G)):
                continue  # row copies straight from the cache pages, in any page order
            if host is not None and spans is not None and top < host.shape[0]:
                for a, b in spans:  # one copy per stretch of consecutive pages
                    src = host[ids[a]:ids[a] + b - a]                  # (b-a, BS, H, D)
                    for gi in range(G):
                        staged[layer, gi, a:b, k] = src[:, :, gi * Hg:(gi + 1) * Hg]
                continue
            # the checked host ids: page_ids may be a CUDA tensor (no numpy view)
            pages = _raw(view[_ids_for(view, ids)], itemsize)           # (n, BS, H, D)
            pages = pages.reshape(n, BS, G, Hg, D)
            pages = pages.permute(2, 0, 1, 3, 4) if _is_torch(pages) \
                else pages.transpose(2, 0, 1, 3, 4)
            _copy_into(staged[layer, :, :, k], pages)
    return store.put_run(keys, buf.array[:n * g.block_bytes])


def _check_layout(layout, what: str) -> None:
    """The engine's cache itself (a list of tensors) passed for its layout
    failed with AttributeError "'list' object has no attribute 'check'"."""
    if not isinstance(layout, CacheLayout):
        raise ConfigError(f"{what}: layout must be a CacheLayout over the engine's cache, got "
                          f"{type(layout).__name__}; wrap the cache in one, e.g. "
                          "VLLMLayout(kv_caches), SGLangHostLayout(kv_buffer, layout, "
                          "page_size) or HFDynamicLayout.from_cache(cache, block_tokens)")


def _page_id_array(page_ids, what: str) -> np.ndarray:
    """The page ids as a 1-D int64 array (a torch tensor on any device, a
    cupy array, a list, a numpy array).  Before anything takes their len():
    one id or a generator raised TypeError "object of type 'int' has no
    len()"."""
    try:
        if _is_torch(page_ids):
            page_ids = page_ids.cpu()
        elif _is_cupy(page_ids):
            # cupy refuses numpy's implicit conversion (TypeError), which
            # read as ids that are no sequence of integers: copy them over
            page_ids = page_ids.get()
        ids = np.asarray(page_ids)
    except (TypeError, ValueError):   # ragged lists and the like
        ids = None
    if ids is None or ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ConfigError(f"{what}: page ids must be a 1-D sequence of integers (one cache "
                          f"page per key, in token order), got {type(page_ids).__name__}")
    # an unsigned id past int64 would be cast to a negative one it never was
    if ids.dtype.kind == "u" and ids.size and ids.max() > np.iinfo(np.int64).max:
        raise ConfigError(f"{what}: page id {int(ids.max())} is outside any cache (page ids "
                          "are below 2**63): pass the cache's page numbers")
    return ids.astype(np.int64, copy=False)


def _check_page_ids(layout: CacheLayout, page_ids, what: str) -> np.ndarray:
    """The page ids as int64, each a page of the cache (a negative id would
    wrap around to the cache's end, one past it fail mid-copy)."""
    ids = _page_id_array(page_ids, what)
    pages = layout.layer_views(0)[0].shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= pages):
        bad = int(ids[(ids < 0) | (ids >= pages)][0])
        note = layout.pages_note(bad, what) if bad >= 0 else ""
        raise ConfigError(f"{what}: page id {bad} is outside the cache's {pages} pages{note}")
    return ids


def _check_distinct(ids: np.ndarray) -> None:
    """A load's page ids name each page once: two blocks loaded into one
    page leave one of them lost while the load counts both (which one
    lands depends on the pieces' order; on a GPU index_put_ defines none)."""
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size < ids.size:
        dup = uniq[counts > 1][0]
        a, b = np.nonzero(ids == dup)[0][:2].tolist()
        raise ConfigError(f"load: page id {int(dup)} is given for keys {a} and {b}: a page "
                          "holds one block, so one of them would not be in the cache; pass "
                          "one page per key")


class LoadTimeoutError(KVBlockError, TimeoutError):
    """A load (or one of its layers) was not done within the timeout given
    to :meth:`LoadHandle.wait` / :meth:`LoadHandle.wait_layer`; it goes on."""


class LoadHandle:
    """A load in flight.  ``blocks`` is the number of leading pages loaded
    (final after :meth:`wait`; 0 when the load failed); ``wait_layer(l)``
    blocks until layer l is in the cache."""

    def __init__(self, num_layers: int, blocks: int):
        self.blocks = blocks
        self.num_layers = num_layers
        self._events = [threading.Event() for _ in range(num_layers)]
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.layer_ready_at = [0.0] * num_layers
        self.started_at = time.perf_counter()
        self.bytes_read = 0

    def wait_layer(self, layer: int, timeout: float | None = None) -> int:
        """Wait for one layer; returns the pages valid so far (may still shrink
        if a later layer fails its checksum: use :meth:`wait` for the final count)."""
        # -1 would silently wait for the last one; 2.5 index the events; a
        # bool (an int to isinstance) wait for layer 0 or 1; "0" printed as 0
        # would read as in range
        if not is_whole(layer):
            raise ConfigError(f"wait_layer: layer must be an int, got {layer!r} "
                              f"({type(layer).__name__})")
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"wait_layer: layer {layer} is not one of the store's "
                              f"{self.num_layers} layers (0-{self.num_layers - 1})")
        timeout = timeout_setting(timeout, "wait_layer")
        if not self._events[layer].wait(timeout):
            raise LoadTimeoutError(f"layer {layer} not loaded within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.blocks

    def wait(self, timeout: float | None = None) -> int:
        timeout = timeout_setting(timeout, "wait")
        if not self._done.wait(timeout):
            raise LoadTimeoutError(f"load not finished within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.blocks

    def done(self) -> bool:
        return self._done.is_set()

    def _fail(self, exc):
        self.blocks = 0    # a failed load delivers nothing (its later layers never arrived)
        self._error = exc
        for e in self._events:
            e.set()
        self._done.set()


def _tp_plan(g, tp_rank: int, tp_size: int):
    """(first store group, group count, head offset, heads) a rank reads."""
    # A float (2.0 from a JSON config) passed every check below, then
    # failed as a head slice in the scatter thread, after the reads; a
    # bool rank was taken for rank 0 or 1.
    for name, value in (("tp_rank", tp_rank), ("tp_size", tp_size)):
        if not is_whole(value, index=True):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    tp_rank, tp_size = operator.index(tp_rank), operator.index(tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    H = g.num_kv_heads
    if tp_size > H and tp_size % H == 0:
        # More ranks than KV heads: engines replicate each head over
        # tp_size / H ranks (MLA's one latent head over all of them).
        head = tp_rank // (tp_size // H)
        return head // g.heads_per_group, 1, head % g.heads_per_group, 1
    if H % tp_size:
        raise ConfigError(f"{H} kv heads do not split over tp_size {tp_size} (nor are they "
                          "replicated over it: a multiple of the heads)")
    heads = g.num_kv_heads // tp_size
    G = g.head_groups
    if tp_size % G == 0:          # as many or more ranks than groups: part of one group
        per = tp_size // G
        return tp_rank // per, 1, (tp_rank % per) * heads, heads
    if G % tp_size == 0:          # fewer ranks: several adjacent groups, one read
        per = G // tp_size
        return tp_rank * per, per, 0, heads
    raise ConfigError(f"store cut for {G} head groups cannot serve tp_size {tp_size}; "
                      "use a multiple or divisor of it")


def load_blocks(store, keys, layout: CacheLayout, page_ids, *, tp_rank: int = 0,
                tp_size: int = 1, background: bool = True) -> LoadHandle:
    """Load the stored prefix of ``keys`` into cache pages ``page_ids``, layer
    by layer, for rank ``tp_rank`` of ``tp_size`` (the cache holds that rank's
    heads).  Returns at once with a :class:`LoadHandle` (``background=False``
    loads before returning)."""
    # A close() waits for the load: left by its job, or here (with the
    # token: see the note after save_blocks).
    token, job = [], None
    try:
        store._inflight.enter(token)
        handle, job = _prepare_load(store, keys, layout, page_ids, tp_rank, tp_size)
        if job is None:            # nothing to read from the device
            store._inflight.leave(token)     # (cut: left again below)
            return handle
        job.token = token
        # From here the job leaves the InFlight (its scatter stage, last
        # thing) and unpins, once it owns them (``owned``, as it starts).
        if background:
            job.start()
        else:
            job.run_inline()
            handle.wait()
        return handle
    except BaseException:
        if job is not None and job.owned:
            raise
        try:
            if job is not None:    # cut before it started: its pins go here
                try:
                    store._unpin(job.segs)
                except BaseException:   # cut as it began: again (the rest, once)
                    store._unpin(job.segs)
                    raise
        except Exception as e:   # noqa: BLE001  (the load's own error is raised, not this)
            logger.warning("kvblock: releasing the pins of a load that did not start "
                           "failed: %s", e)
        finally:
            try:
                store._inflight.leave(token)
            except BaseException:     # cut as it left: again (note after save_blocks)
                store._inflight.leave(token)
                raise
        raise


def _prepare_load(store, keys, layout, page_ids, tp_rank, tp_size):
    """(handle, the job that reads the device, or None when nothing is
    stored there: the handle is done).  The runs it pins are unpinned if it
    raises after pinning them."""
    store._check_open()
    g = store.geometry
    g0, ng, h0, heads = _tp_plan(g, tp_rank, tp_size)
    _check_layout(layout, "load")
    layout.check(g, heads=heads, tp_size=tp_size)
    _check_writable(layout)
    keys = normalize_keys(keys)
    page_ids = _page_id_array(page_ids, "load")
    if len(page_ids) < len(keys):
        raise ConfigError(f"load: {len(keys)} keys but only {len(page_ids)} page ids")
    page_ids = _check_page_ids(layout, page_ids[:len(keys)], "load")
    _check_distinct(page_ids)
    job_class = _job_class(store, layout)      # before pinning: it may raise
    segs = None
    try:        # (a KeyboardInterrupt between the pinning and the job, too)
        if store.host is None:
            with store._lock:
                segs = store._segments(keys)
            n = sum(c for _, _, c, _ in segs)
        else:
            segs, n = _load_tiered(store, keys, layout, page_ids, g0, ng, h0, heads)
        handle = LoadHandle(g.num_layers, n)
        if segs:
            return handle, job_class(store, layout, segs, page_ids, g0, ng, h0, heads, handle)
    except BaseException:
        if segs:
            try:
                store._unpin(segs)
            except BaseException:   # cut as it began: again (the rest, once)
                store._unpin(segs)
                raise
        raise
    if n == 0:       # nothing stored: a miss, as for the other reads
        store.counters.add("miss_gets")
    _count_loaded(store, n, 0, heads)
    for e in handle._events:
        e.set()
    handle._done.set()
    return handle, None


def _check_writable(layout) -> None:
    """A load writes every layer's pages: a read-only numpy cache is refused
    here (numpy's plain ValueError in the scatter, after the reads, said
    neither which cache nor what to do)."""
    if not isinstance(layout.sample(), np.ndarray):
        return           # torch caches: written through torch (or a numpy view of CPU memory)
    for layer in range(layout.num_layers):
        for view in layout.layer_views(layer):
            if isinstance(view, np.ndarray) and not view.flags.writeable:
                raise ConfigError(
                    f"load: the {type(layout).__name__} cache is read-only at layer {layer} "
                    "(a numpy array with writeable=False); a load writes its pages: pass "
                    "writable arrays (a copy, or arr.flags.writeable = True where it owns "
                    "its memory)")


# A layer's reads are cut into units of about this many bytes: each unit is
# one I/O batch, checked and scattered while the next one is read.  A few
# unit buffers fit the CPU's last-level cache, so the checksum and the
# scatter read what the read has just put there rather than DRAM, staging
# memory does not grow with the prefix, and layer 0's first pages are in
# place before its last ones have been read.
UNIT_BYTES = 8 << 20
UNIT_BUFFERS = 3
# Into a CUDA cache the pieces cross to the GPU (and are cut there) per
# unit, and each unit costs the scatter stage a few kernel launches and the
# reader a wait: larger units.  H200, 1 GiB of KV on /dev/shm,
# KVIKIO_NTHREADS=8, 2026-12-04, medians of 6: kvikio path 8 MiB units
# 18.3-19.1 GiB/s, 16 MiB 22.4, 32 MiB 23.7 (kvikio's raw preads 24-26);
# host path 7.7-8.4 / 11.0-11.8 / 14.2-15.1.  Beside a fixed amount of
# compute (perf/gpu_bandwidth.py's) the restore took as long with any of
# the three (host 0.137-0.150 s / 0.139-0.145 / 0.138-0.143), and layer
# 0 came no later (3-6 ms).  (An earlier comparison said larger units hid
# worse: it sized the compute to each variant's own load time.)
CUDA_UNIT_BYTES = 32 << 20
# The kvikio path's staging is device memory, and kvikio splits each read
# over its thread pool: units in flight keep its threads busy (8 units of
# 8 MiB: 9.3 GiB/s where 3 gave 6.2, before CUDA_UNIT_BYTES).  128 MiB of
# GPU memory per load.
KVIKIO_UNIT_BUFFERS = 4


def _sample_tensor(layout):
    """The array behind ``layout.sample()``: a Hugging Face cache of
    several heads pages through _StridedPages (no torch tensor: no
    ``device`` nor ``is_cuda``), whose tensor is ``.t``."""
    sample = layout.sample()
    return sample.t if isinstance(sample, _StridedPages) else sample


def _job_class(store, layout):
    """_KvikioLoadJob for a CUDA cache when kvikio is the store's GPU path,
    else _LoadJob (host staging)."""
    sample = _sample_tensor(layout)
    if _is_torch(sample) and sample.is_cuda:
        from kvblock.io.gpu import gpu_path

        if gpu_path(store, device=sample.device) == "kvikio":   # timed on the cache's GPU
            return _KvikioLoadJob
    return _LoadJob


# (ServerGoneError, as every call that meets the server gone: a caller
# retrying once the store reconnects catches that one)
PINS_LAPSED = ("the store server went away during the load: its pins lapsed, so a "
               "restarted server may have reused the space read; treat the load as a miss")


def _lapsed(store) -> Exception:
    """The error of a load whose pins lapsed: the rank itself closed
    (StoreClosedError: no reconnect brings it back), or its server gone."""
    if store.closed:
        return StoreClosedError("the store was closed during the load: its pins went with "
                                "its connection; treat the load as a miss")
    return ServerGoneError(PINS_LAPSED)


class _LoadJob:
    """Reader thread -> units of (layer, pages of runs) -> scatter thread."""

    def __init__(self, store, layout, segs, page_ids, g0, ng, h0, heads, handle):
        # segs: (run, first position, count, position in the load); the
        # load's blocks outside them came from the DRAM tier
        self.store, self.layout, self.segs, self.handle = store, layout, segs, handle
        self.page_ids = np.asarray(page_ids, dtype=np.int64)
        self.g0, self.ng, self.h0, self.heads = g0, ng, h0, heads
        g = store.geometry
        self.verify = store.verify == "always"
        self.num_layers = g.num_layers
        self.cuda = _cuda_device(layout)
        self._plan(segs)
        self.seg_bytes = [0] * len(segs)         # bytes read per segment (the reader's)
        self.bad_runs = []
        self.q: queue.Queue = queue.Queue()      # units read, in order
        self.free: queue.Queue = queue.Queue()   # unit buffers not in use
        self.abort = False                       # the scatter stage failed: stop reading
        self._bufs: list = []
        self._stages = 2                         # reader and scatter still running
        self._stages_lock = threading.Lock()
        self._reader_thread: threading.Thread | None = None
        self._caller_work = None                 # start(): an event on the caller's stream
        self.token: list = []                    # load_blocks' InFlight token
        self.owned = False       # started: the scatter stage unpins and leaves the InFlight
        self._scatter_taken = False   # the scatter stage began, or its caller took it over
        self._reader_taken = False    # the reader stage began, or its starter took it over
        self._reader_token: list = []            # the reader's (hold)

    def _plan(self, segs):
        """Cut every layer's reads into units (the same cut for every layer).

        Per segment (a stored run's stretch of the prefix) and head group the
        read is one extent of the run's range: all of it when verifying (the
        checksum covers the whole range), else the aligned prefix holding the
        pages we need.  Extents are cut at page boundaries that are also
        alignment boundaries into pieces ``(segment, first page, end page,
        bytes per group, last piece?, offset in the unit buffer)``; pieces are
        packed into units of about UNIT_BYTES (CUDA_UNIT_BYTES into a CUDA
        cache).
        """
        store, ng = self.store, self.ng
        gbb, align = store.geometry.group_block_bytes, store.alignment
        step = align // math.gcd(gbb, align)          # pages per aligned cut
        cap = UNIT_BYTES if self.cuda is None else CUDA_UNIT_BYTES
        k = max(step, cap // (ng * gbb) // step * step)
        self.seg_info = []
        pieces = []
        for si, (run, pos, count, out_at) in enumerate(segs):
            lay = store.layout(run.nblocks)
            extent = lay.range_bytes if self.verify else lay.prefix_read_bytes(pos + count)
            dev, base = store.regions.address(run.region, run.offset)
            self.seg_info.append((run, lay, pos, count, out_at, dev, base))
            p = 0
            while True:
                b0, b1 = p * gbb, min(extent, (p + k) * gbb)
                last = b1 >= extent
                pieces.append((si, p, min(p + k, b1 // gbb, lay.nblocks), b1 - b0, last))
                if last:
                    break
                p += k
        self.units, unit, at, biggest = [], [], 0, 0
        for si, p0, p1, nbytes, last in pieces:
            if unit and at + ng * nbytes > cap:
                self.units.append(unit)
                biggest = max(biggest, at)
                unit, at = [], 0
            unit.append((si, p0, p1, nbytes, last, at))
            at += ng * nbytes
        self.units.append(unit)
        self.unit_bytes = max(biggest, at)

    def _unit_reads(self, layer: int, unit):
        """(device, device offset, buffer offset, bytes) of one unit's reads."""
        gbb = self.store.geometry.group_block_bytes
        out = []
        for si, p0, _p1, nbytes, _last, at in unit:
            _run, lay, _pos, _count, _out_at, dev, base = self.seg_info[si]
            for j in range(self.ng):
                out.append((dev, base + lay.range_offset(layer, self.g0 + j) + p0 * gbb,
                            at + j * nbytes, nbytes))
        return out

    # The store's InFlight: load_blocks entered it for the scatter stage,
    # which leaves it last thing; the reader holds it once more.
    # A thread that cannot start (RuntimeError "can't start new thread"):
    # the load fails with that error and leaves no call in flight and no
    # pin.  (Started reader first, a scatter thread that did not start left
    # the load's call in flight and its pins held for good.)  So the scatter
    # stage starts first: it is what unpins and leaves, and it hears of a
    # reader that did not start through the queue.
    def start(self):
        # The scatter thread writes the cache on its own CUDA stream: it
        # first waits for what the caller had queued on its stream by now
        # (with a non-default stream nothing orders the two otherwise, and
        # the caller's earlier writes to the pages could land after the load's).
        # (In the try: a CUDA error recording it left the runs pinned and
        # the load's call in flight for good.)
        # The reader is started inside the try too: a Ctrl-C once the
        # scatter thread ran (in Thread.start's wait for it, or as the
        # reader was started) released the pins and the token here while
        # that stage, whose cleanup does the same, waited for good for a
        # reader that never came (or, cut outside the try, released
        # nothing).  A stage that began is handed the error (it fails the
        # load, waits for a reader that started, unpins and leaves); one
        # that did not is taken (its thread then does nothing) and run here.
        try:
            self.owned = True    # (its start failed: unpinned and left below)
            self._caller_work = _record_cuda(self.cuda)
            scatter = threading.Thread(target=self._scatter, name="kvblock-load-scatter",
                                       daemon=True)
            scatter.start()
            reading = self._start_reader("kvblock-load-read")
        except BaseException as e:
            # Released here: cut as it set ``owned`` (before the assignment),
            # load_blocks unpinned a second time.
            self.owned = True
            if self._claim_scatter():
                self._scatter(e)   # unpins (its error logged) and leaves; the start's is raised
            else:
                self.q.put(e)
            raise
        if not reading:
            scatter.join()       # it fails the load, unpins and leaves
            self.handle.wait()   # raises the reader's error

    def run_inline(self):
        # Owned inside the try, which runs the scatter stage (its cleanup
        # unpins and leaves): a Ctrl-C between taking the load over and
        # entering the stage (as the reader was started, or as the stage
        # was called) left the pins and the InFlight token held for good
        # (load_blocks leaves them to an owning job).  Cut before the stage
        # began, it runs now and fails the load with the interrupt (it
        # waits for a reader already started, unpins once and leaves).
        try:
            self.owned = True
            self._start_reader(None)
            self._scatter()
        except BaseException as e:
            self.owned = True    # released here, not by load_blocks too (as start's)
            if self._claim_scatter():
                self._scatter(e)
            raise
        if self._reader_thread is not None:
            self._reader_thread.join()

    def _claim_scatter(self) -> bool:
        """Take the scatter stage for a caller that was cut before it began
        (it then never runs: the caller runs it with the error, or releases
        what it would); False when it began (it unpins and leaves)."""
        # one line, no call in it (as InFlight.enter): the stage's thread
        # and a Ctrl-C see it taken or not, never half way
        taken, self._scatter_taken = self._scatter_taken, True
        return not taken

    def _start_reader(self, name) -> bool:
        """Start the reader stage; False when its thread could not start
        (then the error is queued for the scatter stage, which fails the load)."""
        try:     # held inside the try, left with its token (note after save_blocks)
            # (made in the try too: a Ctrl-C as the Thread was made left the
            # scatter stage waiting for a reader that never came)
            t = self._reader_thread = threading.Thread(target=self._reader, name=name,
                                                       daemon=True)
            self.store._inflight.hold(self._reader_token)
            t.start()
        except BaseException as e:
            # A Ctrl-C in Thread.start's wait for the thread to run: it runs.
            # Taken for one that never started, its stage was counted done
            # twice (the unit buffers back to the store's spares while its
            # reads landed in them) and the scatter stage, not waiting for
            # it, unpinned and left while they were in flight.  Taken first
            # (it then does nothing), it is undone here; else it is waited for.
            if self._claim_reader():
                self._reader_thread = None   # nothing to join: no read is in flight
                # buffers back before the store's close can go on (as the
                # reader's own end does): else it may free its spares first
                self._stage_done()
                self.store._inflight.leave(self._reader_token)
            self.q.put(e)
            return False
        return True

    def _claim_reader(self) -> bool:
        """Take the reader stage for a starter whose start failed; False
        when its thread began it (it ends itself)."""
        taken, self._reader_taken = self._reader_taken, True   # one step (_claim_scatter)
        return not taken

    def _stage_done(self):
        """Called by each stage as it ends; the last one hands the unit
        buffers back to the store for the next load."""
        with self._stages_lock:
            self._stages -= 1
            last = self._stages == 0
        if last:
            spares = getattr(self.store, "spares", None)
            for b in self._bufs:
                if spares is not None and isinstance(b, HostBuffer):
                    spares.give(b)
            self._bufs = []

    def _unit_buffers(self) -> int:
        """How many unit buffers a load may have (read at the call: tests
        set the module's number)."""
        return UNIT_BUFFERS

    def _next_buffer(self):
        """A free unit buffer; a new one (``_new_buffer()``) while fewer than
        UNIT_BUFFERS exist and none is free, so a short load maps little."""
        if self.free.empty() and len(self._bufs) < self._unit_buffers():
            b = self._new_buffer()
            self._bufs.append(b)
            return b
        return self.free.get()  # returned by the scatter stage when it is done with it

    def _spare_buffer(self):
        """Another unit buffer if one is free or may be made now, else None."""
        try:
            return self.free.get_nowait()
        except queue.Empty:
            pass
        if len(self._bufs) < self._unit_buffers():
            b = self._new_buffer()
            self._bufs.append(b)
            return b
        return None

    def _batches(self):
        """(layer, unit, buffer) lists to read together, in order.  The first
        unit goes alone (layer 0's first pages land soonest); after it, the
        next units join a batch while buffers are free (up to UNIT_BUFFERS - 1,
        leaving one to the scatter stage), so a device that needs I/Os in
        flight gets them while the scatter keeps up."""
        todo = [(layer, u) for layer in range(self.num_layers) for u in range(len(self.units))]
        i = 0
        while i < len(todo):
            batch = [(*todo[i], self._next_buffer())]
            while i > 0 and len(batch) < self._unit_buffers() - 1 and \
                    i + len(batch) < len(todo):
                extra = self._spare_buffer()
                if extra is None:
                    break
                batch.append((*todo[i + len(batch)], extra))
            if self.abort:
                return
            yield batch
            i += len(batch)

    def _new_buffer(self):
        """A unit buffer: host memory, from the store's spares when it keeps
        any; page-locked with CUDA for a CUDA cache (once: the spares keep
        it so), its copies to the GPU then at DMA speed."""
        spares = getattr(self.store, "spares", None)
        buf = spares.take(self.unit_bytes) if spares is not None else \
            HostBuffer(self.unit_bytes, register=False)
        if self.cuda is not None:
            try:
                # with the cache's GPU current: this (reader) thread's own is
                # GPU 0, whose context CUDA would make for it in a process
                # that uses another
                if not buf.pin_for_cuda(_device_index(self.cuda)) and not buf.closed:
                    _log_pageable(buf.cuda_pin_refusal)
            except BaseException:
                # not in _bufs yet, which _stage_done hands back: a Ctrl-C in
                # the page-locking (or a raising log handler) lost it for good
                if spares is not None:
                    spares.give(buf)
                else:
                    buf.close()
                raise
        return buf

    def _settle(self, buf) -> None:
        """Host staging: the scatter's copies are done when it returns,
        but into a CUDA cache its last copy (from the device tensor the
        host pages went to) may still be queued on this thread's stream:
        waited for before the layer is handed over, whose consumer may run
        on another stream (as the kvikio path's _settle waits)."""
        _settle_cuda(self.cuda)

    def _read_batch(self, batch) -> int:
        """Read a batch of (layer, unit, buffer) as one I/O batch; returns bytes."""
        cols = [[], [], [], []]
        for layer, u, buf in batch:
            for dev, off, at, n in self._unit_reads(layer, self.units[u]):
                cols[0].append(dev)
                cols[1].append(off)
                cols[2].append(buf.address + at)
                cols[3].append(n)
        devs, offs, addrs, lens = (np.array(c, dtype=np.uint64) for c in cols)
        self.store.io.read(IOBatch(addrs, devs, offs, lens))
        return int(lens.sum())

    def _reader(self):
        taken, self._reader_taken = self._reader_taken, True   # one step (_claim_scatter)
        if taken:
            return       # its starter, cut as it started it, counted it out
        try:
            self._read_all()
            self.q.put(None)
        except BaseException as e:  # surfaced through the handle
            self.q.put(e)
        finally:
            self._stage_done()
            self.store._inflight.leave(self._reader_token)

    def _read_all(self):
        """Read every unit, in order, handing each to the scatter stage."""
        for batch in self._batches():
            self._deliver(batch, self._read_batch(batch))

    def _deliver(self, batch, nbytes: int) -> None:
        """Hand (layer, unit, buffer) items just read (``nbytes`` in all) to
        the scatter stage."""
        self.handle.bytes_read += nbytes
        # The store's bytes_read counts them once the load is done, for the
        # runs it delivered (as a get_run counts the runs it verified, not
        # one that failed its checksum).
        for _, u, _ in batch:
            for si, _, _, piece, _, _ in self.units[u]:
                self.seg_bytes[si] += self.ng * piece
        for item in batch:
            self.q.put(item)

    def _scatter(self, error: BaseException | None = None):
        """The scatter stage, then the load's InFlight leave.  ``error``:
        the stage was taken by a caller cut before it began
        (_claim_scatter): it fails the load with it."""
        try:
            self._scatter_stage(error)
        finally:
            try:
                self.store._inflight.leave(self.token)
            except BaseException:     # cut as it left: again (note after save_blocks)
                self.store._inflight.leave(self.token)
                raise

    def _scatter_stage(self, error: BaseException | None = None):
        store, g, handle = self.store, self.store.geometry, self.handle
        itemsize, gbb, ng = g.itemsize, g.group_block_bytes, self.ng
        kv, BS, Hg, D = g.kv_parts, g.block_tokens, g.heads_per_group, g.head_dim
        hashers: dict = {}
        views = None
        cut = None          # a Ctrl-C in the steps before the unpin (see there)
        lapsed = False      # the pins were found lapsed before the load's end
        # cupy works on the thread's current device, 0 on a new thread: a
        # cupy cache on another GPU is written with its device current
        # (torch follows each tensor's device).  Entered inside the try: a
        # failure there fails the load, as any other of this stage's.
        on_device = contextlib.ExitStack()
        try:
            if error is not None:
                raise error          # its caller was cut before it began
            # Begun here, inside the try whose cleanup unpins and leaves
            # (one line, no call in it: see _claim_scatter); taken already,
            # its caller was cut as it started it and released the load.
            taken, self._scatter_taken = self._scatter_taken, True
            if taken:
                return
            on_device.enter_context(_on_device(self.cuda))
            _wait_cuda(self.cuda, self._caller_work)
            while True:
                item = self.q.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                layer, u, buf = item
                if u == 0:
                    views = self.layout.layer_views(layer)
                for si, p0, p1, nbytes, last, at in self.units[u]:
                    run, lay, pos, count, out_at, _dev, _base = self.seg_info[si]
                    if out_at >= handle.blocks:
                        continue       # a run that failed its checksum, or one after it
                    data = buf.array[at:at + ng * nbytes].reshape(ng, nbytes)
                    if self.verify and not self._check(hashers, layer, si, p0, last, data):
                        continue
                    a, b = max(p0, pos), min(p1, pos + count)
                    if a >= b:
                        continue
                    pages = data[:, (a - p0) * gbb:(b - p0) * gbb]
                    pages = pages.view(_NP_INT[itemsize]).reshape(ng, b - a, kv, BS, Hg, D)
                    _scatter_pages(views, pages, self.page_ids[out_at + a - pos:out_at + b - pos],
                                   self.h0, self.heads, itemsize)
                self._settle(buf)
                self.free.put(buf)
                if u == len(self.units) - 1:
                    # its consumer may run on another stream: the layer's
                    # copies done before it is handed over
                    _settle_cuda(self.cuda)
                    # A layer is handed over only while the runs' pins hold:
                    # a store server that went away may have let a new one
                    # give their space to other runs while this layer was
                    # read (unverified, nothing else would notice).
                    if not store._pins_hold(self.segs):
                        lapsed = True
                        raise _lapsed(store)
                    handle.layer_ready_at[layer] = time.perf_counter() - handle.started_at
                    handle._events[layer].set()
        except BaseException as e:  # surfaced by wait()/wait_layer()
            error = e
            self.abort = True
            for b in self._bufs:       # unblock a reader waiting for a buffer
                self.free.put(b)
            # Its reads may still be in flight: the pins hold until they are
            # done, and wait() raises only then (the caller may close next).
            # Only a reader that began is waited for: one made but not yet
            # started (this stage failed at once, in _on_device or
            # _wait_cuda, while start() was between making its Thread and
            # starting it) raised RuntimeError from join(), past the unpin
            # and the handle's end (wait() never returned).  Not begun, it
            # sees ``abort`` (set above) before its first read, and reads
            # nothing.
            reader = self._reader_thread
            if reader is not None and reader.ident is not None:
                reader.join()
        # (``error`` stays None otherwise: the stage was given none)
        # Inline (run_inline), this runs in the caller's thread: a Ctrl-C
        # in the steps before the unpin (the re-reads of _read_failed, say)
        # came out past the unpin and left the runs pinned for good.  It is
        # raised once they are released and the handle has ended (``cut``).
        try:
            try:
                if error is not None:
                    # A failed load's copies still queued would land in
                    # pages its caller reuses (recomputes) once wait()
                    # raises, and read staging freed for other tensors.
                    _settle_cuda(self.cuda)
            except BaseException as e:   # noqa: BLE001  (the load fails with its own error)
                logger.warning("kvblock: settling the copies of a failed load failed: %s", e)
            try:
                # (cupy restoring the thread's device: a CUDA error there came
                # out of the thread past everything below, the unpin and the
                # handle's end: wait() never returned and the pins stayed)
                on_device.close()
            except BaseException as e:  # the load fails with it, unless it failed first
                if error is None:
                    error = e
            self._stage_done()
            if isinstance(error, IOFailedError):   # an unreadable run is gone too
                # (before the unpin: _read_failed may read the runs again, each
                # alone, to tell which one the device failed).  Whatever befalls
                # it, the pins go and the load fails with the device's error: an
                # exception from here would leave both to nobody, and wait()
                # would never return.
                try:
                    store._read_failed(error, [seg[0] for seg in self.segs])
                except Exception as e:
                    logger.warning("kvblock: dropping the runs of a failed load failed: %s", e)
        except BaseException as e:
            cut = e
            if error is None:
                error = e
        try:
            held = store._unpin(self.segs)
        except BaseException as e:
            # An error answered to the unpin (a store server's ServerError;
            # a lost connection _unpin takes itself) came out of the thread
            # before handle._fail: wait() never returned.  Whether the pins
            # held cannot be told: the load fails with it (unless it failed
            # first) and counts nothing.
            held = True
            # Inline, a Ctrl-C as _unpin began released nothing: made again
            # (it releases what is left, nothing twice), then raised.
            try:
                store._unpin(self.segs)
            except BaseException as again:   # noqa: BLE001  (the first is what counts)
                logger.warning("kvblock: releasing the pins of a load again failed: %r",
                               again)
            if not isinstance(e, Exception) and cut is None:
                cut = e
            if error is None:
                error = e
            else:
                logger.warning("kvblock: releasing the pins of a failed load failed: %s", e)
        if not held and (error is None or lapsed):
            # As a read under pins that lapsed (RunReader._read_done): a miss,
            # counted as such, and none of its blocks count as returned.
            store.counters.add("lapsed_pin_gets")
            if error is None:
                error = _lapsed(store)
        if error is None:
            # Counted only once the pins were released and found to have
            # held.  The blocks read from the device; the rest of those
            # returned came from DRAM (a run failing its checksum cuts off
            # DRAM blocks copied after it too).
            read = sum(max(0, min(count, handle.blocks - out_at))
                       for _, _, count, out_at in self.segs)
            _count_loaded(store, handle.blocks, read, self.heads)
            store.counters.add("bytes_read", sum(
                n for n, (_, _, _, out_at) in zip(self.seg_bytes, self.segs)
                if out_at < handle.blocks))
        if self.bad_runs:  # before wait() returns: a failed run is gone for the next lookup
            try:
                store._drop_runs(self.bad_runs)
            except KVBlockError as e:
                # As get_run: the load stands whatever became of the drop (what
                # it delivered was read and verified under pins that held, and
                # failing it lost that prefix); a later read meets the run
                # again and drops it.
                for run in self.bad_runs:
                    store._damage_not_dropped(run)
                logger.warning("kvblock: dropping %d run(s) after a checksum failure "
                               "failed: %s", len(self.bad_runs), e)
        if error is not None:
            handle._fail(error)
        else:
            handle._done.set()
        if cut is not None:
            raise cut

    def _check(self, hashers, layer, si, p0, last, data) -> bool:
        """Feed a piece to its ranges' streaming checksums; at a range's last
        piece compare.  False when the segment failed (its pages and those
        after it are no longer part of the load)."""
        run, lay, _pos, _count, out_at, _dev, _base = self.seg_info[si]
        for j in range(self.ng):
            h = hashers.get((si, j)) if p0 else None
            if h is None:
                h = hashers[(si, j)] = data_hasher(run.run_id)
            h.update(data[j])
            if last:
                del hashers[(si, j)]
                r = lay.range_index(layer, self.g0 + j)
                if h.intdigest() != int(run.checksums[r]):
                    self._checksum_failure(run, r, out_at)
                    return False
        return True

    def _checksum_failure(self, run, range_index, out_at):
        store = self.store
        self.handle.blocks = min(self.handle.blocks, out_at)
        if not store._run_pin_held(run):
            return       # its space may hold other runs now (the load fails: PINS_LAPSED)
        count, drop = store._damage_found(run)
        if count:        # else counted by the read or load that met it first
            store.counters.add("checksum_failures")
            dev, off = store.regions.address(run.region, run.offset)
            store.last_checksum_failure = (store.io.devices[dev].path, off, run.run_id,
                                           range_index)
        if drop:         # else dropped (or being dropped) by that one
            self.bad_runs.append(run)


def _consecutive(ids) -> slice | None:
    """ids as a slice when they are consecutive (a plain copy beats index_put)."""
    arr = np.asarray(ids.cpu() if _is_torch(ids) else ids)
    if arr.size and (arr.size == 1 or bool(np.all(np.diff(arr) == 1))):
        return slice(int(arr[0]), int(arr[0]) + arr.size)
    return None


def _scatter_pages(views, pages, ids, h0, heads, itemsize, threads=1):
    """pages (groups, n, kv, BS, Hg, D) raw ints -> the cache: per KV part
    (n, BS, groups*Hg, D), then the rank's slice of heads.  One copy thread
    by default: in the load pipeline a second one competes with the reads
    for the cores (2-core VM, /dev/shm loop, 4 rounds: restore medians 3.75
    vs 4.95 GiB/s with memcpy rows; with streamed rows, paired 0.745 vs 0.736
    of fio)."""
    ng, count, kv, bs, hg, d = pages.shape
    device = None if _is_torch(pages) else _torch_cuda(views)
    if device is not None:
        # Host staging into a CUDA torch cache: the piece goes over as it
        # was read, one host-to-device copy, and is cut into K/V and heads
        # on the device.  Cut on the host first, each part was gathered
        # into a new pageable array (np.ascontiguousarray), then copied:
        # two passes over the bytes on the CPU and a copy per part.
        pages = _torch_from_host(pages, device)
    if _is_torch(pages):  # device staging (GPU path): stays on the device
        pages = pages.permute(2, 1, 3, 0, 4, 5).reshape(kv, count, bs, ng * hg, d)
        pages = pages[..., h0:h0 + heads, :]
        # The page ids once for every part, consecutive ones as a slice:
        # made a CUDA tensor per part (a copy from pageable memory) and
        # looked at again on the host (_consecutive's .cpu()), each unit
        # waited twice per part for the stream, scatters queued before it
        # included.
        run = _consecutive(ids)
        ids = run if run is not None and run.start >= 0 else _ids_for(views[0], ids)
        for k, view in enumerate(views):
            _raw_assign(view, ids, pages[k], itemsize)
        return
    pages = pages.transpose(2, 1, 3, 0, 4, 5).reshape(kv, count, bs, ng * hg, d)
    pages = pages[..., h0:h0 + heads, :]
    for k, view in enumerate(views):
        host = _host_np(view, itemsize)
        if host is not None:  # host cache: one copy, staging -> cache
            if copy_pages(host, pages[k], dst_ids=ids, threads=threads):
                continue
            run = _consecutive(ids)
            if run is not None and run.start >= 0:
                host[run] = pages[k]
            else:
                host[np.asarray(ids)] = pages[k]
            continue
        src = _as_like(np.ascontiguousarray(pages[k]), view)
        _raw_assign(view, _ids_for(view, ids), src, itemsize)


def _torch_cuda(views):
    """The CUDA device of ``views`` when they are torch tensors (or HF's
    strided pages of one) in CUDA memory, else None (host and cupy caches)."""
    view = views[0]
    t = view.t if isinstance(view, _StridedPages) else view
    if _is_torch(t) and t.is_cuda:
        return t.device
    return None


def _torch_from_host(a: np.ndarray, device):
    """Host array ``a`` copied into a new tensor on CUDA ``device`` (one
    copy, synchronous: the host buffer may be reused as soon as this
    returns)."""
    import torch

    if a.flags.c_contiguous:
        return _h2d(torch.from_numpy(a), device)
    # A piece of several head groups cut short (part of a run loaded) is
    # one row per group in the unit buffer, each contiguous: copied row by
    # row, each straight from the (page-locked) staging.  Gathered into a
    # new array first, the copy went from pageable memory, through the
    # driver's bounce buffer.
    if a.ndim > 1 and all(row.flags.c_contiguous for row in a):
        return torch.stack([_h2d(torch.from_numpy(row), device) for row in a])
    return _h2d(torch.from_numpy(np.ascontiguousarray(a)), device)


def _h2d(t, device):
    """Host tensor ``t`` copied to CUDA ``device`` (synchronous)."""
    return t.to(device, non_blocking=False)


def _load_tiered(store, keys, layout, page_ids, g0, ng, h0, heads) -> tuple[list, int]:
    """With a DRAM tier: the prefix of ``keys`` as stretches in DRAM (scattered
    now) and stretches on the device (pinned segments, their output positions
    counted from the first key, for the load job); and its length."""
    from kvblock.store.store import Segments

    segs = Segments()      # (what _unpin takes: it keeps its record on it)
    found = None           # a stretch pinned, not yet in ``segs``
    pos = 0
    arena = []             # _load_from_host's row plan, made once for every stretch
    try:
        while pos < len(keys):
            pos += _load_from_host(store, keys[pos:], layout, page_ids[pos:], g0, ng, h0, heads,
                                   arena)
            if pos == len(keys):
                break
            # After the first device stretch, a short stored prefix of the
            # keys left is likely (a DRAM stretch may follow it): looked up
            # a window at a time, not all of them once per stretch
            # (quadratic in the stretches, under the lock).
            with store._lock:
                found = store._segments(keys[pos:], windowed=bool(segs))
            if not found:
                break
            shifted = [(run, p, c, out + pos) for run, p, c, out in found]
            n = len(segs)
            # into ``segs`` and off ``found`` in one line with no call in
            # it: a KeyboardInterrupt finds the stretch in one of the two
            segs[n:n], found = shifted, None
            stretch = sum(c for _, _, c, _ in shifted)
            store.host.missed(stretch - 1)   # the first one's miss: host.get counted it
            pos += stretch
    except BaseException:
        cut = None        # (a second Ctrl-C: the other stretches go all the same)
        for pinned in (found, segs):
            if pinned:
                try:
                    store._unpin(pinned)
                except BaseException as e:   # cut as it began: again (the rest, once)
                    cut = cut or e
                    store._unpin(pinned)
        if cut is not None:
            raise cut
        raise
    return segs, pos


def _load_from_host(store, keys, layout, page_ids, g0, ng, h0, heads, arena=None) -> int:
    """Scatter the leading blocks that sit in the host tier; returns how many.
    ``arena``: a list that keeps :func:`_arena_rows`'s plan (made at the
    first hit) for the next stretch of the same load."""
    g = store.geometry
    # Only the leading keys held here, and the one after (its get counts
    # the miss _load_tiered counts on): a load alternating DRAM and device
    # stretches calls this once a stretch with all the keys left, and
    # looking them all up each time cost quadratic work under the lock.
    m = 0
    while m < len(keys) and keys[m] in store.host:
        m += 1
    keys = keys[:m + 1]
    # the runs the keys name now: a copy older than its key's is stale
    # (HostTier._stale_locked)
    with store._lock:
        since = store.index.published_of(store.index.lookup(keys))
    since = since.tolist()
    device = _cuda_device(layout)
    if device is not None and not isinstance(device, _CupyDevice):
        n = _host_hits_into_cuda(store, keys, since, layout, page_ids, g0, ng, h0, heads,
                                 device)
        store._host_hits_used(keys[:n])
        return n
    if device is None and m:
        if arena is None:
            arena = []
        if not arena:
            arena.append(_arena_rows(g, layout, g0, ng, h0, heads))
        if arena[0] is not None:
            n = _host_hits_into_host(store, keys, since, page_ids, arena[0])
            store._host_hits_used(keys[:n])
            return n
    blocks = []
    for key, published in zip(keys, since):
        block = store.host.get(key, since=published)
        if block is None:
            break
        blocks.append(block)
    if not blocks:
        return 0
    n = len(blocks)
    store._host_hits_used(keys[:n])
    data = np.stack(blocks).view(_NP_INT[g.itemsize]).reshape(
        n, g.num_layers, g.head_groups, g.kv_parts, g.block_tokens, g.heads_per_group,
        g.head_dim)
    for layer in range(g.num_layers):
        pages = data[:, layer, g0:g0 + ng].transpose(1, 0, 2, 3, 4, 5)  # (ng, n, kv, BS, Hg, D)
        _scatter_pages(layout.layer_views(layer), pages, page_ids[:n], h0, heads, g.itemsize,
                       threads=None)  # no reads in flight here
    _settle_cuda(_cuda_device(layout))   # handed over at once when all of it came from here
    return n


class _ArenaRows:
    """A DRAM-tier block's rows into a host cache's pages: every layer, K/V
    part and head group of the rank's heads in one native row copy.
    ``rows.dst``: the destinations as for page 0 (int64, moved ``dst_page``
    bytes a page); ``rows.src``: the sources as offsets into the block."""

    __slots__ = ("rows", "dst_page", "lib")

    def __init__(self, rows: Rows, dst_page, lib):
        self.rows, self.dst_page, self.lib = rows, dst_page, lib


def _arena_rows(g, layout, g0, ng, h0, heads) -> _ArenaRows | None:
    """The row plan of :func:`_host_hits_into_host`; None (get, stack and
    scatter then) for a cache whose pages are not host memory numpy can
    see, layers of other strides (no one plan), or no native library.
    Rows of any length: one pass beats get, stack and numpy's scatter
    even for short ones (HND rows of 8 bytes: 19 vs 27 ms, 32 bytes: 24
    vs 66 ms, 512 blocks of 32 layers on the 2-core dev VM)."""
    lib = pagecopy._lib()
    if lib is None:
        return None
    # Addresses only, nothing read: a block's rows as offsets from its start
    template = np.empty(g.block_bytes, np.uint8)
    base = template.__array_interface__["data"][0]
    data = template.view(_NP_INT[g.itemsize]).reshape(
        g.num_layers, g.head_groups, g.kv_parts, g.block_tokens, g.heads_per_group, g.head_dim)
    hg, shape, parts = g.heads_per_group, None, ([], [], [])
    page0 = np.zeros(1, np.int64)
    pages = None
    for layer in range(g.num_layers):
        for k, view in enumerate(layout.layer_views(layer)):
            host = _host_np(view, g.itemsize)
            if host is None:
                return None
            # page ids are checked against layer 0's pages only: a layer of
            # fewer would be written past its end (the scatter refuses it)
            pages = host.shape[0] if pages is None else pages
            if host.shape[0] < pages:
                return None
            # the rank's heads h0:h0+heads of its groups' heads, group by group
            for gi in range(ng):
                lo, hi = max(h0, gi * hg), min(h0 + heads, (gi + 1) * hg)
                if lo >= hi:
                    continue
                src = data[layer, g0 + gi, k, None, :, lo - gi * hg:hi - gi * hg]
                rows = row_plan(host[:, :, lo - h0:hi - h0], src, dst_ids=page0, min_row=1)
                if rows is None or shape not in (None, rows[2:]):
                    return None
                shape = rows[2:]
                parts[0].append(rows.dst.view(np.int64))
                parts[1].append(np.full(rows.dst.size, host.strides[0], np.int64))
                parts[2].append(rows.src.view(np.int64) - base)
    dst0, dst_page, src = (np.concatenate(p) for p in parts)
    return _ArenaRows(Rows(dst0, src, *shape), dst_page, lib)


def _host_hits_into_host(store, keys, since, page_ids, arena: _ArenaRows) -> int:
    """:func:`_load_from_host` into a host cache: each of the leading blocks
    of ``keys`` the DRAM tier holds copied straight from the tier's arena
    into its page of every layer (one native row copy a block, under the
    tier's lock: HostTier.copy_out); how many.  Through HostTier.get and
    np.stack each block was copied twice into new memory before the
    scatter, and the lock is held for one block's copy at a time."""
    n = 0
    # (only this stretch's ids: page_ids runs to the load's last key)
    for key, published, page in zip(keys, since, page_ids[:len(keys)].tolist()):
        dst = (arena.rows.dst + page * arena.dst_page).view(np.uint64)   # (outside the lock)

        def copy(block, dst=dst):
            src = (arena.rows.src + block.__array_interface__["data"][0]).view(np.uint64)
            copy_rows(arena.lib, arena.rows, dst, src)

        if not store.host.copy_out(key, copy, since=published):
            break
        n += 1
    return n


# Device staging of a DRAM-tier load into a CUDA cache: at most this many
# bytes of blocks at a time (a long prefix is not staged whole in HBM).
HOST_HITS_STAGING_BYTES = 256 << 20


def _host_hits_into_cuda(store, keys, since, layout, page_ids, g0, ng, h0, heads,
                         device) -> int:
    """:func:`_load_from_host` into a CUDA torch cache: the leading blocks
    of ``keys`` the DRAM tier holds, each copied straight from the tier's
    arena (page-locked with CUDA when a GPU is present) into device
    staging, then cut into layers, K/V and heads and scattered on the
    device; how many.  Through HostTier.get and np.stack each block was
    copied twice into new pageable memory first, then once more per layer
    to be made contiguous, and sent through the driver's bounce buffer:
    1.1-1.2 GiB/s on an H200, whatever the copies into CUDA were cut to.

    Each block's copy runs under the tier's lock and is finished before it
    is let go (HostTier.copy_out: a delete can free the slot and a put
    reuse it at once), on a stream of its own (_hits_stream) so that it
    waits for nothing the caller or an earlier load queued.  The scatters
    go on the loads' stream after the caller's earlier work (an event, as
    for a device read) and are settled before this returns."""
    import torch

    g = store.geometry
    per = max(1, HOST_HITS_STAGING_BYTES // g.block_bytes)
    dtype = _torch_int(g.itemsize)
    after = _record_cuda(device)         # the caller's work queued so far
    copier = _hits_stream(device)
    n = 0
    queued = False      # a scatter was queued on the loads' stream
    with _on_device(device):
        loads = torch.cuda.current_stream(device)
        _wait_cuda(device, after)
        try:
            while n < len(keys):
                count = min(per, len(keys) - n)
                with torch.cuda.stream(copier):
                    staging = torch.empty((count, g.block_bytes), dtype=torch.uint8,
                                          device=device)
                    got = 0
                    for key, published in zip(keys[n:n + count], since[n:n + count]):
                        row = staging[got]
                        # synchronous (non_blocking=False): done before the lock goes
                        if not store.host.copy_out(
                                key, lambda b: row.copy_(torch.from_numpy(b)), since=published):
                            break
                        got += 1
                if got == 0:
                    break
                # the scatters below read it on the loads' stream: not handed to
                # another allocation (on the copier's) before they are done
                staging.record_stream(loads)
                data = staging[:got].view(dtype).reshape(
                    got, g.num_layers, g.head_groups, g.kv_parts, g.block_tokens,
                    g.heads_per_group, g.head_dim)
                queued = True
                for layer in range(g.num_layers):
                    pages = data[:, layer, g0:g0 + ng].permute(1, 0, 2, 3, 4, 5)
                    _scatter_pages(layout.layer_views(layer), pages, page_ids[n:n + got], h0,
                                   heads, g.itemsize)
                n += got
                if got < count:
                    break
        except BaseException:
            # As a failed device load (_scatter_stage): the scatters queued
            # would land in pages the caller reuses once this raises.
            if queued:
                try:
                    _settle_cuda(device)
                except BaseException as e:   # noqa: BLE001  (the load fails with its own error)
                    logger.warning("kvblock: settling the copies of a failed load failed: %s", e)
            raise
        if queued:   # (nothing scattered: not a wait for the caller's work queued so far)
            _settle_cuda(device)    # handed over at once: the loads' stream, settled
    return n


_HITS_STREAMS: dict = {}


def _hits_stream(device):
    """The non-blocking stream DRAM-tier hits are copied into CUDA
    ``device`` on (one per GPU for the process): its copies wait for no
    scatter, which may wait for the caller's work, while the tier's lock
    is held."""
    import torch

    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _LOAD_STREAMS_LOCK:
        stream = _HITS_STREAMS.get(device.index)
        if stream is None:
            stream = _HITS_STREAMS[device.index] = torch.cuda.Stream(device)
    return stream


class _CupyDevice:
    """The CUDA device of a cupy cache: its streams are cupy's (the
    copies into it are queued on cupy's current stream, not torch's)."""

    def __init__(self, device):
        self.device = device

    def stream(self):
        import cupy

        return cupy.cuda.get_current_stream(self.device.id)


def _on_device(device):
    """The scatter stage's context for a load into CUDA ``device``
    (_cuda_device's): the cache's device current (cupy works on the
    thread's current device, 0 on a new thread; torch follows each
    tensor's) and the loads' own stream (_load_stream) current.  On the
    legacy default stream (a new thread's current one) every copy and
    scatter of a load waited for whatever the model had queued there
    (layer k+1's load could not overlap layer k's compute), and the kvikio
    path's scatters for its reads in flight (kvikio's per-thread streams
    are blocking ones, ordered with the legacy stream).  The stage waits
    for the caller's earlier work by an event (_wait_cuda) and settles
    its stream before a layer is handed over (_settle_cuda).  Nothing for
    a host cache."""
    if device is None:
        return contextlib.nullcontext()
    if isinstance(device, _CupyDevice):
        import cupy

        stack = contextlib.ExitStack()
        try:
            stack.enter_context(cupy.cuda.Device(device.device.id))
            stack.enter_context(_load_stream(device))
        except BaseException:
            stack.close()
            raise
        return stack
    import torch

    return torch.cuda.stream(_load_stream(device))   # (it makes its device current too)


_LOAD_STREAMS: dict = {}
_LOAD_STREAMS_LOCK = threading.Lock()


def _load_stream(device):
    """The non-blocking CUDA stream loads into ``device`` queue their
    copies on: one per GPU (and library) for the process, made on first
    use.  (A stream per load would leave the caching allocator a pool of
    blocks per stream: its temporaries could not be reused by the next
    load's.)  Loads running at once share it: each settles it per unit,
    waiting for the other's copies too, which use the same link."""
    if isinstance(device, _CupyDevice):
        import cupy

        key = ("cupy", int(device.device.id))
        make = lambda: cupy.cuda.Stream(non_blocking=True)   # noqa: E731  (made on the current device)
    else:
        import torch

        device = torch.device(device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = ("torch", device.index)
        # torch's pool streams are created cudaStreamNonBlocking
        make = lambda: torch.cuda.Stream(device)   # noqa: E731
    with _LOAD_STREAMS_LOCK:
        stream = _LOAD_STREAMS.get(key)
        if stream is None:
            stream = _LOAD_STREAMS[key] = make()
    return stream


def _cuda_device(layout):
    """The CUDA device of ``layout``'s cache (a torch device, or a
    _CupyDevice); None for a host one."""
    sample = layout.sample()
    t = sample.t if isinstance(sample, _StridedPages) else sample
    if _is_torch(t):
        return t.device if t.is_cuda else None
    if _is_cupy(t) and getattr(t, "device", None) is not None:
        return _CupyDevice(t.device)
    return None


_PAGEABLE_LOGGED = False   # a staging buffer's page-locking failed, and was logged


def _log_pageable(why) -> None:
    """Say once per process that the host path's staging into CUDA stays
    pageable (the load goes on from it, slower): it was silent."""
    global _PAGEABLE_LOGGED
    if _PAGEABLE_LOGGED:
        return
    _PAGEABLE_LOGGED = True
    logger.warning("kvblock: the host path's staging buffers could not be page-locked with "
                   "CUDA (%s); loads into CUDA copy from pageable memory, through the "
                   "driver's bounce buffer (slower)", why or "refused")


def _device_index(device) -> int | None:
    """The index of CUDA ``device`` (_cuda_device's), None if it has none."""
    if isinstance(device, _CupyDevice):
        return int(device.device.id)
    index = getattr(device, "index", None)      # a torch.device's
    return index if isinstance(index, int) else None


def _settle_cuda(device) -> None:
    """Wait for the copies queued on this thread's stream of CUDA
    ``device`` (nothing for None: a host cache)."""
    if isinstance(device, _CupyDevice):
        device.stream().synchronize()
    elif device is not None:
        import torch

        torch.cuda.current_stream(device).synchronize()


def _record_cuda(device):
    """An event recorded on this thread's stream of CUDA ``device`` (None
    for a host cache)."""
    if device is None:
        return None
    if isinstance(device, _CupyDevice):
        import cupy

        # made on the cache's device: cupy makes an event on the current
        # one, and CUDA records none on another device's stream (torch's
        # event takes the stream's device)
        with cupy.cuda.Device(device.device.id):
            event = cupy.cuda.Event()
            event.record(device.stream())
        return event
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _wait_cuda(device, event) -> None:
    """Make this thread's stream of ``device`` wait for ``event`` (from
    :func:`_record_cuda` on another thread) before the work queued next."""
    if event is None:
        return
    if isinstance(device, _CupyDevice):
        device.stream().wait_event(event)
        return
    import torch

    torch.cuda.current_stream(device).wait_event(event)


def _count_loaded(store, blocks: int, from_device: int, heads: int) -> None:
    """A load returned ``blocks`` (``heads`` KV heads of each), ``from_device``
    of them read from the device and the rest copied from the DRAM tier."""
    g = store.geometry
    counts = {"get_blocks": blocks,
              "get_bytes": blocks * (g.block_bytes // g.num_kv_heads * heads),
              "device_hit_blocks": from_device}
    if store.host is not None:
        counts["host_hit_blocks"] = blocks - from_device
    store.counters.add_each(**counts)


def _raw_assign(view, ids, src, itemsize):
    """view[ids] = src, moving raw element bits (``ids``: page ids, or a
    slice of consecutive ones)."""
    # (ids on a GPU: made so because they are not consecutive; looked at
    # again here, they were copied back, a wait for the stream)
    run = ids if isinstance(ids, slice) else \
        None if _is_torch(ids) and ids.is_cuda else _consecutive(ids)
    if run is not None and isinstance(view, _StridedPages):  # HF: one strided slice copy
        t = view.t.view(_torch_int(itemsize))[0]
        tokens = slice(run.start * view.bt, run.stop * view.bt)
        t[:, tokens] = src.reshape(-1, *view.shape[2:]).permute(1, 0, 2)
        return
    if run is not None:
        ids = run
    if _is_torch(view):
        _raw(view, itemsize)[ids] = src
    elif isinstance(view, _StridedPages):
        raw_t = view.t.view(_torch_int(itemsize))
        _StridedPages(raw_t, view.bt, view.shape[0] * view.bt)[ids] = src
    else:
        if _is_cupy(view) and not isinstance(ids, slice):
            import cupy

            ids = cupy.asarray(ids)      # a scatter's indices on the cache's device
        _raw(view, itemsize)[ids] = src


class _KvikioLoadJob(_LoadJob):
    """GPU path: each unit's reads go through kvikio straight into a device
    staging buffer and are scattered on the device (no host copy, no checksum:
    chosen only with verify="never", see kvblock.io.gpu.gpu_path)."""

    def _unit_buffers(self) -> int:
        return KVIKIO_UNIT_BUFFERS

    def _new_buffer(self):
        import torch

        device = _sample_tensor(self.layout).device
        return _DeviceStaging(torch.empty(self.unit_bytes, dtype=torch.uint8, device=device))

    def _settle(self, buf) -> None:
        """The scatter's copies out of ``buf`` are queued on the device: an
        event marks their end, which the reader waits for before it reads
        into ``buf`` again (kvikio's reads are not ordered with the stream).
        The layer's handover settles the stream (_scatter_stage).  Waited
        for here, per unit, the scatter stage stalled on every unit's copies
        and the reads into the other buffers went on without it: the
        kvikio path loaded at about 40% of kvikio's own preads."""
        buf.mark_used()

    def _read_all(self):
        """A window of units in flight: a unit's reads start as soon as a
        staging buffer is free, and units are handed over in order as their
        reads land.  (Read in batches waited for whole, as the host path's
        io_uring batches are, the window fell to the one or two buffers the
        scatter had just given back, each a couple of kvikio tasks: most of
        kvikio's threads sat idle between batches.)  kvikio's thread pool
        takes tasks in order, so layer 0's first unit still lands first."""
        reader = self.store._kvikio_reader()
        todo = collections.deque((layer, u) for layer in range(self.num_layers)
                                 for u in range(len(self.units)))
        flight: collections.deque = collections.deque()   # (item, its reads), oldest first
        try:
            while todo or flight:
                while todo and not self.abort:
                    # blocks for a buffer only when nothing is in flight
                    buf = self._spare_buffer() if flight else self._next_buffer()
                    if buf is None or self.abort:   # (abort: set while it waited)
                        break
                    buf.wait_unused()    # the scatter's copies out of it are done
                    reads: list = []
                    flight.append(((*todo.popleft(), buf), reads))
                    self._start_reads(reader, flight[-1][0], reads)
                if self.abort:
                    return       # (the reads in flight are waited for below)
                item, reads = flight.popleft()
                self._deliver([item], self._wait_reads(reads))
        finally:
            # Every read started is waited for before the reader ends (a
            # failure raised, or the scatter stage failed): they still write
            # into the staging buffers, which the failed load frees (and it
            # unpins the runs, and lets close() go on).
            for _, reads in flight:
                self._wait_reads(reads, quiet=True)

    def _start_reads(self, reader, item, reads: list) -> None:
        """Start one unit's reads through kvikio, appending each started
        read to ``reads`` (so a failure part way still leaves them to wait
        for)."""
        layer, u, buf = item
        for dev, off, at, n in self._unit_reads(layer, self.units[u]):
            reads.append((reader.read(dev, off, buf.array[at:at + n].t, n), dev, off, n))

    def _wait_reads(self, reads, quiet: bool = False) -> int:
        """Wait for every read in ``reads``; the bytes read.  A read that
        failed or came back short raises once all of them are done (nothing
        with ``quiet``: a failure is being raised already)."""
        error = None
        for f, dev, off, n in reads:
            try:
                got = f.get()
            except BaseException as e:
                error = error or e
                continue
            if got != n and error is None:
                # As the engine reports one: the scatter stage drops the run
                # (store._read_failed) only for an IOFailedError with an offset.
                path = self.store.io.devices[dev].path
                error = IOFailedError(f"short read at offset {off} on {path}: {got} of {n} "
                                      "bytes through kvikio (end of device, or the device "
                                      "shrank)", path, errno.EIO, off, n)
        if error is not None and not quiet:
            raise error
        return sum(n for *_, n in reads)


class _DeviceStaging:
    """A CUDA staging tensor shaped like HostBuffer for the scatter stage: its
    ``array`` slices give torch views that the scatter reinterprets in place."""

    def __init__(self, tensor):
        self.array = _TorchBytes(tensor)
        self.used = None     # an event after the scatter's last copies out of it

    def mark_used(self) -> None:
        """(the scatter stage, on its stream) Mark the end of the copies
        queued out of this buffer so far."""
        t = self.array.t
        if t.is_cuda:
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            self.used = event

    def wait_unused(self) -> None:
        """(the reader, before reading into it) Wait for the copies
        :meth:`mark_used` marked."""
        event, self.used = self.used, None
        if event is not None:
            event.synchronize()


class _TorchBytes:
    def __init__(self, t):
        self.t = t

    def __getitem__(self, sl):
        return _TorchBytes(self.t[sl])

    def reshape(self, *shape):
        return _TorchBytes(self.t.reshape(*shape))

    def view(self, np_dtype):
        import torch

        return self.t.view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                            8: torch.int64}[np.dtype(np_dtype).itemsize])
