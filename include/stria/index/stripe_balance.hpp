// SPDX-License-Identifier: Apache-2.0
// Workload-aware stripe placement: from a layer's global selection, which rank owns each 64-token
// block so that every (query rank, KV rank) pair, and so every rank at every ring step, gets an
// equal share of the active entries; each rank keeps num_blocks / W blocks (the ring's traffic is
// that of striped<64>).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"
#include "stria/index/global_selection.hpp"
#include "stria/sharding/placed_stripes.hpp"

namespace stria {

/// Active entries per 64-token block, as count_ring_workload counts them: of its 64 query rows
/// (against every key) and of its 64 key columns (from every query). Each sums to the total.
struct block_costs {
  std::vector<std::int64_t> query_entries;  // [num_blocks]
  std::vector<std::int64_t> key_entries;    // [num_blocks]
};

namespace detail {

/// A layer's selection summed over heads, as balance_stripes reads it: the union of the heads'
/// slash diagonals (each with how many heads select it), the vertical tokens per block, and the
/// explicit tiles. An entry counts as count_ring_workload counts it: a tile on a head's selected
/// diagonal or explicit tile is whole for that head (causal diagonal tiles: the 64 * 65 / 2
/// triangle); else each of the head's vertical tokens of the key block in the query block's causal
/// range adds 64. So a tile's entries are its vertical entries as if no tile were active (per key
/// block, in closed form) plus, per head that activates it, the tile less that head's vertical
/// entries there; the second part is summed over heads once per diagonal, not per head.
///
/// Heads with equal vertical token lists form one class (the heads of a KV group, often), so that
/// correcting a tile for its heads' vertical entries costs one term per class with tokens in the
/// key block, not one per head.
class stripe_tiles {
 public:
  explicit stripe_tiles(const global_selection& selection) : nb_(selection.num_blocks()), causal_(selection.causal) {
    selection.validate();
    const auto nb = static_cast<std::size_t>(nb_);
    const auto heads = static_cast<std::size_t>(selection.num_heads());
    // Classes of heads with equal vertical tokens.
    std::vector<std::size_t> class_of(heads), representative;
    for (std::size_t h = 0; h < heads; ++h) {
      const auto& tokens = selection.heads[h].vertical_tokens;
      std::size_t c = 0;
      while (c < representative.size() && selection.heads[representative[c]].vertical_tokens != tokens) ++c;
      if (c == representative.size()) representative.push_back(h);
      class_of[h] = c;
    }
    classes_ = representative.size();
    class_tokens_.assign(classes_ * nb, 0);
    std::vector<std::int64_t> class_size(classes_, 0);
    for (std::size_t h = 0; h < heads; ++h) ++class_size[class_of[h]];
    for (std::size_t c = 0; c < classes_; ++c)
      for (const index_t token : selection.heads[representative[c]].vertical_tokens) ++class_tokens_[c * nb + static_cast<std::size_t>(token / block_tokens)];
    tokens_all_.assign(nb, 0);
    token_begin_.assign(nb + 1, 0);
    for (std::size_t k = 0; k < nb; ++k) {
      for (std::size_t c = 0; c < classes_; ++c)
        if (const std::int32_t n = class_tokens_[c * nb + k]; n != 0) {
          block_tokens_.push_back({static_cast<std::int32_t>(c), n});
          tokens_all_[k] += class_size[c] * n;
        }
      token_begin_[k + 1] = block_tokens_.size();
    }

    // The union of the slash diagonals, and per diagonal how many heads of each class select it.
    delta_index_.assign(2 * nb - 1, -1);
    for (const head_selection& head : selection.heads)
      for (const index_t delta : head.slash_deltas) delta_index_[static_cast<std::size_t>(delta + nb_ - 1)] = 0;
    for (index_t d = -(nb_ - 1); d < nb_; ++d)
      if (delta_index_[static_cast<std::size_t>(d + nb_ - 1)] == 0) {
        delta_index_[static_cast<std::size_t>(d + nb_ - 1)] = static_cast<index_t>(deltas_.size());
        deltas_.push_back(d);
      }
    const std::size_t u = deltas_.size();
    class_heads_.assign(u * classes_, 0);
    std::vector<std::int64_t> heads_on(u, 0);
    for (std::size_t h = 0; h < heads; ++h)
      for (const index_t delta : selection.heads[h].slash_deltas) {
        const auto i = static_cast<std::size_t>(delta_index_[static_cast<std::size_t>(delta + nb_ - 1)]);
        ++class_heads_[i * classes_ + class_of[h]];
        ++heads_on[i];
      }
    whole_.resize(u);
    for (std::size_t i = 0; i < u; ++i) whole_[i] = heads_on[i] * tile(deltas_[i], 0);

    // Explicit tiles off the head's own selected diagonals (those count once, as diagonal tiles),
    // merged over heads.
    for (std::size_t h = 0; h < heads; ++h) {
      const head_selection& head = selection.heads[h];
      for (const block_pair& b : head.blocks) {
        if (std::binary_search(head.slash_deltas.begin(), head.slash_deltas.end(), b.query_block - b.key_block)) continue;
        const std::int64_t vertical = in_range(b.query_block, b.key_block) ? block_tokens * std::int64_t{class_tokens_[class_of[h] * nb + static_cast<std::size_t>(b.key_block)]} : 0;
        explicit_by_query_.push_back({b.query_block, b.key_block, tile(b.query_block, b.key_block) - vertical});
      }
    }
    std::sort(explicit_by_query_.begin(), explicit_by_query_.end(), [](const weighted_tile& x, const weighted_tile& y) {
      return x.query_block != y.query_block ? x.query_block < y.query_block : x.key_block < y.key_block;
    });
    std::size_t kept = 0;  // one entry per tile
    for (std::size_t i = 0; i < explicit_by_query_.size(); ++i) {
      if (kept > 0 && explicit_by_query_[kept - 1].query_block == explicit_by_query_[i].query_block && explicit_by_query_[kept - 1].key_block == explicit_by_query_[i].key_block)
        explicit_by_query_[kept - 1].entries += explicit_by_query_[i].entries;
      else explicit_by_query_[kept++] = explicit_by_query_[i];
    }
    explicit_by_query_.resize(kept);
    explicit_by_key_ = explicit_by_query_;
    std::sort(explicit_by_key_.begin(), explicit_by_key_.end(), [](const weighted_tile& x, const weighted_tile& y) {
      return x.key_block != y.key_block ? x.key_block < y.key_block : x.query_block < y.query_block;
    });
  }

