import errno
import os
import threading

import numpy as np
import pytest

from kvblock.errors import ConfigError
from kvblock.memory import PAGE_SIZE, BufferPool, HostBuffer, aligned_empty
from kvblock.memory import registry
from kvblock.memory.pool import PoolExhaustedError


def test_host_buffer_is_aligned_and_registered():
    with HostBuffer(10_000) as buf:
        assert buf.address % PAGE_SIZE == 0
        assert buf.array.size == 10_000
        _, regions = registry.snapshot()
        assert (buf.address, 3 * PAGE_SIZE) in regions
    _, regions = registry.snapshot()
    assert all(addr != buf.address for addr, _ in regions)


def test_a_buffer_dropped_without_close_leaves_the_registry():
    """A thread's staging buffer is dropped, not closed, when the thread
    ends: its region must leave the registry (a stale one makes later rings'
    fixed-buffer registration fail), and a later close() of a buffer must
    not remove another buffer's region at a reused address."""
    import gc

    local = threading.local()
    seen = []

    def worker():
        local.buf = HostBuffer(1 << 20)
        seen.append(local.buf.address)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    del t
    gc.collect()
    _, regions = registry.snapshot()
    assert all(addr != seen[0] for addr, _ in regions)

    a = HostBuffer(1 << 20)
    a.close()
    b = HostBuffer(1 << 20)              # may be mapped where a was
    a.close()                            # closing again does nothing
    del a
    gc.collect()
    _, regions = registry.snapshot()
    assert (b.address, 1 << 20) in regions
    b.close()


