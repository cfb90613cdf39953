// SPDX-License-Identifier: Apache-2.0
// The host backend of the window statistics engine (engine/window_statistics_engine.hpp) and
// estimate(): statistics then selection. Runs on any communicator with the host_collectives surface.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "stria/comm/host_threads.hpp"
#include "stria/core/attention_shape.hpp"
#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/softmax_merge.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/engine/window_statistics_engine.hpp"
#include "stria/estimator/statistics.hpp"
#include "stria/index/global_selection.hpp"

namespace stria::estimator {

namespace detail {

/// The selection when an estimator asks for no statistics: select() on the shape alone.
template <index_estimator Estimator>
global_selection select_without_statistics(const Estimator& estimator, index_t seq_len, index_t num_heads, bool causal) {
  vs_statistics shape;
  shape.seq_len = seq_len;
  shape.num_heads = num_heads;
  shape.causal = causal;
  return estimator.select(shape);
}

/// The host backend of the window statistics engine: the reference tile math in plain loops on this
/// rank's shards, scores in fp32, sums of exp and probabilities in fp64.
template <class T>
class window_backend {
 public:
  using floats = std::vector<float>;
  using share = engine::rank_share<floats, std::vector<std::uint64_t>>;
  using window_rows = std::span<float>;  // [rows, Hq, D]
  using statistics = vs_statistics;

  window_backend(const engine::window_plan& plan, index_t rank, const attention_shape& shape, tensor_view<const T, 3> q_local,
                 tensor_view<const T, 3> k_local, double softmax_scale)
      : plan_(plan), shape_(shape), k_(k_local), scale_(softmax_scale), rows_(plan.shape.window_rows), tokens_(plan.rank_blocks * block_tokens),
        window_(static_cast<std::size_t>(rows_ * shape.heads_q * shape.head_dim), 0.0f) {
    for (const index_t block : plan.global_blocks(rank))
      for (index_t t = 0; t < block_tokens; ++t) key_global_.push_back(block * block_tokens + t);
    for (std::size_t i = 0; rank == plan.window_owner && i < window_.size(); ++i) {  // i = (row * Hq + h) * D + d
      const auto d = static_cast<index_t>(i) % shape.head_dim, row_head = static_cast<index_t>(i) / shape.head_dim;
      window_[i] = float(q_local(plan.window_local_token + row_head / shape.heads_q, row_head % shape.heads_q, d));
    }
  }

  template <class Comm>
  engine::host_exchange<Comm> exchange(Comm& comm) const {
    return {comm};
  }
  window_rows window() { return window_; }

  /// Scores against the local keys [Hq, rows, local tokens], -inf where causally masked, and the row max.
  void score_window() {
    const index_t heads = shape_.heads_q, dim = shape_.head_dim;
    score_.resize(static_cast<std::size_t>(heads * rows_) * static_cast<std::size_t>(tokens_));
    max_.assign(static_cast<std::size_t>(heads * rows_), neg_inf);
    for (index_t r = 0; r < heads * rows_; ++r) {  // r = h * rows + a
      const index_t h = r / rows_, a = r % rows_, hk = shape_.kv_head(h);
      const float* q = window_.data() + static_cast<std::size_t>((a * heads + h) * dim);
      for (index_t j = 0; j < tokens_; ++j) {
        float& s = score_[static_cast<std::size_t>(r) * static_cast<std::size_t>(tokens_) + static_cast<std::size_t>(j)];
        s = neg_inf;
        if (plan_.shape.causal && key_global_[static_cast<std::size_t>(j)] > plan_.first_row() + a) continue;
        float dot = 0;
        for (index_t d = 0; d < dim; ++d) dot += q[d] * float(k_(j, hk, d));
        s = dot * float(scale_);
        max_[static_cast<std::size_t>(r)] = std::max(max_[static_cast<std::size_t>(r)], s);
      }
    }
  }

  /// This rank's normaliser [2, Hq, rows]: its row max, then its sums of exp against it.
  std::vector<float> row_normaliser() const {
    std::vector<float> own = max_;
    const std::vector<float> sum = sums_against(max_);
    own.insert(own.end(), sum.begin(), sum.end());
    return own;
  }
  /// Every rank's normaliser [W, 2, Hq, rows] becomes the global one (combine_normaliser_row per row).
  void place_normaliser(std::vector<float> every_rank) {
    const std::size_t rows = max_.size(), expected = 2 * rows * static_cast<std::size_t>(plan_.world);
    if (every_rank.size() != expected) throw invalid_argument("every_rank.size()", every_rank.size(), "must be W * 2 * Hq * rows = " + std::to_string(expected));
    sum_.resize(rows);
    for (std::size_t i = 0; i < rows; ++i) {
      const auto row = combine_normaliser_row<false>(every_rank.data(), plan_.world, static_cast<std::int64_t>(rows), static_cast<std::int64_t>(i));
      max_[i] = row.max;
      sum_[i] = row.sum;
    }
  }

