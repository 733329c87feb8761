"""SGLang HiCache: a kvblock store as the L3 storage backend.

SGLang 0.5.23 keeps evicted KV pages in a host pool (L2) and backs them up to
a ``HiCacheStorage`` (L3).  ``KVBlockHiCacheStorage`` is such a backend, on
raw NVMe namespaces or pre-sized files.  SGLang loads it with its dynamic
backend loader, which constructs ``cls(storage_config, kwargs)`` and then
calls ``register_mem_pool_host(host_pool)``::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvblock",
        "module_path": "kvblock.integrations.sglang",
        "class_name": "KVBlockHiCacheStorage", "interface_v1": 1,
        "devices": ["/dev/nvme1n1"], "format": "if-empty"}'

One SGLang page is one kvblock block.
    The store's geometry comes from the registered host pool (layers, KV heads
    of this rank, head dim, dtype, page size, MLA), so the store is opened --
    or formatted, per ``format`` -- in ``register_mem_pool_host``.  A store
    made for another geometry or another model is refused with
    ``GeometryMismatchError``.  Blocks are kept in kvblock's layer-major
    layout whatever the pool's layout, so a store written from a
    ``page_first`` pool serves a ``page_first_direct`` one and back.

Data path (``interface_v1: 1``, the zero-copy calls).
    ``batch_set_v1`` gathers the pages, layer by layer with one native row
    copy (kvblock.tensors.pagecopy), from the host pool into the store's
    aligned staging buffer laid out as the run's on-device image, and
    kvblock writes it with one direct I/O per run (kvblock.tensors.save_blocks).
    ``batch_get_v1`` reads each run straight into the thread's staging
    buffer (one read, its I/Os in flight together) and copies its pages into
    the pool in one pass.  That one copy per direction is the
    page-major -> layer-major transposition; nothing else is copied.  Runs
    are cut at ``max_run_bytes`` (the staging memory of the calling thread),
    and runs written at what one of the store's regions holds.
    Pages already stored are not written again (one vectorised index probe
    per call) but marked as just used for LRU eviction.  Supported pool layouts: ``page_first``,
    ``page_first_direct``, ``layer_first`` and ``page_unified`` (MLA; MHA with
    one head group), MHA (K and V of equal head dim) and MLA.  The older ``get``/``set`` calls take SGLang's flat pages
    (``get_data_page``/``get_dummy_flat_data_page`` order) and cost one more
    copy.

Hybrid models (``*_v2`` calls).
    SGLang's hybrid controller moves the KV pool and extra host pools (Mamba
    or SWA state, ...) with ``batch_set_v2``/``batch_get_v2``/``batch_exists_v2``.
    KV pages take the v1 path above; a page of an extra pool is stored as the
    pool's own flat page (``get_data_page(i, flat=True)`` /
    ``set_from_flat_data_page``), padded to whole kvblock blocks, under keys
    derived from the page key, the pool name and the page's format (size,
    dtype, shape, host layout: a page stored in another format is a miss).
    ``batch_exists_v2`` cuts the KV prefix by each pool's hit policy
    (``ALL_PAGES``: every page of the prefix; ``TRAILING_PAGES``: the last
    ``len(transfer.keys)`` pages).  A
    ``BLOCK_GROUPS`` pool does not cut it: its hit is the KV pages that its
    leading complete key groups cover (SGLang's docstring semantics; no
    SGLang 0.5.23 backend or caller uses that policy yet).

Keys.
    An SGLang page key (a SHA-256 chain hex string) names token content only.
    The kvblock key is ``xxh3_128(prefix || page_key)``; ``prefix`` hashes the
    model name, ``namespace`` (tenant/salt, default empty), TP rank and size
    (MHA: each rank holds its own heads; MLA pages are rank-replicated, the
    same at any TP size: their keys carry neither, so a restart at another
    TP size hits them), and PP and attention-CP rank/size, so two models or
    tenants never share blocks.
    Mamba state pages (hybrid models) are TP-sharded even beside MLA KV
    (SGLang has every rank back them up), so their keys always carry the TP
    rank; so do an MHA draft model's pages (``PoolName.DRAFT``), each rank's
    own heads: SGLang backs them up beside MLA KV from rank 0 only, so the
    other ranks miss them rather than load rank 0's heads (and, as SGLang
    takes the smallest hit of all ranks, such a model gets no L3 hit at
    tp_size > 1: each rank warns of it when the draft pool registers).
    The store itself is fingerprinted with the model name: a device formatted
    for one model is refused for another.  An fp8 cache's host pool is uint8
    for either fp8 format (SGLang tells backends no more): name the format
    in ``namespace``, or e4m3 pages would be served to an e5m2 restart.

Devices.
    A kvblock store is opened exclusively, so by default every SGLang rank
    (its own process) needs its own device(s): ``devices`` entries may
    contain ``{tp_rank}``, ``{tp_size}``, ``{pp_rank}``, ``{dp_rank}`` and ``{attn_cp_rank}``
    (e.g. ``"/dev/disk/by-id/nvme-kv-{tp_rank}"``), or ``devices`` may map a
    TP rank (as a string) to its list.  Pipeline stages share TP ranks, so
    with pp_size > 1 the paths (a dict's too) need ``{pp_rank}``.  Two ranks
    given the same devices: the second fails its open with
    ``DeviceBusyError`` (after a second), which names its ranks.

One store for every rank: ``"server"``.
    With ``"server": "/run/kvblock/sglang.sock"`` the ranks share one store
    on ``devices``: a ``kvblock serve`` process owns its metadata and each
    rank does its own direct I/O (kvblock.store.server).  The first rank to
    find no server on the socket formats the devices (per ``format``) and
    starts it, under a lock file beside the socket; the others connect.  An
    operator may start it instead (``kvblock serve DEV --socket PATH``).
    This is what MLA models with tp_size > 1 need: SGLang writes MLA pages
    from rank 0 only while every rank reads, and MLA keys carry no TP rank,
    so every rank hits what rank 0 wrote.  (MHA ranks keep their own keys in
    the shared store.)  Pipeline stages holding different numbers of layers
    cannot share one store (its geometry is one): give each stage its own,
    ``{pp_rank}`` in ``server`` and ``devices``.  Not with ``host_cache_bytes``.  An MLA model with
    tp_size > 1 and no ``server`` is refused: the ranks that do not write
    would never hit, and SGLang takes the smallest hit of all ranks.  With
    DP attention ``tp_rank`` counts within the attention group, so per-rank
    device templates need ``{dp_rank}`` too.

Configuration (``--hicache-storage-backend-extra-config``, besides SGLang's own
keys)::

    {"devices": ["/dev/nvme1n1"],       # or pre-sized files; see above for TP
     "server": null,                    # a socket path: one store shared by every rank
     "format": "if-empty",              # "never": only open; "force": format every start
     "size": "64G",                     # create missing files of this size
     "namespace": "",                   # tenant / salt mixed into every key
     "model": null,                     # override SGLang's model name
     "max_run_bytes": "64M",
     "verify": "always", "eviction": "lru", "admit_after": 1,   # KVStore options
     "region_size": null, "engine": null, "queue_depth": 32, "host_cache_bytes": 0}

``batch_set_v1`` reports pages that admission (``admit_after``) declines as
written: declining is the store's policy, not a failure to retry at once.

``clear()`` evicts every block of the store (all namespaces); ``get_stats()``
returns SGLang's ``StorageMetrics`` (pages and GB/s per call) when storage
metrics are enabled; ``stats()`` returns kvblock's own counters.
"""

