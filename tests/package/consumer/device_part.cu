// SPDX-License-Identifier: Apache-2.0
// The consumer's CUDA translation unit: stria's umbrella header under nvcc brings the device layer.
#include <stria/stria.hpp>

__global__ void block_side(int* out) { *out = stria::tile<64, 64, 128>::block_q; }

int device_part_check() {
  STRIA_CUDA_CHECK(cudaSuccess);  // compiles and links against cudart; needs no GPU
  return stria::tile<64, 64, 128>::block_kv;
}
