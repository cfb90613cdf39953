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

/// The active entries of one (query block, key block) tile summed over heads, in O(heads), and the
/// per-block totals. An entry counts as count_ring_workload counts it: a tile on a selected
/// diagonal or an explicit tile is whole (causal diagonal tiles: the 64 * 65 / 2 triangle); else
/// each vertical token of the key block in the query block's causal range adds 64.
class tile_entries {
 public:
  explicit tile_entries(const global_selection& selection)
      : selection_(selection), nb_(selection.num_blocks()), heads_(selection.num_heads()), causal_(selection.causal) {
    selection.validate();
    const auto nb = static_cast<std::size_t>(nb_);
    on_slash_.assign(static_cast<std::size_t>(heads_), std::vector<unsigned char>(2 * nb - 1, 0));
    tokens_.assign(static_cast<std::size_t>(heads_) * nb, 0);
    tokens_all_.assign(nb, 0);
    explicit_.resize(static_cast<std::size_t>(heads_));
    explicit_by_key_.resize(static_cast<std::size_t>(heads_));
    for (index_t h = 0; h < heads_; ++h) {
      const head_selection& head = selection.heads[static_cast<std::size_t>(h)];
      auto& on_slash = on_slash_[static_cast<std::size_t>(h)];
      for (const index_t delta : head.slash_deltas) on_slash[static_cast<std::size_t>(delta + nb_ - 1)] = 1;
      for (const index_t token : head.vertical_tokens) {
        ++tokens_[static_cast<std::size_t>(h) * nb + static_cast<std::size_t>(token / block_tokens)];
        ++tokens_all_[static_cast<std::size_t>(token / block_tokens)];
      }
      // Explicit tiles on a selected diagonal are counted once, as diagonal tiles.
      for (const block_pair& b : head.blocks)
        if (!on_slash[static_cast<std::size_t>(b.query_block - b.key_block + nb_ - 1)]) explicit_[static_cast<std::size_t>(h)].push_back(b);
      auto& by_key = explicit_by_key_[static_cast<std::size_t>(h)];
      by_key = explicit_[static_cast<std::size_t>(h)];
      std::sort(by_key.begin(), by_key.end(), [](const block_pair& x, const block_pair& y) {
        return x.key_block != y.key_block ? x.key_block < y.key_block : x.query_block < y.query_block;
      });
    }
  }

  [[nodiscard]] index_t num_blocks() const { return nb_; }
  [[nodiscard]] index_t num_heads() const { return heads_; }
  [[nodiscard]] bool causal() const { return causal_; }
  [[nodiscard]] const global_selection& selection() const { return selection_; }
  [[nodiscard]] const std::vector<block_pair>& explicit_tiles(index_t h) const { return explicit_[static_cast<std::size_t>(h)]; }
  [[nodiscard]] const std::vector<block_pair>& explicit_tiles_by_key(index_t h) const { return explicit_by_key_[static_cast<std::size_t>(h)]; }
  [[nodiscard]] std::int64_t vertical_tokens(index_t k_block) const { return tokens_all_[static_cast<std::size_t>(k_block)]; }

  /// Whether a vertical token of k_block counts for the rows of q_block (outside active tiles).
  [[nodiscard]] bool in_range(index_t q_block, index_t k_block) const { return !causal_ || q_block > k_block; }

  [[nodiscard]] std::int64_t tile(index_t q_block, index_t k_block) const {
    return causal_ && q_block == k_block ? std::int64_t{block_tokens} * (block_tokens + 1) / 2 : std::int64_t{block_tokens} * block_tokens;
  }

  /// Head h's vertical entries in the tile, as if it were not active.
  [[nodiscard]] std::int64_t vertical(index_t h, index_t q_block, index_t k_block) const {
    return in_range(q_block, k_block) ? block_tokens * std::int64_t{tokens_[static_cast<std::size_t>(h) * static_cast<std::size_t>(nb_) + static_cast<std::size_t>(k_block)]} : 0;
  }

  /// What an active tile adds over the vertical entries counted for it already.
  [[nodiscard]] std::int64_t active_over_vertical(index_t h, index_t q_block, index_t k_block) const {
    return tile(q_block, k_block) - vertical(h, q_block, k_block);
  }

