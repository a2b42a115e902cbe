// hvd_ext: fused feedback-memory updates (one read of each input, one write).
#include "common.cuh"

// memory[i] = u[i] - sent[i]   (residual error feedback: what was meant minus what was sent)
extern "C" __global__ void hvd_residual_update(float* __restrict__ memory, const float* __restrict__ u,
                                               const float* __restrict__ sent, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        memory[i] = __fsub_rn(u[i], sent[i]);
}

// S[i] = b * S[i] + c * G[i] where mask[i] != 0 (or everywhere when mask is null); b = beta,
// c = 1 - beta, both rounded to float32 by the caller.  Products and the sum are rounded
// separately (no FMA) to match the torch reference bit for bit.
extern "C" __global__ void hvd_ewma_update(float* __restrict__ S, const float* __restrict__ G,
                                           const u8* __restrict__ mask, i64 n, float b, float c) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        if (mask == 0 || mask[i]) S[i] = __fadd_rn(__fmul_rn(b, S[i]), __fmul_rn(c, G[i]));
    }
}
