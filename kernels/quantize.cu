// hvd_ext: b-bit packing, stochastic quantize + pack, unpack + dequantize + accumulate.
//
// BIT ORDER CONTRACT (same as hvd_ext/compression/bitpack.py): little-endian
// bitstream; code i occupies stream bits [i*bits, (i+1)*bits), LSB of the code
// first; stream bit j is bit (j % 8) of byte j / 8.  n codes take
// ceil(n * bits / 8) bytes, unused high bits of the last byte are 0.
//
// Work split: one thread per group of 8 codes = exactly `bits` bytes of stream,
// so groups never share a byte and need no atomics.
#include "common.cuh"

#define MAX_LEVELS 256

// codes (uint8, n) -> packed stream (nbytes = ceil(n*bits/8)).
extern "C" __global__ void hvd_pack_bits(const u8* __restrict__ codes, i64 n, int bits, u8* __restrict__ out,
                                         i64 nbytes) {
    const i64 groups = (n + 7) / 8;
    const u32 mask = (1U << bits) - 1U;
    for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < groups; g += (i64)gridDim.x * blockDim.x) {
        const i64 i0 = g * 8;
        u64 word = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            i64 i = i0 + j;
            u32 c = (i < n) ? ((u32)codes[i] & mask) : 0U;
            word |= ((u64)c) << (j * bits);
        }
        i64 b0 = g * bits;
        i64 nb = nbytes - b0;
        hvd_store_bytes(out + b0, word, nb < bits ? (int)nb : bits);
    }
}

// packed stream -> codes (uint8, n).
extern "C" __global__ void hvd_unpack_bits(const u8* __restrict__ data, i64 n, int bits, u8* __restrict__ codes) {
    const i64 groups = (n + 7) / 8;
    const i64 nbytes = (n * bits + 7) / 8;
    const u32 mask = (1U << bits) - 1U;
    for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < groups; g += (i64)gridDim.x * blockDim.x) {
        i64 b0 = g * bits;
        i64 nb = nbytes - b0;
        u64 word = hvd_load_bytes(data + b0, nb < bits ? (int)nb : bits);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            i64 i = g * 8 + j;
            if (i < n) codes[i] = (u8)((word >> (j * bits)) & mask);
        }
    }
}

// Stochastic rounding of v = x * inv_scale between neighbouring levels (sorted, L of them,
// 2 <= L <= 2^bits), packed.  c = clamp(#{levels <= v} - 1, 0, L-2), a = levels[c],
// b = levels[c+1]; code = c + (u * (b - a) < v - a) with u = uniform(key, i), i.e. round up
// with probability (v - a) / (b - a) without a division.  Every float op is an explicit _rn
// intrinsic (no FMA contraction) so the torch reference reproduces the codes bit for bit.
extern "C" __global__ void hvd_quantize_pack(const float* __restrict__ x, i64 n,
                                             const float* __restrict__ levels, int L, float inv_scale,
                                             u32 key, int bits, u8* __restrict__ out, i64 nbytes) {
    __shared__ float lv[MAX_LEVELS];
    for (int j = threadIdx.x; j < L; j += blockDim.x) lv[j] = levels[j];
    __syncthreads();
    const i64 groups = (n + 7) / 8;
    const bool aligned = (((u64)x) & 15ULL) == 0;
    for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < groups; g += (i64)gridDim.x * blockDim.x) {
        const i64 i0 = g * 8;
        float v[8];
        if (aligned && i0 + 8 <= n) {
            float4 a = *(const float4*)(x + i0);
            float4 b = *(const float4*)(x + i0 + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = (i0 + j < n) ? x[i0 + j] : 0.0f;
        }
        u64 word = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const i64 i = i0 + j;
            if (i >= n) break;
            float s = __fmul_rn(v[j], inv_scale);
            // branchless upper bound: number of levels <= s (NaN -> 0), same trip count in every thread
            int base = 0, len = L;
            while (len > 1) {
                int half = len >> 1;
                base = (lv[base + half - 1] <= s) ? base + half : base;
                len -= half;
            }
            int c = base + ((lv[base] <= s) ? 1 : 0) - 1;
            c = c < 0 ? 0 : (c > L - 2 ? L - 2 : c);
            float a = lv[c], b = lv[c + 1];
            float u = hvd_uniform(key, i);
            bool up = __fmul_rn(u, __fsub_rn(b, a)) < __fsub_rn(s, a);
            u32 code = (u32)c + (up ? 1U : 0U);
            word |= ((u64)code) << (j * bits);
        }
        i64 b0 = g * bits;
        i64 nb = nbytes - b0;
        hvd_store_bytes(out + b0, word, nb < bits ? (int)nb : bits);
    }
}

// out[i] += sum_r tables[r*L + code_r(i)], ranks summed in order r = 0..nranks-1 with
// round-to-nearest adds (deterministic).  tables[r*L + c] = levels_r[c] * scale_r
// (computed by the caller); codes >= L are clamped to L-1.  data_ptrs: device
// pointers of each rank's packed stream (>= ceil(n*bits/8) bytes).
// Dynamic shared memory: nranks*L floats when use_shared, else 0.
extern "C" __global__ void hvd_unpack_dequant_acc(float* __restrict__ out, i64 n, const u64* __restrict__ data_ptrs,
                                                  int nranks, const float* __restrict__ tables, int L, int bits,
                                                  int use_shared) {
    extern __shared__ float sh_tab[];
    if (use_shared) {
        for (int j = threadIdx.x; j < nranks * L; j += blockDim.x) sh_tab[j] = tables[j];
        __syncthreads();
    }
    const float* tab = use_shared ? sh_tab : tables;
    const i64 groups = (n + 7) / 8;
    const i64 nbytes = (n * bits + 7) / 8;
    const u32 mask = (1U << bits) - 1U;
    for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < groups; g += (i64)gridDim.x * blockDim.x) {
        const i64 i0 = g * 8;
        const int cnt = (n - i0) < 8 ? (int)(n - i0) : 8;
        float acc[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = (j < cnt) ? out[i0 + j] : 0.0f;
        const i64 b0 = g * bits;
        const i64 nb = nbytes - b0;
        const int nbi = nb < bits ? (int)nb : bits;
        for (int r = 0; r < nranks; ++r) {
            u64 word = hvd_load_bytes(((const u8*)data_ptrs[r]) + b0, nbi);
            const float* t = tab + r * L;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                u32 c = (u32)(word >> (j * bits)) & mask;
                c = c < (u32)L ? c : (u32)(L - 1);
                acc[j] = __fadd_rn(acc[j], t[c]);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (j < cnt) out[i0 + j] = acc[j];
    }
}
