/*
 * kvblock native I/O core: batched direct I/O over io_uring, with a
 * pread/pwrite worker fallback.  The whole public surface is this header;
 * kvblock/io/native.py declares exactly these symbols to cffi (ABI mode).
 *
 * A batch is four parallel arrays of n entries (buffer address, device index,
 * byte offset, length).  One call submits the whole batch, keeps at most `qd`
 * I/Os in flight (refilling as completions arrive) and reaps completions in C.
 * Per-I/O outcome goes to results[i]: bytes transferred (>= 0) or -errno.
 * Callers compare results with lengths to find short transfers.
 *
 * Threading: a kvb_ring belongs to the thread that created it (kvblock keeps
 * one ring per thread): where the kernel allows, it is created with
 * IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN.  Running or
 * registering from another thread (or a forked child) fails with -EEXIST,
 * on every kernel, and leaves the ring as it was.
 * kvb_ring_destroy may be called from any thread.  kvb_pio_run may be called
 * from many threads at once on the same batch; they share work through the
 * atomic cursor.
 */
#ifndef KVBLOCK_IO_H
#define KVBLOCK_IO_H

#include <stdint.h>
#include <stddef.h>

#define KVB_OP_READ 0
#define KVB_OP_WRITE 1

typedef struct kvb_ring kvb_ring;
typedef struct kvb_hasher kvb_hasher;

/* Create a ring with `entries` submission slots.  Returns NULL and sets *err
 * to a negative errno when io_uring is unavailable (ENOSYS, EPERM, ...). */
kvb_ring *kvb_ring_create(unsigned entries, int *err);
void kvb_ring_destroy(kvb_ring *ring);

/* Register the device table; afterwards device index i means fds[i].  Falls
 * back to plain fds (returns the negative errno, ring still usable) when the
 * kernel refuses fixed files. */
int kvb_ring_set_files(kvb_ring *ring, const int *fds, unsigned n);

/* Register host memory regions for fixed-buffer I/O.  An I/O whose buffer lies
 * wholly inside a registered region uses READ_FIXED/WRITE_FIXED.  Returns 0 or
 * the negative errno (ring still usable with unregistered buffers). */
int kvb_ring_set_buffers(kvb_ring *ring, const uint64_t *addrs,
                         const uint64_t *lens, unsigned n);

/* Run a batch to completion.  latency_ns may be NULL.  Returns the number of
 * I/Os whose result is negative, or a negative errno when the ring itself
 * failed (then results of unfinished I/Os are -ECANCELED).  With a hasher
 * (NULL: none), completed reads are hashed as they land (below).  An I/O
 * longer than 1 GiB is issued for its first 1 GiB (an SQE's length is 32
 * bits): a short transfer, which the caller goes on from.  One whose offset
 * is past INT64_MAX is not issued: -EINVAL, as pread answers it. */
int64_t kvb_ring_run(kvb_ring *ring, int op, uint64_t n, const uint64_t *addrs,
                     const uint32_t *devs, const uint64_t *offsets,
                     const uint64_t *lens, unsigned qd, int64_t *results,
                     int64_t *latency_ns, kvb_hasher *hasher);

/* Fallback engine body: claim I/Os from *cursor until the batch is done and
 * run each with pread/pwrite (looping over partial transfers).  Returns the
 * number of failed I/Os this caller ran.  Every caller on one batch passes
 * the same hasher (or NULL). */
int64_t kvb_pio_run(int op, uint64_t n, const uint64_t *addrs,
                    const uint32_t *devs, const int *fds, unsigned nfds,
                    const uint64_t *offsets, const uint64_t *lens,
                    int64_t *results, int64_t *latency_ns, uint64_t *cursor,
                    kvb_hasher *hasher);

/* Checksums of a read batch, computed as its pieces land (overlapping the rest).
 * Piece i (addrs[i], lens[i]: the batch's host buffers) belongs to stream
 * streams[i]; streams are numbered 0..nstreams-1 in batch order (each piece's
 * stream equals or is one more than the one before), and a stream's pieces
 * are its bytes in order.  digests[s] becomes XXH3-64 (seed seeds[s]) of
 * stream s, the same value as xxhash's xxh3_64 of those bytes.
 *
 * kvb_hasher_create sets every results[i] to "pending" (INT64_MIN); the run
 * that gets the hasher then hashes piece after piece, in batch order, as each
 * one completes and all before it have, on whichever thread sees it first
 * (the one that reaps it, for a ring).  The arrays must outlive the hasher.
 * Returns NULL and sets *err (-EINVAL for bad streams, -ENOMEM).
 *
 * kvb_hasher_finish hashes what is left, writes the last digest and frees
 * the hasher.  Returns the number of streams with a piece that failed or came
 * back short (their digests are 0), or -EAGAIN when a piece never completed
 * (the run itself failed).  Call it exactly once, after every run is over. */
kvb_hasher *kvb_hasher_create(uint64_t n, const uint64_t *addrs, const uint64_t *lens,
                              const uint32_t *streams, uint32_t nstreams,
                              const uint64_t *seeds, int64_t *results, uint64_t *digests,
                              int *err);
int64_t kvb_hasher_finish(kvb_hasher *hasher);

