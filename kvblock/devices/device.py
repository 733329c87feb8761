"""Open a block device or regular file for direct I/O and probe what it is.

Probing uses the kernel's own answers: BLKGETSIZE64 / BLKSSZGET / BLKPBSZGET
ioctls and the queue attributes in sysfs for block devices, fstat and the
filesystem for files.  Opening is exclusive by default (O_EXCL on block
devices, which the kernel refuses while the device is mounted or opened
exclusively by anyone else; an advisory flock on files) so two stores never
write one device.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import re
import shlex
import stat
import struct
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from kvblock.errors import (
    AlignmentError,
    ConfigError,
    DeviceBusyError,
    DeviceError,
    DeviceNotFoundError,
    DevicePathError,
    DevicePermissionError,
    DeviceTooSmallError,
    IOFailedError,
    ReadOnlyDeviceError,
    UnsupportedDeviceError,
    strerror,
)
from kvblock.units import is_whole

logger = logging.getLogger(__name__)

BLKGETSIZE64 = 0x80081272
BLKROGET = 0x125E
BLKSSZGET = 0x1268
BLKPBSZGET = 0x127B
BLKDISCARD = 0x1277
# Files are addressed at 4 KiB: every filesystem block device kvblock meets has
# a logical block size <= 4096, and 4 KiB is what GPUDirect Storage needs.
FILE_BLOCK_SIZE = 4096


@dataclass(frozen=True)
class DeviceInfo:
    path: str
    kind: str                  # "block" or "file"
    capacity: int              # bytes usable
    logical_block_size: int    # alignment of offsets, lengths and buffers
    physical_block_size: int
    discard: bool              # TRIM/punch-hole supported
    rotational: bool
    model: str
    # The cache mode the device (for a file: its filesystem's device) reports:
    # "write back" (volatile: each flush waits for it), "write through" (the
    # kernel completes flushes at once, as for a drive without a volatile
    # cache, like many with power-loss protection), "" where no block device says (tmpfs).
    write_cache: str = ""
    # Bytes the device or file has: capacity is the whole blocks of them (a
    # 1000-byte file has none).  None: as capacity.
    size: int | None = None

    def as_dict(self) -> dict:
        # (by its fields: reading __dict__ would make one; see layout.geometry._derive)
        return asdict(self)


def said_size(dev) -> str:
    """``dev``'s size (a Device, or a plan's stand-in) for a message: its
    capacity, and the bytes it has where they are more (whole blocks only
    are used): a 1000-byte file is "1000 bytes (0 in whole 4096-byte
    blocks)", not "0 bytes"."""
    size = getattr(getattr(dev, "info", None), "size", None)
    if size is None or size == dev.capacity:
        return f"{dev.capacity} bytes"
    return f"{size} bytes ({dev.capacity} in whole {dev.block_size}-byte blocks)"


def create_file(path: str | os.PathLike, size: int, *, _exclusive: bool = False) -> Path:
    """Create (or grow) a pre-sized backing file of ``size`` bytes.

    Space is reserved with posix_fallocate so later writes cannot fail with
    ENOSPC half-way through a run.
    (``_exclusive``: only create it; FileExistsError when it exists (new_file).)
    """
    # before anything is made: a float or None failed deep inside (a bare
    # TypeError), 0 or a negative size made an empty "pre-sized" file
    if not is_whole(size) or size < 1:
        raise ConfigError(f"create_file: size must be a whole number of bytes, at least 1 "
                          f"(e.g. 1 << 30 for 1 GiB), got {size!r}")
    size = int(size)
    _refuse_nul(path)
    _refuse_folder_path(path)
    path = Path(path)
    if not os.path.exists(path):   # missing, or a link to a missing name
        _refuse_dev(path)
    try:
        existed = path.exists()
        # The folder the file goes in: a dangling link's target's (the link's
        # own is there already), as new_file lists what it makes
        Path(os.path.realpath(path)).parent.mkdir(parents=True, exist_ok=True)
        if _exclusive:
            # O_EXCL fails on any symlink: create the (dangling) link's target.
            try:
                fd = os.open(os.path.realpath(path), os.O_RDWR | os.O_CREAT | os.O_EXCL,
                             0o600)
            except FileExistsError:
                raise _MadeMeanwhile() from None
            # Held until it has its size: another start finding the path
            # taken meanwhile opened a file of 0 bytes and failed
            # DeviceTooSmallError; a store's open finds this lock busy.
            with contextlib.suppress(OSError):    # (ENOLCK: as before, unlocked)
                fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        # mkdir's EEXIST (exist_ok): a folder on the way is a file.
        code = errno.ENOTDIR if isinstance(e, FileExistsError) else e.errno
        where = f" (at {e.filename})" if e.filename and os.fspath(e.filename) != str(path) else ""
        # What is wrong is the path given (exit 8), or the filesystem is
        # read-only (as opening a store file there says); not an I/O error.
        cls = (DevicePermissionError if code in (errno.EACCES, errno.EPERM) else
               ReadOnlyDeviceError if code == errno.EROFS else
               DevicePathError if code in _BAD_PATH else DeviceError)
        raise cls(f"{path}: cannot create the store file: {strerror(code)}{where}; choose "
                  "another path (a file on a writable filesystem)"
                  + ("; or run as a user that may write there"
                     if cls is DevicePermissionError else ""),
                  path, code) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISBLK(st.st_mode):
            # Its st_size reads 0: fallocate and ftruncate would fail on it.
            raise UnsupportedDeviceError(
                f"{path}: a block device, not a file to create or grow; give it as the "
                "device (a store uses it as it is), or choose a file path", path, errno.ENOTSUP)
        if not stat.S_ISREG(st.st_mode):
            # A character device or FIFO opens read-write, but neither
            # fallocate nor ftruncate works on it (a bare EINVAL OSError).
            raise UnsupportedDeviceError(
                f"{path}: {_describe_mode(st.st_mode)}, not a file to create or grow; choose "
                "a file path (or give a block device as the device)", path, errno.ENOTSUP)
        if st.st_size < size:
            # Refuse before reserving: a failed posix_fallocate may leave
            # every free byte of the filesystem allocated to the file.
            fs = os.fstatvfs(fd)
            free = fs.f_bavail * fs.f_frsize
            need = size - st.st_blocks * 512
            # A size that does not fit (DeviceTooSmallError: exit 7, as a
            # size too small for the store), not a failed I/O: nothing failed.
            if need > free:
                raise DeviceTooSmallError(
                    f"{path}: cannot reserve {size} bytes: {free} bytes are free on its "
                    f"filesystem; {_NO_ROOM_FIX}", path, errno.ENOSPC)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    os.ftruncate(fd, st.st_size)     # give back what was reserved
                    # no room after all (space went meanwhile, a quota): a
                    # size that does not fit; anything else failed
                    cls = (DeviceTooSmallError if e.errno in (errno.ENOSPC, errno.EDQUOT)
                           else DeviceError)
                    raise cls(f"{path}: cannot reserve {size} bytes: {strerror(e.errno)}; "
                              f"{_NO_ROOM_FIX}", path, e.errno) from e
                os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        fd = -1
        if not existed:
            # The file made: a dangling symlink's target, not the link.
            Path(os.path.realpath(path)).unlink(missing_ok=True)
        raise
    finally:
        if fd >= 0:
            if _exclusive:     # (not only closed: a child forked meanwhile shares it)
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    return path


