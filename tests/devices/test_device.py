"""Opening and probing devices, and the errors for every kind of bad target."""

import contextlib
import errno
import os
import socket
import stat
import subprocess
import time

import numpy as np
import pytest

from kvblock.devices import Device, create_file
from kvblock.errors import (
    AlignmentError,
    ConfigError,
    DeviceBusyError,
    DeviceError,
    DeviceNotFoundError,
    DevicePermissionError,
    DeviceTooSmallError,
    IOFailedError,
    KVBlockError,
    UnsupportedDeviceError,
)

MIB = 1 << 20


def test_probe_loop_device(loop_device):
    dev_path = loop_device(32 * MIB)
    with Device(dev_path) as dev:
        assert dev.kind == "block"
        assert dev.capacity == 32 * MIB
        assert dev.block_size in (512, 4096)
        assert dev.info.physical_block_size >= dev.block_size
        assert dev.info.model.startswith("/dev/shm/") or dev.info.model  # loop backing file
        assert isinstance(dev.info.discard, bool)


def test_probe_file(file_target):
    path = file_target(10 * MIB + 100)  # a partial last block is not usable
    with Device(path) as dev:
        assert dev.kind == "file"
        assert dev.capacity == 10 * MIB
        assert dev.block_size == 4096
        assert dev.info.discard


def _report_write_cache(dev_path, mode):
    with open(f"/sys/block/{os.path.basename(dev_path)}/queue/write_cache", "w") as f:
        f.write(mode)


