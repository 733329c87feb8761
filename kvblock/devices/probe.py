"""What is on a device before kvblock writes to it.

Signatures of filesystems, partition tables, RAID and LVM members come from
util-linux's ``blkid -p`` (low-level probing, no cache); kvblock's own
superblock is read directly.
"""

from __future__ import annotations

import shutil
import subprocess

from kvblock.errors import ConfigError, UnsafeTargetError


def signatures(path: str) -> dict:
    """blkid's findings (TYPE, PTTYPE, USAGE, LABEL...), {} when none.
    Fails closed: a probe that cannot tell (blkid failed or hung) raises
    UnsafeTargetError, and several signatures (blkid's "ambivalent" result,
    e.g. a filesystem beside a stale old one) count as data."""
    blkid = shutil.which("blkid") or "/sbin/blkid"
    try:
        res = subprocess.run([blkid, "-p", "-o", "export", path], capture_output=True,
                             text=True, timeout=30)
    except FileNotFoundError:
        raise ConfigError("blkid (util-linux) is needed to check a device before formatting; "
                          "install util-linux or pass --force") from None
    except subprocess.TimeoutExpired:
        raise UnsafeTargetError(f"{path}: blkid -p did not answer in 30 s, so what the device "
                                "holds is unknown; check it with wipefs, or pass --force") \
            from None
    if res.returncode == 2:      # nothing found
        return {}
    if res.returncode == 8:      # ambivalent: more than one signature
        return {"USAGE": "ambivalent", "TYPE": "several signatures"}
    if res.returncode != 0:
        raise UnsafeTargetError(
            f"{path}: blkid -p failed (exit {res.returncode}: {res.stderr.strip()}), so what "
            "the device holds is unknown; check it with wipefs, or pass --force")
    # Only what the device itself holds: a partition reports its entry in the
    # parent's table too (PART_ENTRY_*), which says nothing about its content.
    found = {}
    for line in res.stdout.splitlines():
        key, _, value = line.partition("=")
        if key in ("TYPE", "PTTYPE", "USAGE", "LABEL", "UUID"):
            found[key] = value
    return found


def describe(found: dict) -> str:
    kind = found.get("TYPE") or found.get("PTTYPE")
    if found.get("USAGE") == "ambivalent":
        return ("several signatures (blkid's ambivalent result, e.g. a filesystem beside a "
                "stale one; list them with wipefs)")
    what = {"filesystem": "a filesystem", "raid": "a RAID/LVM member",
            "crypto": "an encrypted volume", "other": "a signature"}.get(found.get("USAGE", ""),
                                                                           "a partition table"
                                                                           if "PTTYPE" in found
                                                                           else "a signature")
    label = f" labelled {found['LABEL']!r}" if found.get("LABEL") else ""
    return f"{what} ({kind}{label})"
