"""vLLM tiered KV offloading: a kvblock store as a secondary tier.

vLLM 0.33's ``TieringOffloadingSpec`` keeps offloaded KV in a CPU primary
pool (one slot of ``block_size_bytes`` per offload chunk) and cascades slots
to secondary tiers; ``KVBlockTierManager`` is such a tier, backed by a
kvblock store on raw NVMe namespaces or pre-sized files.  vLLM calls every
method from its scheduler thread, so none of them does I/O: ``submit_store``
and ``submit_load`` queue the job and return, a small pool of worker threads
runs the kvblock reads and writes, and ``get_finished_jobs`` hands back the
results.

Geometry: a slot is one kvblock block.
    The tier only ever moves whole slots between the primary pool and the
    store; what a slot holds (every worker's pages of a chunk, every layer,
    maybe padding) is vLLM's business.  So the store is formatted with the
    byte geometry ``Geometry(num_layers=1, num_kv_heads=1,
    head_dim=block_size_bytes, dtype="uint8", block_tokens=1, kv_parts=1)``:
    ``block_bytes == block_size_bytes`` exactly, a run has a single
    (layer, head group) range, and a run of N slots is on the device exactly
    what N adjacent slots are in the pool.  vLLM sizes slots in whole pages,
    so the range needs no padding and kvblock reads and writes it straight
    from and into the pool.  (kvblock's layer-wise layout buys nothing here:
    the CPU->GPU step is vLLM's, one slot at a time.)

Zero copy.
    A job is cut into pieces of at most ``max_run_bytes`` (and 1/8 of a store
    region), each stored as one kvblock run (one journal record); the pieces
    of a job run in parallel on the workers.  A load cut the same way as the
    store (same keys in the same order: vLLM promotes a request's prefix in
    order) reads whole runs.  When a piece's ``chunk_ids`` are ascending and
    adjacent, ``put_run``/``get_run`` get the pool slice itself: one large
    direct I/O.  Otherwise (a fragmented or reused pool) ``put_blocks`` /
    ``get_blocks`` get the slots where they are: one direct I/O per slot
    (slots that happen to touch are merged), checksummed piece by piece, no
    staging copy.  Keys already in the store, or being stored by another
    job, are not written again.

Keys and namespaces.
    A vLLM ``OffloadKey`` (block hash + KV group index) names token content
    only: two models see the same keys for the same prompt.  The kvblock key
    is ``xxh3_128(prefix || offload_key)`` where ``prefix`` hashes the served
    model's name (``model`` overrides it), the tier's ``namespace`` (a
    tenant or salt, default empty) and the slot layout (dtype, tokens per
    hash, blocks per chunk, parallel sizes, KV groups, slot size), so two
    models, two tenants, or one model under two layouts never share blocks,
    while a store can serve several of them in turn.  Slots whose bytes
    vLLM makes the same under any parallel layout (its replicated MLA
    layout, certified canonical pages) leave the parallel sizes out, as
    vLLM's fs tier does: deployments sharded differently share them.

Data-parallel replicas.
    Every replica (engine) builds its own tier from the same config.  The
    store's devices are opened exclusively, so either give each replica its
    own: ``{dp_rank}`` in ``devices`` (and ``server``) is the replica's
    index, e.g. ``"/dev/disk/by-id/nvme-kv-{dp_rank}"``; or share one store
    with ``"server": "/run/kvblock/vllm.sock"``: the first replica formats
    the devices (per ``format``) and starts a ``kvblock serve`` process that
    owns the metadata, and every replica does its own direct I/O.  Replicas
    of one model then hit what any of them stored.

Store lifecycle.
    ``format="if-empty"`` (default) opens the store on ``devices`` and
    formats it when they hold none (refusing block devices on which blkid
    finds a filesystem or partition table: ``UnsafeTargetError``);
    ``"never"`` only opens; ``"force"`` formats every start (with ``server``:
    the start that launches the server; a server still running from an
    earlier run is used as it is, with a warning).  A store made
    for another slot size, or by something other than this tier, is refused
    with ``GeometryMismatchError``.  ``shutdown()`` cancels queued jobs,
    waits for running ones and closes the store (a checkpoint: fast reopen).

Lookups: HIT when the store holds the key, else RETRY while a store job for
the key is in flight (or while a worker has held the store's index lock for
over a millisecond), else MISS.  A load that finds a key evicted since its lookup
fails for that key only (``JobResult.successful_keys`` names the others);
so does one whose run cannot be read (EIO): the store drops that run, so
the next lookup misses instead of vLLM promoting it again every step.  A
load that fails while the store keeps the key (an I/O engine failure that
reached no device, a drop that failed) makes the key a MISS for the request
that met it, until that request finishes, as vLLM's fs tier does: else
vLLM's tiering manager would promote it again every step, and the request
would wait for good.

Configuration (one entry of ``secondary_tiers``)::

    {"type": "kvblock", "devices": ["/dev/nvme1n1"],     # or pre-sized files
     "format": "if-empty", "namespace": "",  # tenant / salt mixed into every key
     "model": null,            # override the served model's name in the keys
     "server": null,           # a socket path: one store for every DP replica
     "size": "64G",            # create missing files of this size
     "threads": 8, "max_run_bytes": "16M", "verify": "always",
     "eviction": "lru", "region_size": null, "engine": null, "queue_depth": 32,
     "locality": null,         # "LOCAL" / "REMOTE": carried by its KV events
     "enable_kv_events": false}  # BlockStored/BlockRemoved (with vLLM's KV events on)

KV events carry ``ownership="kvblock:<store uuid>"`` (the tier type, then
the store's uuid: two kvblock tiers in one vLLM are two residencies).

Metrics: the store's gauges and counters, and the tier's configuration,
reach vLLM's Prometheus metrics through its own tier hooks
(``build_metric_definitions``, ``get_stats``, ``config_info``;
kvblock/integrations/vllm_metrics.py).  KV cache events: what store jobs
put, and its removal once evicted, deleted or cleared
(kvblock/integrations/vllm_events.py).

Register the type with :func:`register` (the ``vllm.general_plugins`` entry
point does it in every vLLM process), or name this module in the tier config
(``"type": "KVBlockTierManager", "module_path": "kvblock.integrations.vllm"``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import xxhash
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from kvblock.devices.device import refuse_missing
from kvblock.store import provision
from kvblock.units import MIN_FILE_SIZE, flag_setting, int_setting, name_setting, size_setting
from kvblock.errors import (
    ConfigError,
    DeviceBusyError,
    IOFailedError,
    KVBlockError,
)
from kvblock.integrations.failures import RUNTIME_FAILURES, FailureLog
from kvblock.integrations.vllm_events import TierEvents
from kvblock.integrations.vllm_metrics import INFO_KEYS, StoreStats, metric_definitions
from kvblock.layout import Geometry
from kvblock.store import KVStore

logger = logging.getLogger(__name__)

TIER_TYPE = "kvblock"
# Model fingerprint of stores this tier formats: a store written by anything
# else (a `kvblock demo` store, another engine's) is refused at open.
STORE_MODEL = "kvblock.integrations.vllm/v1"
FORMAT_MODES = provision.FORMAT_MODES
DEFAULT_MAX_RUN_BYTES = 16 << 20
DEFAULT_THREADS = 8
# How long lookup() waits for the store's index lock before it answers
# RETRY.  Workers hold the lock for microseconds, but a thread switch can
# leave it held for a while; without a wait a busy tier answered RETRY to
# over half of its lookups (each one defers a request by a step).  Only the
# first lookup that finds it busy waits: vLLM's scheduler goes on looking up
# a request's next keys after a RETRY, so a lock held long (a checkpoint's
# snapshot, an eviction's scan) would cost it this wait per key of every
# waiting request; the next ones try without waiting until it is free again.
LOOKUP_LOCK_WAIT_S = 0.001
# On a shared store, how long lookup() waits for the server's answer: a hung
# server costs the scheduler one such wait, then lookups miss at once until
# the tier has reconnected.
LOOKUP_ANSWER_TIMEOUT_S = 1.0
# How long shutdown() lets the workers finish the pieces they run; those
# still in a store call then (a hung store server: the shared store's own
# request timeout is 60 s) are cut, the store closed under them.
SHUTDOWN_WAIT_S = 5.0
# A worker that takes a load (or a store) of at most SMALL_PIECE_SLOTS
# adjacent slots also takes the small ones of its kind queued behind it, up
# to BATCH_BYTES in all (and max_run_bytes), and hands them to the store in
# one call: KVStore.get_runs for loads, put_runs (one flush, one journal
# commit) for stores.  A promotion of a few slots costs more in Python and
# in thread switches for the GIL than in copying, and workers running small
# loads side by side mostly take turns.  perf/partial_promotions.py (2-slot
# promotions of 256 KiB slots, 32 queued at once) with batches of up to 16
# / 4 / 2 MiB: store file in /var/tmp 0.34-0.38 / 0.27-0.29 / 0.31-0.32 ms
# per job; loop device 0.35-0.52 / 0.31-0.32 ms; /dev/shm store file
# 0.20-0.21 / 0.19-0.21 ms.  A smaller batch leaves work for the other
# workers (reads in flight, hashing as they land, on more than one core).
SMALL_PIECE_SLOTS = 8
BATCH_BYTES = 4 << 20


# ---------------------------------------------------------------------- helpers
def slot_geometry(block_size_bytes: int) -> Geometry:
    """The byte geometry whose block is one primary-pool slot."""
    return Geometry(num_layers=1, num_kv_heads=1, head_dim=int(block_size_bytes),
                    dtype="uint8", block_tokens=1, kv_parts=1, head_groups=1)


def _layout_facts(offloading_spec: Any) -> dict:
    """What in vLLM's offloading config decides the bytes of a slot (plain
    values only: a test's mock spec contributes nothing)."""
    config = getattr(offloading_spec, "config", None)
    if not isinstance(config, OffloadingConfig):
        return {}
    p = config.parallel
    return {
        "dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "parallel": ("agnostic" if _parallelism_free(config) else
                     [p.world_size, p.tp_size, p.pp_size, p.pcp_size, p.dcp_size]),
        "groups": [[g.group_id, g.tokens_per_block, list(g.layer_names)]
                   for g in config.groups],
        "replicated_layout": bool(config.replicated_layout),
        "canonical_layout": bool(config.canonical_layout),
        "kv_cache_layout": config.kv_cache_layout,
        **_canonical_format(config),
    }