def test_probe_reports_the_write_cache_of_the_device_or_the_files_filesystem(
        loop_device, tmp_path):
    """A block device's reported cache mode; a file's is its filesystem's
    device's (an ext4 on a loop device here); a tmpfs file has none.  (The
    loop_device fixture sets the minor's mode back.)"""
    dev_path = loop_device(32 * MIB)
    for mode in ("write back", "write through", "write back"):
        _report_write_cache(dev_path, mode)
        with Device(dev_path) as dev:
            assert dev.info.write_cache == mode
    subprocess.run(["mkfs.ext4", "-q", "-F", dev_path], check=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", dev_path, str(mnt)], check=True)
    try:
        path = create_file(mnt / "kv.img", 4 * MIB)
        for mode in ("write through", "write back"):
            _report_write_cache(dev_path, mode)
            with Device(str(path)) as dev:
                assert dev.kind == "file" and dev.info.write_cache == mode
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    shm = create_file(f"/dev/shm/kvblock-test-wc-{os.getpid()}.img", 4 * MIB)
    try:
        with Device(str(shm)) as dev:
            assert dev.info.write_cache == ""
    finally:
        shm.unlink()


def test_create_file_reserves_space(tmp_path):
    path = create_file(tmp_path / "sub" / "store.img", 8 * MIB)
    assert os.path.getsize(path) == 8 * MIB
    assert os.stat(path).st_blocks * 512 >= 8 * MIB  # allocated, not sparse


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.img"
    with pytest.raises(DeviceNotFoundError) as exc:
        Device(missing)
    assert str(missing) in str(exc.value) and "no such device" in str(exc.value)
    assert isinstance(exc.value, KVBlockError) and exc.value.errno == errno.ENOENT


def test_a_device_error_keeps_its_errno_through_pickle_and_copy(tmp_path):
    """A DeviceError sent to another process (a ProcessPoolExecutor's
    worker, an engine's worker process) or copied came back with errno 0:
    OSError's own reduce rebuilt it from OSError's args (errno, message)
    taken as (message, path), and the errno was never passed again."""
    import copy
    import pickle

    missing = tmp_path / "nope.img"
    with pytest.raises(DeviceNotFoundError) as exc:
        Device(missing)
    made = [exc.value,
            IOFailedError("read failed: EIO", "/dev/x", errno.EIO, offset=4096, length=512,
                          failed=2),
            DeviceError("cannot reserve 8 bytes", "/x.img", errno.ENOSPC),
            DeviceError("no errno")]
    for e in made:
        for back in (pickle.loads(pickle.dumps(e)), copy.copy(e)):
            assert type(back) is type(e)
            assert (str(back), back.path, back.errno, back.strerror) == \
                (str(e), e.path, e.errno, e.strerror), (e, back)
    back = pickle.loads(pickle.dumps(made[1]))
    assert (back.offset, back.length, back.failed, back.device_fault) == (4096, 512, 2, True)
    assert made[0].errno == errno.ENOENT


def test_a_missing_device_on_dev_is_not_told_to_create_a_store_file_there():
    """A mistyped device name (/dev/nvme0n2 for /dev/nvme1n1): the error
    said to create a store file with `kvblock format FILE --size SIZE`, at
    that path, which format refuses (a store file is not made on /dev's
    devtmpfs).  It says the device does not exist, and how to find it."""
    if os.stat("/dev").st_dev == os.stat("/").st_dev:
        pytest.skip("/dev is no filesystem of its own here")
    for typo in (f"/dev/kvblock-typo-{os.getpid()}", f"/dev/disk/kvblock-typo-{os.getpid()}/n1"):
        with pytest.raises(DeviceNotFoundError) as exc:
            Device(typo)
        msg = str(exc.value)
        assert msg.startswith(f"{typo}: no such device") and "lsblk" in msg, msg
        assert "--size" not in msg and "create_file" not in msg, msg
        assert exc.value.errno == errno.ENOENT and exc.value.path == typo


def test_an_immutable_file_is_not_told_to_run_as_root(tmp_path):
    """A file flagged immutable (chattr +i) refuses a read-write open with
    EPERM even to root: the error said "permission denied ... run as root"
    (with errno EACCES), advice that cannot help.  It names the flag and
    how to clear it, with the errno the kernel gave."""
    path = tmp_path / "kv.img"
    path.write_bytes(b"\0" * 4096)
    if os.geteuid() != 0 or subprocess.run(["chattr", "+i", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("chattr +i needs root and a filesystem that keeps the flag")
    try:
        with pytest.raises(DevicePermissionError) as exc:
            Device(path)
        msg = str(exc.value)
        assert "immutable" in msg and "chattr -i" in msg and "run as root" not in msg, msg
        assert exc.value.errno == errno.EPERM
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_block_device_refused_with_eperm_is_not_told_to_chattr_it(loop_device, monkeypatch):
    """A read-write open of a block device that fails EPERM (a container's
    device rules, docker run without --device for it; a security policy)
    was told the *file* is flagged immutable and to `chattr -i -a` the
    device node: chattr cannot set or clear a flag through a device node
    (its ioctl goes to the driver), so the advice could not help.  A block
    device's EPERM names what refuses a device."""
    dev = loop_device(1 << 20)
    real_open = os.open

    def refused(path, flags, *a, **kw):
        if os.fspath(path) == dev and flags & os.O_RDWR:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        return real_open(path, flags, *a, **kw)
    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(DevicePermissionError) as exc:
        Device(dev)
    msg = str(exc.value)
    assert "chattr" not in msg and "immutable" not in msg and "run as root" not in msg, msg
    assert "--device" in msg and msg.startswith(f"{dev}: operation not permitted"), msg
    assert exc.value.errno == errno.EPERM
    monkeypatch.undo()
    Device(dev).close()


def test_a_path_that_cannot_be_looked_up_is_a_device_error(tmp_path):
    """A path through a file (ENOTDIR), or through a symlink loop (ELOOP):
    a typed error naming the path, not a bare OSError from os.stat."""
    (tmp_path / "kv.img").write_bytes(b"")
    with pytest.raises(DeviceNotFoundError) as exc:
        Device(tmp_path / "kv.img" / "x")
    assert str(tmp_path / "kv.img" / "x") in str(exc.value) and "no such device" in str(exc.value)
    assert exc.value.errno == errno.ENOTDIR
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    with pytest.raises(DeviceError, match=r"loop: cannot look it up: ELOOP") as exc:
        Device(tmp_path / "loop")
    assert exc.value.errno == errno.ELOOP and exc.value.path == str(tmp_path / "loop")


@pytest.mark.parametrize("size", [None, "1G", 1.5, 4096.0, True, 0, -1, -MIB])
def test_create_file_with_a_size_that_is_no_byte_count_is_a_config_error(tmp_path, size):
    """create_file's size was used as given: None, "1G" or a float raised a
    bare TypeError from a comparison or posix_fallocate, and 0, a negative
    size or True made an empty (or 1-byte) "pre-sized" file and returned as
    if it had reserved the space.  Each is a ConfigError naming the size, and
    nothing is created (an existing file keeps its size)."""
    from kvblock.errors import ConfigError

    with pytest.raises(ConfigError, match=r"create_file: size must be a whole number of bytes"):
        create_file(tmp_path / "kv.img", size)
    assert os.listdir(tmp_path) == []
    old = create_file(tmp_path / "old.img", MIB)
    with pytest.raises(ConfigError, match=r"create_file: size"):
        create_file(old, size)
    assert os.path.getsize(old) == MIB
    assert create_file(tmp_path / "np.img", np.int64(MIB)) and \
        os.path.getsize(tmp_path / "np.img") == MIB


def test_a_path_with_a_nul_byte_is_a_typed_error_naming_it(tmp_path):
    """A device path with a NUL byte in it (a stray \\u0000 in a JSON config)
    names no file; Device, check_distinct (the first thing KVStore.open and
    format do), create_file and new_file raised the bare ValueError
    ("embedded null byte") of os.stat, naming nothing.  It is a
    DeviceNotFoundError naming the path (exit 3), and nothing is created."""
    from kvblock import KVStore
    from kvblock.devices import check_distinct
    from kvblock.devices.device import new_file

    bad = str(tmp_path / "kv.img\0x")
    for call in (lambda: Device(bad), lambda: check_distinct([bad]) or Device(bad),
                 lambda: KVStore.open([bad]), lambda: create_file(bad, MIB),
                 lambda: new_file(bad, MIB), lambda: Device(os.fsencode(bad))):
        with pytest.raises(DeviceNotFoundError, match=r"kv\.img\\x00x.*NUL byte") as e:
            call()
        assert e.value.errno == errno.ENOENT
    assert os.listdir(tmp_path) == []


def test_one_path_given_where_a_list_of_devices_is_expected_is_named(tmp_path):
    """KVStore.open("/dev/nvme1n1") (a path, not a list of them) went through
    check_distinct one character at a time: "/ and / are the same device;
    give each device once", which names no device and a wrong fix (a
    Path or bytes: a bare TypeError).  It is a ConfigError saying to give
    a list, before anything is opened or written."""
    from pathlib import Path

    from kvblock import KVStore
    from kvblock.devices import check_distinct
    from kvblock.errors import ConfigError
    from kvblock.layout import Geometry

    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    geometry = Geometry(2, 2, 64, "float16", 16)
    for single in (path, Path(path), os.fsencode(path)):
        for call in (lambda: check_distinct(single), lambda: KVStore.open(single),
                     lambda: KVStore.format(single, geometry)):
            with pytest.raises(ConfigError, match=r"kv\.img.*a single path.*a list"):
                call()
    with open(path, "rb") as f:
        assert f.read() == bytes(8 * MIB)         # nothing was formatted


def test_one_path_given_to_connect_where_a_list_of_devices_is_expected_is_named(tmp_path):
    """As above, for the server's clients: connect(sock, "/dev/nvme1n1")
    with no server there started one on the path's characters ('kvblock
    serve / d e v ...': "/ and / are the same device; give each device
    once", from its log), and with one there RemoteStore compared the
    characters with the served devices.  A ConfigError naming the path,
    before any server is started or asked."""
    from pathlib import Path

    from kvblock.errors import ConfigError
    from kvblock.store.client import RemoteStore, connect, ensure_server

    path = str(tmp_path / "kv.img")
    create_file(path, 8 * MIB)
    sock = tmp_path / "s.sock"
    for single in (path, Path(path), os.fsencode(path)):
        for call in (lambda: connect(sock, single, start_timeout=20),
                     lambda: RemoteStore(sock, devices=single),
                     lambda: ensure_server(sock, single, start_timeout=20)):
            with pytest.raises(ConfigError, match=r"kv\.img.*a single path.*a list"):
                call()
    assert sorted(os.listdir(tmp_path)) == ["kv.img"]       # no server was started


def test_directory_is_unsupported(tmp_path):
    with pytest.raises(UnsupportedDeviceError, match="not a block device or regular file.*directory"):
        Device(tmp_path)


def test_char_device_and_socket_are_unsupported(tmp_path):
    with pytest.raises(UnsupportedDeviceError, match="character device"):
        Device("/dev/null")
    sock_path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    try:
        with pytest.raises(UnsupportedDeviceError, match="socket"):
            Device(sock_path)
    finally:
        s.close()


def test_too_small(file_target):
    path = file_target(1 * MIB)
    with pytest.raises(DeviceTooSmallError, match=r"1048576 bytes, need at least 2097152"):
        Device(path, min_size=2 * MIB)


def test_permission_denied_for_non_root(file_target):
    path = file_target(1 * MIB)
    os.chmod(path, 0o400)
    if os.geteuid() == 0:
        # root ignores mode bits: check as an unprivileged user in a child process
        code = ("import sys\nfrom kvblock.devices import Device\n"
                "from kvblock.errors import DevicePermissionError\n"
                "try:\n    Device(sys.argv[1])\nexcept DevicePermissionError as e:\n"
                "    print('denied:', e)\n")
        os.chmod(os.path.dirname(path), 0o755)
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              _python(), "-c", code, path], capture_output=True, text=True)
        assert "denied:" in out.stdout and "run as root" in out.stdout, out.stderr
    else:
        with pytest.raises(DevicePermissionError, match="run as root"):
            Device(path)


def _python():
    import sys

    return sys.executable


def test_exclusive_file_lock(file_target):
    path = file_target(1 * MIB)
    with Device(path):
        with pytest.raises(DeviceBusyError, match="locked by another kvblock store"):
            Device(path)
    with Device(path):  # released on close
        pass


def test_a_file_sized_while_its_open_waits_for_the_lock_has_its_new_capacity(
        tmp_path, monkeypatch):
    """A store file another start has just made (new_file holds its flock
    from the O_EXCL create until posix_fallocate has sized it): an open that
    finds it locked waits for the lock (busy_timeout) and then goes on, but
    its capacity came from the stat taken before it opened the file, when
    it still had 0 bytes, so the sized file read as empty (0 bytes, or
    DeviceTooSmallError with a min_size)."""
    import fcntl
    import threading

    path = tmp_path / "kv.img"
    path.touch()
    holder = os.open(path, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    real_flock = fcntl.flock
    refused = threading.Event()

    def flock(fd, op):
        try:
            return real_flock(fd, op)
        except BlockingIOError:
            refused.set()         # the open has looked at the file and waits
            raise

    monkeypatch.setattr(fcntl, "flock", flock)

    def size_and_let_go():
        assert refused.wait(10)
        os.ftruncate(holder, 8 * MIB)
        real_flock(holder, fcntl.LOCK_UN)

    sizer = threading.Thread(target=size_and_let_go)
    sizer.start()
    try:
        with Device(path, min_size=4 * MIB, busy_timeout=10) as dev:
            assert dev.capacity == 8 * MIB
    finally:
        refused.set()
        sizer.join(10)
        os.close(holder)


def test_a_closed_devices_flush_and_discard_are_config_errors(file_target):
    """flush(), discard() and discard_supported() on a closed Device ran
    fdatasync, fallocate or fstat on the descriptor -1 and raised Python's
    bare ValueError ('file descriptor cannot be a negative integer'), no
    kvblock error and no device named."""
    path = file_target(MIB)
    dev = Device(path)
    dev.close()
    for call in (dev.flush, lambda: dev.discard(0, 4096), dev.discard_supported):
        with pytest.raises(ConfigError, match=f"{path}: the device is closed"):
            call()


def test_busy_names_the_process_holding_it(file_target, loop_device):
    """A device or file another process holds: the error names its pid and
    command line (an auto-started `kvblock serve` outlives its engine)."""
    import sys

    path, dev = file_target(1 * MIB), loop_device(8 * MIB)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom kvblock.devices import Device\n"
         "held = [Device(p) for p in sys.argv[1:]]\nprint('ready', flush=True)\n"
         "time.sleep(60)", path, dev], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        for target in (path, dev):
            with pytest.raises(DeviceBusyError, match=f"held by pid {holder.pid}: .*python"):
                Device(target, busy_timeout=0.1)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_busy_names_the_holder_not_processes_that_merely_have_it_open(shm_target,
                                                                    loop_device):
    """A store held by one process (`kvblock serve`) and opened, without the
    claim, by three others (its ranks): the error named the first three
    processes /proc listed with the device open, as "held by", so the ranks
    (started first) filled it and the real holder was left out.  The holder
    (the one with the flock: on the file, or on a loop device's backing
    file) is named as holding it; the others only as having it open."""
    import re
    import sys

    path, dev = shm_target(1 * MIB), loop_device(8 * MIB)
    procs = []
    try:
        for _ in range(3):             # the ranks: started first, so /proc lists them first
            procs.append(subprocess.Popen(
                [sys.executable, "-c", "import os, sys, time\n"
                 "fds = [os.open(p, os.O_RDWR) for p in sys.argv[1:]]\n"
                 "print('ready', flush=True)\ntime.sleep(60)", path, dev],
                stdout=subprocess.PIPE, text=True))
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\nfrom kvblock.devices import Device\n"
             "held = [Device(p) for p in sys.argv[1:]]\nprint('ready', flush=True)\n"
             "time.sleep(60)", path, dev], stdout=subprocess.PIPE, text=True)
        procs.append(holder)
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        for target in (path, dev):
            with pytest.raises(DeviceBusyError) as e:
                Device(target, busy_timeout=0.1)
            msg = str(e.value)
            assert re.search(f"held by pid {holder.pid}: [^;]*python", msg), msg
            also = msg.find("also open in")
            assert also > msg.find(f"held by pid {holder.pid}:"), msg
            for rank in procs[:3]:
                assert f"pid {rank.pid}:" in msg[also:], msg
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


