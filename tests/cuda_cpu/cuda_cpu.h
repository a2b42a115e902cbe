// The CUDA execution model on CPU threads, so that kernels/*.cu run unmodified on a machine
// without a GPU (tests/cuda_cpu/harness.py builds them with g++ and drives them through ctypes).
//
//  * one OS thread per CUDA thread; the blocks of a launch run one at a time, every thread of the
//    block taking part (a block's __shared__ arrays are function statics: one block owns them);
//  * __syncthreads is a barrier of the block's threads; __ballot_sync / __shfl_down_sync are
//    barriers of the warp's 32 lanes exchanging their values; a barrier that some thread never
//    reaches (a removed or divergent one) is reported as a deadlock after a timeout, naming the
//    kernel, the block, the thread and the call;
//  * atomicAdd is a relaxed atomic read-modify-write; the _rn float intrinsics are plain float
//    operations (the build turns FMA contraction off, so products and sums round separately);
//  * `extern __shared__` (dynamic shared memory) is the launch's buffer of the requested size.
//
// Only what kernels/*.cu use is defined; anything else fails to compile, which is the point.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

struct dim3 {
    unsigned x, y, z;
};

struct alignas(16) float4 {
    float x, y, z, w;
};

namespace hvd_cpu {

struct ThreadCtx {
    dim3 thread, block, block_dim, grid_dim;  // threadIdx, blockIdx, blockDim, gridDim of this thread
};
extern thread_local ThreadCtx ctx;

void syncthreads();
unsigned ballot(unsigned mask, bool pred);
uint64_t shfl_down(unsigned mask, uint64_t value, unsigned delta);
void* dynamic_shared();

}  // namespace hvd_cpu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__ static
#define threadIdx (hvd_cpu::ctx.thread)
#define blockIdx (hvd_cpu::ctx.block)
#define blockDim (hvd_cpu::ctx.block_dim)
#define gridDim (hvd_cpu::ctx.grid_dim)

inline void __syncthreads() { hvd_cpu::syncthreads(); }

inline unsigned __ballot_sync(unsigned mask, int pred) { return hvd_cpu::ballot(mask, pred != 0); }

template <typename T>
inline T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
    static_assert(sizeof(T) <= 8, "a shuffled value is at most 64 bits");
    uint64_t word = 0;
    memcpy(&word, &value, sizeof(T));
    word = hvd_cpu::shfl_down(mask, word, delta);
    T out;
    memcpy(&out, &word, sizeof(T));
    return out;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }

inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}

inline float __uint2float_rn(unsigned u) { return (float)u; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }

inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }

inline float atomicAdd(float* p, float v) {
    unsigned* u = reinterpret_cast<unsigned*>(p);
    unsigned old = __atomic_load_n(u, __ATOMIC_RELAXED);
    for (;;) {
        float f;
        memcpy(&f, &old, 4);
        f += v;
        unsigned want;
        memcpy(&want, &f, 4);
        if (__atomic_compare_exchange_n(u, &old, want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return f - v;
    }
}
