/*
 * Batched host-memory copies for kvtier's DRAM tier and CPU gather/scatter of packed KV blocks.
 *
 * One call copies a whole batch of rows: dst[i] <- src[i], nbytes[i] bytes each. Python builds the three
 * address tables with numpy and calls this once through ctypes (which releases the GIL), so a batch of
 * thousands of 64 KiB blocks costs one foreign call instead of one per block.
 *
 * Why not plain memcpy: glibc switches to non-temporal stores only for copies larger than a large threshold
 * (a fraction of the L3 cache), so a 1 GiB memcpy streams at full memory bandwidth while the same bytes
 * copied as 4 MiB or 64 KiB pieces go through the cache at about half the speed (measured on this project's
 * 2-core EPYC machines: 7.7 GB/s vs 14 GB/s). Packed KV blocks are written once and read much later, so
 * streaming stores that bypass the cache are the right choice for every row of NT_MIN_BYTES or more.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define KVTIER_HAVE_SSE2 1
#endif

#define KVTIER_API __attribute__((visibility("default")))

/* Rows below this size are copied with memcpy: the data is likely to be read again soon and the per-row
 * setup of the streaming loop is not worth it. */
#define NT_MIN_BYTES (16u * 1024u)

#ifdef KVTIER_HAVE_SSE2
/* 16-byte streaming stores, 64 bytes per iteration: every x86-64 CPU has them. Not AVX2's 32-byte ones (UMBP's
 * NtCopyAvx2, ROCm/mori src/umbp/local/tiers/dram_tier.cpp): on this project's EPYC machines they copied a
 * batch out of a /dev/shm mapping 15-25% slower than these (1 and 4 MiB rows, interleaved, 4 runs), and no
 * faster into one. */
static void stream_sse2(char *dst, const char *src, uint64_t n) {
    uint64_t head = (16u - ((uintptr_t)dst & 15u)) & 15u;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    uint64_t chunks = n / 64u;
    for (uint64_t i = 0; i < chunks; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        dst += 64;
        src += 64;
    }
    memcpy(dst, src, n - chunks * 64u);
}
#endif

static void copy_row(char *dst, const char *src, uint64_t n) {
#ifdef KVTIER_HAVE_SSE2
    if (n >= NT_MIN_BYTES) {
        stream_sse2(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* ---- running a batch on several threads ------------------------------------------------------------- */

/* Work on items [begin, end) of a batch; ctx describes the batch. */
typedef void (*range_fn)(const void *ctx, int64_t begin, int64_t end);

typedef struct {
    range_fn fn;
    const void *ctx;
    int64_t items, grain;
    atomic_int_fast64_t next; /* the first item no thread has taken yet */
} shared_batch;

/* Take grain items at a time until none is left. Work is handed out as it is done, not split up front: on a
 * machine whose cores are busy a thread that waits for a core takes less, and the threads that run take the
 * rest, so a batch on two threads is never held up by the slower one for more than a grain. */
static void *batch_worker(void *arg) {
    shared_batch *b = (shared_batch *)arg;
    for (;;) {
        int64_t begin = atomic_fetch_add(&b->next, b->grain);
        if (begin >= b->items) break;
        int64_t end = begin + b->grain < b->items ? begin + b->grain : b->items;
        b->fn(b->ctx, begin, end);
    }
#ifdef KVTIER_HAVE_SSE2
    /* Streaming stores are weakly ordered: fence so the bytes are visible before we report completion. */
    _mm_sfence();
#endif
    return NULL;
}

#define MAX_THREADS 16

/*
 * Run fn over items [0, items), grain at a time, on threads threads, the caller's thread included. Returns 0,
 * or -1 if a worker thread could not be started (the threads that did start, and the caller, do its share,
 * so the work itself never fails).
 */
static int run_batch(range_fn fn, const void *ctx, int64_t items, int64_t grain, int threads) {
    shared_batch b = {fn, ctx, items, grain < 1 ? 1 : grain, 0};
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int rc = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], NULL, batch_worker, &b) == 0)
            started[t] = 1;
        else
            rc = -1;
    }
    batch_worker(&b);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
    return rc;
}

static int clamp_threads(int threads, int64_t n) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = (int)n;
    return threads < 1 ? 1 : threads;
}

/* ---- rows: dst[i] <- src[i] ---------------------------------------------------------------------------- */

