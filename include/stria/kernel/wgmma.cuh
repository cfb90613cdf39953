// SPDX-License-Identifier: Apache-2.0
// Hopper warpgroup MMA (wgmma, sm_90a) primitives for the 64x64 tile kernels: shared-memory
// descriptors for 128-byte-swizzled tiles, the products with A from registers (RS) or from shared
// memory (SS), and the fences around them (PTX ISA, "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate").
//
// Tile layout in shared memory (`swizzled_tile<D>`): 64 token rows of D 16-bit elements, stored as
// D / 64 slabs of [64 rows][128 bytes]; within a row the 16-byte chunk c sits at chunk c ^ (row % 8).
// This is the canonical 128B-swizzle layout for both operand majors, so one tile serves as a K-major
// operand (K in S = Q K^T) and as an MN-major one (V in O = P V) alike. Slabs are 1024-byte aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "stria/core/tile.hpp"
#include "stria/kernel/mma.cuh"

// wgmma exists on sm_90a only ("arch-specific" features); elsewhere the kernels that use it trap
// and the launcher never selects them (see device::hopper_kernels_available).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define STRIA_WGMMA_AVAILABLE 1
#else
#define STRIA_WGMMA_AVAILABLE 0
#endif

namespace stria::kernel {

template <int D>
struct swizzled_tile {
  static_assert(D % 64 == 0, "the swizzled layout stores 64-element (128-byte) slabs");
  static constexpr int slab_bytes = block_tokens * 128;
  static constexpr int bytes = (D / 64) * slab_bytes;
  static constexpr int row_pitch = 128;  // bytes from a row to the next within a slab

  /// Byte offset of the 16-byte chunk `chunk` (0 .. D / 8 - 1) of row `row`.
  __host__ __device__ static constexpr int offset(int row, int chunk) {
    return (chunk / 8) * slab_bytes + row * 128 + (((chunk % 8) ^ (row % 8)) * 16);
  }
};

namespace detail {

/// The first 1024-byte aligned address at or after `p` (shared memory): swizzled tiles start there.
__device__ inline unsigned char* align_1024(unsigned char* p) { return p + ((1024 - shared_address(p) % 1024) % 1024); }

/// Descriptor of a swizzled tile as a wgmma operand: K-major (the tile's rows are M or N, a k-step
/// advances 32 bytes inside a slab) or MN-major (the rows are K, a k-step of 16 rows advances 2048
/// bytes; slabs lie along M or N).
__device__ inline std::uint64_t descriptor(const unsigned char* start, int leading_bytes, int stride_bytes) {
  const auto address = static_cast<std::uint64_t>(shared_address(start));
  return ((address & 0x3FFFF) >> 4) | (static_cast<std::uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<std::uint64_t>(stride_bytes >> 4) << 32) | (std::uint64_t{1} << 62);  // 128-byte swizzle
}

/// A swizzled tile of 64 rows and D columns as a K-major operand, the k-th 16 of its columns: K in
/// S = Q K^T, or A = K and B = Q in S^T = K Q^T. `SlabStride`: bytes from one slab to the next; with
/// two tiles' slabs interleaved (twice a slab), the first tile's address names a 128-row operand.
template <int D, int SlabStride = swizzled_tile<D>::slab_bytes>
__device__ std::uint64_t k_major_operand(const unsigned char* tile, int k) {
  return descriptor(tile + (k / 4) * SlabStride + (k % 4) * 32, 16, 1024);
}

/// A swizzled tile of 64 rows and D columns as an MN-major operand (transposed), its rows 16k to
/// 16k + 15: V in O = P V, dO and Q in dV = P^T dO and dK = dS^T Q, K in dQ = dS K (all B, N = D), and
/// the dS^T tile [key][query] as A = dS (M = 64).
template <int D>
__device__ std::uint64_t mn_major_operand(const unsigned char* tile, int k) {
  return descriptor(tile + k * 16 * 128, swizzled_tile<D>::slab_bytes, 1024);
}

__device__ inline void wgmma_fence() {
#if STRIA_WGMMA_AVAILABLE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ inline void wgmma_commit() {
#if STRIA_WGMMA_AVAILABLE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int Pending>
__device__ inline void wgmma_wait() {
#if STRIA_WGMMA_AVAILABLE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
#endif
}
/// Pins accumulator registers at this point of the program: wgmma writes them asynchronously, and
/// without this the compiler may move their uses above wgmma_wait (it cannot see the dependence).
template <int N>
__device__ inline void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/// The same for A fragments in registers: wgmma reads them asynchronously, so they must stay
/// untouched (not reused for other values) until wgmma_wait.
template <int K>
__device__ inline void fence_registers(unsigned (&a)[K][4]) {
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[k][i])::"memory");
}

/// Makes this thread's generic-proxy shared-memory writes (cp.async included) visible to wgmma.
__device__ inline void fence_async_shared() {
#if STRIA_WGMMA_AVAILABLE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The accumulator operands of an m64nN wgmma: N / 2 fp32 registers per thread, as asm operand lists
// (%0 .. %N/2-1) and their placeholders.
#define STRIA_WGMMA_D32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define STRIA_WGMMA_D64 STRIA_WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define STRIA_WGMMA_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define STRIA_WGMMA_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// One wgmma with the accumulate flag as a predicate: SHAPE_TYPES names the instruction's shape and
// types, REGS the accumulator placeholders, OPERANDS the placeholders of the A and B operands, the
// flag (P) and the immediates.
#define STRIA_WGMMA_ASM(SHAPE_TYPES, REGS, OPERANDS, P) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\nwgmma.mma_async.sync.aligned." SHAPE_TYPES " " REGS ", " OPERANDS ";\n}\n"

// Whether a 16-bit element type is bf16 (else fp16): it names the wgmma instruction's types.
template <class T>
inline constexpr bool is_bf16 = std::is_same_v<T, __nv_bfloat16>;

/// d (64 x N over the warpgroup; this thread's N / 2 values in mma.sync accumulator order) +=
/// A (registers, 64 x 16) * B (shared, 16 x N). Asynchronous: fence before, commit and wait after.
template <class T, int N, int TransposeB>
__device__ inline void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], std::uint64_t desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128, "stria issues wgmma with N = 64 or 128");
#if STRIA_WGMMA_AVAILABLE
  const int flag = static_cast<int>(accumulate);
