"""The admin CLI on real loop devices: safe by default, one-line errors with
distinct exit codes, and the device left as it was on every refusal."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from kvblock import KVStore
from tests.store.workload import run_data, run_keys
from tests.support import loopdev

GEOM_ARGS = ["--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--dtype", "float16",
             "--block-tokens", "16", "--head-groups", "2"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kvb(*args, user=None, timeout=60, process=False):
    """Run ``kvblock ARGS``: in this process through click's runner (exit
    code, stdout and stderr as a subprocess gives them), or as a process of
    its own for ``user`` (another uid) or ``process=True``."""
    if not (user or process):
        from click.testing import CliRunner

        from kvblock.cli.main import cli

        res = CliRunner().invoke(cli, [str(a) for a in args], prog_name="kvblock")
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            raise res.exception
        return subprocess.CompletedProcess(args, res.exit_code, res.stdout, res.stderr)
    cmd = [sys.executable, "-m", "kvblock", *map(str, args)]
    if user:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def one_line_error(res, code, *fragments):
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("kvblock: error: "), res.stderr
    for f in fragments:
        assert f in lines[-1], (f, lines[-1])


def _default_sigint():
    """Ctrl-C reaches the child even when this test run itself ignores SIGINT
    (a job started in the background by a non-interactive shell, as CI may be):
    Python only installs its KeyboardInterrupt handler if SIGINT is not ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_until_open(pid, path, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            return
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    return
            except OSError:
                pass
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never opened {path}")


def head(path, n=1 << 20):
    with open(path, "rb") as f:
        return f.read(n)


def formatted(path):
    res = kvb("format", path, *GEOM_ARGS, "--yes", "--region-size", "256K", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_format_info_ls_fsck_on_loop_device(loop_device):
    dev = loop_device(16 << 20)
    info = formatted(dev)
    assert info["geometry"].startswith("2 layers x 2 kv heads x 32 float16")
    with KVStore.open([dev]) as store:
        for i in range(3):
            store.put_run(run_keys(i, 2), run_data(run_keys(i, 2)))
    res = kvb("info", dev, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["runs"] == 3 and out["blocks"] == 6 and out["state"] == "clean"
    assert out["uuid"] == info["uuid"]
    assert out["reads"].startswith("#0 ") and out["reads"].endswith(", direct I/O"), out
    # a volatile cache (what a loop device reports), which every commit
    # flushes, and none (a drive with power-loss protection) are told apart
    # (tests/support/loopdev.py sets the minor's mode back)
    for mode, said in (("write through", "write through (flushes complete at once)"),
                       ("write back", "write back (volatile: every commit waits for it "
                                      "to flush)")):
        with open(f"/sys/block/{os.path.basename(dev)}/queue/write_cache", "w") as f:
            f.write(mode)
        out = json.loads(kvb("info", dev, "--json").stdout)
        assert out["write_cache"] == f"#0 {said}", out
    backing = loopdev.backing_of(dev)       # a file in /dev/shm: info says to use it instead
    assert out["hint"].startswith(f"{dev} is a loop device over {backing} on tmpfs"), out
    res = kvb("ls", dev, "--json", "--limit", "2")
    rows = json.loads(res.stdout)
    assert rows["total_runs"] == 3 and len(rows["runs"]) == 2
    assert rows["runs"][0]["blocks"] == 2 and rows["runs"][0]["device"] == dev
    res = kvb("fsck", dev, "--deep", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["status"] == "clean", res.stdout
    for human in (kvb("info", dev), kvb("ls", dev)):
        assert human.returncode == 0 and "error" not in human.stderr
    # piped, the tables are not cut to 80 columns: offsets and hints stay whole
    assert f" {rows['runs'][0]['offset']} " in kvb("ls", dev).stdout
    assert backing in kvb("info", dev).stdout.replace("\n", "")


def test_ls_shows_no_hits_or_pins_it_cannot_see(file_target):
    """ls opens the devices itself: hits and pins live in the process that
    holds the store (and are never written down), so its "hits" and
    "pinned" columns said 0 and false for a run that process had read three
    times and pinned."""
    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS, "--region-size", "256K")
    keys = run_keys(0, 2)
    with KVStore.open([path]) as store:
        store.put_run(keys, run_data(keys))
        out = np.empty_like(run_data(keys))
        for _ in range(3):
            assert store.get_run(keys, out) == 2
        store.pin(keys)
        res = kvb("ls", path, "--json")
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(res.stdout)["runs"]
    assert row["blocks"] == 2 and row["device"] == path
    assert "hits" not in row and "pinned" not in row, row
    header = kvb("ls", path).stdout.splitlines()[2]     # under the title and the rule
    assert "first_key" in header and "hits" not in header and "pinned" not in header


def test_ls_says_how_many_of_a_runs_blocks_are_still_served(file_target):
    """A run partly superseded by a newer one (a key stored again) showed
    all its blocks, so ls's blocks added up to more than info's; "live"
    says how many of them the store still serves from it."""
    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS, "--region-size", "256K")
    keys = run_keys(0, 3)
    with KVStore.open([path]) as store:
        store.put_run(keys, run_data(keys))
        again = keys[2:] + run_keys(9, 1)
        store.put_run(again, run_data(again))      # takes over keys[2]
    res = kvb("ls", path, "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["runs"]
    assert [(r["blocks"], r["live"]) for r in rows] == [(3, 2), (2, 2)]
    info = json.loads(kvb("info", path, "--json").stdout)
    assert sum(r["live"] for r in rows) == info["blocks"] == 4
    assert "live" in kvb("ls", path).stdout.splitlines()[2]


def test_ls_first_key_is_the_first_key_a_run_still_serves(file_target):
    """A run whose first position a newer run took over (its key stored
    again) showed first_key 000...0: a checkpoint zeroes superseded
    positions, and zero reads as a key.  ls names the first key the run
    still serves."""
    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS, "--region-size", "256K")
    keys = run_keys(0, 3)
    with KVStore.open([path]) as store:
        store.put_run(keys, run_data(keys))
        again = keys[:1] + run_keys(9, 1)
        store.put_run(again, run_data(again))      # takes over keys[0]
    res = kvb("ls", path, "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["runs"]
    from kvblock.index import normalize_keys

    assert [(r["live"], r["first_key"]) for r in rows] == \
        [(2, normalize_keys(keys)[1].hex()), (2, normalize_keys(again)[0].hex())]


def test_format_refuses_ext4(loop_device):
    dev = loop_device(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "precious", dev], check=True)
    before = head(dev)
    res = kvb("format", dev, *GEOM_ARGS, "--yes")
    one_line_error(res, 16, dev, "a filesystem (ext4 labelled 'precious')", "--force")
    assert head(dev) == before


def test_info_of_a_filesystem_says_what_the_device_holds(file_target, tmp_path):
    """A device that holds a filesystem is no store: the read-only commands
    say what it holds, not "not formatted" (exit 11); so do the commands
    that open the store to write it (serve said "no kvblock superblock at
    offset 0 (not formatted, or overwritten)"), and leave it as it was."""
    path = file_target(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "precious", path], check=True)
    one_line_error(kvb("info", path), 11, path, "a filesystem (ext4 labelled 'precious')")
    res = kvb("fsck", path, "--json")
    assert res.returncode == 11
    assert "a filesystem (ext4 labelled 'precious')" in json.loads(res.stdout)["problems"][0]
    before = head(path, 16 << 20)
    sock = tmp_path / "kv.sock"
    for args in (("serve", path, "--socket", sock), ("evict", path, "--all"), ("trim", path)):
        one_line_error(kvb(*args), 11, path, "a filesystem (ext4 labelled 'precious')")
    assert head(path, 16 << 20) == before and not sock.exists()


def _stale_fat_boot_sector(dev):
    """A FAT16 boot sector in bytes 0..511 (ext4 leaves its first 1 KiB
    alone): what an old filesystem leaves behind."""
    import struct

    bs = bytearray(512)
    bs[0:3], bs[3:11] = b"\xeb\x3c\x90", b"MSDOS5.0"
    struct.pack_into("<HBHBHHBHHHII", bs, 11, 512, 4, 1, 2, 512, 0, 0xF8, 64, 32, 64, 0, 65536)
    bs[36], bs[38], bs[39:43] = 0x80, 0x29, b"\x12\x34\x56\x78"
    bs[43:54], bs[54:62], bs[510:512] = b"NO NAME    ", b"FAT16   ", b"\x55\xaa"
    with open(dev, "r+b") as f:
        f.write(bs)


def test_format_refuses_a_filesystem_beside_a_stale_signature(loop_device):
    """blkid -p exits 8 ("ambivalent") when it finds more than one signature,
    e.g. ext4 beside an old FAT boot sector.  That is data: refused by the
    CLI and by the integrations' format "if-empty", the filesystem intact."""
    from kvblock.errors import UnsafeTargetError
    from kvblock.layout import Geometry
    from kvblock.store.provision import open_or_format

    dev = loop_device(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-L", "precious", dev], check=True)
    _stale_fat_boot_sector(dev)
    assert subprocess.run(["blkid", "-p", dev], capture_output=True).returncode == 8
    before = head(dev)
    res = kvb("format", dev, *GEOM_ARGS, "--yes")
    one_line_error(res, 16, dev, "several signatures", "wipefs", "--force")
    with pytest.raises(UnsafeTargetError, match="several signatures"):
        open_or_format([dev], Geometry(2, 2, 32, dtype="float16"), "m")
    assert head(dev) == before
    fsck = subprocess.run(["e2fsck", "-n", dev], capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_format_refuses_a_store_of_another_release(file_target):
    """A store whose superblocks carry another format version is still a
    store: `info` says so (exit 12), and neither `format` nor
    KVStore.format overwrites it without force."""
    import struct

    from kvblock import Geometry, KVStore
    from kvblock.errors import FormatError
    from kvblock.format import FORMAT_VERSION
    from kvblock.format import superblock as sbfmt
    from kvblock.format.checksum import meta_checksum

    path = file_target(16 << 20)
    formatted(path)
    with open(path, "r+b") as f:
        for off in sbfmt.COPY_OFFSETS:
            f.seek(off)
            sb = bytearray(f.read(4096))
            struct.pack_into("<I", sb, 8, FORMAT_VERSION + 1)       # a later format
            struct.pack_into("<Q", sb, 4088, meta_checksum(bytes(sb[:4088])))
            f.seek(off)
            f.write(sb)
    before = head(path)
    assert kvb("info", path).returncode == 12
    res = kvb("format", path, *GEOM_ARGS, "--yes")
    one_line_error(res, 16, "a kvblock store of another kvblock release", "--force")
    with pytest.raises(FormatError, match="another kvblock release"):
        KVStore.format([path], Geometry(2, 2, 32, dtype="float16"))
    assert head(path) == before


def test_a_store_a_newer_release_began_to_upgrade_is_refused_and_never_downgraded(
        file_target):
    """Copy B of the superblock valid with a newer format version (a later
    release upgrading the store in place, cut short between its copies)
    and copy A of this version: the store opened by copy A and fsck
    --repair wrote copy A over the newer copy.  The open, info and fsck
    (with --repair too) refuse it as a newer release's (exit 12), naming
    the device, both versions and the fix; the newer copy is left as is."""
    import struct

    from kvblock import KVStore
    from kvblock.errors import UnsupportedVersionError
    from kvblock.format import FORMAT_VERSION
    from kvblock.format import superblock as sbfmt
    from kvblock.format.checksum import meta_checksum

    path = file_target(16 << 20)
    formatted(path)
    with open(path, "r+b") as f:
        f.seek(sbfmt.COPY_OFFSETS[1])
        sb = bytearray(f.read(sbfmt.SIZE))
        struct.pack_into("<I", sb, 8, FORMAT_VERSION + 1)      # a later format
        struct.pack_into("<Q", sb, 184, 2)                      # its sequence, past A's
        struct.pack_into("<Q", sb, 4088, meta_checksum(bytes(sb[:4088])))
        f.seek(sbfmt.COPY_OFFSETS[1])
        f.write(sb)
    before = head(path)
    with pytest.raises(UnsupportedVersionError) as ei:
        KVStore.open([path])
    msg = str(ei.value)
    assert path in msg and "upgrade kvblock" in msg
    assert f"format version {FORMAT_VERSION + 1}" in msg and f"version {FORMAT_VERSION}" in msg
    assert kvb("info", path).returncode == 12
    for args in (["fsck", path], ["fsck", "--repair", path]):
        res = kvb(*args)
        assert res.returncode == 12, (args, res.stdout, res.stderr)
        assert "unusable" in res.stdout and "upgrade kvblock" in res.stdout
    assert head(path) == before


def test_format_refuses_partition_table(loop_device):
    dev = loop_device(32 << 20)
    subprocess.run(["sfdisk", "-q", dev], input="label: gpt\n,,L\n", text=True, check=True,
                   capture_output=True)
    res = kvb("format", dev, *GEOM_ARGS, "--yes")
    one_line_error(res, 16, "partition table (gpt)")


def test_format_takes_an_empty_partition(loop_device):
    """A partition never written holds no signature (blkid -p reports only
    its entry in the disk's table): format takes it without --force, and
    refuses it once it holds a filesystem."""
    dev = loop_device(32 << 20)
    subprocess.run(["sfdisk", "-q", dev], input="label: gpt\n,,L\n", text=True, check=True,
                   capture_output=True)
    with _partition_node(dev) as part:
        probe = subprocess.run(["blkid", "-p", "-o", "export", part], capture_output=True,
                               text=True)
        assert "PART_ENTRY_TYPE" in probe.stdout and "\nTYPE=" not in probe.stdout
        res = kvb("format", part, *GEOM_ARGS, "--yes", "--json")
        assert res.returncode == 0, res.stderr
        with KVStore.open([part]) as store:
            assert 0 < store.stats()["capacity_bytes"] < 32 << 20
        subprocess.run(["mkfs.ext4", "-q", "-F", part], check=True)
        one_line_error(kvb("format", part, *GEOM_ARGS, "--yes"), 16, "a filesystem (ext4)")
    # a BIOS boot partition holds a boot loader without any signature: not free
    subprocess.run(["sfdisk", "-q", dev], input="label: gpt\n,,21686148-6449-6E6F-744E-"
                   "656564454649\n", text=True, check=True, capture_output=True)
    with _partition_node(dev) as part:
        subprocess.run(["wipefs", "-a", "-q", part], check=True)
        res = kvb("format", part, *GEOM_ARGS, "--yes")
        one_line_error(res, 16, "a system partition (partition type 21686148",
                       "pass --force once you know it is free")
        assert "wipefs" not in res.stderr          # it has no signature to wipe


@contextlib.contextmanager
def _partition_node(dev):
    """/dev/loopNp1 of a partitioned loop device (made by hand: no udev here)."""
    subprocess.run(["losetup", "-P", "-c", dev], check=False)   # the kernel re-reads the table
    subprocess.run(["partx", "-u", dev], check=False, capture_output=True)
    name = os.path.basename(dev)
    sys_part = f"/sys/block/{name}/{name}p1/dev"
    deadline = time.monotonic() + 5
    while not os.path.exists(sys_part):
        subprocess.run(["partx", "-a", dev], check=False, capture_output=True)
        assert time.monotonic() < deadline, f"{dev}: the kernel did not add partition 1"
        time.sleep(0.1)
    node, made = f"/dev/{name}p1", False
    if not os.path.exists(node):
        major, minor = map(int, open(sys_part).read().split(":"))
        os.mknod(node, 0o600 | stat.S_IFBLK, os.makedev(major, minor))
        made = True
    try:
        yield node
    finally:
        subprocess.run(["partx", "-d", dev], check=False, capture_output=True)
        if made:
            os.unlink(node)


def test_format_refuses_mounted_device(loop_device, tmp_path):
    dev = loop_device(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", dev, str(mnt)], check=True)
    try:
        res = kvb("format", dev, *GEOM_ARGS, "--yes", "--force")
        one_line_error(res, 5, dev, "busy", "unmount")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@contextlib.contextmanager
def _mounted_ext4(loop_device, tmp_path):
    """A loop device with an ext4 mounted on it: (device, backing file)."""
    dev = loop_device(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", dev], check=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", dev, str(mnt)], check=True)
    try:
        yield dev, loopdev.backing_of(dev)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("command", [("fsck",), ("fsck", "--repair"), ("trim",),
                                     ("evict", "--all")])
def test_store_commands_on_a_mounted_device_say_to_unmount_it(loop_device, tmp_path, command):
    """fsck, trim and evict on a mounted block device replaced the device's
    own advice ('unmount it') with a store server's ('stop the store server
    ... or evict through it'), though a mount is no process to stop."""
    with _mounted_ext4(loop_device, tmp_path) as (dev, _):
        res = kvb(*command, dev)
        one_line_error(res, 5, dev, "busy", "unmount it")
        assert "kvblock serve" not in res.stderr, res.stderr


def test_format_refuses_the_backing_file_of_a_mounted_loop_device(loop_device, tmp_path):
    """A loop device and its backing file are one device: the file under a
    mounted filesystem is busy, even with --force (which overrides
    signatures, never a mount)."""
    with _mounted_ext4(loop_device, tmp_path) as (dev, backing):
        before = head(backing)
        res = kvb("format", backing, *GEOM_ARGS, "--force")
        one_line_error(res, 5, backing, dev, "busy", "unmount")
        assert head(backing) == before


def test_format_refuses_a_second_loop_device_over_a_mounted_ones_file(loop_device, tmp_path):
    """Two loop devices over one file are one device too: the second is
    busy while the first is mounted."""
    with _mounted_ext4(loop_device, tmp_path) as (dev, backing):
        second = loopdev.attach(backing)
        try:
            before = head(backing)
            res = kvb("format", second, *GEOM_ARGS, "--force", "--yes")
            one_line_error(res, 5, second, dev, "busy", "unmount")
            assert head(backing) == before
        finally:
            loopdev.detach(second)


def test_format_refuses_existing_store_and_block_device_needs_yes(loop_device):
    dev = loop_device(16 << 20)
    res = kvb("format", dev, *GEOM_ARGS)
    assert res.returncode == 2 and "needs --yes" in res.stderr
    assert head(dev, 8192) == bytes(8192)
    uuid = formatted(dev)["uuid"]
    before = head(dev)
    res = kvb("format", dev, *GEOM_ARGS, "--yes")
    one_line_error(res, 16, f"already holds kvblock store {uuid}", "2 layers x 2 kv heads")
    assert head(dev) == before
    res = kvb("format", dev, *GEOM_ARGS, "--yes", "--force", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["uuid"] != uuid


def test_format_with_size_creates_missing_store_files_only(tmp_path, file_target):
    """--size creates a missing store file with its space reserved; an
    existing file keeps its size; a format that fails removes the file it
    created (and never one that was there)."""
    new = tmp_path / "sub" / "kv.img"
    res = kvb("format", new, *GEOM_ARGS, "--size", "24M", "--json")
    assert res.returncode == 0, res.stderr
    st = os.stat(new)
    assert st.st_size == 24 << 20 and st.st_blocks * 512 >= 24 << 20     # reserved, not sparse
    out = json.loads(kvb("info", new, "--json").stdout)
    assert out["devices"] == f"#0 {new} (file, {24 << 20} bytes)", out
    old = file_target(20 << 20)
    res = kvb("format", old, *GEOM_ARGS, "--size", "64M", "--json")
    assert res.returncode == 0, res.stderr
    assert os.path.getsize(old) == 20 << 20
    small = tmp_path / "small.img"
    res = kvb("format", small, *GEOM_ARGS, "--size", "1M")
    one_line_error(res, 7, str(small), "--size 1048576 is too small")
    assert not small.exists()
    small = tmp_path / "made" / "for" / "small.img"      # and the folders it made for it
    res = kvb("format", small, *GEOM_ARGS, "--size", "1M")
    one_line_error(res, 7, str(small), "--size 1048576 is too small")
    assert not (tmp_path / "made").exists()
    kept = file_target(1 << 20)
    res = kvb("format", kept, *GEOM_ARGS, "--size", "64M")
    one_line_error(res, 7, str(kept), "cannot hold metadata")
    assert os.path.getsize(kept) == 1 << 20


def test_format_with_size_creates_the_file_a_dangling_symlink_names(tmp_path):
    """A link to a store file not made yet (a stable name an operator set
    up) is a DEV that does not exist: --size creates the file at its target,
    as bench --size and the integrations' size do.  format alone took the
    link for an existing device and failed (exit 3) with the advice to
    create the file with `kvblock format FILE --size SIZE`, what was run.
    A format that fails removes the file it made and keeps the link."""
    link, target = tmp_path / "kv-link.img", tmp_path / "kv.img"
    link.symlink_to(target)
    res = kvb("format", link, *GEOM_ARGS, "--size", "24M", "--json")
    assert res.returncode == 0, res.stderr
    assert os.path.islink(link) and os.path.getsize(target) == 24 << 20
    assert json.loads(kvb("info", link, "--json").stdout)["uuid"] == json.loads(res.stdout)["uuid"]
    small_link, small = tmp_path / "small-link.img", tmp_path / "small.img"
    small_link.symlink_to(small)
    one_line_error(kvb("format", small_link, *GEOM_ARGS, "--size", "1M"), 7, str(small_link),
                   "--size 1048576 is too small")
    assert not os.path.lexists(small) and os.path.islink(small_link)


def test_size_never_creates_a_store_file_on_dev():
    """A mistyped device name with --size (/dev/nvme0n2 for /dev/nvme1n1) made
    a store file on /dev's devtmpfs, memory the kernel's device nodes live
    in, and format, bench and selfcheck went on writing it.  It is refused
    as the missing device it is (exit 3), and nothing is created."""
    if os.stat("/dev").st_dev == os.stat("/").st_dev:
        pytest.skip("/dev is no filesystem of its own here")
    typo = f"/dev/kvblock-typo-{os.getpid()}"
    deep = f"/dev/disk/kvblock-typo-{os.getpid()}/nvme0n1"
    try:
        for res in (kvb("format", typo, *GEOM_ARGS, "--size", "8M", "--json"),
                    kvb("format", deep, *GEOM_ARGS, "--size", "8M"),
                    kvb("bench", typo, "--size", "8M", "--seconds", "0.1", "--json"),
                    kvb("selfcheck", "--path", typo, "--size", "8M")):
            one_line_error(res, 3, typo if typo in res.args else deep, "no such device",
                           "lsblk")
            assert res.stdout == ""
            assert not os.path.lexists(typo) and not os.path.lexists(os.path.dirname(deep))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(typo)
        subprocess.run(["rm", "-rf", os.path.dirname(deep)], check=False)


def test_size_never_creates_a_store_file_on_dev_through_a_symlink(tmp_path):
    """A link (e.g. a udev-style name the operator made) to a missing /dev
    name was followed: create_file looked only at the link's own folder and
    made the store file on /dev's devtmpfs.  It is refused as the missing
    device it names (exit 3), and nothing is created at the target."""
    if os.stat("/dev").st_dev == os.stat("/").st_dev:
        pytest.skip("/dev is no filesystem of its own here")
    target = f"/dev/kvblock-linked-typo-{os.getpid()}"
    link = tmp_path / "nvme-kv"
    link.symlink_to(target)
    from kvblock import Geometry
    from kvblock.errors import DeviceNotFoundError
    from kvblock.store.provision import open_or_format

    try:
        for res in (kvb("bench", link, "--size", "8M", "--seconds", "0.1", "--json"),
                    kvb("selfcheck", "--path", link, "--size", "8M")):
            one_line_error(res, 3, str(link), target, "no such device", "lsblk")
            assert not os.path.lexists(target)
        with pytest.raises(DeviceNotFoundError, match="no such device"):
            open_or_format([str(link)], Geometry(2, 2, 32), model="m", size=8 << 20)
        assert not os.path.lexists(target) and os.path.islink(link)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(target)


def test_format_with_size_refuses_a_new_file_given_twice(tmp_path):
    """A store file --size is to create, named twice (or by two paths), is one
    device given twice (exit 8), as an existing one is: not a busy device
    "locked by another kvblock store" (exit 5); nothing is left behind."""
    new = tmp_path / "kv.img"
    for second in (new, tmp_path / "." / "kv.img"):
        one_line_error(kvb("format", new, second, *GEOM_ARGS, "--size", "24M"), 8,
                       "are the same device")
        assert not new.exists()


def test_missing_device_and_not_a_device(tmp_path):
    for cmd in ("info", "ls", "fsck", "stats", "trim"):
        one_line_error(kvb(cmd, tmp_path / "missing.img"), 3, "no such device")
    one_line_error(kvb("info", "/dev/null"), 6, "not a block device or regular file")
    one_line_error(kvb("format", tmp_path, *GEOM_ARGS), 6, "directory")


def test_not_root(loop_device):
    dev = loop_device(16 << 20)
    formatted(dev)
    for cmd in ("info", "fsck"):
        one_line_error(kvb(cmd, dev, user=65534), 4, dev, "run as root")
    # the overwrite guard of a write benchmark opens the device first
    one_line_error(kvb("bench", dev, "--workload", "write", "--yes", "--seconds", "0.2",
                       user=65534), 4, dev, "run as root")


def test_read_only_device(loop_device):
    """A read-only block device (losetup -r): formatting it or changing its
    store says so (exit 17, nothing written); reading it works."""
    dev = loop_device(16 << 20)
    formatted(dev)
    subprocess.run(["blockdev", "--setro", dev], check=True)
    try:
        before = head(dev)
        for args in (("format", dev, *GEOM_ARGS, "--yes", "--force"), ("evict", dev, "--all"),
                     ("trim", dev), ("fsck", dev, "--repair")):
            one_line_error(kvb(*args), 17, dev, "read-only", "blockdev --setrw")
        assert kvb("info", dev).returncode == 0 and kvb("fsck", dev).returncode == 0
        assert head(dev) == before
    finally:
        subprocess.run(["blockdev", "--setrw", dev], check=True)



def test_a_read_only_device_is_not_said_to_open_read_only_to_commands_that_write(loop_device,
                                                                                  tmp_path):
    """Refused on a read-only device, the commands that write were told the
    device's own advice, "open the store read-only", which none of them can
    (the commands that read open it read-only already and never meet the
    error): the line names the command that writes and the one fix."""
    dev = loop_device(16 << 20)
    formatted(dev)
    subprocess.run(["blockdev", "--setro", dev], check=True)
    try:
        for args in (("format", dev, *GEOM_ARGS, "--yes", "--force"), ("evict", dev, "--all"),
                     ("trim", dev), ("fsck", dev, "--repair"),
                     ("serve", dev, "--socket", tmp_path / "kv.sock"),
                     ("bench", dev, "--workload", "write", "--yes", "--force"),
                     ("selfcheck", "--path", dev, "--yes", "--force")):
            res = kvb(*args)
            one_line_error(res, 17, dev, "read-only", f"blockdev --setrw {dev}",
                           f"kvblock {args[0]}{' --repair' if args[0] == 'fsck' else ''} writes")
            assert "open the store read-only" not in res.stderr, res.stderr
    finally:
        subprocess.run(["blockdev", "--setrw", dev], check=True)

def test_fsck_repair_on_a_read_only_device_is_not_told_fsck_reads_it_as_it_is():
    """Only ``fsck --repair`` writes: its line said "kvblock fsck writes to
    it ... (kvblock info, ls, stats and fsck read it as it is)", the command
    that failed named among those that work."""
    from kvblock import errors
    from kvblock.cli.main import _said_to

    dev = "/dev/loop9"
    e = errors.ReadOnlyDeviceError(
        f"{dev}: the device is read-only (losetup -r, blockdev --setro, or write-protected); "
        f"open the store read-only, or `blockdev --setrw {dev}`", dev, 30)
    line = _said_to(e, "fsck")
    assert "kvblock fsck --repair writes to it" in line, line
    assert f"`blockdev --setrw {dev}` first" in line, line
    assert "fsck without --repair" in line, line
    assert "open the store read-only" not in line, line
    line = _said_to(e, "evict")
    assert "kvblock evict writes to it" in line and "fsck read it as it is" in line, line


def test_a_detached_loop_device_is_said_detached_not_too_small():
    """A loop device whose store file was detached (losetup -d, a reboot) is
    0 bytes: it is a device not found (exit 3) that names the fix, not a
    device too small for a store (exit 7: "use a larger device")."""
    from kvblock.cli.main import exit_code_for
    from kvblock.errors import DeviceNotFoundError

    ok, why = loopdev.can_make_loop_devices()
    if not ok:
        pytest.skip(why)
    with loopdev.backing_file(16 << 20) as path:
        # A high minor: the test processes beside this one (make test runs
        # two) attach the first free one, which once detached could be
        # theirs before it is opened here.
        for minor in range(200, 300):
            if not os.path.exists(f"/sys/block/loop{minor}/loop/backing_file"):
                try:
                    dev = loopdev.attach(path, device=f"/dev/loop{minor}")
                    break
                except subprocess.CalledProcessError:
                    continue            # taken meanwhile
        formatted(dev)
        loopdev.detach(dev)
        with pytest.raises(DeviceNotFoundError, match="no file attached") as e:
            KVStore.open([dev], readonly=True)
    assert dev in str(e.value) and "losetup" in str(e.value)
    assert exit_code_for(e.value) == 3


def test_one_device_given_twice(loop_device, file_target):
    """The same device twice, or a loop device and its backing file: one
    line naming both, before anything is opened."""
    path = file_target(16 << 20)
    one_line_error(kvb("format", path, path, *GEOM_ARGS), 8, "are the same device")
    dev = subprocess.run(["losetup", "-f", "--show", path], capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        one_line_error(kvb("format", dev, path, *GEOM_ARGS, "--yes"), 8,
                       f"{dev} (its backing file", "are the same device")
    finally:
        subprocess.run(["losetup", "-d", dev], check=True)
    assert head(path) == bytes(len(head(path)))


def test_devices_of_different_sizes_are_named_at_format(file_target):
    small, big = file_target(16 << 20), file_target(48 << 20)
    res = kvb("format", small, big, *GEOM_ARGS, "--json")
    assert res.returncode == 0, res.stderr
    assert "differ in size" in res.stderr and "0.0156 GiB of each" in res.stderr
    assert json.loads(res.stdout)["capacity_bytes"] <= 2 * (16 << 20)


def test_format_says_a_small_stores_size_in_digits_not_0_00_gib(file_target):
    """format's plan line and its note on devices of unequal sizes said a
    store of a few MiB was "0.00 GiB" or "0.01 GiB" (two decimals of GiB), as plan once
    did: three significant digits, as plan says them."""
    one = file_target(8 << 20)
    res = kvb("format", one, *GEOM_ARGS)
    assert res.returncode == 0, res.stderr
    assert "0.01 GiB" not in res.stderr and f"{one}; 0.00781 GiB)" in res.stderr, res.stderr
    small, big = file_target(6 << 20), file_target(8 << 20)
    res = kvb("format", small, big, *GEOM_ARGS)
    assert res.returncode == 0, res.stderr
    assert "0.01 GiB" not in res.stderr, res.stderr
    assert "about 0.00586 GiB of each (0.0117 GiB in all)" in res.stderr, res.stderr


def test_format_prompt_goes_to_the_terminal_not_stdout(loop_device):
    """Without --yes on a terminal: the question is on stderr (stdout stays
    JSON); "n" formats nothing (exit 1), Ctrl-D at the prompt exits 130."""
    import pty

    dev = loop_device(16 << 20)
    for answer, code in ((b"n\n", 1), (b"\x04", 130), (b"y\n", 0)):
        main, sub = pty.openpty()
        try:
            p = subprocess.Popen([sys.executable, "-m", "kvblock", "format", dev, *GEOM_ARGS,
                                  "--json"], cwd=ROOT, stdin=sub, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
            os.write(main, answer)
            out, err = p.communicate(timeout=60)
        finally:
            os.close(main)
            os.close(sub)
        assert p.returncode == code, (answer, p.returncode, out, err)
        assert b"Continue?" in err and b"Continue?" not in out
        if code == 0:
            assert json.loads(out)["runs"] == 0
        else:
            assert out == b"" and head(dev, 8192) == bytes(8192)


def test_not_a_store_and_corrupt_superblock(loop_device, file_target):
    blank = file_target(16 << 20)
    # what to do about it too: give the store's device, or format this one
    fix = f"give the store's device, or format this one (kvblock format {blank} "
    for args in (("info", blank), ("ls", blank), ("stats", blank), ("trim", blank),
                 ("serve", blank, "--socket", os.path.dirname(blank) + "/kv.sock")):
        one_line_error(kvb(*args), 11, f"{blank}: no kvblock superblock at offset 0", fix)
    res = kvb("fsck", blank, "--json")
    assert res.returncode == 11 and json.loads(res.stdout)["status"] == "unusable"
    assert fix in json.loads(res.stdout)["problems"][0]
    res = kvb("fsck", blank)
    assert res.returncode == 11 and "unusable" in res.stdout and "no kvblock superblock" in \
        res.stdout
    assert head(blank, 16 << 20) == bytes(16 << 20)
    other = file_target(16 << 20)
    formatted(other)
    res = kvb("fsck", other, blank, "--json")       # the second is not that store's
    assert res.returncode in (11, 14) and json.loads(res.stdout)["status"] == "unusable"
    dev = loop_device(16 << 20)
    formatted(dev)
    with open(dev, "r+b") as f:
        for off in (200, 4096 + 200):
            f.seek(off)
            f.write(b"\xff" * 16)
    one_line_error(kvb("info", dev), 11, "every superblock copy (offsets 0 and 4096) fails its "
                   "checksum")
    assert kvb("fsck", dev).returncode == 11


def test_fsck_json_of_an_unusable_store_has_the_keys_of_a_report(file_target):
    """A script reads the same keys whatever fsck found: an unusable store's
    report has the counts (zero) and lists (empty) of a clean one."""
    good = file_target(16 << 20)
    formatted(good)
    clean = json.loads(kvb("fsck", good, "--json").stdout)
    res = kvb("fsck", file_target(16 << 20), "--json")
    out = json.loads(res.stdout)
    assert res.returncode == 11 and out["status"] == "unusable"
    assert list(out) == list(clean)
    assert out["repaired"] == [] and out["checkpoint_slots"] == []
    assert out["dropped_runs"] == out["dropped_blocks"] == out["runs_checked"] == 0
    assert out["bytes_verified"] == out["journal_records_replayed"] == 0
    assert len(out["problems"]) == 1 and "no kvblock superblock" in out["problems"][0]


def test_format_prints_the_checkpoint_generation_the_device_holds(file_target):
    path = file_target(16 << 20)
    made = formatted(path)
    res = kvb("info", path, "--json")
    assert res.returncode == 0, res.stderr
    assert made["checkpoint_generation"] == json.loads(res.stdout)["checkpoint_generation"]


def test_model_mismatch(file_target):
    path = file_target(16 << 20)
    res = kvb("format", path, *GEOM_ARGS, "--model", "llama-a", "--json")
    assert res.returncode == 0
    one_line_error(kvb("info", path, "--model", "llama-b"), 13, "another model fingerprint")
    assert kvb("info", path, "--model", "llama-a").returncode == 0


def test_fsck_finds_and_repairs_corrupt_data(file_target):
    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    with KVStore.open([path]) as store:
        for i in range(4):
            store.put_run(run_keys(i, 2), run_data(run_keys(i, 2)))
        run = next(iter(store.index.runs.values()))
        _, off = store.regions.address(run.region, run.offset)
    with open(path, "r+b") as f:
        f.seek(off + 10)
        f.write(b"\x00\x11\x22")
    res = kvb("fsck", path)  # shallow: data not read
    assert res.returncode == 0
    res = kvb("fsck", path, "--deep", "--json")
    out = json.loads(res.stdout)
    assert res.returncode == 1 and out["status"] == "problems"
    assert any("checksum mismatch" in p for p in out["problems"])
    res = kvb("fsck", path, "--deep", "--repair", "--json")
    out = json.loads(res.stdout)
    assert res.returncode == 1 and out["status"] == "repaired" and out["dropped_runs"] == 1
    assert out["dropped_blocks"] == 2
    res = kvb("fsck", path, "--deep")
    assert res.returncode == 0 and "clean; 3 runs" in res.stdout


def test_fsck_refuses_a_store_in_use(file_target, loop_device, tmp_path):
    """A store a server (or any process) holds changes under a check: runs
    evicted and their regions rewritten mid-check failed their checksums
    (--deep reported them as damaged, exit 1), a checkpoint slot being
    rewritten read as damaged.  fsck refuses it (exit 5, naming the holder
    and the fix), with --repair too; info and stats still read it."""
    from kvblock.store.server import serve_in_background

    for target in (file_target(16 << 20), loop_device(16 << 20)):
        assert kvb("format", target, *GEOM_ARGS, "--yes").returncode == 0
        sock = str(tmp_path / "kv.sock")
        with serve_in_background([target], sock) as server:
            for i in range(3):
                server.store.put_run(run_keys(i, 2), run_data(run_keys(i, 2)))
            for flags in ((), ("--deep", "--json"), ("--repair",)):
                res = kvb("fsck", target, *flags, process=True)
                one_line_error(res, 5, target, f"pid {os.getpid()}", "in use",
                               "stop the store server")
                assert res.stdout == ""
            assert json.loads(kvb("info", target, "--json", process=True).stdout)["runs"] == 3
        res = kvb("fsck", target, "--deep", "--json")    # stopped: checked
        assert res.returncode == 0 and json.loads(res.stdout)["runs_checked"] == 3


def test_fsck_reports_journal_records_past_a_damaged_one(file_target):
    """A store left dirty (six commits in its journal), then the third
    commit's record damaged: recovery stops there, and fsck says that
    intact records follow (their runs are lost) and that the record is
    damaged, not torn (what it removed is unknown: every run is dropped),
    until a writable open starts a new journal.  A torn tail alone (the
    last commit's sector never written: a device writes a sector whole) is
    clean."""
    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    store = KVStore.open([path])
    for i in range(6):
        store.put_run(run_keys(i, 2), run_data(run_keys(i, 2)))
    journal = store.sb.journal_offset
    store._release_devices()                      # a crash: nothing checkpointed
    # each commit is one record in its own 4 KiB journal block
    with open(path, "r+b") as f:
        f.seek(journal + 5 * 4096)                # the last commit: a torn tail
        f.write(bytes(512))
    res = kvb("fsck", path, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["journal_records_replayed"] == 5
    with open(path, "r+b") as f:
        f.seek(journal + 2 * 4096 + 48)
        f.write(b"\xff\xff")
    res = kvb("fsck", path, "--json")
    out = json.loads(res.stdout)
    assert res.returncode == 1 and out["journal_records_replayed"] == 2, out
    assert any("journal stops at record" in p and "2 intact record(s)" in p
               and f"offset {journal + 3 * 4096}" in p for p in out["problems"]), out
    assert any(f"journal record at offset {journal + 2 * 4096} (number 3) is damaged" in p
               and "2 runs" in p for p in out["problems"]), out
    res = kvb("fsck", path, "--repair", "--json")
    assert res.returncode == 1 and "journal stops" in res.stdout
    res = kvb("fsck", path)
    assert res.returncode == 0 and "clean; 0 runs" in res.stdout
    with KVStore.open([path]) as store:
        assert [store.lookup(run_keys(i, 2)) for i in range(6)] == [0] * 6


def test_fsck_counts_records_lost_inside_one_long_commit(file_target):
    """One put_runs commit of 40 records spans several journal blocks; its
    first record damaged, the other 39 (which do not start on a block) are
    found and counted."""
    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    store = KVStore.open([path])
    for i in range(5):
        store.put_run(run_keys(i, 1), run_data(run_keys(i, 1)))
    store.put_runs([(run_keys(100 + i, 1), run_data(run_keys(100 + i, 1)))
                    for i in range(40)])
    journal = store.sb.journal_offset
    store._release_devices()                      # a crash: nothing checkpointed
    with open(path, "r+b") as f:
        f.seek(journal + 5 * 4096 + 48)           # record 6: the long commit's first
        f.write(b"\xff\xff")
    out = json.loads(kvb("fsck", path, "--json").stdout)
    assert out["journal_records_replayed"] == 5
    assert any("39 intact record(s) from 7 on" in p for p in out["problems"]), out


def test_fsck_reports_a_damaged_checkpoint_slot(file_target):
    """One checkpoint slot damaged: the store opens from the other, fsck
    says so (exit 1), and --repair's writable open rewrites it."""
    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    with KVStore.open([path]) as store:
        store.put_run(run_keys(1, 2), run_data(run_keys(1, 2)))
        sb = store.sb
    slots = json.loads(kvb("fsck", path, "--json").stdout)["checkpoint_slots"]
    older = slots.index(min(slots))
    with open(path, "r+b") as f:
        f.seek(sb.checkpoint_offset + older * sb.checkpoint_bytes + 64)
        f.write(b"\xff\xff")
    res = kvb("fsck", path, "--json")
    out = json.loads(res.stdout)
    assert res.returncode == 1 and out["checkpoint_slots"][older] is None
    assert any(f"checkpoint slot {older}" in p and "damaged" in p for p in out["problems"])
    res = kvb("fsck", path, "--repair", "--json")
    out = json.loads(res.stdout)
    assert res.returncode == 1 and out["status"] == "repaired", out
    assert any(f"rewrote checkpoint slot {older}" in r for r in out["repaired"])
    assert kvb("fsck", path).returncode == 0
    with KVStore.open([path]) as store:
        assert store.lookup(run_keys(1, 2)) == 2


def test_fsck_repairs_a_bad_superblock_copy(file_target):
    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    with open(path, "r+b") as f:
        f.seek(4096 + 300)
        f.write(b"\x01\x02")
    res = kvb("fsck", path)
    assert res.returncode == 1 and "superblock at offset 4096 fails its checksum" in res.stdout
    res = kvb("fsck", path, "--repair")
    assert res.returncode == 1 and "rewrote superblock copy at offset 4096" in res.stdout
    assert kvb("fsck", path).returncode == 0


@pytest.mark.parametrize("copy", [0, 4096])
def test_fsck_calls_a_store_with_another_stores_superblock_copy_unusable(file_target, copy):
    """Another store's superblock over one copy: fsck (and info) opened the
    device as whichever store copy A named.  It is unusable (exit 11),
    both offsets named, and format --force makes it a store again."""
    path, other = file_target(16 << 20), file_target(16 << 20)
    for p in (path, other):
        kvb("format", p, *GEOM_ARGS)
    with open(path, "r+b") as f:
        f.seek(copy)
        f.write(head(other, 8192)[copy:copy + 4096])
    for args in ((), ("--repair",)):
        res = kvb("fsck", path, *args)
        assert res.returncode == 11 and "unusable" in res.stdout, (res.stdout, res.stderr)
        assert "superblock copies at offsets 0 and 4096 are both valid but disagree" in \
            res.stdout
    one_line_error(kvb("info", path), 11, "another store")
    assert kvb("format", path, *GEOM_ARGS).returncode == 16
    assert kvb("format", path, *GEOM_ARGS, "--force").returncode == 0
    assert kvb("fsck", path).returncode == 0


def test_evict_and_trim(file_target):
    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS, "--region-size", "256K")
    with KVStore.open([path]) as store:
        for i in range(40):
            store.put_run(run_keys(i, 4), run_data(run_keys(i, 4)))
        sealed = store.stats()["regions_sealed"]
    assert sealed >= 2
    res = kvb("evict", path, "--older-than", "1h", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["regions_reclaimed"] == 0
    # Seal times are kept in whole seconds, rounded up (a region never reads
    # as older than it is): "older than 0s" takes them a second later.
    time.sleep(1.0)
    res = kvb("evict", path, "--older-than", "0s", "--json")
    assert json.loads(res.stdout)["regions_reclaimed"] >= 1
    res = kvb("evict", path, "--all", "--json")
    assert res.returncode == 0
    out = json.loads(kvb("info", path, "--json").stdout)
    assert out["runs"] == 0
    res = kvb("trim", path, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["regions_trimmed"] > 0
    res = kvb("evict", path)
    assert res.returncode == 2 and "exactly one of" in res.stderr
    for bad in ("soon", "-1h", "-inf", "nan", "inf", "1e999d"):   # a negative age: everything
        res = kvb("evict", path, "--older-than", bad)
        assert res.returncode == 2 and "not a duration" in res.stderr, bad


def test_evict_bytes_beyond_what_can_be_freed_evicts_what_it_can(file_target, tmp_path):
    """--bytes more than can be freed (more than the store, or regions a
    read pins) is no error: every unpinned region goes, exit 0, and
    free_bytes says how much is free (as the README says)."""
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS, "--region-size", "256K")
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock) as server:
        store = server.store
        for i in range(40):
            store.put_run(run_keys(i, 4), run_data(run_keys(i, 4)))
        pins = store.pin(run_keys(0, 4))
        res = kvb("evict", "--socket", sock, "--bytes", "1G", "--json")
        out = json.loads(res.stdout)
        assert res.returncode == 0, res.stderr
        assert store.lookup(run_keys(0, 4)) == 4 and store.stats()["runs"] >= 1
        assert out["runs_evicted"] == 40 - store.stats()["runs"]
        assert out["free_bytes"] == store.stats()["capacity_bytes"] - store.regions.size
        store.unpin(pins)
    res = kvb("evict", path, "--bytes", "1G", "--json")      # more than the whole store
    assert res.returncode == 0, res.stderr
    info = json.loads(kvb("info", path, "--json").stdout)
    assert json.loads(res.stdout)["free_bytes"] == info["capacity_bytes"] and info["runs"] == 0


def test_evict_through_a_store_server(file_target, tmp_path):
    """While a server holds the store, `kvblock evict DEV` is refused with a
    pointer to --socket, and --socket evicts through the server."""
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS, "--region-size", "256K")
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock) as server:
        for i in range(40):
            server.store.put_run(run_keys(i, 4), run_data(run_keys(i, 4)))
        busy = kvb("evict", path, "--all")
        one_line_error(busy, 5, "kvblock evict --socket PATH")
        res = kvb("evict", "--socket", sock, "--older-than", "1h", "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["regions_reclaimed"] == 0
        res = kvb("evict", "--socket", sock, "--older-than", "0s", "--json")
        assert json.loads(res.stdout)["regions_reclaimed"] >= 1
        res = kvb("evict", "--socket", sock, "--all", "--json")
        out = json.loads(res.stdout)
        assert res.returncode == 0 and out["blocks_evicted"] > 0
        assert server.store.stats()["runs"] == 0
    assert kvb("evict", path, "--socket", sock, "--all").returncode == 2   # one or the other


def test_evict_through_a_server_counts_only_what_it_evicted(file_target, tmp_path):
    """Another client's puts while `evict --socket` runs are not evictions:
    runs_evicted and blocks_evicted are the runs and blocks the eviction
    dropped, not the change in the store's run count (which those puts
    skew, down to a negative count)."""
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS, "--region-size", "256K")
    with serve_in_background([path], str(tmp_path / "kv.sock")) as server:
        store = server.store
        for i in range(40):
            store.put_run(run_keys(i, 4), run_data(run_keys(i, 4)))
        evict = store.evict

        def evict_while_another_rank_puts(nbytes=None, all=False):
            reclaimed = evict(nbytes, all=all)
            for i in range(100, 140):        # another client's puts, before the CLI's stats()
                store.put_run(run_keys(i, 4), run_data(run_keys(i, 4)))
            return reclaimed

        store.evict = evict_while_another_rank_puts
        before = store.stats()
        res = kvb("evict", "--socket", tmp_path / "kv.sock", "--all", "--json")
        after = store.stats()
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["runs_evicted"] == after["evicted_runs"] - before["evicted_runs"] == 40
    assert out["blocks_evicted"] == after["evicted_blocks"] - before["evicted_blocks"] == 160


def test_stats_through_a_server_exports_no_read_counters_it_never_sees(file_target, tmp_path):
    """Each client of a store server reads the devices itself: the server's
    read counters stay 0 whatever was read.  `stats --socket` (and its
    Prometheus export) leaves them out instead of reporting 0 hits."""
    from kvblock.store.client import RemoteStore
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock):
        with RemoteStore(sock) as rank:
            keys = run_keys(1, 4)
            rank.put_run(keys, run_data(keys))
            out = np.zeros(len(keys) * rank.geometry.block_bytes, np.uint8)
            assert rank.get_run(keys, out) == 4
        res = kvb("stats", "--socket", sock, "--json")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["put_runs"] == 1 and s["runs"] == 1
    assert not {"get_blocks", "bytes_read", "host_hit_blocks"} & set(s), s


def test_trim_of_a_served_store_says_to_stop_the_server(file_target, tmp_path):
    """trim writes (discards) a store, so a store in use is refused; the
    device's own advice, "open it read-only", is no way to trim: the
    message says to stop the server that holds it."""
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    assert kvb("format", path, *GEOM_ARGS).returncode == 0
    with serve_in_background([path], str(tmp_path / "kv.sock")):
        res = kvb("trim", path, "--json", process=True)
        one_line_error(res, 5, path, f"pid {os.getpid()}", "stop the store server")
        assert "read-only" not in res.stderr and res.stdout == ""
    assert kvb("trim", path, "--json").returncode == 0


def test_a_served_store_in_use_names_every_process_that_has_it_open(file_target, tmp_path):
    """The commands that rewrite the device's busy error kept only what came
    before its first "; ", taken for the start of its advice: the list of
    processes that have the device open is itself joined with "; ", so it
    was cut after the first (the holder), its parenthesis left open and the
    ranks beside it dropped."""
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    assert kvb("format", path, *GEOM_ARGS).returncode == 0
    # a process that only has it open (a rank); its code in a file, so that
    # its command line (which the message quotes, cut at 120 characters) has
    # no parenthesis of its own to unbalance the message's
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
                      "print('ready', flush=True)\ntime.sleep(60)\n")
    rank = subprocess.Popen([sys.executable, str(script), path],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline() == "ready\n"
        with serve_in_background([path], str(tmp_path / "kv.sock")):
            res = kvb("trim", path, "--json", process=True)
            one_line_error(res, 5, path, f"held by pid {os.getpid()}",
                           f"also open in pid {rank.pid}", "stop the store server")
            line = res.stderr.strip().splitlines()[-1]
            assert line.count("(") == line.count(")"), line
    finally:
        rank.kill()
        rank.wait()
        rank.stdout.close()


def test_a_busy_message_is_cut_at_its_advice_not_in_a_path_holding_a_semicolon(tmp_path,
                                                                               monkeypatch):
    """The commands that put their own fix in place of a busy device's
    advice cut its message at its last "; ", taken for the start of the
    advice: a path named after that point holding "; " (the mount point in
    "unmount it first (umount '/mnt/a; b')", the socket of a stopping store
    server that serve's refusal names after the advice) was cut instead,
    the path's end dropped and the device's advice ("open it read-only")
    kept beside the command's.  The cut is where the advice begins."""
    from types import SimpleNamespace

    from kvblock import create_file
    from kvblock.cli.admin import _in_use, _without_advice
    from kvblock.devices import device as device_mod
    from kvblock.devices.device import Device
    from kvblock.errors import DeviceBusyError

    # a block device mounted at a path holding "; ", as the device layer says it
    monkeypatch.setattr(device_mod, "_mount_points", lambda rdev: [(None, "/mnt/a; b")])
    blk = SimpleNamespace(st_mode=stat.S_IFBLK | 0o660, st_rdev=os.makedev(8, 0))
    e = device_mod._busy("/dev/sdz: device is busy", blk, "/dev/sdz", "", "/dev/sdz",
                         errno.EBUSY)
    assert str(e).endswith("; unmount it first (umount '/mnt/a; b')"), str(e)
    assert _without_advice(e) == "/dev/sdz: device is busy (mounted at /mnt/a; b)"

    # a store file (in a folder holding "; ") locked by another store, as
    # serve says it when a store server stopping on a socket in a folder
    # holding "; " still held it (server.open_server)
    folder = tmp_path / "st; ore"
    folder.mkdir()
    path = str(folder / "kv.img")
    create_file(path, 1 << 20)
    with Device(path):
        with pytest.raises(DeviceBusyError) as held:
            Device(path, busy_timeout=0)
    head = f"{path}: file is locked by another kvblock store"
    assert str(held.value) == f"{head}; stop the other process or open it read-only"
    assert _without_advice(held.value) == head
    sock = str(tmp_path / "run; 1" / "kv.sock")
    stopping = DeviceBusyError(f"{held.value} (the store server stopping on {sock} still "
                               "held them after 10 s of waiting: let its stop finish, or "
                               "stop it, then start again)")
    said = str(_in_use(stopping, "one process serves a store", "serve"))
    assert said.startswith(f"{head}; one process serves a store: stop the store server"), said
    assert "read-only" not in said, said


def test_commands_that_write_a_served_store_do_not_say_open_it_read_only(file_target,
                                                                          tmp_path):
    """format, serve and evict on a store file a server holds: exit 5 naming
    the holder, without the device's "open it read-only", which none of them
    can do."""
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    assert kvb("format", path, *GEOM_ARGS).returncode == 0
    with serve_in_background([path], str(tmp_path / "kv.sock")):
        for args, fix in ((("format", path, *GEOM_ARGS, "--force"), "stop the store server"),
                          (("serve", path, "--socket", str(tmp_path / "b.sock")),
                           "stop the store server"),
                          (("evict", path, "--all"), "kvblock evict --socket PATH")):
            res = kvb(*args, process=True)       # the holder named is this process
            one_line_error(res, 5, path, f"pid {os.getpid()}", fix)
            assert "read-only" not in res.stderr, res.stderr


def _scrape(port, want, timeout=30.0) -> str:
    """/metrics of the exporter on ``port`` once it holds ``want``."""
    deadline, body = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=2).read().decode()
            if want in body:
                return body
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{want!r} never appeared in:\n{body[-2000:]}")


def _sample(body: str, name: str) -> float:
    """The value of metric ``name`` (one sample) in a /metrics body."""
    values = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
              if line.startswith(name + "{")]
    assert len(values) == 1, body[-2000:]
    return values[0]


def test_stats_exporter_keeps_the_last_numbers_when_a_read_fails(capsys):
    """The store briefly unreadable (a file moved, a server restarting):
    scrapes get the last numbers and stderr one line, not a failed scrape
    and a traceback each time; a first read that fails still fails."""
    from kvblock.cli.admin import _Cached
    from kvblock.errors import DeviceNotFoundError

    answers = [{"runs": 1}, DeviceNotFoundError("x.img: gone", "x.img", 2),
               DeviceNotFoundError("x.img: gone", "x.img", 2), {"runs": 2}]

    def read():
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a
    cached = _Cached(read, interval=0)
    assert [cached()["runs"] for _ in range(4)] == [1, 1, 1, 2]
    assert capsys.readouterr().err.count("x.img: gone (serving the last numbers)") == 1
    answers.append(DeviceNotFoundError("x.img: gone", "x.img", 2))
    with pytest.raises(DeviceNotFoundError):
        _Cached(read, interval=0)()


def test_stats_prometheus_follows_the_store_and_ctrl_c(file_target, tmp_path):
    """The exporter re-reads the devices (gauges follow puts made by another
    process); with --socket it serves the server's counters too.  A port in
    use is one line, not a traceback; Ctrl-C exits 130."""
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    port = 19000 + os.getpid() % 1000
    proc = subprocess.Popen([sys.executable, "-m", "kvblock", "stats", path,
                             "--prometheus", str(port), "--interval", "0.2"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    try:
        body = _scrape(port, "kvblock_store_runs{")
        assert _sample(body, "kvblock_store_runs") == 0
        assert "kvblock_store_put_runs_total" not in body   # the exporter's own: not served
        with KVStore.open([path]) as store:      # another process's puts
            for i in range(3):
                store.put_run(run_keys(i, 2), run_data(run_keys(i, 2)))
        deadline = time.monotonic() + 30
        while _sample(body, "kvblock_store_runs") != 3:
            assert time.monotonic() < deadline, body[-2000:]
            time.sleep(0.2)
            body = _scrape(port, "kvblock_store_runs{")
        for _ in range(2):   # a refused start leaves nothing registered to collide with
            busy = kvb("stats", path, "--prometheus", str(port))
            one_line_error(busy, 8, f"cannot serve metrics on port {port}", "another --prometheus")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "interrupted" in err

    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock) as server:
        res = kvb("stats", "--socket", sock, "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["runs"] == 3
        proc = subprocess.Popen([sys.executable, "-m", "kvblock", "stats", "--socket", sock,
                                 "--prometheus", str(port), "--interval", "0.2"], cwd=ROOT,
                                stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
        try:
            body = _scrape(port, "kvblock_store_put_runs_total{")
            assert _sample(body, "kvblock_store_put_runs_total") == 0
            server.store.put_run(run_keys(9, 1), run_data(run_keys(9, 1)))
            deadline = time.monotonic() + 30
            while _sample(body, "kvblock_store_put_runs_total") != 1:
                assert time.monotonic() < deadline, body[-2000:]
                time.sleep(0.2)
                body = _scrape(port, "kvblock_store_put_runs_total{")
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=20)
    assert kvb("stats", path, "--socket", sock).returncode == 2     # one or the other


def test_stats_prometheus_listens_on_localhost_unless_asked(file_target, monkeypatch):
    """--prometheus served the store's metrics (its devices, uuid, sizes) on
    every network interface (prometheus_client's default address 0.0.0.0),
    which neither the help nor the README said.  It listens on 127.0.0.1
    unless --address names another, and says where."""
    import prometheus_client
    import prometheus_client.core

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    calls = []

    def started(port, addr="0.0.0.0", **kw):
        calls.append((port, addr))
        raise KeyboardInterrupt          # stands for Ctrl-C once serving

    monkeypatch.setattr(prometheus_client, "start_http_server", started)
    for args, addr in (((), "127.0.0.1"), (("--address", "0.0.0.0"), "0.0.0.0"),
                       (("--address", "::1"), "::1")):
        monkeypatch.setattr(prometheus_client.core, "REGISTRY",
                            prometheus_client.CollectorRegistry())
        res = kvb("stats", path, "--prometheus", "9400", *args)
        assert res.returncode == 130, res.stderr
        assert calls.pop() == (9400, addr)


def test_stats_prometheus_serves_its_first_read_to_the_first_scrape(monkeypatch):
    """The read that checks the store at start was thrown away: the first
    scrape read the store again (a second recovery) and, the store briefly
    unreadable then, failed with no last numbers to serve."""
    import prometheus_client
    import prometheus_client.core

    from kvblock.cli import admin
    from kvblock.errors import DeviceNotFoundError
    from kvblock.metrics import GAUGES

    reads, scraped = [], []
    registry = prometheus_client.CollectorRegistry()

    def read(devices):
        reads.append(devices)
        if len(reads) > 1:
            raise DeviceNotFoundError("x.img: gone", "x.img", 2)
        return {"uuid": "u", **{name: 7 for name in GAUGES}}

    def serving(seconds):                # the CLI's wait once serving: scrape, then Ctrl-C
        scraped.append(prometheus_client.generate_latest(registry).decode())
        raise KeyboardInterrupt

    monkeypatch.setattr(admin, "_device_stats", read)
    monkeypatch.setattr(prometheus_client, "start_http_server", lambda *a, **kw: None)
    monkeypatch.setattr(prometheus_client.core, "REGISTRY", registry)
    monkeypatch.setattr(admin.time, "sleep", serving)
    res = kvb("stats", "x.img", "--prometheus", "9400", "--interval", "60")
    assert res.returncode == 130, res.stderr
    assert len(reads) == 1 and 'kvblock_store_runs{store="u"} 7.0' in scraped[0], scraped


def test_stats_prometheus_json_says_where_it_serves(monkeypatch):
    """stats --prometheus --json printed nothing on stdout: the only word
    that it serves, and where, was the line on stderr.  As kvblock serve
    --json, it prints one JSON line once listening."""
    import prometheus_client
    import prometheus_client.core

    from kvblock.cli import admin
    from kvblock.metrics import GAUGES

    def serving(seconds):                # Ctrl-C once serving
        raise KeyboardInterrupt

    monkeypatch.setattr(admin, "_device_stats", lambda devices: {"uuid": "u",
                                                                 **{n: 7 for n in GAUGES}})
    monkeypatch.setattr(prometheus_client, "start_http_server", lambda *a, **kw: None)
    monkeypatch.setattr(prometheus_client.core, "REGISTRY", prometheus_client.CollectorRegistry())
    monkeypatch.setattr(admin.time, "sleep", serving)
    res = kvb("stats", "x.img", "y.img", "--prometheus", "9400", "--address", "::1",
              "--interval", "2", "--json")
    assert res.returncode == 130, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1, res.stdout
    assert json.loads(lines[0]) == {"metrics": "http://[::1]:9400/metrics",
                                    "store": "x.img, y.img", "interval": 2.0,
                                    "pid": os.getpid()}


def test_stats_of_devices_shows_the_stores_state_not_zero_counters(file_target):
    """kvblock stats DEV opens the store read-only: the puts and hits of the
    process that wrote it are not on the devices, so it reports the gauges
    and what its own recovery found, never this process's counters as a
    put_runs 0 beside a store full of runs."""
    from kvblock.store.store import COUNTERS

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    with KVStore.open([path]) as store:
        for i in range(3):
            store.put_run(run_keys(i, 2), run_data(run_keys(i, 2)))
    res = kvb("stats", path, "--json")
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["runs"] == 3 and s["blocks"] == 6
    shown = sorted(set(COUNTERS) & set(s))
    assert shown == ["recovery_us", "replayed_records", "stale_checkpoint_runs_dropped"], shown
    text = kvb("stats", path).stdout
    assert "put_runs" not in text and "bytes_written" not in text and "runs" in text


def test_ctrl_c_during_bench(file_target):
    path = file_target(64 << 20)
    proc = subprocess.Popen([sys.executable, "-m", "kvblock", "bench", path,
                             "--workload", "randread", "--seconds", "30", "--json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    _wait_until_open(proc.pid, path)   # the bench is running I/O on the target
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "kvblock: interrupted"


def test_help_texts():
    res = kvb("--help")
    for cmd in ("format", "info", "ls", "fsck", "stats", "evict", "trim", "bench", "demo"):
        assert cmd in res.stdout
    for cmd in ("format", "info", "ls", "fsck", "stats", "evict", "trim", "bench", "demo"):
        res = kvb(cmd, "--help")
        assert res.returncode == 0 and "Usage: kvblock " + cmd in res.stdout


def test_the_readmes_cli_table_has_a_row_for_every_command():
    """README's table of the kvblock command had no row for plan, report,
    selfcheck or demo, which kvblock --help lists."""
    from kvblock.cli.main import cli

    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    table = text.split("| command | what it does |", 1)[1].split("\n\n", 1)[0]
    rows = {line.split("`")[1].split()[1] for line in table.splitlines()
            if line.startswith("| `kvblock ")}
    assert rows == set(cli.commands), sorted(set(cli.commands) ^ rows)


def test_the_readmes_cli_table_names_every_option_of_a_command():
    """README's row of a command named no --model for info, none of serve's
    --model, --eviction, --admit-after, --engine, --verify, nor plan's
    --dtype, --kv-parts, --mfu: each option a command takes is in its row
    (bench's row, whose usage ends in " ...", gives the workloads only).
    The other way, test_readme_snippets' test_command_table_options_exist."""
    import re

    from kvblock.cli.main import cli

    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    table = text.split("| command | what it does |", 1)[1].split("\n\n", 1)[0]
    for line in table.splitlines():
        if not line.startswith("| `kvblock "):
            continue
        usage = line.split("`")[1]
        command = cli.commands[usage.split()[1]]
        takes = {o for p in command.params for o in p.opts if o.startswith("--")}
        if not usage.endswith(" ..."):
            missing = takes - {"--json", "--help"} - set(re.findall(r"(?<![\w-])--[a-z][a-z-]*",
                                                                      line))
            assert not missing, (usage, sorted(missing))


def test_interrupted_format_leaves_no_half_valid_superblock(file_target):
    """Crash format at every I/O: the device holds the old store untouched, no
    valid superblock, or a complete, empty new store; never a mix."""
    from kvblock import Geometry
    from kvblock.errors import NotAStoreError
    from tests.support.faults import CrashPlan, SimulatedCrash

    geom = Geometry(2, 2, 32, "float16", 16, 2, 2)
    path = file_target(16 << 20)
    counting = CrashPlan()
    KVStore.format([path], geom, storeio_factory=counting.factory()).close()
    total = counting.ops
    assert total >= 5
    outcomes = set()
    for n in range(1, total + 1):
        with open(path, "r+b") as f:  # a device that held an older store
            f.truncate(0)
            f.truncate(16 << 20)
        KVStore.format([path], geom).close()
        old_uuid = KVStore.open([path], readonly=True).stats()["uuid"]
        plan = CrashPlan(crash_at=n, torn=True)
        with pytest.raises(SimulatedCrash):
            KVStore.format([path], geom, force=True, storeio_factory=plan.factory()).close()
        try:
            with KVStore.open([path]) as store:
                s = store.stats()
                assert s["blocks"] == 0
                outcomes.add("old store" if s["uuid"] == old_uuid else "new store")
        except NotAStoreError:
            outcomes.add("no store")
    assert outcomes == {"old store", "new store", "no store"}


def test_trim_of_a_mapped_tmpfs_store_says_how_to_release_it(shm_target, monkeypatch):
    path = shm_target(16 << 20)
    kvb("format", path, *GEOM_ARGS, "--region-size", "256K")
    with KVStore.open([path]) as store:
        for i in range(8):
            store.put_run(run_keys(i, 4), run_data(run_keys(i, 4)))
    info = json.loads(kvb("info", path, "--json").stdout)
    assert info["reads"] == "#0 mapped (tmpfs file)" and "hint" not in info, info
    assert kvb("evict", path, "--all", "--json").returncode == 0
    allocated = os.stat(path).st_blocks
    out = json.loads(kvb("trim", path, "--json").stdout)
    assert out["regions_trimmed"] == 0 and "KVBLOCK_MAPPED_READS=never" in out["note"]
    assert os.stat(path).st_blocks == allocated
    monkeypatch.setenv("KVBLOCK_MAPPED_READS", "never")
    out = json.loads(kvb("trim", path, "--json").stdout)
    assert out["regions_trimmed"] > 0 and "note" not in out
    assert os.stat(path).st_blocks < allocated
    monkeypatch.delenv("KVBLOCK_MAPPED_READS")
    with KVStore.open([path]) as store:           # sparse now: read through the engine
        assert not store.io.engine.mapped(0) and store.stats()["mapped_reads"] == []
        keys = run_keys(99, 4)
        store.put_run(keys, run_data(keys))
        got = np.zeros(4 * store.geometry.block_bytes, np.uint8)
        assert store.get_run(keys, got) == 4 and np.array_equal(got, run_data(keys))
    # allocated again (what the note says to run), the next open maps it
    subprocess.run(["fallocate", "-l", str(os.stat(path).st_size), path], check=True)
    with KVStore.open([path]) as store:
        assert store.io.engine.mapped_for_writes(0)
        assert store.get_run(keys, got) == 4 and np.array_equal(got, run_data(keys))


def test_trim_of_a_store_striped_over_a_device_that_keeps_its_space_is_not_supported(
        file_target, shm_target):
    """A store striped over a file on disk (holes punched) and one on tmpfs
    read through a mapping (kept allocated): only the disk file's free
    regions are discarded.  trim said supported (some were) and left out
    the note saying how to release the other's."""
    disk, shm = file_target(16 << 20), shm_target(16 << 20)
    assert kvb("format", disk, shm, *GEOM_ARGS, "--region-size", "256K").returncode == 0
    allocated = os.stat(shm).st_blocks
    res = kvb("trim", disk, shm, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert 0 < out["regions_trimmed"] < out["free_regions"], out
    assert out["supported"] is False
    assert shm in out["note"] and disk not in out["note"]
    assert "KVBLOCK_MAPPED_READS=never" in out["note"]
    assert os.stat(shm).st_blocks == allocated


def test_a_device_too_small_for_superblocks_is_too_small_not_an_io_error(tmp_path):
    """Under 8 KiB (a --size without its unit, a truncated store): format,
    info and fsck say the device is too small (exit 7), not that a read
    past its end failed (exit 9)."""
    small = tmp_path / "small.img"
    small.write_bytes(b"\0" * 1000)
    one_line_error(kvb("format", small, *GEOM_ARGS, "--yes"), 7, "small.img")
    one_line_error(kvb("format", tmp_path / "new.img", "--size", "64", *GEOM_ARGS), 7)
    one_line_error(kvb("info", small), 7, "cannot hold a kvblock store")
    store = tmp_path / "st.img"
    assert kvb("format", store, "--size", "8M", *GEOM_ARGS).returncode == 0
    os.truncate(store, 4096)
    res = kvb("fsck", store, "--json")
    assert res.returncode == 7, res.stderr
    assert json.loads(res.stdout)["status"] == "unusable"


@pytest.mark.parametrize("nbytes", [1000, 5000])
def test_a_store_file_of_a_partial_block_is_said_its_real_size(tmp_path, nbytes):
    """A store file whose size is no whole number of 4 KiB blocks (under
    4 KiB: none) was said to be its whole blocks' size: "0 bytes" for a
    1000-byte file, 4096 for 5000 bytes.  format and info say the size the
    file has, and that it is too small, with the least size and the fix."""
    small = tmp_path / "small.img"
    small.write_bytes(b"\0" * nbytes)
    res = kvb("format", small, *GEOM_ARGS)
    one_line_error(res, 7, str(small), f"{nbytes} bytes", "use a larger device (at least ")
    whole = nbytes // 4096 * 4096
    assert f": {whole} bytes cannot" not in res.stderr, res.stderr
    res = kvb("info", small)
    one_line_error(res, 7, str(small), f"{nbytes} bytes", "cannot hold a kvblock store")
    assert f": {whole} bytes cannot" not in res.stderr, res.stderr
    assert small.stat().st_size == nbytes        # refused: left as it was


def test_serve_refuses_a_socket_path_too_long_before_touching_the_store(tmp_path):
    store = tmp_path / "st.img"
    assert kvb("format", store, "--size", "8M", *GEOM_ARGS).returncode == 0
    before = store.read_bytes()
    sock = tmp_path / "new" / ("y" * 110 + ".sock")
    one_line_error(kvb("serve", store, "--socket", sock), 8, "at most 107")
    assert store.read_bytes() == before and not (tmp_path / "new").exists()


def test_an_empty_model_name_is_refused(tmp_path):
    """`--model "$MODEL"` with MODEL unset stamped the store with the empty
    name's fingerprint, a model of its own: every later open naming the
    real model was refused (exit 13).  A usage error says so at once."""
    store = tmp_path / "st.img"
    res = kvb("format", store, "--size", "8M", *GEOM_ARGS, "--model", "")
    assert res.returncode == 2 and "--model" in res.stderr and "is empty" in res.stderr
    assert not store.exists()
    assert kvb("format", store, "--size", "8M", *GEOM_ARGS, "--model", "m@1").returncode == 0
    res = kvb("info", store, "--model", " ")
    assert res.returncode == 2 and "is empty" in res.stderr


def test_stats_through_a_path_that_is_no_socket_says_so(file_target, tmp_path):
    """--socket naming the store file (or any regular file) was answered "nobody
    listening (a stale socket of a stopped server)": it names what is there."""
    path = file_target(16 << 20)
    res = kvb("stats", "--socket", path, "--json")
    assert res.returncode == 18, res.stderr
    assert "it is a regular file, not a socket" in res.stderr and "stale" not in res.stderr
    res = kvb("stats", "--socket", tmp_path, "--json")
    assert res.returncode == 18 and "it is a directory, not a socket" in res.stderr


def test_serve_that_stops_on_a_failure_says_which(tmp_path, monkeypatch):
    """A server that stopped because its store failed (a metadata write,
    its listener) exited 1 saying only "stopped (store failed)": the
    operator had to find the reason elsewhere.  The line names it."""
    from kvblock.errors import StoreClosedError
    from kvblock.store import server as server_mod

    def fails(server, stop):
        server.failed = StoreClosedError("metadata write failed; store closed")
        server.stop()
        return 1
    monkeypatch.setattr(server_mod, "run_forever", fails)
    store = tmp_path / "st.img"
    assert kvb("format", store, "--size", "8M", *GEOM_ARGS).returncode == 0
    res = kvb("serve", store, "--socket", tmp_path / "kv.sock")
    assert res.returncode == 1
    assert "stopped (store failed: metadata write failed; store closed)" in res.stderr, res.stderr


def test_a_store_servers_numbers_are_gauges_and_its_pid_no_metric(file_target, tmp_path):
    """clients and pinned_regions go up and down: exported as counters,
    Prometheus would read each fall as a reset.  The server's pid is no
    quantity at all, nor is the pin lease (a setting: given as a whole
    number of seconds it was exported as a counter)."""
    from kvblock.cli.admin import _server_stats
    from kvblock.metrics import StoreCollector
    from kvblock.store.client import RemoteStore
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    assert kvb("format", path, *GEOM_ARGS, "--yes").returncode == 0
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock, pin_lease=30), RemoteStore(sock) as rank:
        keys = [b"m0", b"m1"]
        rank.put_run(keys, np.zeros(2 * rank.geometry.block_bytes, np.uint8))
        pins = rank.pin(keys)
        stats = _server_stats(sock)
        families = {f.name.removeprefix("kvblock_store_"): f
                    for f in StoreCollector(lambda: stats).collect()}
        rank.unpin(pins)
    assert families["clients"].type == "gauge" and families["clients"].samples[0].value == 1
    assert families["pinned_regions"].type == "gauge"
    assert families["pinned_regions"].samples[0].value == 1
    assert "server_pid" not in families and "pin_lease" not in families
    assert families["put_blocks"].type == "counter"


def test_stats_through_a_server_counts_its_clients_not_itself(file_target, tmp_path):
    """`stats --socket` asks over a connection of its own, which the server
    counted among its clients: a server no rank used said 1 client, and
    every Prometheus scrape of it one more than there were."""
    from kvblock.store.client import RemoteStore
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock):
        res = kvb("stats", "--socket", sock, "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["clients"] == 0
        with RemoteStore(sock), RemoteStore(sock):
            assert json.loads(kvb("stats", "--socket", sock, "--json").stdout)["clients"] == 2


def test_connections_total_counts_ranks_not_probes_or_the_stats_read(file_target, tmp_path):
    """connections_total counted every accepted connection: a probe for a
    live server (wait_for_server, which every rank starting a server runs)
    and the `stats --socket` read itself, so a server one rank had used
    said 3 (and each Prometheus scrape one more).  It counts hellos
    answered yes; the stats read leaves its own out, as for clients."""
    from kvblock.store.client import RemoteStore
    from kvblock.store.launch import wait_for_server
    from kvblock.store.server import serve_in_background

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([path], sock) as server:
        wait_for_server(sock)
        with RemoteStore(sock):
            pass
        res = kvb("stats", "--socket", sock, "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["connections_total"] == 1
        assert server.connections_total == 2      # the rank's and the stats read's


def test_a_dram_tiers_occupancy_is_a_gauge_and_counters_end_in_total(file_target):
    """host_blocks falls when the DRAM tier evicts: as a counter Prometheus
    reads each fall as a reset (rate() of it is nonsense).  Every value
    that can go down is a gauge; every counter is exported as ..._total."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvblock.metrics import StoreCollector

    path = file_target(16 << 20)
    assert kvb("format", path, *GEOM_ARGS, "--yes").returncode == 0
    with KVStore.open([path], host_cache_bytes=1 << 20) as store:
        keys = [b"h0", b"h1"]
        store.put_run(keys, np.zeros(2 * store.geometry.block_bytes, np.uint8))
        families = {f.name.removeprefix("kvblock_store_"): f
                    for f in StoreCollector(store).collect()}
        registry = CollectorRegistry()
        registry.register(StoreCollector(store))
        text = generate_latest(registry).decode()
    for name in ("host_blocks", "host_capacity_blocks"):
        assert families[name].type == "gauge", (name, families[name].type)
    assert families["host_capacity_blocks"].samples[0].value > 0
    assert families["host_tier_hits"].type == "counter"
    for line in text.splitlines():
        if line.startswith("# TYPE ") and line.endswith(" counter"):
            name = line.split()[2]
            assert name.endswith("_total") and f"\n{name}{{" in text, name


def test_a_size_of_too_many_digits_is_a_usage_error_and_sizes_are_exact(tmp_path):
    """A size too long for a float (a key held down) was an OverflowError
    traceback; a byte count past 2**53 came back rounded."""
    from kvblock.errors import ConfigError
    from kvblock.units import parse_size, size_setting

    huge = "9" * 400
    res = kvb("format", tmp_path / "new.img", "--size", huge, *GEOM_ARGS)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "--size" in res.stderr
    assert not (tmp_path / "new.img").exists()
    with pytest.raises(ConfigError, match="size"):
        size_setting(huge + "G", "KVBlockTier", "size")
    assert parse_size(str((1 << 60) + 1)) == (1 << 60) + 1
    assert parse_size("1.5G") == 3 << 29 and parse_size("64KiB") == 64 << 10


def test_a_size_past_pythons_digit_limit_is_refused_as_a_size(tmp_path):
    """More than 4300 digits (a key held down longer) hit Python's int
    conversion limit: 'Exceeds the limit (4300 digits) ... use
    sys.set_int_max_str_digits()', advice for Python, not for the size, and
    a long fraction of a small size was refused the same way."""
    from kvblock.errors import ConfigError
    from kvblock.units import parse_size, size_setting

    huge = "9" * 5000
    with pytest.raises(ValueError, match="too large") as e:
        parse_size(huge)
    assert "set_int_max_str_digits" not in str(e.value)
    with pytest.raises(ConfigError, match="size.*too large"):
        size_setting(huge + "G", "KVBlockTier", "size")
    assert parse_size("0" * 5000 + "64K") == 64 << 10
    assert parse_size("1." + "5" * 5000 + "K") == 1592
    res = kvb("format", tmp_path / "new.img", "--size", huge, *GEOM_ARGS)
    assert res.returncode == 2 and "set_int_max_str_digits" not in res.stderr, res.stderr
    assert not (tmp_path / "new.img").exists()


def test_an_ib_without_its_unit_is_no_size(tmp_path):
    """The unit's "iB" was optional on its own: "64iB" or "1 ib" (a K, M,
    G or T lost) was taken for 64 and 1 bytes, not refused as no size."""
    from kvblock.errors import ConfigError
    from kvblock.units import parse_size, size_setting

    for text in ("64iB", "1 ib", "4096IB"):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(text)
    with pytest.raises(ConfigError, match="not a size"):
        size_setting("512iB", "KVBlockTier", "max_run_bytes")
    assert [parse_size(t) for t in ("64KiB", "64kib", "64KB", "64 K", "4096B", "4096 b",
                                    "2 GiB")] == [64 << 10] * 3 + [64 << 10, 4096, 4096, 2 << 30]
    res = kvb("format", tmp_path / "new.img", "--size", "64iB", *GEOM_ARGS)
    assert res.returncode == 2 and "not a size" in res.stderr, res.stderr
    assert not (tmp_path / "new.img").exists()


def test_a_whole_number_setting_that_only_looks_numeric_is_a_config_error():
    """int_setting judged a string by str.isdigit() after stripping every
    leading '-': "--5" and "²" (digits to isdigit, not to int()) passed the
    check and ended in int()'s ValueError, not a ConfigError naming the setting."""
    from kvblock.errors import ConfigError
    from kvblock.units import int_setting

    for bad in ("--5", "²", "-", "5-"):
        with pytest.raises(ConfigError, match="threads must be a whole number"):
            int_setting(bad, "kvblock tier", "threads")
    assert int_setting(" 7 ", "kvblock tier", "threads") == 7
    with pytest.raises(ConfigError, match="at least 1, got '-3'"):
        int_setting("-3", "kvblock tier", "threads")


def test_is_whole_takes_ints_and_numpy_ints_never_bools():
    """The one "a whole number, not a bool" check the settings, the engine,
    the buffers and the geometry share; ``index=True`` also takes what
    operator.index does (a 0-d integer array), still no bool."""
    import numpy as np

    from kvblock.units import is_whole

    for good in (0, -3, 1 << 70, np.int8(3), np.uint64(1 << 63)):
        assert is_whole(good) and is_whole(good, index=True), good
    for bad in (True, False, np.True_, 2.0, np.float64(2), "3", None, np.array(5), [1]):
        assert not is_whole(bad), bad
    assert is_whole(np.array(5), index=True)
    for bad in (True, np.True_, np.array(True), 2.0, "3", None, np.array([5])):
        assert not is_whole(bad, index=True), bad


def test_tables_show_paths_as_given_not_as_rich_markup(tmp_path):
    """The text tables went through rich's markup: a store file in a folder
    named like a style ("kv[red]", "[x]") was shown as "kv/store.img",
    a device path that does not exist, the part in brackets swallowed (and
    ":fire:" in a name was shown as an emoji)."""
    from click.testing import CliRunner

    from kvblock.cli.main import cli
    from tests.store.workload import small_store

    path = small_store(tmp_path / "kv[red]" / "store:fire:[x].img")
    with KVStore.open([path]) as store:
        store.put_run(run_keys(0, 2), run_data(run_keys(0, 2)))
    for cmd in ("info", "ls", "stats"):
        res = CliRunner().invoke(cli, [cmd, path])
        assert res.exit_code == 0, res.output
        assert path in res.output, (cmd, res.output)


def test_evict_bad_older_than_names_the_option():
    """A bad --older-than said "Invalid value: '-5s' is not a duration"
    without naming the option it came from (the duration was parsed after
    click's own checks)."""
    for bad in ("-5s", "soon"):
        res = kvb("evict", "/nonexistent/kv.img", "--older-than", bad)
        assert res.returncode == 2, res.stderr
        assert "Invalid value for '--older-than'" in res.stderr and "not a duration" in \
            res.stderr and bad in res.stderr, res.stderr


@pytest.mark.parametrize("fmt", [["--json"], []])
def test_output_to_a_reader_that_went_away_is_no_error(fmt):
    """`kvblock info --json | head -c1`: the reader closes the pipe, as
    head does.  The JSON path said 'kvblock: error: Broken pipe' (a table
    went quietly); either way kvblock stops without a word, exit 1, as
    Python's docs advise (and rich does for its tables)."""
    r, w = os.pipe()
    os.close(r)                      # the reader is gone before kvblock writes
    try:
        res = subprocess.run([sys.executable, "-m", "kvblock", "plan", "--model-layers", "32",
                              "--kv-heads", "8", "--head-dim", "128", "--tokens", "8192",
                              "--device-gbps", "7", *fmt],
                             stdout=w, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             stdin=subprocess.DEVNULL, timeout=60)
    finally:
        os.close(w)
    assert (res.returncode, res.stderr) == (1, "")


def test_serve_that_cannot_print_its_ready_line_stops_the_server_it_opened(tmp_path):
    """``kvblock serve --json`` whose stdout fails (a full device here; a
    launcher's pipe closed early does the same) exited with the server it had
    opened never stopped: its socket was left behind, a stale one, and the
    store not closed (as after a crash).  It now stops the server (its
    socket removed) before the one-line error."""
    store = tmp_path / "st.img"
    assert kvb("format", store, "--size", "8M", *GEOM_ARGS).returncode == 0
    sock = tmp_path / "s.sock"
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "kvblock", "serve", str(store), "--socket",
                              str(sock), "--json"], stdout=full, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT, timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 1, res.stderr
    assert "kvblock: error: " in res.stderr and "No space left" in res.stderr, res.stderr
    assert not sock.exists(), "the stopped server's socket was left behind"
    assert "stopped" in res.stderr, res.stderr


def test_trim_of_a_full_store_on_a_device_that_keeps_its_space_is_not_supported(shm_target):
    """With no free region (a cache store in steady state: eviction frees
    regions only as puts need them) trim discards none and tried none:
    "supported" was 0 == 0, true, and the note left out, on a store file
    on tmpfs read through a mapping, which never releases a region's
    space.  With nothing tried, supported says what the devices would do."""
    path = shm_target(16 << 20)
    assert kvb("format", path, *GEOM_ARGS, "--region-size", "256K").returncode == 0
    with KVStore.open([path]) as store:
        i = 0
        while store.stats()["regions_free"]:
            store.put_run(run_keys(i, 16), run_data(run_keys(i, 16)))
            i += 1
    res = kvb("trim", path, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["regions_trimmed"] == out["free_regions"] == 0, out
    assert out["supported"] is False, out
    assert "KVBLOCK_MAPPED_READS=never" in out["note"], out


def test_trim_of_a_full_store_file_whose_filesystem_cannot_punch_holes_is_not_supported(
        file_target, monkeypatch):
    """A full store (no free region: nothing tried) in a file on a
    filesystem without hole punching (ext2, vfat, older NFS: fallocate
    says EOPNOTSUPP, here made so).  Every file's DeviceInfo says discard,
    so trim said supported: true for any file, though a trim with free
    regions there discards none (supported: false)."""
    import errno

    import kvblock.devices.device as device

    path = file_target(16 << 20)
    assert kvb("format", path, *GEOM_ARGS, "--region-size", "256K").returncode == 0

    def no_punch(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(device, "_punch_hole", no_punch)
    res = kvb("trim", path, "--json")          # free regions: tried, none discarded
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["regions_trimmed"] == 0 < out["free_regions"] and out["supported"] is False
    with KVStore.open([path]) as store:
        i = 0
        while store.stats()["regions_free"]:
            store.put_run(run_keys(i, 16), run_data(run_keys(i, 16)))
            i += 1
    res = kvb("trim", path, "--json")          # none free: what the file would do
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["regions_trimmed"] == out["free_regions"] == 0, out
    assert out["supported"] is False, out
    monkeypatch.undo()                         # a filesystem that punches holes
    out = json.loads(kvb("trim", path, "--json").stdout)
    assert out["free_regions"] == 0 and out["supported"] is True, out


def test_stats_prometheus_stops_serving_on_ctrl_c(file_target, monkeypatch):
    """Ctrl-C ended `stats --prometheus` but left its HTTP server thread
    serving the port and its collector registered: in a process that goes
    on (the CLI called in-process), the port stayed taken and a second
    `stats --prometheus` failed with a DuplicateTimeseries traceback.  On
    the way out the exporter now shuts its server and unregisters."""
    import socket
    import threading

    import prometheus_client.core

    from kvblock.cli import admin

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    registry = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(prometheus_client.core, "REGISTRY", registry)

    def ctrl_c(seconds):               # the CLI's wait once serving
        raise KeyboardInterrupt
    monkeypatch.setattr(admin.time, "sleep", ctrl_c)
    with socket.socket() as s:         # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for _ in range(2):                 # the second run finds the port and registry free
        res = kvb("stats", path, "--prometheus", str(port))
        assert res.returncode == 130, res.stderr
        assert "serving metrics" in res.stderr
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, "still serving after Ctrl-C"
        assert prometheus_client.generate_latest(registry) == b""
    assert not [t for t in threading.enumerate() if "serve_forever" in t.name]


def test_stats_through_a_server_shows_the_read_errors_its_clients_reported(tmp_path):
    """A rank's read that fails with EIO drops the run on the server, which
    counts it in its read_errors (as checksum_failures for a bad checksum).
    `stats --socket` (and its Prometheus export) left read_errors out with
    the read counters the server never sees: a failing device showed
    nowhere, while checksum failures did."""
    from kvblock import create_file
    from kvblock.cli.admin import _server_stats
    from kvblock.errors import IOFailedError
    from kvblock.metrics import StoreCollector
    from kvblock.store.client import RemoteStore
    from kvblock.store.server import serve_in_background
    from tests.store.workload import GEOM, REGION
    from tests.support.faults import BadSectors

    path = str(tmp_path / "s.img")
    create_file(path, 16 << 20)
    KVStore.format([path], GEOM, region_size=REGION).close()
    sock = str(tmp_path / "kv.sock")
    keys = run_keys(3, 4)
    with serve_in_background([path], sock) as server, RemoteStore(sock) as rank:
        assert rank.put_run(keys, run_data(keys)) == 4
        (run,) = server.store.index.runs.values()
        bad = BadSectors()
        bad.add(*rank.regions.address(run.region, run.offset), GEOM.block_bytes)
        bad.install(rank)
        with pytest.raises(IOFailedError, match="EIO"):
            rank.get_run(keys, np.zeros(4 * GEOM.block_bytes, np.uint8))
        assert server.store.counters["read_errors"] == 1
        res = kvb("stats", "--socket", sock, "--json")
        stats = _server_stats(sock)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout).get("read_errors") == 1, res.stdout
    families = {f.name.removeprefix("kvblock_store_"): f
                for f in StoreCollector(lambda: stats).collect()}
    assert families["read_errors"].type == "counter"
    assert families["read_errors"].samples[0].value == 1
    assert "get_blocks" not in families          # the reads themselves: the ranks'


def test_fsck_of_a_store_whose_checkpoints_cannot_be_read_is_unusable(file_target,
                                                                      monkeypatch):
    """Both checkpoint slots unreadable (EIO): the open fails with the I/O
    error, and fsck printed no report at all (--json: no JSON), only the
    general one-line error; it is an unusable store, reported as one with
    the I/O error's exit code (9)."""
    from kvblock.format.superblock import pick
    from kvblock.store import store as store_mod
    from tests.support.faults import BadSectors

    path = file_target(16 << 20)
    formatted(path)
    with open(path, "rb") as f:
        sb = pick([f.read(4096), f.read(4096)], path)
    bad = BadSectors()
    bad.add(0, sb.checkpoint_offset, 2 * sb.checkpoint_bytes)
    monkeypatch.setattr(store_mod, "StoreIO", bad.factory())
    res = kvb("fsck", path, "--json")
    out = json.loads(res.stdout)
    assert res.returncode == 9 and out["status"] == "unusable", res.stderr
    assert len(out["problems"]) == 1 and "EIO" in out["problems"][0]
    res = kvb("fsck", path)
    assert res.returncode == 9 and "unusable" in res.stdout


@pytest.mark.parametrize("extra", [["--interval", "1"], ["--address", "0.0.0.0"]])
def test_stats_refuses_prometheus_options_without_prometheus(file_target, extra):
    """--interval and --address only shape the --prometheus exporter; without
    it they were accepted and ignored (one read, printed, exit 0), so
    `kvblock stats DEV --interval 1` looked like a refresh that never came.
    A usage error names the option and --prometheus."""
    path = file_target(16 << 20)
    formatted(path)
    res = kvb("stats", path, *extra, "--json")
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert extra[0] in res.stderr and "--prometheus" in res.stderr, res.stderr
    assert res.stdout == ""


def test_evict_older_than_capital_m_is_refused_not_taken_for_minutes():
    """--older-than 1M was lower-cased and read as one minute: an operator
    who meant a month (systemd's M), or a size (--bytes 1M is a MiB in the
    same command), evicted every region sealed more than a minute ago.  An
    upper-case M is refused with the units that say either; 1H, 7D, 90S
    (no other meaning) are still taken."""
    for bad in ("1M", "30M", "1.5M"):
        res = kvb("evict", "/nonexistent/kv.img", "--older-than", bad)
        assert res.returncode == 2, (bad, res.stdout, res.stderr)
        assert "Invalid value for '--older-than'" in res.stderr and bad in res.stderr, res.stderr
        assert "30m" in res.stderr and "d" in res.stderr, res.stderr
    from kvblock.cli.admin import _duration

    assert [_duration(t) for t in ("1H", "7D", "90S", "30m")] == [3600, 7 * 86400, 90, 1800]


def test_a_model_name_that_is_not_utf8_is_a_usage_error(tmp_path):
    """--model whose bytes are no UTF-8 (a name typed or exported in a
    Latin-1 locale: Python hands it over with surrogates) went to the model
    fingerprint and came out as a UnicodeEncodeError traceback, exit 1
    (format, info, serve).  A usage error names the option."""
    store = tmp_path / "st.img"
    latin1 = os.fsdecode(b"caf\xe9")           # what argv holds for those bytes
    res = kvb("format", store, "--size", "8M", *GEOM_ARGS, "--model", latin1)
    assert res.returncode == 2 and "--model" in res.stderr and "UTF-8" in res.stderr, res.stderr
    assert not store.exists()
    assert kvb("format", store, "--size", "8M", *GEOM_ARGS).returncode == 0
    res = kvb("info", store, "--model", latin1)
    assert res.returncode == 2 and "--model" in res.stderr and "UTF-8" in res.stderr, res.stderr


def test_stats_prometheus_on_a_mistyped_address_is_one_line(file_target, monkeypatch):
    """--address 10.0..1 (a typo) or a name with a label over 63 characters
    failed in the socket module's IDNA encoding with a UnicodeError, which
    is no OSError: a traceback, exit 1, and the collector left registered.
    It is the one-line "cannot serve metrics" error (exit 8) a port in use
    gets, and a second try does not collide with the first."""
    import prometheus_client
    import prometheus_client.core

    path = file_target(16 << 20)
    kvb("format", path, *GEOM_ARGS)
    registry = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(prometheus_client.core, "REGISTRY", registry)
    for address in ("10.0..1", "a" * 64 + ".example", "10.0..1"):
        res = kvb("stats", path, "--prometheus", "9400", "--address", address)
        one_line_error(res, 8, "cannot serve metrics on port 9400", address, "--address")
    assert not registry._collector_to_names


def test_fsck_of_an_unusable_store_lets_go_of_the_devices_it_claimed(file_target):
    """fsck claims the devices itself and hands them to KVStore.open, whose
    failure leaves a caller's Devices to the caller: fsck of a store it
    found unusable kept them open, flocked (in a process that goes on, as
    click's runner is: a second fsck or a format of the device was refused
    as "locked by another kvblock store")."""
    blank = file_target(16 << 20)
    before = sorted(os.listdir("/proc/self/fd"))
    for flags in ([], ["--repair"], ["--json"]):
        res = kvb("fsck", blank, *flags)
        assert res.returncode == 11 and "unusable" in res.stdout, (res.stdout, res.stderr)
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert kvb("format", blank, *GEOM_ARGS).returncode == 0


def test_a_size_too_small_for_a_new_store_file_says_what_was_asked_and_the_least(tmp_path):
    """`format FILE --size 100` said "0 bytes cannot hold metadata" (the
    size rounded down to whole 4 KiB blocks), a size nobody gave, and named
    no size that would do; `--size 0` was answered with the library's
    create_file message ("e.g. 1 << 30"), not in the command's terms.  Both
    now name the --size asked and the least one that formats, before any
    file is made."""
    new = str(tmp_path / "new.img")
    for asked in ("100", "0", str(1 << 20)):
        res = kvb("format", new, "--size", asked, *GEOM_ARGS)
        one_line_error(res, 7, f"--size {asked} ")
        assert "create_file" not in res.stderr and ": 0 bytes" not in res.stderr
        assert not os.path.exists(new)
        least = int(res.stderr.split("at least ")[1].split()[0])
        assert 1 << 20 < least < 16 << 20
    assert kvb("format", new, "--size", str(least - 4096), *GEOM_ARGS).returncode == 7
    assert not os.path.exists(new)
    res = kvb("format", new, "--size", str(least), *GEOM_ARGS, "--json")
    assert res.returncode == 0, res.stderr
    # and with a --region-size of its own: its own least
    os.unlink(new)
    res = kvb("format", new, "--size", "100", "--region-size", "64K", *GEOM_ARGS)
    one_line_error(res, 7, "--size 100 ")
    small = int(res.stderr.split("at least ")[1].split()[0])
    assert small < least
    assert kvb("format", new, "--size", str(small), "--region-size", "64K",
               *GEOM_ARGS).returncode == 0


# A model whose run's journal record of one block needs an 8 MiB journal (a
# store's is 1/128 of its space), and one whose needs more than any (64 MiB).
_BIG_RECORD = ["--layers", "4096", "--kv-heads", "64", "--head-dim", "8",
               "--block-tokens", "1", "--head-groups", "64"]
_HUGE_RECORD = ["--layers", "65536", *_BIG_RECORD[2:]]


def test_format_of_a_device_too_small_names_what_the_operator_can_change(file_target,
                                                                         tmp_path):
    """`kvblock format` on an existing device too small for the store, or
    for a model whose journal record is too large, showed the library's
    advice: "use a larger device or a smaller region_size", or "journal_bytes
    1048576 is too small ...", settings the command does not take.  The
    refusal names a larger device, --region-size where a smaller one would
    do, and a smaller model where no device would."""
    small = file_target(4 << 20)
    res = kvb("format", small, *GEOM_ARGS, "--region-size", "4M")
    one_line_error(res, 7, small, "cannot hold metadata", "larger device", "--region-size")
    assert "region_size" not in res.stderr, res.stderr
    tiny = file_target(1 << 20)            # too small for the metadata, whatever the regions
    res = kvb("format", tiny, *GEOM_ARGS)
    one_line_error(res, 7, tiny, "cannot hold metadata", "larger device")
    assert "region" not in res.stderr.split("; ", 1)[1], res.stderr
    target = file_target(64 << 20)
    res = kvb("format", target, *_BIG_RECORD)
    one_line_error(res, 7, target, "larger device", "at least ")
    assert "journal_bytes" not in res.stderr, res.stderr
    least = int(res.stderr.split("at least ")[1].split()[0])
    assert 64 << 20 < least < 4 << 30
    res = kvb("format", target, *_HUGE_RECORD)
    one_line_error(res, 8, "smaller model", "--layers")
    assert "journal_bytes" not in res.stderr and "larger device" not in res.stderr, res.stderr
    # a new file of a --size too small: the least --size, as for regions
    new = str(tmp_path / "new.img")
    res = kvb("format", new, "--size", "64M", *_BIG_RECORD)
    one_line_error(res, 7, new, "--size 67108864 is too small", f"give --size {least} or more")
    assert "journal_bytes" not in res.stderr and not os.path.exists(new), res.stderr
    res = kvb("format", new, "--size", "64M", *_HUGE_RECORD)
    one_line_error(res, 8, "smaller model")
    assert "journal_bytes" not in res.stderr and not os.path.exists(new), res.stderr


# Blocks of 4 bytes: a store's checkpoint keeps 16 bytes per block its space
# could hold in each of two slots, so its metadata outgrows any device.
_TINY_BLOCKS = ["--layers", "1", "--kv-heads", "1", "--head-dim", "1", "--dtype", "float16",
                "--block-tokens", "1"]


def test_format_of_a_model_of_blocks_too_small_for_any_store_says_so(tmp_path, file_target):
    """A model of blocks under ~32 bytes was refused with exit 7 and the
    sizes of the planner's 2**60-byte probe under an empty path (": 1152921504606846976
    bytes cannot hold metadata ..."), neither the operator's device nor a
    fix.  Now: exit 8, the model's block size, the least a store takes, and
    the fix (more tokens per block or larger heads), for a new file as for
    an existing one, before any file is made."""
    new = str(tmp_path / "new.img")
    existing = file_target(64 << 20)
    for args in ([new, "--size", "1M"], [existing]):
        res = kvb("format", *args, *_TINY_BLOCKS)
        one_line_error(res, 8, "blocks of 4 bytes", "at least ", "tokens per block",
                       "larger heads")
        assert str(1 << 60) not in res.stderr and "error: :" not in res.stderr, res.stderr
        assert "larger device" not in res.stderr, res.stderr
        assert not os.path.exists(new)
        least = int(res.stderr.split("at least ")[1].split()[0])
        assert 4 < least <= 64


def test_format_with_a_region_size_no_device_holds_two_of_names_the_region_size(tmp_path,
                                                                                file_target):
    """A --region-size no device up to the planner's largest holds two of
    (512P) was refused with "use a larger device or a smaller --region-size"
    (none is large enough), and a new file was made and removed before the
    refusal.  Now the --region-size is named as the fix, before any file is
    made."""
    new = str(tmp_path / "new.img")
    for args in ([new, "--size", "64M"], [file_target(64 << 20)]):
        res = kvb("format", *args, "--region-size", "524288T", *GEOM_ARGS)
        one_line_error(res, 8, "--region-size 576460752303423488 is too large", "the least is")
        assert "larger device" not in res.stderr, res.stderr
        assert not os.path.exists(new)


def test_serve_with_a_socket_on_a_read_only_filesystem_names_the_socket_path(tmp_path):
    """--socket in a directory where the write fence beside it cannot be
    made (a read-only filesystem) surfaced the bare OSError, "X.sock.fence:
    Read-only file system", as exit 17 (a read-only store, which the store
    is not), with no fix.  It is the --socket path that is wrong: exit 8,
    as a socket that cannot be bound, naming it and what to do."""
    store = tmp_path / "st.img"
    assert kvb("format", store, "--size", "8M", *GEOM_ARGS).returncode == 0
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        res = kvb("serve", store, "--socket", ro / "kv.sock")
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    one_line_error(res, 8, str(ro / "kv.sock"), "read-only file system",
                   "choose another --socket path")
    assert kvb("fsck", store).returncode == 0


def test_serve_with_a_socket_in_a_directory_that_takes_no_files_says_so(tmp_path):
    """A --socket directory nobody may create files in (here an immutable
    one: EPERM even for root, as EACCES is for a user in another's folder)
    was said to hold a fence file "left by a server run as another user?":
    there is none; the directory is what refuses."""
    store = tmp_path / "st.img"
    assert kvb("format", store, "--size", "8M", *GEOM_ARGS).returncode == 0
    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        pytest.skip("no immutable directories on this filesystem (chattr +i)")
    try:
        res = kvb("serve", store, "--socket", locked / "kv.sock")
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    one_line_error(res, 4, str(locked / "kv.sock"), "in its directory",
                   "choose another --socket path")
    assert "another user?" not in res.stderr and not os.listdir(locked)


def test_serve_where_the_fence_exists_but_cannot_be_opened_does_not_say_cannot_create(tmp_path):
    """The write fence beside --socket there already (a directory of that
    name, or the fence of an earlier server on a filesystem now read-only)
    was said to be one the server "cannot create": it can't open it, and a
    directory in its place is what to remove.  Exit 8 as before (the
    --socket path is wrong), the message says what is there."""
    store = tmp_path / "st.img"
    assert kvb("format", store, "--size", "8M", *GEOM_ARGS).returncode == 0
    (tmp_path / "kv.sock.fence").mkdir()
    res = kvb("serve", store, "--socket", tmp_path / "kv.sock")
    one_line_error(res, 8, f"cannot open {tmp_path / 'kv.sock.fence'}", "a directory",
                   "choose another --socket path")
    assert "cannot create" not in res.stderr, res.stderr
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ro)], check=True)
    try:
        (ro / "kv.sock.fence").write_bytes(b"")      # an earlier server's
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        res = kvb("serve", store, "--socket", ro / "kv.sock")
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    one_line_error(res, 8, f"cannot open {ro / 'kv.sock.fence'} for writing",
                   "read-only file system", "choose another --socket path")
    assert "cannot create" not in res.stderr, res.stderr
    assert kvb("fsck", store).returncode == 0


def test_format_of_a_store_file_at_a_path_where_none_can_be_made_is_a_bad_argument(tmp_path):
    """`kvblock format /proc/x --size 8M` (a folder that takes no files:
    ENOENT) exited 9, an I/O error, which nothing failed: the path
    given is wrong.  Exit 8 (bad argument), naming the path and the fix; a
    read-only filesystem is exit 17, as opening a store file there is.
    Still DeviceErrors (OSErrors with .path and .errno) for create_file's callers."""
    from kvblock import errors
    from kvblock.devices import create_file

    (tmp_path / "plain").write_bytes(b"")
    for path in ("/proc/kvblock-no-such-file", tmp_path / "plain" / "kv.img"):
        res = kvb("format", path, "--size", "8M", *GEOM_ARGS)
        one_line_error(res, 8, f"{path}: cannot create the store file", "choose another path")
    with pytest.raises(errors.DeviceError) as e:
        create_file("/proc/kvblock-no-such-file", 4096)
    assert isinstance(e.value, errors.ConfigError) and e.value.errno == errno.ENOENT
    assert e.value.path == "/proc/kvblock-no-such-file"
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        res = kvb("format", ro / "kv.img", "--size", "8M", *GEOM_ARGS)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    one_line_error(res, 17, f"{ro / 'kv.img'}: cannot create the store file", "EROFS")


def test_a_loop_device_attached_read_only_is_not_told_blockdev_setrw(tmp_path):
    """A loop device attached with losetup -r was told "`blockdev --setrw
    DEV` first": the ioctl succeeds and the device stays read-only (the
    kernel's read-only flag of the loop disk; checked on a real device
    here), so the advice could not be taken.  The fix said is to detach it
    and attach its file again read-write."""
    ok, why = loopdev.can_make_loop_devices()
    if not ok:
        pytest.skip(why)
    with loopdev.backing_file(16 << 20) as backing:
        dev = subprocess.run(["losetup", "-r", "-f", "--show", str(backing)], check=True,
                             capture_output=True, text=True).stdout.strip()
        try:
            subprocess.run(["blockdev", "--setrw", dev], check=True)   # the advice given
            assert subprocess.run(["blockdev", "--getro", dev], capture_output=True,
                                  text=True).stdout.strip() == "1"       # ... does nothing
            res = kvb("format", dev, *GEOM_ARGS, "--yes")
        finally:
            loopdev.detach(dev)
    one_line_error(res, 17, dev, "attached read-only", f"losetup -d {dev}",
                   f"losetup -f --show --direct-io=on {backing}")
    assert f"blockdev --setrw {dev}" not in res.stderr, res.stderr


def test_a_path_with_a_trailing_slash_is_a_folder_not_a_missing_device(tmp_path, loop_device):
    """`kvblock format /var/lib/kvblock/ --size 8M` (a folder's path, a
    slash at its end) created the file /var/lib/kvblock (pathlib drops the
    slash), failed to open the path as given (ENOTDIR) and removed it:
    exit 3, "no such device or file; check the path (create a store file
    with `kvblock format FILE --size SIZE ...`)", the very command run.
    A path no file can be made at is a bad argument (exit 8) naming the
    slash.  And `kvblock info /dev/loopN/` said "/dev/loopN: no such
    device (lsblk lists the block devices)" of a device that exists."""
    from kvblock import errors
    from kvblock.devices import create_file

    folder = tmp_path / "kvblock"
    res = kvb("format", f"{folder}/", "--size", "8M", *GEOM_ARGS)
    one_line_error(res, 8, f"{folder}/", "ends in /", "file name")
    assert "--size SIZE" not in res.stderr, res.stderr
    assert not folder.exists()
    with pytest.raises(errors.DevicePathError):
        create_file(f"{folder}/", 4096)
    assert not folder.exists()
    store = tmp_path / "kv.img"                    # a file before the slash: left as it is
    store.write_bytes(b"x" * 4096)
    one_line_error(kvb("format", f"{store}/", "--size", "8M", *GEOM_ARGS), 8, f"give {store}")
    assert store.read_bytes() == b"x" * 4096
    dev = loop_device(16 << 20)
    for cmd in ("info", "fsck"):
        res = kvb(cmd, f"{dev}/")
        one_line_error(res, 3, f"{dev}/", "ends in /", f"give {dev}")
        assert "lsblk" not in res.stderr, res.stderr


def test_an_empty_device_path_is_said_empty(tmp_path):
    """`kvblock info "$DEV"` with DEV unset said ": no such device or file;
    check the path", naming nothing; `kvblock format "" --size 8M` the
    same, after create_file took "" for the current folder.  Each says the
    path is empty (exit 3, as a missing device), and nothing is made."""
    for args in (("info", ""), ("fsck", ""), ("format", "", "--size", "8M", *GEOM_ARGS),
                 ("bench", "", "--size", "8M", "--seconds", "0.1")):
        res = subprocess.run([sys.executable, "-m", "kvblock", *map(str, args)],
                             capture_output=True, text=True, cwd=tmp_path, timeout=60,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 [ROOT, os.environ.get("PYTHONPATH", "")])},
                             stdin=subprocess.DEVNULL)
        one_line_error(res, 3, "the device path is empty")
        assert "error: :" not in res.stderr, res.stderr
    assert not os.listdir(tmp_path)