  [[nodiscard]] index_t num_blocks() const { return nb_; }
  [[nodiscard]] bool causal() const { return causal_; }
  /// Vertical tokens of key block k over all heads.
  [[nodiscard]] std::int64_t vertical_tokens(index_t k) const { return tokens_all_[static_cast<std::size_t>(k)]; }

  /// Whether a vertical token of k_block counts for the rows of q_block (outside active tiles).
  [[nodiscard]] bool in_range(index_t q_block, index_t k_block) const { return !causal_ || q_block > k_block; }

  [[nodiscard]] std::int64_t tile(index_t q_block, index_t k_block) const {
    return causal_ && q_block == k_block ? std::int64_t{block_tokens} * (block_tokens + 1) / 2 : std::int64_t{block_tokens} * block_tokens;
  }

  /// Entries of the tile (query block, key block) over all heads.
  [[nodiscard]] std::int64_t operator()(index_t q_block, index_t k_block) const {
    std::int64_t sum = in_range(q_block, k_block) ? block_tokens * tokens_all_[static_cast<std::size_t>(k_block)] : 0;
    if (const index_t i = delta_index_[static_cast<std::size_t>(q_block - k_block + nb_ - 1)]; i >= 0) sum += on_diagonal(static_cast<std::size_t>(i), k_block);
    if (!explicit_by_query_.empty()) {
      const auto it = std::lower_bound(explicit_by_query_.begin(), explicit_by_query_.end(), block_pair{q_block, k_block}, by_query);
      if (it != explicit_by_query_.end() && it->query_block == q_block && it->key_block == k_block) sum += it->entries;
    }
    return sum;
  }

