/*
 * Packed-block gather/scatter for kvtier: one launch moves every (layer, part) fragment of a batch of KV
 * blocks between the engine's paged per-layer tensors and packed blocks (kvtier.layout.BlockLayout).
 *
 * Plain CUDA with extern "C" launchers, built into a small shared library by kvtier/native_build.py and
 * called through ctypes with tensor data_ptr()s and torch's current stream. It depends on no torch build,
 * so it compiles wherever nvcc exists (CI compiles it without a GPU so a broken kernel fails the build).
 *
 * Work: one CTA per (block, fragment) item, grid-stride over items. A fragment is nruns runs of run_bytes
 * (see kvtier/hostcopy.py FRAGMENT_FIELDS); a CTA's threads split into groups of a power-of-two size, one
 * group per run, so the index math is shifts and masks, and each thread keeps four vector loads in flight
 * before storing. V is the widest vector (16 bytes normally) that every address and size is aligned to.
 *
 * Packed rows may be device memory or pinned host memory mapped into the device's address space: a gather
 * then writes straight over PCIe/NVLink-C2C with no staging copy (kvtier_cuda_device_pointers maps them).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#define KVTIER_API extern "C" __attribute__((visibility("default")))

namespace {

struct Fragment {
    int64_t engine_base, block_stride, packed_offset, run_bytes, nruns, engine_run_stride, packed_run_stride,
        group;
};
static_assert(sizeof(Fragment) == 64, "Fragment is shared with Python, the C library and Triton");

constexpr int kThreads = 256;  // a power of two: the thread groups below divide it evenly

template <typename V>
__device__ __forceinline__ void copy_run(V *__restrict__ dst, const V *__restrict__ src, int64_t n, int lane,
                                         int step) {
    int64_t w = lane;
    for (; w + 3 * step < n; w += 4 * step) {  // four loads in flight per thread
        V a = src[w], b = src[w + step], c = src[w + 2 * step], d = src[w + 3 * step];
        dst[w] = a;
        dst[w + step] = b;
        dst[w + 2 * step] = c;
        dst[w + 3 * step] = d;
    }
    for (; w < n; w += step) dst[w] = src[w];
}

template <typename V>
__device__ __forceinline__ void zero_run(V *__restrict__ dst, int64_t n, int lane, int step) {
    for (int64_t w = lane; w < n; w += step) dst[w] = V{};
}

template <typename V, bool kScatter>
__global__ void __launch_bounds__(kThreads)
    copy_fragments_kernel(const Fragment *__restrict__ frags, int64_t nfrags, const int64_t *__restrict__ block_ids,
                          const uint64_t *__restrict__ packed_rows, int64_t nblocks) {
    const int64_t items = nblocks * nfrags;
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
        const int64_t i = item / nfrags;
        const Fragment f = frags[item - i * nfrags];
        const int64_t id = block_ids[f.group * nblocks + i];
        const int64_t run = f.run_bytes / (int64_t)sizeof(V);
        // Threads per run: the smallest power of two >= run, at most the whole CTA.
        int per_run = kThreads;
        while (per_run > 1 && (per_run >> 1) >= run) per_run >>= 1;
        const int lane = threadIdx.x & (per_run - 1);
        const int runs_per_pass = kThreads / per_run;
        char *packed = reinterpret_cast<char *>(packed_rows[i]) + f.packed_offset;
        if (id < 0) {
            // No engine block for this group, or alignment padding: a gather writes zeros (equal KV packs
            // to equal bytes), a scatter leaves it alone. Padding need not be aligned to V: bytes then.
            if (kScatter) continue;
            if ((f.packed_offset | f.run_bytes | f.packed_run_stride) % (int64_t)sizeof(V)) {
                for (int64_t r = 0; r < f.nruns; r++)
                    zero_run(reinterpret_cast<uint8_t *>(packed + r * f.packed_run_stride), f.run_bytes,
                             threadIdx.x, kThreads);
            } else {
                for (int64_t r = threadIdx.x / per_run; r < f.nruns; r += runs_per_pass)
                    zero_run(reinterpret_cast<V *>(packed + r * f.packed_run_stride), run, lane, per_run);
            }
            continue;
        }
        char *engine = reinterpret_cast<char *>(f.engine_base) + id * f.block_stride;
        for (int64_t r = threadIdx.x / per_run; r < f.nruns; r += runs_per_pass) {
            V *e = reinterpret_cast<V *>(engine + r * f.engine_run_stride);
            V *p = reinterpret_cast<V *>(packed + r * f.packed_run_stride);
            if (kScatter)
                copy_run(e, p, run, lane, per_run);
            else
                copy_run(p, e, run, lane, per_run);
        }
    }
}

template <typename V>
cudaError_t launch(const Fragment *frags, int64_t nfrags, const int64_t *ids, const uint64_t *rows,
                   int64_t nblocks, int scatter, int grid, cudaStream_t stream) {
    if (scatter)
        copy_fragments_kernel<V, true><<<grid, kThreads, 0, stream>>>(frags, nfrags, ids, rows, nblocks);
    else
        copy_fragments_kernel<V, false><<<grid, kThreads, 0, stream>>>(frags, nfrags, ids, rows, nblocks);
    return cudaGetLastError();
}

}  // namespace

/*
 * Gather (scatter = 0: packed <- engine) or scatter (1: engine <- packed) nblocks blocks on `stream`.
 * frags: nfrags Fragment rows, block_ids: (groups, nblocks) int64, rows: nblocks packed row addresses; all
 * three in device-accessible memory. vec_bytes: 16, 8, 4, 2 or 1, dividing every address and size of the
 * fragments that copy (zero-fill fragments may be narrower: they fall back to bytes).
 * grid: CTAs to launch (they grid-stride over nblocks * nfrags items). Returns a cudaError_t (0 = launched).
 */