from __future__ import annotations

import difflib
import json
import logging
import threading
import time
from typing import Any

import numpy as np
import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvblock.store import provision
from kvblock.units import MIN_FILE_SIZE, int_setting, name_setting, path_setting, size_setting
from kvblock.errors import ConfigError, DeviceBusyError, KVBlockError, ServerGoneError
from kvblock.integrations.failures import RUNTIME_FAILURES, FailureLog
from kvblock.layout import Geometry
from kvblock.layout.geometry import DTYPES
from kvblock.tensors import SGLangHostLayout, save_blocks
from kvblock.tensors.pagecopy import copy_pages
from kvblock.store import KVStore

logger = logging.getLogger(__name__)

# Model fingerprints of stores this backend formats start with this: a store
# written by anything else (another integration, `kvblock demo`) is refused.
STORE_MODEL_PREFIX = "kvblock.integrations.sglang/v1"
KEY_DOMAIN = b"kvblock-sglang-key-v1\0"
FORMAT_MODES = provision.FORMAT_MODES
LAYOUTS = ("page_first", "page_first_direct", "layer_first")
DEFAULT_MAX_RUN_BYTES = 64 << 20
_STORE_OPTIONS = ("verify", "eviction", "admit_after", "engine", "queue_depth",
                  "host_cache_bytes")
_OWN_KEYS = {"devices", "server", "format", "size", "namespace", "model", "max_run_bytes",
             "region_size", *_STORE_OPTIONS}
# SGLang's own keys in the same dict (the dynamic loader's, and HiCache's)
_KNOWN_KEYS = _OWN_KEYS | {"backend_name", "module_path", "class_name", "interface_v1",
                           "prefetch_threshold", "prefetch_timeout_base",
                           "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
                           # set by SGLang itself (unified radix cache) whenever
                           # --file-storage-path is given: no misspelling to warn of
                           "file_storage_path"}


# ---------------------------------------------------------------------- helpers
def _misspelt(key) -> str | None:
    """The kvblock key that ``key`` (not one kvblock or SGLang reads) is a
    close misspelling of -- another case, '-' for '_', a letter or two off --
    or None (another backend's or SGLang's key, passed on: only warned of)."""
    text = str(key)
    norm = text.lower().replace("-", "_").replace(" ", "_")
    if norm in _OWN_KEYS:
        return norm
    close = difflib.get_close_matches(norm, sorted(_OWN_KEYS), n=1, cutoff=0.8)
    return close[0] if close else None


def _parse_size(value, name: str, minimum: int = 1) -> int:
    return size_setting(value, "kvblock sglang backend", name, minimum)


FORCE_HINT = 'set "format": "force" in the extra config'   # (errors name the backend's setting)


def open_or_format(devices: list[str], geometry: Geometry, model: str, **kwargs) -> KVStore:
    """kvblock.store.provision.open_or_format, with this integration's wording."""
    return provision.open_or_format(devices, geometry, model, owner="the kvblock SGLang backend",
                                    force_hint=FORCE_HINT, **kwargs)


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"kvblock sglang backend: KV dtype {dtype} is not one kvblock stores "
                          f"({', '.join(DTYPES)})")
    return name


# Host pool buffers of per-page data outside kv_buffer (SGLang 0.5.23's MXFP8
# KV pool): such pools are refused, see register_mem_pool_host.
SCALE_BUFFERS = ("k_scale_host", "v_scale_host")


class PoolPages:
    """Per-page views of an SGLang host pool's ``kv_buffer``.

    ``paged_raw()[p]`` is a view (no copy) of page ``p`` shaped like one
    kvblock block: ``(layers, kv_parts, page_size, heads, head_dim)``.  Host pool
    shapes (``sglang/srt/mem_cache/pool_host/{mha,mla}.py``, ``init_kv_buffer``)::

        MHA layer_first       (2, L, size, H, D)
        MHA page_first        (2, size, L, H, D)
        MHA page_first_direct (2, pages, L, page_size, H, D)
        MLA layer_first       (L, size, 1, D)
        MLA page_first        (size, L, 1, D)
        MLA page_first_direct (pages, L, page_size, 1, D)
    """

    def __init__(self, kv_buffer: torch.Tensor, layout: str, page_size: int, mla: bool):
        if layout not in LAYOUTS + ("page_unified",):
            raise ConfigError(f"kvblock sglang backend: host pool layout {layout!r} is not "
                              f"supported; use one of {LAYOUTS + ('page_unified',)} "
                              "(--hicache-mem-layout)")
        if not isinstance(kv_buffer, torch.Tensor) or kv_buffer.device.type != "cpu":
            raise ConfigError("kvblock sglang backend: the host pool's kv_buffer must be one "
                              "CPU tensor (pools with split K/V buffers are not supported)")
        self.host_layout = layout
        if layout == "page_unified":
            kv_buffer, layout = _unified_as_direct(kv_buffer, page_size, mla), "page_first_direct"
        self.buf, self.layout, self.page_size, self.mla = kv_buffer, layout, page_size, mla
        shape = tuple(kv_buffer.shape)
        want_dims = (4 if mla else 5) + (layout == "page_first_direct")
        if len(shape) != want_dims or (not mla and shape[0] != 2) or (mla and shape[-2] != 1):
            raise ConfigError(f"kvblock sglang backend: {'MLA' if mla else 'MHA'} host pool "
                              f"kv_buffer of shape {shape} does not fit layout {layout!r}")
        if mla:
            self.layers = shape[0] if layout == "layer_first" else shape[1]
            self.kv_parts, self.heads, self.head_dim = 1, 1, shape[-1]
        else:
            self.layers = shape[1] if layout == "layer_first" else shape[2]
            self.kv_parts, self.heads, self.head_dim = 2, shape[-2], shape[-1]
        if layout == "page_first_direct":
            if shape[-3] != page_size:
                raise ConfigError(f"kvblock sglang backend: page_first_direct pool pages hold "
                                  f"{shape[-3]} tokens, not the page size {page_size}")
            self.num_pages = shape[0] if mla else shape[1]
        else:
            # the token axis: MHA (2, L, size..) / (2, size, ..); MLA (L, size..) / (size, ..)
            axis = (1 if layout == "layer_first" else 0) + (0 if mla else 1)
            self.num_pages = shape[axis] // page_size

    def cache_layout(self) -> SGLangHostLayout:
        """The pool as kvblock.tensors sees it (save_blocks / load_blocks)."""
        return SGLangHostLayout(self.buf, self.layout, self.page_size, mla=self.mla)

    def geometry(self) -> Geometry:
        return Geometry(num_layers=self.layers, num_kv_heads=self.heads, head_dim=self.head_dim,
                        dtype=_dtype_name(self.buf.dtype), block_tokens=self.page_size,
                        kv_parts=self.kv_parts, head_groups=1)

    def paged_raw(self) -> np.ndarray:
        """The whole pool as one numpy view (raw same-size ints, no copy)
        indexed by page: ``(pages, layers, kv_parts, page_size, heads,
        head_dim)``, for copies of many pages at once."""
        b = self.buf.detach()
        raw = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()]
        x = b.view(raw).numpy()
        P, ps = self.num_pages, self.page_size
        if self.mla:
            x = x[None]                                # MLA: kv_parts = 1 in front
        if self.layout == "page_first_direct":         # (kv, P, L, ps, H, D)
            return x.transpose(1, 2, 0, 3, 4, 5)
        if self.layout == "page_first":                # (kv, size, L, H, D)
            return x[:, :P * ps].reshape(x.shape[0], P, ps, *x.shape[2:]) \
                .transpose(1, 3, 0, 2, 4, 5)
        return x[:, :, :P * ps].reshape(x.shape[0], x.shape[1], P, ps, *x.shape[3:]) \
            .transpose(2, 1, 0, 3, 4, 5)               # (kv, L, size, H, D)