  /// Calls f(key_block, entries) for the active tiles of query block q with key blocks in
  /// [k_begin, k_end): the entries their heads add over the tile's vertical entries. A key block
  /// may come twice (a diagonal and an explicit tile).
  template <class F>
  void for_each_key(index_t q, index_t k_begin, index_t k_end, F&& f) const {
    if (k_begin >= k_end) return;
    // k = q - delta in [k_begin, k_end): delta in (q - k_end, q - k_begin].
    const auto first = static_cast<std::size_t>(std::upper_bound(deltas_.begin(), deltas_.end(), q - k_end) - deltas_.begin());
    const auto last = static_cast<std::size_t>(std::upper_bound(deltas_.begin(), deltas_.end(), q - k_begin) - deltas_.begin());
    for (std::size_t i = first; i < last; ++i) {
      const index_t k = q - deltas_[i];
      f(k, on_diagonal(i, k));
    }
    if (explicit_by_query_.empty()) return;
    for (auto it = std::lower_bound(explicit_by_query_.begin(), explicit_by_query_.end(), block_pair{q, k_begin}, by_query);
         it != explicit_by_query_.end() && it->query_block == q && it->key_block < k_end; ++it)
      f(it->key_block, it->entries);
  }

  /// The same for key block k: its active tiles with query blocks in [q_begin, q_end).
  template <class F>
  void for_each_query(index_t k, index_t q_begin, index_t q_end, F&& f) const {
    if (q_begin >= q_end) return;
    // q = k + delta in [q_begin, q_end): delta in [q_begin - k, q_end - k).
    const auto first = static_cast<std::size_t>(std::lower_bound(deltas_.begin(), deltas_.end(), q_begin - k) - deltas_.begin());
    const auto last = static_cast<std::size_t>(std::lower_bound(deltas_.begin(), deltas_.end(), q_end - k) - deltas_.begin());
    for (std::size_t i = first; i < last; ++i) f(k + deltas_[i], on_diagonal(i, k));
    if (explicit_by_key_.empty()) return;
    for (auto it = std::lower_bound(explicit_by_key_.begin(), explicit_by_key_.end(), block_pair{q_begin, k}, by_key);
         it != explicit_by_key_.end() && it->key_block == k && it->query_block < q_end; ++it)
      f(it->query_block, it->entries);
  }

  /// Each block's entries as a query block and as a key block, in O(num_blocks x (diagonals +
  /// classes)): the diagonals' whole tiles and the vertical entries by prefix sums; only the
  /// query side's vertical correction runs along each diagonal (contiguous, vectorised).
  [[nodiscard]] block_costs costs() const {
    const auto nb = static_cast<std::size_t>(nb_);
    const std::size_t u = deltas_.size();
    block_costs c{std::vector<std::int64_t>(nb, 0), std::vector<std::int64_t>(nb, 0)};
    std::vector<std::int64_t> whole_before(u + 1, 0), heads_before((u + 1) * classes_, 0);  // prefix sums over the diagonals
    for (std::size_t i = 0; i < u; ++i) {
      whole_before[i + 1] = whole_before[i] + whole_[i];
      for (std::size_t cl = 0; cl < classes_; ++cl)
        heads_before[(i + 1) * classes_ + cl] = heads_before[i * classes_ + cl] + (corrected(i) ? class_heads_[i * classes_ + cl] : 0);
    }
    // Query side: the vertical tokens its active tiles cover, per diagonal (q = k + delta).
    std::vector<std::int64_t> covered(nb, 0);
    for (std::size_t i = 0; i < u; ++i) {
      if (!corrected(i)) continue;
      const index_t delta = deltas_[i];
      const auto q_begin = static_cast<std::size_t>(std::max<index_t>(0, delta)), q_end = static_cast<std::size_t>(std::min(nb_, nb_ + delta));
      for (std::size_t cl = 0; cl < classes_; ++cl) {
        const std::int32_t heads = class_heads_[i * classes_ + cl];
        if (heads == 0) continue;
        const std::int32_t* tokens = class_tokens_.data() + cl * nb;
        for (std::size_t q = q_begin; q < q_end; ++q) covered[q] += heads * tokens[q - static_cast<std::size_t>(delta)];
      }
    }
    std::int64_t all_tokens = 0;
    for (const std::int64_t t : tokens_all_) all_tokens += t;
    std::int64_t tokens_below = 0;  // vertical tokens of the key blocks before b
    const auto diagonal = [&](index_t lo, index_t hi) {  // indices of the deltas in [lo, hi]
      return std::pair{static_cast<std::size_t>(std::lower_bound(deltas_.begin(), deltas_.end(), lo) - deltas_.begin()),
                       static_cast<std::size_t>(std::upper_bound(deltas_.begin(), deltas_.end(), hi) - deltas_.begin())};
    };
    for (index_t b = 0; b < nb_; ++b) {
      const auto bi = static_cast<std::size_t>(b);
      // As query: key blocks b - delta in [0, nb).
      const auto [q_first, q_last] = diagonal(b - nb_ + 1, b);
      std::int64_t query = block_tokens * (causal_ ? tokens_below : all_tokens) + whole_before[q_last] - whole_before[q_first] - block_tokens * covered[bi];
      // As key: query blocks b + delta in [0, nb); the tiles' heads cover b's tokens.
      const auto [k_first, k_last] = diagonal(-b, nb_ - 1 - b);
      std::int64_t key = block_tokens * tokens_all_[bi] * (causal_ ? nb_ - 1 - b : nb_) + whole_before[k_last] - whole_before[k_first];
      for (std::size_t p = token_begin_[bi]; p < token_begin_[bi + 1]; ++p) {
        const auto cl = static_cast<std::size_t>(block_tokens_[p].first);
        key -= block_tokens * std::int64_t{block_tokens_[p].second} * (heads_before[k_last * classes_ + cl] - heads_before[k_first * classes_ + cl]);
      }
      for_explicit(explicit_by_query_, b, [](const weighted_tile& t) { return t.query_block; }, [&](std::int64_t n) { query += n; });
      for_explicit(explicit_by_key_, b, [](const weighted_tile& t) { return t.key_block; }, [&](std::int64_t n) { key += n; });
      c.query_entries[bi] = query;
      c.key_entries[bi] = key;
      tokens_below += tokens_all_[bi];
    }
    return c;
  }