  /// Active entries of the tile (query block, key block) over all heads.
  [[nodiscard]] std::int64_t operator()(index_t q_block, index_t k_block) const {
    std::int64_t sum = 0;
    for (index_t h = 0; h < heads_; ++h) {
      const bool slash = on_slash_[static_cast<std::size_t>(h)][static_cast<std::size_t>(q_block - k_block + nb_ - 1)] != 0;
      const auto& tiles = explicit_[static_cast<std::size_t>(h)];
      const bool active = slash || (!tiles.empty() && std::binary_search(tiles.begin(), tiles.end(), block_pair{q_block, k_block}));
      sum += active ? tile(q_block, k_block) : vertical(h, q_block, k_block);
    }
    return sum;
  }

 private:
  const global_selection& selection_;
  index_t nb_, heads_;
  bool causal_;
  std::vector<std::vector<unsigned char>> on_slash_;     // [head][delta + nb - 1]
  std::vector<std::int32_t> tokens_;                     // [head, key block] vertical tokens
  std::vector<std::int64_t> tokens_all_;                 // [key block] over all heads
  std::vector<std::vector<block_pair>> explicit_;        // [head] explicit tiles off the selected diagonals
  std::vector<std::vector<block_pair>> explicit_by_key_; // the same, by key block
};

/// Calls f(partner, entries) for every block `partner` with index below `limit` that `block`'s
/// query rows meet with nonzero entries beyond the vertical ones (as_query: partner is the key
/// block) or whose query rows meet `block`'s keys (else), with the active tile's entries minus the
/// vertical entries already counted for it.
template <class F>
void for_each_active_partner(const tile_entries& t, index_t block, index_t limit, bool as_query, F&& f) {
  const index_t nb = t.num_blocks();
  for (index_t h = 0; h < t.num_heads(); ++h) {
    for (const index_t delta : t.selection().heads[static_cast<std::size_t>(h)].slash_deltas) {
      const index_t partner = as_query ? block - delta : block + delta;
      if (partner < 0 || partner >= std::min(nb, limit)) continue;
      f(partner, as_query ? t.active_over_vertical(h, block, partner) : t.active_over_vertical(h, partner, block));
    }
    if (as_query) {
      const auto& tiles = t.explicit_tiles(h);
      auto it = std::lower_bound(tiles.begin(), tiles.end(), block_pair{block, 0});
      for (; it != tiles.end() && it->query_block == block && it->key_block < limit; ++it) f(it->key_block, t.active_over_vertical(h, block, it->key_block));
    } else {
      const auto& tiles = t.explicit_tiles_by_key(h);
      auto it = std::lower_bound(tiles.begin(), tiles.end(), block, [](const block_pair& x, index_t k) { return x.key_block < k; });
      for (; it != tiles.end() && it->key_block == block && it->query_block < limit; ++it) f(it->query_block, t.active_over_vertical(h, it->query_block, block));
    }
  }
}

inline block_costs block_costs_of(const tile_entries& t) {
  const index_t nb = t.num_blocks();
  block_costs c{std::vector<std::int64_t>(static_cast<std::size_t>(nb), 0), std::vector<std::int64_t>(static_cast<std::size_t>(nb), 0)};
  std::int64_t all_tokens = 0;
  for (index_t k = 0; k < nb; ++k) all_tokens += t.vertical_tokens(k);
  std::int64_t tokens_below = 0;  // vertical tokens of the key blocks before b
  for (index_t b = 0; b < nb; ++b) {
    // Vertical entries as if no tile were active, then what the active tiles add over them.
    std::int64_t query = block_tokens * (t.causal() ? tokens_below : all_tokens);
    std::int64_t key = block_tokens * t.vertical_tokens(b) * (t.causal() ? nb - 1 - b : nb);
    for_each_active_partner(t, b, nb, true, [&](index_t, std::int64_t n) { query += n; });
    for_each_active_partner(t, b, nb, false, [&](index_t, std::int64_t n) { key += n; });
    c.query_entries[static_cast<std::size_t>(b)] = query;
    c.key_entries[static_cast<std::size_t>(b)] = key;
    tokens_below += t.vertical_tokens(b);
  }
  return c;
}

}  // namespace detail