def test_busy_cuts_a_long_command_line_and_says_so(shm_target):
    """A holder's command line is quoted up to 120 characters; it was cut
    there without a mark, so a cut inside its own "(...)" read as the
    message's parenthesis left open and nothing told the line went on."""
    import sys

    path = shm_target(1 * MIB)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom kvblock.devices import Device\n"
         "held = Device(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(60)",
         path, "x" * 300], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        with pytest.raises(DeviceBusyError) as e:
            Device(path, busy_timeout=0.1)
        msg = str(e.value)
        quoted = msg.split(f"held by pid {holder.pid}: ", 1)[1].rsplit(")", 1)[0]
        assert len(quoted) == 120 and quoted.endswith("..."), msg
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_exclusive_block_device(loop_device):
    dev_path = loop_device(8 * MIB)
    with Device(dev_path):
        with pytest.raises(DeviceBusyError, match="busy"):
            Device(dev_path)


def test_mounted_block_device_is_busy(loop_device, tmp_path):
    dev_path = loop_device(32 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", dev_path], check=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", dev_path, str(mnt)], check=True)
    try:
        with pytest.raises(DeviceBusyError, match="mounted"):
            Device(dev_path)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_check_range(file_target):
    with Device(file_target(1 * MIB)) as dev:
        dev.check_range(0, 4096)
        with pytest.raises(AlignmentError, match="4096-byte logical block size"):
            dev.check_range(100, 4096)
        with pytest.raises(AlignmentError):
            dev.check_range(0, 1000)
        with pytest.raises(IOFailedError, match="outside the device"):
            dev.check_range(MIB, 4096)


def test_a_negative_length_is_a_config_error(file_target, loop_device):
    """A negative length passed check_range (a multiple of the block size,
    and offset + length inside the device): discard(0, -4096) then raised a
    bare struct.error packing it for BLKDISCARD on a block device and
    returned False ("not supported") on a file.  It is a ConfigError
    naming the device, the offset and the length."""
    for path in (file_target(1 * MIB), loop_device(8 * MIB)):
        with Device(path) as dev:
            for call in (lambda: dev.check_range(0, -4096),
                         lambda: dev.discard(0, -4096),
                         lambda: dev.discard(8192, -4096)):
                with pytest.raises(ConfigError, match=f"{path}: .*length -4096"):
                    call()


def test_discard_zeroes_file_range(file_target):
    path = file_target(1 * MIB)
    with open(path, "r+b") as f:
        f.write(b"\xab" * MIB)
    with Device(path) as dev:
        assert dev.discard(0, 65536)
    with open(path, "rb") as f:
        assert f.read(65536) == b"\0" * 65536
        assert f.read(4096) == b"\xab" * 4096


def test_discards_of_a_file_look_up_libc_once(file_target, monkeypatch):
    """A file's discard punches a hole through libc's fallocate; finding
    libc (ctypes.util.find_library runs ldconfig, a process) is done once,
    not for every region a store reclaims."""
    import ctypes.util

    path = file_target(1 * MIB)
    found = []
    real = ctypes.util.find_library
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: found.append(name) or real(name))
    with Device(path) as dev:
        for off in range(0, 8 * 65536, 65536):
            assert dev.discard(off, 65536)
    assert len(found) <= 1, found


def test_errors_are_oserrors_too(tmp_path):
    with pytest.raises(OSError):
        Device(tmp_path / "missing")
    assert issubclass(DeviceError, KVBlockError)