# create_file's advice for a size its filesystem has no room for
_NO_ROOM_FIX = ("choose a smaller size, or put the file on another filesystem with room "
                "for it (or free space on this one)")


# create_file's errors of the path itself: a folder that takes no files
# (/proc: ENOENT), a file on the way, a folder at the path, a name too long,
# a loop of links
_BAD_PATH = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG,
                       errno.ELOOP, errno.EINVAL})


class _MadeMeanwhile(Exception):
    """(create_file, exclusive) the file exists: another process made it."""


def new_file(path: str | os.PathLike, size: int) -> list[str] | None:
    """create_file at a path where nothing is yet.  Returns what it made,
    for remove_made: the file (a dangling symlink's target, not the link),
    then each folder made for it, innermost first; None when another
    process made the file meanwhile (it is theirs: a store they may have
    formatted and hold, which no failure here may remove)."""
    _refuse_nul(path)
    # before realpath, which drops the slash: "made" would name the file
    # before it, perhaps one that exists (a store), for remove_made
    _refuse_folder_path(path)
    made = os.path.realpath(path)
    folders = []
    parent = os.path.dirname(made)
    while not os.path.exists(parent):
        folders.append(parent)
        parent = os.path.dirname(parent)
    try:
        create_file(path, size, _exclusive=True)
    except _MadeMeanwhile:
        return None
    except BaseException:
        # The create's error is the one to raise: a cleanup of what was
        # never made (the file under a file: ENOTDIR; on a read-only
        # filesystem: EROFS) raised its bare OSError in its place.
        try:
            remove_made([made, *folders])
        except OSError as e:
            if os.path.lexists(made):        # said only where something is left
                logger.warning("kvblock: %s: not removed after the failure: %s", made, e)
        raise
    return [made, *folders]


def remove_made(made: list[str] | None) -> None:
    """Remove what new_file made: the file, then its folders while they are
    empty (one another program has put something in since stays).  None
    (new_file made nothing): nothing."""
    if not made:
        return
    try:
        fd = os.open(made[0], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1
    except OSError:
        fd = -1                      # (unreadable: removed as before)
    try:
        if fd >= 0:
            try:
                # A store another process opened on it since (a sibling rank
                # that found it blank and formatted it) holds its flock: the
                # file is that store now, not ours to remove.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                import logging

                logging.getLogger("kvblock").warning(
                    "kvblock: %s: not removed after the failure: another process holds a "
                    "store on it", made[0])
                return
            except OSError:
                pass
        with contextlib.suppress(FileNotFoundError):
            os.unlink(made[0])       # (under the flock: no store opens it meanwhile)
    finally:
        if fd >= 0:
            os.close(fd)
    for folder in made[1:]:
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            continue
        except OSError:
            return


def _refuse_nul(path) -> None:
    """DeviceNotFoundError for an empty path, or one with a NUL byte in it
    (a stray \\u0000 in a config), which names no file: os.stat and open
    raise a bare ValueError on it.  The message shows it escaped (printed, the byte is
    invisible)."""
    p = os.fspath(path)
    if not p:
        # (an unset variable: "$DEV"): pathlib takes it for the current folder
        raise DeviceNotFoundError(
            "no such device or file: the device path is empty (an unset variable?); give "
            "the device (e.g. /dev/nvme1n1) or store file", p, errno.ENOENT)
    if ("\0" if isinstance(p, str) else b"\0") in p:
        raise DeviceNotFoundError(
            f"{p!r}: no such device or file: the path contains a NUL byte, which no file "
            "name can; check the path", p, errno.ENOENT)


def _refuse_folder_path(path) -> None:
    """DevicePathError for a path that ends in a slash, where no file can be
    made: it names a folder.  pathlib drops the slash, so create_file made
    (or took) the file before it, which the path as given then failed to
    open (ENOTDIR): "no such device or file" of what was just made."""
    p = os.fspath(path)
    if not p.endswith(b"/" if isinstance(p, bytes) else "/"):
        return
    text = os.fsdecode(p)
    stripped = _trailing_slash(text)
    fix = (f"{stripped} is no folder; give {stripped}"
           if stripped is not None and not os.path.isdir(stripped) else
           f"give a file name (e.g. {os.path.join(text, 'kv.img')})")
    raise DevicePathError(f"{text}: cannot create the store file: the path ends in /, which "
                          f"names a folder; {fix}", p, errno.EISDIR)


def _trailing_slash(path: str) -> str | None:
    """The device or file that ``path``, given with a slash at its end,
    names without it (None when there is none, or no slash): opened, the
    slash fails with ENOTDIR, which said the device did not exist."""
    if not isinstance(path, str):
        return None
    stripped = path.rstrip("/")
    if stripped and stripped != path and os.path.lexists(stripped):
        return stripped
    return None


def _slash_refusal(path: str, stripped: str, code: int) -> DeviceNotFoundError:
    """The error for ``path``, a device or file given with a slash at its
    end (``stripped``: without it)."""
    return DeviceNotFoundError(f"{path}: no such device or file: the path ends in /, which "
                               f"names a folder, and {stripped} is none; give {stripped}",
                               path, code)


def refuse_missing(path: str | os.PathLike, fix: str):
    """DeviceNotFoundError for ``path``, which does not exist, with ``fix``:
    the way the command at hand makes one (bench's --size).  Not where that
    way is none: a name on /dev's devtmpfs is a mistyped device, where no
    file is made (_refuse_dev's advice), and a path with a slash at its end
    names a folder."""
    p = os.fspath(path)
    _refuse_nul(p)
    stripped = _trailing_slash(p)
    if stripped is not None:
        raise _slash_refusal(p, stripped, errno.ENOENT)
    _refuse_dev(Path(p))
    raise DeviceNotFoundError(f"{p}: no such device or file; {fix}", p, errno.ENOENT)


def _refuse_dev(path: Path) -> None:
    """A path to create on /dev's own filesystem (devtmpfs: memory, where the
    kernel puts device nodes) is a mistyped device name (/dev/nvme0n2 for
    /dev/nvme1n1), never a place for a store file.  A link to a missing
    name is judged by where the file would be made: the link's target."""
    real = Path(os.path.realpath(path))
    try:
        dev = os.stat("/dev").st_dev
        if dev == os.stat("/").st_dev:
            return                   # /dev is a plain folder here, not devtmpfs
        parent = real.parent
        while not parent.exists():   # the folder it would be made in
            parent = parent.parent
        if os.stat(parent).st_dev != dev:
            return
    except OSError:
        return
    via = f" (a link to {real})" if str(real) != os.path.abspath(path) else ""
    raise DeviceNotFoundError(
        f"{path}{via}: no such device (lsblk lists the block devices); a store file is not "
        "created on /dev, whose filesystem is memory: check the device name, or create the "
        "file on a filesystem (e.g. /var/lib/kvblock/kv.img)", os.fspath(path), errno.ENOENT)


def _read_only(fd: int) -> bool:
    """Is the block device open on ``fd`` read-only (BLKROGET)?"""
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, BLKROGET, buf)
    except OSError:
        return False
    return struct.unpack("<i", buf)[0] != 0