def _parallelism_free(config: OffloadingConfig) -> bool:
    """Whether vLLM makes a slot's bytes the same under any parallel layout,
    so the keys leave the parallel sizes out (as vLLM's fs tier leaves them
    out of its paths; its tier shares such slots across deployments sharded
    differently): the single-copy MLA layout (``replicated_layout``: the
    slot is the latent, alike on every TP rank), or canonical pages
    certified parallelism-agnostic (vLLM's worker refuses to start when a
    layer is not).  Not the direct layout under ``is_parallelism_agnostic``
    alone, which vLLM's fs tier also shares: its slot is each worker's cell
    in rank order, a cell holding every tensor (layer) and block of that
    worker's heads one after another, so TP 2 does not write the bytes a
    TP-1 worker reads (wrong KV, not a miss)."""
    return bool(config.replicated_layout) or (
        bool(config.canonical_layout) and bool(config.parallel.is_parallelism_agnostic))


def _canonical_format(config: OffloadingConfig) -> dict:
    """With vLLM's canonical host layout: the canonical byte format's id
    (its version and layout family), which vLLM changes on any change of the
    format, as its fs tier names it in its paths; a store kept across a vLLM
    upgrade must not hand old-format slots to the new one."""
    if not config.canonical_layout or config.kv_cache_layout is None:
        return {}
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping

    try:
        return {"canonical_format": canonical_mapping.canonical_format_id(
            config.kv_cache_layout)}
    except KeyError:       # a layout this vLLM does not name: its version all the same
        return {"canonical_format": f"v{canonical_mapping.CANONICAL_FORMAT_VERSION}"}


def default_model(offloading_spec: Any) -> str:
    """The served model's name from vLLM's offloading config ("" if none)."""
    config = getattr(offloading_spec, "config", None)
    if isinstance(config, OffloadingConfig) and config.model.name:
        return config.model.name
    return ""


