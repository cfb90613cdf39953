// SPDX-License-Identifier: Apache-2.0
// What every ring engine (host and device) shares: the checks that the communicator and a rank's
// per-step indices fit the schedule, its error for a broken gradient schedule, and the message tags
// of the schedule's transfers.
#pragma once

#include <span>
#include <string>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"

namespace stria {

/// Throws unless the communicator has the topology's number of ranks.
template <ring_topology Topology>
void check_ring_world(index_t comm_world_size, const Topology& topology) {
  if (comm_world_size != topology.world_size())
    throw invalid_argument("comm.world_size()", comm_world_size, "must equal the topology's world size " + std::to_string(topology.world_size()));
}

/// A backward ring whose gradient schedule broke its promise: `what` happened on `rank`.
inline comm_error gradient_schedule_error(index_t rank, const std::string& what) {
  return comm_error("rank " + std::to_string(rank) + " " + what + " (inconsistent gradient schedule)");
}

/// Throws unless `indices` holds one index per step of `topology`, each built for this rank and
/// that step's KV source (an index built for another configuration is never used silently).
template <ring_topology Topology, class Index>
void check_ring_indices(const Topology& topology, index_t rank, std::span<const Index> indices) {
  if (static_cast<index_t>(indices.size()) != topology.num_steps())
    throw invalid_argument("indices.size()", indices.size(),
                           "must equal the topology's number of steps " + std::to_string(topology.num_steps()));
  for (index_t s = 0; s < topology.num_steps(); ++s) {
    const auto& o = indices[static_cast<std::size_t>(s)].origin;
    const std::string field = "indices[" + std::to_string(s) + "].origin";
    if (o.world_size != topology.world_size())
      throw invalid_argument(field + ".world_size", o.world_size,
                             "the index was built for another configuration: the ring has " + std::to_string(topology.world_size()) + " ranks");
    if (o.rank != rank || o.step != s || o.kv_source_rank != topology.kv_source_rank(rank, s))
      throw invalid_argument(field + ".kv_source_rank", o.kv_source_rank,
                             "the index was built for another configuration: rank " + std::to_string(rank) + " step " +
                                 std::to_string(s) + " computes with the KV of rank " +
                                 std::to_string(topology.kv_source_rank(rank, s)) + " (index: rank " + std::to_string(o.rank) +
                                 ", step " + std::to_string(o.step) + ")");
  }
}

/// Message tags: KV and dK/dV partials, inner and outer links, as separate NCCL communicators would be.
constexpr int ring_message_tag(const ring_transfer& t, bool gradient) {
  return (gradient ? 2 : 0) + (t.channel == ring_channel::outer ? 1 : 0);
}

/// The link a message tag of ring_message_tag travels on (a communicator with separate inner and
/// outer rings routes by it).
constexpr ring_channel ring_message_channel(int tag) { return tag % 2 == 1 ? ring_channel::outer : ring_channel::inner; }

}  // namespace stria
