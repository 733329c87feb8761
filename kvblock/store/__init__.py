"""The KV block store: format, open, put/lookup/get, eviction, recovery."""

from kvblock.store.store import KVStore

__all__ = ["KVStore", "RemoteStore", "connect"]


def __getattr__(name):  # the multi-process client, imported on first use
    if name in ("RemoteStore", "connect"):
        from kvblock.store import client

        return getattr(client, name)
    raise AttributeError(name)