def test_a_loop_device_and_its_backing_file_are_one_device(loop_device):
    """O_EXCL on /dev/loopN and flock on a file do not see each other: a
    store opened on both paths (or on two loop devices over one file) would
    have two writers on the same bytes.  The loop device's backing file is
    locked beside it."""
    dev = loop_device(16 << 20)
    name = os.path.basename(dev)
    with open(f"/sys/block/{name}/loop/backing_file") as f:
        backing = f.read().strip()
    with Device(dev):
        with pytest.raises(DeviceBusyError, match="loop device|locked"):
            Device(backing, busy_timeout=0.1)
    with Device(backing):
        with pytest.raises(DeviceBusyError, match=f"loop device over {backing}"):
            Device(dev, busy_timeout=0.1)
    second = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", backing],
                            capture_output=True, text=True, check=True).stdout.strip()
    try:
        with Device(dev):
            with pytest.raises(DeviceBusyError, match="another loop device"):
                Device(second, busy_timeout=0.1)
    finally:
        subprocess.run(["losetup", "-d", second], check=True)
    with Device(dev), Device(dev, writable=False, exclusive=False):
        pass                                     # read-only peeks stay possible


@contextlib.contextmanager
def _loop_over(path):
    """A loop device over ``path`` (a file or a block device), detached after."""
    from tests.support import loopdev

    upper = loopdev.attach(path)
    try:
        yield upper
    finally:
        loopdev.detach(upper)


