#!/usr/bin/env python3
"""kvblock's SGLang HiCache backend vs SGLang's HiCacheFile: same data, same filesystem.

Both backends are built and driven the way SGLang 0.5.23's HiCacheController
drives an L3 storage backend (``attach_storage_backend``: the backend
factory, ``register_mem_pool_host``, ``on_host_pools_registered``; then
``_page_backup`` / ``_storage_hit_query`` / ``_page_transfer`` in batches of
at most ``STORAGE_BATCH_SIZE`` = 128 pages), over one host pool holding
exactly the ``kv_buffer`` of ``MHATokenToKVPoolHost`` (bf16, ``--layout``):

- kvblock: ``KVBlockHiCacheStorage`` from ``StorageBackendFactory
  .create_backend("dynamic", ...)`` with ``"interface_v1": 1``, so the
  controller uses its zero-copy path: backup = ``batch_set_v1(keys,
  host_indices, extra_info)``, hit query = ``batch_exists(keys,
  extra_info)``, prefetch = ``batch_get_v1(keys, host_indices,
  extra_info)``.  The store lives on a loop device (direct I/O on) over a
  file in the location (``--kvblock-target file``: a pre-sized store file
  there, kvblock's embedded target), formatted for each measurement (``"format":
  "force"``); other settings are the backend's defaults (verify "always",
  max_run_bytes 64M) unless ``--max-run-bytes`` says otherwise.
- HiCacheFile: ``StorageBackendFactory.create_backend("file", ...)``
  (``extra_config["file_storage_path"]`` = a fresh folder in the location).
  It implements only the v0 calls, which the controller reaches through its
  generic path: backup = ``_generic_page_set`` (``get_data_page(host_indices[
  i * page_size])`` for each page -- a flattened copy -- then
  ``batch_set(keys, pages)``: one ``.tmp`` file written with ``tofile`` and
  renamed per page, no fsync); hit query = ``batch_exists`` (the base class's:
  ``exists`` per key, one ``stat``); prefetch = ``_generic_page_get``
  (``get_dummy_flat_data_page()`` per page, a fresh zeroed tensor;
  ``batch_get(keys, dummies)``: one unbuffered ``open`` + ``readinto`` into
  the dummy per page; then ``set_from_flat_data_page`` per page).  Those
  controller steps are timed as part of HiCacheFile's store and load, since
  SGLang runs them for it.
  The flat-page methods come from ``SGLangHostPool`` below, a copy of
  ``MHATokenToKVPoolHost``'s (``pool_host/mha.py``) over the test suite's
  ``HostPool`` (SGLang's pool classes cannot be imported on a CPU-only
  machine: see tests/integrations/sglang_pools.py).

One thread drives each backend, as in SGLang: the controller runs backups on
its one backup thread and prefetch reads on its one prefetch I/O thread, each
calling the backend serially (a write and a read may overlap in a server;
here they never do).

For each location (``disk``: /var/tmp; ``shm``: /dev/shm) and page size (bytes
of one SGLang page, all layers, K and V), ``--rounds`` times (alternating which
backend goes first): store ``--gib`` GiB of pages in batches of
``--batch-pages`` (every page has its own SGLang key: the chained SHA-256 of
``get_hash_str`` over distinct tokens, and its own content: each page is
stamped with its number before its batch is stored), drop the page cache
(root), run the hit query over every batch (timed apart: on stderr and in
--json, not in the table), load every batch back into zeroed pool pages, check
the bytes of every page (exits on a mismatch), and print the median store and
load GiB/s and the kvblock/HiCacheFile ratios next to the issue's bars (load
>= 2x HiCacheFile at 256 KiB pages, >= 1.0x at 2 MiB).  The host pool
(``--pool``) may be smaller than the data: batches reuse its pages.

    .venv/bin/python perf/sglang_vs_hicachefile.py          # ~2 minutes
    .venv/bin/python perf/sglang_vs_hicachefile.py --layout page_first_direct
    .venv/bin/python perf/sglang_vs_hicachefile.py --gib 2 --pages 256K,2M,8M --json
    .venv/bin/python perf/sglang_vs_hicachefile.py --profile 25  # cProfile kvblock loads

Needs root (losetup, drop_caches) and fio (fills the loop device's backing
file).  Loop devices are always detached (also on Ctrl-C) and every file and
folder it creates is removed.  HiCacheFile does not fsync; kvblock fdatasyncs
before publishing a run.  The page cache is synced and dropped outside the
timed phases, so HiCacheFile's write-back on disk is not in its store time;
on /dev/shm (tmpfs) nothing can be dropped and HiCacheFile reads memory.

``--loop-write-cache write-through`` makes the loop device report what a
drive without a volatile write cache reports (many with power-loss
protection), so that kvblock's flushes cost what they would on one
(nothing; perf/fio_support.py says why).  The peers
never flush.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))      # fio_support
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.integrations

import fio_support as fs
import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

import kvblock
from kvblock.cli.units import parse_size
from tests.integrations.sglang_pools import HostPool

GIB, MIB = 1 << 30, 1 << 20
LOCATIONS = {"disk": Path("/var/tmp"), "shm": Path("/dev/shm")}
BACKENDS = ("kvblock", "file")
LABEL = {"kvblock": "kvblock", "file": "HiCacheFile"}
# The bars: kvblock load / HiCacheFile load, by page size.
LOAD_BARS = {256 << 10: 2.0, 2 << 20: 1.0}
MODEL = "bench/sglang-hicache"
FILE_ENV = ("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE",
            "SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE",
            "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY",
            "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class SGLangHostPool(HostPool):
    """``HostPool`` plus the flat-page methods SGLang's controller calls on a
    host pool for v0 backends, as ``MHATokenToKVPoolHost`` implements them
    (sglang/srt/mem_cache/pool_host/mha.py, 0.5.23)."""

    device, pin_memory = "cpu", False

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index: index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index: index + self.page_size, :, :, :]
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index: real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        if flat:
            data_page = data_page.flatten()
        return data_page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype, device=self.device,
                           pin_memory=self.pin_memory).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index: index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            self.kv_buffer[:, index: index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim)
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            self.kv_buffer[:, real_index: real_index + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")


def page_view(buf: torch.Tensor, layout: str, ps: int, p: int) -> torch.Tensor:
    """Page ``p`` of an MHA kv_buffer, as a view (K and V first)."""
    if layout == "page_first_direct":
        return buf[:, p]
    tok = slice(p * ps, (p + 1) * ps)
    return buf[:, tok] if layout == "page_first" else buf[:, :, tok]


def stamp(buf: torch.Tensor, layout: str, ps: int, pages, numbers) -> None:
    """Write each page's number into its first 8 bytes of K and of V, so that
    every stored page has its own content."""
    for p, n in zip(pages, numbers):
        v = page_view(buf, layout, ps, int(p))
        for kv in (0, 1):
            v[kv, 0, 0, 0, :4].view(torch.int64).fill_(int(n))


def storage_config(extra: dict, layout: str) -> HiCacheStorageConfig:
    """What HiCacheController._generate_storage_config builds for TP 1."""
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name=MODEL, extra_config=extra)


def store_files(locations, size: int):
    """For each location, a fresh pre-sized store file there: yields
    (location, path); the file is removed after its cases."""
    for loc in locations:
        with tempfile.TemporaryDirectory(prefix="kvblock-sglang-", dir=LOCATIONS[loc]) as d:
            yield loc, str(kvblock.create_file(Path(d) / "kv.img", size))


def attach(kind: str, pool: SGLangHostPool, base: Path, dev: str, args):
    """HiCacheController.attach_storage_backend, storage part."""
    if kind == "kvblock":
        extra = {"backend_name": "kvblock", "module_path": "kvblock.integrations.sglang",
                 "class_name": "KVBlockHiCacheStorage", "interface_v1": 1,
                 "devices": [dev], "format": "force", "namespace": ""}
        if args.max_run_bytes:
            extra["max_run_bytes"] = args.max_run_bytes
        backend = StorageBackendFactory.create_backend("dynamic",
                                                       storage_config(extra, pool.layout), pool)
    else:
        extra = {"file_storage_path": str(base / "hicache")}
        backend = StorageBackendFactory.create_backend("file",
                                                       storage_config(extra, pool.layout), pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


class Plan:
    """The batches of one case: SGLang keys, host pool pages, host indices."""

    def __init__(self, total_pages: int, pool_pages: int, batch_pages: int, ps: int,
                 pattern: str, seed: int):
        rng = np.random.default_rng(seed)
        perm = np.arange(pool_pages) if pattern == "adjacent" else rng.permutation(pool_pages)
        # distinct tokens, so every page gets its own chained SHA-256 key
        tokens = (np.arange(total_pages * ps, dtype=np.int64) + seed * 1_000_003) % 150_000
        keys = get_hash_str(tokens.tolist(), None, page_size=ps)
        assert len(set(keys)) == total_pages
        self.batches = []
        for start in range(0, total_pages, batch_pages):
            idx = np.arange(start, min(total_pages, start + batch_pages))
            pages = perm[idx % pool_pages]
            host = torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1))
            self.batches.append((keys[start:idx[-1] + 1], pages.tolist(),
                                 (idx + 1).tolist(), host))


# ------------------------------------------------------------------ controller steps
def file_backup(backend, pool, ps, keys, host_indices) -> bool:
    """HiCacheController._generic_page_set."""
    data = [pool.get_data_page(host_indices[i * ps]) for i in range(len(keys))]
    return backend.batch_set(keys, data)


def file_prefetch(backend, pool, ps, keys, host_indices) -> int:
    """HiCacheController._generic_page_get (returns the pages loaded)."""
    dummy_page_dst = [pool.get_dummy_flat_data_page() for _ in keys]
    page_data = backend.batch_get(keys, dummy_page_dst)
    if page_data is None:
        return 0
    count = 0
    for i in range(len(keys)):
        if page_data[i] is None:
            break
        pool.set_from_flat_data_page(host_indices[i * ps], page_data[i])
        count += 1
    return count


def kvblock_backup(backend, keys, host_indices, extra_info) -> bool:
    """HiCacheController._page_set_zero_copy."""
    return all(backend.batch_set_v1(keys, host_indices, extra_info))


def kvblock_prefetch(backend, keys, host_indices, extra_info) -> int:
    """HiCacheController._page_get_zero_copy."""
    results = backend.batch_get_v1(keys, host_indices, extra_info)
    inc = 0
    for r in results:
        if not r:
            break
        inc += 1
    return inc


# torch's own thread count, for the timed calls (HiCacheFile's page copies
# are torch's); the script's untimed torch work runs on --torch-threads
TIMED_THREADS = torch.get_num_threads()


def timed_threads():
    return fs.torch_threads(TIMED_THREADS)


# ------------------------------------------------------------------ one measurement
def measure(kind: str, loc: str, dev: str, pool: SGLangHostPool, expected: torch.Tensor,
            plan: Plan, page_bytes: int, args, profile: cProfile.Profile | None) -> dict:
    where = LOCATIONS[loc]
    layout, ps = pool.layout, pool.page_size
    total = sum(len(b[0]) for b in plan.batches) * page_bytes
    t0 = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix=f"kvblock-sglang-bench-{os.getpid()}-", dir=where))
    backend = None
    try:
        backend = attach(kind, pool, base, dev, args)
        setup_s = time.perf_counter() - t0
        # store
        store_s = 0.0
        for keys, pages, numbers, host in plan.batches:
            stamp(pool.kv_buffer, layout, ps, pages, numbers)
            info = HiCacheStorageExtraInfo(prefix_keys=None)
            with timed_threads():
                t = time.perf_counter()
                ok = (kvblock_backup(backend, keys, host, info) if kind == "kvblock"
                      else file_backup(backend, pool, ps, keys, host))
                store_s += time.perf_counter() - t
            if not ok:
                raise SystemExit(f"{LABEL[kind]} at {where}: batch_set failed "
                                 f"({len(keys)} pages of {page_bytes} bytes)")
        stats = backend.stats() if kind == "kvblock" else {}
        if stats.get("evicted_blocks"):
            raise SystemExit(f"kvblock store on {dev} too small: {stats['evicted_blocks']} "
                             "pages evicted")
        # Untimed, both backends alike: one batch loaded before the timed
        # loads, so that what a serving process makes once (kvblock's load
        # staging, 32 MiB at 256 KiB pages, touched at 1-2 GiB/s on this VM)
        # is not timed in every round, each of which attaches a new backend.
        keys, _, _, host = plan.batches[0]
        info = HiCacheStorageExtraInfo(prefix_keys=None)
        with timed_threads():
            got = (kvblock_prefetch(backend, keys, host, info) if kind == "kvblock"
                   else file_prefetch(backend, pool, ps, keys, host))
        if got != len(keys):
            raise SystemExit(f"{LABEL[kind]} at {where}: the warm-up load missed pages")
        fs.drop_caches()
        # hit query (SGLang's prefetch thread, before the transfer)
        t = time.perf_counter()
        for keys, _, _, _ in plan.batches:
            hit = backend.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=None))
            if hit != len(keys):
                raise SystemExit(f"{LABEL[kind]} at {where}: batch_exists found {hit} of "
                                 f"{len(keys)} stored pages")
        query_s = time.perf_counter() - t
        # load, into zeroed pages; every page checked
        load_s = 0.0
        for keys, pages, numbers, host in plan.batches:
            for p in pages:
                page_view(pool.kv_buffer, layout, ps, p).zero_()
            info = HiCacheStorageExtraInfo(prefix_keys=None)
            if profile is not None:
                profile.enable()
            with timed_threads():
                t = time.perf_counter()
                got = (kvblock_prefetch(backend, keys, host, info) if kind == "kvblock"
                       else file_prefetch(backend, pool, ps, keys, host))
                load_s += time.perf_counter() - t
            if profile is not None:
                profile.disable()
            if got != len(keys):
                raise SystemExit(f"{LABEL[kind]} at {where}: loaded {got} of {len(keys)} pages")
            stamp(expected, layout, ps, pages, numbers)
            for p in pages:
                # as integers: random bf16 bits hold NaNs, which never compare equal
                if not torch.equal(page_view(pool.kv_buffer, layout, ps, p).view(torch.int16),
                                   page_view(expected, layout, ps, p).view(torch.int16)):
                    raise SystemExit(f"{LABEL[kind]} at {where}, {page_bytes}-byte pages: "
                                     f"loaded bytes of pool page {p} differ from stored")
        files = (len([n for n in os.listdir(base / "hicache") if n.endswith(".bin")])
                 if kind == "file" else stats.get("put_blocks"))
    finally:
        if backend is not None and kind == "kvblock":
            backend.close()
        shutil.rmtree(base, ignore_errors=True)
    return {"backend": kind, "store_gibps": total / GIB / store_s,
            "load_gibps": total / GIB / load_s, "store_s": store_s, "load_s": load_s,
            "query_s": query_s, "setup_s": setup_s, "pages_stored": files,
            "total_s": time.perf_counter() - t0}


# ------------------------------------------------------------------ first usable layer
def first_usable_layer(where: Path, src: list, g) -> dict:
    """HiCacheFile's time to a usable first layer of a prefix, for
    perf/first_layer_vs_peers.py: ``src`` is the prefix as a vLLM NHD cache
    (one tensor per layer, 2 x pages x block_tokens x heads x dim, bf16),
    ``g`` its kvblock Geometry.  Every page (all layers, ``g.block_tokens``
    tokens) goes into a ``page_first`` host pool and is stored the way
    :func:`measure` stores it (``_generic_page_set``, batches of
    STORAGE_BATCH_SIZE), the page cache is dropped, the pool zeroed and every
    page prefetched (``_generic_page_get``): SGLang moves a page to the GPU
    only once it is whole in the host pool, so the first layer is usable
    when the last page has landed.  The hit query (``batch_exists``) is
    not timed, as vLLM's lookup is not.  Exits when a loaded byte differs."""
    set_env = [v for v in FILE_ENV if os.environ.get(v)]
    if set_env:
        raise SystemExit(f"unset {', '.join(set_env)}: they change HiCacheFile's behaviour")

    class Pool(SGLangHostPool):
        def randomize(self, seed: int) -> None:       # every byte is copied in below
            pass

    pages, ps = src[0].shape[1], g.block_tokens
    pool = Pool(layout="page_first", layers=g.num_layers, heads=g.num_kv_heads,
                head_dim=g.head_dim, page_size=ps, pages=pages)

    def layer(buf, n):                                 # (2, tokens, heads, dim)
        return buf[:, :, n]

    def loaded_as_stored() -> bool:
        return all(torch.equal(layer(pool.kv_buffer, n).view(torch.int16),
                               t.view(torch.int16).reshape(2, pages * ps, *t.shape[3:]))
                   for n, t in enumerate(src))

    for n, t in enumerate(src):
        layer(pool.kv_buffer, n).copy_(t.reshape(2, pages * ps, *t.shape[3:]))
    plan = Plan(pages, pages, STORAGE_BATCH_SIZE, ps, "adjacent", seed=ps)
    base = Path(tempfile.mkdtemp(prefix="kvblock-ttfl-hicache-", dir=where))
    try:
        backend = attach("file", pool, base, None, None)
        store_s = 0.0
        for keys, _, _, host in plan.batches:
            t = time.perf_counter()
            ok = file_backup(backend, pool, ps, keys, host)
            store_s += time.perf_counter() - t
            if not ok:
                raise SystemExit(f"HiCacheFile at {where}: batch_set failed")
        fs.drop_caches()
        for keys, _, _, _ in plan.batches:
            hit = backend.batch_exists(keys, HiCacheStorageExtraInfo(prefix_keys=None))
            if hit != len(keys):
                raise SystemExit(f"HiCacheFile at {where}: batch_exists found {hit} of "
                                 f"{len(keys)} stored pages")
        pool.kv_buffer.view(torch.int16).zero_()
        t = time.perf_counter()
        for keys, _, _, host in plan.batches:
            got = file_prefetch(backend, pool, ps, keys, host)
            if got != len(keys):
                raise SystemExit(f"HiCacheFile at {where}: loaded {got} of {len(keys)} pages")
        load_s = time.perf_counter() - t
        if not loaded_as_stored():
            raise SystemExit(f"HiCacheFile at {where}: restored KV differs from the saved KV")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"backend": "hicachefile", "store_s": store_s, "first_ms": load_s * 1e3,
            "all_ms": load_s * 1e3}


