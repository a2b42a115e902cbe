// hvd_ext: 1-bit sign packing and majority vote (signSGD with majority vote,
// Bernstein et al. 2018).
//
// Bit of element i is 1 when x[i] >= 0 (so +0.0 and -0.0 give 1) and 0 when
// x[i] < 0 or NaN; stored with the BIT ORDER CONTRACT of quantize.cu for bits=1
// (element i -> bit i % 8 of byte i / 8).
#include "common.cuh"

// out_words: ceil(n / 32) u32 words (little-endian, so the byte stream is the contract's).
// One thread per element; lane l of a warp owns bit l of the warp's word.
extern "C" __global__ void hvd_sign_pack(const float* __restrict__ x, i64 n, u32* __restrict__ out_words) {
    const i64 words = (n + 31) / 32;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    // Iterate whole warps so __ballot_sync sees every lane.
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i / 32 < words; i += stride) {
        bool p = (i < n) && (x[i] >= 0.0f);
        u32 b = __ballot_sync(0xffffffffU, p);
        if ((threadIdx.x & 31) == 0) out_words[i / 32] = b;
    }
}

// out[i] = +1 if (#ranks whose bit i is 1) * 2 >= nranks, else -1 (a tie gives +1).
// data_ptrs: device pointers of each rank's packed signs (>= ceil(n/8) bytes).
// One thread per byte (8 elements).
extern "C" __global__ void hvd_majority_vote(float* __restrict__ out, i64 n, const u64* __restrict__ data_ptrs,
                                             int nranks) {
    const i64 nbytes = (n + 7) / 8;
    for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < nbytes; g += (i64)gridDim.x * blockDim.x) {
        int cnt[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int r = 0; r < nranks; ++r) {
            u32 byte = ((const u8*)data_ptrs[r])[g];
#pragma unroll
            for (int j = 0; j < 8; ++j) cnt[j] += (byte >> j) & 1U;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            i64 i = g * 8 + j;
            if (i < n) out[i] = (2 * cnt[j] >= nranks) ? 1.0f : -1.0f;
        }
    }
}
