"""The KV block store: format, open, put/lookup/get, eviction, recovery."""

from kvblock.store.store import KVStore

__all__ = ["KVStore"]
