"""Open a store, or format one, the way engine integrations are configured.

Engines start with a device path in their config and no operator at hand:
``open_or_format`` opens the store there (checking geometry and model) and,
per ``format``, formats one when there is none: "if-empty" (default) formats
only devices that hold no kvblock store, and never a block device on which
util-linux's blkid finds a filesystem, partition table or RAID/LVM signature;
"never" only opens; "force" formats every time.
"""

from __future__ import annotations

import logging
import os
import stat

from kvblock.devices import create_file
from kvblock.errors import ConfigError, NotAStoreError, UnsafeTargetError
from kvblock.layout import Geometry
from kvblock.store.store import KVStore

FORMAT_MODES = ("if-empty", "never", "force")
logger = logging.getLogger("kvblock")


def open_or_format(devices: list[str], geometry: Geometry, model: str | None = None, *,
                   format: str = "if-empty", size: int | None = None,
                   region_size: int | None = None, owner: str = "kvblock",
                   force_hint: str = 'set format to "force"', **options) -> KVStore:
    """The store on ``devices``.  ``size``: create missing backing files of this
    size.  ``owner`` and ``force_hint`` name the integration and its setting
    in error messages."""
    if format not in FORMAT_MODES:
        raise ConfigError(f"{owner}: format must be one of {FORMAT_MODES}, got {format!r}")
    if size is not None:
        for path in devices:
            if not os.path.exists(path):
                create_file(path, size)
    if format == "force":
        return KVStore.format(devices, geometry, model=model, region_size=region_size,
                              force=True, **options)
    try:
        return KVStore.open(devices, geometry=geometry, model=model, **options)
    except NotAStoreError:
        if format == "never":
            raise
    for path in devices:
        if _is_block_device(path):
            from kvblock.devices.probe import describe, signatures

            found = signatures(path)
            if found:
                raise UnsafeTargetError(f"{path} holds {describe(found)}; {owner} will not "
                                        f"format it. Wipe it, or {force_hint}")
    logger.info("kvblock: formatting a new store on %s (%s)", devices, geometry.describe())
    return KVStore.format(devices, geometry, model=model, region_size=region_size, **options)


def _is_block_device(path: str) -> bool:
    try:
        return stat.S_ISBLK(os.stat(path).st_mode)
    except OSError:
        return False
