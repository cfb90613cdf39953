// SPDX-License-Identifier: Apache-2.0
// Host gathering of the observation window's statistics across ranks (DESIGN 7, steps 1-3), and
// estimate(): statistics then selection. Runs on any communicator with the host_threads surface.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::estimator {

namespace detail {

/// Statistics of `heads` query heads with zeroed slash and window masses, ready to be filled.
inline vs_statistics empty_statistics(index_t seq_len, index_t heads, bool causal, index_t window_rows, index_t local_blocks) {
  vs_statistics st;
  st.seq_len = seq_len;
  st.num_heads = heads;
  st.causal = causal;
  st.window_rows = window_rows;
  st.local_blocks = local_blocks;
  st.slash_mass.assign(static_cast<std::size_t>(heads) * static_cast<std::size_t>(st.num_diagonals()), 0.0f);
  st.window_mass.assign(static_cast<std::size_t>(heads), 0.0f);
  return st;
}

/// The collectives that finish every rank's statistics, shared by the host and device paths: slash
/// and window mass summed over ranks (in rank order), and each rank's `per_rank` top candidates per
/// head ([heads, per_rank] in `mine`) gathered into every head's union, in selection order, without
/// the local-block sentinels (mass -1).
template <class Comm>
void finish_statistics(Comm& comm, vs_statistics& st, const std::vector<vertical_candidate>& mine, index_t per_rank) {
  comm.all_reduce(st.slash_mass.data(), st.slash_mass.data(), st.slash_mass.size(), comm::reduce_op::sum);
  comm.all_reduce(st.window_mass.data(), st.window_mass.data(), st.window_mass.size(), comm::reduce_op::sum);
  const index_t world = comm.world_size(), heads = st.num_heads;
  std::vector<vertical_candidate> all(mine.size() * static_cast<std::size_t>(world));
  comm.all_gather(mine.data(), all.data(), mine.size());
  st.vertical.assign(static_cast<std::size_t>(heads), {});
  for (index_t h = 0; h < heads; ++h) {
    // Each rank's run is already in selection order: merge the runs pairwise instead of sorting.
    auto& union_h = st.vertical[static_cast<std::size_t>(h)];
    union_h.reserve(static_cast<std::size_t>(world) * static_cast<std::size_t>(per_rank));
    for (index_t r = 0; r < world; ++r) {
      const auto begin = all.begin() + (static_cast<std::ptrdiff_t>(r) * heads + h) * per_rank;
      union_h.insert(union_h.end(), begin, begin + per_rank);
    }
    for (index_t width = per_rank; width < static_cast<index_t>(union_h.size()); width *= 2)
      for (index_t first = 0; first + width < static_cast<index_t>(union_h.size()); first += 2 * width)
        std::inplace_merge(union_h.begin() + first, union_h.begin() + first + width,
                           union_h.begin() + std::min<index_t>(first + 2 * width, static_cast<index_t>(union_h.size())));
    union_h.erase(std::find_if(union_h.begin(), union_h.end(), [](const vertical_candidate& c) { return c.mass < 0.0f; }), union_h.end());
  }
}

/// The selection when an estimator asks for no statistics: select() on the shape alone.
template <index_estimator Estimator>
global_selection select_without_statistics(const Estimator& estimator, index_t seq_len, index_t num_heads, bool causal) {
  vs_statistics shape;
  shape.seq_len = seq_len;
  shape.num_heads = num_heads;
  shape.causal = causal;
  return estimator.select(shape);
}

}  // namespace detail