@contextlib.contextmanager
def _mounted(dev, where):
    """``dev`` with a fresh ext4 mounted at ``where``, unmounted after."""
    subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True)
    where.mkdir()
    subprocess.run(["mount", dev, str(where)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_loop_device_over_a_busy_block_device_is_busy(loop_device, tmp_path):
    """A loop device whose backing "file" is a block device writes that
    device's bytes: while the block device is mounted (or a store holds it),
    opening the loop device to write must be refused, as its own mount
    would be; and a store on the loop device claims the block device under
    it, so none opens on that one meanwhile."""
    lower = loop_device(32 * MIB)
    with _loop_over(lower) as upper:
        with _mounted(lower, tmp_path / "mnt"):
            with pytest.raises(DeviceBusyError, match=f"loop device over {lower}.*busy"):
                Device(upper, busy_timeout=0.1)
        with Device(lower):
            with pytest.raises(DeviceBusyError, match=f"loop device over {lower}"):
                Device(upper, busy_timeout=0.1)
        with Device(upper):
            with pytest.raises(DeviceBusyError):
                Device(lower, busy_timeout=0.1)
        with Device(upper):                  # released on close, the claim below too
            pass
        with Device(lower):
            pass


def test_a_block_device_under_a_busy_loop_device_is_busy(loop_device, tmp_path):
    """The other way round: a block device that backs a mounted loop device
    holds that filesystem's bytes, though the kernel claims only the loop
    device; opening it to write is refused, naming the loop device."""
    lower = loop_device(32 * MIB)
    with _loop_over(lower) as upper:
        with _mounted(upper, tmp_path / "mnt"):
            with pytest.raises(DeviceBusyError, match=f"backing device of {upper}.*busy"):
                Device(lower, busy_timeout=0.1)
            with Device(lower, writable=False, exclusive=False):
                pass                             # read-only peeks stay possible
        with Device(lower):                      # unmounted: free again
            pass


@pytest.fixture
def partitioned_disk(request):
    """Factory: ``partitioned_disk(size)`` -> (/dev/loopN, /dev/loopNp1): a
    loop device with one partition (added with BLKPG, addpart: the kernel
    needs no partition-table parser for it), detached (its partition with
    it) after the test."""
    from tests.support import loopdev

    ok, why = loopdev.can_make_loop_devices()
    if not ok:
        pytest.skip(why)
    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)

    def make(size=32 * MIB):
        path = stack.enter_context(loopdev.backing_file(size))
        disk = loopdev.attach(path, partscan=True)
        stack.callback(loopdev.detach, disk)
        subprocess.run(["addpart", disk, "1", "2048", str(size // 512 - 4096)], check=True)
        name = os.path.basename(disk)
        part = f"/dev/{name}p1"
        if not os.path.exists(part):             # no devtmpfs or udev to make the node
            major, minor = map(int, open(f"/sys/block/{name}/{name}p1/dev").read().split(":"))
            os.mknod(part, 0o600 | stat.S_IFBLK, os.makedev(major, minor))
            stack.callback(os.unlink, part)      # (runs before the detach: last in, first out)
        return disk, part

    return make


def test_a_whole_disk_under_a_busy_loop_device_over_its_partition_is_busy(
        partitioned_disk, tmp_path):
    """A whole disk holds its partitions' bytes: while a loop device over a
    partition is mounted, opening the disk to write (kvblock format DISK
    --force) would overwrite that filesystem, and so would a store on a
    second loop device over the disk.  Both are refused, naming the busy
    loop device; the kernel sees neither (a loop device claims nothing
    under it, and the partition is not the disk's number)."""
    disk, part = partitioned_disk()
    with _loop_over(part) as upper:
        with _mounted(upper, tmp_path / "mnt"):
            with pytest.raises(DeviceBusyError, match=f"{part}, the backing device of {upper}"
                                                      ".*busy"):
                Device(disk, busy_timeout=0.1)
            with _loop_over(disk) as other:
                with pytest.raises(DeviceBusyError, match=f"loop device over {disk}.*{upper}"):
                    Device(other, busy_timeout=0.1)
            with Device(disk, writable=False, exclusive=False):
                pass                             # read-only peeks stay possible
        with Device(disk):                       # unmounted: free again
            pass


def test_a_partition_under_a_busy_loop_device_over_its_whole_disk_is_busy(
        partitioned_disk, tmp_path):
    """The other way round: a partition is part of its disk's bytes, so
    while a loop device over the whole disk is mounted, opening the
    partition to write is refused, naming the loop device."""
    disk, part = partitioned_disk()
    with _loop_over(disk) as upper:
        with _mounted(upper, tmp_path / "mnt"):
            with pytest.raises(DeviceBusyError, match=f"{disk}, the backing device of {upper}"
                                                      ".*busy"):
                Device(part, busy_timeout=0.1)
        with Device(part):                       # unmounted: free again
            pass


def test_a_file_under_a_mounted_loop_device_over_its_loop_device_is_busy(loop_device, tmp_path):
    """Loop devices stack: a file under loop device L, under loop device U
    which is mounted, holds that filesystem's bytes though neither it nor
    L is claimed by anyone (a loop device claims nothing under it).
    Opening the file to write (kvblock format FILE --force) is refused,
    naming the mounted loop device."""
    from tests.support import loopdev

    lower = loop_device(32 * MIB)
    backing = loopdev.backing_of(lower)
    with _loop_over(lower) as upper:
        with _mounted(upper, tmp_path / "mnt"):
            with pytest.raises(DeviceBusyError, match=f"{lower}.*{upper}, which is busy"):
                Device(backing, busy_timeout=0.1)
        with Device(backing):                    # unmounted: free again
            pass


def test_a_loop_device_over_a_loop_device_over_a_busy_device_is_busy(loop_device, tmp_path):
    """Down a stack of loop devices: top over mid over lower (a loop device
    over a file).  Writing top writes lower's bytes and its file's, so top
    is refused while lower is mounted, or while a store holds the file
    (its flock), as a loop device directly over either is."""
    from tests.support import loopdev

    lower = loop_device(32 * MIB)
    backing = loopdev.backing_of(lower)
    with _loop_over(lower) as mid, _loop_over(mid) as top:
        with _mounted(lower, tmp_path / "mnt"):
            with pytest.raises(DeviceBusyError, match=f"over {mid}.*over {lower}, which is busy"):
                Device(top, busy_timeout=0.1)
        with Device(backing):
            with pytest.raises(DeviceBusyError, match=f"over {backing}, which another kvblock"):
                Device(top, busy_timeout=0.1)
        with Device(top):                        # free again; and it holds the stack
            with pytest.raises(DeviceBusyError):
                Device(backing, busy_timeout=0.1)
        with Device(backing):                    # released on close
            pass


def test_a_forked_childs_close_keeps_the_parents_claim(file_target, loop_device):
    """A forked process shares its parent's open files, and a flock belongs
    to the open file, not the process: a child that closes its copy of a
    Device (README: a forked child's close() "only lets go of the copy")
    must not unlock the parent's store file, or the backing file of its
    loop device, for a second store to open while the parent writes."""
    path, dev = file_target(1 * MIB), loop_device(8 * MIB)
    from tests.support import loopdev

    backing = loopdev.backing_of(dev)
    held = [Device(path), Device(dev)]
    try:
        pid = os.fork()
        if pid == 0:                                 # the child: let go of its copies
            try:
                for d in held:
                    d.close()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        with pytest.raises(DeviceBusyError):
            Device(path, busy_timeout=0.1)
        with pytest.raises(DeviceBusyError):
            Device(backing, busy_timeout=0.1)
    finally:
        for d in held:
            d.close()
    with Device(path), Device(backing):              # the parent's close releases them
        pass


def test_a_blkid_that_cannot_tell_refuses(tmp_path, monkeypatch, file_target):
    """The probe fails closed: blkid failing (exit 4, or exit 2 with an
    error), hanging, or finding several signatures (exit 8, "ambivalent") is
    never "nothing found"."""
    from kvblock.devices import probe
    from kvblock.errors import UnsafeTargetError

    path = file_target(1 << 20)
    fake = tmp_path / "blkid"

    def blkid_exits(code):
        fake.write_text(f"#!/bin/sh\necho 'blkid: trouble' >&2\nexit {code}\n")
        fake.chmod(0o755)
        monkeypatch.setattr(probe.shutil, "which", lambda name: str(fake))
    fake.write_text("#!/bin/sh\nexit 2\n")      # nothing found: exit 2, nothing said
    fake.chmod(0o755)
    monkeypatch.setattr(probe.shutil, "which", lambda name: str(fake))
    assert probe.signatures(path) == {}
    blkid_exits(2)      # exit 2 with an error said: blkid could not read the device
    with pytest.raises(UnsafeTargetError, match="blkid -p could not read it .blkid: trouble"):
        probe.signatures(path)
    blkid_exits(8)
    found = probe.signatures(path)
    assert "several signatures" in probe.describe(found)
    blkid_exits(4)
    with pytest.raises(UnsafeTargetError, match="blkid -p failed .exit 4: blkid: trouble"):
        probe.signatures(path)


def test_a_device_blkid_cannot_open_is_not_empty(tmp_path):
    """blkid -p exits 2 both for "nothing found" and for a device it cannot
    open (saying so on stderr): a device node whose driver answers ENXIO
    was taken for an empty device, and formatting went ahead."""
    from kvblock.devices import probe
    from kvblock.errors import UnsafeTargetError

    with open("/proc/devices") as f:
        block = f.read().split("Block devices:")[1].split()
    used = {int(w) for w in block if w.isdigit()}
    major = next(m for m in range(240, 255) if m not in used)   # local/experimental
    node = tmp_path / "nodev"
    os.mknod(node, 0o600 | 0o060000, os.makedev(major, 7))      # S_IFBLK
    res = subprocess.run(["blkid", "-p", str(node)], capture_output=True, text=True)
    assert res.returncode == 2 and "No such device" in res.stderr
    with pytest.raises(UnsafeTargetError, match=rf"{node}: blkid -p could not read it "
                                                r".*No such device.*wipefs"):
        probe.signatures(str(node))


@pytest.fixture
def small_fs(tmp_path):
    """A directory on an 8 MiB tmpfs (unmounted afterwards)."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _free(path) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def test_create_file_too_big_leaves_nothing_behind(small_fs, monkeypatch):
    """A file larger than the filesystem's free space is refused before any
    space is reserved; when the reservation itself fails (the check passed,
    space went meanwhile), what it took is given back and a new file is
    removed.  An existing file keeps its size."""
    free = _free(small_fs)
    with pytest.raises(DeviceError, match="cannot reserve .* bytes are free") as e:
        create_file(small_fs / "kv.img", 64 * MIB)
    assert e.value.errno == errno.ENOSPC
    assert not (small_fs / "kv.img").exists() and _free(small_fs) == free

    real = os.fstatvfs
    monkeypatch.setattr(os, "fstatvfs", lambda fd: _Roomy(real(fd)))
    with pytest.raises(DeviceError, match="cannot reserve"):
        create_file(small_fs / "kv.img", 64 * MIB)
    assert not (small_fs / "kv.img").exists() and _free(small_fs) == free
    create_file(small_fs / "old.img", 1 * MIB)
    with pytest.raises(DeviceError, match="cannot reserve"):
        create_file(small_fs / "old.img", 64 * MIB)
    assert os.path.getsize(small_fs / "old.img") == 1 * MIB
    assert _free(small_fs) == free - 1 * MIB


class _Roomy:
    """An os.statvfs_result that reports plenty of free space."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return 1 << 40 if name == "f_bavail" else getattr(self._real, name)


def test_create_file_through_a_dangling_symlink_that_fails_keeps_the_link(small_fs, tmp_path):
    """A store path that is a symlink to a file not made yet (the file goes on
    another filesystem): a create that fails removes the file it made at the
    link's target, not the user's link."""
    link = tmp_path / "kv.img"
    link.symlink_to(small_fs / "kv.img")
    with pytest.raises(DeviceError, match="cannot reserve"):
        create_file(link, 64 * MIB)
    assert link.is_symlink() and os.readlink(link) == str(small_fs / "kv.img")
    assert not (small_fs / "kv.img").exists()
    assert create_file(link, 1 * MIB) == link and os.path.getsize(small_fs / "kv.img") == MIB


def test_a_dangling_symlink_into_a_missing_folder_gets_its_folders_made(tmp_path):
    """create_file makes the folders a new store file goes in; through a
    dangling symlink it made the link's (there already), not the target's,
    and failed ENOENT (exit 8: "choose another path").  The target's are
    made, and new_file's record of them is what a failed start removes."""
    from kvblock.devices.device import new_file, remove_made

    for make in (lambda link: create_file(link, MIB), lambda link: new_file(link, MIB)):
        link, target = tmp_path / "kv.img", tmp_path / "store" / "files" / "kv.img"
        link.symlink_to(target)
        try:
            made = make(link)
            assert link.is_symlink() and os.path.getsize(target) == MIB
        finally:
            link.unlink()
        if isinstance(made, list):            # new_file: the file, then its folders
            assert made == [str(target), str(target.parent), str(target.parent.parent)]
            remove_made(made)
            assert not (tmp_path / "store").exists()
        else:
            target.unlink()
            target.parent.rmdir()
            target.parent.parent.rmdir()


def test_create_file_where_it_cannot_be_made_is_a_device_error(tmp_path):
    """A store file that cannot be made (its folder is a file, the path a
    folder, the filesystem read-only) is a DeviceError naming the path, as
    opening a device is, not a bare OSError."""
    (tmp_path / "plain").write_bytes(b"")
    with pytest.raises(DeviceError, match=r"plain/kv.img: cannot create the store file: "
                                          r"ENOTDIR.*choose another path") as e:
        create_file(tmp_path / "plain" / "kv.img", MIB)
    assert e.value.errno == errno.ENOTDIR and e.value.path == str(tmp_path / "plain" / "kv.img")
    (tmp_path / "dir").mkdir()
    with pytest.raises(DeviceError, match=r"dir: cannot create the store file: EISDIR"):
        create_file(tmp_path / "dir", MIB)
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        with pytest.raises(DeviceError, match=r"ro/kv.img: cannot create the store file: EROFS"):
            create_file(ro / "kv.img", MIB)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    if os.geteuid() == 0:                    # a folder only root may enter, as nobody
        (tmp_path / "private").mkdir(mode=0o700)
        os.chmod(tmp_path, 0o755)
        code = ("import os, sys\nfrom kvblock.devices import create_file\n"
                "from kvblock.errors import DevicePermissionError\n"
                "os.setgid(65534); os.setuid(65534)\ntry:\n    create_file(sys.argv[1], 4096)\n"
                "except DevicePermissionError as e:\n    print('denied:', e)\n")
        out = subprocess.run([_python(), "-c", code, str(tmp_path / "private" / "kv.img")],
                             capture_output=True, text=True)
        assert "denied:" in out.stdout and "EACCES" in out.stdout, out.stderr


def test_create_file_on_a_block_device_is_refused_by_name(loop_device):
    """A block device is no file to create or grow (its st_size reads 0):
    posix_fallocate (ENODEV) and ftruncate failed on it with a bare EINVAL
    OSError, even for a size it has.  A typed error says to give it as it is, and
    leaves its bytes alone."""
    dev_path = loop_device(8 * MIB)
    with open(dev_path, "r+b") as f:
        f.write(b"\xab" * 4096)
    for size in (4 * MIB, 16 * MIB):
        with pytest.raises(UnsupportedDeviceError, match=rf"{dev_path}: a block device, not a "
                                                         r"file.*give it as the device") as e:
            create_file(dev_path, size)
        assert e.value.path == dev_path
    with open(dev_path, "rb") as f:
        assert f.read(4096) == b"\xab" * 4096
    with Device(dev_path) as dev:     # no fd left open on it
        assert dev.capacity == 8 * MIB


def test_create_file_on_a_character_device_or_fifo_is_refused_by_name(tmp_path):
    """Like a block device, a character device (/dev/null) or a FIFO is no
    file to create or grow: posix_fallocate failed on it and the ftruncate
    after it raised a bare EINVAL OSError, naming nothing.  A typed error
    names the path and what it is."""
    fifo = tmp_path / "kv.fifo"
    os.mkfifo(fifo)
    for path, what in (("/dev/null", "a character device"), (str(fifo), "a FIFO")):
        with pytest.raises(UnsupportedDeviceError, match=rf"{path}: {what}, not a file to "
                                                         r"create or grow") as e:
            create_file(path, 4096)
        assert e.value.path == path
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)        # left as it was


def test_a_block_devices_capacity_is_whole_logical_blocks(loop_device):
    """A loop device with 4 KiB sectors over a file of 16 MiB + 512 bytes
    reports 16 MiB + 512 bytes (BLKGETSIZE64 counts 512-byte sectors), but
    its partial last block cannot be read or written: the capacity is the
    whole logical blocks, as for a file, so the last block is at
    capacity - block_size."""
    from kvblock.io import IOBatch, open_engine
    from kvblock.memory import HostBuffer

    with Device(loop_device(16 * MIB + 512, sector_size=4096)) as dev, \
            open_engine([dev]) as eng, HostBuffer(4096) as buf:
        assert (dev.block_size, dev.capacity) == (4096, 16 * MIB)
        buf.array[:] = 7
        eng.write(IOBatch.single(buf.address, 0, dev.capacity - 4096, 4096))
        buf.array[:] = 0
        eng.read(IOBatch.single(buf.address, 0, dev.capacity - 4096, 4096))
        assert (buf.array == 7).all()


def test_a_store_formatted_on_a_partial_last_block_still_opens(loop_device, monkeypatch):
    """A store formatted before capacities were whole blocks recorded the
    device's size with its partial last block; it is not a shrunk device."""
    import dataclasses

    from kvblock import Geometry, KVStore

    geom = Geometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
    path = loop_device(64 * MIB + 512, sector_size=4096)
    probe = Device._probe

    def old_probe(self, st):      # the capacity as the kernel gives it
        return dataclasses.replace(probe(self, st), capacity=64 * MIB + 512)

    monkeypatch.setattr(Device, "_probe", old_probe)
    KVStore.format([path], geom, model="m").close()
    monkeypatch.setattr(Device, "_probe", probe)
    with KVStore.open([path], geometry=geom, model="m") as store:
        assert store.lookup([b"k" * 16]) == 0


def test_a_read_only_file_or_device_is_a_device_error_with_its_path(tmp_path, loop_device):
    """Opening a store file on a read-only filesystem, or a read-only block
    device, for writing raised a ReadOnlyStoreError with no .path or .errno
    (every other open failure is a DeviceError, an OSError naming the
    path); it is both now, and still read-only for the CLI (exit 17)."""
    from kvblock.cli.main import exit_code_for
    from kvblock.errors import ReadOnlyStoreError

    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ro)], check=True)
    try:
        create_file(ro / "kv.img", MIB)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        with pytest.raises(DeviceError, match=r"ro/kv.img: on a read-only filesystem") as e:
            Device(ro / "kv.img")
        assert isinstance(e.value, ReadOnlyStoreError) and exit_code_for(e.value) == 17
        assert e.value.errno == errno.EROFS and e.value.path == str(ro / "kv.img")
        with Device(ro / "kv.img", writable=False) as dev:    # reading it works
            assert dev.capacity == MIB
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    dev_path = loop_device(4 * MIB)
    subprocess.run(["blockdev", "--setro", dev_path], check=True)
    try:
        with pytest.raises(DeviceError, match="the device is read-only") as e:
            Device(dev_path)
        assert isinstance(e.value, ReadOnlyStoreError) and exit_code_for(e.value) == 17
        assert e.value.errno == errno.EROFS and e.value.path == dev_path
    finally:
        subprocess.run(["blockdev", "--setrw", dev_path], check=True)


