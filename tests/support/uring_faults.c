/* LD_PRELOAD faults for kvblock's io_uring ring (tests/io/test_uring_faults.py).
 *
 * KVB_FAULT_SUBMIT_AT=N: the N-th io_uring_submit_and_wait submits as usual,
 *   then reports -ENOMEM, as a ring that broke after taking the I/Os;
 *   with KVB_FAULT_SUBMIT_NONE=1 it submits nothing (the kernel never takes
 *   the I/Os prepared for it).
 * KVB_FAULT_REAP_AFTER_MS=T: io_uring_wait_cqe_timeout reports -ETIME until T
 *   ms after its first call, as a device slow to complete what it took.
 * KVB_FAULT_OLD_KERNEL=1: io_uring_queue_init_params refuses SINGLE_ISSUER
 *   and DEFER_TASKRUN with -EINVAL, as kernels before 6.0/6.1 do.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <time.h>
#include <liburing.h>

static void *real_sym(const char *name)
{
    void *lib = dlopen("liburing.so.2", RTLD_NOW | RTLD_LOCAL);
    return lib ? dlsym(lib, name) : NULL;
}

int io_uring_submit_and_wait(struct io_uring *ring, unsigned wait_nr)
{
    static int (*real)(struct io_uring *, unsigned);
    static int calls, fail_at = -1;
    if (!real) {
        real = (int (*)(struct io_uring *, unsigned))real_sym("io_uring_submit_and_wait");
        const char *at = getenv("KVB_FAULT_SUBMIT_AT");
        fail_at = at ? atoi(at) : -1;
    }
    if (++calls == fail_at) {
        if (!getenv("KVB_FAULT_SUBMIT_NONE"))
            real(ring, 0);        /* the I/Os reach the kernel, then the "failure" */
        return -ENOMEM;
    }
    return real(ring, wait_nr);
}

int io_uring_wait_cqe_timeout(struct io_uring *ring, struct io_uring_cqe **cqe_ptr,
                              struct __kernel_timespec *ts)
{
    static int (*real)(struct io_uring *, struct io_uring_cqe **, struct __kernel_timespec *);
    static struct timespec until;
    if (!real) {
        real = (int (*)(struct io_uring *, struct io_uring_cqe **, struct __kernel_timespec *))
            real_sym("io_uring_wait_cqe_timeout");
        const char *after = getenv("KVB_FAULT_REAP_AFTER_MS");
        clock_gettime(CLOCK_MONOTONIC, &until);
        long ms = after ? atol(after) : 0;
        until.tv_sec += ms / 1000;
        until.tv_nsec += (ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec < until.tv_sec ||
        (now.tv_sec == until.tv_sec && now.tv_nsec < until.tv_nsec)) {
        nanosleep(&(struct timespec){.tv_sec = ts->tv_sec, .tv_nsec = ts->tv_nsec}, NULL);
        return -ETIME;
    }
    return real(ring, cqe_ptr, ts);
}

int io_uring_queue_init_params(unsigned entries, struct io_uring *ring,
                               struct io_uring_params *p)
{
    static int (*real)(unsigned, struct io_uring *, struct io_uring_params *);
    if (!real)
        real = (int (*)(unsigned, struct io_uring *, struct io_uring_params *))
            real_sym("io_uring_queue_init_params");
    if (getenv("KVB_FAULT_OLD_KERNEL") &&
        (p->flags & (IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN)))
        return -EINVAL;
    return real(entries, ring, p);
}
