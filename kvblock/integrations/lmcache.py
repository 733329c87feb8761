"""LMCache: a kvblock store as an LMCache storage plugin.

LMCache 0.5.x loads in-process storage plugins from its config; this one is
``KVBlockStorageBackend``::

    storage_plugins: ["kvblock"]
    extra_config:
      storage_plugin.kvblock.module_path: kvblock.integrations.lmcache
      storage_plugin.kvblock.class_name: KVBlockStorageBackend
      kvblock.devices: ["/dev/nvme1n1"]        # or pre-sized files, one set per worker

LMCache's storage manager puts and gets whole chunks (``MemoryObj``, by
default 256 tokens of every layer, K and V; one layer of them in layer-wise
mode) allocated by its ``LocalCPUBackend``; this plugin moves those buffers to
and from the store.

Geometry: one chunk is one kvblock block of bytes.
    LMCache's chunk is already a byte buffer in LMCache's own layout
    (``KV_2LTD``: ``[2, layers, tokens, hidden]``, or ``KV_MLA_FMT`` for MLA),
    and LMCache never reads part of a chunk.  So the store is formatted with
    the byte geometry ``Geometry(num_layers=1, num_kv_heads=1,
    head_dim=chunk_bytes, dtype="uint8", block_tokens=1, kv_parts=1)`` and
    each chunk is stored as its own run: one range, the chunk's bytes as they
    are; the chunks of one put are published with one journal commit.
    ``put`` writes straight from the ``MemoryObj`` and ``get`` reads
    straight into freshly allocated ones, one store read for all the chunks of
    a batched get (kvblock does direct I/O on them when
    they are 4 KiB-aligned whole pages, as LMCache's allocator makes them;
    otherwise through aligned staging).  A run per chunk keeps ``remove`` exact
    (kvblock deletes whole runs).  kvblock's layer-major layout would buy
    nothing here: LMCache never asks for part of an object.

Chunk format.
    The full-chunk format -- shapes, dtypes and ``MemoryFormat`` -- comes from
    LMCache's metadata at start-up (``metadata.get_shapes()``/``get_dtypes()``;
    ``KV_MLA_FMT`` for MLA, ``KV_2LTD`` otherwise), and is part of the store's
    fingerprint with the model name: a store written for another model or chunk
    format is refused (``GeometryMismatchError``).  Objects of any other format
    -- a partial last chunk (``save_unfull_chunk``) -- are not stored (a miss
    later, never a wrong answer).

Layer-wise mode (``use_layerwise: true``).
    LMCache's cache engine then stores each layer of a chunk as its own object
    under its own key (``LayerCacheEngineKey``: the chunk's key and the layer
    id), one ``batched_put`` per layer as the layer leaves the GPU, and loads
    them back one layer at a time (``layerwise_batched_get`` calls
    ``batched_get_non_blocking`` with one layer's keys of every chunk).  The
    plugin then stores layer objects instead of chunks: ``[tokens, 2,
    hidden]`` ``KV_T2D`` (``[2, tokens, hidden]`` ``KV_2TD`` with
    ``enable_blending``; ``[tokens, hidden]`` ``KV_MLA_FMT`` for MLA), each
    its own run, as above.  A layer-wise store and a whole-chunk store have
    different fingerprints: switching the mode on a store is refused like a
    change of model (format it again with ``kvblock.format: force``).
    Layer 0 is found only while all its chunk's layers are (``_whole_chunk``):
    LMCache checks layer 0 alone before it loads a chunk layer by layer.
    ``remove`` of a chunk's own key (``LMCacheEngine.clear(tokens)``)
    removes all its layers.

Blending (``enable_blending: true``).
    CacheBlend's connector needs each object's ``cached_positions`` (the
    token positions its KV was computed at) back with the object.  The block
    then holds the object's bytes, a count and the positions (int64,
    ``chunk_size`` of them; count -1: none were set), and objects go
    through aligned staging memory.  Such a store has its own fingerprint.

Keys.
    A 4-byte owner tag of the plugin's ``kvblock.namespace``, the model and
    the worker id, then 12 bytes of ``xxh3_128(prefix || fields)``: the
    fields of LMCache's key -- model, world size, worker, chunk hash, KV
    dtype, tags in order, layer -- as a JSON list (``to_string()`` joins
    them with "@" and "%" unescaped, so two tag sets could spell one
    string); ``prefix`` adds the namespace (tenant / salt).  ``clear()``
    removes the keys of its own tag (``delete_prefix``): on a shared store
    the other workers' and tenants' chunks stay, and so do its pinned ones.

Pins.
    ``pin``/``contains(pin=True)`` pin the chunk's run in the store until
    ``unpin``: its region is not reclaimed meanwhile.  ``remove(key,
    force=False)`` and ``clear()`` leave pinned chunks alone.  The pins an async lookup
    takes (``batched_async_contains(lookup_id, keys, pin=True)``) are
    released by the load LMCache then starts for that lookup
    (``batched_get_non_blocking``), as LocalDiskBackend does: LMCache never
    unpins them otherwise.  When no load comes (LMCache's serializer refuses
    one over its chunk budget, telling no backend) they are released at the
    first lookup or put after LMCache's ``lookup_timeout_ms`` (3 s by
    default; its scheduler recomputes the request by then); an aborted
    request's (``cancel_request``) at once.  A load that has started keeps
    its lookup's pins until it ends, past that deadline too.

Writes are asynchronous: ``batched_submit_put_task`` hands the chunks to
``kvblock.writer_threads`` threads and returns their futures; a chunk is
visible to ``contains`` once its journal record is durable.  Reads are
synchronous (``get_blocking``) or on as many threads of their own
(``get_non_blocking``, ``batched_get_non_blocking``): a load never waits
behind queued puts.

Settings (``extra_config``)::

    kvblock.devices: ["/dev/nvme1n1"]   # entries may use {worker_id} / {world_size} /
                                        # {local_worker_id}, or map a worker id ("0",
                                        # "1"...) to its list
    kvblock.server: /run/kvblock/lm.sock  # optional: every worker shares one store on
                                        # kvblock.devices through `kvblock serve`
                                        # (started by the first worker to find none)
    kvblock.format: if-empty            # "never": only open; "force": format every start
    kvblock.size: 64G                   # create missing files of this size
    kvblock.namespace: ""               # tenant / salt mixed into every key
    kvblock.writer_threads: 2
    kvblock.verify: always              # also eviction, admit_after, region_size,
                                        # engine, queue_depth
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import (
    AllocatorBackendInterface,
    StoragePluginInterface,
)

from kvblock.store import provision
from kvblock.units import MIN_FILE_SIZE, int_setting, name_setting, path_setting, size_setting
from kvblock.errors import (
    ConfigError,
    KVBlockError,
)
from kvblock.integrations.failures import RUNTIME_FAILURES, FailureLog
from kvblock.layout import Geometry
from kvblock.memory import aligned_empty
from kvblock.store import KVStore

logger = logging.getLogger(__name__)

STORE_MODEL_PREFIX = "kvblock.integrations.lmcache/v1"
KEY_DOMAIN = b"kvblock-lmcache-key-v3\0"
# A key's first bytes name its owner (namespace, model, worker): clear()
# removes one worker's chunks of a store other workers or tenants share
# (LMCache's controller asks every worker and wants equal counts back).
OWNER_TAG_BYTES = 4
FORMAT_MODES = provision.FORMAT_MODES
OPTION_PREFIX = "kvblock."
_STORE_OPTIONS = ("verify", "eviction", "admit_after", "engine", "queue_depth")
_OPTIONS = {"devices", "server", "format", "size", "namespace", "writer_threads",
            "region_size", *_STORE_OPTIONS}


def _parse_size(value, name: str, minimum: int = 1) -> int:
    return size_setting(value, "kvblock lmcache plugin", name, minimum)


FORCE_HINT = "set kvblock.format: force"     # (errors name the plugin's setting)


def open_or_format(devices: list[str], geometry: Geometry, model: str, **kwargs) -> KVStore:
    """kvblock.store.provision.open_or_format, with this integration's wording."""
    return provision.open_or_format(devices, geometry, model, owner="the kvblock LMCache plugin",
                                    force_hint=FORCE_HINT, **kwargs)