#define STRIA_WGMMA_RS(...) STRIA_WGMMA_RS_(__VA_ARGS__)  // expands STRIA_RS64 / STRIA_RS128 into arguments
#define STRIA_WGMMA_RS_(SHAPE_TYPES, REGS, OPERANDS, P, ...)                                            \
  asm volatile(STRIA_WGMMA_ASM(SHAPE_TYPES, REGS, OPERANDS, P)                                             \
               : __VA_ARGS__                                                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(flag), "n"(TransposeB))
#define STRIA_RS64 STRIA_WGMMA_REGS32, "{%32, %33, %34, %35}, %36, p, 1, 1, %38", "%37", STRIA_WGMMA_D32
#define STRIA_RS128 STRIA_WGMMA_REGS64, "{%64, %65, %66, %67}, %68, p, 1, 1, %70", "%69", STRIA_WGMMA_D64
  if constexpr (N == 64 && is_bf16<T>) STRIA_WGMMA_RS("m64n64k16.f32.bf16.bf16", STRIA_RS64);
  if constexpr (N == 64 && !is_bf16<T>) STRIA_WGMMA_RS("m64n64k16.f32.f16.f16", STRIA_RS64);
  if constexpr (N == 128 && is_bf16<T>) STRIA_WGMMA_RS("m64n128k16.f32.bf16.bf16", STRIA_RS128);
  if constexpr (N == 128 && !is_bf16<T>) STRIA_WGMMA_RS("m64n128k16.f32.f16.f16", STRIA_RS128);
#undef STRIA_RS64
#undef STRIA_RS128
#undef STRIA_WGMMA_RS
#undef STRIA_WGMMA_RS_
#else
  (void)d, (void)a, (void)desc_b, (void)accumulate;
  __trap();
#endif
}

/// d (64 x N) += A (shared, 64 x 16) * B (shared, 16 x N), both from descriptors; Transpose = 1 for an
/// MN-major operand (the 16 k-rows of a swizzled tile), 0 for K-major. Asynchronous like wgmma_rs.
template <class T, int N, int TransposeA, int TransposeB>
__device__ inline void wgmma_ss(float (&d)[N / 2], std::uint64_t desc_a, std::uint64_t desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128, "stria issues wgmma with N = 64 or 128");
#if STRIA_WGMMA_AVAILABLE
  const int flag = static_cast<int>(accumulate);
#define STRIA_WGMMA_SS(...) STRIA_WGMMA_SS_(__VA_ARGS__)  // expands STRIA_SS64 / STRIA_SS128 into arguments
#define STRIA_WGMMA_SS_(SHAPE_TYPES, REGS, OPERANDS, P, ...) \
  asm volatile(STRIA_WGMMA_ASM(SHAPE_TYPES, REGS, OPERANDS, P) \
               : __VA_ARGS__                                   \
               : "l"(desc_a), "l"(desc_b), "r"(flag), "n"(TransposeA), "n"(TransposeB))
#define STRIA_SS64 STRIA_WGMMA_REGS32, "%32, %33, p, 1, 1, %35, %36", "%34", STRIA_WGMMA_D32
#define STRIA_SS128 STRIA_WGMMA_REGS64, "%64, %65, p, 1, 1, %67, %68", "%66", STRIA_WGMMA_D64
  if constexpr (N == 64 && is_bf16<T>) STRIA_WGMMA_SS("m64n64k16.f32.bf16.bf16", STRIA_SS64);
  if constexpr (N == 64 && !is_bf16<T>) STRIA_WGMMA_SS("m64n64k16.f32.f16.f16", STRIA_SS64);
  if constexpr (N == 128 && is_bf16<T>) STRIA_WGMMA_SS("m64n128k16.f32.bf16.bf16", STRIA_SS128);
  if constexpr (N == 128 && !is_bf16<T>) STRIA_WGMMA_SS("m64n128k16.f32.f16.f16", STRIA_SS128);
#undef STRIA_SS64
#undef STRIA_SS128
#undef STRIA_WGMMA_SS
#undef STRIA_WGMMA_SS_
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();
#endif
}

}  // namespace detail

/// Writes 1 when this binary's code for the running device has the wgmma kernels (sm_90a), else 0.
template <int Unused = 0>
__global__ void probe_wgmma(int* available) {
  *available = STRIA_WGMMA_AVAILABLE;
}

}  // namespace stria::kernel