def test_a_disk_and_its_partition_given_together_are_one_device_given_twice(
        partitioned_disk, loop_device):
    """A store given a whole disk and its partition (or a loop device over
    one and the other, or the file under a stack of loop devices and the
    top one) as two devices writes the same bytes through both: that is a
    device given twice (ConfigError, exit 8) before anything is opened,
    not a DeviceBusyError at the second open (nor, for a client that opens
    without O_EXCL, one store's bytes read out of place).  Two partitions
    of one disk, and loop devices over them, do not overlap."""
    from kvblock.devices import check_distinct
    from kvblock.errors import ConfigError
    from tests.support import loopdev

    disk, part = partitioned_disk()
    for pair in ((disk, part), (part, disk)):
        with pytest.raises(ConfigError, match="give each device once"):
            check_distinct(pair)
    with _loop_over(part) as over_part, _loop_over(disk) as over_disk:
        for pair in ((over_part, disk), (disk, over_part), (over_disk, part),
                     (part, over_disk), (over_part, over_disk)):
            with pytest.raises(ConfigError, match="give each device once"):
                check_distinct(pair)
    lower = loop_device(8 * MIB)
    backing = loopdev.backing_of(lower)
    with _loop_over(lower) as mid, _loop_over(mid) as top:
        for pair in ((top, backing), (backing, top), (top, lower)):
            with pytest.raises(ConfigError, match="give each device once"):
                check_distinct(pair)
    name = os.path.basename(disk)
    subprocess.run(["delpart", disk, "1"], check=True)
    subprocess.run(["addpart", disk, "1", "2048", "4096"], check=True)
    subprocess.run(["addpart", disk, "2", "8192", "4096"], check=True)
    second = f"/dev/{name}p2"
    made = not os.path.exists(second)
    if made:
        major, minor = map(int, open(f"/sys/block/{name}/{name}p2/dev").read().split(":"))
        os.mknod(second, 0o600 | stat.S_IFBLK, os.makedev(major, minor))
    try:
        check_distinct([part, second])              # two partitions: distinct
        with _loop_over(part) as a, _loop_over(second) as b:
            check_distinct([a, b])
            with Device(a), Device(b):               # and both open to write
                pass
        with Device(part), Device(second):           # each claims the file shared
            with pytest.raises(DeviceBusyError):
                Device(loopdev.backing_of(disk), busy_timeout=0.1)
    finally:
        if made:
            os.unlink(second)