def key_prefix(model: str, namespace: str, offloading_spec: Any,
               block_size_bytes: int) -> bytes:
    """16 bytes mixed into every kvblock key of this tier: the model, the
    namespace (tenant) and the slot layout."""
    facts = dict(_layout_facts(offloading_spec), slot_bytes=int(block_size_bytes))
    text = json.dumps([model, namespace, facts], sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_digest(b"kvblock-vllm-key-v2\0" + text.encode())


def _dp_fields(offloading_spec: Any) -> dict:
    config = getattr(offloading_spec, "config", None)
    if isinstance(config, OffloadingConfig):
        p = config.parallel
        return {"dp_rank": p.data_parallel_index, "dp_size": p.data_parallel_size}
    return {"dp_rank": 0, "dp_size": 1}


def _fill(text: str, fields: dict, what: str) -> str:
    """``text`` with {dp_rank} and {dp_size} filled in."""
    try:
        return str(text).format_map(fields)
    except (KeyError, ValueError, IndexError, AttributeError, TypeError) as e:
        raise ConfigError(f"kvblock tier: bad {what} template {text!r}: {e} (known: "
                          f"{', '.join('{' + k + '}' for k in fields)})") from None


def _parse_size(value, name: str, minimum: int = 1) -> int:
    return size_setting(value, "kvblock tier", name, minimum)


FORCE_HINT = 'set "format": "force" in the tier config'   # (errors name the tier's setting)


def open_tier_store(devices: list[str], geometry: Geometry, **kwargs) -> KVStore:
    """Open (or format, per ``format``) the tier's store on ``devices``
    (kvblock.store.provision.open_or_format, with this tier's wording)."""
    return provision.open_or_format(devices, geometry, STORE_MODEL, owner="the kvblock tier",
                                    force_hint=FORCE_HINT, **kwargs)


def _pool_array(view: memoryview, block_size: int) -> np.ndarray:
    """(slots, block_size) uint8 array over the primary pool (no copy)."""
    arr = np.asarray(view)
    if not arr.flags.c_contiguous or arr.nbytes % block_size:
        raise ConfigError(f"kvblock tier: the primary KV view must be C-contiguous whole "
                          f"slots of {block_size} bytes (shape {view.shape}, strides "
                          f"{view.strides})")
    if not arr.flags.writeable:
        raise ConfigError("kvblock tier: the primary KV view is read-only")
    return arr.reshape(-1).view(np.uint8).reshape(arr.nbytes // block_size, block_size)


def _take_all(queue: deque) -> list:
    """Everything queued so far, oldest first (workers append to the deque
    while the scheduler thread takes: popleft and append are thread-safe)."""
    out = []
    while queue:
        out.append(queue.popleft())
    return out


def _adjacent(chunk_ids: np.ndarray) -> bool:
    """Ascending, adjacent slot ids: one contiguous slice of the pool."""
    return chunk_ids.size <= 1 or bool((np.diff(chunk_ids) == 1).all())


class _Job:
    __slots__ = ("meta", "load", "keys", "kbs", "chunks", "pending", "ok", "declined", "moved",
                 "started", "ended", "reserved", "waits", "settled", "waiters", "published")

    def __init__(self, meta: TransferJob, load: bool, keys: list, kbs: list[bytes],
                 chunks: np.ndarray, reserved: list[bytes]):
        self.meta = meta
        self.load = load
        self.keys = keys              # OffloadKeys this job moves (stores: minus in-flight)
        self.kbs = kbs                # their kvblock keys
        self.chunks = chunks          # their primary slots
        self.pending = 0              # pieces not finished
        self.ok = np.zeros(len(keys), dtype=bool)
        self.declined = np.zeros(len(keys), dtype=bool)   # not stored: the store's policy
        self.moved = 0                # slots read or written (a load reports those read)
        self.started = None
        self.ended = None
        self.reserved = reserved      # kvblock keys this store job claimed in _storing
        self.waits: list = []         # (store job, index): keys left to another job
        self.settled = False          # every piece done: ok is final
        self.waiters: list = []       # settled jobs that wait for this one to settle
        self.published = False


# ---------------------------------------------------------------------- the tier
class KVBlockTierManager(SecondaryTierManager):
    """A vLLM secondary tier on a kvblock store (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, *, devices=None, format: str = "if-empty",
                 namespace: str | None = None, model: str | None = None,
                 server: str | None = None, size=None, threads: int = DEFAULT_THREADS,
                 max_run_bytes=DEFAULT_MAX_RUN_BYTES, verify: str = "always",
                 eviction: str = "lru", region_size=None, engine: str | None = None,
                 queue_depth: int = 32, locality: str | None = None,
                 enable_kv_events: bool = False, **unknown):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if unknown:
            raise ConfigError(f"kvblock tier: unknown config keys {sorted(unknown)}; known: "
                              "devices, format, namespace, model, server, size, threads, "
                              "max_run_bytes, verify, eviction, region_size, engine, "
                              "queue_depth, locality, enable_kv_events")
        if not devices:
            raise ConfigError('kvblock tier: "devices" must name the store\'s device(s) or '
                              'pre-sized file(s), e.g. ["/dev/nvme1n1"]')
        if isinstance(devices, (str, os.PathLike)):
            devices = [devices]
        if not isinstance(devices, (list, tuple)) or \
                not all(isinstance(d, (str, os.PathLike)) for d in devices):
            raise ConfigError('kvblock tier: "devices" must be a path or a list of paths, got '
                              f'{devices!r}; one store per data-parallel replica: put '
                              '"{dp_rank}" in the paths')
        if server is not None and not isinstance(server, (str, os.PathLike)):
            raise ConfigError('kvblock tier: "server" must be a socket path, e.g. '
                              f'"/run/kvblock/vllm.sock", got {server!r}')
        if engine is not None and not isinstance(engine, str):
            # (a number or a list reached the engine picker's str methods:
            # an AttributeError out of vLLM's startup)
            raise ConfigError('kvblock tier: "engine" must be one of "uring", "threads", '
                              f'"auto" (or null), got {engine!r}')
        dp = _dp_fields(offloading_spec)
        self.devices = [_fill(os.fspath(d), dp, "device") for d in devices]
        self.server = _fill(os.fspath(server), dp, "server") if server else None
        threads = int_setting(threads, "kvblock tier", "threads")
        queue_depth = int_setting(queue_depth, "kvblock tier", "queue_depth")
        enable_kv_events = flag_setting(enable_kv_events, "kvblock tier", "enable_kv_events")
        try:
            self.locality = Locality(locality) if locality is not None else None
        except ValueError:
            raise ConfigError(f"kvblock tier: locality must be one of "
                              f"{[x.value for x in Locality]}, got {locality!r}") from None
        bs = self.block_size_bytes
        # (a list or true there was its repr: keys no other config names, unsaid)
        self.model = name_setting(model, "kvblock tier", "model",
                                  default_model(offloading_spec))
        self.namespace = name_setting(namespace, "kvblock tier", "namespace")
        self._prefix = key_prefix(self.model, self.namespace, offloading_spec, bs)
        self.geometry = slot_geometry(bs)
        run_bytes = _parse_size(max_run_bytes, "max_run_bytes")
        self._slots = _pool_array(primary_kv_view, bs)
        lock = threading.Lock()
        self._cond = threading.Condition(lock)       # workers wait here for pieces
        # drain_jobs waits here: a finished job wakes it, not every idle worker
        self._drained = threading.Condition(lock)
        self._stop = False
        self._closed = False
        # (what a start that fails after the store's open stops: _abandon_start)
        self._workers: list[threading.Thread] = []
        self._metrics = self._events = None
        try:
            self.store = self._open_store(
                dp["dp_size"], format=format,
                size=None if size is None else _parse_size(size, "size", MIN_FILE_SIZE),
                region_size=None if region_size is None else _parse_size(region_size,
                                                                          "region_size"),
                verify=verify, eviction=eviction, engine=engine, queue_depth=queue_depth)
        except BaseException:
            self._slots = None      # vLLM unmaps the pool after a failed start
            raise
        try:
            self._start(bs, run_bytes, threads, enable_kv_events, offloading_spec, tier_type)
        except BaseException:
            # The store (its devices locked) and the workers started must
            # not outlive a failed start: vLLM's retry, or the next
            # process, would find the devices busy.
            self._abandon_start()
            raise

    def _start(self, bs: int, run_bytes: int, threads: int, enable_kv_events: bool,
               offloading_spec, tier_type: str) -> None:
        """The start's steps after the store's open."""
        # A run never spans regions; runs of at most 1/8 region keep the space
        # a region cannot fit at its end small.
        self.max_run_blocks = max(1, min(run_bytes // bs, self.store.max_run_blocks // 8))
        if run_bytes < bs:
            # A run holds whole slots: the value cannot take effect.
            logger.warning("kvblock tier: max_run_bytes %d is below one slot (%d bytes): "
                           "every run is one slot; set it to a multiple of %d bytes",
                           run_bytes, bs, bs)
        self._batch_slots = max(1, min(self.max_run_blocks, BATCH_BYTES // bs))
        self._failed = FailureLog(logger, "kvblock tier")
        self._loads: deque = deque()
        self._stores: deque = deque()
        self._finished: deque[JobResult] = deque()
        self._inflight = 0                      # jobs submitted, result not yet queued
        # kvblock key -> (the store job writing it, its index there)
        self._storing: dict[bytes, tuple[_Job, int]] = {}
        # req_id -> kvblock keys a load for that request failed; lookup()
        # answers MISS to the request for them.  An entry per
        # live request (on_new_request to on_request_finished), so a load
        # failing after its request finished (an abort) leaves nothing.
        self._missed: dict[str, set[bytes]] = {}
        # A lookup's wait for the store's lock (or a shared store's
        # connection) ran out, and no call has had it since: don't wait.
        self._store_busy = False
        self._metrics = StoreStats(self.stats)  # vLLM's get_stats (vllm_metrics.py)
        self._events = self._kv_events(enable_kv_events, offloading_spec, tier_type)
        for i in range(threads):
            t = threading.Thread(target=self._worker, name=f"kvblock_tier_{i}", daemon=True)
            self._workers.append(t)
            t.start()
        logger.info("kvblock tier on %s%s: %d-byte slots, model %r, namespace %r, %d threads, "
                    "runs of up to %d slots", self.devices,
                    f" (server {self.server})" if self.server else "", bs, self.model,
                    self.namespace, threads, self.max_run_blocks)

    def _abandon_start(self) -> None:
        """(a start that failed after the store's open) stop the workers
        started, close the store and drop the pool array; a failure of
        these is logged (the start's own error is the one raised)."""
        with self._cond:
            self._closed = True
            self._stop = True
            self._cond.notify_all()
        try:
            self._close_parts()
        except Exception:  # noqa: BLE001  (logged; the start's error goes on)
            logger.exception("kvblock tier: cleaning up after a failed start failed")

    def _kv_events(self, enabled, offloading_spec, tier_type: str) -> TierEvents | None:
        """Where KV events wait for take_events: only with ``enable_kv_events``
        and vLLM's KV cache events on (vLLM drains take_events only then)."""
        if not enabled:
            return None
        events_config = getattr(offloading_spec, "kv_events_config", None)
        if getattr(events_config, "enable_kv_cache_events", False) is True:
            return TierEvents(self.store, self.medium, self.locality,
                              self.event_ownership(tier_type))
        logger.warning("kvblock tier %r: enable_kv_events is set but vLLM's KV cache events "
                       "are off (--kv-events-config); the tier emits none", tier_type)
        return None

    def event_ownership(self, tier_type: str) -> str:
        """The ``ownership`` of this tier's KV events: ``"<tier type>:<store
        uuid>"``.  vLLM's OffloadingEventsTracker keeps a chunk's payload per
        residency, keyed by (medium, ownership), until the last one is
        removed; two kvblock tiers in one vLLM (two "kvblock" entries of
        secondary_tiers) announcing one ownership would be one residency, so
        one tier's removal would erase the other's copy.  Tiers sharing one
        store (one server) hold one copy: the same ownership."""
        return f"{tier_type}:{self.store.uuid}"

    def _open_store(self, dp_size: int, **options):
        if options.get("size") is None:
            # (the store's own advice, `kvblock format FILE --size`, makes a
            # layered store of another model, which this tier refuses)
            for path in self.devices:
                if not os.path.exists(path):
                    refuse_missing(path, 'check the path, or set "size" in the tier config '
                                         '(e.g. "size": "64G") to create the store file there')
        if self.server is not None:
            return provision.open_shared(self.server, self.devices, self.geometry, STORE_MODEL,
                                         owner="the kvblock tier", force_hint=FORCE_HINT,
                                         **options)
        try:
            return open_tier_store(self.devices, self.geometry, **options)
        except DeviceBusyError as e:
            if dp_size <= 1:
                raise
            raise DeviceBusyError(
                f"{e}. vLLM runs {dp_size} data-parallel replicas, each with its own tier: "
                'give each its own devices ("{dp_rank}" in the paths) or share one store '
                '("server": "/run/kvblock/vllm.sock")', e.path, e.errno) from e

    # ------------------------------------------------------------ keys
    def kvblock_key(self, key: OffloadKey) -> bytes:
        """The 16-byte kvblock key of a vLLM key in this tier's namespace."""
        if not isinstance(key, (bytes, bytearray, memoryview)):
            # (bytes(n) of an int n is n zero bytes: int keys of one value
            # were one kvblock key, a HIT for another key's bytes)
            raise ConfigError(f"kvblock tier: key {key!r} is {type(key).__name__}, not "
                              "bytes (a vLLM OffloadKey)")
        return xxhash.xxh3_128_digest(self._prefix + bytes(key))

    # ------------------------------------------------------------ scheduler-side API
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        with self._cond:
            self._missed.setdefault(req_context.req_id, set())
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        with self._cond:
            self._missed.pop(req_context.req_id, None)

    def _scheduler_key(self, key, what: str) -> bytes | None:
        """kvblock_key for lookup and touch, None for a key that is not
        bytes: vLLM calls them on its scheduler thread with no try around
        them (an exception ends the engine), so such a key is logged and is
        a miss, as submit_store/submit_load report its job failed."""
        try:
            return self.kvblock_key(key)
        except ConfigError as e:
            self._failed(what, e)
            return None

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        kb = self._scheduler_key(key, "a lookup")
        if kb is None:
            return LookupResult.MISS
        with self._cond:
            if self._closed:
                return LookupResult.MISS
            if kb in self._missed.get(req_context.req_id, ()):   # its load failed here
                return LookupResult.MISS
            storing = kb in self._storing
        found = self._contains_nowait(kb)
        if found:
            return LookupResult.HIT
        if found is None or storing:
            return LookupResult.RETRY
        return LookupResult.MISS

    def touch(self, keys, req_context: ReqContext) -> None:
        """vLLM marks chunks it is about to use: their regions count as just
        read for LRU eviction.  A hint: skipped when the store's lock (a
        shared store's connection) stays busy, as lookup's bounded wait."""
        if self._closed:
            return
        kbs = [kb for kb in (self._scheduler_key(k, "a touch") for k in keys) if kb is not None]
        if not kbs:
            return
        store = self.store
        if hasattr(store, "touch_nowait"):         # a shared store: one request, bounded
            self._shared_nowait(lambda wait: store.touch_nowait(
                kbs, wait, timeout=LOOKUP_ANSWER_TIMEOUT_S))
            return
        self._under_store_lock(lambda: store.touch(kbs))

    def _job_inputs(self, job_metadata: TransferJob, kind: str):
        """(vLLM keys, pool slot ids, kvblock keys) of a transfer job."""
        keys = list(job_metadata.keys)
        chunks = np.asarray(job_metadata.chunk_ids, dtype=np.int64).reshape(-1)
        if len(keys) != chunks.size:
            raise ConfigError(f"kvblock tier: {kind} job {job_metadata.job_id} has "
                              f"{len(keys)} keys but {chunks.size} chunk ids")
        # (a slot past the pool would shorten a slice, a negative one wrap;
        # no pool: shut down, the job fails as closed)
        n = None if self._slots is None else len(self._slots)
        if n is not None and chunks.size and (chunks.min() < 0 or chunks.max() >= n):
            bad = int(chunks[(chunks < 0) | (chunks >= n)][0])
            raise ConfigError(f"kvblock tier: {kind} job {job_metadata.job_id} names primary "
                              f"slot {bad}, outside the pool's {n} slots")
        return keys, chunks, [self.kvblock_key(k) for k in keys]

    def _refused(self, job_metadata: TransferJob, kind: str, e: Exception) -> None:
        """A job _job_inputs refused (inputs vLLM never sends): logged, and
        reported finished as failed, as vLLM's fs tier reports a failed job
        (raised out of submit_*, the job stayed open in vLLM for good: its
        slots pinned, its request never finalized).  A refused load's keys
        miss for its request from now on (see _note_missed)."""
        self._failed(f"{kind} job {job_metadata.job_id}", e)
        with self._cond:
            if kind == "load":
                missed = self._missed.get(getattr(job_metadata.req_context, "req_id", None))
                if missed is not None:
                    for k in job_metadata.keys or ():
                        with contextlib.suppress(ConfigError):
                            missed.add(self.kvblock_key(k))
            self._finished.append(JobResult(job_metadata.job_id, False))

    def _checked_inputs(self, job_metadata: TransferJob, kind: str):
        """_job_inputs, or None when it refused the job (reported failed)."""
        try:
            return self._job_inputs(job_metadata, kind)
        except (ConfigError, TypeError, ValueError) as e:
            self._refused(job_metadata, kind, e)
            return None

    def submit_store(self, job_metadata: TransferJob) -> None:
        inputs = self._checked_inputs(job_metadata, "store")
        if inputs is None:
            return
        keys, chunks, kbs = inputs
        with self._cond:
            if self._closed:
                self._finished.append(JobResult(job_metadata.job_id, False))
                return
            # Keys another store job is already writing are left to that job
            # (this one succeeds only if that one wrote them).
            mine, seen, waits = [], set(), []
            for i, kb in enumerate(kbs):
                if kb in self._storing:
                    waits.append(self._storing[kb])
                elif kb not in seen:
                    seen.add(kb)
                    mine.append(i)
            job = _Job(job_metadata, False, [keys[i] for i in mine], [kbs[i] for i in mine],
                       chunks[mine], [kbs[i] for i in mine])
            job.waits = waits
            self._storing.update((kb, (job, at)) for at, kb in enumerate(job.kbs))
            self._enqueue(job, self._stores)

    def submit_load(self, job_metadata: TransferJob) -> None:
        inputs = self._checked_inputs(job_metadata, "load")
        if inputs is None:
            return
        keys, chunks, kbs = inputs
        with self._cond:
            if self._closed:
                self._finished.append(JobResult(job_metadata.job_id, False))
                return
            self._enqueue(_Job(job_metadata, True, keys, kbs, chunks, []), self._loads)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return _take_all(self._finished)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """With ``enable_kv_events``: stored events of the keys store jobs
        put in the store, removed events once the store dropped them
        (evicted, deleted, cleared; see vllm_events.py)."""
        return self._events.take() if self._events is not None else []

    def has_pending_work(self) -> bool:
        return self._inflight > 0 or bool(self._finished)

    def drain_jobs(self) -> None:
        with self._drained:
            self._drained.wait_for(lambda: self._inflight == 0)

    def shutdown(self) -> None:
        """Cancel queued pieces (their jobs fail), let running ones finish,
        stop the workers and close the store."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stop = True
            cancelled = list(self._loads) + list(self._stores)
            self._loads.clear()
            self._stores.clear()
            for job, _, _ in cancelled:
                self._piece_done(job)
            self._cond.notify_all()
        self._close_parts()

    def _close_parts(self) -> None:
        """(``_stop`` set) join the workers, stop the metrics' and events'
        threads, close the store and drop the array over vLLM's pool: each
        step whatever an earlier one raised (the error reaches the caller
        once all ran; a store's KVBlockError on close is logged)."""
        with contextlib.ExitStack() as steps:      # (callbacks run last first)
            steps.callback(self._drop_pool)
            steps.callback(self._close_store)
            if self._events is not None:
                steps.callback(self._events.close)
            if self._metrics is not None:
                steps.callback(self._metrics.close)
            steps.callback(self._join_workers)

    def _join_workers(self) -> None:
        """Join the workers.  Those still running after SHUTDOWN_WAIT_S
        wait on the store (a hung store server): the store is closed under
        their calls, which then fail (their jobs are reported failed), and
        they are joined for good: none may outlive the pool vLLM unmaps."""
        started = [t for t in self._workers if t.ident is not None]
        if not hasattr(self.store, "answer_overdue"):
            # a store of this process: no server to hang on, its calls end
            # (as vLLM's fs tier, joined with no limit)
            for t in started:
                t.join()
            return
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for t in started:
            t.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in started if t.is_alive()]
        if busy:
            logger.warning("kvblock tier: workers %s still in a store call %g s into "
                           "shutdown (a hung store server?): closing the store under "
                           "them; their jobs fail", busy, SHUTDOWN_WAIT_S)
            try:
                self._close_store(cut=True)
            finally:
                for t in started:
                    t.join()

    def _close_store(self, cut: bool = False) -> None:
        """``cut`` (a shared store's, from _join_workers): its connection
        ends under calls in flight at once, not after its own wait
        (CLOSE_WAIT_S, 30 s): the workers had theirs."""
        try:
            if cut:
                self.store.close(wait=0)
            else:
                self.store.close()
        except KVBlockError:
            logger.exception("kvblock tier: closing the store failed")

    def _drop_pool(self) -> None:
        # vLLM's primary tier releases the view and unmaps the pool right
        # after the secondary tiers shut down: keep no array over it.
        self._slots = None

    # ------------------------------------------------------------ vLLM's metrics
    @classmethod
    def build_metric_definitions(cls, tier_config: dict) -> dict:
        return metric_definitions()

    def get_stats(self):
        """The store's gauges and counter increments since the last call
        (from a snapshot taken off the scheduler thread), or None."""
        return self._metrics.take()

    @classmethod
    def config_info_keys(cls, tier_config: dict) -> tuple[str, ...]:
        return INFO_KEYS

    def config_info(self) -> dict:
        """This tier's line of ``vllm:kv_offload_config_info``."""
        values = (self.store.uuid, ",".join(self.devices), self.server or "",
                  str(self.block_size_bytes), self.model, self.namespace)
        return dict(zip(INFO_KEYS, values))

    def stats(self) -> dict:
        """The store's counters and gauges (``KVStore.stats()``), and how
        many store failures failed jobs' keys."""
        own = {"store_failures": self._failed.count}
        try:
            return {**self.store.stats(), **own}
        except RUNTIME_FAILURES as e:
            return {**own, "store_error": str(e)}

    # ------------------------------------------------------------ internals
    def _enqueue(self, job: _Job, queue: deque) -> None:
        """(under _cond) cut the job into pieces of at most max_run_blocks."""
        self._inflight += 1
        n = len(job.keys)
        if n == 0:
            self._finish(job)
            return
        step = self.max_run_blocks
        for start in range(0, n, step):
            queue.append((job, start, min(n, start + step)))
            job.pending += 1
        self._cond.notify(job.pending)

    def _piece_done(self, job: _Job) -> None:
        """(under _cond)"""
        job.pending -= 1
        if job.pending == 0:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        """(under _cond) the job's pieces are done: publish its result, once
        the store jobs it left keys to have settled theirs (and so every job
        waiting on this one and settled already)."""
        for kb in job.reserved:
            if self._storing.get(kb, (None,))[0] is job:
                del self._storing[kb]
        job.settled = True
        unsettled = [owner for owner, _ in job.waits if not owner.settled]
        for owner in unsettled:
            owner.waiters.append(job)
        if not unsettled:
            self._publish(job)
        for waiter in job.waiters:
            if not waiter.published and all(owner.settled for owner, _ in waiter.waits):
                self._publish(waiter)

    def _publish(self, job: _Job) -> None:
        """(under _cond) queue the job's result for get_finished_jobs."""
        job.published = True
        meta = job.meta
        # A store key the store declined (a clear() overtook it) is not a
        # failure: vLLM's tiering manager feeds every store result with
        # success=False to its back-pressure detector (on_store_failed), which
        # enters pressure after a few in a row and drops the stores after
        # them.  Such a job reports success.
        done = job.ok | job.declined
        success = bool(done.all()) and all(owner.ok[at] or owner.declined[at]
                                           for owner, at in job.waits)
        successful = None
        if job.load and not success:
            if job.ok.any():
                successful = tuple(k for k, ok in zip(job.keys, job.ok) if ok)
            self._note_missed(job)
        elapsed = None
        if job.started is not None:
            elapsed = (job.ended or time.monotonic()) - job.started
        if self._events is not None and not job.load:
            self._events.stored([(kb, k) for kb, k, ok in zip(job.kbs, job.keys, job.ok)
                                 if ok])
        # A store reports the bytes of all its keys (written, found stored,
        # left to another job, declined), as vLLM's fs tier does and vLLM
        # assumes without a count: its back-pressure detector divides the
        # job's time since submit (queueing included) by them, so counting
        # only the slots written made a job mostly stored already look slow.
        slots = job.moved if job.load else len(meta.keys)
        self._finished.append(JobResult(
            job_id=meta.job_id, success=success, successful_keys=successful,
            transfer_time=elapsed, transfer_bytes=slots * self.block_size_bytes))
        self._inflight -= 1
        if self._inflight == 0:
            self._drained.notify_all()

    def _note_missed(self, job: _Job) -> None:
        """(under _cond) a load job failed for some keys: lookups of its
        request miss them from now on.  vLLM's tiering manager frees the
        slots of the keys that failed and looks them up again; one that
        failed while the store kept it (an engine failure, a drop that
        failed, a bug) was a HIT again, promoted again, failed again, every
        step, and the request never went on (vLLM's fs tier marks them a
        miss, its #49176).  Keys the store dropped or lost miss anyway."""
        missed = self._missed.get(getattr(job.meta.req_context, "req_id", None))
        if missed is None:                   # (finished meanwhile: nobody asks)
            return
        missed.update(kb for kb, ok in zip(job.kbs, job.ok) if not ok)

    def _contains_nowait(self, kb: bytes) -> bool | None:
        """Whether the store holds ``kb``; None when a worker has held the
        store's lock for LOOKUP_LOCK_WAIT_S (the caller answers RETRY).

        The index's arrays are swapped when it grows, so it is probed under
        the store's lock; lookup() runs on vLLM's scheduler thread, so the
        wait for it is bounded.
        """
        store = self.store
        if hasattr(store, "contains_nowait"):      # a shared store: one socket, bounded too
            return self._shared_nowait(lambda wait: store.contains_nowait(
                kb, wait, timeout=LOOKUP_ANSWER_TIMEOUT_S))
        return self._under_store_lock(lambda: store.contains(kb))

    def _shared_nowait(self, call):
        """call(wait): a shared store's bounded request (contains_nowait,
        touch_nowait), its connection waited for per _lock_wait; its answer,
        False when the store failed.  The connection counts as busy when the
        wait ran out (None) and also while another call on it is stuck past
        LOOKUP_ANSWER_TIMEOUT_S (a hung server: the answer is a miss, and
        the next calls must not wait for the connection either)."""
        try:
            answer = call(self._lock_wait())
        except KVBlockError:
            return False
        self._store_busy = answer is None or (
            not answer and self.store.answer_overdue(LOOKUP_ANSWER_TIMEOUT_S))
        return answer

    def _lock_wait(self) -> float:
        """How long to wait for the store's lock: LOOKUP_LOCK_WAIT_S, or not
        at all while an earlier wait ran out and nobody here has had it since."""
        return 0 if self._store_busy else LOOKUP_LOCK_WAIT_S

    def _under_store_lock(self, fn):
        """fn() under the store's lock, waited for at most LOOKUP_LOCK_WAIT_S
        (the caller is vLLM's scheduler thread; see _lock_wait): None when it stays busy,
        False when the store failed (closed after a failed metadata write)."""
        lock = self.store._lock
        if not lock.acquire(timeout=self._lock_wait()):
            self._store_busy = True
            return None
        self._store_busy = False
        try:
            return fn()
        except KVBlockError:
            return False
        finally:
            lock.release()

    def _worker(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._loads or self._stores)
                if self._stop:
                    return
                queue = self._loads or self._stores
                pieces = [queue.popleft()]
                if self._small(pieces[0]):
                    slots = pieces[0][2] - pieces[0][1]
                    while queue and self._small(queue[0]):
                        _, start, stop = queue[0]
                        if slots + stop - start > self._batch_slots:
                            break
                        slots += stop - start
                        pieces.append(queue.popleft())
                now = time.monotonic()
                for job, _, _ in pieces:
                    if job.started is None:
                        job.started = now
            if len(pieces) == 1:
                moved = [self._guarded(*pieces[0], self._run_piece)]
            else:
                moved = self._together(pieces)
            with self._cond:
                now = time.monotonic()
                for (job, _, _), m in zip(pieces, moved):
                    job.moved += m
                    job.ended = now
                    self._piece_done(job)

    def _guarded(self, job: _Job, start: int, stop: int, run) -> int:
        """run(job, start, stop): the slots it moved.  When it failed, the
        keys it had not marked done fail (never the worker); a load's keys
        read before the failure stay loaded and counted."""
        try:
            return run(job, start, stop)
        except KVBlockError as e:
            self._failed(f"{'load' if job.load else 'store'} job {job.meta.job_id}, "
                         f"slots {start}..{stop}", e)
        except Exception as e:  # noqa: BLE001  (a bug: logged whole, the job fails)
            logger.warning("kvblock tier: %s job %s, slots %d..%d failed: %s",
                           "load" if job.load else "store", job.meta.job_id, start, stop,
                           e, exc_info=True)
        return int(job.ok[start:stop].sum()) if job.load else 0

    def _run_piece(self, job: _Job, start: int, stop: int) -> int:
        return (self._load_piece if job.load else self._store_piece)(job, start, stop)

    def _small(self, piece) -> bool:
        """(under _cond) a load or store of a few adjacent slots, which goes
        to the store with others of its kind."""
        job, start, stop = piece
        if stop - start > SMALL_PIECE_SLOTS:
            return False
        first = int(job.chunks[start])
        return job.chunks[start:stop].tolist() == list(range(first, first + stop - start))

    def _together(self, pieces: list) -> list[int]:
        """Small pieces of one kind in one store call; when that call fails,
        each piece on its own, which reports its own failure (a store that
        is gone fails them all, a bad run only the pieces that read it)."""
        try:
            return (self._load_together if pieces[0][0].load else self._store_together)(pieces)
        except KVBlockError as e:
            logger.debug("kvblock tier: %d pieces together: %s; each alone", len(pieces), e)
        except Exception as e:  # noqa: BLE001  (a bug: logged whole; each piece alone still)
            logger.warning("kvblock tier: %d pieces together failed: %s", len(pieces), e,
                           exc_info=True)
        return [self._guarded(*piece, self._run_piece) for piece in pieces]

    def _store_together(self, pieces: list) -> list[int]:
        """Small stores (see SMALL_PIECE_SLOTS) in one store call (put_runs:
        one flush and one journal commit for all of them); a piece with some
        of its keys stored already goes alone (:meth:`_store_piece` writes
        the rest where they are).  Returns the slots written per piece."""
        slots = self._slots
        present = self.store.present([kb for job, a, b in pieces for kb in job.kbs[a:b]])
        moved = [0] * len(pieces)
        items, owners, alone = [], [], []
        at = 0
        for p, (job, start, stop) in enumerate(pieces):
            n = stop - start
            held = int(present[at:at + n].sum())
            at += n
            if held == n:                          # stored already: nothing to write
                job.ok[start:stop] = True
            elif held:
                alone.append(p)
            else:
                first = int(job.chunks[start])
                items.append((job.kbs[start:stop], slots[first:first + n]))
                owners.append(p)
        for p, written in zip(owners, self.store.put_runs(items) if items else []):
            job, start, stop = pieces[p]
            if written == stop - start:
                job.ok[start:stop] = True
                moved[p] = written
            else:
                self._declined(job, start, stop)
        for p in sorted(alone):
            moved[p] = self._guarded(*pieces[p], self._store_piece)
        return moved

    def _declined(self, job: _Job, start: int, stop: int, todo=slice(None)) -> None:
        """The store wrote none of a piece's keys ``todo`` (its offsets in
        the piece; all by default): its admission control turned
        the run away, or a clear() came while it was written.  The store's
        policy, not a failure: the keys are not stored (no BlockStored
        event; lookups miss), the job still reports success (see _publish),
        and the store counts them
        (``admission_rejected_runs``, ``cleared_puts``), not as store failures."""
        job.declined[start:stop][todo] = True
        logger.debug("kvblock tier: store job %s, slots %d..%d: the store declined the run "
                     "(admission, or a clear() overtook it); not stored", job.meta.job_id,
                     start, stop)

    def _load_together(self, pieces: list) -> list[int]:
        """Small loads (see SMALL_PIECE_SLOTS) in one store call; a piece the
        store did not fully answer (a miss, a bad block, EIO: get_runs
        dropped the run) goes on as :meth:`_load_piece` reads it.  Returns
        the slots moved per piece."""
        slots = self._slots
        requests = []
        for job, start, stop in pieces:
            first = int(job.chunks[start])
            requests.append((job.kbs[start:stop], slots[first:first + stop - start]))
        got = self.store.get_runs(requests)
        moved = []
        for (job, start, stop), done in zip(pieces, got):
            if done == stop - start:
                job.ok[start:stop] = True
                moved.append(done)
            else:
                moved.append(self._guarded(job, start, stop,
                                           functools.partial(self._load_piece, done=done)))
        return moved

    def _store_piece(self, job: _Job, start: int, stop: int) -> int:
        kbs = job.kbs[start:stop]
        chunks = job.chunks[start:stop]
        present = self.store.present(kbs)
        todo = np.nonzero(~present)[0]
        # Keys found stored are in the store (and announced) whatever
        # becomes of the others.
        job.ok[start:stop] = present
        written = 0
        if todo.size:
            keys = [kbs[i] for i in todo]
            ids = chunks[todo]
            if _adjacent(ids):                 # one slice of the pool: one write
                got = self.store.put_run(keys, self._slots[int(ids[0]):int(ids[0]) + ids.size])
            else:                              # scattered slots: written where they are
                slots = self._slots
                got = self.store.put_blocks(keys, [slots[i] for i in ids.tolist()])
            if got != len(keys):
                self._declined(job, start, stop, todo)
                return 0
            written = len(keys)
        job.ok[start:stop] = True
        return written

    def _load_piece(self, job: _Job, start: int, stop: int, done: int | None = None) -> int:
        """Slots start..stop of a load job, key after key past any that miss;
        ``done``: the first ``done`` are read already (get_runs' count: the
        next one missed, or a run from it on failed and was dropped, which
        may be a later run than its own: it is read again)."""
        kbs = job.kbs[start:stop]
        ids = job.chunks[start:stop]
        n = len(kbs)
        if _adjacent(ids):
            dst = self._slots[int(ids[0]):int(ids[0]) + n]
            read = self.store.get_run
        else:
            slots = self._slots
            dst = [slots[i] for i in ids.tolist()]
            read = self.store.get_blocks
        # job.ok's own slice: keys read stay read if a later read raises
        ok = job.ok[start:stop]
        i, errors = 0, 0
        if done is not None:
            ok[:done] = True
            i = done
        while i < n:
            try:
                got = read(kbs[i:], dst[i:])
            except IOFailedError as e:
                # The store dropped the run it could not read (a miss from
                # now on, so vLLM stops promoting it) and logged it, as
                # get_runs does for the batched loads: read again up to it.
                # An engine failure that reached no device dropped nothing.
                errors += 1
                if not e.device_fault or errors > n:
                    raise
                continue
            ok[i:i + got] = True
            i += got + 1          # skip the key that missed (evicted, corrupt, unreadable)
        return int(ok.sum())

    def __repr__(self) -> str:
        return (f"KVBlockTierManager(devices={self.devices}, slot={self.block_size_bytes}, "
                f"model={self.model!r}, namespace={self.namespace!r})")


def register() -> None:
    """Register ``"kvblock"`` with vLLM's SecondaryTierFactory (idempotent).

    Meant for the ``vllm.general_plugins`` entry point, which vLLM calls in
    each of its processes before it builds the offloading spec.
    """
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    try:
        SecondaryTierFactory.register_tier(TIER_TYPE, __name__, KVBlockTierManager.__name__)
    except ValueError:
        pass  # already registered (plugins load once per process, tests call it again)


__all__ = ["KVBlockTierManager", "register", "slot_geometry", "key_prefix", "open_tier_store",
           "TIER_TYPE", "STORE_MODEL"]