LOOP_GET_STATUS64 = 0x4C05
LO_FLAGS_READ_ONLY = 1


def _loop_attached_read_only(fd: int, st: os.stat_result) -> str | None:
    """The backing file of the loop device (or partition of one) open on
    ``fd`` when it was attached read-only (losetup -r, or a file it could
    not open for writing: LO_FLAGS_READ_ONLY); None for any other device."""
    backing = _writes_backing(st.st_rdev)
    if backing is None:
        return None
    info = bytearray(232)         # struct loop_info64; lo_flags at byte 52
    try:
        fcntl.ioctl(fd, LOOP_GET_STATUS64, info)
    except OSError:
        return None
    return backing if struct.unpack_from("<I", info, 52)[0] & LO_FLAGS_READ_ONLY else None


def holders(path: str, limit: int = 3) -> str:
    """" (held by pid N: CMDLINE; also open in pid M: CMDLINE)" for the
    processes other than this one that have ``path`` open, read from /proc
    (what a busy-device message can name; empty when none can be seen,
    e.g. without root).  For a block device, also those that have its whole
    disk or one of its partitions open: the kernel's claim on either makes
    it busy.

    Having it open is not holding it: the ranks of a served store open its
    devices without the claim, and with three of them they alone filled the
    list.  The holder named first is the process whose open file holds a
    flock on it, or on a file or device under it down a stack of loop
    devices (the claim of a store, as Device takes it: the file's flock, a
    loop device's backing file's); every such process is named, and up to
    ``limit`` of the others after it, as "also open in" (and how many more).
    Where no flock tells (a plain block device opened O_EXCL, a mount) the
    processes are only "open in"."""
    ident = _identity(path)
    if ident is None:
        return ""
    # a block device: its own number, its whole disk's, and (by their disk)
    # its partitions'
    disk = _whole_disk(ident[1]) if ident[0] == "block" else None
    # what a store over ``path`` flocks: the files (and block devices) down
    # its stack of loop devices; a process with one of these open and locked
    # holds the claim, though it may have no other reason to be named
    under = set()
    for st, *_ in _writes(path)[1:]:
        under.add(("block", st.st_rdev) if stat.S_ISBLK(st.st_mode)
                  else ("file", st.st_dev, st.st_ino))
    held, opened = [], []
    for pid in filter(str.isdigit, _listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        is_open = locked = False
        for fd in _listdir(f"/proc/{pid}/fd"):
            other = _identity(f"/proc/{pid}/fd/{fd}")
            if other is None:
                continue
            mine = other == ident or (
                disk is not None and other[0] == "block"
                and (other[1] == disk or _whole_disk(other[1]) == ident[1]))
            if not mine and other not in under:
                continue
            is_open = is_open or mine
            locked = locked or _flocked(f"/proc/{pid}/fdinfo/{fd}")
            if locked:
                break
        if not (locked or is_open):
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())
        except OSError:
            continue
        # a long command line is cut, and says so: its cut may leave a
        # parenthesis of its own open
        cmd = cmd if len(cmd) <= 120 else cmd[:117] + "..."
        (held if locked else opened).append(f"pid {pid}: {cmd}")
    more = f"; and {len(opened) - limit} more" if len(opened) > limit else ""
    others = "; ".join(opened[:limit]) + more
    if held:
        return f" (held by {'; '.join(held)}" + (f"; also open in {others})" if opened else ")")
    return f" (open in {others})" if opened else ""


def _flocked(fdinfo: str) -> bool:
    """Does the open file behind /proc/PID/fdinfo/FD hold a flock (its
    "lock:" lines: the locks that open file holds)?  Not a POSIX or OFD
    lock: ranks take those (the write fence) on the device they only use."""
    try:
        with open(fdinfo) as f:
            return any(line.startswith("lock:") and " FLOCK " in line for line in f)
    except OSError:
        return False


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _identity(path: str) -> tuple | None:
    """What a path names, comparable across paths: a block device's number,
    a file's (filesystem, inode); a loop device also names its backing file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISBLK(st.st_mode):
        return ("block", st.st_rdev)
    return ("file", st.st_dev, st.st_ino)


LOOP_MAJOR = 7      # the kernel's block major of loop devices


def _same_target(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two stats name the same bytes: a block device by its number
    (whatever node it is reached by: the inode of a node in /dev is not the
    device), a file by its (filesystem, inode)."""
    if stat.S_ISBLK(a.st_mode) or stat.S_ISBLK(b.st_mode):
        return stat.S_ISBLK(a.st_mode) and stat.S_ISBLK(b.st_mode) and a.st_rdev == b.st_rdev
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _whole_disk(rdev: int) -> int:
    """The number of the whole disk a partition ``rdev`` is on (sysfs: a
    partition's folder has a ``partition`` file and sits in its disk's
    folder); ``rdev`` itself for a whole disk."""
    base = Path(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}")
    if not (base / "partition").exists():
        return rdev
    try:
        major, minor = _read_str(base.resolve().parent / "dev").split(":")
        return os.makedev(int(major), int(minor))
    except ValueError:
        return rdev


def _overlap(a: os.stat_result, b: os.stat_result) -> str | None:
    """Whether writing ``a`` writes bytes of ``b``: "same" for the same
    target (_same_target), "disk" when ``a`` is the whole disk ``b`` is a
    partition of, "partition" when ``a`` is a partition of the whole disk
    ``b``; None otherwise (two partitions of one disk do not overlap).
    The kernel's O_EXCL links a partition and its disk, but a loop device
    over either claims neither, so the busy checks must."""
    if _same_target(a, b):
        return "same"
    if not (stat.S_ISBLK(a.st_mode) and stat.S_ISBLK(b.st_mode)):
        return None
    if _whole_disk(b.st_rdev) == a.st_rdev:
        return "disk"
    if _whole_disk(a.st_rdev) == b.st_rdev:
        return "partition"
    return None


def loop_backing(rdev: int) -> str | None:
    """The backing file of the loop device numbered ``rdev``; None for any
    other block device."""
    backing = _read_str(Path(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/loop/"
                             "backing_file"))
    return backing or None