def test_loop_devices_over_disjoint_ranges_of_one_file_are_refused_for_what_they_are(
        loop_device):
    """Two loop devices over disjoint byte ranges of one file (losetup
    --offset/--sizelimit) given to one store were refused as "the same
    device; give each device once": neither is true of two devices that
    share no byte, and no fix was named.  kvblock claims a loop device's
    whole backing file (as a second store would be refused, busy), so they
    are still one device to it, but the message now says why and what to do."""
    from kvblock.devices import check_distinct
    from kvblock.errors import ConfigError
    from tests.support import loopdev

    loop_device(MIB)                          # skips (fails, under make test) without root
    with loopdev.backing_file(16 * MIB) as backing:
        made = []
        try:
            for offset in (0, 8 * MIB):
                made.append(subprocess.run(
                    ["losetup", "-f", "--show", "--direct-io=on", "--offset", str(offset),
                     "--sizelimit", str(8 * MIB), str(backing)],
                    capture_output=True, text=True, check=True).stdout.strip())
            with pytest.raises(ConfigError) as e:
                check_distinct(made)
            assert f"{made[0]} and {made[1]} are loop devices over one file, {backing}" \
                in str(e.value) and "--offset" in str(e.value)
            assert "same device" not in str(e.value) and "own file" in str(e.value)
            with Device(made[0]):             # and a second store on the other: busy
                with pytest.raises(DeviceBusyError, match=f"loop device over {backing}"):
                    Device(made[1], busy_timeout=0.1)
        finally:
            for dev in made:
                subprocess.run(["losetup", "-d", dev], check=True)


def test_a_partition_of_a_loop_device_claims_the_loop_devices_backing(
        partitioned_disk, loop_device, tmp_path):
    """A partition of a loop device (losetup -P) writes the loop device's
    backing file as the loop device does: opening it to write is refused
    while a store holds that file, or while the block device under the loop
    device is mounted; a store on the partition holds the file meanwhile;
    and the file and the partition given together are one device given
    twice (ConfigError)."""
    from kvblock.devices import check_distinct
    from kvblock.errors import ConfigError
    from tests.support import loopdev

    disk, part = partitioned_disk()
    backing = loopdev.backing_of(disk)
    with pytest.raises(ConfigError, match="give each device once"):
        check_distinct([backing, part])
    with Device(backing):
        with pytest.raises(DeviceBusyError, match=f"over {backing}"):
            Device(part, busy_timeout=0.1)
    with Device(part):
        with pytest.raises(DeviceBusyError):
            Device(backing, busy_timeout=0.1)
    with Device(part), Device(backing, writable=False, exclusive=False):
        pass                                       # read-only peeks stay possible
    lower = loop_device(32 * MIB)
    upper = loopdev.attach(lower, partscan=True)
    name, made = os.path.basename(upper), None
    try:
        subprocess.run(["addpart", upper, "1", "2048", "4096"], check=True)
        upart = f"/dev/{name}p1"
        if not os.path.exists(upart):
            major, minor = map(int, open(f"/sys/block/{name}/{name}p1/dev").read().split(":"))
            os.mknod(upart, 0o600 | stat.S_IFBLK, os.makedev(major, minor))
            made = upart
        with _mounted(lower, tmp_path / "mnt"):
            with pytest.raises(DeviceBusyError, match=f"over {lower}.*busy"):
                Device(upart, busy_timeout=0.1)
        with Device(upart):                         # unmounted: free again
            pass
    finally:
        if made:
            os.unlink(made)
        loopdev.detach(upper)


