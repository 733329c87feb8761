"""Block keys and the in-memory index of stored runs."""

from kvblock.index.keys import KEY_BYTES, chain_keys, normalize_key, normalize_keys
from kvblock.index.index import KeyIndex, Run

__all__ = ["KEY_BYTES", "chain_keys", "normalize_key", "normalize_keys", "KeyIndex", "Run"]