def medium_key(st: os.stat_result) -> tuple:
    """What a device or file with this stat stores its bytes on, as a key:
    ("file", st_dev, st_ino) of a regular file, or of the file at the
    bottom of a stack of loop devices (a loop device is the file it is
    over); ("blk", st_rdev) of any other block device (a partition of a
    loop device is itself, not its disk's whole file)."""
    seen = set()
    while stat.S_ISBLK(st.st_mode) and st.st_rdev not in seen:
        seen.add(st.st_rdev)
        backing = loop_backing(st.st_rdev)
        if backing is None:
            break
        try:
            st = os.stat(backing)
        except OSError:        # (deleted, or a path that no longer names it)
            break
    return ("blk", st.st_rdev) if stat.S_ISBLK(st.st_mode) else ("file", st.st_dev, st.st_ino)


def _writes_backing(rdev: int) -> str | None:
    """The backing file block device ``rdev`` writes: a loop device's, or,
    for a partition of a loop device (losetup -P), its disk's (a partition
    has no loop folder in sysfs, but its bytes are the backing file's)."""
    return loop_backing(_whole_disk(rdev))


def _writes(path: str) -> list[tuple[os.stat_result, str, int | None, str]]:
    """What writing ``path`` writes, each with its name for a message, the
    loop device it is reached through a partition of (None if not) and its
    own path: the path itself and, down a stack of loop devices, each backing."""
    try:
        out = [(os.stat(path), path, None, path)]
    except (OSError, ValueError):   # ValueError: a NUL byte (Device says so)
        return []
    chain, seen, via = "", set(), None
    while stat.S_ISBLK(out[-1][0].st_mode) and out[-1][0].st_rdev not in seen:
        rdev = out[-1][0].st_rdev
        seen.add(rdev)
        backing = _writes_backing(rdev)
        if backing is None:
            break
        if via is None and _whole_disk(rdev) != rdev:
            via = _whole_disk(rdev)
        chain += f", over {backing}" if chain else f" (its backing file {backing}"
        try:
            out.append((os.stat(backing), f"{path}{chain})", via, backing))
        except OSError:
            break
    return out


def refuse_one_path(devices) -> None:
    """ConfigError naming it when ``devices`` is one path (str, bytes or
    os.PathLike) where a list of devices is expected: iterated, a str is its
    characters ("/ and / are the same device", a server on "/", "t", ...)."""
    if isinstance(devices, (str, bytes, os.PathLike)):
        raise ConfigError(f"{os.fspath(devices)!r} is a single path where a list of devices "
                          f"is expected; give [{os.fspath(devices)!r}]")


def check_distinct(paths) -> None:
    """ConfigError when two of ``paths`` are one device: the same path or
    device twice, a loop device and its backing file (or the file under a
    stack of loop devices), or a whole disk and one of its partitions
    (either of them directly or under a loop device)."""
    # Not only identical targets: a disk and its partition write the same
    # bytes, and Device's O_EXCL would refuse the second as busy (exit 5),
    # or, opened without it (a client), read one store's bytes out of place.
    refuse_one_path(paths)
    seen: list[tuple[os.stat_result, str, int | None, str, str]] = []
    for p in map(os.fspath, paths):
        mine = [(*level, p) for level in _writes(p)]
        for st, what, via, name, _ in mine:
            for other, other_what, other_via, _, other_p in seen:
                if via is not None and via == other_via:
                    continue    # two partitions of one loop device: judged as partitions
                overlap = _overlap(other, st)
                if overlap is None:
                    continue
                if (overlap == "same" and stat.S_ISREG(st.st_mode) and name != p
                        and other_what != other_p):
                    # Two loop devices (or stacks) over one file: perhaps over
                    # disjoint ranges of it (--offset/--sizelimit), which are no
                    # "same device", but each claims the whole file.
                    raise ConfigError(
                        f"{other_p} and {p} are loop devices over one file, {name}: kvblock "
                        "claims a loop device's whole backing file, whatever its --offset "
                        "and --sizelimit, so they count as one device; give each its own "
                        "file (or use partitions of one loop device: losetup -P)")
                how = {"same": "are the same device",
                       "disk": "overlap (the first is the whole disk of the second)",
                       "partition": "overlap (the first is a partition of the second)"}[overlap]
                raise ConfigError(f"{other_what} and {what} {how}; give each device once")
        seen += mine