def test_a_partition_of_a_loop_device_over_a_block_device_holds_that_device(
        loop_device, tmp_path):
    """A store on a partition of loop device U over block device L writes
    L's bytes: L must stay claimed while the store is open, so a mount of
    L (or any exclusive opener) is refused meanwhile, as it is for a store
    on U itself; a second partition of U (a sibling, which writes other
    bytes of L) still opens beside it."""
    from tests.support import loopdev

    lower = loop_device(32 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", lower], check=True)
    upper = loopdev.attach(lower, partscan=True)
    name, made = os.path.basename(upper), []
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        subprocess.run(["addpart", upper, "1", "2048", "4096"], check=True)
        subprocess.run(["addpart", upper, "2", "8192", "4096"], check=True)
        parts = []
        for n in (1, 2):
            p = f"/dev/{name}p{n}"
            if not os.path.exists(p):
                major, minor = map(int, open(f"/sys/block/{name}/{name}p{n}/dev").read().split(":"))
                os.mknod(p, 0o600 | stat.S_IFBLK, os.makedev(major, minor))
                made.append(p)
            parts.append(p)
        first = Device(parts[0])
        try:
            mount = subprocess.run(["mount", lower, str(mnt)], capture_output=True, text=True)
            if mount.returncode == 0:
                subprocess.run(["umount", str(mnt)], check=True)
            assert mount.returncode != 0, f"{lower} mounted under a store on {parts[0]}"
            with Device(parts[1]):                  # a sibling opens beside it
                with pytest.raises(OSError) as e:   # and the lower device stays held
                    os.close(os.open(lower, os.O_RDONLY | os.O_EXCL))
                assert e.value.errno == errno.EBUSY
        finally:
            first.close()
        os.close(os.open(lower, os.O_RDONLY | os.O_EXCL))   # both closed: free again
    finally:
        for p in made:
            os.unlink(p)
        loopdev.detach(upper)


def test_an_open_interrupted_while_waiting_for_the_backing_files_lock_leaks_nothing(
        loop_device, monkeypatch):
    """Opening a loop device whose backing file another store holds waits
    (busy_timeout) for that file's lock; a Ctrl-C (or any error) meanwhile
    must close the backing file it opened, not leave it open in a process
    that lives on."""
    from tests.support import loopdev

    dev = loop_device(8 * MIB)
    backing = loopdev.backing_of(dev)

    def open_backing():
        return sorted(fd for fd in os.listdir("/proc/self/fd")
                      if os.path.realpath(f"/proc/self/fd/{fd}") == backing)

    with Device(backing):
        held = open_backing()
        import time

        def interrupted(_):
            raise KeyboardInterrupt
        monkeypatch.setattr(time, "sleep", interrupted)
        with pytest.raises(KeyboardInterrupt):
            Device(dev, busy_timeout=5)
        monkeypatch.undo()
        assert open_backing() == held


def test_busy_names_the_process_holding_a_partition_or_its_disk(partitioned_disk):
    """A whole disk is busy while a store holds one of its partitions (and
    a partition while one holds the disk): the error names that process
    (README: exit 5 "naming the processes that hold it"), though it has
    the other device node open, not the one refused."""
    import sys

    disk, part = partitioned_disk()
    for held, refused in ((part, disk), (disk, part)):
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\nfrom kvblock.devices import Device\n"
             "held = Device(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(60)", held],
            stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline() == "ready\n"
            with pytest.raises(DeviceBusyError, match=f"held by pid {holder.pid}: .*python"):
                Device(refused, busy_timeout=0.1)
        finally:
            holder.kill()
            holder.wait()
            holder.stdout.close()


def test_a_sibling_partition_does_not_open_over_a_mounted_block_device(loop_device, tmp_path):
    """Partitions p1, p2, p3 of loop device U over block device L: the store
    on p1 holds L (O_EXCL), p2's opens beside it (a sibling's flock).  Once
    p1's store closes first, L is no longer claimed (the gap noted in
    _claim_shared) and can be mounted; a store on p3 must then not take
    the siblings' flock on L for a sibling's claim and write the mounted
    filesystem's bytes: it is refused as busy, as with no sibling open."""
    from tests.support import loopdev

    lower = loop_device(32 * MIB)
    subprocess.run(["mkfs.ext4", "-q", "-F", lower], check=True)
    upper = loopdev.attach(lower, partscan=True)
    name, made = os.path.basename(upper), []
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        parts = []
        for n, start in ((1, 2048), (2, 8192), (3, 14336)):
            subprocess.run(["addpart", upper, str(n), str(start), "4096"], check=True)
            p = f"/dev/{name}p{n}"
            if not os.path.exists(p):
                major, minor = map(int, open(f"/sys/block/{name}/{name}p{n}/dev").read().split(":"))
                os.mknod(p, 0o600 | stat.S_IFBLK, os.makedev(major, minor))
                made.append(p)
            parts.append(p)
        first = Device(parts[0])
        with Device(parts[1]):
            first.close()
            mount = subprocess.run(["mount", lower, str(mnt)], capture_output=True, text=True)
            if mount.returncode == 0:           # (refused once the gap is closed: fine too)
                try:
                    with pytest.raises(DeviceBusyError, match=f"over {lower}, which is busy"):
                        Device(parts[2], busy_timeout=0.1).close()
                finally:
                    subprocess.run(["umount", str(mnt)], check=True)
        with Device(parts[2]):                  # unmounted: free again
            pass
    finally:
        for p in made:
            os.unlink(p)
        loopdev.detach(upper)


def test_a_close_that_fails_is_not_repeated_on_a_reused_number(tmp_path, monkeypatch):
    """Device.close() closed its descriptor and only then forgot it: a close
    that raised (EIO from an NFS or FUSE close) left the number recorded,
    and a later close() closed it again, by then possibly another file's
    descriptor.  The number is forgotten first."""
    path = tmp_path / "dev.img"
    create_file(path, 1 << 20)
    dev = Device(str(path))
    fd = dev.fd
    real, calls = os.close, []

    def failing(n):
        calls.append(n)
        real(n)
        if n == fd and calls.count(fd) == 1:
            raise OSError(errno.EIO, "close failed")
    monkeypatch.setattr(os, "close", failing)
    with pytest.raises(OSError, match="close failed"):
        dev.close()
    dev.close()                            # nothing more to close
    assert calls.count(fd) == 1 and dev.closed


def test_new_file_under_a_file_keeps_its_error_not_the_cleanups(tmp_path):
    """new_file at a path whose folder is a file (kvblock format
    plain/kv.img --size 8M): create_file's typed error (ENOTDIR, naming the
    fix) was replaced by its cleanup's bare NotADirectoryError from
    unlinking a file that was never made: exit 1, no fix (on a read-only
    filesystem EROFS, as bare)."""
    from kvblock.devices.device import new_file

    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(DeviceError, match=r"plain/kv.img: cannot create the store file: "
                                          r"ENOTDIR.*choose another path") as e:
        new_file(tmp_path / "plain" / "kv.img", MIB)
    assert e.value.errno == errno.ENOTDIR
    assert (tmp_path / "plain").read_bytes() == b"x"


def test_a_lock_no_process_is_seen_holding_is_waited_for_past_busy_timeout(file_target):
    """A process killed with a store open lets go of its file's flock only
    once the kernel has torn down its io_uring, after the process is reaped
    (seconds on a loaded machine: a store reopened after a SIGKILL was
    refused, 'locked by another kvblock store' naming nobody).  Such a lock,
    held by an open file no process has a descriptor of (here: a mapping of
    it, its descriptor closed), is waited for past busy_timeout; one a
    process is seen holding is not."""
    import ctypes
    import fcntl
    import mmap
    import threading

    path = file_target(1 * MIB)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # a mapping holds the open file (and its lock) past the close, with no
    # descriptor anywhere (Python's mmap keeps a dup: libc's here)
    addr = libc.mmap(None, MIB, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    os.close(fd)
    unmapped = []

    def unmap():
        if not unmapped:
            unmapped.append(libc.munmap(addr, MIB))

    let_go = threading.Timer(1.0, unmap)
    let_go.start()
    try:
        t0 = time.monotonic()
        with Device(path, busy_timeout=0.2):
            waited = time.monotonic() - t0
        assert waited >= 0.9, waited         # (it waited for the lock, not past it)
    finally:
        let_go.cancel()
        let_go.join()
        unmap()
    # held by an open descriptor of this process (another store here): no wait
    with Device(path):
        t0 = time.monotonic()
        with pytest.raises(DeviceBusyError, match="locked by another kvblock store"):
            Device(path, busy_timeout=0.2)
        assert time.monotonic() - t0 < 5
