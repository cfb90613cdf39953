// SPDX-License-Identifier: Apache-2.0
// The kernel of device dispatch/undispatch (sharding/dispatch.cuh): moves whole 64-token blocks of a
// token-major tensor between a global tensor and one rank's shard, in 16-byte vectors.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "stria/core/config.hpp"

namespace stria::kernel {

/// to[to_block[b]] = from[from_block[b]] for blocks of `block_vectors` 16-byte vectors.
/// Grid-stride over (block, vector).
template <int Unused = 0>
__global__ void copy_token_blocks(const uint4* __restrict__ from, uint4* __restrict__ to, const index_t* __restrict__ from_block,
                                  const index_t* __restrict__ to_block, index_t blocks, std::int64_t block_vectors) {
  const std::int64_t total = static_cast<std::int64_t>(blocks) * block_vectors;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t b = i / block_vectors, v = i % block_vectors;
    to[to_block[b] * block_vectors + v] = from[from_block[b] * block_vectors + v];
  }
}

}  // namespace stria::kernel
