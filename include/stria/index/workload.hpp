// SPDX-License-Identifier: Apache-2.0
// Workload planner: active entries and FLOPs per (rank, ring step) of a global selection under a
// sharding and a ring topology, and the worker- and step-level imbalance degrees (MTraining 4.1).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"
#include "stria/index/global_selection.hpp"

namespace stria {

/// Active (query, key) entries each rank computes at each ring step.
struct ring_workload {
  index_t world_size = 0;
  index_t num_steps = 0;
  std::vector<std::int64_t> entries;  // [world_size, num_steps]

  [[nodiscard]] std::int64_t at(index_t rank, index_t step) const {
    return entries[static_cast<std::size_t>(rank) * static_cast<std::size_t>(num_steps) + static_cast<std::size_t>(step)];
  }
  [[nodiscard]] std::int64_t rank_total(index_t rank) const {
    std::int64_t sum = 0;
    for (index_t s = 0; s < num_steps; ++s) sum += at(rank, s);
    return sum;
  }
  [[nodiscard]] std::int64_t total() const { return std::accumulate(entries.begin(), entries.end(), std::int64_t{0}); }
  [[nodiscard]] std::int64_t max_rank_total() const {
    std::int64_t most = 0;
    for (index_t r = 0; r < world_size; ++r) most = std::max(most, rank_total(r));
    return most;
  }
};

/// FLOPs of `entries` active entries: 4 * D per entry forward (QK^T and PV), 2.5x that backward.
constexpr double forward_flops(std::int64_t entries, index_t head_dim) { return 4.0 * double(entries) * head_dim; }
constexpr double backward_flops(std::int64_t entries, index_t head_dim) { return 2.5 * forward_flops(entries, head_dim); }

/// Imbalance degrees, max / mean (1.0 is perfect balance):
/// - worker level: per step, the busiest rank over the mean rank; reported as mean and max over steps;
/// - step level: per rank, its busiest step over its mean step; reported as mean and max over ranks.
/// A step (or rank) with no work at all counts as balanced.
struct imbalance_degrees {
  double worker_mean = 1.0;
  double worker_max = 1.0;
  double step_mean = 1.0;
  double step_max = 1.0;
};

inline imbalance_degrees measure_imbalance(const ring_workload& w) {
  auto ratio = [](const std::vector<double>& x) {
    const double mean = std::accumulate(x.begin(), x.end(), 0.0) / double(x.size());
    return mean > 0 ? *std::max_element(x.begin(), x.end()) / mean : 1.0;
  };
  imbalance_degrees d{0.0, 0.0, 0.0, 0.0};
  std::vector<double> column(static_cast<std::size_t>(w.world_size)), row(static_cast<std::size_t>(w.num_steps));
  for (index_t s = 0; s < w.num_steps; ++s) {
    for (index_t r = 0; r < w.world_size; ++r) column[static_cast<std::size_t>(r)] = double(w.at(r, s));
    const double x = ratio(column);
    d.worker_mean += x / double(w.num_steps);
    d.worker_max = std::max(d.worker_max, x);
  }
  for (index_t r = 0; r < w.world_size; ++r) {
    for (index_t s = 0; s < w.num_steps; ++s) row[static_cast<std::size_t>(s)] = double(w.at(r, s));
    const double x = ratio(row);
    d.step_mean += x / double(w.world_size);
    d.step_max = std::max(d.step_max, x);
  }
  return d;
}

/// Counts, without building indices, what build_ring_indices would give each (rank, step):
/// tiles on selected diagonals and explicit tiles (diagonal tiles of causal attention count their
/// 64 * 65 / 2 triangle), and 64 rows per vertical token outside the row's tiles.
template <sharding_policy Sharding, ring_topology Topology>
ring_workload count_ring_workload(const global_selection& selection, const Sharding& sharding, const Topology& topology) {
  selection.validate();
  const index_t nb = selection.num_blocks(), world = topology.world_size(), steps = topology.num_steps();
  const shard_layout layout{nb, world};
  sharding.validate(layout);

  std::vector<index_t> owner(static_cast<std::size_t>(nb));
  for (index_t b = 0; b < nb; ++b) owner[static_cast<std::size_t>(b)] = sharding.locate(layout, b).rank;
  // step_of[query rank][KV rank]: the step at which the query rank computes with that KV.
  std::vector<index_t> step_of(static_cast<std::size_t>(world) * static_cast<std::size_t>(world), -1);
  for (index_t r = 0; r < world; ++r)
    for (index_t s = 0; s < steps; ++s) step_of[static_cast<std::size_t>(r * world + topology.kv_source_rank(r, s))] = s;

  ring_workload w{world, steps, std::vector<std::int64_t>(static_cast<std::size_t>(world) * static_cast<std::size_t>(steps), 0)};
  auto add = [&](index_t q_block, index_t k_block, std::int64_t n) {
    const index_t r = owner[static_cast<std::size_t>(q_block)];
    const index_t s = step_of[static_cast<std::size_t>(r * world + owner[static_cast<std::size_t>(k_block)])];
    w.entries[static_cast<std::size_t>(r) * static_cast<std::size_t>(steps) + static_cast<std::size_t>(s)] += n;
  };
  constexpr std::int64_t full_tile = std::int64_t{block_tokens} * block_tokens;
  constexpr std::int64_t triangle = std::int64_t{block_tokens} * (block_tokens + 1) / 2;

  std::vector<unsigned char> on_slash(static_cast<std::size_t>(2 * nb - 1));  // delta + nb - 1
  for (const head_selection& head : selection.heads) {
    std::fill(on_slash.begin(), on_slash.end(), 0);
    for (const index_t delta : head.slash_deltas) on_slash[static_cast<std::size_t>(delta + nb - 1)] = 1;
    auto active_tile = [&](index_t q_block, index_t k_block) {
      return on_slash[static_cast<std::size_t>(q_block - k_block + nb - 1)] ||
             (!head.blocks.empty() && std::binary_search(head.blocks.begin(), head.blocks.end(), block_pair{q_block, k_block}));
    };
    for (const index_t delta : head.slash_deltas)
      for (index_t q_block = std::max<index_t>(0, delta); q_block < std::min(nb, nb + delta); ++q_block)
        add(q_block, q_block - delta, selection.causal && delta == 0 ? triangle : full_tile);
    for (const block_pair& b : head.blocks)
      if (!on_slash[static_cast<std::size_t>(b.query_block - b.key_block + nb - 1)])
        add(b.query_block, b.key_block, selection.causal && b.query_block == b.key_block ? triangle : full_tile);
    for (const index_t token : head.vertical_tokens) {
      const index_t k_block = token / block_tokens;
      for (index_t q_block = selection.causal ? k_block + 1 : 0; q_block < nb; ++q_block)
        if (!active_tile(q_block, k_block)) add(q_block, k_block, block_tokens);
    }
  }
  return w;
}

}  // namespace stria