/// Each 64-token block's active entries as a query block and as a key block (see block_costs).
inline block_costs count_block_costs(const global_selection& selection) { return detail::block_costs_of(detail::tile_entries(selection)); }


/// The most ranks balance_stripes takes: its pair-load table has W^2 entries and its cost grows
/// as num_blocks x W^2.
inline constexpr index_t max_balanced_world_size = 1024;

namespace detail {

/// First pass of balance_stripes: round by round, heaviest block first, each block to the free
/// rank where it least raises the sum of squares of the pair loads. Entries with placed blocks are
/// exact; those with blocks still to come are counted as spread evenly over the ranks.
inline std::vector<index_t> greedy_placement(const tile_entries& entries, const block_costs& costs, index_t world) {
  const index_t nb = entries.num_blocks();
  const auto w = static_cast<std::size_t>(world);
  // Pair loads M[q][k] = x[q][k] + row_shift[q] + column_shift[k]: the shifts take the rank-one
  // updates (a placed block's entries leaving the evenly spread estimate) in O(W).
  std::vector<double> x(w * w, 0.0), row_shift(w, 0.0), column_shift(w, 0.0);
  std::vector<double> tokens_done(w, 0.0), blocks_done(w, 0.0);  // per rank, over the finished rounds
  std::vector<index_t> owner(static_cast<std::size_t>(nb), -1);
  std::vector<double> row(w), column(w);  // the block's entries with each rank's blocks: as query, as key
  std::vector<index_t> order(w), placed_in_round;
  std::vector<unsigned char> taken(w);
  placed_in_round.reserve(w);
  const auto total_cost = [&](index_t b) { return costs.query_entries[static_cast<std::size_t>(b)] + costs.key_entries[static_cast<std::size_t>(b)]; };

  for (index_t round_begin = 0; round_begin < nb; round_begin += world) {
    std::iota(order.begin(), order.end(), round_begin);
    std::stable_sort(order.begin(), order.end(), [&](index_t a, index_t b) { return total_cost(a) > total_cost(b); });
    std::fill(taken.begin(), taken.end(), 0);
    placed_in_round.clear();
    for (const index_t b : order) {
      // Entries with the blocks of finished rounds (all below round_begin) ...
      for (std::size_t r = 0; r < w; ++r) {
        row[r] = block_tokens * tokens_done[r];
        column[r] = entries.causal() ? 0.0 : double(block_tokens * entries.vertical_tokens(b)) * blocks_done[r];
      }
      for_each_active_partner(entries, b, round_begin, true, [&](index_t k, std::int64_t n) { row[static_cast<std::size_t>(owner[static_cast<std::size_t>(k)])] += double(n); });
      for_each_active_partner(entries, b, round_begin, false, [&](index_t q, std::int64_t n) { column[static_cast<std::size_t>(owner[static_cast<std::size_t>(q)])] += double(n); });
      // ... and with the blocks of this round placed so far.
      for (const index_t other : placed_in_round) {
        const auto r = static_cast<std::size_t>(owner[static_cast<std::size_t>(other)]);
        row[r] += double(entries(b, other));
        column[r] += double(entries(other, b));
      }
      const double self = double(entries(b, b));
      // The rest, with blocks not placed yet, spread evenly.
      const double known_row = std::accumulate(row.begin(), row.end(), 0.0), known_column = std::accumulate(column.begin(), column.end(), 0.0);
      const double future_row = std::max(0.0, double(costs.query_entries[static_cast<std::size_t>(b)]) - known_row - self) / double(w);
      const double future_column = std::max(0.0, double(costs.key_entries[static_cast<std::size_t>(b)]) - known_column - self) / double(w);
      for (std::size_t r = 0; r < w; ++r) row[r] += future_row, column[r] += future_column;
      const double row_sum = known_row + future_row * double(w), column_sum = known_column + future_column * double(w);
      const double row_mean = row_sum / double(w), column_mean = column_sum / double(w);

      // Half the rise of sum(M^2) when b goes to rank r, less what is the same for every r.
      std::size_t best = w;
      double best_score = std::numeric_limits<double>::infinity();
      for (std::size_t r = 0; r < w; ++r) {
        if (taken[r]) continue;
        double score = row_shift[r] * row_sum + column_shift[r] * column_sum + (column[r] - column_mean) * (row[r] - row_mean);
        for (std::size_t j = 0; j < w; ++j) score += x[r * w + j] * row[j] + x[j * w + r] * column[j];
        score += self * (x[r * w + r] + row_shift[r] + column_shift[r] + row[r] + column[r]);
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
      }
      x[best * w + best] += self;
    }
    for (index_t b = round_begin; b < round_begin + world; ++b) {
      const auto r = static_cast<std::size_t>(owner[static_cast<std::size_t>(b)]);
      tokens_done[r] += double(entries.vertical_tokens(b));
      blocks_done[r] += 1.0;
    }
  }
  return owner;
}

/// One round of a complete placement: each block's exact entries with the blocks outside the
/// round, per rank (as query: row, as key: column), and the entries among the round's blocks.
struct round_entries {
  std::vector<double> row, column;  // [W blocks of the round, W ranks]
  std::vector<double> among;        // [W, W]: (query block i, key block j) of the round, diagonal: the block itself