def fmt_size(n: int) -> str:
    if n >= MIB and n % MIB == 0:
        return f"{n >> 20} MiB"
    return f"{n >> 10} KiB" if n % 1024 == 0 else f"{n} B"


def geometry_for(page_bytes: int, args) -> int:
    """Tokens per page for ``page_bytes`` (exact, or an error)."""
    token_bytes = 2 * args.layers * args.heads * args.head_dim * 2  # K+V, bf16
    if page_bytes % token_bytes:
        raise SystemExit(f"a {page_bytes}-byte page is not a whole number of "
                         f"{token_bytes}-byte tokens ({args.layers} layers x {args.heads} "
                         f"heads x {args.head_dim} x K+V x bf16)")
    return page_bytes // token_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5, help="GiB stored and loaded per case")
    ap.add_argument("--pages", default="256K,2M", type=fs.comma_sizes,
                    help="page sizes (bytes of one SGLang page, all layers, K+V), comma separated")
    ap.add_argument("--locations", default="disk,shm", type=fs.comma_choices(LOCATIONS),
                    help=f"comma separated, of {sorted(LOCATIONS)}")
    ap.add_argument("--layout", choices=("page_first", "page_first_direct", "layer_first"),
                    default="page_first", help="host pool layout (--hicache-mem-layout)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8, help="KV heads of the rank")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pool", default="256M", type=fs.size_text, help="host pool size (pages are reused)")
    ap.add_argument("--batch-pages", type=int, default=STORAGE_BATCH_SIZE,
                    help=f"pages per storage call (SGLang's STORAGE_BATCH_SIZE: "
                         f"{STORAGE_BATCH_SIZE})")
    ap.add_argument("--pattern", choices=("adjacent", "scattered"), default="adjacent",
                    help="host pages of a batch: ascending adjacent, or a fragmented pool")
    ap.add_argument("--max-run-bytes", default=None, type=fs.size_text,
                    help="kvblock extra_config max_run_bytes (default: the backend's, 64M)")
    fs.add_write_cache_option(ap)
    ap.add_argument("--kvblock-target", choices=("loop", "file"), default="loop",
                    help="kvblock's store: a loop device over a file in the location "
                         "(default: the issue's method) or a pre-sized store file there "
                         "(kvblock's embedded target; on /dev/shm read through a mapping)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds per case (order alternates); medians are printed")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="threads of the script's own (untimed) torch work; more leave "
                         "OpenMP workers spinning into the timed calls, which run on torch's "
                         "default (default 1; fio_support.torch_threads says why)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile kvblock's loads; print the top N functions per case "
                         "(stderr; its timings then include the profiler's overhead)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true", help="exit 1 when a load bar is missed")
    args = ap.parse_args(argv)
    args.loop_write_cache = fs.write_cache_arg(ap, args)
    # (argparse's types check them: a bad value is a usage error, not a traceback)
    page_sizes, locations = args.pages, args.locations
    if args.rounds < 1 or args.batch_pages < 1 or args.gib <= 0 or args.torch_threads < 1:
        ap.error("--rounds, --batch-pages, --gib and --torch-threads must be positive")
    set_env = [v for v in FILE_ENV if os.environ.get(v)]
    if set_env:
        ap.error(f"unset {', '.join(set_env)}: they change HiCacheFile's behaviour")
    ok, why = fs.prerequisites()
    if not ok:
        print(f"sglang_vs_hicachefile: {why}", file=sys.stderr)
        return 2
    total = int(args.gib * GIB)
    cases = []
    for page in page_sizes:
        ps = geometry_for(page, args)
        n = total // page
        if n < 1:
            ap.error(f"--gib {args.gib} holds no {page}-byte page")
        pool_pages = max(min(args.batch_pages, n), min(parse_size(args.pool) // page, n))
        cases.append((page, ps, n, pool_pages))
    # the loop device holds one case's pages, plus room for metadata and for the
    # tail a region cannot fit a whole run in (regions are capacity/16 on small
    # devices, runs up to max_run_bytes: up to half a region can go unused)
    dev_bytes = (max(n * page for page, _, n, _ in cases) * 2 + 256 * MIB) // MIB * MIB
    rows, pools = [], {}
    t_start = time.monotonic()

    def body():
        with fs.torch_threads(args.torch_threads):
            cases_on_targets()

    def cases_on_targets():
        targets = (fs.attached_targets(locations, LOCATIONS, dev_bytes, args.loop_write_cache)
                   if args.kvblock_target == "loop" else store_files(locations, dev_bytes))
        for loc, dev in targets:
            for page, ps, n, pool_pages in cases:
                if page not in pools:
                    pool = SGLangHostPool(layout=args.layout, layers=args.layers,
                                          heads=args.heads, head_dim=args.head_dim,
                                          page_size=ps, pages=pool_pages, seed=page)
                    pools[page] = (pool, pool.kv_buffer.clone(),
                                   Plan(n, pool_pages, args.batch_pages, ps, args.pattern,
                                        seed=page % 9973))
                pool, expected, plan = pools[page]
                log(f"  {loc} {dev}: {fmt_size(page)} pages ({ps} tokens), {n} pages in "
                    f"{len(plan.batches)} batches, pool of {pool_pages} pages")
                prof = cProfile.Profile() if args.profile else None
                samples = {k: [] for k in BACKENDS}
                for rnd in range(args.rounds):
                    # alternate the order so drift and leftovers hit both backends alike
                    for kind in (BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]):
                        r = measure(kind, loc, dev, pool, expected, plan, page, args,
                                    prof if kind == "kvblock" else None)
                        samples[kind].append(r)
                        log(f"    round {rnd + 1} {LABEL[kind]:<11} store "
                            f"{r['store_gibps']:6.2f} GiB/s  load {r['load_gibps']:6.2f} GiB/s"
                            f"  query {r['query_s'] * 1e3:7.1f} ms")
                if prof is not None:
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(
                        args.profile)
                    log(f"  cProfile of kvblock's loads ({loc}, {fmt_size(page)} pages, "
                        f"{args.rounds} rounds), by own time:\n{out.getvalue()}")
                for kind in BACKENDS:
                    runs = samples[kind]
                    rows.append({
                        "backend": kind, "location": loc, "path": str(LOCATIONS[loc]),
                        "page_bytes": page, "page_tokens": ps, "pages": n,
                        "bytes": n * page,
                        "store_gibps": statistics.median(r["store_gibps"] for r in runs),
                        "load_gibps": statistics.median(r["load_gibps"] for r in runs),
                        "query_ms": statistics.median(r["query_s"] for r in runs) * 1e3,
                        "samples": runs})

    rc = fs.run_guarded("sglang_vs_hicachefile", body,
                        "loop devices detached" if args.kvblock_target == "loop"
                        else "store files removed")
    if rc is not None:
        return rc
    log(f"done in {time.monotonic() - t_start:.0f} s")
    pairs = [(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
    verdicts = []
    for kv, fl in pairs:
        bar = LOAD_BARS.get(kv["page_bytes"])
        ratio = kv["load_gibps"] / fl["load_gibps"]
        verdicts.append((bar, None if bar is None else ratio >= bar))
        kv["load_ratio"] = fl["load_ratio"] = ratio
        kv["store_ratio"] = fl["store_ratio"] = kv["store_gibps"] / fl["store_gibps"]
        kv["load_bar"] = fl["load_bar"] = bar
    missed = any(v is False for _, v in verdicts)
    settings = {"layout": args.layout, "pattern": args.pattern, "batch_pages": args.batch_pages,
                "layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
                "dtype": "bfloat16", "pool": args.pool, "rounds": args.rounds, "gib": args.gib,
                "max_run_bytes": args.max_run_bytes,
                "kvblock_target": args.kvblock_target, "loop_write_cache": args.loop_write_cache}
    if args.json:
        print(json.dumps({"rows": rows, "settings": settings}, indent=2))
        return 1 if args.check and missed else 0
    print(f"{args.gib:g} GiB per case, median of {args.rounds} rounds, {args.layout} host pool "
          f"({args.layers} layers x {args.heads} heads x {args.head_dim}, bf16), batches of "
          f"{args.batch_pages} pages ({args.pattern}); kvblock: batch_set_v1/batch_get_v1 on a "
          f"{'loop device' if args.kvblock_target == 'loop' else 'store file'}"
          f"{f' ({args.loop_write_cache})' if args.loop_write_cache else ''}, max_run_bytes={args.max_run_bytes or '64M'}; HiCacheFile: "
          f"batch_set/batch_get of flat pages, one file per page")
    head = (f"{'where':<5} {'page':>7} | {'kvblock store':>13} {'HiCacheFile store':>17} "
            f"{'ratio':>6} | {'kvblock load':>12} {'HiCacheFile load':>16} {'ratio':>6} "
            f"{'bar':>11}   (GiB/s)")
    print(head)
    print("-" * len(head))
    for (kv, fl), (bar, ok) in zip(pairs, verdicts):
        mark = "" if bar is None else f">={bar:.1f}x {'ok' if ok else 'MISS'}"
        print(f"{kv['location']:<5} {fmt_size(kv['page_bytes']):>7} | "
              f"{kv['store_gibps']:>13.2f} {fl['store_gibps']:>17.2f} "
              f"{kv['store_ratio']:>5.2f}x | "
              f"{kv['load_gibps']:>12.2f} {fl['load_gibps']:>16.2f} "
              f"{kv['load_ratio']:>5.2f}x {mark:>11}")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
