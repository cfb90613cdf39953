// SPDX-License-Identifier: Apache-2.0
// The GPU builder of local step indices: build_local_index_device and its batched and per-ring forms
// produce on the device exactly the arrays that build_local_index (local_index.hpp) produces on the
// host, from a device_selection (device_index.cuh). device/local_index.cuh launches the kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <span>
#include <utility>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/device/local_index.cuh"
#include "stria/index/device_index.cuh"
#include "stria/index/global_selection.hpp"
#include "stria/index/local_index.hpp"
#include "stria/index/step_index.hpp"

namespace stria {

/// build_local_index on the GPU for a batch of indices (a layer's ring steps, a rank's solver
/// tasks), in order on `stream`, with one host synchronisation for the whole batch: every index is
/// counted first, the totals that size the entry arrays are read together, then every index is
/// filled. Returns the indices in request order.
template <sharding_policy Sharding>
std::vector<device_step_index> build_local_indices_device(const device_selection& sel, const Sharding& sharding, index_t world_size,
                                                          std::span<const index_request> requests, cudaStream_t stream = nullptr) {
  return device::build_local_indices(sel, sharding, world_size, requests, stream);
}

/// build_local_index on the GPU: the index of `query_rank`'s local query blocks against `kv_rank`'s
/// KV shard, built in order on `stream` (one host synchronisation, to size the entry arrays).
template <sharding_policy Sharding>
device_step_index build_local_index_device(const device_selection& sel, const Sharding& sharding, index_t world_size, index_t query_rank,
                                           index_t kv_rank, step_index_origin origin = {}, cudaStream_t stream = nullptr) {
  const index_request request{query_rank, kv_rank, origin};
  return std::move(build_local_indices_device(sel, sharding, world_size, std::span<const index_request>(&request, 1), stream).front());
}

/// Every step's index of `rank` under a ring topology, on the GPU in one batch: element s is for step s.
template <sharding_policy Sharding, ring_topology Topology>
std::vector<device_step_index> build_ring_indices_device(const device_selection& sel, const Sharding& sharding, const Topology& topology,
                                                         index_t rank, cudaStream_t stream = nullptr) {
  std::vector<index_request> steps;
  steps.reserve(static_cast<std::size_t>(topology.num_steps()));
  for (index_t s = 0; s < topology.num_steps(); ++s) steps.push_back({rank, topology.kv_source_rank(rank, s), {0, 0, 0, s, 0}});
  return build_local_indices_device(sel, sharding, topology.world_size(), steps, stream);
}

}  // namespace stria