class Device:
    """An open device.  ``fd`` is opened with O_DIRECT (and O_EXCL / flock).

    Parameters
    ----------
    path : block device or regular file.
    writable : open read-write (default) or read-only.
    exclusive : refuse if another opener holds it exclusively (default True).
    min_size : raise :class:`DeviceTooSmallError` below this many bytes.
    busy_timeout : seconds to keep retrying an exclusive open that finds the
        device busy.  A process that was just killed releases its claim only
        when the kernel finishes tearing down its io_uring, a moment later;
        a restarted server should not fail on that.  A file lock that no
        process is seen holding (no open descriptor names the file) is
        waited for ORPHANED_LOCK_WAIT_S longer: such a teardown takes
        seconds on a loaded machine.
    """

    def __init__(self, path: str | os.PathLike, *, writable: bool = True,
                 exclusive: bool = True, min_size: int = 0, busy_timeout: float = 1.0):
        self.path = os.fspath(path)
        self.writable = writable
        self.exclusive = exclusive   # (a store opened to write needs its claim: KVStore.open)
        self.fd = -1
        # a loop device's backing file, locked beside it (and, for a loop
        # device over a loop device, that one's backing, down the stack)
        self._backing_fds: list[int] = []
        self._pid = os.getpid()   # the process whose flocks these are (see close)
        # The I/O engines over this device (IOEngine adds itself): closed by
        # close() before the descriptor is (see close).
        self._engines: "weakref.WeakSet" = weakref.WeakSet()
        _refuse_nul(self.path)
        try:
            st = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError) as e:   # ENOTDIR: a file on the way
            stripped = _trailing_slash(self.path)
            if stripped is not None:
                raise _slash_refusal(self.path, stripped, e.errno) from None
            # On /dev's devtmpfs: a mistyped device name, where no store
            # file is created (format refuses it), so no advice to make one
            _refuse_dev(Path(self.path))
            raise DeviceNotFoundError(
                f"{self.path}: no such device or file; check the path "
                "(create a store file with `kvblock format FILE --size SIZE ...` or "
                "kvblock.devices.create_file)",
                self.path, e.errno) from None
        except PermissionError:
            raise DevicePermissionError(
                f"{self.path}: permission denied while looking it up; run as root or "
                "grant access to the path", self.path, errno.EACCES) from None
        except OSError as e:     # ELOOP, ENAMETOOLONG, EIO...
            raise DeviceError(f"{self.path}: cannot look it up: {strerror(e.errno)}; check "
                              "the path", self.path, e.errno) from None
        if stat.S_ISBLK(st.st_mode):
            self.kind = "block"
        elif stat.S_ISREG(st.st_mode):
            self.kind = "file"
        else:
            raise UnsupportedDeviceError(
                f"{self.path}: not a block device or regular file "
                f"({_describe_mode(st.st_mode)}); pass a raw device such as /dev/nvme0n1 "
                "or a pre-sized file", self.path, errno.ENODEV)
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_DIRECT | os.O_CLOEXEC
        if exclusive and self.kind == "block":
            flags |= os.O_EXCL
        try:
            self.fd = _retry_busy(lambda: os.open(self.path, flags), busy_timeout)
        except PermissionError as e:
            if e.errno == errno.EPERM and writable and self.kind == "block":
                # A device node's flags are not the bytes' (chattr cannot
                # reach them through the node: its ioctl goes to the driver):
                # what refuses a device is a container's device rules or
                # a security policy.
                raise DevicePermissionError(
                    f"{self.path}: operation not permitted opening for read-write (EPERM): "
                    "the device is refused by a container's device rules (pass it in "
                    f"read-write: docker run --device {self.path}, or the pod's device "
                    "plugin) or by a security policy; allow it there, or open the store "
                    "read-only where reading is allowed", self.path, e.errno) from None
            if e.errno == errno.EPERM and writable:
                # Not access: an immutable or append-only file refuses a
                # writer, root too, so "run as root" would not help.
                raise DevicePermissionError(
                    f"{self.path}: operation not permitted opening for read-write (EPERM): "
                    "the file is flagged immutable or append-only (lsattr shows it; "
                    f"`chattr -i -a {self.path}` clears it), or a security policy refuses "
                    "it; open the store read-only", self.path, e.errno) from None
            raise DevicePermissionError(
                f"{self.path}: permission denied opening for {'read-write' if writable else 'read'}"
                "; run as root (raw devices) or add your user to the device's group",
                self.path, errno.EACCES) from None
        except OSError as e:
            if e.errno == errno.EBUSY:
                raise _busy(f"{self.path}: device is busy", st, self.path, "", self.path,
                            e.errno) from None
            if e.errno == errno.EROFS:
                raise ReadOnlyDeviceError(
                    f"{self.path}: on a read-only filesystem; open the store read-only, or "
                    "remount the filesystem read-write", self.path, e.errno) from None
            if e.errno == errno.EINVAL:
                raise UnsupportedDeviceError(
                    f"{self.path}: the filesystem refuses O_DIRECT; put the file on ext4/xfs "
                    "or use a raw or loop device", self.path, e.errno) from None
            raise DeviceError(f"{self.path}: cannot open: {strerror(e.errno)}",
                              self.path, e.errno) from None
        try:
            if exclusive and self.kind == "file":
                try:
                    _flock_waiting(self.fd, fcntl.LOCK_EX, self.path, busy_timeout)
                except BlockingIOError:
                    raise DeviceBusyError(
                        f"{self.path}: file is locked by another kvblock store"
                        f"{holders(self.path)}; stop the other process or open it read-only",
                        self.path, errno.EBUSY) from None
                # The lock may have been won from remove_made (a failed start
                # removing the file it made, under this lock): the file opened
                # is then no longer at the path, and a store on it would be lost.
                if not _still_at(self.path, self.fd):
                    raise DeviceNotFoundError(
                        f"{self.path}: the file was removed while it was being opened (a "
                        "store start that made it failed); try again", self.path,
                        errno.ENOENT)
            if writable and self.kind == "file" and _swap_over(os.fstat(self.fd)):
                # The kernel's, as a mounted device is: it opens, and fails
                # every write (ETXTBSY), which read as an I/O error.
                raise _busy(f"{self.path}: file is busy", os.fstat(self.fd), self.path, "",
                            self.path, errno.EBUSY)
            if exclusive and writable:
                # (a block device too: a loop device over it writes its bytes,
                # and the kernel claims only the loop device when it is mounted)
                self._refuse_busy_loop_over(st)
            if writable and self.kind == "block" and _read_only(self.fd):
                # The kernel opens it read-write, then fails every write (EPERM).
                backing = _loop_attached_read_only(self.fd, st)
                if backing is not None:
                    # blockdev --setrw clears a flag of its own, not the loop
                    # disk's: the device stays read-only (tried on one)
                    raise ReadOnlyDeviceError(
                        f"{self.path}: the loop device is attached read-only (losetup -r, or "
                        f"its file {backing} could not be opened for writing; blockdev --setrw "
                        "leaves it so); open the store read-only, or detach it and attach the "
                        f"file again read-write (`losetup -d {self.path}; losetup -f --show "
                        f"--direct-io=on {backing}`, then give the device it prints)",
                        self.path, errno.EROFS)
                raise ReadOnlyDeviceError(
                    f"{self.path}: the device is read-only (losetup -r, blockdev --setro, or "
                    f"write-protected); open the store read-only, or `blockdev --setrw "
                    f"{self.path}`", self.path, errno.EROFS)
            if exclusive and self.kind == "block":
                self._lock_loop_backing(st, busy_timeout)
            # The file as opened and locked, not the stat before: a store file
            # another start was still sizing (new_file holds its flock until
            # then) read as the 0 bytes it had when this open first looked.
            self.info = self._probe(os.fstat(self.fd))
            if (self.kind == "block" and self.info.capacity == 0
                    and os.major(st.st_rdev) == LOOP_MAJOR and not loop_backing(st.st_rdev)):
                raise DeviceNotFoundError(
                    f"{self.path}: a loop device with no file attached (detached, or never "
                    "set up); attach the store's file (losetup -f --show --direct-io=on FILE) "
                    "and give the device it prints", self.path, errno.ENXIO)
            if self.info.capacity < min_size:
                raise DeviceTooSmallError(
                    f"{self.path}: {said_size(self)}, need at least {min_size}; "
                    "use a larger device or grow the file", self.path, errno.ENOSPC)
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            for fd in self._backing_fds:
                os.close(fd)
            self._backing_fds = []
            raise

    def _lock_loop_backing(self, st: os.stat_result, busy_timeout: float) -> None:
        """A loop device's bytes are its backing file's: O_EXCL on the device
        does not stop a store opened on the file (its flock), nor one on a
        second loop device over the same file.  So the backing file is
        flocked too, as a store opened on the file itself locks it."""
        rdev, over, seen = st.st_rdev, "a loop device", {st.st_rdev}
        # Partitions of a loop device (losetup -P) write its backing file too,
        # but only part of it: a partition claims what is under its loop device
        # shared (flock LOCK_SH; a block device also held with O_EXCL, see
        # _claim_shared), so two partitions of one loop device stay usable side
        # by side, while a store on the file, or a loop device over all of it
        # (LOCK_EX), is refused.
        shared = False
        # A loop device over a loop device writes that one's backing too: each
        # level down the stack is claimed and checked as the first is (the
        # kernel claims none of them for the loop devices over it).
        while backing := _writes_backing(rdev):
            if _whole_disk(rdev) != rdev:
                if rdev == st.st_rdev:
                    over = "a partition of a loop device"
                shared = True
            over += f" over {backing}"
            # A loop device over a block device writes that device's bytes: claim
            # it (O_EXCL), which the kernel refuses while it is mounted or held by
            # another store, and which keeps either off it while this one is open
            # (a flock on a device node is seen by no O_EXCL opener).
            try:
                flags = os.O_RDONLY | os.O_CLOEXEC
                if stat.S_ISBLK(os.stat(backing).st_mode):
                    flags |= os.O_EXCL
                if shared and flags & os.O_EXCL:
                    fd = _claim_shared(backing, busy_timeout)
                else:
                    fd = _retry_busy(lambda: os.open(backing, flags), busy_timeout)
            except OSError as e:
                if e.errno == errno.EBUSY:
                    try:
                        bst = os.stat(backing)
                    except OSError:
                        bst = None
                    raise _busy(f"{self.path}: {over}, which is busy", bst, backing, "",
                                self.path, e.errno) from None
                return      # deleted or out of reach: nothing else can open it by name
            lock = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
            try:
                _flock_waiting(fd, lock, backing, busy_timeout)
            except BaseException as e:
                # Not yet in _backing_fds, which __init__ closes on failure:
                # a Ctrl-C in the wait (or any error) would leak it, and with
                # it the O_EXCL claim on a block device under the loop device.
                os.close(fd)
                if not isinstance(e, BlockingIOError):
                    raise
                raise DeviceBusyError(
                    f"{self.path}: {over}, which another kvblock store has open (through "
                    f"the file or another loop device{holders(backing)}); stop the other "
                    "process", self.path, errno.EBUSY) from None
            self._backing_fds.append(fd)
            bst = os.fstat(fd)
            # another loop device over it (or over its whole disk or a partition);
            # for a partition, its own disk is the loop device to skip (the
            # partition's claim makes that one look busy; what is over the
            # disk was checked with the partition itself)
            self._refuse_busy_loop_over(bst, _whole_disk(rdev), backing)
            if not stat.S_ISBLK(bst.st_mode) or bst.st_rdev in seen:
                return
            rdev = bst.st_rdev
            seen.add(rdev)

    def _refuse_busy_loop_over(self, file_st: os.stat_result, rdev: int | None = None,
                               name: str = "", _via: str = "", _seen: frozenset = frozenset()
                               ) -> None:
        """The other half of _lock_loop_backing: a file that backs a loop
        device which is mounted or claimed (O_EXCL: a filesystem, dm/md, a
        store on it) is in use, though nothing holds the file itself; so is
        a second loop device over that file (``rdev``: this one, skipped;
        ``name``: the file's path, for the message).
        Writing either would overwrite a mounted filesystem under the kernel.
        ``file_st`` may be a block device's: a loop device can be over one,
        and one over a partition of it, or over its whole disk, writes some
        of its bytes just the same.  Loop devices stack: one that is not busy
        is checked in turn for busy loop devices over it (``_via``: the
        chain so far, for the message)."""
        for loop_name in _listdir("/sys/block"):
            backing = _read_str(Path("/sys/block") / loop_name / "loop" / "backing_file")
            if not backing:
                continue
            try:
                bst, lst = os.stat(backing), os.stat(f"/dev/{loop_name}")
            except OSError:
                continue     # no node, or the file is gone: nothing to tell
            if lst.st_rdev == rdev or lst.st_rdev in _seen:
                continue
            overlap = _overlap(file_st, bst)
            if overlap is None:
                continue
            loop = f"/dev/{loop_name}"
            if _via:
                over, what = _via + ", ", "device"
            else:
                over = "" if rdev is None else f"a loop device over {name or backing}, "
                what = "device" if stat.S_ISBLK(file_st.st_mode) else "file"
            part = {"same": "", "disk": f"the whole disk of {backing}, ",
                    "partition": f"a partition of {backing}, "}[overlap]
            chain = f"{over}{part}the backing {what} of {loop}"
            try:
                os.close(os.open(loop, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC))
            except OSError as e:
                if e.errno != errno.EBUSY:
                    continue    # no access: nothing to tell
                raise _busy(f"{self.path}: {chain}, which is busy", lst, loop,
                            f", then `losetup -d {loop}`", self.path, errno.EBUSY) from None
            # Not busy itself, but a mounted loop device over it writes
            # through it to these bytes just the same (the kernel claims
            # only the top one).
            self._refuse_busy_loop_over(lst, rdev, name, chain, _seen | {lst.st_rdev})

    # --- probing ---------------------------------------------------------------
    def _probe(self, st: os.stat_result) -> DeviceInfo:
        if self.kind == "block":
            size = struct.unpack("Q", fcntl.ioctl(self.fd, BLKGETSIZE64, b"\0" * 8))[0]
            lbs = struct.unpack("i", fcntl.ioctl(self.fd, BLKSSZGET, b"\0" * 4))[0]
            # Whole logical blocks: the size counts 512-byte sectors, and a
            # partial last block (a 4 KiB-sector loop device over a file of
            # odd size) can be neither read nor written.
            capacity = size // lbs * lbs
            pbs = struct.unpack("I", fcntl.ioctl(self.fd, BLKPBSZGET, b"\0" * 4))[0]
            queue = _sysfs_queue(st.st_rdev)
            discard = _read_int(queue / "discard_max_bytes") > 0 if queue else False
            rotational = _read_int(queue / "rotational") == 1 if queue else False
            model = ""
            if queue:  # NVMe/SCSI model string, or the backing file of a loop device
                model = (_read_str(queue.parent / "device" / "model")
                         or _read_str(queue.parent / "loop" / "backing_file"))
            return DeviceInfo(self.path, "block", capacity, lbs, pbs, discard, rotational, model,
                              _read_str(queue / "write_cache") if queue else "", size)
        capacity = st.st_size // FILE_BLOCK_SIZE * FILE_BLOCK_SIZE
        queue = _sysfs_queue(st.st_dev) if os.major(st.st_dev) else None   # 0: tmpfs and co.
        return DeviceInfo(self.path, "file", capacity, FILE_BLOCK_SIZE,
                          max(FILE_BLOCK_SIZE, st.st_blksize), True, False, "file",
                          _read_str(queue / "write_cache") if queue else "", st.st_size)

    @property
    def capacity(self) -> int:
        return self.info.capacity

    @property
    def block_size(self) -> int:
        return self.info.logical_block_size

    # --- checks ----------------------------------------------------------------
    def check_range(self, offset: int, length: int) -> None:
        """Raise :class:`AlignmentError` / :class:`IOFailedError` for a request
        this device cannot serve with O_DIRECT (:class:`ConfigError` for a
        negative length)."""
        bs = self.block_size
        if length < 0:
            # A multiple of the block size, and offset + length inside the
            # device: it passed below, then BLKDISCARD's struct.pack raised a
            # bare struct.error and a file's punch hole said "unsupported".
            raise ConfigError(
                f"{self.path}: offset {offset} / length {length}: the length is "
                f"negative; give a length of 0 or more bytes (a multiple of {bs})")
        if offset % bs or length % bs:
            raise AlignmentError(
                f"{self.path}: offset {offset} / length {length} not aligned to the "
                f"{bs}-byte logical block size; round to multiples of {bs}")
        if offset < 0 or offset + length > self.capacity:
            raise IOFailedError(
                f"{self.path}: range [{offset}, {offset + length}) is outside the device "
                f"(capacity {self.capacity} bytes)", self.path, errno.EINVAL, offset, length)

    # --- maintenance -----------------------------------------------------------
    def _check_open(self) -> None:
        """ConfigError once closed: the descriptor is -1 (os calls on it
        raise a bare ValueError)."""
        if self.fd < 0:
            raise ConfigError(f"{self.path}: the device is closed; open it again "
                              "(Device(path)) to use it")

    def flush(self) -> None:
        """Make written data durable (fdatasync: flushes the device write cache)."""
        self._check_open()
        try:
            os.fdatasync(self.fd)
        except OSError as e:
            raise IOFailedError(f"{self.path}: flush failed: {strerror(e.errno)}",
                                self.path, e.errno) from None

    def discard(self, offset: int, length: int) -> bool:
        """Tell the device a range is free (TRIM / punch hole).  Returns False
        when the device does not support it; the range is then left as is."""
        self.check_range(offset, length)
        self._check_open()
        if not self.info.discard or length == 0:
            return False
        try:
            if self.kind == "block":
                fcntl.ioctl(self.fd, BLKDISCARD, struct.pack("QQ", offset, length))
            else:
                _punch_hole(self.fd, offset, length)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
                return False
            raise IOFailedError(f"{self.path}: discard of [{offset}, {offset + length}) "
                                f"failed: {strerror(e.errno)}", self.path, e.errno,
                                offset, length) from None
        return True

    def discard_supported(self) -> bool:
        """Whether :meth:`discard` would release space here, asked without
        discarding anything.  A block device says so in sysfs; every file's
        DeviceInfo says discard (punch hole), which only its filesystem can
        confirm (ext2, vfat, older NFS refuse it): a hole is punched past
        the file's end (KEEP_SIZE: no data there, the size kept)."""
        self._check_open()
        if not self.info.discard:
            return False
        if self.kind == "block":
            return True
        end = -(-os.fstat(self.fd).st_size // FILE_BLOCK_SIZE) * FILE_BLOCK_SIZE
        try:
            _punch_hole(self.fd, end, FILE_BLOCK_SIZE)
        except OSError:
            return False
        return True

    def close(self) -> None:
        # The engines over this device first, each once its I/O in flight is
        # done: an engine keeps the descriptor's number in its table, and once
        # another file took that number (the next open) its I/O went there.
        # Closed, an engine refuses I/O (ConfigError).  (The store closes its
        # engine first; this is for a Device closed under an open engine.)
        # An engine whose close fails (its owner's close already met that)
        # does not keep the descriptor and its claim open.
        for engine in list(getattr(self, "_engines", ())):
            try:
                engine.close()
            except Exception as e:
                logger.warning("kvblock: %s: closing an I/O engine over it failed (%s); "
                               "the device is closed all the same", self.path, e)
        # A flock belongs to the open file, which a forked child shares with
        # its parent: unlocking there would free the parent's claim while it
        # still writes.  A child only closes its descriptors.
        owner = os.getpid() == self._pid
        # Taken off first: a close that raises (EIO from an NFS close) is not
        # tried again later on the number, by then another file's; and each
        # is closed past one that raises (the error raised after).
        fd, self.fd = self.fd, -1
        backing, self._backing_fds = self._backing_fds, []
        with contextlib.ExitStack() as stack:      # closes in the reverse order
            for b in reversed(backing):
                stack.callback(_let_go, b, owner)
            if fd >= 0:
                # The lock released explicitly: an io_uring that registered
                # this fd may hold the open file (and so the lock) a moment longer.
                stack.callback(_let_go, fd, self.kind == "file" and owner)

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.info.capacity} bytes"
        return f"Device({self.path!r}, {self.kind}, {state})"


