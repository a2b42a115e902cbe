// hvd_ext: threshold selection / compaction for top-k style sparsifiers and
// scatter-add decoding of N ranks' sparse payloads.
// Entry points are extern "C"; launched from hvd_ext/kernels.py (cupy.RawModule).
//
// Selection never sorts and never asks the host for a threshold: the threshold t lives in device
// memory (a two-level histogram of |x|'s float bits picks it, hvd_hist_abs), a per-block count of
// |x| >= t and an exclusive scan of the (few) block counts give every block its output offset,
// then one compaction pass in which every block scans its predicate with warp ballots and writes
// (index, value) pairs in ascending index order. The host reads one number: how many there are.
#include "common.cuh"

#define SEL_THREADS 256
#define SEL_ITEMS 16
#define SEL_TILE (SEL_THREADS * SEL_ITEMS)   // elements per block in count/compact
#define HIST_BINS 4096

// block_counts[b] = #{ i in tile b : |x[i]| >= *t }   (grid = ceil(n / SEL_TILE), block = SEL_THREADS)
extern "C" __global__ void hvd_count_ge(const float* __restrict__ x, i64 n, const float* __restrict__ t_ptr,
                                        int* __restrict__ block_counts) {
    __shared__ int warp_cnt[SEL_THREADS / 32];
    const float t = *t_ptr;
    const i64 base = (i64)blockIdx.x * SEL_TILE;
    int c = 0;
#pragma unroll 4
    for (int j = 0; j < SEL_ITEMS; ++j) {
        i64 i = base + (i64)j * SEL_THREADS + threadIdx.x;
        if (i < n && fabsf(x[i]) >= t) ++c;
    }
    for (int o = 16; o > 0; o >>= 1) c += __shfl_down_sync(0xffffffffU, c, o);
    if ((threadIdx.x & 31) == 0) warp_cnt[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int w = 0; w < SEL_THREADS / 32; ++w) s += warp_cnt[w];
        block_counts[blockIdx.x] = s;
    }
}

// Writes every i with |x[i]| >= *t, ascending, starting at block_offsets[b] for tile b
// (exclusive scan of hvd_count_ge's counts for the same t).
extern "C" __global__ void hvd_compact_ge(const float* __restrict__ x, i64 n, const float* __restrict__ t_ptr,
                                          const i64* __restrict__ block_offsets,
                                          int* __restrict__ out_idx, float* __restrict__ out_val) {
    __shared__ int warp_tot[SEL_THREADS / 32];
    const float t = *t_ptr;
    const i64 base = (i64)blockIdx.x * SEL_TILE;
    const i64 off = block_offsets[blockIdx.x];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 lt_mask = (1U << lane) - 1U;
    i64 run = 0;
    for (int j = 0; j < SEL_ITEMS; ++j) {
        i64 i = base + (i64)j * SEL_THREADS + threadIdx.x;
        float v = 0.0f;
        bool p = false;
        if (i < n) { v = x[i]; p = fabsf(v) >= t; }
        u32 b = __ballot_sync(0xffffffffU, p);
        if (lane == 0) warp_tot[warp] = __popc(b);
        __syncthreads();
        int before = 0, tot = 0;
#pragma unroll
        for (int w = 0; w < SEL_THREADS / 32; ++w) {
            int c = warp_tot[w];
            before += (w < warp) ? c : 0;
            tot += c;
        }
        if (p) {
            i64 pos = off + run + before + __popc(b & lt_mask);
            out_idx[pos] = (int)i;
            out_val[pos] = v;
        }
        run += tot;
        __syncthreads();
    }
}

// Histogram of the float bit patterns of |x|: elements whose bits >> prefix_shift == *prefix_ptr
// (0 when prefix_ptr is null; NaN excluded) go to bin (bits >> shift) & 4095.  hist has HIST_BINS
// u32 zeros on entry.
extern "C" __global__ void hvd_hist_abs(const float* __restrict__ x, i64 n, const u32* __restrict__ prefix_ptr,
                                        int prefix_shift, int shift, u32* __restrict__ hist) {
    __shared__ u32 h[HIST_BINS];
    const u32 prefix = prefix_ptr ? *prefix_ptr : 0U;
    for (int b = threadIdx.x; b < HIST_BINS; b += blockDim.x) h[b] = 0;
    __syncthreads();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        u32 bits = __float_as_uint(x[i]) & 0x7fffffffU;
        if (bits <= 0x7f800000U && (bits >> prefix_shift) == prefix)
            atomicAdd(&h[(bits >> shift) & (HIST_BINS - 1)], 1U);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < HIST_BINS; b += blockDim.x)
        if (h[b]) atomicAdd(&hist[b], h[b]);
}

// out[idx_r[j]] += scale * val_r[j] for every rank r and j < len_r, in one launch.
// idx_ptrs / val_ptrs: device pointers of each rank's index (int32, or int64 if idx64)
// and float32 value arrays; offsets: exclusive prefix sums of the lengths (nranks + 1).
// An index outside [0, n) is not written: it counts in *err (a corrupt payload).
extern "C" __global__ void hvd_scatter_add(float* __restrict__ out, i64 n, const u64* __restrict__ idx_ptrs,
                                           const u64* __restrict__ val_ptrs, const i64* __restrict__ offsets,
                                           int nranks, int idx64, float scale, int* __restrict__ err) {
    const i64 total = offsets[nranks];
    for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < total; g += (i64)gridDim.x * blockDim.x) {
        int lo = 0, hi = nranks - 1;           // rank r with offsets[r] <= g < offsets[r+1]
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (offsets[mid] <= g) lo = mid; else hi = mid - 1;
        }
        i64 j = g - offsets[lo];
        i64 idx = idx64 ? ((const i64*)idx_ptrs[lo])[j] : (i64)((const int*)idx_ptrs[lo])[j];
        if (idx < 0 || idx >= n) {
            atomicAdd(err, 1);
            continue;
        }
        float v = ((const float*)val_ptrs[lo])[j];
        atomicAdd(out + idx, __fmul_rn(scale, v));
    }
}