 private:
  struct weighted_tile {
    index_t query_block, key_block;
    std::int64_t entries;  // over the heads for which it is explicit, less their vertical entries
  };
  static bool by_query(const weighted_tile& x, const block_pair& y) { return x.query_block != y.query_block ? x.query_block < y.query_block : x.key_block < y.key_block; }
  static bool by_key(const weighted_tile& x, const block_pair& y) { return x.key_block != y.key_block ? x.key_block < y.key_block : x.query_block < y.query_block; }

  template <class Block, class F>
  static void for_explicit(const std::vector<weighted_tile>& tiles, index_t b, Block block, F&& f) {
    auto it = std::lower_bound(tiles.begin(), tiles.end(), b, [&](const weighted_tile& t, index_t x) { return block(t) < x; });
    for (; it != tiles.end() && block(*it) == b; ++it) f(it->entries);
  }

  /// Whether the tiles of diagonal i cover vertical entries (causal: not on the block diagonal).
  [[nodiscard]] bool corrected(std::size_t i) const { return !causal_ || deltas_[i] > 0; }

  /// What the heads selecting diagonal i add on its tile with key block k, over the tile's vertical entries.
  [[nodiscard]] std::int64_t on_diagonal(std::size_t i, index_t k) const {
    std::int64_t n = whole_[i];
    if (!corrected(i)) return n;
    const auto kb = static_cast<std::size_t>(k);
    for (std::size_t p = token_begin_[kb]; p < token_begin_[kb + 1]; ++p)
      n -= block_tokens * std::int64_t{block_tokens_[p].second} * class_heads_[i * classes_ + static_cast<std::size_t>(block_tokens_[p].first)];
    return n;
  }

