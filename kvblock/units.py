"""Byte sizes as people write them: 4096, 64K, 64KiB, 1M, 1.5G (binary units)."""

from __future__ import annotations

import operator
import os
import re
from fractions import Fraction

import numpy as np

from kvblock.errors import ConfigError

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_SIZE = (1 << 63) - 1   # off_t: no file, device or offset is larger
_WHOLE = re.compile(r"^\s*-?[0-9]+\s*$")
# B alone or after a unit; "iB" only after one ("64iB" is a unit lost, not 64 bytes)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:I?B)?|B)?\s*$", re.IGNORECASE)


def is_whole(value, *, index: bool = False) -> bool:
    """Whether ``value`` is a whole number: an int or a numpy integer, never
    a bool (an int to isinstance: True would be taken for 1), a float (2.5
    would be cut to 2), a string or None.  ``index``: also anything
    ``operator.index`` takes (a 0-d integer array, a torch integer scalar),
    still no bool."""
    if isinstance(value, bool):
        return False
    if not index:
        return isinstance(value, (int, np.integer))
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def parse_size(text: str) -> int:
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size; use bytes or a K/M/G/T suffix, e.g. 64K or 1G")
    # Exact (a float rounds byte counts past 2**53 and overflows on long digit strings).
    # Digits past what can matter are cut first: Python refuses to convert
    # more than 4300 (its advice, sys.set_int_max_str_digits, is not ours).
    whole, _, frac = m.group(1).partition(".")
    whole = whole.lstrip("0") or "0"
    if len(whole) > len(str(MAX_SIZE)):
        raise ValueError(f"{text!r} is too large: at most {MAX_SIZE >> 40}T")
    # 40 decimals: a cut fraction times a unit (<= 2**40) floors the same
    size = int(Fraction(f"{whole}.{frac[:40] or 0}") * _UNITS[(m.group(2) or "").upper()])
    if size > MAX_SIZE:
        raise ValueError(f"{text!r} is too large: at most {MAX_SIZE >> 40}T")
    return size


def size_setting(value, owner: str, name: str, minimum: int = 1) -> int:
    """A size from a config (int or "64G"), as a ConfigError naming the
    setting; at least ``minimum`` bytes (a store file's size: 1 MiB, so that
    a number typed without its unit is refused rather than made a file)."""
    if is_whole(value):
        size = int(value)
    elif isinstance(value, bool):
        raise ConfigError(f"{owner}: {name} must be a size, got {value!r}")
    else:
        try:
            size = parse_size(value)
        except ValueError as e:
            raise ConfigError(f"{owner}: {name}: {e}") from None
    if size < minimum:
        raise ConfigError(f"{owner}: {name} must be at least {minimum} bytes, got {value!r}"
                          + (" (a unit missing? e.g. 64G)" if minimum >= 1 << 20 else ""))
    return size


def int_setting(value, owner: str, name: str, minimum: int = 1) -> int:
    """A whole number from a config (an int or a string of digits), at least
    ``minimum``, as a ConfigError naming the setting (not a TypeError deep
    inside, nor 2.7 silently made 2)."""
    if is_whole(value):
        number = int(value)
    elif isinstance(value, str) and _WHOLE.match(value):   # what int() takes, not isdigit()
        number = int(value)
    else:
        raise ConfigError(f"{owner}: {name} must be a whole number, got {value!r}")
    if number < minimum:
        raise ConfigError(f"{owner}: {name} must be at least {minimum}, got {value!r}")
    return number


def timeout_setting(value, owner: str, least: str = ">= 0") -> float | None:
    """A timeout in seconds (None: no limit), as a ConfigError naming the
    call: text failed deep in threading or socket with a TypeError, NaN
    waited as a poll (it compares false with 0).  ``least``: what the
    number must be, ">= 0" or "> 0"."""
    if value is None:
        return None
    if isinstance(value, (int, float, np.integer, np.floating)) and \
            not isinstance(value, bool) and value == value:
        seconds = float(value)
        if seconds > 0 or (seconds == 0 and least == ">= 0"):
            return seconds
    raise ConfigError(f"{owner}: timeout must be seconds (a number {least}) or None, "
                      f"got {value!r}")


def flag_setting(value, owner: str, name: str, default: bool = False) -> bool:
    """A true/false setting from a config (null: ``default``), as a
    ConfigError naming it when it is anything else (the string "false" is
    truthy)."""
    if value is None:
        return default
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ConfigError(f"{owner}: {name} must be true or false, got {value!r}")


def name_setting(value, owner: str, name: str, default: str = "") -> str:
    """A name from a config (a tenant, a model), mixed into keys: a string,
    or a whole number taken as its digits (a tenant named 0 is "0"); null:
    ``default``.  Anything else (a list, a map, true, 1.5) is a ConfigError
    naming the setting, not its repr made the name unsaid."""
    if value is None:
        return default
    if isinstance(value, str):
        return value
    if is_whole(value):
        return str(int(value))
    raise ConfigError(f"{owner}: {name} must be a string (a name), got {value!r}")


def path_setting(value, owner: str, name: str, example: str) -> str:
    """A path from a config, as a ConfigError naming the setting when it is
    no path (a number or a list would be made the path "123" or "['/x']")."""
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str):
            return path
    raise ConfigError(f"{owner}: {name} must be a path, e.g. {example!r}, got {value!r}")


# Store file sizes given in engine configs: below this a unit was forgotten.
MIN_FILE_SIZE = 1 << 20
