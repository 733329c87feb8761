"""What is on a device before kvblock writes to it.

Signatures of filesystems, partition tables, RAID and LVM members come from
util-linux's ``blkid -p`` (low-level probing, no cache); kvblock's own
superblock is read directly.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

from kvblock.errors import ConfigError, DevicePermissionError, UnsafeTargetError


def open_to_check(path: str) -> int:
    """``path`` opened read-only to see what it holds; DevicePermissionError
    (run as root) when this user may not."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        raise DevicePermissionError(f"{path}: permission denied opening it to check what it "
                                    "holds; run as root (raw devices) or add your user to the "
                                    "device's group", path, errno.EACCES) from None


def _check_readable(path: str) -> None:
    """DevicePermissionError when this user may not open ``path`` for reading."""
    try:
        fd = open_to_check(path)
    except DevicePermissionError:
        raise
    except OSError:
        return               # another failure: blkid's message says it
    os.close(fd)


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
    if res.returncode == 2:
        # Nothing found, or (saying so on stderr) the device could not be
        # opened or read: blkid exits 2 for both.
        if not res.stderr.strip():
            return {}
        _check_readable(path)    # not permitted to read it: say so (run as root)
        raise UnsafeTargetError(
            f"{path}: blkid -p could not read it ({res.stderr.strip()}), so what the device "
            "holds is unknown; check that it can be read, and what it holds with wipefs, "
            "or pass --force")
    if res.returncode == 8:      # ambivalent: more than one signature
        return {"USAGE": "ambivalent", "TYPE": "several signatures"}
    if res.returncode != 0:
        raise UnsafeTargetError(
            f"{path}: blkid -p failed (exit {res.returncode}: {res.stderr.strip()}), so what "
            "the device holds is unknown; check it with wipefs, or pass --force")
    # What the device itself holds.  A partition also reports its entry in
    # the parent's table (PART_ENTRY_*): that says nothing about its content,
    # except that system partitions hold data without a signature (a BIOS
    # boot partition's boot loader, Microsoft's reserved space).  So an
    # empty partition counts as empty only with a general-purpose type.
    found, part_type = {}, None
    for line in res.stdout.splitlines():
        key, _, value = line.partition("=")
        if key in ("TYPE", "PTTYPE", "USAGE", "LABEL", "UUID"):
            found[key] = value
        elif key == "PART_ENTRY_TYPE":
            part_type = value.lower()
    if not found and part_type is not None and part_type not in DATA_PARTITION_TYPES:
        found = {"USAGE": "partition", "TYPE": f"partition type {part_type}"}
    return found


# Partition types made for plain data: an empty one of these may be formatted.
DATA_PARTITION_TYPES = {
    "0x83",                                    # MBR: Linux
    "0xda",                                    # MBR: non-filesystem data
    "0fc63daf-8483-4772-8e79-3d69d8477de4",    # GPT: Linux filesystem data
    "8da63339-0007-60c0-c436-083ac8230908",    # GPT: Linux reserved
}


def how_to_free(found: dict) -> str:
    """What to do about ``found`` before formatting: wipefs removes
    signatures; a system partition has none to remove."""
    if found.get("USAGE") == "partition":
        return "pass --force once you know it is free"
    return "wipe it with wipefs, or pass --force"


def describe(found: dict) -> str:
    kind = found.get("TYPE") or found.get("PTTYPE")
    if found.get("USAGE") == "ambivalent":
        return ("several signatures (blkid's ambivalent result, e.g. a filesystem beside a "
                "stale one; list them with wipefs)")
    if found.get("USAGE") == "partition":
        return (f"a system partition ({kind}; such partitions hold data without a "
                "signature, e.g. a boot loader); check it is free")
    what = {"filesystem": "a filesystem", "raid": "a RAID/LVM member",
            "crypto": "an encrypted volume", "other": "a signature"}.get(found.get("USAGE", ""),
                                                                           "a partition table"
                                                                           if "PTTYPE" in found
                                                                           else "a signature")
    label = f" labelled {found['LABEL']!r}" if found.get("LABEL") else ""
    return f"{what} ({kind}{label})"