def _unified_as_direct(kv_buffer: torch.Tensor, page_size: int, mla: bool) -> torch.Tensor:
    """A ``page_unified`` kv_buffer (sglang/srt/mem_cache/pool_host/page_unified.py)
    as a ``page_first_direct`` view of the same memory, no copy.  MLA pages
    ``(pages, L, page_size, D)`` are page_first_direct's bytes without the
    head axis; MHA pages ``(pages, head_groups, L, 2, page_size, heads, D)``
    with one head group are kvblock's block order, K/V inside the layer, so
    the view only moves the K/V axis to the front.  Several head groups split
    a token's heads across the page: refused."""
    shape = tuple(kv_buffer.shape)
    if mla:
        if len(shape) != 4 or shape[2] != page_size:
            raise ConfigError(f"kvblock sglang backend: MLA page_unified kv_buffer of shape "
                              f"{shape} is not (pages, layers, {page_size}, dim)")
        return kv_buffer.unsqueeze(3)
    if len(shape) != 7 or shape[3] != 2 or shape[4] != page_size:
        raise ConfigError(f"kvblock sglang backend: MHA page_unified kv_buffer of shape {shape} "
                          f"is not (pages, head_groups, layers, 2, {page_size}, heads, dim)")
    if shape[1] != 1:
        raise ConfigError(f"kvblock sglang backend: a page_unified host pool of {shape[1]} head "
                          "groups keeps each token's heads in separate parts of the page, which "
                          "kvblock's page copies do not gather; use one head group, or "
                          "--hicache-mem-layout page_first / page_first_direct")
    return kv_buffer[:, 0].permute(2, 0, 1, 3, 4, 5)


class _StoreRestarted(ServerGoneError):
    """A backup met a new run of its store server (_cleared_since): the
    run it wrote after the restart was deleted, the rest not written."""


class _BackupCleared(Exception):
    """A clear() overtook a backup (_cleared_since): it wrote nothing of
    the call that the store still holds, and stopped."""


def _ticket_run(ticket: str) -> str:
    """The store run a clear ticket names (``run:clears``, KVStore's and a
    store server's alike)."""
    return str(ticket).rpartition(":")[0]


def _pool_key(name) -> str:
    """A pool name (PoolName or str) as the plain string SGLang keys results by."""
    return name.value if isinstance(name, PoolName) else str(name)


