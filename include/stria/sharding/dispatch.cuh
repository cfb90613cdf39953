// SPDX-License-Identifier: Apache-2.0
// Device dispatch/undispatch for any sharding policy: one rank's shard of a token-major global
// tensor in device memory ([S, ...] -> [S / W, ...]), and back, by a gather of whole 64-token blocks
// on a stream (the device counterpart of dispatch.hpp); device/dispatch.cuh launches the copy.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "stria/core/concepts.hpp"
#include "stria/core/config.hpp"
#include "stria/device/dispatch.cuh"

namespace stria::sharding {

/// Writes rank `rank`'s shard [S / W, ...] of the global tensor [S, ...] (`row_elements` elements per
/// token, e.g. heads x head_dim), both contiguous in device memory, queued on `stream`.
template <sharding_policy P, class T>
void dispatch_device(const P& policy, const T* global, T* shard, index_t seq_len, std::size_t row_elements, index_t world_size,
                     index_t rank, cudaStream_t stream) {
  device::move_rank_blocks(policy, global, shard, seq_len, row_elements, world_size, rank, true, stream);
}

/// The inverse: writes rank `rank`'s shard into its blocks of the global tensor (the other ranks'
/// blocks are left as they are; every rank's call together fill it).
template <sharding_policy P, class T>
void undispatch_device(const P& policy, const T* shard, T* global, index_t seq_len, std::size_t row_elements, index_t world_size,
                       index_t rank, cudaStream_t stream) {
  device::move_rank_blocks(policy, shard, global, seq_len, row_elements, world_size, rank, false, stream);
}

}  // namespace stria::sharding