/* The same digests for bytes already in memory (no results to wait for).
 * Returns 0, or -EINVAL / -ENOMEM. */
int64_t kvb_hash_pieces(uint64_t n, const uint64_t *addrs, const uint64_t *lens,
                        const uint32_t *streams, uint32_t nstreams, const uint64_t *seeds,
                        uint64_t *digests);

/* A run's block digests and range checksums in one pass over its blocks:
 * block_digests[r * nblocks + k] = XXH3-64 (seed) of the block_len bytes at
 * addrs[r * nblocks + k]; range_digests[r] = XXH3-64 (seed) of range r's
 * blocks in order followed by pad zero bytes.  Returns 0 or -ENOMEM. */
int64_t kvb_hash_blocks_ranges(uint64_t nranges, uint64_t nblocks, const uint64_t *addrs,
                               uint64_t block_len, uint64_t pad, uint64_t seed,
                               uint64_t *block_digests, uint64_t *range_digests);

/* Copy rows between two strided memory layouts (the gather and scatter of
 * KV pages between an engine's paged cache and kvblock's staging):
 *   for i < n, j < m:  memcpy(dst[i] + j * dst_step, src[i] + j * src_step, len)
 * dst and src hold one absolute address per outer item (e.g. per page, in
 * page-id order); m rows of len bytes follow each at the given byte steps.
 * The n items are split over `threads` threads (the caller's and up to 15
 * started for this call: one core's memcpy does not saturate memory
 * bandwidth).  Regions must not overlap.  Called without the GIL (cffi drops
 * it), so a copy in one Python thread also overlaps I/O issued from another. */
void kvb_copy_rows(uint64_t n, const uint64_t *dst, const uint64_t *src,
                   uint64_t m, int64_t dst_step, int64_t src_step, uint64_t len,
                   unsigned threads);

/* Reads out of memory-mapped device files.  bases[d] / sizes[d]: the
 * address and length of device d's shared mapping (0: not mapped).  Entry i
 * copies lens[i] bytes at offsets[i] of device devs[i] to addrs[i] (any
 * alignment); results[i] is lens[i], or -EINVAL for an unmapped device or a
 * range past the mapping.  Copies stream around the cache (non-temporal
 * stores) where the destination is 16-byte aligned.  With a hasher (fresh,
 * created for exactly these n entries), each 64 KiB chunk of the mapping is
 * hashed right after it is copied (while the loads left it in cache), in
 * batch order, on this thread; the caller keeps the source from being
 * rewritten meanwhile (the store pins regions it reads).  Returns the number
 * of failed entries, or -EINVAL when the hasher is not fresh or is for
 * another batch. */
int64_t kvb_mem_read(uint64_t n, const uint64_t *addrs, const uint32_t *devs,
                     const uint64_t *bases, const uint64_t *sizes, unsigned nbases,
                     const uint64_t *offsets, const uint64_t *lens, int64_t *results,
                     int64_t *latency_ns, kvb_hasher *hasher);

/* kvb_mem_read's other direction: entry i copies lens[i] bytes from addrs[i]
 * into device devs[i]'s shared mapping at offsets[i] (streamed stores,
 * fenced before each result is set), same checks and results; with a
 * hasher, each 64 KiB chunk of the source is hashed right after it is
 * copied, as kvb_mem_read does.  Only for mappings whose every page is
 * allocated: a hole would be filled on the fault, and a full filesystem
 * turns that into a SIGBUS. */
int64_t kvb_mem_write(uint64_t n, const uint64_t *addrs, const uint32_t *devs,
                      const uint64_t *bases, const uint64_t *sizes, unsigned nbases,
                      const uint64_t *offsets, const uint64_t *lens, int64_t *results,
                      int64_t *latency_ns, kvb_hasher *hasher);

/* kvb_mem_read (to_map 0) or kvb_mem_write (to_map 1) of the batch with a
 * hasher over its streams (kvb_hasher_create's rules), finished before it
 * returns: digests[s] is stream s's XXH3-64 (seeds[s]), or 0 when an entry
 * of it failed.  One call instead of three: each call from Python releases
 * and retakes the GIL, which other threads are often waiting for.  Returns
 * the number of failed entries, or -EINVAL (bad streams) / -ENOMEM. */
int64_t kvb_mem_copy_hashed(int to_map, uint64_t n, const uint64_t *addrs,
                            const uint32_t *devs, const uint64_t *bases, const uint64_t *sizes,
                            unsigned nbases, const uint64_t *offsets, const uint64_t *lens,
                            int64_t *results, int64_t *latency_ns, const uint32_t *streams,
                            uint32_t nstreams, const uint64_t *seeds, uint64_t *digests);

/* Map the pages of [addr, addr + len) of a shared mapping into this process
 * now (madvise MADV_POPULATE_READ), so that later copies out of it do not
 * fault.  Returns 0 or a negative errno (-EINVAL before Linux 5.14). */
int kvb_mem_prefault(uint64_t addr, uint64_t len);

/* fstatfs(fd)'s f_type (TMPFS_MAGIC, ...), or a negative errno. */
int64_t kvb_fs_type(int fd);

/* Version of this ABI; bumped on any signature change. */
int kvb_abi_version(void);

#endif