# ---------------------------------------------------------------------- the backend
class KVBlockHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 backend over a kvblock store (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None):
        self.storage_config = storage_config
        self._failed = FailureLog(logger, "kvblock sglang backend")
        extra = dict(storage_config.extra_config or {})
        self.extra = extra
        if storage_config.dcp_size > 1:
            raise ConfigError("kvblock sglang backend: decode context parallelism "
                              "(dcp_size > 1) is not supported")
        # (a list or true there was its repr: another tenant or store, unsaid)
        self.model = (name_setting(extra.get("model"), "kvblock sglang backend", "model")
                      or str(storage_config.model_name or ""))
        self.namespace = name_setting(extra.get("namespace"), "kvblock sglang backend",
                                      "namespace")
        unknown = sorted(set(extra) - _KNOWN_KEYS, key=str)
        for key in unknown:
            meant = _misspelt(key)
            if meant:
                raise ConfigError(f"kvblock sglang backend: extra-config key {key!r} is not "
                                  f"kvblock's; did you mean {meant!r}? (kvblock reads "
                                  f"{', '.join(sorted(_OWN_KEYS))})")
        if unknown:
            logger.warning("kvblock sglang backend: extra-config keys %s are not kvblock's "
                           "(a misspelling? kvblock reads %s)", unknown, sorted(_OWN_KEYS))
        self.devices = self._devices(extra.get("devices"))
        server = extra.get("server")
        if server is not None:
            server = path_setting(server, "kvblock sglang backend", "server",
                                  "/run/kvblock/sglang.sock")
        self.server = self._template(server, "server") if server else None
        self.format = extra.get("format", "if-empty")
        if self.format not in FORMAT_MODES:
            raise ConfigError(f"kvblock sglang backend: format must be one of {FORMAT_MODES}, "
                              f"got {self.format!r}")
        self.size = _parse_size(extra["size"], "size", MIN_FILE_SIZE) \
            if extra.get("size") is not None else None
        self.region_size = (_parse_size(extra["region_size"], "region_size")
                            if extra.get("region_size") is not None else None)
        self.max_run_bytes = _parse_size(extra.get("max_run_bytes", DEFAULT_MAX_RUN_BYTES),
                                         "max_run_bytes")
        if self.max_run_bytes <= 0:
            raise ConfigError("kvblock sglang backend: max_run_bytes must be positive")
        self.store_options = {k: extra[k] for k in _STORE_OPTIONS if extra.get(k) is not None}
        if "host_cache_bytes" in self.store_options:
            self.store_options["host_cache_bytes"] = _parse_size(
                self.store_options["host_cache_bytes"], "host_cache_bytes", 0)
        for key, least in (("queue_depth", 1), ("admit_after", 1)):
            if key in self.store_options:
                self.store_options[key] = int_setting(self.store_options[key],
                                                      "kvblock sglang backend", key, least)
        if storage_config.is_mla_model and storage_config.tp_size > 1 and not self.server:
            raise ConfigError(
                f"kvblock sglang backend: an MLA model at tp_size {storage_config.tp_size} "
                "needs one store for every rank: SGLang writes MLA pages from one rank only, "
                "so a rank's own store would never hit. Add \"server\": \"/run/kvblock/"
                "sglang.sock\" (one device set, shared through a store server)")
        self.prefix = self.key_prefix(storage_config, self.model, self.namespace)
        self.rank_prefix = self.key_prefix(storage_config, self.model, self.namespace,
                                           per_rank=True)
        self.store: KVStore | None = None
        self.pages: PoolPages | None = None
        self.mem_pool_host = None
        self._page_formats: dict[int, tuple] = {}   # id(pool) -> (pool, _page_format)
        self._metrics_lock = threading.Lock()
        # clear() calls so far: a backup that sees it move stops (its pages
        # hold KV from before the clear), see _clear_mark
        self._clears, self._clears_lock = 0, threading.Lock()
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}

    # ------------------------------------------------------------------ configuration
    def _devices(self, spec) -> list[str]:
        c = self.storage_config
        if spec is None:
            raise ConfigError('kvblock sglang backend: extra config needs "devices" (raw '
                              'devices or pre-sized files, one set per rank)')
        if isinstance(spec, dict):
            spec = spec.get(str(c.tp_rank), spec.get(c.tp_rank))
            if spec is None:
                raise ConfigError(f"kvblock sglang backend: no devices for tp_rank {c.tp_rank} "
                                  'in "devices"')
        if isinstance(spec, str):
            spec = [spec]
        # a null or a number is no path (null became a store file named "None")
        if not isinstance(spec, (list, tuple)) or not all(isinstance(d, str) for d in spec):
            raise ConfigError('kvblock sglang backend: "devices" must be a path or a list of '
                              f'paths (or a dict of them by TP rank), got {spec!r} for tp_rank '
                              f'{c.tp_rank}, e.g. ["/dev/disk/by-id/nvme-kv-{{tp_rank}}"]')
        devices = [self._template(d, "device") for d in spec]
        if not devices:
            raise ConfigError('kvblock sglang backend: "devices" is empty')
        return devices

    def _template(self, text, what: str) -> str:
        """``text`` with {tp_rank}, {tp_size}, {pp_rank}, {dp_rank} and
        {attn_cp_rank} filled in from this rank's storage config."""
        c = self.storage_config
        fields = {"tp_rank": c.tp_rank, "tp_size": c.tp_size, "pp_rank": c.pp_rank,
                  "dp_rank": c.dp_rank, "attn_cp_rank": c.attn_cp_rank}
        try:
            return str(text).format_map(fields)
        except (KeyError, ValueError, IndexError, AttributeError, TypeError) as e:
            raise ConfigError(f"kvblock sglang backend: bad {what} template {text!r}: "
                              f"{e}") from None

    @staticmethod
    def key_prefix(c: HiCacheStorageConfig, model: str, namespace: str, *,
                   per_rank: bool = False) -> bytes:
        """16 bytes mixed into every key: model, tenant and the rank's shard
        (MLA pages leave the TP rank and size out unless ``per_rank``: they
        are the same on every rank at any TP size, the latent KV replicated,
        so a restart at another TP size hits them, as HiCacheFile's keys)."""
        shared = c.is_mla_model and not per_rank
        shard = {"model": model, "namespace": namespace,
                 "tp_rank": None if shared else c.tp_rank,
                 "tp_size": None if shared else c.tp_size,
                 "pp": [c.pp_rank, c.pp_size], "attn_cp": [c.attn_cp_rank, c.attn_cp_size]}
        text = json.dumps(shard, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_digest(KEY_DOMAIN + text.encode())

    def kvblock_key(self, key: str) -> bytes:
        return xxhash.xxh3_128_digest(self.prefix + str(key).encode())

    def store_model(self) -> str:
        return f"{STORE_MODEL_PREFIX}:{self.model}"

    # ------------------------------------------------------------------ pool + store
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Called by SGLang right after construction: the pool fixes the geometry,
        so the store is opened (or formatted) here."""
        super().register_mem_pool_host(mem_pool_host)
        outside = [name for name in SCALE_BUFFERS if getattr(mem_pool_host, name, None) is not None]
        if outside:
            # MXFP8 KV: each page's scales live beside kv_buffer.  Stored
            # without them, a page restored into a reused host slot would be
            # dequantised with that slot's stale scales.
            raise ConfigError(
                f"kvblock sglang backend: {type(mem_pool_host).__name__} keeps each page's "
                f"scales outside kv_buffer ({', '.join(outside)}); kvblock stores kv_buffer "
                "pages only and would restore them without their scales (SGLang's own L3 "
                "backends refuse this pool too). Use a KV cache dtype without per-page "
                "scales, or run without --hicache-storage-backend")
        mla = getattr(mem_pool_host, "kv_cache_dim", None) is not None
        v_dim = getattr(mem_pool_host, "v_head_dim", None)
        if not mla and v_dim is not None and v_dim != getattr(mem_pool_host, "head_dim", v_dim):
            raise ConfigError("kvblock sglang backend: K and V head dims differ "
                              f"({mem_pool_host.head_dim} vs {v_dim}); not supported")
        pages = PoolPages(getattr(mem_pool_host, "kv_buffer", None), mem_pool_host.layout,
                          int(mem_pool_host.page_size), mla)
        geometry = pages.geometry()
        if self.store is not None:
            if self.store.geometry != geometry:
                raise ConfigError("kvblock sglang backend: a host pool of another geometry was "
                                  f"registered ({geometry.describe()}, store: "
                                  f"{self.store.geometry.describe()})")
            self.pages = pages
            return
        run_blocks = max(1, self.max_run_bytes // geometry.block_bytes)
        if self.server is not None:
            store = provision.open_shared(
                self.server, self.devices, geometry, self.store_model(),
                format=self.format, size=self.size, region_size=self.region_size,
                owner="kvblock sglang backend", force_hint=FORCE_HINT, **self.store_options)
        else:
            store = self._open_own(geometry)
        self.pages, self.store = pages, store
        self.run_blocks = run_blocks
        # A run written is at most one of the store's regions: a longer one
        # the store takes whole or not at all, and one it cannot hold at
        # once (a small store, max_run_bytes raised) it refuses every time
        # (StoreFullError); SGLang's pages are keyed one by one, so shorter
        # runs lose nothing.  (Reads have no such limit.)
        self.write_blocks = max(1, min(run_blocks, store.max_run_blocks))
        logger.info("kvblock: SGLang L3 on %s (%s, %s layout, %d pages per run)",
                    self.devices, geometry.describe(), pages.host_layout, run_blocks)

    def _open_own(self, geometry: Geometry) -> KVStore:
        """This rank's own store on its devices.  Every SGLang rank is a
        process of its own: a device another rank holds is a config that
        gave two ranks the same devices, which the error says."""
        try:
            return open_or_format(self.devices, geometry, self.store_model(),
                                  format=self.format, size=self.size,
                                  region_size=self.region_size, **self.store_options)
        except DeviceBusyError as e:
            c = self.storage_config
            if c.tp_size * c.pp_size * c.attn_cp_size == 1 and not c.dp_rank:
                raise
            raise DeviceBusyError(
                f"{e}. SGLang runs a process per rank (this one: tp_rank {c.tp_rank} of "
                f"tp_size {c.tp_size}, pp_rank {c.pp_rank} of pp_size {c.pp_size}, dp_rank "
                f"{c.dp_rank}, attn_cp_rank {c.attn_cp_rank} of attn_cp_size "
                f"{c.attn_cp_size}), each with its own store: give each rank its own "
                'devices ({tp_rank}, {pp_rank}, {dp_rank}, {attn_cp_rank} in the paths; a '
                '"devices" dict is keyed by TP rank only, so its paths need the others) or '
                'share one store ("server": "/run/kvblock/sglang.sock")',
                e.path, e.errno) from e

    def _ready(self) -> bool:
        return self.store is not None and not self.store.closed

    def _page_ids(self, keys: list[str], host_indices) -> list[int] | None:
        ps = self.pages.page_size
        if host_indices is None:    # PoolTransfer.host_indices is Optional
            logger.error("kvblock: no host indices for %d pages", len(keys))
            return None
        idx = host_indices.reshape(-1) if isinstance(host_indices, torch.Tensor) \
            else torch.as_tensor(host_indices).reshape(-1)
        if idx.numel() != len(keys) * ps:
            logger.error("kvblock: %d host indices for %d pages of %d tokens", idx.numel(),
                         len(keys), ps)
            return None
        pages = idx.cpu().reshape(len(keys), ps)
        starts = pages[:, 0]
        if bool((starts % ps != 0).any()) or bool((starts < 0).any()) or \
                bool((pages != starts[:, None] + torch.arange(ps)).any()):
            logger.error("kvblock: host indices are not whole pages (each page's %d indices "
                         "must be consecutive from a multiple of %d)", ps, ps)
            return None
        ids = (starts // ps).tolist()
        if ids and max(ids) >= self.pages.num_pages:
            logger.error("kvblock: host page %d outside the pool's %d pages", max(ids),
                         self.pages.num_pages)
            return None
        return ids

    def _clear_mark(self) -> tuple[int, str]:
        """What a backup call notes when it begins, for _cleared_since: this
        backend's clear() calls, then the store's clear ticket (a clear by
        another rank or client of a shared store).  A store that is away
        raises (the backup fails): noted as no ticket, a reconnect before
        the puts let the backup run with no clear or restart seen."""
        clears = self._clears
        return clears, self.store.clear_ticket()

    def _cleared_since(self, mark: tuple[int, str],
                       keys: list[bytes] | None = None) -> bool:
        """Has a clear() begun since a backup call noted ``mark``
        (_clear_mark)?  Then its later runs are not written, and ``keys``
        (the run just written, which the clear may have missed) are deleted:
        the call's pages hold KV from before the clear (SGLang clears after a
        weight update), and a run written after it would be served as a hit.
        The store itself refuses only a run that a clear() overtakes while
        it is written.  The caller raises _BackupCleared: every page of the
        call is answered False (the clear took those stored before it too),
        which ends SGLang's v1 backup of the operation (_page_backup stops at
        a batch not stored), so its later batches, of the old weights' KV,
        are not written under the new clear ticket either (SGLang 0.5.23's
        hybrid controller backs the KV pages up whatever batch_set_v2
        answered: README).  A ticket of
        another store run (the server restarted; no clear() of this
        backend's) stops the backup the same way but raises _StoreRestarted:
        a store failure, whose pages not stored are answered False (those
        stored before the restart stay)."""
        clears, ticket = mark
        now = self.store.clear_ticket()
        if self._clears == clears and now == ticket:
            return False
        if keys:
            self.store.delete(keys)
        if self._clears == clears and _ticket_run(now) != _ticket_run(ticket):
            # Only the store's run changed: its server restarted (and this
            # client reconnected).  A clear may have come on the old run, so
            # the backup stops as for one, but the restart is a store
            # failure: the pages not stored are answered so (False), as for
            # a server that dies part way, and SGLang stops the operation.
            raise _StoreRestarted(f"the store server restarted during the backup (clear "
                                  f"ticket {ticket!r} -> {now!r}); its later pages are "
                                  "not stored")
        return True

    def _answer_cleared(self, n: int) -> list[bool]:
        """The answer to a backup call of ``n`` pages that a clear()
        overtook (_BackupCleared): none stored."""
        logger.info("kvblock: a clear() overtook a backup of %d pages: none of them is "
                    "stored (answered False)", n)
        return [False] * n

    def _write_pages(self, pages: PoolPages, kbs: list[bytes], page_ids: list[int],
                     stored: np.ndarray | None = None,
                     clears: tuple[int, str] | None = None) -> int:
        """Store ``pages``' pages ``page_ids`` as runs of at most write_blocks
        (kvblock.tensors.save_blocks: one vectorised gather per layer into the
        store's staging, one write per run); returns the pages the store
        wrote, not those admission declined (raises on failure), and records
        them as a backup (get_stats: the v1 and the flat-page calls alike).
        ``stored`` (one bool per key) is set run by run, so after a failure
        it says which pages the store took.  ``clears``: the _clear_mark() when the
        call began; a clear() after it ends the backup (_cleared_since:
        _BackupCleared)."""
        done = written = 0
        t0 = time.perf_counter()
        layout = pages.cache_layout()
        clears = self._clear_mark() if clears is None else clears
        try:
            for start in range(0, len(kbs), self.write_blocks):
                keys = kbs[start:start + self.write_blocks]
                ids = page_ids[start:start + self.write_blocks]
                if self._cleared_since(clears):
                    raise _BackupCleared
                n = save_blocks(self.store, keys, layout, ids)
                done += len(keys)
                # stored and written before the check, which may fail (the
                # store closed or away): the run stays stored, answered so
                # and counted; a check that deletes it takes both back
                written += n
                if stored is not None:
                    stored[start:done] = True
                try:
                    if self._cleared_since(clears, keys):
                        written -= n
                        raise _BackupCleared
                except _StoreRestarted:   # the run was deleted again
                    written -= n
                    if stored is not None:
                        stored[start:done] = False
                    raise
        finally:    # a failed run: the runs before it were written all the same
            self._record("backup", written, time.perf_counter() - t0)
        return written

    def _read_pages(self, pages: PoolPages, kbs: list[bytes], page_ids: list[int],
                    what: str) -> int:
        """Load the stored prefix of kbs into ``pages``' pages ``page_ids``;
        returns its length, recorded as a prefetch (get_stats: the v1 and the
        flat-page calls alike).  A store failure (logged as ``what``) ends
        the prefix at the run it failed: the runs before it are in the pool
        and count (SGLang takes the leading loaded pages as the hit).
        Per run of at most run_blocks: one read of the whole run (its I/Os
        in flight together) into this thread's staging buffer, then one
        native copy of its pages into the pool (numpy's
        indexing where the pool's rows are too short for it).  Measured on /dev/shm,
        256 KiB pages: 113 -> 59 ms of copying per 0.5 GiB.  (SGLang prefetches
        whole pages, so the layer-wise pipeline of load_blocks buys nothing
        here, and its smaller reads measured slower: perf/sglang_vs_hicachefile.py.)"""
        g = self.store.geometry
        done = 0
        t0 = time.perf_counter()
        paged = pages.paged_raw()
        for start in range(0, len(kbs), self.run_blocks):
            keys, ids = kbs[start:start + self.run_blocks], page_ids[start:start + self.run_blocks]
            n = len(keys)
            try:
                view = self.store._staging(n * g.block_bytes, "pages").array[:n * g.block_bytes]
                got = self.store.get_run(keys, view)
            except KVBlockError as e:
                self._failed(what, e)
                break
            if got:
                src = view.view(paged.dtype).reshape(
                    g.num_layers, n, g.kv_parts, g.block_tokens, g.num_kv_heads,
                    g.head_dim)[:, :got].transpose(1, 0, 2, 3, 4, 5)
                dst = np.asarray(ids[:got], dtype=np.int64)
                if not copy_pages(paged, src, dst_ids=dst):
                    paged[dst] = src              # rows too short for it: numpy's indexing
            done += got
            if got < n:
                break
        self._record("prefetch", done, time.perf_counter() - t0)
        return done

    def _record(self, kind: str, pages: int, seconds: float,
                page_bytes: int | None = None) -> None:
        """One get_stats() entry: ``pages`` moved in ``seconds`` (``page_bytes``
        each; default a KV page, one kvblock block)."""
        if not self.storage_config.enable_storage_metrics or not pages:
            return
        gb = pages * (page_bytes or self.store.geometry.block_bytes) / 1e9
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gb / max(seconds, 1e-9))

    # ------------------------------------------------------------------ zero-copy calls
    def _v1_pages(self, keys: list[str], host_indices: torch.Tensor):
        """The host pages of a v1 call, or None when the call cannot be served
        (no keys, no store yet, bad indices: logged by _page_ids)."""
        if not keys or not self._ready():
            return None
        return self._page_ids(keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        page_ids = self._v1_pages(keys, host_indices)
        if page_ids is None:
            return [False] * len(keys)
        kbs = [self.kvblock_key(k) for k in keys]
        try:
            clears = self._clear_mark()
            ok = self._stored(kbs)
        except KVBlockError as e:
            self._failed(f"backing up {len(keys)} pages", e)
            return [False] * len(keys)
        todo = np.nonzero(~ok)[0]
        written = np.zeros(len(todo), dtype=bool)
        try:
            self._write_pages(self.pages, [kbs[i] for i in todo],
                              [page_ids[i] for i in todo], written, clears)
        except _BackupCleared:
            return self._answer_cleared(len(keys))
        except KVBlockError as e:
            # the runs before the failed one are stored: report them so
            self._failed(f"backing up {len(keys)} pages", e)
            ok[todo] = written
            return ok.tolist()
        return [True] * len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        page_ids = self._v1_pages(keys, host_indices)
        if page_ids is None:
            return [False] * len(keys)
        got = self._read_pages(self.pages, [self.kvblock_key(k) for k in keys], page_ids,
                               f"loading {len(keys)} pages")
        return [True] * got + [False] * (len(keys) - got)

    # ------------------------------------------------------------------ v2: hybrid models
    # Hybrid models (Mamba/SWA state, DSA indexer...) keep extra host pools
    # beside the KV pool; SGLang's hybrid controller moves them with the *_v2
    # calls.  KV pages go the v1 way.  An extra pool's page is opaque bytes
    # (the pool's own flat page: get_data_page / set_from_flat_data_page, as
    # SGLang's generic path uses), stored padded to whole kvblock blocks under
    # keys derived from the page key and the pool name.

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_key(host_pool_name)
        if name == PoolName.KV.value and self.store is None:
            self.register_mem_pool_host(host_pool)
        c = self.storage_config
        if c.is_mla_model and c.tp_size > 1 and name != PoolName.MAMBA.value and \
                self._rank_sharded(name):
            # (see _rank_sharded) SGLang backs this pool up from rank 0 only
            # and takes the smallest hit of all ranks: the L3 never hits.
            logger.warning(
                "kvblock sglang backend: an MHA draft pool %r beside MLA KV at tp_size %d: "
                "SGLang 0.5.23 backs it up from TP rank 0 only (per-rank draft backups are "
                "Mooncake's alone), and each rank holds its own heads of it, so ranks other "
                "than 0 miss it and the prefix with it; SGLang takes the smallest hit of all "
                "ranks, so this model gets no L3 hit from kvblock", name, c.tp_size)

    def _pool(self, name):
        pools = getattr(self, "registered_pools", {}) or {}
        for k, pool in pools.items():
            if _pool_key(k) == _pool_key(name):
                return pool
        raise ConfigError(f"kvblock sglang backend: no host pool {_pool_key(name)!r} was "
                          "registered (register_mem_host_pool_v2)")

    def _page_blocks(self, pool) -> tuple[int, int]:
        """(bytes of one flat page of ``pool``, kvblock blocks that hold it)."""
        return self._page_format(pool)[:2]

    def _page_format(self, pool) -> tuple[int, int, bytes]:
        """(bytes of one flat page of ``pool``, kvblock blocks that hold it,
        the page's format: size, dtype, shape and layout, mixed into its keys).  The
        padding to whole blocks hides a page's size, so a page stored in
        another format (a restart with another --mamba-ssm-dtype, MTP draft
        layers or slot side states added, another host layout) would load as
        the leading bytes of the old one; keyed by format it is a miss."""
        cached = self._page_formats.get(id(pool))
        if cached is not None and cached[0] is pool:
            return cached[1]
        page = pool.get_dummy_flat_data_page()
        nbytes = page.numel() * page.element_size()
        shaped = pool.get_data_page(0, flat=False)
        # the layout too: a page's bytes are in its layout's order, and two
        # layouts can give the same shape (page_first (2, ps, L, ..) and
        # layer_first (2, L, ps, ..) when ps == L)
        tag = (f"{nbytes}:{page.dtype}:{shaped.dtype}:{tuple(shaped.shape)}:"
               f"{getattr(pool, 'layout', None)}").encode()
        fmt = (nbytes, -(-nbytes // self.store.geometry.block_bytes), tag)
        self._page_formats[id(pool)] = (pool, fmt)
        return fmt

    def _rank_sharded(self, name) -> bool:
        """Does each TP rank hold its own part of pool ``name``'s pages,
        whatever the KV pool is?  Mamba state, and an MHA KV pool (an MHA
        draft model's, ``PoolName.DRAFT``/``DRAFT_SWA``, beside an MLA main
        model: each rank has its own heads; SGLang's MHATokenToKVPoolHost,
        ``head_num`` without MLA's ``kv_cache_dim``).  SGLang 0.5.23 backs
        such a draft pool up from TP rank 0 only (for backends other than
        Mooncake, which keys it per rank): keyed without the rank, every
        other rank loaded rank 0's heads as its own; keyed per rank, they
        miss."""
        if _pool_key(name) == PoolName.MAMBA.value:
            return True
        try:
            pool = self._pool(name)
        except ConfigError:
            return False
        return getattr(pool, "head_num", None) is not None and \
            getattr(pool, "kv_cache_dim", None) is None

    def _pool_keys(self, name, keys: list[str], nb: int, page_format: bytes) -> list[bytes]:
        """The nb block keys of each page of pool ``name`` in ``page_format``
        (_page_format).  A TP-sharded pool's keys name the rank whatever the
        KV pool is (_rank_sharded: Mamba state, which SGLang backs up on
        every rank and HiCacheFile keys per rank too; an MHA draft pool)."""
        tag = _pool_key(name)
        prefix = self.rank_prefix if self._rank_sharded(name) else self.prefix
        return [xxhash.xxh3_128_digest(prefix + f"{k}\0{tag}\0{i}\0".encode() + page_format)
                for k in keys for i in range(nb)]

    def _pool_present(self, name, keys: list[str], backup: bool = False) -> np.ndarray:
        """Per page key: are all blocks of its ``name`` pool page stored?
        ``backup``: a backup's probe, which marks them used (_stored)."""
        if not keys:
            return np.zeros(0, dtype=bool)
        _, nb, page_format = self._page_format(self._pool(name))
        kbs = self._pool_keys(name, keys, nb, page_format)
        found = self._stored(kbs) if backup else self.store.present(kbs)
        return found.reshape(len(keys), nb).all(axis=1)

    def _stored(self, kbs: list[bytes]) -> np.ndarray:
        """A backup's probe: per key, is it stored already?  Those are not
        written again but marked as just used (touch), as HiCacheFile
        refreshes a page set again: SGLang backs a prefix up again when it
        computed it anew, so LRU must not evict it as one never used since."""
        found = self.store.present(kbs)
        if found.any():
            self.store.touch([k for k, f in zip(kbs, found.tolist()) if f])
        return found

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix: KV pages stored from the start, cut where an
        extra pool lacks what its hit policy needs (ALL_PAGES: every page of
        the prefix; TRAILING_PAGES: the last len(transfer.keys) pages).  A
        BLOCK_GROUPS pool never cuts it: it reports, as its own hit, the KV
        pages covered by its leading complete key groups (``group_pages`` of
        its keys per group, ``block_pages`` KV pages per group)."""
        kv = self.batch_exists(keys)
        hits: dict[str, int] = {PoolName.KV.value: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            name = _pool_key(t.name)
            if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                covered = self._block_groups_hit(t, kv)
                if covered:
                    hits[name] = covered
                continue
            try:
                have = self._pool_present(t.name, keys[:kv])
            except KVBlockError as e:
                self._failed(f"looking up pool {name}", e)
                have = np.zeros(kv, dtype=bool)
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                missing = np.nonzero(~have)[0]
                boundary = int(missing[0]) if missing.size else kv
                ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv + 1) if have[max(0, n - trailing):n].all()}
                boundary = max(ok, default=0)
            else:
                logger.error("kvblock: hit policy %s of pool %s is not supported; the pool "
                             "reports no hits", t.hit_policy, name)
                continue
            if boundary:
                hits[name] = boundary
            restorable &= ok
        final = sorted(restorable)
        return PoolTransferResult(final[-1] if final else 0, hits, final)

    def _block_groups_hit(self, t: PoolTransfer, kv: int) -> int:
        """KV pages (at most ``kv``) covered by the leading groups of
        ``t.keys`` whose every key is stored; 0 when the transfer does not
        give its group geometry."""
        name = _pool_key(t.name)
        per_group, block = int(t.group_pages or 0), int(t.block_pages or 0)
        if per_group <= 0 or block <= 0:
            logger.error("kvblock: BLOCK_GROUPS pool %s without group_pages/block_pages "
                         "(%s/%s); the pool reports no hits", name, t.group_pages,
                         t.block_pages)
            return 0
        groups = len(t.keys or []) // per_group
        if not groups or not kv:
            return 0
        try:
            have = self._pool_present(t.name, list(t.keys[:groups * per_group]))
        except KVBlockError as e:
            self._failed(f"looking up pool {name}", e)
            return 0
        whole = have.reshape(groups, per_group).all(axis=1)
        lead = int(np.argmin(whole)) if not whole.all() else groups
        return min(kv, lead * block)

    def _v2(self, transfers: list[PoolTransfer], load: bool) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name = _pool_key(t.name)
            keys = list(t.keys or [])
            if not keys:
                out[name] = []
                continue
            if name == PoolName.KV.value:
                call = self.batch_get_v1 if load else self.batch_set_v1
                out[name] = call(keys, t.host_indices)
                continue
            try:
                out[name] = self._pool_io(t, keys, load)
            except KVBlockError as e:
                self._failed(f"{'loading' if load else 'storing'} {len(keys)} {name} pages", e)
                out[name] = [False] * len(keys)
        return out

    def _staged_pages(self, npages: int, nblocks: int, bb: int):
        """``npages`` pages of ``nblocks`` blocks in this thread's staging
        buffer: the pages, and the blocks' views.  A store call (inside the
        caller's failure handling): StoreClosedError once the store closed."""
        buf = self.store._staging(nblocks * bb, "pages").array[:nblocks * bb]
        return buf.reshape(npages, nblocks // npages * bb), list(buf.reshape(nblocks, bb))

    def _pool_io(self, t: PoolTransfer, keys: list[str], load: bool) -> list[bool]:
        """One extra pool's pages to or from the store: one run per
        max_run_bytes of pages (SGLang's backup hands a KV-derived pool every
        page of the operation in one call; the thread's staging is kept, so it
        must not grow to the largest call).  A page's bytes lie in its own
        blocks (put_blocks/get_blocks, one buffer a block), so any subset or
        grouping of pages reads back what was written; a run buffer would
        spread each page across the run's layers."""
        if not self._ready():
            return [False] * len(keys)
        pool = self._pool(t.name)
        ps = int(getattr(pool, "page_size", 1) or 1)
        idx = t.host_indices.reshape(-1) if t.host_indices is not None else None
        if idx is None or idx.numel() != len(keys) * ps:
            logger.error("kvblock: %s host indices for %d %s pages of %d slots",
                         None if idx is None else idx.numel(), len(keys), _pool_key(t.name), ps)
            return [False] * len(keys)
        offsets = idx[::ps].tolist()
        nbytes, nb, page_format = self._page_format(pool)
        bb = self.store.geometry.block_bytes
        todo = list(range(len(keys)))
        clears = None if load else self._clear_mark()   # (a store call: backups only)
        if not load:
            todo = np.nonzero(~self._pool_present(t.name, keys, backup=True))[0].tolist()
            if not todo:
                return [True] * len(keys)
        # (pages whose blocks fit one region: see write_blocks)
        per_run = max(1, min(self.max_run_bytes // (nb * bb), self.write_blocks // nb))
        page = None if not load else pool.get_dummy_flat_data_page()  # the pool copies from it
        got = written = 0
        t0 = time.perf_counter()
        for start in range(0, len(todo), per_run):
            run = todo[start:start + per_run]
            kbs = self._pool_keys(t.name, [keys[i] for i in run], nb, page_format)
            if not load:
                stored = start
                try:
                    pages, blocks = self._staged_pages(len(run), len(kbs), bb)
                    for j, i in enumerate(run):
                        data = pool.get_data_page(offsets[i], flat=True)
                        pages[j, :nbytes] = \
                            data.contiguous().view(torch.uint8).reshape(-1).numpy()
                        pages[j, nbytes:] = 0
                    if self._cleared_since(clears):
                        raise _BackupCleared
                    n = self.store.put_blocks(kbs, blocks) // nb
                    # (a failure of the check below: stored and written all the same)
                    stored += len(run)
                    written += n          # pages the store wrote (not those admission declined)
                    try:
                        if self._cleared_since(clears, kbs):
                            written -= n
                            raise _BackupCleared
                    except _StoreRestarted:   # the run was deleted again
                        stored -= len(run)
                        written -= n
                        raise
                except _BackupCleared:
                    self._record("backup", written, time.perf_counter() - t0, nbytes)
                    return self._answer_cleared(len(keys))
                except KVBlockError as e:
                    # the runs before the failure are stored: report them so
                    self._failed(f"storing {len(keys)} {_pool_key(t.name)} pages", e)
                    self._record("backup", written, time.perf_counter() - t0, nbytes)
                    ok = np.ones(len(keys), dtype=bool)
                    ok[todo[stored:]] = False
                    return ok.tolist()
                continue
            try:
                pages, blocks = self._staged_pages(len(run), len(kbs), bb)
                n = self.store.get_blocks(kbs, blocks) // nb
            except KVBlockError as e:
                # the runs before the failure are in the pool: report them so
                self._failed(f"loading {len(keys)} {_pool_key(t.name)} pages", e)
                break
            for j in range(n):
                page.view(torch.uint8).reshape(-1).copy_(torch.from_numpy(pages[j, :nbytes]))
                pool.set_from_flat_data_page(offsets[run[j]], page)
            got += n
            if n < len(run):
                break
        self._record("prefetch" if load else "backup", got if load else written,
                     time.perf_counter() - t0, nbytes)
        if not load:
            return [True] * len(keys)
        return [True] * got + [False] * (len(keys) - got)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._v2(transfers, load=True)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._v2(transfers, load=False)

    # ------------------------------------------------------------------ lookups
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Length of the leading run of stored keys."""
        if not keys or not self._ready():
            return 0
        try:
            return self.store.lookup([self.kvblock_key(k) for k in keys])
        except RUNTIME_FAILURES as e:
            self._failed("a lookup", e)
            return 0

    # ------------------------------------------------------------------ flat-page calls
    def _flat_shape(self) -> tuple[tuple[int, ...], int]:
        """Shape of one flat page as the host pool produces it (``get_data_page``)
        and the axis along which pages concatenate into a pool of that layout."""
        p = self.pages
        ps, L, H, D = p.page_size, p.layers, p.heads, p.head_dim
        if p.mla:
            return {"layer_first": ((L, ps, 1, D), 1), "page_first": ((ps, L, 1, D), 0),
                    "page_first_direct": ((1, L, ps, 1, D), 0)}[p.layout]
        return {"layer_first": ((2, L, ps, H, D), 2), "page_first": ((2, ps, L, H, D), 1),
                "page_first_direct": ((2, 1, L, ps, H, D), 1)}[p.layout]

    def _flat_pool(self, n: int, like: torch.Tensor | None = None) -> tuple[PoolPages, tuple]:
        shape, axis = self._flat_shape()
        full = list(shape)
        full[axis] *= n
        buf = torch.empty(full, dtype=self.pages.buf.dtype) if like is None else like
        # (page_unified pools are handled as their page_first_direct view:
        # SGLang's get_data_page has no flat page for that layout)
        return PoolPages(buf.view(full), self.pages.layout, self.pages.page_size,
                         self.pages.mla), (shape, axis)

    def batch_set(self, keys: list[str], values: Any | None = None,
                  target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        if not keys:
            return True
        if not self._ready() or values is None or len(values) != len(keys):
            return False
        if not all(isinstance(v, torch.Tensor) for v in values):
            # (a None page reached v.reshape: an AttributeError out of a
            # call that answers a bool, as set(key, None) and HiCacheFile do)
            logger.error("kvblock: batch_set of %d pages given a page that is no tensor (%s)",
                         len(keys), next(type(v).__name__ for v in values
                                         if not isinstance(v, torch.Tensor)))
            return False
        shape, axis = self._flat_shape()
        try:
            pages = torch.cat([v.reshape(shape) for v in values], dim=axis)
        except (RuntimeError, ValueError) as e:
            logger.error("kvblock: flat pages do not fit the host pool's page shape %s: %s",
                         shape, e)
            return False
        pool, _ = self._flat_pool(len(keys), pages)
        kbs = [self.kvblock_key(k) for k in keys]
        try:
            clears = self._clear_mark()
            todo = np.nonzero(~self._stored(kbs))[0].tolist()
            self._write_pages(pool, [kbs[i] for i in todo], todo, clears=clears)
        except _BackupCleared:
            return all(self._answer_cleared(len(keys)))
        except KVBlockError as e:
            self._failed(f"storing {len(keys)} flat pages", e)
            return False
        return True

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value] if value is not None else None)

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        if not keys:
            return []
        if not self._ready():
            return [None] * len(keys)
        pool, (shape, axis) = self._flat_pool(len(keys))
        got = self._read_pages(pool, [self.kvblock_key(k) for k in keys], list(range(len(keys))),
                               f"loading {len(keys)} flat pages")
        out: list[torch.Tensor | None] = []
        for i in range(len(keys)):
            if i >= got:
                out.append(None)
                continue
            page = pool.buf.narrow(axis, i * shape[axis], shape[axis]).reshape(-1)
            target = target_locations[i] if target_locations is not None else None
            if target is None:
                out.append(page.clone())
            else:
                target.view(-1).copy_(page)
                out.append(target)
        return out

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    # ------------------------------------------------------------------ housekeeping
    def clear(self) -> bool:
        """Forget every block of the store, DRAM tier included (SGLang clears
        after a weight update: the same page keys would name other KV)."""
        if not self._ready():
            return False
        with self._clears_lock:   # before the store's clear: see _cleared_since
            self._clears += 1
        try:
            self.store.clear()
        except KVBlockError as e:
            self._failed("clear", e)
            return False
        return True

    def get_stats(self):
        """SGLang's StorageMetrics for the calls since the last get_stats()."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._metrics_lock:
            for name, values in self._metrics.items():
                getattr(metrics, name).extend(values)
                values.clear()
        return metrics

    def stats(self) -> dict:
        """kvblock's counters and gauges for this backend's store, and how
        many store failures were answered as misses."""
        own = {"store_failures": self._failed.count}
        if self.store is None:
            return own
        try:
            return {**self.store.stats(), **own}
        except RUNTIME_FAILURES as e:
            return {**own, "store_error": str(e)}

    def close(self) -> None:
        """Checkpoint and close the store (fast reopen).  The closed store is
        kept: a call in flight on another thread (SGLang's prefetch or backup
        thread) then meets StoreClosedError in its next store operation and
        answers a miss, where self.store = None failed it with AttributeError."""
        if self.store is not None:
            self.store.close()

    def __repr__(self) -> str:
        return f"KVBlockHiCacheStorage({self.devices}, model={self.model!r}, store={self.store!r})"
