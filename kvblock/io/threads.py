"""Fallback engine for machines where io_uring cannot be used (seccomp,
io_uring_disabled, old kernels): ``qd`` worker threads run pread/pwrite with
O_DIRECT in C, claiming I/Os from a shared cursor; no Python per I/O."""

from __future__ import annotations

import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

from kvblock.io import native
from kvblock.io.batch import IOBatch
from kvblock.io.engine import IOEngine


class ThreadEngine(IOEngine):
    name = "threads"
    # Workers would take turns at the one in-order hash cursor.  2-core VM,
    # KVBLOCK_IO_ENGINE=threads perf/verified_reads.py (2 MiB vLLM slots, store
    # file in /dev/shm, 8 tier threads; measured before tmpfs files were mapped,
    # so add KVBLOCK_MAPPED_READS=never to repeat it): 4.66 GiB/s that way,
    # 6.55 hashing after the read, 8.57 unverified.
    hashes_as_reads_land = False

    def __init__(self, devices, **kwargs):
        native.lib()  # fail early, with a clear error, if the library is missing
        # (before the base registers the engine with its devices, which close it)
        super().__init__(devices, **kwargs)
        self._pool = self._new_pool()

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.queue_depth, thread_name_prefix="kvblock-io")

    def _run(self, op, batch: IOBatch, qd, results, latency, hasher) -> None:
        lib, p = native.lib(), native.ptr
        cursor = native.ffi.new("uint64_t *", 0)
        args = (op, len(batch), p("uint64_t *", batch.addrs), p("uint32_t *", batch.devs),
                p("int *", self.fds), len(self.fds), p("uint64_t *", batch.offsets),
                p("uint64_t *", batch.lens), p("int64_t *", results), p("int64_t *", latency),
                cursor, native.ffi.NULL if hasher is None else hasher.handle)
        if min(qd, len(batch)) == 1:   # one worker: this thread (no hand-off to the pool)
            lib.kvb_pio_run(*args)
            return
        # Every worker is counted while it is in the native call: a pool
        # submit that raised may still have queued its worker, so the
        # futures alone do not name every worker.  Counted with two lists
        # (an append is atomic) and no lock or Condition: the batch's
        # qd workers (32 by default) each paid a Condition's Python-level
        # enter, exit and notify_all, 4-9% of a small multi-I/O read.  A
        # worker that enters once the batch is done (``closed``: its submit
        # raised) makes no native call.
        entered, ended, closed = [], [], [False]

        def work():
            entered.append(None)
            try:
                if not closed[0]:
                    lib.kvb_pio_run(*args)
            finally:
                ended.append(None)

        workers = []
        try:
            try:
                for _ in range(min(qd, len(batch))):
                    workers.append(self._pool.submit(work))
            except RuntimeError:
                # A helper that cannot start ("can't start new thread"): raised
                # from here, the helpers started went on reading into the
                # caller's buffers, freed or reused from then on.  The workers
                # share the batch through the cursor: this thread takes the
                # missing ones' place.
                lib.kvb_pio_run(*args)
            for w in workers:
                w.result()
        except BaseException:
            # Interrupted (KeyboardInterrupt) while the workers run: they read
            # into the caller's buffers, which are freed or reused once this
            # raises.  Let them claim no more I/Os and wait for those taken.
            cursor[0] = len(batch)
            futures.wait(workers)
            raise
        finally:
            # Closed first, then counted (ended read before entered: a
            # worker in the native call is in both counts or in neither's
            # read); a worker entering after the count sees it closed.
            # Every future done, every worker submitted has ended: only one
            # a raising submit queued can still be in the native call (rare:
            # polled).
            closed[0] = True
            while len(ended) < len(entered):
                time.sleep(0.001)

    def _after_fork(self) -> None:
        super()._after_fork()
        # the parent's workers do not exist here: a task handed to them
        # would never run
        self._pool = self._new_pool()

    def close(self) -> None:
        with self._closing:
            if not self.closed:
                super().close()
                self._pool.shutdown(wait=True)