typedef struct {
    const uint64_t *dst, *src, *nbytes;
} rows_batch;

static void copy_rows_range(const void *ctx, int64_t begin, int64_t end) {
    const rows_batch *b = (const rows_batch *)ctx;
    for (int64_t i = begin; i < end; i++)
        copy_row((char *)(uintptr_t)b->dst[i], (const char *)(uintptr_t)b->src[i], b->nbytes[i]);
}

/*
 * Copy n rows. threads > 1 hands the rows out one at a time to that many threads, the caller's thread included.
 * Returns 0, or -1 if a worker thread could not be started (the copy itself never fails).
 */
KVTIER_API int kvtier_copy_rows(const uint64_t *dst, const uint64_t *src, const uint64_t *nbytes, int64_t n,
                                int threads) {
    if (n <= 0) return 0;
    rows_batch batch = {dst, src, nbytes};
    return run_batch(copy_rows_range, &batch, n, 1, clamp_threads(threads, n));
}

/* ---- fragments: gather engine paged KV into packed blocks, scatter back ------------------------------- */

/*
 * One fragment of a packed block, as kvtier/kernels/enginekv.py compiles it (the same 64-byte record the
 * CUDA and Triton kernels read). For engine block id b it is nruns runs of run_bytes:
 *     engine: engine_base + b * block_stride + r * engine_run_stride
 *     packed: packed_row + packed_offset + r * packed_run_stride
 * group picks the row of the block-id table (hybrid models keep one block table per cache group; a last,
 * all -1 row marks the fragments that zero-fill a packed block's alignment padding).
 */
typedef struct {
    int64_t engine_base, block_stride, packed_offset, run_bytes, nruns, engine_run_stride, packed_run_stride,
        group;
} kvtier_fragment;
_Static_assert(sizeof(kvtier_fragment) == 64, "kvtier_fragment is shared with Python, CUDA and Triton");

typedef struct {
    const kvtier_fragment *frags;
    int64_t nfrags, nblocks;
    const int64_t *block_ids; /* (groups, nblocks), row-major; -1 = no engine block for this group */
    const uint64_t *packed;   /* nblocks row addresses */
    int scatter;
} frag_batch;

static void copy_fragments_range(const void *ctx, int64_t begin, int64_t end) {
    const frag_batch *b = (const frag_batch *)ctx;
    for (int64_t item = begin; item < end; item++) {
        int64_t i = item / b->nfrags;
        const kvtier_fragment *f = &b->frags[item - i * b->nfrags];
        int64_t id = b->block_ids[f->group * b->nblocks + i];
        char *packed = (char *)(uintptr_t)b->packed[i] + f->packed_offset;
        if (id < 0) {
            /* No engine block (or alignment padding): a gather writes zeros, so equal KV packs to equal bytes. */
            if (!b->scatter)
                for (int64_t r = 0; r < f->nruns; r++) memset(packed + r * f->packed_run_stride, 0, f->run_bytes);
            continue;
        }
        char *engine = (char *)(uintptr_t)f->engine_base + id * f->block_stride;
        for (int64_t r = 0; r < f->nruns; r++) {
            char *e = engine + r * f->engine_run_stride, *p = packed + r * f->packed_run_stride;
            if (b->scatter)
                copy_row(e, p, (uint64_t)f->run_bytes);
            else
                copy_row(p, e, (uint64_t)f->run_bytes);
        }
    }
}

/*
 * Gather (scatter = 0: packed <- engine) or scatter (scatter = 1: engine <- packed) nblocks packed blocks,
 * every fragment of each. Work items are (block, fragment) pairs in block-major order; threads > 1 splits
 * them out one block (nfrags items) at a time.
 * Returns 0, or -1 if a worker thread could not be started (the copy itself never fails).
 */
KVTIER_API int kvtier_copy_fragments(const kvtier_fragment *frags, int64_t nfrags, const int64_t *block_ids,
                                     const uint64_t *packed, int64_t nblocks, int scatter, int threads) {
    int64_t items = nfrags * nblocks;
    if (items <= 0) return 0;
    frag_batch batch = {frags, nfrags, nblocks, block_ids, packed, scatter};
    return run_batch(copy_fragments_range, &batch, items, nfrags, clamp_threads(threads, nblocks));
}

/* Lets Python check it loaded the library it expects. */
KVTIER_API int kvtier_native_abi_version(void) { return 1; }