  /// Probabilities into window mass per key token (the candidates) and per key block; each head's top candidates.
  void probabilities() {
    if (sum_.empty()) sum_ = sums_against(max_);  // one rank: its own normaliser is the global one
    const index_t heads = shape_.heads_q, blocks = plan_.rank_blocks, per_rank = plan_.per_rank;
    const index_t first_local_block = plan_.shape.num_blocks() - plan_.shape.local_blocks;  // its tokens are never vertical candidates
    mass_.resize(static_cast<std::size_t>(heads) * static_cast<std::size_t>(blocks + 1));
    candidates_.resize(static_cast<std::size_t>(heads) * static_cast<std::size_t>(per_rank));
    std::vector<double> column_mass(static_cast<std::size_t>(tokens_));
    std::vector<double> block_mass(static_cast<std::size_t>(blocks));
    std::vector<vertical_candidate> column(static_cast<std::size_t>(tokens_));
    for (index_t h = 0; h < heads; ++h) {
      std::fill(column_mass.begin(), column_mass.end(), 0.0);
      std::fill(block_mass.begin(), block_mass.end(), 0.0);
      double total = 0;
      for (index_t a = 0; a < rows_; ++a) {
        const auto r = static_cast<std::size_t>(h * rows_ + a);
        if (sum_[r] == 0.0f) continue;  // a row with no keys anywhere contributes nothing
        for (std::size_t j = 0; j < column.size(); ++j) {
          const float s = score_[r * column.size() + j];
          if (s == neg_inf) continue;
          const double p = std::exp(double(s) - double(max_[r])) / double(sum_[r]);
          column_mass[j] += p;
          block_mass[j / block_tokens] += p;
          total += p;
        }
      }
      for (std::size_t j = 0; j < column.size(); ++j) {  // local-block tokens sort last: never among the candidates
        const index_t token = key_global_[j];
        column[j] = {token / block_tokens >= first_local_block ? -1.0f : float(column_mass[j]), token};
      }
      float* mass = mass_.data() + static_cast<std::size_t>(h) * static_cast<std::size_t>(blocks + 1);
      for (index_t b = 0; b < blocks; ++b) mass[b] = float(block_mass[static_cast<std::size_t>(b)]);
      mass[blocks] = float(total);
      std::partial_sort(column.begin(), column.begin() + per_rank, column.end());
      std::copy(column.begin(), column.begin() + per_rank, candidates_.begin() + static_cast<std::ptrdiff_t>(h) * per_rank);
    }
  }

  share rank_share() const {
    std::vector<std::uint64_t> keys(candidates_.size());
    std::transform(candidates_.begin(), candidates_.end(), keys.begin(), stria::detail::selection_key);
    return {mass_, std::move(keys)};
  }
  vs_statistics global_statistics(share all) const { return engine::combine_shares(plan_, all.mass, all.candidates); }
  vs_statistics own_statistics() const { return global_statistics(rank_share()); }

 private:
  static constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  /// Each row's sum of exp against `max`: many small terms, accumulated in fp64, then rounded.
  [[nodiscard]] std::vector<float> sums_against(const std::vector<float>& max) const {
    std::vector<float> sum(max.size());
    for (std::size_t r = 0; r < sum.size(); ++r) {
      double total = 0;
      for (std::size_t j = 0; j < static_cast<std::size_t>(tokens_); ++j)
        if (const float s = score_[r * static_cast<std::size_t>(tokens_) + j]; s != neg_inf) total += std::exp(double(s) - double(max[r]));
      sum[r] = float(total);
    }
    return sum;
  }

  const engine::window_plan& plan_;
  attention_shape shape_;
  tensor_view<const T, 3> k_;
  double scale_;
  index_t rows_, tokens_;
  std::vector<float> window_;                 // [rows, Hq, D]
  std::vector<index_t> key_global_;           // [local tokens]
  std::vector<float> score_, max_, sum_;      // [Hq, rows, local tokens], [Hq, rows] x 2
  std::vector<float> mass_;                   // [Hq, local blocks + 1]: rank_share's
  std::vector<vertical_candidate> candidates_;  // [Hq, per_rank]: each head's top candidates in selection order
};

}  // namespace detail

/// Gathers the window statistics of `request` on every rank, identically: engine::gather_window_statistics
/// on the host backend; each head's union holds every rank's top candidates.
///   q_local [S_local, Hq, D]   k_local [S_local, Hkv, D]   (this rank's shards under `sharding`)
template <class Comm, sharding_policy Sharding, class T>
vs_statistics gather_window_statistics(Comm& comm, const Sharding& sharding, index_t seq_len, bool causal,
                                       tensor_view<const T, 3> q_local, tensor_view<const T, 3> k_local, double softmax_scale,
                                       statistics_request request) {
  static_assert(check_host_collectives<Comm>());
  const attention_shape shape{q_local.extent(0), k_local.extent(0), q_local.extent(1), k_local.extent(1), q_local.extent(2)};
  shape.validate();
  const shard_layout layout{seq_len / block_tokens, comm.world_size()};
  sharding.validate(layout);
  const index_t local_tokens = sharding.local_blocks(layout) * block_tokens;
  check_extents(q_local, {local_tokens, shape.heads_q, shape.head_dim}, "q_local");
  check_extents(k_local, {local_tokens, shape.heads_kv, shape.head_dim}, "k_local");
  const engine::window_plan plan = engine::make_window_plan(sharding, seq_len, layout.world_size, causal, shape.heads_q, request);
  detail::window_backend<T> backend(plan, comm.rank(), shape, q_local, k_local, softmax_scale);
  return engine::gather_window_statistics(backend, comm, plan);
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