def _let_go(fd: int, unlock: bool) -> None:
    """Close ``fd``, releasing its flock first when ``unlock``."""
    try:
        if unlock:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _claim_shared(backing: str, timeout: float) -> int:
    """Open block device ``backing`` (under a partition of a loop device) to
    be claimed shared: held with O_EXCL, so that nothing mounts or claims it
    while the store writes (a flock on the node is seen by no mount), unless
    a sibling partition's store holds it already.  The kernel's claim
    belongs to one open file, so siblings cannot share it: a sibling is
    told from a mount by the flock every partition's store holds on the
    node (LOCK_SH, taken by the caller).  EBUSY (an OSError) when it is
    held by anything else past ``timeout``.  (While siblings are open, the
    device is claimed only as long as the one that got the claim is: once
    it closes, a mount can take the device while the others still write.
    A store's flock then no longer says whose the claim is, so a device
    mounted, or held by dm/md, is refused whatever flock is held.)"""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return os.open(backing, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
        fd = os.open(backing, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not _claimed_by_kernel(os.fstat(fd).st_rdev):
                return fd             # a store holds it: a sibling's (LOCK_SH) or,
                                      # LOCK_EX, one over all of it (refused by the caller)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)                  # no store's: mounted, or claimed by a program
        if time.monotonic() >= deadline:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), backing)
        time.sleep(0.01)


