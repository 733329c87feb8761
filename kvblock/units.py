"""Byte sizes as people write them: 4096, 64K, 64KiB, 1M, 1.5G (binary units)."""

from __future__ import annotations

import re

import numpy as np

from kvblock.errors import ConfigError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size; use bytes or a K/M/G/T suffix, e.g. 64K or 1G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_setting(value, owner: str, name: str) -> int:
    """A size from a config (int or "64G"), as a ConfigError naming the setting."""
    if isinstance(value, bool):
        raise ConfigError(f"{owner}: {name} must be a size, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    try:
        return parse_size(value)
    except ValueError as e:
        raise ConfigError(f"{owner}: {name}: {e}") from None
