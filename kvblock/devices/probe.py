"""What is on a device before kvblock writes to it.

Signatures of filesystems, partition tables, RAID and LVM members come from
util-linux's ``blkid -p`` (low-level probing, no cache); kvblock's own
superblock is read directly.
"""

from __future__ import annotations

import shutil
import subprocess

from kvblock.errors import ConfigError


def signatures(path: str) -> dict:
    """blkid's findings (TYPE, PTTYPE, USAGE, LABEL...), {} when none."""
    blkid = shutil.which("blkid") or "/sbin/blkid"
    try:
        res = subprocess.run([blkid, "-p", "-o", "export", path], capture_output=True,
                             text=True, timeout=30)
    except FileNotFoundError:
        raise ConfigError("blkid (util-linux) is needed to check a device before formatting; "
                          "install util-linux or pass --force") from None
    if res.returncode == 2:      # nothing found
        return {}
    if res.returncode != 0:
        return {}
    found = {}
    for line in res.stdout.splitlines():
        key, _, value = line.partition("=")
        if key in ("TYPE", "PTTYPE", "USAGE", "LABEL", "UUID", "PART_ENTRY_TYPE"):
            found[key] = value
    return found


def describe(found: dict) -> str:
    kind = found.get("TYPE") or found.get("PTTYPE")
    what = {"filesystem": "a filesystem", "raid": "a RAID/LVM member",
            "crypto": "an encrypted volume", "other": "a signature"}.get(found.get("USAGE", ""),
                                                                           "a partition table"
                                                                           if "PTTYPE" in found
                                                                           else "a signature")
    label = f" labelled {found['LABEL']!r}" if found.get("LABEL") else ""
    return f"{what} ({kind}{label})"