  index_t nb_;
  bool causal_;
  std::size_t classes_ = 0;                                   // vertical classes: heads with equal vertical tokens
  std::vector<std::int32_t> class_tokens_;                    // [class, key block] vertical tokens of one head of the class
  std::vector<std::pair<std::int32_t, std::int32_t>> block_tokens_;  // per key block (CSR): (class, tokens) where tokens > 0
  std::vector<std::size_t> token_begin_;                      // [num_blocks + 1] into block_tokens_
  std::vector<std::int64_t> tokens_all_;                      // [key block] over all heads
  std::vector<index_t> deltas_;                               // [diagonals] the union of the heads' slash deltas, ascending
  std::vector<index_t> delta_index_;                          // [delta + nb - 1] index into deltas_, or -1
  std::vector<std::int32_t> class_heads_;                     // [diagonal, class] heads of the class that select it
  std::vector<std::int64_t> whole_;                           // [diagonal] its whole tiles' entries over the heads that select it
  std::vector<weighted_tile> explicit_by_query_, explicit_by_key_;
};

}  // namespace detail

/// Each 64-token block's active entries as a query block and as a key block (see block_costs).
inline block_costs count_block_costs(const global_selection& selection) { return detail::stripe_tiles(selection).costs(); }


/// The most ranks balance_stripes takes: its pair-load table has W^2 entries and its cost grows
/// as num_blocks x W^2.
inline constexpr index_t max_balanced_world_size = 1024;

namespace detail {

/// First pass of balance_stripes: round by round, heaviest block first, each block to the free
/// rank where it least raises the sum of squares of the pair loads. Entries with placed blocks are
/// exact; those with blocks still to come are counted as spread evenly over the ranks. `loads`
/// gets the exact pair loads of the placement: [query rank, KV rank].
inline std::vector<index_t> greedy_placement(const stripe_tiles& tiles, const block_costs& costs, index_t world, std::vector<std::int64_t>& loads) {
  const index_t nb = tiles.num_blocks();
  const auto w = static_cast<std::size_t>(world);
  // Estimated pair loads M[q][k] = x[q][k] + row_shift[q] + column_shift[k]: the shifts take the
  // rank-one updates (a placed block's entries leaving the evenly spread estimate) in O(W).
  std::vector<double> x(w * w, 0.0), row_shift(w, 0.0), column_shift(w, 0.0);
  std::vector<std::int64_t> tokens_done(w, 0), blocks_done(w, 0);  // per rank, over the finished rounds
  std::vector<index_t> owner(static_cast<std::size_t>(nb), -1);
  // The block's exact entries with each rank's placed blocks (as query: row, as key: column), and
  // with the rest spread evenly; x_row = X row, x_column = X^T column.
  std::vector<std::int64_t> known_row(w), known_column(w);
  std::vector<double> row(w), column(w), x_row(w), x_column(w);
  std::vector<index_t> order(w), placed_in_round;
  std::vector<unsigned char> taken(w);
  placed_in_round.reserve(w);
  loads.assign(w * w, 0);
  const auto total_cost = [&](index_t b) { return costs.query_entries[static_cast<std::size_t>(b)] + costs.key_entries[static_cast<std::size_t>(b)]; };
  const auto owner_of = [&](index_t b) { return static_cast<std::size_t>(owner[static_cast<std::size_t>(b)]); };

  for (index_t round_begin = 0; round_begin < nb; round_begin += world) {
    std::iota(order.begin(), order.end(), round_begin);
    std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) { return total_cost(a) > total_cost(b); });
    std::fill(taken.begin(), taken.end(), 0);
    placed_in_round.clear();
    for (const index_t b : order) {
      // Entries with the blocks of finished rounds (all below round_begin) ...
      const std::int64_t b_tokens = tiles.vertical_tokens(b);
      for (std::size_t r = 0; r < w; ++r) {
        known_row[r] = block_tokens * tokens_done[r];
        known_column[r] = tiles.causal() ? 0 : block_tokens * b_tokens * blocks_done[r];
      }
      tiles.for_each_key(b, 0, round_begin, [&](index_t k, std::int64_t n) { known_row[owner_of(k)] += n; });
      tiles.for_each_query(b, 0, round_begin, [&](index_t q, std::int64_t n) { known_column[owner_of(q)] += n; });
      // ... and with the blocks of this round placed so far.
      for (const index_t other : placed_in_round) {
        known_row[owner_of(other)] += tiles(b, other);
        known_column[owner_of(other)] += tiles(other, b);
      }
      const std::int64_t self = tiles(b, b);
      // The rest, with blocks not placed yet, spread evenly.
      const std::int64_t known_row_sum = std::accumulate(known_row.begin(), known_row.end(), std::int64_t{0});
      const std::int64_t known_column_sum = std::accumulate(known_column.begin(), known_column.end(), std::int64_t{0});
      const double future_row = double(std::max<std::int64_t>(0, costs.query_entries[static_cast<std::size_t>(b)] - known_row_sum - self)) / double(w);
      const double future_column = double(std::max<std::int64_t>(0, costs.key_entries[static_cast<std::size_t>(b)] - known_column_sum - self)) / double(w);
      for (std::size_t r = 0; r < w; ++r) row[r] = double(known_row[r]) + future_row, column[r] = double(known_column[r]) + future_column;
      const double row_sum = double(known_row_sum) + future_row * double(w), column_sum = double(known_column_sum) + future_column * double(w);
      const double row_mean = row_sum / double(w), column_mean = column_sum / double(w);
      std::fill(x_column.begin(), x_column.end(), 0.0);
      for (std::size_t j = 0; j < w; ++j) {
        const double c = column[j];
        const double* xj = x.data() + j * w;
        for (std::size_t r = 0; r < w; ++r) x_column[r] += c * xj[r];
      }

      // Half the rise of sum(M^2) when b goes to rank r, less what is the same for every r.
      std::size_t best = w;
      double best_score = std::numeric_limits<double>::infinity();
      for (std::size_t r = 0; r < w; ++r) {
        if (taken[r]) continue;
        const double* xr = x.data() + r * w;
        double x_row_r = 0.0;
        for (std::size_t j = 0; j < w; ++j) x_row_r += xr[j] * row[j];
        double score = row_shift[r] * row_sum + column_shift[r] * column_sum + (column[r] - column_mean) * (row[r] - row_mean) + x_row_r + x_column[r];
        score += double(self) * (xr[r] + row_shift[r] + column_shift[r] + row[r] + column[r]);
        if (score < best_score) best_score = score, best = r;
      }
      taken[best] = 1;
      owner[static_cast<std::size_t>(b)] = static_cast<index_t>(best);
      placed_in_round.push_back(b);
      for (std::size_t j = 0; j < w; ++j) {
        x[best * w + j] += row[j];
        x[j * w + best] += column[j];
        column_shift[j] -= row[j] / double(w);
        row_shift[j] -= column[j] / double(w);
        loads[best * w + j] += known_row[j];
        loads[j * w + best] += known_column[j];
      }
      x[best * w + best] += double(self);
      loads[best * w + best] += self;
    }
    for (index_t b = round_begin; b < round_begin + world; ++b) {
      tokens_done[owner_of(b)] += tiles.vertical_tokens(b);
      ++blocks_done[owner_of(b)];
    }
  }
  return owner;
}

