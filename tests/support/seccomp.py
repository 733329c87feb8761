"""Block io_uring_setup in the current process with a seccomp filter.

This is what a container runtime's default profile does; it lets the tests
see kvblock's fallback engine chosen for real, not by a test switch.
Run it in a child process: a seccomp filter can never be removed.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

SYS_IO_URING_SETUP = 425  # same number on x86_64 and aarch64 (generic table)
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000


def supported() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "aarch64")


def block_io_uring(err: int = errno.ENOSYS, kill: bool = False) -> None:
    """``kill``: io_uring_setup kills the process (SIGSYS), as a systemd
    SystemCallFilter= without SystemCallErrorNumber= does, instead of failing."""
    insns = [
        (0x20, 0, 0, 0),                      # ld  seccomp_data.nr
        (0x15, 0, 1, SYS_IO_URING_SETUP),     # jeq io_uring_setup ? next : skip one
        (0x06, 0, 0, _RET_KILL_PROCESS if kill else _RET_ERRNO | err),   # ret KILL / ERRNO(err)
        (0x06, 0, 0, _RET_ALLOW),             # ret ALLOW
    ]
    code = b"".join(struct.pack("HBBI", *i) for i in insns)
    filt = ctypes.create_string_buffer(code)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(insns), ctypes.addressof(filt))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP failed")