KVTIER_API int kvtier_cuda_copy_fragments(const void *frags, int64_t nfrags, const int64_t *block_ids,
                                          const uint64_t *rows, int64_t nblocks, int scatter, int vec_bytes,
                                          int grid, void *stream) {
    if (nfrags <= 0 || nblocks <= 0) return 0;
    const Fragment *f = static_cast<const Fragment *>(frags);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (vec_bytes) {
        case 16: return launch<uint4>(f, nfrags, block_ids, rows, nblocks, scatter, grid, s);
        case 8: return launch<uint2>(f, nfrags, block_ids, rows, nblocks, scatter, grid, s);
        case 4: return launch<uint32_t>(f, nfrags, block_ids, rows, nblocks, scatter, grid, s);
        case 2: return launch<uint16_t>(f, nfrags, block_ids, rows, nblocks, scatter, grid, s);
        case 1: return launch<uint8_t>(f, nfrags, block_ids, rows, nblocks, scatter, grid, s);
        default: return (int)cudaErrorInvalidValue;
    }
}

/*
 * Device addresses of n host or device pointers (out[i]). Returns 0; k + 1 if ptrs[k] is host memory that
 * is not page-locked (the caller must stage it); or -(cudaError_t) on a CUDA error.
 */
KVTIER_API int64_t kvtier_cuda_device_pointers(const uint64_t *ptrs, uint64_t *out, int64_t n) {
    for (int64_t k = 0; k < n; k++) {
        cudaPointerAttributes attr;
        cudaError_t rc = cudaPointerGetAttributes(&attr, reinterpret_cast<const void *>(ptrs[k]));
        if (rc == cudaErrorInvalidValue) {  // older runtimes: plain host memory
            cudaGetLastError();
            return k + 1;
        }
        if (rc != cudaSuccess) return -(int64_t)rc;
        if (attr.type == cudaMemoryTypeUnregistered) return k + 1;
        out[k] = attr.type == cudaMemoryTypeHost ? reinterpret_cast<uint64_t>(attr.devicePointer) : ptrs[k];
        if (out[k] == 0) return k + 1;  // page-locked but not mapped into the device's address space
    }
    return 0;
}

/* Streaming multiprocessors of the current device (to size the grid), or -(cudaError_t). */
KVTIER_API int kvtier_cuda_sm_count(void) {
    int device = 0, sms = 0;
    cudaError_t rc = cudaGetDevice(&device);
    if (rc == cudaSuccess) rc = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return rc == cudaSuccess ? sms : -(int)rc;
}

KVTIER_API const char *kvtier_cuda_error_string(int rc) { return cudaGetErrorString((cudaError_t)rc); }

/* Lets Python check it loaded the library it expects. */
KVTIER_API int kvtier_cuda_abi_version(void) { return 1; }