  /// `tokens_before[r]`: vertical tokens of rank r's blocks before the round; `tokens_all[r]`: of all its blocks.
  round_entries(const tile_entries& entries, const std::vector<index_t>& owner, index_t round_begin, index_t world,
                const std::vector<double>& tokens_before, const std::vector<double>& tokens_all)
      : row(static_cast<std::size_t>(world) * static_cast<std::size_t>(world)), column(row.size()), among(row.size()) {
    const auto w = static_cast<std::size_t>(world);
    const index_t nb = entries.num_blocks(), round_end = round_begin + world;
    const double later_blocks = double(nb / world - round_begin / world - 1);  // per rank: one block per round
    for (std::size_t i = 0; i < w; ++i) {
      const index_t b = round_begin + static_cast<index_t>(i);
      double* r = row.data() + i * w;
      double* c = column.data() + i * w;
      const double tokens = double(entries.vertical_tokens(b));
      for (std::size_t k = 0; k < w; ++k) {
        // Vertical entries outside the round, as if no tile were active (each rank has one block in it).
        const double round_tokens = double(entries.vertical_tokens(round_begin + owner_index(owner, round_begin, world, k)));
        r[k] = block_tokens * (entries.causal() ? tokens_before[k] : tokens_all[k] - round_tokens);
        c[k] = block_tokens * tokens * (entries.causal() ? later_blocks : double(nb / world - 1));
      }
      const auto outside = [&](index_t partner) { return partner < round_begin || partner >= round_end; };
      for_each_active_partner(entries, b, nb, true, [&](index_t k, std::int64_t n) {
        if (outside(k)) r[owner[static_cast<std::size_t>(k)]] += double(n);
      });
      for_each_active_partner(entries, b, nb, false, [&](index_t q, std::int64_t n) {
        if (outside(q)) c[owner[static_cast<std::size_t>(q)]] += double(n);
      });
      for (std::size_t j = 0; j < w; ++j) among[i * w + j] = double(entries(b, round_begin + static_cast<index_t>(j)));
    }
  }

