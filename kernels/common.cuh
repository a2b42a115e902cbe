// hvd_ext kernels: helpers shared by every .cu file (included with -I<kernels dir>).
//
// Plain CUDA C++ without standard headers so the same source compiles with
// nvcc (CI compile check) and NVRTC (cupy.RawModule at run time).
//
// Counter-based random numbers (no state, reproducible, identical in the torch
// reference in hvd_ext/kernels.py):
//   mix32(x)        = "lowbias32" (C. Wellons): x ^= x>>16; x *= 0x7feb352d;
//                     x ^= x>>15; x *= 0x846ca68b; x ^= x>>16   (all mod 2^32)
//   stream_key(s,t) = mix32(mix32(s ^ 0x9e3779b9) ^ t)          (s, t taken mod 2^32)
//   hash(key, i)    = mix32(lo32(i) ^ k),  k = key if hi32(i) == 0 else mix32(key ^ (hi32(i) * 0x9e3779b9))
//                     (one mix per element for tensors below 2^32 elements)
//   uniform(key, i) = (hash(key, i) >> 8) * 2^-24                in [0, 1), exact in float32
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned char u8;

__device__ __forceinline__ u32 hvd_mix32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

__device__ __forceinline__ u32 hvd_hash(u32 key, i64 i) {
    u64 ui = (u64)i;
    u32 lo = (u32)(ui & 0xffffffffULL);
    u32 hi = (u32)(ui >> 32);
    u32 k = hi ? hvd_mix32(key ^ (hi * 0x9e3779b9U)) : key;
    return hvd_mix32(lo ^ k);
}

__device__ __forceinline__ float hvd_uniform(u32 key, i64 i) {
    // 24 random bits -> float in [0, 1), exactly representable.
    return __uint2float_rn(hvd_hash(key, i) >> 8) * 5.9604644775390625e-08f;
}

// Write the `nbytes` (<= 8) low bytes of a little-endian 64-bit word to dst,
// with one wide store when size and alignment allow.
__device__ __forceinline__ void hvd_store_bytes(u8* dst, u64 word, int nbytes) {
    u64 addr = (u64)dst;
    if (nbytes == 8 && (addr & 7) == 0) { *(u64*)dst = word; return; }
    if (nbytes == 4 && (addr & 3) == 0) { *(u32*)dst = (u32)word; return; }
    if (nbytes == 2 && (addr & 1) == 0) { *(unsigned short*)dst = (unsigned short)word; return; }
    for (int b = 0; b < nbytes; ++b) dst[b] = (u8)(word >> (8 * b));
}

// Read `nbytes` (<= 8) bytes as the low bytes of a little-endian 64-bit word.
__device__ __forceinline__ u64 hvd_load_bytes(const u8* src, int nbytes) {
    u64 addr = (u64)src;
    if (nbytes == 8 && (addr & 7) == 0) return *(const u64*)src;
    if (nbytes == 4 && (addr & 3) == 0) return (u64)*(const u32*)src;
    if (nbytes == 2 && (addr & 1) == 0) return (u64)*(const unsigned short*)src;
    u64 w = 0;
    for (int b = 0; b < nbytes; ++b) w |= ((u64)src[b]) << (8 * b);
    return w;
}