/// Second pass: within each round, swaps two blocks' ranks wherever that lowers the sum of
/// squares of the exact pair loads `loads` (kept up to date); stops after `passes` sweeps or a
/// sweep without a swap. Per round, each block's entries with the blocks outside the round are
/// summed per rank once (they do not change while the round's blocks swap), so a candidate swap
/// costs O(W).
inline void refine_placement(const stripe_tiles& tiles, index_t world, std::vector<index_t>& owner, const std::vector<std::int64_t>& loads, int passes) {
  const index_t nb = tiles.num_blocks();
  const auto w = static_cast<std::size_t>(world);
  std::vector<double> m(w * w), mt(w * w);  // pair loads [query rank, KV rank] and transposed
  for (std::size_t i = 0; i < w; ++i)
    for (std::size_t j = 0; j < w; ++j) m[i * w + j] = mt[j * w + i] = double(loads[i * w + j]);
  std::vector<std::int64_t> tokens_all(w, 0), tokens_before(w, 0);  // per rank: vertical tokens of all its blocks, of those before the round
  for (index_t b = 0; b < nb; ++b) tokens_all[static_cast<std::size_t>(owner[static_cast<std::size_t>(b)])] += tiles.vertical_tokens(b);
  // Per block of the round (position i), per rank: entries with the rank's blocks, as query (row)
  // and as key (column): outside the round exactly, inside by the blocks' current ranks.
  std::vector<std::int64_t> outside_row(w * w), outside_column(w * w);
  std::vector<double> row(w * w), column(w * w), among(w * w);  // among: (query block i, key block j) of the round
  std::vector<std::size_t> position(w);  // rank -> its block's position in the round
  std::vector<double> d_row(w), d_column(w);
  const auto rank_of = [&](index_t round_begin, std::size_t i) { return static_cast<std::size_t>(owner[static_cast<std::size_t>(round_begin) + i]); };

  for (int pass = 0; pass < passes; ++pass) {
    bool swapped = false;
    std::fill(tokens_before.begin(), tokens_before.end(), 0);
    for (index_t round_begin = 0; round_begin < nb; round_begin += world) {
      const index_t round_end = round_begin + world;
      const std::int64_t later_blocks = nb / world - round_begin / world - 1;  // per rank: one block per round
      for (std::size_t i = 0; i < w; ++i) position[rank_of(round_begin, i)] = i;
      for (std::size_t i = 0; i < w; ++i) {
        const index_t b = round_begin + static_cast<index_t>(i);
        std::int64_t* r = outside_row.data() + i * w;
        std::int64_t* c = outside_column.data() + i * w;
        const std::int64_t b_tokens = tiles.vertical_tokens(b);
        for (std::size_t k = 0; k < w; ++k) {
          // Vertical entries outside the round, as if no tile were active (each rank has one block in it).
          r[k] = block_tokens * (tiles.causal() ? tokens_before[k] : tokens_all[k] - tiles.vertical_tokens(round_begin + static_cast<index_t>(position[k])));
          c[k] = block_tokens * b_tokens * (tiles.causal() ? later_blocks : nb / world - 1);
        }
        const auto add_row = [&](index_t k, std::int64_t n) { r[owner[static_cast<std::size_t>(k)]] += n; };
        const auto add_column = [&](index_t q, std::int64_t n) { c[owner[static_cast<std::size_t>(q)]] += n; };
        tiles.for_each_key(b, 0, round_begin, add_row);
        tiles.for_each_key(b, round_end, nb, add_row);
        tiles.for_each_query(b, 0, round_begin, add_column);
        tiles.for_each_query(b, round_end, nb, add_column);
        for (std::size_t j = 0; j < w; ++j) among[i * w + j] = double(tiles(b, round_begin + static_cast<index_t>(j)));
      }
      for (std::size_t i = 0; i < w * w; ++i) row[i] = double(outside_row[i]), column[i] = double(outside_column[i]);
      for (std::size_t i = 0; i < w; ++i)
        for (std::size_t j = 0; j < w; ++j) {
          row[i * w + rank_of(round_begin, j)] += among[i * w + j];
          column[j * w + rank_of(round_begin, i)] += among[i * w + j];
        }

      for (std::size_t a = 0; a < w; ++a)
        for (std::size_t b = a + 1; b < w; ++b) {
          const std::size_t ra = rank_of(round_begin, a), rb = rank_of(round_begin, b);
          // Block a's entries by rank minus block b's, the pair (a, b) and the blocks themselves apart.
          const double* row_a = row.data() + a * w;
          const double* row_b = row.data() + b * w;
          const double* column_a = column.data() + a * w;
          const double* column_b = column.data() + b * w;
          for (std::size_t k = 0; k < w; ++k) d_row[k] = row_a[k] - row_b[k], d_column[k] = column_a[k] - column_b[k];
          const double aa = among[a * w + a], ab = among[a * w + b], ba = among[b * w + a], bb = among[b * w + b];
          d_row[ra] -= aa - ba;
          d_row[rb] -= ab - bb;
          d_column[ra] -= aa - ab;
          d_column[rb] -= ba - bb;
          const double self = aa - bb, pair = ab - ba;
          // Swapping moves a's row and column from ra to rb and b's the other way:
          // dM = u (x) d_row + d_column (x) u + self (E_bb - E_aa) + pair (E_ba - E_ab), u = e_rb - e_ra.
          const auto change = [&](std::size_t i, std::size_t j) {
            const double ui = i == rb ? 1.0 : i == ra ? -1.0 : 0.0, uj = j == rb ? 1.0 : j == ra ? -1.0 : 0.0;
            double d = ui * d_row[j] + d_column[i] * uj;
            if (i == j) d += self * ui;  // +self at (rb, rb), -self at (ra, ra)
            else if (i == rb && j == ra) d += pair;
            else if (i == ra && j == rb) d -= pair;
            return d;
          };
          // Rows ra and rb and columns ra and rb change: sum of d (2 m + d) over their cells, the
          // four crossings apart.
          const double* m_ra = m.data() + ra * w;
          const double* m_rb = m.data() + rb * w;
          const double* mt_ra = mt.data() + ra * w;
          const double* mt_rb = mt.data() + rb * w;
          const auto line = [&](std::size_t j) {
            return d_row[j] * (m_rb[j] - m_ra[j] + d_row[j]) + d_column[j] * (mt_rb[j] - mt_ra[j] + d_column[j]);
          };
          double lines = 0.0;
          for (std::size_t j = 0; j < w; ++j) lines += line(j);
          double rise = 2.0 * (lines - line(ra) - line(rb));
          for (const std::size_t i : {ra, rb})
            for (const std::size_t j : {ra, rb}) {
              const double d = change(i, j);
              rise += d * (2.0 * m[i * w + j] + d);
            }
          if (rise >= -1e-9 * std::abs(m[ra * w + rb] + 1.0)) continue;
          const auto apply = [&](std::size_t i, std::size_t j) {
            const double d = change(i, j);
            m[i * w + j] += d;
            mt[j * w + i] += d;
          };
          for (std::size_t j = 0; j < w; ++j) apply(ra, j), apply(rb, j);
          for (std::size_t i = 0; i < w; ++i)
            if (i != ra && i != rb) apply(i, ra), apply(i, rb);
          // The round's rows and columns by rank: a's and b's entries trade ranks.
          for (std::size_t i = 0; i < w; ++i) {
            const double to_a = among[i * w + a], to_b = among[i * w + b];
            row[i * w + ra] += to_b - to_a;
            row[i * w + rb] += to_a - to_b;
            const double from_a = among[a * w + i], from_b = among[b * w + i];
            column[i * w + ra] += from_b - from_a;
            column[i * w + rb] += from_a - from_b;
          }
          std::swap(owner[static_cast<std::size_t>(round_begin) + a], owner[static_cast<std::size_t>(round_begin) + b]);
          std::swap(position[ra], position[rb]);
          const std::int64_t a_tokens = tiles.vertical_tokens(round_begin + static_cast<index_t>(a)), b_tokens = tiles.vertical_tokens(round_begin + static_cast<index_t>(b));
          tokens_all[ra] += b_tokens - a_tokens;
          tokens_all[rb] += a_tokens - b_tokens;
          swapped = true;
        }
      for (std::size_t i = 0; i < w; ++i) tokens_before[rank_of(round_begin, i)] += tiles.vertical_tokens(round_begin + static_cast<index_t>(i));
    }
    if (!swapped) break;
  }
}

}  // namespace detail