/// Gathers the window statistics of `request` on every rank, identically:
/// 1. the window (the last window_rows global query tokens) reaches every rank: each owner writes its
///    rows into a zeroed buffer and an all-reduce sums them (exact: every element has one writer);
/// 2. each rank scores the window against its local keys (scaled, causal by global position);
/// 3. the softmax becomes global: all-reduce of the row max, then of the row sum of exp;
/// 4. slash mass per block diagonal is summed locally and all-reduced; each rank contributes its
///    top vertical candidates per head, and an all-gather gives every rank their union.
///   q_local [S_local, Hq, D]   k_local [S_local, Hkv, D]   (this rank's shards under `sharding`)
template <class Comm, sharding_policy Sharding, class T>
vs_statistics gather_window_statistics(Comm& comm, const Sharding& sharding, index_t seq_len, bool causal,
                                       tensor_view<const T, 3> q_local, tensor_view<const T, 3> k_local, double softmax_scale,
                                       statistics_request request) {
  static_assert(check_host_collectives<Comm>());
  const index_t world = comm.world_size(), rank = comm.rank();
  const attention_shape shape{q_local.extent(0), k_local.extent(0), q_local.extent(1), k_local.extent(1), q_local.extent(2)};
  shape.validate();
  const shard_layout layout{seq_len / block_tokens, world};
  sharding.validate(layout);
  const index_t local_tokens = sharding.local_blocks(layout) * block_tokens;
  check_extents(q_local, {local_tokens, shape.heads_q, shape.head_dim}, "q_local");
  check_extents(k_local, {local_tokens, shape.heads_kv, shape.head_dim}, "k_local");
  if (request.window_rows < 1 || request.window_rows > std::min(seq_len, block_tokens))
    throw invalid_argument("request.window_rows", request.window_rows, "must lie in [1, 64]: the window is the end of the last block");
  if (request.local_blocks < 0 || request.local_blocks > seq_len / block_tokens)
    throw invalid_argument("request.local_blocks", request.local_blocks, "must lie in [0, seq_len / 64]");

  const index_t rows = request.window_rows, heads = shape.heads_q, dim = shape.head_dim;
  const index_t first_row = seq_len - rows;  // global token of window row 0
  auto global_token = [&](index_t local_token) {
    return sharding.global_block(layout, {rank, local_token / block_tokens}) * block_tokens + local_token % block_tokens;
  };

  // 1. The window's queries on every rank: [rows, Hq, D].
  std::vector<float> window(static_cast<std::size_t>(rows) * heads * dim, 0.0f);
  for (index_t a = 0; a < rows; ++a) {
    const index_t token = first_row + a;
    const block_location where = sharding.locate(layout, token / block_tokens);
    if (where.rank != rank) continue;
    const index_t local = where.local_block * block_tokens + token % block_tokens;
    for (index_t h = 0; h < heads; ++h)
      for (index_t d = 0; d < dim; ++d) window[(static_cast<std::size_t>(a) * heads + h) * dim + d] = float(q_local(local, h, d));
  }
  comm.all_reduce(window.data(), window.data(), window.size(), comm::reduce_op::sum);

  // 2. Scores against the local keys, [Hq, rows, local_tokens]; -inf where causally masked.
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<index_t> key_global(static_cast<std::size_t>(local_tokens));
  for (index_t j = 0; j < local_tokens; ++j) key_global[static_cast<std::size_t>(j)] = global_token(j);
  std::vector<float> score(static_cast<std::size_t>(heads) * rows * local_tokens);
  std::vector<float> row_max(static_cast<std::size_t>(heads) * rows, neg_inf);
  for (index_t h = 0; h < heads; ++h) {
    const index_t hk = shape.kv_head(h);
    for (index_t a = 0; a < rows; ++a) {
      const float* qrow = window.data() + (static_cast<std::size_t>(a) * heads + h) * dim;
      float& top = row_max[static_cast<std::size_t>(h) * rows + a];
      for (index_t j = 0; j < local_tokens; ++j) {
        float& s = score[(static_cast<std::size_t>(h) * rows + a) * local_tokens + j];
        if (causal && key_global[static_cast<std::size_t>(j)] > first_row + a) {
          s = neg_inf;
          continue;
        }
        float dot = 0;
        for (index_t d = 0; d < dim; ++d) dot += qrow[d] * float(k_local(j, hk, d));
        s = dot * float(softmax_scale);
        top = std::max(top, s);
      }
    }
  }
  // 3. Global softmax normaliser.
  comm.all_reduce(row_max.data(), row_max.data(), row_max.size(), comm::reduce_op::max);
  // Sums of many small terms accumulate in double here, then travel as float.
  std::vector<float> row_sum(row_max.size(), 0.0f);
  for (std::size_t r = 0; r < row_max.size(); ++r) {
    double sum = 0;
    for (index_t j = 0; j < local_tokens; ++j) {
      const float s = score[r * static_cast<std::size_t>(local_tokens) + static_cast<std::size_t>(j)];
      if (s != neg_inf) sum += std::exp(double(s) - double(row_max[r]));
    }
    row_sum[r] = float(sum);
  }
  comm.all_reduce(row_sum.data(), row_sum.data(), row_sum.size(), comm::reduce_op::sum);

  // 4. Probabilities into vertical (per key token) and slash (per block diagonal) sums.
  vs_statistics st = detail::empty_statistics(seq_len, heads, causal, rows, request.local_blocks);
  const index_t first_local_block = layout.num_blocks - request.local_blocks;  // its tokens are never vertical candidates
  const index_t diagonals = st.num_diagonals(), offset = st.diagonal_offset();
  // Every rank sends the same number of candidates (one all-gather); local-block tokens carry mass
  // -1, sort last, and are dropped from the union, so its top-k is exact for k <= per_rank.
  const index_t per_rank = std::min(request.vertical_candidates, local_tokens);
  std::vector<vertical_candidate> mine(static_cast<std::size_t>(heads) * per_rank);
  std::vector<vertical_candidate> column(static_cast<std::size_t>(local_tokens));
  std::vector<double> column_mass(static_cast<std::size_t>(local_tokens)), slash(static_cast<std::size_t>(diagonals));
  for (index_t h = 0; h < heads; ++h) {
    std::fill(column_mass.begin(), column_mass.end(), 0.0);
    std::fill(slash.begin(), slash.end(), 0.0);
    double total = 0;
    for (index_t a = 0; a < rows; ++a) {
      const std::size_t r = static_cast<std::size_t>(h) * rows + a;
      if (row_sum[r] == 0.0f) continue;  // a row with no keys anywhere contributes nothing
      const index_t q_block = (first_row + a) / block_tokens;
      for (index_t j = 0; j < local_tokens; ++j) {
        const float s = score[r * static_cast<std::size_t>(local_tokens) + static_cast<std::size_t>(j)];
        if (s == neg_inf) continue;
        const double p = std::exp(double(s) - double(row_max[r])) / double(row_sum[r]);
        column_mass[static_cast<std::size_t>(j)] += p;
        slash[static_cast<std::size_t>(q_block - key_global[static_cast<std::size_t>(j)] / block_tokens + offset)] += p;
        total += p;
      }
    }
    // Tokens of the local blocks get no vertical mass: they sort last and are never among the candidates.
    for (index_t j = 0; j < local_tokens; ++j) {
      const index_t token = key_global[static_cast<std::size_t>(j)];
      const bool local_block = token / block_tokens >= first_local_block;
      column[static_cast<std::size_t>(j)] = {local_block ? -1.0f : float(column_mass[static_cast<std::size_t>(j)]), token};
    }
    for (index_t x = 0; x < diagonals; ++x)
      st.slash_mass[static_cast<std::size_t>(h) * diagonals + static_cast<std::size_t>(x)] = float(slash[static_cast<std::size_t>(x)]);
    st.window_mass[static_cast<std::size_t>(h)] = float(total);
    std::partial_sort(column.begin(), column.begin() + per_rank, column.end());
    std::copy(column.begin(), column.begin() + per_rank, mine.begin() + static_cast<std::ptrdiff_t>(h) * per_rank);
  }
  detail::finish_statistics(comm, st, mine, per_rank);
  return st;
}

/// The estimator's global selection, identical on every rank: statistics (when it asks for any),
/// then select(). q_local and k_local are this rank's shards.
template <index_estimator Estimator, class Comm, sharding_policy Sharding, class T>
global_selection estimate(const Estimator& estimator, Comm& comm, const Sharding& sharding, index_t seq_len, bool causal,
                          tensor_view<const T, 3> q_local, tensor_view<const T, 3> k_local, double softmax_scale) {
  static_assert(check_host_collectives<Comm>());
  estimator.validate(seq_len, q_local.extent(1));
  const statistics_request request = estimator.request(seq_len);
  if (request.window_rows == 0) return detail::select_without_statistics(estimator, seq_len, q_local.extent(1), causal);
  return estimator.select(gather_window_statistics(comm, sharding, seq_len, causal, q_local, k_local, softmax_scale, request));
}

}  // namespace stria::estimator
