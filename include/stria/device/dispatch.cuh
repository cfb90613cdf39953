// SPDX-License-Identifier: Apache-2.0
// The launcher of device dispatch/undispatch (sharding/dispatch.cuh): checks the call, then copies
// one rank's whole 64-token blocks between a token-major global tensor and its shard on a stream.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/cuda_check.cuh"
#include "stria/core/device_buffer.cuh"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"
#include "stria/device/launch.cuh"
#include "stria/kernel/dispatch.cuh"

namespace stria::device {

/// Checks the call and moves `rank`'s blocks: to_shard copies global -> shard, else shard -> global.
template <sharding_policy P, class T>
void move_rank_blocks(const P& policy, const T* from, T* to, index_t seq_len, std::size_t row_elements, index_t world_size,
                      index_t rank, bool to_shard, cudaStream_t stream) {
  if (seq_len <= 0 || seq_len % block_tokens != 0)
    throw invalid_argument("seq_len", seq_len, "must be a positive multiple of 64 (the block size)");
  if (world_size < 1) throw invalid_argument("world_size", world_size, "must be at least 1");
  if (rank < 0 || rank >= world_size) throw invalid_argument("rank", rank, "must lie in [0, world_size = " + std::to_string(world_size) + ")");
  const shard_layout layout{seq_len / block_tokens, world_size};
  policy.validate(layout);
  const std::size_t block_bytes = static_cast<std::size_t>(block_tokens) * row_elements * sizeof(T);
  if (row_elements == 0 || block_bytes % 16 != 0)
    throw invalid_argument("row_elements", row_elements, "must make a 64-token block a multiple of 16 bytes (the copy's vector)");
  for (const auto& [name, pointer] : {std::pair{"global", static_cast<const void*>(to_shard ? from : to)},
                                      std::pair{"shard", static_cast<const void*>(to_shard ? to : from)}}) {
    if (pointer == nullptr) throw invalid_argument(name, "nullptr", "must point to device memory");
    if (reinterpret_cast<std::uintptr_t>(pointer) % 16 != 0) throw invalid_argument(name, pointer, "must be 16-byte aligned");
  }
  const index_t local = policy.local_blocks(layout);
  std::vector<index_t> global_block(static_cast<std::size_t>(local)), local_block(global_block.size());
  for (index_t b = 0; b < local; ++b) {
    global_block[static_cast<std::size_t>(b)] = policy.global_block(layout, {rank, b});
    local_block[static_cast<std::size_t>(b)] = b;
  }
  const device_buffer<index_t> global_d{std::span<const index_t>(global_block), stream}, local_d{std::span<const index_t>(local_block), stream};
  const std::int64_t block_vectors = static_cast<std::int64_t>(block_bytes / 16);
  const std::int64_t total = static_cast<std::int64_t>(local) * block_vectors;
  const auto grid = static_cast<unsigned>(std::clamp<std::int64_t>((total + 255) / 256, 1, 65535));
  detail::launch<&kernel::copy_token_blocks<>>("copy_token_blocks", {grid, 256, 0, stream}, reinterpret_cast<const uint4*>(from),
                                               reinterpret_cast<uint4*>(to), to_shard ? global_d.data() : local_d.data(),
                                               to_shard ? local_d.data() : global_d.data(), local, block_vectors);
}

}  // namespace stria::device