 private:
  /// Position in the round of the block that rank `rank` owns there.
  static index_t owner_index(const std::vector<index_t>& owner, index_t round_begin, index_t world, std::size_t rank) {
    for (index_t i = 0; i < world; ++i)
      if (static_cast<std::size_t>(owner[static_cast<std::size_t>(round_begin + i)]) == rank) return i;
    return 0;  // unreachable: every rank owns one block of each round
  }
};

/// Second pass: within each round, swaps two blocks' ranks wherever that lowers the sum of
/// squares of the exact pair loads; stops after `passes` sweeps or a sweep without a swap.
inline void refine_placement(const tile_entries& entries, index_t world, std::vector<index_t>& owner, int passes) {
  const index_t nb = entries.num_blocks();
  const auto w = static_cast<std::size_t>(world);
  std::vector<double> tokens_all(w, 0.0);
  for (index_t b = 0; b < nb; ++b) tokens_all[static_cast<std::size_t>(owner[static_cast<std::size_t>(b)])] += double(entries.vertical_tokens(b));
  const auto rank_of = [&](index_t round_begin, std::size_t i) { return static_cast<std::size_t>(owner[static_cast<std::size_t>(round_begin) + i]); };

  // The exact pair loads: each entry counted in its query block's row.
  std::vector<double> m(w * w, 0.0), tokens_before(w, 0.0);
  for (index_t round_begin = 0; round_begin < nb; round_begin += world) {
    const round_entries e(entries, owner, round_begin, world, tokens_before, tokens_all);
    for (std::size_t i = 0; i < w; ++i) {
      const std::size_t q = rank_of(round_begin, i);
      for (std::size_t k = 0; k < w; ++k) m[q * w + k] += e.row[i * w + k];
      for (std::size_t j = 0; j < w; ++j) m[q * w + rank_of(round_begin, j)] += e.among[i * w + j];
      tokens_before[q] += double(entries.vertical_tokens(round_begin + static_cast<index_t>(i)));
    }
  }

  std::vector<double> d_row(w), d_column(w);
  for (int pass = 0; pass < passes; ++pass) {
    bool swapped = false;
    std::fill(tokens_before.begin(), tokens_before.end(), 0.0);
    for (index_t round_begin = 0; round_begin < nb; round_begin += world) {
      const round_entries e(entries, owner, round_begin, world, tokens_before, tokens_all);
      for (std::size_t a = 0; a < w; ++a)
        for (std::size_t b = a + 1; b < w; ++b) {
          const std::size_t ra = rank_of(round_begin, a), rb = rank_of(round_begin, b);
          // Block a's entries by rank minus block b's, the pair (a, b) and the blocks themselves apart.
          for (std::size_t k = 0; k < w; ++k) {
            d_row[k] = e.row[a * w + k] - e.row[b * w + k];
            d_column[k] = e.column[a * w + k] - e.column[b * w + k];
          }
          for (std::size_t c = 0; c < w; ++c) {
            if (c == a || c == b) continue;
            const std::size_t rc = rank_of(round_begin, c);
            d_row[rc] += e.among[a * w + c] - e.among[b * w + c];
            d_column[rc] += e.among[c * w + a] - e.among[c * w + b];
          }
          const double self = e.among[a * w + a] - e.among[b * w + b], pair = e.among[a * w + b] - e.among[b * w + a];
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
          double rise = 0.0;
          const auto visit = [&](auto&& f) {
            for (std::size_t j = 0; j < w; ++j) f(ra, j), f(rb, j);
            for (std::size_t i = 0; i < w; ++i)
              if (i != ra && i != rb) f(i, ra), f(i, rb);
          };
          visit([&](std::size_t i, std::size_t j) {
            const double d = change(i, j);
            rise += d * (2.0 * m[i * w + j] + d);
          });
          if (rise >= -1e-9 * std::abs(m[ra * w + rb] + 1.0)) continue;
          visit([&](std::size_t i, std::size_t j) { m[i * w + j] += change(i, j); });
          std::swap(owner[static_cast<std::size_t>(round_begin) + a], owner[static_cast<std::size_t>(round_begin) + b]);
          swapped = true;
        }
      for (std::size_t i = 0; i < w; ++i) tokens_before[rank_of(round_begin, i)] += double(entries.vertical_tokens(round_begin + static_cast<index_t>(i)));
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
  const detail::tile_entries entries(selection);
  if (entries.num_blocks() % world_size != 0)
    throw invalid_argument("seq_len", selection.seq_len,
                           "balance_stripes needs seq_len to be a multiple of world_size * 64 = " + std::to_string(std::int64_t{world_size} * block_tokens));
  std::vector<index_t> owner = detail::greedy_placement(entries, detail::block_costs_of(entries), world_size);
  detail::refine_placement(entries, world_size, owner, refine_passes);
  return sharding::placed_stripes(std::move(owner), world_size);
}

}  // namespace stria