/// A placement of the 64-token blocks on `world_size` ranks that balances the work of every
/// (query rank, KV rank) pair, for any ring topology: at each ring step each rank computes one such
/// pair, so equal pairs mean equal ranks within a step (worker level) and equal steps within a
/// rank (step level). Blocks are placed round by round, W consecutive blocks per round and one per
/// rank (as striped<64> places them: every rank owns num_blocks / W blocks spread over the
/// sequence). Within a round the heaviest block goes first (longest processing time first), each to
/// the free rank where it least raises the sum of squares of the W x W pair loads; its entries with
/// blocks still to be placed count as spread evenly. Then `refine_passes` sweeps swap two blocks of
/// a round wherever that lowers the sum of squares of the exact loads.
/// Cost O(num_blocks x W^2 x (1 + refine_passes)) plus the selection's active tiles; throws when
/// seq_len is not a multiple of world_size * 64 or world_size exceeds max_balanced_world_size.
inline sharding::placed_stripes balance_stripes(const global_selection& selection, index_t world_size, int refine_passes = 2) {
  if (world_size < 1 || world_size > max_balanced_world_size)
    throw invalid_argument("world_size", world_size,
                           "balance_stripes takes 1 to " + std::to_string(max_balanced_world_size) + " ranks (its cost grows as W^2)");
  if (refine_passes < 0) throw invalid_argument("refine_passes", refine_passes, "must not be negative");
  const detail::stripe_tiles tiles(selection);
  if (tiles.num_blocks() % world_size != 0)
    throw invalid_argument("seq_len", selection.seq_len,
                           "balance_stripes needs seq_len to be a multiple of world_size * 64 = " + std::to_string(std::int64_t{world_size} * block_tokens));
  std::vector<std::int64_t> loads;
  std::vector<index_t> owner = detail::greedy_placement(tiles, tiles.costs(), world_size, loads);
  detail::refine_placement(tiles, world_size, owner, loads, refine_passes);
  return sharding::placed_stripes(std::move(owner), world_size);
}

}  // namespace stria