def _claimed_by_kernel(rdev: int) -> bool:
    """Whether block device ``rdev``, or a partition of it, is mounted (in
    this mount namespace) or held by a dm/md device stacked on it (sysfs
    holders): claims no store takes, which a store's flock must not be
    taken to explain."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and ":" in fields[2]:
                    major, minor = map(int, fields[2].split(":"))
                    dev = os.makedev(major, minor)
                    # the device itself (a partition too), or one of its partitions
                    if major and (dev == rdev or _whole_disk(dev) == rdev):
                        return True
    except (OSError, ValueError):
        pass
    base = Path(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}").resolve()
    folders = [base] + [p.parent for p in base.glob("*/partition")]
    return any(_listdir(str(folder / "holders")) for folder in folders)


def _busy(head: str, st: os.stat_result | None, busy: str, tail: str, path: str,
          code: int) -> DeviceBusyError:
    """DeviceBusyError "HEAD (why); fix TAIL" for ``path``, where block
    device ``busy`` (``st``: its stat; None when unknown) is busy: where it
    is mounted in this mount namespace (" (mounted at /mnt/x); unmount it
    first (umount /mnt/x)"), the swap area it is (/proc/swaps: swapoff; a
    swap file too), the kernel device stacked on it (dm/md holders), else
    the processes that have it open (holders()) and both fixes.
    ``kernel_held``: True when the mount, swap or stacked device was found
    (the fix is the kernel's, no process to stop)."""
    rdev = st.st_rdev if st is not None and stat.S_ISBLK(st.st_mode) else None
    mounts = _mount_points(rdev) if rdev is not None else []
    swaps = _swap_over(st) if st is not None and not mounts else []
    stacked = _stacked_on(rdev) if rdev is not None and not (mounts or swaps) else []
    if mounts:
        said = [point if name is None else f"{point} ({name})" for name, point in mounts]
        shown = ", ".join(said[:3]) + (f" and {len(said) - 3} more" if len(said) > 3 else "")
        targets = " ".join(shlex.quote(point) for _, point in mounts)
        why = f" (mounted at {shown}); unmount it first (umount {targets})"
    elif swaps:
        # no mount and no process: "unmount it or stop the other user" fits not
        why = (f" (in use as swap: {', '.join(swaps)}); turn the swap off first (swapoff "
               f"{' '.join(shlex.quote(name) for name in swaps)})")
    elif stacked:
        why = (f" (held by {', '.join(stacked)}, stacked on it: LVM, dm-crypt, multipath or "
               "md RAID); release it there first (vgchange -an, cryptsetup close, "
               "dmsetup remove or mdadm --stop)")
    else:
        why = (f" (mounted, or opened exclusively by another store or program"
               f"{holders(busy)}); unmount it or stop the other user")
    e = DeviceBusyError(f"{head}{why}{tail}", path, code)
    e.kernel_held = bool(mounts or swaps or stacked)
    return e


PROC_SWAPS = "/proc/swaps"     # the kernel's list of swap areas in use


def _kernel_unescape(field: str) -> str:
    """A path as /proc/swaps and mountinfo write it: octal escapes (\\040:
    a space) for the characters that would split the line."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _swap_over(st: os.stat_result) -> list[str]:
    """The swap areas in use (/proc/swaps) whose bytes are ``st``'s, or a
    partition's of it, or its whole disk's: the kernel's, as a mount's."""
    try:
        with open(PROC_SWAPS) as f:
            lines = f.read().splitlines()[1:]      # (a header line first)
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        name = _kernel_unescape(fields[0])
        try:
            if _overlap(st, os.stat(name)) is not None:
                found.append(name)
        except OSError:
            continue            # a swap file deleted since ("(deleted)"): no name to stat
    return found


def _mount_points(rdev: int) -> list[tuple[str | None, str]]:
    """Where block device ``rdev`` is mounted in this mount namespace, as
    /proc/self/mountinfo says: (None, mount point), or, for a partition of
    it or the whole disk it is a partition of (which claim it too),
    ("/dev/NAME", mount point); [] when none is (or none can be read)."""
    disk = _whole_disk(rdev)
    found = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 5 or ":" not in fields[2]:
                    continue
                major, minor = map(int, fields[2].split(":"))
                dev = os.makedev(major, minor)
                if not major or not (dev == rdev or dev == disk != rdev
                                     or _whole_disk(dev) == rdev):
                    continue
                point = _kernel_unescape(fields[4])
                found.append((None if dev == rdev else _dev_name(dev), point))
    except (OSError, ValueError):
        return []
    return list(dict.fromkeys(found))


def _dev_name(rdev: int) -> str:
    """/dev/NAME of block device ``rdev`` (its sysfs folder's name)."""
    base = Path(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}").resolve()
    return f"/dev/{base.name}" if base.name else f"device {os.major(rdev)}:{os.minor(rdev)}"


def _stacked_on(rdev: int) -> list[str]:
    """The dm/md devices the kernel stacked on block device ``rdev`` or a
    partition of it (sysfs holders), each as /dev/NAME, with its mapper
    name where it has one."""
    base = Path(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}").resolve()
    names = []
    for folder in [base] + [p.parent for p in base.glob("*/partition")]:
        for name in _listdir(str(folder / "holders")):
            mapper = _read_str(Path("/sys/block") / name / "dm" / "name")
            names.append(f"/dev/{name}" + (f" (/dev/mapper/{mapper})" if mapper else ""))
    return list(dict.fromkeys(names))


def _still_at(path: str, fd: int) -> bool:
    """Does ``path`` still name the file open as ``fd`` (not unlinked or
    replaced since it was opened)?"""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True          # cannot tell: as before
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _retry_busy(attempt, timeout: float):
    """Run ``attempt`` until it stops failing with EBUSY/EWOULDBLOCK or time is up."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.EWOULDBLOCK) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


# A process killed with a store open lets go of its file's lock only once
# the kernel has torn down its io_uring (the ring holds the file), which it
# finishes after the process is reaped: a moment, seconds on a loaded
# machine.  A lock that no process is seen holding (no open file names the
# path, this process's own included) is waited for this much longer.
ORPHANED_LOCK_WAIT_S = 10.0


def _flock_waiting(fd: int, op: int, path: str, busy_timeout: float) -> None:
    """flock(fd, op), retried for ``busy_timeout`` while another open file
    holds the lock; then, where none is seen open on ``path`` (the lock of a
    process just killed, still going), for ORPHANED_LOCK_WAIT_S more.
    BlockingIOError when it is still held."""
    attempt = lambda: fcntl.flock(fd, op | fcntl.LOCK_NB)   # noqa: E731
    try:
        _retry_busy(attempt, busy_timeout)
    except BlockingIOError:
        if holders(path) or _open_here(path, fd):
            raise
        logger.info("kvblock: %s is locked, but no process has it open: waiting up to %g s "
                    "for a process just killed to let go of it", path, ORPHANED_LOCK_WAIT_S)
        _retry_busy(attempt, ORPHANED_LOCK_WAIT_S)


def _open_here(path: str, fd: int) -> bool:
    """Whether this process has ``path`` open on a descriptor other than
    ``fd`` (another store of its own holds the lock: nothing to wait for)."""
    ident = _identity(path)
    return ident is not None and any(
        int(other) != fd and _identity(f"/proc/self/fd/{other}") == ident
        for other in _listdir("/proc/self/fd"))


@functools.cache
def _libc():
    """libc through ctypes, found once (find_library runs ldconfig: a process)."""
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _punch_hole(fd: int, offset: int, length: int) -> None:
    import ctypes

    libc = _libc()
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
    if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE,
                      ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _sysfs_queue(rdev: int) -> Path | None:
    """The sysfs queue folder of block device ``rdev`` (None if it has none)."""
    base = Path(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}").resolve()
    for candidate in (base / "queue", base.parent / "queue"):  # partitions use the parent's
        if candidate.is_dir():
            return candidate
    return None


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def _read_str(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _describe_mode(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "an unsupported file type"
