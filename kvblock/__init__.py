"""kvblock: user-space block storage for LLM KV caches."""

from kvblock.devices import Device, create_file
from kvblock.errors import KVBlockError
from kvblock.io import IOBatch, engine_report, io_engine, open_engine
from kvblock.index import chain_keys
from kvblock.layout import Geometry
from kvblock.memory import BufferPool, HostBuffer, aligned_empty
from kvblock.store import KVStore

__version__ = "0.1.0"

__all__ = [
    "KVBlockError", "KVStore", "Geometry", "chain_keys", "Device", "create_file", "IOBatch", "open_engine", "io_engine",
    "engine_report", "BufferPool", "HostBuffer", "aligned_empty", "__version__",
]
