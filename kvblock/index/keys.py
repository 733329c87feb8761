"""Block keys: 16 bytes each.

Engines pass their own block hashes (bytes of any length, or ints); kvblock
maps them to 16 bytes (as-is when already 16 bytes, else xxh3-128).  It can
also compute chained prefix keys from token ids: key_i = xxh3_128(key_{i-1} ||
tokens of block i as int32 LE || salt), so a key names its whole prefix and a
salt (model, tenant, TP rank) keeps namespaces apart.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import xxhash

from kvblock.errors import ConfigError
from kvblock.units import is_whole

KEY_BYTES = 16
# 16 zero bytes mark a superseded position in checkpoints (kvblock/index/index.py),
# so the key 0 (or 16 zero bytes) is stored under this stand-in instead.
_ZERO = bytes(KEY_BYTES)
_ZERO_STANDIN = xxhash.xxh3_128_digest(_ZERO)


def normalize_key(key) -> bytes:
    if isinstance(key, (bytes, bytearray, memoryview)):
        key = bytes(key)
        if len(key) != KEY_BYTES:
            return xxhash.xxh3_128_digest(key)
    elif isinstance(key, (bool, np.bool_)):
        # (an int to Python: True was stored as the key 1)
        raise ConfigError(f"block keys must be bytes, str or int, got bool ({key}): a flag "
                          "passed where the keys belong; pass the block's hash or id")
    elif isinstance(key, (int, np.integer)):
        key = (int(key) & ((1 << 128) - 1)).to_bytes(KEY_BYTES, "little")
    elif isinstance(key, str):
        return xxhash.xxh3_128_digest(key.encode())
    else:
        raise ConfigError(f"block keys must be bytes, str or int, got {type(key).__name__}")
    return _ZERO_STANDIN if key == _ZERO else key


def key_begins(key: bytes, prefix: bytes) -> bool:
    """Does the key stored as ``key`` begin with ``prefix`` as its caller
    gave it?  The key 0 begins with zeros, not with its stand-in's bytes."""
    return (_ZERO if key == _ZERO_STANDIN else key).startswith(prefix)


def normalize_keys(keys: Iterable) -> list[bytes]:
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        # one key where a sequence of keys belongs: iterating it would make
        # a key of every byte or character
        raise ConfigError(f"expected a sequence of block keys, got one {type(keys).__name__} "
                          "key; wrap it in a list")
    try:
        each = iter(keys)
    except TypeError:
        # None or a number: no keys at all (a key of a wrong type inside the
        # sequence is a ConfigError too, in normalize_key)
        raise ConfigError(f"expected a sequence of block keys, got {type(keys).__name__}") \
            from None
    return [normalize_key(k) for k in each]


def chain_keys(token_ids: Sequence[int], block_tokens: int, salt: bytes | str = b"",
               parent: bytes = b"") -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` (a partial last block has none)."""
    if isinstance(salt, str):
        salt = salt.encode()
    if not is_whole(block_tokens) or block_tokens < 1:
        raise ConfigError(f"block_tokens must be a whole number of tokens of at least 1, got "
                          f"{block_tokens!r}")
    try:
        given = np.asarray(token_ids)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"token ids must be a sequence of integers: {e}") from None
    # hashed as int32: an id past it would wrap into another id's key
    # (two prompts, one key), a float would be cut to another id
    if given.size and (given.dtype.kind not in "iu" or given.ndim != 1
                       or given.min() < -(1 << 31) or given.max() >= 1 << 31):
        raise ConfigError(f"token ids must be a flat sequence of integers in int32's range, got "
                          f"{given.dtype} of shape {given.shape}"
                          + (f" from {given.min()} to {given.max()}" if given.dtype.kind in "iu"
                             else ""))
    tokens = given.astype("<i4")
    keys, prev = [], parent
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        prev = xxhash.xxh3_128_digest(prev + tokens[start:start + block_tokens].tobytes() + salt)
        keys.append(prev)
    return keys
