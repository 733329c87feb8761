"""The kvblock exception vocabulary.

Every error kvblock raises on purpose derives from :class:`KVBlockError`, so a
caller can catch the package's failures with one ``except``.  Subclasses name
the kind of failure; messages name the device, the offset and the fix.

A cache *miss* is not an error: lookups return counts, reads of absent keys
return ``False``/``None``.  Exceptions are for bad input, broken devices and
stores that cannot be served.
"""

from __future__ import annotations

import errno as _errno
import os


class KVBlockError(Exception):
    """Root of every error kvblock raises on purpose."""


# --- configuration -----------------------------------------------------------
class ConfigError(KVBlockError, ValueError):
    """A setting or argument has a value kvblock cannot use."""


# --- devices -----------------------------------------------------------------
class DeviceError(KVBlockError, OSError):
    """A device (block device or backing file) cannot be used as asked."""

    def __init__(self, message: str, path: str | os.PathLike | None = None,
                 errno: int | None = None):
        OSError.__init__(self, errno if errno is not None else 0, message)
        self.path = os.fspath(path) if path is not None else None
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        # OSError's would call the class with OSError's args (errno,
        # message), taken here for (message, path): the errno came back 0
        # (pickled to another process, or copied).  The attributes of
        # subclasses (IOFailedError's offset...) are in the state.
        return type(self), (self.message, self.path, self.errno), self.__dict__


class DeviceNotFoundError(DeviceError, FileNotFoundError):
    """The device path does not exist."""


class DevicePermissionError(DeviceError, PermissionError):
    """The process may not open the device (usually: not root)."""


class UnsupportedDeviceError(DeviceError):
    """The path is neither a block device nor a regular file."""


class DeviceTooSmallError(DeviceError):
    """The device has fewer bytes than the store or request needs."""


class DeviceBusyError(DeviceError):
    """Another process (or store) holds the device exclusively, or it is mounted."""


class DevicePathError(DeviceError, ConfigError):
    """A store file cannot be made at the path given: its folder takes no
    files (/proc), a folder on the way is a file, the path is a folder.  The
    path is the bad argument (a ConfigError), not the device failing (still a
    DeviceError, an OSError with .path and .errno)."""


class SocketInUseError(DeviceBusyError, ConfigError):
    """A store server already listens on the socket path a server was to
    listen on: in use, as a store another process holds is (a
    DeviceBusyError: the CLI's exit 5), and a ConfigError (the path given
    is taken: choose another), as it was raised before."""


class AlignmentError(KVBlockError, ValueError):
    """An offset or length is not a multiple of the device's block size."""


class IOFailedError(DeviceError):
    """An I/O failed or transferred fewer bytes than asked (EIO, EINVAL, short read).

    ``device_fault`` is False when the engine failed the I/Os without the
    device answering them (no ``path``; or a broken io_uring, whose ``path``
    still names where they were going): that says nothing about the data
    there, so no caller takes it for a bad sector.

    ``in_flight``: of the ``failed`` I/Os, those a broken io_uring could not
    wait for (the kernel took them): they may still land, a write on the
    space it was going to, a read in its buffer."""

    def __init__(self, message: str, path: str | None = None, errno: int | None = None,
                 offset: int | None = None, length: int | None = None,
                 failed: int = 1, device_fault: bool = True, in_flight: int = 0):
        super().__init__(message, path, errno)
        self.offset = offset
        self.length = length
        self.failed = failed
        self.device_fault = device_fault and path is not None
        self.in_flight = in_flight


class EngineUnavailableError(KVBlockError, RuntimeError):
    """The requested I/O engine cannot run on this machine (e.g. io_uring disabled)."""


class NativeLibraryError(KVBlockError, ImportError):
    """The native core (libkvblock_io.so) is missing or does not match this package."""


def strerror(code: int) -> str:
    """``'EIO (Input/output error)'`` for an errno value."""
    code = abs(int(code))
    return f"{_errno.errorcode.get(code, str(code))} ({os.strerror(code)})"


# --- stores --------------------------------------------------------------------
class FormatError(KVBlockError):
    """On-device metadata is missing, corrupt or of another kind."""

    def __init__(self, message: str, path: str | None = None, offset: int | None = None):
        super().__init__(message)
        self.path = path
        self.offset = offset


class NotAStoreError(FormatError):
    """No valid kvblock superblock on the device (never formatted, or both copies corrupt)."""


class SuperblockConflictError(NotAStoreError):
    """Both superblock copies of a device are valid but disagree (another
    store's superblock written over one): which is the device's cannot be
    told.  ``offsets`` are the two copies'."""

    def __init__(self, message: str, path: str | None = None, offsets: tuple = ()):
        super().__init__(message, path, offsets[0] if offsets else None)
        self.offsets = tuple(offsets)


class UnsupportedVersionError(FormatError):
    """The store was written by a kvblock with another on-device format
    version: ``version`` (None where not known)."""

    def __init__(self, message: str, path: str | None = None, offset: int | None = None,
                 version: int | None = None):
        super().__init__(message, path, offset)
        self.version = version


class GeometryMismatchError(FormatError):
    """The store was formatted for another KV geometry or model fingerprint."""


class MissingDeviceError(FormatError):
    """A device of a multi-device store is absent, or a device belongs to another store."""


class ProtocolMismatchError(KVBlockError):
    """A store server and its client speak different protocol versions (two
    kvblock releases): run one release on both sides."""


class StoreFullError(KVBlockError):
    """No space can be reclaimed: every region holds pinned runs, or the run is too large."""


class InternalError(KVBlockError, AssertionError):
    """kvblock was about to break one of its own invariants (a bug, not the
    caller's or the device's doing): the step that would have acted on it
    is refused before it changes anything.  Report it."""


class StoreClosedError(KVBlockError):
    """The store was closed (or crashed under fault injection); reopen it."""


class ServerError(KVBlockError):
    """A store server could not be started, or failed a request in a way that
    is not one of kvblock's own errors."""


class ServerGoneError(ServerError, StoreClosedError, ConnectionError):
    """The store server is not there (never started, stopped, killed or
    crashed) or the connection to it broke.  The pins of this connection are
    gone with it; reconnect once a server runs again."""


class ConnectionAbandonedError(ServerGoneError):
    """A call on a shared store's connection got no answer within the
    client's ``timeout=`` (or was cut off by an exception, a Ctrl-C), so the
    connection was given up (the server may well live on): a request another thread had not yet sent on it (a
    put's commit) was never sent, and the calls meet this until a new
    connection is made (``reconnect=True``) or the store is connected
    again."""


class ServerBusyError(ServerError):
    """The store server refused a connection: it serves as many as its
    --max-clients allows (close idle clients, or restart the server with a
    higher limit), or it took none within the connect's timeout (its listen
    backlog stayed full)."""


class PartialLoadError(KVBlockError):
    """A restore delivered fewer blocks than the caller computes with (a run
    failed its checksum or was evicted after the lookup): recompute the
    tokens past what was restored."""


class ReadOnlyStoreError(KVBlockError):
    """A store opened read-only (e.g. by `kvblock info`) was asked to change."""


class ReadOnlyDeviceError(DeviceError, ReadOnlyStoreError):
    """A device, or the filesystem of a store file, refuses writes: the
    store opens read-only only."""


class UnsafeTargetError(KVBlockError):
    """format refused a device that holds a filesystem, partition table, RAID/LVM
    member or another kvblock store (pass --force to overwrite it)."""