@contextlib.contextmanager
def _small_tmpfs(tmp_path, size="16m"):
    """A folder on a tmpfs of ``size`` mounted for the test (unmounted after)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                   check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.parametrize("command", [("format", *GEOM_ARGS), ("bench", "--workload", "write"),
                                     ("bench", "--workload", "save")])
def test_a_size_larger_than_the_filesystems_free_space_is_too_small_not_an_io_error(
        tmp_path, command):
    """`format FILE --size S` (and bench's --size) with S past the free
    space of FILE's filesystem exited 9, an I/O error, though nothing
    failed: it is a size that does not fit (exit 7, as a --size too small
    for the store), refused naming the free space and the fixes, and no
    file is left behind."""
    with _small_tmpfs(tmp_path) as small:
        new = small / "kv.img"
        res = kvb(command[0], new, "--size", "64M", *command[1:],
                  *(["--seconds", "0.1"] if command[0] == "bench" else []))
        one_line_error(res, 7, str(new), "67108864 bytes", "bytes are free",
                       "smaller size", "another filesystem")
        assert os.listdir(small) == []


def test_serve_on_a_socket_another_server_listens_on_is_busy_not_a_bad_argument(tmp_path):
    """`kvblock serve --socket PATH` where a store server already listens on
    PATH exited 8 (bad argument), while the same store served on another
    socket is exit 5 (busy, as every command on a store in use): a socket
    in use is busy too, exit 5, and the server there is left serving."""
    from kvblock.store.client import RemoteStore
    from kvblock.store.server import serve_in_background

    served, other = tmp_path / "a.img", tmp_path / "b.img"
    for store in (served, other):
        assert kvb("format", store, "--size", "8M", *GEOM_ARGS).returncode == 0
    sock = str(tmp_path / "kv.sock")
    with serve_in_background([str(served)], sock):
        for store in (other, served):
            res = kvb("serve", store, "--socket", sock, process=True, timeout=30)
            one_line_error(res, 5, f"a store server already listens on {sock}")
        with RemoteStore(sock, timeout=10) as remote:
            assert remote.stats()["devices"] == [str(served)]


def test_a_mounted_device_is_refused_naming_where_it_is_mounted(loop_device, tmp_path):
    """The busy message of a mounted device said "mounted, or opened
    exclusively by another store or program ...; unmount it" without saying
    where, though /proc/self/mountinfo tells: it names the mount point and
    the command that frees it, for the device itself, its backing file and
    a second loop device over that file."""
    with _mounted_ext4(loop_device, tmp_path) as (dev, backing):
        mnt = str(tmp_path / "mnt")
        for command in (("format", dev, *GEOM_ARGS, "--yes", "--force"),
                        ("format", backing, *GEOM_ARGS, "--force"),
                        ("fsck", dev), ("trim", dev)):
            res = kvb(*command)
            one_line_error(res, 5, command[1], f"mounted at {mnt}", f"umount {mnt}")
        second = loopdev.attach(backing)
        try:
            res = kvb("format", second, *GEOM_ARGS, "--force", "--yes")
            one_line_error(res, 5, second, dev, f"mounted at {mnt}", f"umount {mnt}")
        finally:
            loopdev.detach(second)


def test_a_device_under_a_dm_or_md_device_is_refused_naming_it(loop_device, monkeypatch):
    """A device the kernel holds under a dm/md device stacked on it (LVM,
    dm-crypt, RAID: sysfs holders) names that device, not "mounted, or
    opened by another store or program" (the holders read as sysfs gives
    them: no device-mapper here to stack a real one)."""
    from kvblock.devices import device

    dev = loop_device(16 << 20)
    rdev = os.stat(dev).st_rdev
    monkeypatch.setattr(device, "_stacked_on", lambda r: ["/dev/dm-3 (/dev/mapper/vg-kv)"]
                        if r == rdev else [])
    fd = os.open(dev, os.O_RDONLY | os.O_EXCL)   # the kernel's claim, as a dm device's
    try:
        res = kvb("format", dev, *GEOM_ARGS, "--yes", "--force")
    finally:
        os.close(fd)
    one_line_error(res, 5, dev, "held by /dev/dm-3 (/dev/mapper/vg-kv)", "release it there")
    assert "mounted" not in res.stderr


@pytest.mark.parametrize("command", [("fsck", "--repair"), ("trim",), ("evict", "--all")])
def test_store_commands_on_the_file_under_a_mounted_loop_device_say_to_unmount_it(
        loop_device, tmp_path, command):
    """fsck --repair, trim and evict on the backing file of a mounted loop
    device replaced the device's advice (unmount it) with a store server's
    ("stop the store server ... or evict through it"): only a block device
    given itself was taken for one the kernel holds."""
    with _mounted_ext4(loop_device, tmp_path) as (dev, backing):
        res = kvb(command[0], backing, *command[1:])
        one_line_error(res, 5, backing, f"umount {tmp_path / 'mnt'}")
        assert "kvblock serve" not in res.stderr, res.stderr


def test_fsck_exit_codes_of_an_unusable_store_agree_in_readme_and_help(tmp_path):
    """`kvblock fsck --help` lists exit 7 (device too small) for a store it
    cannot open, as fsck of a shrunk store file exits, but README's fsck
    row did not: the codes both list for an unusable store are the same."""
    import re

    store = tmp_path / "kv.img"
    assert kvb("format", store, "--size", "16M", *GEOM_ARGS).returncode == 0
    os.truncate(store, 8 << 20)
    res = kvb("fsck", store)
    assert res.returncode == 7 and "unusable" in res.stdout and "shrank" in res.stdout, res
    helped = " ".join(kvb("fsck", "--help").stdout.split())
    helped = helped.split("exit code of its error (", 1)[1].split("...)", 1)[0]
    with open(os.path.join(ROOT, "README.md")) as f:
        row = next(line for line in f if line.startswith("| `kvblock fsck "))
    said = row.split("with that error's exit code (", 1)[1].split("; a path", 1)[0]
    codes = lambda text: {int(n) for n in re.findall(r"(?<![\w-])(\d+) [a-z]", text)}  # noqa: E731
    assert 7 in codes(helped) and codes(helped) <= codes(said), (helped, said)


def test_a_device_or_file_in_use_as_swap_is_refused_naming_swapoff(loop_device, tmp_path,
                                                                   monkeypatch):
    """An active swap area is the kernel's: a swap device was refused as
    busy with the advice "unmount it or stop the other user" (no mount, no
    process), and format --force over a swap file (which opens, the kernel
    refusing its writes) failed as an I/O error (exit 9, ETXTBSY) after
    saying it would format it.  Both are in use (exit 5), named as swap
    with the fix (swapoff), and nothing is written.  The kernel's swap list
    stood in (a real swapon would lend the test's device to the kernel's
    paging): a device held open exclusively, as the kernel holds a swap
    device, and a file, each listed there."""
    from kvblock.devices import device

    dev = loop_device(32 << 20)
    swapfile = tmp_path / "swapfile"
    swapfile.write_bytes(b"\xa5" * (1 << 20))
    swaps = tmp_path / "swaps"
    swaps.write_text("Filename\tType\tSize\tUsed\tPriority\n"
                     f"{dev}\tpartition\t32764\t0\t-2\n"
                     f"{str(swapfile).replace(' ', chr(92) + '040')}\tfile\t1020\t0\t-3\n")
    monkeypatch.setattr(device, "PROC_SWAPS", str(swaps))
    before = head(dev)
    held = os.open(dev, os.O_RDONLY | os.O_EXCL)     # as swapon holds it
    try:
        for command in (("format", dev, *GEOM_ARGS, "--yes", "--force"),
                        ("format", loopdev.backing_of(dev), *GEOM_ARGS, "--force"),
                        ("fsck", dev, "--repair"), ("trim", dev)):
            res = kvb(*command)
            one_line_error(res, 5, command[1], f"in use as swap: {dev}", f"swapoff {dev}")
            assert "unmount it" not in res.stderr, res.stderr
    finally:
        os.close(held)
    assert head(dev) == before
    for command in (("format", swapfile, *GEOM_ARGS, "--force"),
                    ("bench", swapfile, "--workload", "write", "--force", "--seconds", "0.1")):
        res = kvb(*command)
        one_line_error(res, 5, str(swapfile), f"in use as swap: {swapfile}",
                       f"swapoff {swapfile}")
    assert swapfile.read_bytes() == b"\xa5" * (1 << 20)
