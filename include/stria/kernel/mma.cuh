// SPDX-License-Identifier: Apache-2.0
// Warp-level tensor-core and copy primitives (sm80+) shared by the kernels: mma.sync m16n8k16,
// ldmatrix, cp.async, and packing fp32 pairs into 16-bit operands. Fragment layouts follow the
// PTX ISA ("Matrix fragments for mma.m16n8k16"): lane l holds rows l/4 and l/4 + 8, columns
// 2(l%4) and 2(l%4) + 1 of each 8-column slice. Every shared-memory asm has a "memory" clobber, so
// the compiler keeps it on its side of __syncthreads (an asm without one may be moved across).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace stria::kernel::detail {

/// d += a * b on the tensor cores: one m16n8k16 product of 16-bit inputs with fp32 accumulation.
template <class T>
__device__ inline void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // stria's targets are sm_80 and newer
#endif
}

__device__ inline unsigned shared_address(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

/// Four 8x8 16-bit matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ inline void ldmatrix_x4(unsigned (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
#else
  __trap();
#endif
}

/// As ldmatrix_x4, each matrix transposed: lane l receives rows 2(l%4), 2(l%4) + 1 of column l / 4.
__device__ inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row))
               : "memory");
#else
  __trap();
#endif
}

/// Asynchronous 16-byte copy global -> shared; with `valid` false the 16 bytes are zero-filled and
/// nothing is read (the source must still be a valid address).
__device__ inline void cp_async_16(void* shared, const void* global, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)), "l"(global), "r"(valid ? 16 : 0)
               : "memory");
#else
  __trap();
#endif
}

/// Asynchronous 4-byte copy global -> shared (through L1: the 16-byte form alone may bypass it).
__device__ inline void cp_async_4(void* shared, const void* global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(shared)), "l"(global) : "memory");
#else
  __trap();
#endif
}

__device__ inline void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/// Waits until at most `Pending` committed copy groups of this thread are still in flight.
template <int Pending>
__device__ inline void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

/// Two floats as one 32-bit register of 16-bit values (the low half holds `lo`), round to nearest.
template <class T>
__device__ inline unsigned pack_pair(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
  }
}

/// The A operand of an m16n8k16 product from an fp32 accumulator of the same warp: the 16 x 16
/// slice made of accumulator column tiles `c[2k]` and `c[2k + 1]` (FlashAttention-2's register reuse).
template <class T>
__device__ inline void accumulator_to_operand(unsigned (&a)[4], const float (&left)[4], const float (&right)[4]) {
  a[0] = pack_pair<T>(left[0], left[1]);
  a[1] = pack_pair<T>(left[2], left[3]);
  a[2] = pack_pair<T>(right[0], right[1]);
  a[3] = pack_pair<T>(right[2], right[3]);
}

/// 2^x on the special-function unit, flushing results below 2^-126 to zero (probabilities that
/// small vanish in bf16/fp16 anyway): one instruction where exp2f needs several for subnormals.
__device__ inline float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ inline float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace stria::kernel::detail