class ChunkFormat:
    """The shapes, dtypes and memory format of the objects the plugin stores:
    one full LMCache chunk, or with ``use_layerwise`` one layer of one."""

    def __init__(self, shapes, dtypes, fmt: MemoryFormat):
        self.shapes = [torch.Size(s) for s in shapes]
        self.dtypes = list(dtypes)
        self.fmt = fmt
        self.nbytes = sum(s.numel() * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    @classmethod
    def from_metadata(cls, metadata, config) -> ChunkFormat:
        if getattr(config, "use_layerwise", False):
            return cls.layer_of(metadata, config)
        fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
        return cls(metadata.get_shapes(), metadata.get_dtypes(), fmt)

    @classmethod
    def layer_of(cls, metadata, config) -> ChunkFormat:
        """One layer of a full chunk, as LMCache's layer-wise GPU connectors
        shape it (``get_shape(chunk_size)``) in the format its cache engine
        picks: ``[tokens, hidden]`` ``KV_MLA_FMT`` for MLA, ``[2, tokens,
        hidden]`` ``KV_2TD`` with ``enable_blending`` (the vLLM buffer
        connector), ``[tokens, 2, hidden]`` ``KV_T2D`` otherwise; hidden is
        KV heads x head size.  Layer objects of any other shape are skipped."""
        _layers, _kv, _tokens, heads, head_size = metadata.kv_shape
        tokens = metadata.chunk_size
        hidden = heads * head_size
        if metadata.use_mla:
            shape, fmt = (tokens, hidden), MemoryFormat.KV_MLA_FMT
        elif getattr(config, "enable_blending", False):
            shape, fmt = (2, tokens, hidden), MemoryFormat.KV_2TD
        else:
            shape, fmt = (tokens, 2, hidden), MemoryFormat.KV_T2D
        return cls([shape], [metadata.kv_dtype], fmt)

    def describe(self) -> str:
        return json.dumps({"shapes": [list(s) for s in self.shapes],
                           "dtypes": [str(d).removeprefix("torch.") for d in self.dtypes],
                           "fmt": self.fmt.name}, separators=(",", ":"))

    def matches(self, obj: MemoryObj) -> bool:
        meta = obj.metadata
        shapes = meta.shapes if meta.shapes is not None else [meta.shape]
        dtypes = meta.dtypes if meta.dtypes is not None else [meta.dtype]
        return (obj.get_size() == self.nbytes and meta.fmt == self.fmt
                and [torch.Size(s) for s in shapes] == self.shapes
                and list(dtypes) == self.dtypes)


class _PutJob:
    """One batched put queued for the writers: keys a remove() took from it
    before it was written, and the clear() epoch it was queued in (a clear
    since drops it all)."""

    __slots__ = ("epoch", "cancelled", "writing")

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.cancelled: set = set()
        self.writing = False


def _run_ids(segs) -> list[int]:
    """The runs a pin handle covers."""
    return [seg[0].run_id for seg in segs]


def _lost(segs) -> bool:
    """Pinned segments of a shared store whose connection is gone."""
    session = getattr(segs, "session", None)
    return session is not None and session.gone is not None


def _obj_bytes(obj: MemoryObj, nbytes: int) -> np.ndarray:
    """The object's bytes as a writable uint8 numpy array (no copy)."""
    raw = getattr(obj, "raw_tensor", None)
    if isinstance(raw, torch.Tensor) and raw.device.type == "cpu":
        return raw.view(torch.uint8).reshape(-1)[:nbytes].numpy()
    return np.frombuffer(obj.byte_array, dtype=np.uint8, count=nbytes)


def _free_loaded(load: Future) -> None:
    """A load's future, done: the objects it read, none of them handed on,
    back to LMCache's allocator."""
    if load.cancelled() or load.exception() is not None:
        return
    for obj in load.result():
        obj.ref_count_down()


class KVBlockStorageBackend(StoragePluginInterface):
    """LMCache storage plugin over a kvblock store (see the module docstring)."""

    def __init__(self, config=None, metadata=None, local_cpu_backend=None,
                 loop: asyncio.AbstractEventLoop | None = None, dst_device: str = "cpu"):
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if config is None or metadata is None:
            raise ConfigError("kvblock lmcache plugin: needs LMCache's config and metadata")
        if local_cpu_backend is None:
            raise ConfigError("kvblock lmcache plugin: needs LMCache's LocalCPUBackend (it "
                              "runs in the worker, not the scheduler role)")
        extra = dict(config.extra_config or {})

        def opt(name, default=None):
            return extra.get(OPTION_PREFIX + name, default)
        unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith(OPTION_PREFIX)
                         and k[len(OPTION_PREFIX):] not in _OPTIONS)
        if unknown:
            raise ConfigError(f"kvblock lmcache plugin: unknown settings {unknown}; known: "
                              f"{sorted(OPTION_PREFIX + k for k in _OPTIONS)}")

        self.devices = self._devices(opt("devices"), metadata)
        self.chunk = ChunkFormat.from_metadata(metadata, config)
        if not 0 < self.chunk.nbytes < 1 << 31:
            raise ConfigError(f"kvblock lmcache plugin: a chunk of {self.chunk.nbytes} bytes "
                              "cannot be one block (at most 2 GiB)")
        self.chunk_tokens = int(getattr(config, "chunk_size", 0) or metadata.chunk_size)
        self.layerwise = bool(getattr(config, "use_layerwise", False))
        self.objects_per_chunk = int(metadata.kv_shape[0]) if self.layerwise else 1
        # (a list or true there was its repr: another tenant, unsaid)
        self.namespace = name_setting(opt("namespace"), "kvblock lmcache plugin",
                                      "kvblock.namespace")
        self.prefix = xxhash.xxh3_128_digest(
            KEY_DOMAIN + json.dumps([self.namespace]).encode())
        # enable_blending: each block also keeps the object's cached_positions
        self.positions = self.chunk_tokens if getattr(config, "enable_blending", False) else 0
        self.block_bytes = self.chunk.nbytes + (8 * (1 + self.positions) if self.positions else 0)
        self.geometry = Geometry(num_layers=1, num_kv_heads=1, head_dim=self.block_bytes,
                                 dtype="uint8", block_tokens=1, kv_parts=1, head_groups=1)
        threads = int_setting(opt("writer_threads", 2), "kvblock lmcache plugin",
                              "kvblock.writer_threads")
        model = f"{STORE_MODEL_PREFIX}:{metadata.model_name}:{self.chunk.describe()}"
        if self.positions:
            model += f":positions={self.positions}"
        options = {k: opt(k) for k in _STORE_OPTIONS if opt(k) is not None}
        for key in ("queue_depth", "admit_after"):
            if key in options:
                options[key] = int_setting(options[key], "kvblock lmcache plugin",
                                           OPTION_PREFIX + key)
        sizes = {"size": (_parse_size(opt("size"), "kvblock.size", MIN_FILE_SIZE)
                          if opt("size") is not None else None),
                 "region_size": (_parse_size(opt("region_size"), "kvblock.region_size")
                                 if opt("region_size") is not None else None)}
        server = opt("server")
        if server is not None:      # (a number or a list was made the socket path "123")
            server = path_setting(server, "kvblock lmcache plugin", "kvblock.server",
                                  "/run/kvblock/lm.sock")
        self.server = self._template(server, metadata) if server else None
        if self.server is not None:
            self.store = provision.open_shared(
                self.server, self.devices, self.geometry, model,
                format=opt("format", "if-empty"), owner="the kvblock LMCache plugin",
                force_hint=FORCE_HINT, **sizes, **options)
        else:
            self.store = open_or_format(self.devices, self.geometry, model,
                                        format=opt("format", "if-empty"), **sizes, **options)
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="kvblock-lmcache")
        # loads on threads of their own: a prefetch must not queue behind puts
        self.loader = ThreadPoolExecutor(threads, thread_name_prefix="kvblock-lmcache-load")
        self._drain_writes_before_cpu_close(local_cpu_backend)
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)     # a job's writing ended
        self._put_tasks: dict[CacheEngineKey, _PutJob] = {}  # queued or being written
        self._epoch = 0                                       # clear()s so far
        self._pins: dict[bytes, list] = {}      # kvblock key -> [pin count, pinned segments]
        # async lookup id -> (deadline, its (key, pin entry)s), oldest first
        self._lookup_pins: dict[str, tuple[float, list]] = {}
        # LMCache's scheduler gives up on a lookup after this: recomputes
        self._lookup_ttl = float(getattr(config, "lookup_timeout_ms", 3000) or 3000) / 1000
        self._clock = time.monotonic
        self.skipped_chunks = 0
        self._failed = FailureLog(logger, "kvblock lmcache plugin")
        logger.info("kvblock: LMCache plugin on %s (chunk %s, %d bytes)", self.devices,
                    self.chunk.describe(), self.chunk.nbytes)

    def __str__(self) -> str:
        return "KVBlockStorageBackend"

    def _stop_threads(self) -> None:
        """Finish the queued writes and loads; later ones are refused (a miss)."""
        self.executor.shutdown(wait=True)
        self.loader.shutdown(wait=True)

    def _drain_writes_before_cpu_close(self, backend) -> None:
        """StorageManager.close() closes LocalCPUBackend, which frees the
        memory the queued writes read, before it closes this plugin: the
        writes must be done first (they crashed the process with SIGSEGV).
        So the backend's close first waits for them (and for the loads,
        which fill memory of its allocator).  Only weak references:
        a cycle backend <-> plugin would leave both to the garbage collector,
        and LMCache's MemoryObj.__del__ then frees memory under a lock the
        collecting thread may hold (a deadlock)."""
        me, target = weakref.ref(self), weakref.ref(backend)
        before = backend.__dict__.get("close")        # another plugin's hook
        close_of_class = type(backend).close

        def close_after_queued_writes(*args, **kwargs):
            plugin = me()
            if plugin is not None:
                plugin._stop_threads()
            if before is not None:
                return before(*args, **kwargs)
            backend = target()
            return None if backend is None else close_of_class(backend, *args, **kwargs)
        backend.close = close_after_queued_writes

    @staticmethod
    def _devices(spec, metadata) -> list[str]:
        if spec is None:
            raise ConfigError("kvblock lmcache plugin: extra_config needs kvblock.devices "
                              "(raw devices or pre-sized files, one set per worker)")
        if isinstance(spec, dict):
            spec = spec.get(str(metadata.worker_id), spec.get(metadata.worker_id))
            if spec is None:
                raise ConfigError(f"kvblock lmcache plugin: no devices for worker "
                                  f"{metadata.worker_id} in kvblock.devices")
        if isinstance(spec, (str, os.PathLike)):
            spec = [spec]
        if (not isinstance(spec, (list, tuple))
                or not all(isinstance(d, (str, os.PathLike)) for d in spec)):
            raise ConfigError("kvblock lmcache plugin: kvblock.devices must be a path, a list "
                              "of paths, or a map of worker ids to either; got "
                              f"{spec!r} (for worker {metadata.worker_id})")
        devices = [KVBlockStorageBackend._template(d, metadata) for d in spec]
        if not devices:
            raise ConfigError("kvblock lmcache plugin: kvblock.devices is empty")
        return devices

    @staticmethod
    def _template(text, metadata) -> str:
        """``text`` with {worker_id}, {world_size} and {local_worker_id} filled in."""
        fields = {"worker_id": metadata.worker_id, "world_size": metadata.world_size,
                  "local_worker_id": metadata.local_worker_id}
        try:
            return str(text).format_map(fields)
        except (KeyError, ValueError, IndexError, AttributeError, TypeError) as e:
            raise ConfigError(f"kvblock lmcache plugin: bad template {text!r}: {e}") from None

    def kvblock_key(self, key: CacheEngineKey) -> bytes:
        """The owner tag of the key's namespace, model and worker, then 12
        bytes hashing every field of the key (96 bits: no collisions)."""
        fields = [key.model_name, key.world_size, key.worker_id, key.chunk_hash_hex,
                  str(key.dtype).removeprefix("torch."),
                  [[k, v] for k, v in (key.tags or ())], getattr(key, "layer_id", None)]
        text = json.dumps(fields, separators=(",", ":"), default=str)
        return (self.owner_tag(key.model_name, key.worker_id)
                + xxhash.xxh3_128_digest(self.prefix + text.encode())[OWNER_TAG_BYTES:])

    def owner_tag(self, model_name: str, worker_id: int) -> bytes:
        """The first bytes of the keys of one worker's chunks (clear())."""
        text = json.dumps([self.namespace, model_name, worker_id], default=str)
        return xxhash.xxh3_64_digest(KEY_DOMAIN + b"owner\0" + text.encode())[:OWNER_TAG_BYTES]

    # ------------------------------------------------------------------ lookups
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        try:
            if self.layerwise and getattr(key, "layer_id", None) == 0:
                # the lookup of the chunk's layers is the engine's counted
                # lookup: layer 0 is not looked up (counted) a second time
                if not self._whole_chunk(key):
                    return False
                return self.pin(key) if pin else True
            # counted as a lookup either way, as batched_contains counts its keys
            found = self.store.contains(self.kvblock_key(key))
            return found and self.pin(key) if pin else found
        except RUNTIME_FAILURES as e:
            self._failed("a lookup", e)
            return False

    def _whole_chunk(self, layer0_key) -> bool:
        """Layer-wise mode: is every layer of this chunk stored?  LMCache's
        store_layer and retrieve_layer ask only for layer 0; were another layer
        gone (evicted, removed), retrieve_layer would count the chunk as loaded
        and hand its connector a short layer.  So layer 0 is found only with
        all its chunk's layers; and store_layer then writes the missing ones."""
        keys = layer0_key.split_layers(self.objects_per_chunk)
        return self.store.lookup([self.kvblock_key(k) for k in keys]) == len(keys)

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False,
                         _held: list | None = None) -> int:
        """Chunks stored as a prefix of ``keys`` (pinned when ``pin``).

        Layer-wise with ``pin``: only whole chunks (every layer, from layer 0)
        count, and the pins of a partial chunk's layers are released here.
        LMCache's lookup asks for one chunk's layers at a time and keeps the
        pins only of a chunk found whole; those of a chunk missing a layer
        it never releases.  ``_held``: gets the (key, pin entry) of each pin
        taken, as it is taken."""
        try:
            n = self.store.lookup([self.kvblock_key(k) for k in keys]) if keys else 0
        except RUNTIME_FAILURES as e:
            self._failed("a lookup", e)
            return 0
        if pin:
            held = [] if _held is None else _held
            first = len(held)
            for i in range(n):
                if not self.pin(keys[i], held):
                    n = i
                    break
            if self.layerwise:
                whole = self._whole_chunks(keys, n)
                with self._lock:
                    # the pins this call took, not the keys' (a forced
                    # remove may have dropped one, and another holder
                    # pinned the key stored again)
                    for kb, entry in held[first + whole:]:
                        if self._pins.get(kb) is entry:
                            self._unpin_entry(kb, entry)
                del held[first + whole:]
                n = whole
        return n

    def _whole_chunks(self, keys: list[CacheEngineKey], n: int) -> int:
        """Layer-wise: the leading ``n`` of ``keys`` rounded down to whole
        chunks (0 unless they start at a chunk's layer 0)."""
        if n and getattr(keys[0], "layer_id", 0) != 0:
            return 0
        return n // self.objects_per_chunk * self.objects_per_chunk

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        # Layer-wise, LMCache rounds the hit down to whole chunks and unpins
        # the rest itself; batched_contains rounding first leaves it nothing
        # to unpin, so no pin is released twice (another lookup's).
        held: list = []
        n = self.batched_contains(keys, pin, held)
        whole = self._whole_chunks(keys, n) if self.layerwise else n
        if pin and whole:
            # Each pin is kept with the entry it counts in, taken with the
            # pin: a forced remove (or a clear found by pin) drops the entry,
            # even before this line, and the load's release must then not
            # take a pin of another holder on the key stored again.
            with self._lock:
                _, pins = self._lookup_pins.pop(lookup_id, (0, []))
                pins.extend(held[:whole])
                self._lookup_pins[lookup_id] = (self._clock() + self._lookup_ttl, pins)
        self._expire_lookup_pins()
        return whole

    def _release_lookup(self, lookup_id: str) -> None:
        """(under the lock) the pins the async lookup ``lookup_id`` took."""
        self._release_pins(self._lookup_pins.pop(lookup_id, (0, []))[1])

    def _release_pins(self, pins: list) -> None:
        """(under the lock) (kvblock key, pin entry) pairs an async lookup took."""
        for kb, entry in pins:
            if self._pins.get(kb) is entry:     # else: dropped since
                self._unpin_entry(kb, entry)

    def _expire_lookup_pins(self) -> None:
        """Release the pins of async lookups whose load has not started by
        their deadline: LMCache never starts it when its serializer refuses
        the load (over its chunk budget) and tells the backend nothing,
        and its scheduler has answered the request as a miss by then."""
        now = self._clock()
        with self._lock:
            while self._lookup_pins:
                lookup_id, (deadline, _) = next(iter(self._lookup_pins.items()))
                if deadline > now:
                    break
                logger.warning("kvblock: releasing the pins of lookup %s: no load "
                               "started within lookup_timeout_ms", lookup_id)
                self._release_lookup(lookup_id)

    def cancel_request(self, req_id: str) -> None:
        """An aborted request (LMCache's StorageManager.cancel_request; its id
        is its async lookup's): that lookup's pins end now."""
        with self._lock:
            self._release_lookup(req_id)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._put_tasks

    # ------------------------------------------------------------------ puts
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[CacheEngineKey], None] | None = None,
    ) -> list[Future] | None:
        """Write the chunks not stored yet, asynchronously; one future per
        call (None when there is nothing to write)."""
        todo = []
        job = _PutJob(self._epoch)
        for key, obj in zip(keys, objs):
            if not self.chunk.matches(obj) or not self._positions_fit(obj):
                self.skipped_chunks += 1
                logger.debug("kvblock: not storing %s: its format differs from a full chunk "
                             "(%s)", key, self.chunk.describe())
                continue
            with self._lock:
                if key in self._put_tasks:
                    continue
                self._put_tasks[key] = job
            todo.append((key, obj))
        self._expire_lookup_pins()      # regions a put may need
        if not todo:
            return None
        # Chunks stored already are skipped with one uncounted probe (present),
        # not a lookup per chunk: the store's lookup counters (its hit rate)
        # are the engine's lookups.
        # Those are in use again (LMCache stored them anew): marked as just
        # used, as LocalDiskBackend's put of a key it holds does, or LRU
        # evicts them as chunks never used since their first put.
        try:
            kbs = [self.kvblock_key(key) for key, _ in todo]
            stored = self.store.present(kbs).tolist()
            if any(stored):
                self.store.touch([kb for kb, done in zip(kbs, stored) if done])
        except RUNTIME_FAILURES as e:   # no store now: nothing to queue writes for
            self._failed("a put", e)
            stored = [True] * len(todo)
        with self._lock:
            for (key, _), done in zip(todo, stored):
                if done:
                    self._end_put_task(key, job)
        todo = [(key, obj) for (key, obj), done in zip(todo, stored) if not done]
        for _, obj in todo:
            obj.ref_count_up()          # the storage manager drops its reference on return
        if not todo:
            return None
        try:
            return [self.executor.submit(self._write, job, todo, on_complete_callback)]
        except RuntimeError:
            # The writers are stopped: LocalCPUBackend's close (the hook
            # above) or this plugin's ran first.  Not stored (a miss later);
            # the references and put tasks taken above are given back.
            logger.warning("kvblock: not storing %d chunks (%s...): the plugin is closing",
                           len(todo), todo[0][0].to_string())
            with self._lock:
                for key, _ in todo:
                    self._end_put_task(key, job)
            for _, obj in todo:
                obj.ref_count_down()
            return None

    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj, transfer_spec: Any = None,
                        on_complete_callback=None) -> Future | None:
        futures = self.batched_submit_put_task([key], [obj], transfer_spec, on_complete_callback)
        return futures[0] if futures else None

    def _positions_fit(self, obj: MemoryObj) -> bool:
        pos = obj.metadata.cached_positions
        return not self.positions or pos is None or pos.numel() <= self.positions

    def _blocks_of(self, objs: list[MemoryObj]) -> list[np.ndarray]:
        """The block each object is stored as: its own buffer, or with
        positions an aligned staging copy of its bytes, count and positions."""
        n = self.chunk.nbytes
        if not self.positions:
            return [_obj_bytes(obj, n) for obj in objs]
        staging = aligned_empty(len(objs) * self.block_bytes).reshape(len(objs), -1)
        for row, obj in zip(staging, objs):
            row[:n] = _obj_bytes(obj, n)
            tail = row[n:].view(np.int64)
            pos = obj.metadata.cached_positions
            tail[:] = 0
            tail[0] = -1 if pos is None else pos.numel()
            if pos is not None:
                tail[1:1 + pos.numel()] = pos.reshape(-1).to(torch.int64).cpu().numpy()
        return list(staging)

    def _end_put_task(self, key: CacheEngineKey, job: _PutJob) -> None:
        """(under the lock) the key's put task of ``job`` is over (a later
        put's task on the key, queued after a remove, stays)."""
        if self._put_tasks.get(key) is job:
            del self._put_tasks[key]

    def _write(self, job: _PutJob, todo, on_complete_callback) -> int:
        """(writer thread) one run per chunk, straight from its buffer; the
        runs of one call published together (put_runs: one journal commit).
        Chunks a remove() or clear() took while queued are not written."""
        all_objs = [obj for _, obj in todo]
        with self._lock:
            stale = job.epoch != self._epoch
            for key, _ in todo:
                if stale or key in job.cancelled:
                    self._end_put_task(key, job)
            todo = [] if stale else [(k, o) for k, o in todo if k not in job.cancelled]
            job.writing = bool(todo)
        got = None
        try:
            if todo:
                blocks = self._blocks_of([obj for _, obj in todo])
                got = self.store.put_runs([([self.kvblock_key(key)], block)
                                           for (key, _), block in zip(todo, blocks)])
        except KVBlockError as e:
            self._failed(f"storing {len(todo)} chunks ({todo[0][0].to_string()}...)", e)
            got = self._stored_after_failure(todo)
        finally:
            for obj in all_objs:
                obj.ref_count_down()
            with self._lock:
                for key, _ in todo:
                    self._end_put_task(key, job)
                job.writing = False
                self._written.notify_all()
        if got is None:
            return 0
        if on_complete_callback is not None:
            for (key, _), n in zip(todo, got):
                if not n:               # declined (admission): not persisted
                    continue
                try:
                    on_complete_callback(key)
                except Exception as e:  # noqa: BLE001 (the engine's callback: log, go on)
                    logger.warning("kvblock: on_complete_callback failed for %s: %s",
                                   key.to_string(), e)
        return sum(got)

    def _stored_after_failure(self, todo) -> list[int] | None:
        """(a put_runs that raised) per chunk of ``todo``, 1 if the store
        holds it: put_runs keeps the groups it published before the
        failure, and LMCache is told of every chunk persisted
        (on_complete_callback), those too.  None when the store cannot say."""
        try:        # uncounted, as the probes before a put
            return self.store.present([self.kvblock_key(key) for key, _ in todo]) \
                .astype(int).tolist()
        except RUNTIME_FAILURES:
            return None

    # ------------------------------------------------------------------ gets
    def _load_prefix(self, keys: Sequence[CacheEngineKey], busy_loop: bool) -> list[MemoryObj]:
        """Objects of the stored prefix of ``keys``, each in a new MemoryObj,
        read in one call of the store."""
        kbs = [self.kvblock_key(k) for k in keys]
        try:
            # an uncounted probe: the engine's lookup before this load was
            # the counted one (the store's hit rate)
            found = self.store.present(kbs) if kbs else np.zeros(0, dtype=bool)
        except RUNTIME_FAILURES as e:
            self._failed("a load", e)
            return []
        stored = len(kbs) if found.all() else int(np.argmin(found))
        objs: list[MemoryObj] = []
        got = 0
        try:
            for key in keys[:stored]:
                obj = self.local_cpu_backend.allocate(self.chunk.shapes, self.chunk.dtypes,
                                                      self.chunk.fmt, busy_loop=busy_loop)
                if obj is None:
                    logger.warning("kvblock: no CPU memory for chunk %s", key.to_string())
                    break
                objs.append(obj)
            if not objs:
                return []
            n = self.chunk.nbytes
            blocks = ([_obj_bytes(o, n) for o in objs] if not self.positions
                      else list(aligned_empty(len(objs) * self.block_bytes)
                                .reshape(len(objs), -1)))
            try:
                read = self.store.get_blocks(kbs[:len(objs)], blocks)
            except KVBlockError as e:
                self._failed(f"reading chunk {keys[0].to_string()}", e)
                read = 0
            if self.positions:             # the bytes into the objects, positions beside
                for obj, row in zip(objs[:read], blocks):
                    _obj_bytes(obj, n)[:] = row[:n]
                    tail = row[n:].view(np.int64)
                    count = int(tail[0])
                    obj.metadata.cached_positions = (
                        None if count < 0 else torch.from_numpy(tail[1:1 + count].copy()))
            got = read
        finally:
            # evicted or removed meanwhile, or a bad checksum; all of them
            # on any other error (a failed allocation or copy, an interrupt):
            # each allocated object goes back to LMCache's allocator
            for obj in objs[got:]:
                obj.ref_count_down()
        return objs[:got]

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        loaded = self._load_prefix([key], busy_loop=True)
        return loaded[0] if loaded else None

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        loaded = self._load_prefix(keys, busy_loop=True)
        return [*loaded, *([None] * (len(keys) - len(loaded)))]

    def get_non_blocking(self, key: CacheEngineKey,
                         location: str | None = None) -> Future | None:
        try:
            if not self.store.present([self.kvblock_key(key)])[0]:   # uncounted, as above
                return None
        except RUNTIME_FAILURES as e:
            self._failed("a load", e)
            return None
        try:
            return self.loader.submit(
                lambda: next(iter(self._load_prefix([key], False)), None))
        except RuntimeError:            # the loaders are stopped (closing): a miss
            logger.warning("kvblock: not loading %s: the plugin is closing", key.to_string())
            return None

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        loop = asyncio.get_running_loop()
        # The load has started: its lookup's pins are no longer left to
        # lookup_timeout_ms (_expire_lookup_pins), which ends those of a
        # load that never came.  A load queued behind others, or reading,
        # past the deadline would lose them under it: its chunks evicted
        # before it read them, the load short of the hits reported.
        with self._lock:
            started = self._lookup_pins.pop(lookup_id, (0, []))[1]
        try:
            try:
                load = self.loader.submit(self._load_prefix, list(keys), False)
            except RuntimeError:
                # The loads' threads are stopped: LocalCPUBackend's
                # close (the hook above) or this plugin's ran first, and
                # LMCache's lookups still come.  A miss, as for puts.
                logger.warning("kvblock: not loading %d chunks (%s...): the plugin is "
                               "closing", len(keys), keys[0].to_string() if keys else "")
                load = None
            try:
                objs = [] if load is None else await asyncio.wrap_future(load, loop=loop)
            except asyncio.CancelledError:
                # The task awaiting the load is cancelled (a prefetch given
                # up, the loop's tasks at close): the loader thread still
                # reads, and what it returns reaches no one.  Give it back.
                load.add_done_callback(_free_loaded)
                raise
            if self.layerwise and transfer_spec is None and len(objs) < len(keys):
                # One layer of every chunk (retrieve_layer): LMCache's
                # layer-wise connectors zip what comes back with the chunks,
                # so a short list would leave that layer's stale KV in place
                # with its tokens counted as loaded.  Fail the load instead
                # (LocalCPUBackend raises too).  An async prefetch (its
                # transfer_spec carries the chunk lengths) gets the prefix:
                # LMCache rounds it down to whole chunks and frees the rest.
                for obj in objs:
                    obj.ref_count_down()
                raise KVBlockError(
                    f"kvblock lmcache plugin: {len(keys) - len(objs)} of {len(keys)} layer "
                    f"objects (from {keys[len(objs)].to_string()}) were evicted, unreadable "
                    "or out of CPU memory since the lookup")
            return objs
        finally:
            # The load of an async lookup ends its pins (LMCache unpins the
            # objects it gets, never the backend's keys).
            with self._lock:
                self._release_pins(started)
                self._release_lookup(lookup_id)

    # ------------------------------------------------------------------ pins, removal
    def pin(self, key: CacheEngineKey, _held: list | None = None) -> bool:
        """Keep the chunk's run (its region) from being reclaimed until unpin.
        ``_held``: gets (kvblock key, the pin entry this pin counts in)."""
        kb = self.kvblock_key(key)
        with self._lock:
            entry = self._pins.get(kb)
            # kvblock has no public pin yet: take the read pin its loads take.
            try:
                segs = self.store.pin([kb])
            except RUNTIME_FAILURES as e:
                # a miss; the pins held stay: the chunk is not known gone
                self._failed("a pin", e)
                return False
            if not segs:
                if entry is not None:
                    # A clear() (or another rank's delete) took the chunk while
                    # pinned: the pin left over must not make it found.
                    # Earlier holders' unpins then find no entry: harmless.
                    del self._pins[kb]
                    self._store_unpin(entry[1])
                return False
            if entry is None:
                # the key too: clear() keeps a pinned layer's whole chunk
                self._pins[kb] = [1, segs, key]
            elif _lost(entry[1]) or _run_ids(segs) != _run_ids(entry[1]):
                # The pin held protects nothing now: taken on a shared
                # store's connection that is gone (the server restarted), or
                # on a copy a clear() or another rank's delete took before the
                # chunk was stored again elsewhere.  The new pin replaces it,
                # keeping the count of LMCache's pins (each is unpinned once)
                # and the entry (async lookups' pins count in it).
                self._store_unpin(entry[1])
                entry[0] += 1
                entry[1] = segs
            else:
                self._store_unpin(segs)     # one store pin per key
                entry[0] += 1
            if _held is not None:
                _held.append((kb, self._pins[kb]))
            return True

    def unpin(self, key: CacheEngineKey) -> bool:
        kb = self.kvblock_key(key)
        with self._lock:
            entry = self._pins.get(kb)
            if entry is None:
                try:            # uncounted: an unpin is no lookup of the engine's
                    return bool(self.store.present([kb])[0])
                except RUNTIME_FAILURES as e:
                    self._failed("an unpin", e)
                    return False
            self._unpin_entry(kb, entry)
            return True

    def _unpin_entry(self, kb: bytes, entry: list) -> None:
        """(under the lock) one pin of ``entry``, the key's, released."""
        entry[0] -= 1
        if entry[0] == 0:
            del self._pins[kb]
            self._store_unpin(entry[1])

    def _store_unpin(self, segs) -> None:
        """Release a store pin handle.  A failure (a store server's call
        timing out; a gone server is quiet already) is a store failure,
        logged and counted, not raised: the handle is spent either way, and
        the callers release pins on the way out of a load (whose objects
        must reach LMCache), of a lookup's expiry or of LMCache's unpin."""
        try:
            self.store.unpin(segs)
        except RUNTIME_FAILURES as e:
            self._failed("an unpin", e)

    def _settle_writes(self, keys: Sequence[CacheEngineKey]) -> None:
        """(under the lock) wait until no write of ``keys`` is under way (one
        store write each; the lock is released meanwhile)."""
        while any((job := self._put_tasks.get(k)) is not None and job.writing for k in keys):
            self._written.wait()

    def _drop_queued_puts(self, keys: Sequence[CacheEngineKey]) -> bool:
        """(under the lock, after _settle_writes: no write of ``keys`` under
        way, and none starts while the lock is held) drop the keys' queued
        puts (the writer skips them and unrefs them).  Whether one was."""
        dropped = False
        for key in keys:
            job = self._put_tasks.pop(key, None)
            if job is not None:
                job.cancelled.add(key)
                dropped = True
        return dropped

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        # Layer-wise, a chunk's key (LMCacheEngine.clear(tokens) removes by
        # chunk key) stands for its layers' objects: all of them go, or
        # (unforced, a layer pinned) none -- a chunk missing a layer is
        # never found or loaded again.
        keys = (key.split_layers(self.objects_per_chunk)
                if self.layerwise and not isinstance(key, LayerCacheEngineKey) else [key])
        kbs = [self.kvblock_key(k) for k in keys]
        with self._lock:
            if not force and any(kb in self._pins for kb in kbs):
                return False
            self._settle_writes(keys)
            # From the pin check to the delete the lock is held, no wait
            # between: a pin (of any of the keys) comes before the remove and
            # keeps them all, its queued puts too, or after it (a miss).
            if not force and any(kb in self._pins for kb in kbs):
                return False
            for kb in kbs:
                if kb in self._pins:
                    self._store_unpin(self._pins.pop(kb)[1])
            dropped = self._drop_queued_puts(keys)
            try:
                return self.store.delete(kbs) > 0 or dropped
            except RUNTIME_FAILURES as e:
                self._failed("a remove", e)
                return False

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        return sum(self.remove(k, force) for k in keys)

    def touch_cache(self) -> None:
        """Recency is kept by the store itself (reads touch their regions)."""

    def clear(self) -> int:
        """Remove this worker's chunks (its namespace, model and worker id:
        on a store that other workers or tenants share theirs stay; LMCache
        clears every worker and expects the same count from each), except
        pinned ones (as LocalCPUBackend.clear and remove(force=False);
        layer-wise, every layer of a chunk with a pinned layer);
        returns the tokens the removed ones held (a layer object holds
        1/layers of its chunk's tokens).  Puts queued before it are dropped
        (writes under way end first)."""
        with self._lock:
            self._epoch += 1
            for key, job in list(self._put_tasks.items()):
                if not job.writing:
                    del self._put_tasks[key]    # its writer drops the job (epoch)
            self._written.wait_for(lambda: not any(
                job.writing and job.epoch < self._epoch for job in self._put_tasks.values()))
            pinned = list(self._pins)   # kept, as by remove(force=False)
            if self.layerwise:
                # A chunk is found and loads only with all its layers: a
                # pinned layer keeps its whole chunk (as remove(chunk,
                # force=False)), not itself alone, the chunk a miss for good.
                pinned = list({self.kvblock_key(k): None for entry in self._pins.values()
                               for k in entry[2].split_layers(self.objects_per_chunk)})
            # Still under the lock: a pin taken between the list of pinned
            # keys and the delete would succeed on a chunk the delete then
            # removes (its lookup's load a miss).  Pins wait for the delete.
            try:
                blocks = self.store.delete_prefix(
                    self.owner_tag(self.metadata.model_name, self.metadata.worker_id), pinned)
            except RUNTIME_FAILURES as e:
                self._failed("clear", e)
                return 0
        return blocks * self.chunk_tokens // self.objects_per_chunk

    def get_allocator_backend(self) -> AllocatorBackendInterface:
        return self.local_cpu_backend

    def stats(self) -> dict:
        """The store's counters and gauges, with the plugin's own: chunks not
        stored for their format, and store failures answered as misses."""
        own = {"skipped_chunks": self.skipped_chunks, "store_failures": self._failed.count}
        try:
            return {**self.store.stats(), **own}
        except RUNTIME_FAILURES as e:
            return {**own, "store_error": str(e)}

    def close(self) -> None:
        """Finish queued writes, release pins, checkpoint and close the store."""
        self._stop_threads()
        with self._lock:
            pins, self._pins = list(self._pins.values()), {}
            self._lookup_pins.clear()
        failure = None
        try:
            for _, segs, _ in pins:
                try:    # an unpin that fails (a call timing out) leaves the others to release
                    self.store.unpin(segs)
                except KVBlockError as e:
                    failure = failure or e
        finally:        # the devices, fence and heartbeat go whatever the pins did
            self.store.close()
        if failure is not None:
            raise failure
