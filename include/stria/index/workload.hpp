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
    const auto first = entries.begin() + static_cast<std::ptrdiff_t>(rank) * num_steps;
    return std::accumulate(first, first + num_steps, std::int64_t{0});
  }
  [[nodiscard]] std::int64_t total() const { return std::accumulate(entries.begin(), entries.end(), std::int64_t{0}); }
  [[nodiscard]] std::int64_t max_rank_total() const {
    std::int64_t most = 0;
    for (index_t r = 0; r < world_size; ++r) most = std::max(most, rank_total(r));
    return most;
  }

  /// Throws unless `entries` holds world_size x num_steps counts, none negative (what the readers of
  /// a workload index and add up). `name` names the workload in the message.
  void validate(const std::string& name) const {
    if (world_size < 1) throw invalid_argument(name + ".world_size", world_size, "must be at least 1");
    if (num_steps < 1) throw invalid_argument(name + ".num_steps", num_steps, "must be at least 1");
    if (const std::size_t want = static_cast<std::size_t>(world_size) * static_cast<std::size_t>(num_steps); entries.size() != want)
      throw invalid_argument(name + ".entries.size()", entries.size(), "must be world_size x num_steps = " + std::to_string(want));
    for (std::size_t i = 0; i < entries.size(); ++i)
      if (entries[i] < 0) throw invalid_argument(name + ".entries[" + std::to_string(i) + "]", entries[i], "counts must be >= 0");
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
  w.validate("workload");
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

namespace detail {

/// What the ring counters look up: the owner of each global block, and the step at which a query
/// rank computes with a KV rank's chunk.
struct ring_lookup {
  index_t world = 0;
  std::vector<index_t> owner;    // [global block]
  std::vector<index_t> step_of;  // [query rank * world + KV rank]

  /// The lookup of a counter over `selection`, once the selection and the sharding's fit are checked.
  template <sharding_policy Sharding, ring_topology Topology>
  static ring_lookup checked(const global_selection& selection, const Sharding& sharding, const Topology& topology) {
    selection.validate();
    const shard_layout layout{selection.num_blocks(), topology.world_size()};
    sharding.validate(layout);
    return of(sharding, layout, topology);
  }

  template <sharding_policy Sharding, ring_topology Topology>
  static ring_lookup of(const Sharding& sharding, const shard_layout& layout, const Topology& topology) {
    ring_lookup x{topology.world_size(), std::vector<index_t>(static_cast<std::size_t>(layout.num_blocks)),
                  std::vector<index_t>(static_cast<std::size_t>(topology.world_size()) * static_cast<std::size_t>(topology.world_size()), -1)};
    for (index_t b = 0; b < layout.num_blocks; ++b) x.owner[static_cast<std::size_t>(b)] = sharding.locate(layout, b).rank;
    for (index_t r = 0; r < x.world; ++r)
      for (index_t s = 0; s < topology.num_steps(); ++s) x.step_of[static_cast<std::size_t>(r) * static_cast<std::size_t>(x.world) + static_cast<std::size_t>(topology.kv_source_rank(r, s))] = s;
    return x;
  }
  [[nodiscard]] index_t step(index_t query_rank, index_t kv_rank) const {
    return step_of[static_cast<std::size_t>(query_rank) * static_cast<std::size_t>(world) + static_cast<std::size_t>(kv_rank)];
  }
};

}  // namespace detail

/// Counts, without building indices, what build_ring_indices would give each (rank, step):
/// tiles on selected diagonals and explicit tiles (diagonal tiles of causal attention count their
/// 64 * 65 / 2 triangle), and 64 rows per vertical token outside the row's tiles.
template <sharding_policy Sharding, ring_topology Topology>
ring_workload count_ring_workload(const global_selection& selection, const Sharding& sharding, const Topology& topology) {
  const detail::ring_lookup lookup = detail::ring_lookup::checked(selection, sharding, topology);
  const index_t nb = selection.num_blocks(), world = topology.world_size(), steps = topology.num_steps();
  const std::vector<index_t>& owner = lookup.owner;
  std::vector<index_t> run_end(owner.size());  // run_end: first later block of another owner
  for (index_t b = nb - 1; b >= 0; --b)
    run_end[static_cast<std::size_t>(b)] =
        b + 1 < nb && owner[static_cast<std::size_t>(b + 1)] == owner[static_cast<std::size_t>(b)] ? run_end[static_cast<std::size_t>(b + 1)] : b + 1;
  index_t runs = 0;
  for (index_t b = 0; b < nb; b = run_end[static_cast<std::size_t>(b)]) ++runs;
  // Long ownership runs (sequential, zigzag, a solver's chunks): a diagonal crosses few stretches
  // where both of its blocks keep their owners, and one add per stretch counts it. Striped<64>
  // changes owner every block: there the plain per-block loops are cheaper.
  const bool by_stretch = 2 * runs < nb;

  ring_workload w{world, steps, std::vector<std::int64_t>(static_cast<std::size_t>(world) * static_cast<std::size_t>(steps), 0)};
  auto add = [&](index_t q_block, index_t k_block, std::int64_t n) {
    const index_t r = owner[static_cast<std::size_t>(q_block)];
    const index_t s = lookup.step(r, owner[static_cast<std::size_t>(k_block)]);
    w.entries[static_cast<std::size_t>(r) * static_cast<std::size_t>(steps) + static_cast<std::size_t>(s)] += n;
  };
  constexpr std::int64_t full_tile = std::int64_t{block_tokens} * block_tokens;
  constexpr std::int64_t triangle = std::int64_t{block_tokens} * (block_tokens + 1) / 2;

  // A vertical token of key block k adds 64 entries at every query block of its range (causal:
  // above k; else all) whose tile is not active. Counted as the whole range, which depends on k
  // only (so all heads' tokens of one key block are counted at once), minus the active tiles on it:
  // O(nb * world + tokens x slash lines) instead of O(tokens x nb), seconds at 512K tokens.
  const auto in_range = [&](index_t q_block, index_t k_block) { return 0 <= q_block && q_block < nb && (!selection.causal || q_block > k_block); };
  std::vector<std::int64_t> tokens_in(static_cast<std::size_t>(nb), 0);       // every head's vertical tokens per key block
  std::vector<std::int64_t> head_tokens_in(static_cast<std::size_t>(nb), 0);  // this head's
  std::vector<std::int64_t> head_prefix(static_cast<std::size_t>(nb) + 1);  // this head's, summed up to a key block
  std::vector<index_t> head_key_blocks;                                       // this head's key blocks with tokens
  std::vector<unsigned char> on_slash(static_cast<std::size_t>(2 * nb - 1));  // delta + nb - 1
  for (const head_selection& head : selection.heads) {
    std::fill(on_slash.begin(), on_slash.end(), 0);
    for (const index_t delta : head.slash_deltas) on_slash[static_cast<std::size_t>(delta + nb - 1)] = 1;
    for (const index_t delta : head.slash_deltas) {
      const std::int64_t tile = selection.causal && delta == 0 ? triangle : full_tile;
      const index_t end = std::min(nb, nb + delta);
      for (index_t q_block = std::max<index_t>(0, delta), next = 0; q_block < end; q_block = next) {
        next = by_stretch ? std::min({run_end[static_cast<std::size_t>(q_block)], run_end[static_cast<std::size_t>(q_block - delta)] + delta, end})
                          : q_block + 1;
        add(q_block, q_block - delta, tile * (next - q_block));
      }
    }
    for (const block_pair& b : head.blocks)
      if (!on_slash[static_cast<std::size_t>(b.query_block - b.key_block + nb - 1)])
        add(b.query_block, b.key_block, selection.causal && b.query_block == b.key_block ? triangle : full_tile);

    head_key_blocks.clear();
    for (const index_t token : head.vertical_tokens) {  // sorted: key blocks in order
      const index_t k_block = token / block_tokens;
      if (head_key_blocks.empty() || head_key_blocks.back() != k_block) head_key_blocks.push_back(k_block);
      ++head_tokens_in[static_cast<std::size_t>(k_block)];
      ++tokens_in[static_cast<std::size_t>(k_block)];
    }
    // The slash tiles on the tokens' ranges: per key block with tokens, or (long runs, many such
    // blocks) per diagonal and stretch, with the head's tokens summed over the stretch.
    if (by_stretch && 2 * std::size_t(runs) < head_key_blocks.size()) {
      head_prefix[0] = 0;
      for (index_t b = 0; b < nb; ++b)
        head_prefix[static_cast<std::size_t>(b) + 1] = head_prefix[static_cast<std::size_t>(b)] + head_tokens_in[static_cast<std::size_t>(b)];
      for (const index_t delta : head.slash_deltas) {
        if (selection.causal && delta <= 0) continue;  // the range lies above the key block
        const index_t end = std::min(nb, nb - delta);
        for (index_t k_block = std::max<index_t>(0, -delta), next = 0; k_block < end; k_block = next) {
          next = std::min({run_end[static_cast<std::size_t>(k_block)], run_end[static_cast<std::size_t>(k_block + delta)] - delta, end});
          const std::int64_t tokens = head_prefix[static_cast<std::size_t>(next)] - head_prefix[static_cast<std::size_t>(k_block)];
          if (tokens > 0) add(k_block + delta, k_block, -block_tokens * tokens);
        }
      }
    } else {
      for (const index_t k_block : head_key_blocks) {
        const std::int64_t rows = block_tokens * head_tokens_in[static_cast<std::size_t>(k_block)];
        for (const index_t delta : head.slash_deltas)
          if (in_range(k_block + delta, k_block)) add(k_block + delta, k_block, -rows);
      }
    }
    for (const block_pair& b : head.blocks)
      if (head_tokens_in[static_cast<std::size_t>(b.key_block)] > 0 && in_range(b.query_block, b.key_block) &&
          !on_slash[static_cast<std::size_t>(b.query_block - b.key_block + nb - 1)])
        add(b.query_block, b.key_block, -block_tokens * head_tokens_in[static_cast<std::size_t>(b.key_block)]);
    for (const index_t k_block : head_key_blocks) head_tokens_in[static_cast<std::size_t>(k_block)] = 0;
  }

  // The whole ranges: per key block, the query blocks each rank owns in the range (causal: the
  // blocks above, counted while walking down; else every block).
  std::vector<std::int64_t> owned(static_cast<std::size_t>(world), 0);
  if (!selection.causal)
    for (index_t b = 0; b < nb; ++b) ++owned[static_cast<std::size_t>(owner[static_cast<std::size_t>(b)])];
  for (index_t k_block = nb - 1; k_block >= 0; --k_block) {
    const std::int64_t tokens = tokens_in[static_cast<std::size_t>(k_block)];
    const index_t kv_rank = owner[static_cast<std::size_t>(k_block)];
    if (tokens > 0)
      for (index_t r = 0; r < world; ++r) {
        const std::int64_t blocks = owned[static_cast<std::size_t>(r)];
        if (blocks == 0) continue;
        const index_t s = lookup.step(r, kv_rank);
        w.entries[static_cast<std::size_t>(r) * static_cast<std::size_t>(steps) + static_cast<std::size_t>(s)] += block_tokens * tokens * blocks;
      }
    if (selection.causal) ++owned[static_cast<std::size_t>(kv_rank)];
  }
  return w;
}

}  // namespace stria
