// SPDX-License-Identifier: Apache-2.0
// A kernel ptxas must serialize (check_ptxas.cmake's own test): the accumulator is read by ordinary
// code while a product that writes it is still in flight, so ptxas injects waits (C7517).
#include <cuda_bf16.h>

#include "stria/kernel/wgmma.cuh"

__global__ void serialized_products(float* out, int steps) {
  namespace d = stria::kernel::detail;
  extern __shared__ __align__(1024) unsigned char tile[];
  float acc[32] = {};
  const unsigned a[4] = {threadIdx.x, 1u, 2u, 3u};
  for (int i = 0; i < steps; ++i) {
    d::wgmma_fence();
    d::wgmma_rs<__nv_bfloat16, 64, 0>(acc, a, d::k_major_operand<64>(tile, i % 4), true);
    d::wgmma_commit();
    if (acc[i % 32] > 0.0f) acc[0] += 1.0f;  // no wait before this read
  }
  d::wgmma_wait<0>();
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = acc[i];
}