def test_numpy_and_torch_views_share_memory():
    torch = pytest.importorskip("torch")
    with HostBuffer(4 * PAGE_SIZE) as buf:
        f = buf.numpy(np.float32, shape=(4, PAGE_SIZE // 4))
        t = buf.torch(torch.float32, shape=(4, PAGE_SIZE // 4))
        f[1, 3] = 2.5
        assert t[1, 3].item() == 2.5
        t[2, 0] = -1.0
        assert f[2, 0] == -1.0
        assert t.data_ptr() == buf.address
        del f, t


def test_views_past_a_buffers_end_are_refused():
    """A typed view must lie inside the buffer's nbytes: past them is the
    page's padding or the mapping's huge-page slack, memory no I/O of the
    buffer reaches (an offset past the end gave a non-empty view)."""
    torch = pytest.importorskip("torch")
    with HostBuffer(3 << 20) as buf:
        for view in (buf.numpy, buf.torch):
            dtype = torch.float32 if view == buf.torch else np.float32
            with pytest.raises(ConfigError, match=r"offset 3149824.*3145728-byte buffer"):
                view(dtype, offset=(3 << 20) + 4096)
            with pytest.raises(ConfigError, match=r"4194304 bytes at offset 0.*3145728-byte"):
                view(dtype, shape=(1 << 20,))
            with pytest.raises(ConfigError, match=r"offset -4096"):
                view(dtype, offset=-4096)
            assert len(view(dtype, offset=(3 << 20) - 8)) == 2
    with HostBuffer(100) as small:
        with pytest.raises(ConfigError, match=r"400 bytes at offset 8 .*100-byte buffer"):
            small.numpy(np.float32, shape=(100,), offset=8)


def test_a_view_shape_with_an_inferred_dim_stays_inside_the_buffer():
    """shape=(-1, ...) made the item count negative, which np.frombuffer and
    torch.frombuffer read as 'to the end of the mapping': a 100-byte
    buffer's (-1,) view was 4096 bytes long (the page padding, or a huge
    page's slack), memory no I/O of the buffer reaches.  A -1 now takes
    what fits in the buffer's nbytes (numpy's meaning); other negative dims,
    or a -1 the rest of the buffer does not fill, are ConfigErrors."""
    torch = pytest.importorskip("torch")
    with HostBuffer(100) as buf:
        for view in (buf.numpy, buf.torch):
            assert tuple(view(shape=(-1,)).shape) == (100,)
            assert tuple(view(shape=(-1, 4), offset=20).shape) == (20, 4)
            dtype = torch.int32 if view == buf.torch else np.int32
            assert tuple(view(dtype, shape=(5, -1)).shape) == (5, 5)
            with pytest.raises(ConfigError, match="shape"):
                view(shape=(-1, 3))           # 100 bytes are no whole number of rows of 3
            with pytest.raises(ConfigError, match="shape"):
                view(shape=(-2,))
            with pytest.raises(ConfigError, match="shape"):
                view(shape=(-1, -1))


@pytest.mark.parametrize("kwargs", [
    dict(shape=(2**32 + 1, 2**32 - 1)),        # 2**64 - 1 items: -1 in int64, 'the whole buffer'
    dict(shape=(2**32, 2**32)),                # 2**64 items: 0 in int64
    dict(shape=(2**32 + 1, 2**32 - 1, -1)),
    dict(shape=(2.5, 4)),                      # cut to (2, 4) silently
    dict(shape=(True, 8)),
    dict(offset=1.5),                          # checked as 1, then a bare TypeError
    dict(offset="8"),
])
def test_a_view_shape_or_offset_that_is_no_whole_number_of_items_is_a_config_error(kwargs):
    """Dims were multiplied in int64 (np.prod), so a shape of 2**64 - 1 items
    was counted -1 items and passed the bounds check (numpy then raised a
    bare 'cannot reshape' ValueError); float dims were cut to ints, and an
    offset was checked as int(offset) but passed on as given (1.5: a
    TypeError from np.frombuffer).  Each is now a ConfigError."""
    torch = pytest.importorskip("torch")
    with HostBuffer(8192) as buf:
        for view in (buf.numpy, buf.torch):
            with pytest.raises(ConfigError, match="shape|offset"):
                view(**kwargs)
        assert buf.numpy(shape=np.array([2, 4]), offset=np.int64(8)).shape == (2, 4)
        assert tuple(buf.torch(torch.int16, shape=(np.int32(3), -1), offset=8192 - 24).shape) \
            == (3, 4)


def test_an_empty_view_at_the_buffers_end_is_one_for_torch_too():
    """A view of no items (offset == nbytes, or a shape with a 0) lies inside
    the buffer and numpy() gives it, but torch() raised torch.frombuffer's
    bare ValueError ('both buffer length ... and count (0) must not be 0')."""
    torch = pytest.importorskip("torch")
    with HostBuffer(100) as buf:
        assert buf.numpy(offset=100).shape == (0,)
        assert tuple(buf.torch(offset=100).shape) == (0,)
        assert tuple(buf.torch(torch.int32, shape=(0, 4), offset=96).shape) == (0, 4)
        assert buf.torch(torch.int32, shape=(0, 4)).dtype == torch.int32


def test_a_0_d_view_is_one_for_torch_too():
    """shape=() is one item, as numpy() gives it (a 0-d array over the
    buffer's bytes); torch() raised a bare TypeError from Tensor.view()
    called with no dims."""
    torch = pytest.importorskip("torch")
    with HostBuffer(64) as buf:
        buf.numpy(np.int32)[:3] = [1, 2, 3]
        assert buf.numpy(np.int32, shape=(), offset=8)[()] == 3
        t = buf.torch(torch.int32, shape=(), offset=4)
        assert t.shape == () and t.item() == 2
        t.fill_(-5)
        assert buf.numpy(np.int32)[1] == -5
        del t


def test_a_torch_view_keeps_its_memory_mapped_after_close_as_a_numpy_view_does():
    """close() with a numpy view alive leaves the pages mapped until the view
    goes (mmap refuses the unmap while a buffer export is held).  A torch()
    view held no export (torch.frombuffer releases it at once): close()
    unmapped the memory under the tensor, and the next buffer mapped at
    that address showed through it, another buffer's bytes read and
    written silently."""
    torch = pytest.importorskip("torch")
    buf = HostBuffer(1 << 16)
    t = buf.torch(torch.int32, shape=(4, -1))
    t[:] = 7
    buf.close()
    others = [HostBuffer(1 << 16) for _ in range(4)]   # where buf was, were it unmapped
    for other in others:
        other.array[:] = 9
    assert bool((t == 7).all())
    t[0, 0] = 5
    assert all(int(other.array.max()) == 9 for other in others)
    for other in others:
        other.close()
    del t


def test_aligned_empty():
    a = aligned_empty((3, 1000), np.float16)
    assert a.ctypes.data % PAGE_SIZE == 0
    assert a.shape == (3, 1000) and a.dtype == np.float16
    a[:] = 1
    assert a.sum() == 3000


def test_bad_size():
    with pytest.raises(ConfigError):
        HostBuffer(0)
    with pytest.raises(ConfigError):
        BufferPool(4096, 0)


@pytest.mark.parametrize("size", [10 ** 20, 1 << 62, "4096", 1.5, True, None])
def test_a_size_no_buffer_can_have_is_a_config_error(size):
    """Past the address space (mmap: OverflowError or ENOMEM), not a whole
    number (a TypeError, or 1.5 cut to a 1-byte buffer): a ConfigError
    naming the size, not a bare error from deep inside."""
    with pytest.raises(ConfigError, match=repr(size) if size != 10 ** 20 else str(size)):
        HostBuffer(size)
    with pytest.raises(ConfigError):
        BufferPool(size, 2)
    with pytest.raises(ConfigError):
        BufferPool(4096, size)


@pytest.mark.parametrize("shape,dtype", [(-1, np.uint8), ((2, -3), np.uint8), (None, np.uint8),
                                         (1.5, np.uint8), (True, np.uint8), ((2.0, 3), np.uint8),
                                         ("ab", np.uint8), (4, "foo"), (4, object)])
def test_aligned_empty_refuses_a_shape_or_dtype_it_cannot_make(shape, dtype):
    """aligned_empty(-1) returned a 4096-byte array (a negative count read
    as 'the whole mapping'), (2, -3) a (2, 2048) one: arrays of a size
    nobody asked for, silently; None, 1.5, True, "ab", an unknown dtype or
    dtype object raised bare TypeErrors and ValueErrors.  Each is a
    ConfigError naming what was given, as numpy.empty refuses them."""
    with pytest.raises(ConfigError, match="aligned_empty"):
        aligned_empty(shape, dtype)
    assert aligned_empty(0).shape == (0,) and aligned_empty((2, 0), np.float32).shape == (2, 0)
    assert aligned_empty(np.int64(5)).shape == (5,) and aligned_empty([2, 3]).shape == (2, 3)
    assert aligned_empty(np.array([2, 3])).shape == (2, 3)


@pytest.mark.parametrize("shape,want", [(np.array(5), (5,)), (np.array(0), (0,)),
                                        ((np.array(2), 3), (2, 3)),
                                        (np.array([np.int64(4)]), (4,))])
def test_aligned_empty_takes_a_count_given_as_a_0d_array(shape, want):
    """A count that is a 0-d integer array (np.array(5), what numpy
    reductions and indexing of arrays hand back) is a shape numpy.empty
    takes, as aligned_empty did; 77b971b's check iterated it (a bare
    TypeError 'iteration over a 0-d array') or refused it as no whole
    number."""
    a = aligned_empty(shape, np.float32)
    assert a.shape == want and a.dtype == np.float32
    with pytest.raises(ConfigError, match="aligned_empty"):
        aligned_empty(np.array(-1))
    with pytest.raises(ConfigError, match="aligned_empty"):
        aligned_empty(np.array(2.5))


def test_pool_acquire_release_and_exhaustion():
    with BufferPool(5000, 2) as pool:
        assert pool.buffer_bytes == 2 * PAGE_SIZE
        a = pool.acquire()
        b = pool.acquire()
        assert {a, b} == {0, 1}
        assert pool.address_of(1) - pool.address_of(0) == pool.buffer_bytes
        assert pool.address_of(a) % PAGE_SIZE == 0
        with pytest.raises(PoolExhaustedError, match="all 2 buffers"):
            pool.acquire(timeout=0.01)
        threading.Timer(0.05, pool.release, args=(a,)).start()
        assert pool.acquire(timeout=2) == a
        pool.release(a)
        pool.release(b)
        with pool.buffer() as (idx, view):
            view[:] = 7
            assert view.size == pool.buffer_bytes
        assert pool.free == 2


def test_pool_refuses_a_double_release_and_views_outside_a_buffer():
    """A buffer released twice would be handed to two callers at once; a
    view past a buffer's end would reach into the next one."""
    with BufferPool(4096, 2) as pool:
        a = pool.acquire()
        pool.release(a)
        with pytest.raises(ConfigError, match="not in use"):
            pool.release(a)
        assert pool.free == 2
        assert {pool.acquire(), pool.acquire()} == {0, 1}
        with pytest.raises(ConfigError, match="buffer 2"):
            pool.release(2)
        with pytest.raises(ConfigError, match="buffer 5"):
            pool.view(5)
        with pytest.raises(ConfigError, match="8192 bytes"):
            pool.view(0, 8192)
        assert pool.view(1, 100).size == 100
        # an address outside the arena: an I/O into it would overwrite other memory
        for bad in (2, -1):
            with pytest.raises(ConfigError, match=rf"no pool buffer {bad}: the pool has 2"):
                pool.address_of(bad)
        assert pool.address_of(1) == pool.arena.address + pool.buffer_bytes



@pytest.mark.parametrize("bad", [1.0, 1.5, None, True, "1"])
def test_a_pool_index_that_is_no_whole_number_is_refused(bad):
    """A buffer index was only range-checked: release(1.0) put the float
    1.0 on the free list (the next acquire() handed it out, and view() of
    it was a bare TypeError), address_of(1.5) returned an address half a
    buffer into buffer 1 (a float), and None or "1" raised a bare
    TypeError.  Each is a ConfigError naming the index, and the pool's
    free list stays as it was."""
    with BufferPool(PAGE_SIZE, 2) as pool:
        held = {pool.acquire(), pool.acquire()}
        calls = [pool.release, pool.address_of, pool.view]
        if bad is not None:                  # view(0, None): the whole buffer
            calls.append(lambda i: pool.view(0, i))
        for call in calls:
            with pytest.raises(ConfigError, match=rf"{bad!r}"):
                call(bad)
        assert pool.free == 0
        for i in held:
            pool.release(i)
        got = [pool.acquire(), pool.acquire()]
        assert sorted(got) == [0, 1] and all(type(i) is int for i in got)
        assert pool.address_of(np.int64(1)) == pool.arena.address + pool.buffer_bytes


def test_a_finalizer_run_inside_the_registrys_lock_does_not_deadlock(monkeypatch):
    """A buffer dropped without close() leaves the registry from a finalizer,
    which the garbage collector may run at any allocation: also inside the
    registry's own critical section (snapshot()'s sort), on the thread that
    holds its lock.  That hung a crash test for good (a plain Lock taken
    twice by one thread); the removal now waits for the end of the section."""
    fake_a, fake_b = 1 << 47, (1 << 47) + (1 << 30)    # never mapped: only listed

    class CollectedMidway(dict):
        def items(self):
            registry.remove(fake_b)        # what a finalizer run by the GC here does
            return super().items()

    removals = []
    monkeypatch.setattr(registry, "_regions", CollectedMidway(registry._regions))
    monkeypatch.setattr(registry, "_on_remove", [lambda: removals.append(1)])
    registry.add(fake_a, 4096)
    registry.add(fake_b, 8192)
    out = []
    t = threading.Thread(target=lambda: out.append(registry.snapshot()), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "snapshot() deadlocked on a removal from inside its own section"
    version, regions = out[0]
    after, now = registry.snapshot()
    assert (fake_b, 8192) not in now and (fake_a, 4096) in now
    assert after > version and removals
    registry.remove(fake_a)
    assert all(addr != fake_a for addr, _ in registry.snapshot()[1])


def test_a_closed_buffer_or_pool_hands_out_no_view_or_address():
    """After close() a HostBuffer's numpy() raised TypeError ('a bytes-like
    object is required, not NoneType'), a BufferPool's view() TypeError
    ('NoneType' object is not subscriptable), and its acquire() and
    address_of() handed out the address of memory already unmapped, which
    a buffer mapped since may occupy: I/O there lands in someone else's
    bytes.  Each now raises a ConfigError that says it is closed."""
    buf = HostBuffer(2 * PAGE_SIZE)
    buf.close()
    with pytest.raises(ConfigError, match="closed"):
        buf.numpy()
    pool = BufferPool(PAGE_SIZE, 2)
    index = pool.acquire()
    pool.close()
    pool.close()                          # twice: nothing more
    with pytest.raises(ConfigError, match="closed"):
        pool.view(index)
    with pytest.raises(ConfigError, match="closed"):
        pool.address_of(index)
    with pytest.raises(ConfigError, match="closed"):
        pool.acquire(timeout=0)
    pool.release(index)                   # giving one back after close is harmless


def test_close_wakes_a_thread_waiting_for_a_pool_buffer():
    """close() did not wake acquire(): a thread waiting for a buffer of a
    pool closed meanwhile waited out its whole timeout (for good with none)
    and then raised PoolExhaustedError, or, woken by a release after the
    close, was handed a buffer of unmapped memory.  It now raises the
    closed pool's ConfigError at once."""
    pool = BufferPool(PAGE_SIZE, 1)
    held = pool.acquire()
    got = []

    def waiter():
        try:
            got.append(pool.acquire(timeout=10))
        except Exception as e:   # noqa: BLE001 - what it raised is the point
            got.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    try:
        while not pool._cond._waiters:      # the waiter is inside acquire()'s wait
            t.join(0.001)
        pool.close()
        t.join(2)
        assert not t.is_alive()
    finally:
        pool.release(held)                  # (before the fix: ends the waiter)
        t.join()
    assert len(got) == 1 and isinstance(got[0], ConfigError) and "closed" in str(got[0])


def test_a_child_forked_while_a_thread_holds_the_registry_makes_and_frees_buffers():
    """The registry's lock is one for the process, taken by every buffer
    made or closed and by every io_uring ring re-registering.  A child
    forked while another thread held it (that thread making a staging
    buffer, say) kept it held for good: the child's first HostBuffer (a
    store it opens again, as README says to) or its close() of a copy's
    buffers waited forever.  A removal the holder had deferred (a
    finalizer run inside its section) must still leave the child's list."""
    from tests.support.servers import exit_code_in_child

    gone = HostBuffer(PAGE_SIZE)
    held, go = threading.Event(), threading.Event()

    def holding():                  # caught inside the registry's section at the fork
        with registry._Section():
            registry.remove(gone.address)       # deferred: this thread holds the section
            held.set()
            go.wait(20)
    t = threading.Thread(target=holding)
    t.start()
    try:
        assert held.wait(10)

        def child():
            with HostBuffer(10_000) as buf:
                if (buf.address, 3 * PAGE_SIZE) not in registry.snapshot()[1]:
                    return 1
            if any(a == gone.address for a, _ in registry.snapshot()[1]):
                return 2
            return 0
        assert exit_code_in_child(child, timeout=10) == 0
    finally:
        go.set()
        t.join(20)
        gone.close()
    assert all(a != gone.address for a, _ in registry.snapshot()[1])


def test_a_child_forked_while_a_thread_takes_a_pool_buffer_uses_its_copy_of_the_pool():
    """A child forked while another thread was inside the pool's condition
    (acquire() handing out a buffer, release() giving one back) kept it
    held for good: the child's acquire() waited forever, its timeout
    unheeded (the wait for the lock is not the wait for a buffer), and so
    did its release() and free.  The child's copy gets a fresh condition."""
    from tests.support.servers import exit_code_in_child_while_held

    with BufferPool(PAGE_SIZE, 2) as pool:
        def child():
            index = pool.acquire(timeout=1)
            pool.release(index)
            return 0 if pool.free == 2 else 1
        # caught inside acquire()/release() at the fork
        assert exit_code_in_child_while_held(pool._cond, child) == 0
        assert pool.free == 2


def _populate_fails(code):
    """An mmap.mmap whose MADV_POPULATE_WRITE answers ``code`` (a memory
    cgroup at its limit: ENOMEM; a kernel older than 5.14: EINVAL)."""
    import mmap

    from kvblock.memory import aligned

    class Map(mmap.mmap):
        def madvise(self, option, *args):
            if option == aligned._MADV_POPULATE_WRITE:
                raise OSError(code, os.strerror(code))
            return super().madvise(option, *args)

    return Map


def test_memory_the_kernel_cannot_populate_is_a_config_error(monkeypatch):
    """MADV_POPULATE_WRITE answering ENOMEM (the process's memory cgroup at
    its limit) was taken for 'not supported' and the pages touched one by
    one instead: the fault the kernel had just refused, now the OOM killer's
    (the process killed, no error).  It is a ConfigError naming the size and
    the fix, and the buffer is neither left mapped nor registered."""
    from kvblock.memory import aligned

    monkeypatch.setattr(aligned.mmap, "mmap", _populate_fails(errno.ENOMEM))
    before = registry.snapshot()[1]
    with pytest.raises(ConfigError, match=r"12288 bytes of host memory cannot be "
                                          r"populated: .*memory.*; free memory, raise "
                                          r"the memory limit .* or ask for less"):
        HostBuffer(3 * PAGE_SIZE)
    assert registry.snapshot()[1] == before  # nothing registered


def test_a_kernel_without_populate_write_still_gets_prefaulted_buffers(monkeypatch):
    """(EINVAL: MADV_POPULATE_WRITE unknown before Linux 5.14) the pages are
    touched by hand and the buffer works."""
    from kvblock.memory import aligned

    monkeypatch.setattr(aligned.mmap, "mmap", _populate_fails(errno.EINVAL))
    with HostBuffer(3 * PAGE_SIZE) as buf:
        buf.array[:] = 7
        assert int(buf.array.sum()) == 7 * 3 * PAGE_SIZE


@pytest.mark.parametrize("where", ["register", "finalizer"])
def test_a_ctrl_c_while_pinning_for_cuda_leaves_the_buffer_unlocked(monkeypatch, where):
    """A KeyboardInterrupt after cudaHostRegister succeeded but before the
    unpin finalizer was set (raised as the call returns, or while the
    finalizer is made) left the buffer page-locked with nothing to unlock
    it: pin_for_cuda had not marked it pinned, so close() did not
    unregister, and no finalizer would.  It is undone before the interrupt
    goes on; the buffer stays unpinned and can be pinned again."""
    torch = pytest.importorskip("torch")
    from kvblock.memory import aligned

    class StandInCudart:
        def __init__(self):
            self.registered = {}

        def cudaHostRegister(self, address, nbytes, flags):
            self.registered[address] = nbytes
            if where == "register" and interrupt:
                interrupt.pop()
                raise KeyboardInterrupt      # a Ctrl-C as the call returns
            return 0

        def cudaHostUnregister(self, address):
            return 0 if self.registered.pop(address, None) is not None else 713

    rt, interrupt = StandInCudart(), [True]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    real_finalize = aligned.weakref.finalize

    def finalize(obj, func, *args):
        if where == "finalizer" and func is not registry.remove and interrupt:
            interrupt.pop()
            raise KeyboardInterrupt          # a Ctrl-C before the finalizer is set
        return real_finalize(obj, func, *args)

    monkeypatch.setattr(aligned.weakref, "finalize", finalize)
    buf = HostBuffer(1 << 20, register=False)
    with pytest.raises(KeyboardInterrupt):
        buf.pin_for_cuda()
    assert rt.registered == {}, "interrupted, the buffer stayed page-locked"
    assert not buf.cuda_pinned
    assert buf.pin_for_cuda() and rt.registered == {buf.address: 1 << 20}   # again
    buf.close()
    assert rt.registered == {}
