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
/// correcting a diagonal's tiles for their heads' vertical entries is one contiguous pass per class
/// that selects the diagonal, not one per head.
class stripe_tiles {
 public:
  explicit stripe_tiles(const global_selection& selection) : nb_(selection.num_blocks()), causal_(selection.causal) {
    selection.validate();
    if (selection.num_heads() > max_heads)
      throw invalid_argument("selection.heads.size()", selection.num_heads(),
                             "balance_stripes takes at most " + std::to_string(max_heads) + " heads (a tile's entries over heads are 32-bit)");
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
    std::vector<index_t> delta_index(2 * nb - 1, -1);  // [delta + nb - 1] index into deltas_, or -1
    for (const head_selection& head : selection.heads)
      for (const index_t delta : head.slash_deltas) delta_index[static_cast<std::size_t>(delta + nb_ - 1)] = 0;
    for (index_t d = -(nb_ - 1); d < nb_; ++d)
      if (delta_index[static_cast<std::size_t>(d + nb_ - 1)] == 0) {
        delta_index[static_cast<std::size_t>(d + nb_ - 1)] = static_cast<index_t>(deltas_.size());
        deltas_.push_back(d);
      }
    const std::size_t u = deltas_.size();
    std::vector<std::int32_t> class_heads(u * classes_, 0);  // [diagonal, class] heads of the class that select it
    std::vector<std::int64_t> heads_on(u, 0);
    for (std::size_t h = 0; h < heads; ++h)
      for (const index_t delta : selection.heads[h].slash_deltas) {
        const auto i = static_cast<std::size_t>(delta_index[static_cast<std::size_t>(delta + nb_ - 1)]);
        ++class_heads[i * classes_ + class_of[h]];
        ++heads_on[i];
      }
    whole_.resize(u);
    for (std::size_t i = 0; i < u; ++i) whole_[i] = heads_on[i] * tile(deltas_[i], 0);
    delta_class_begin_.assign(u + 1, 0);
    whole_before_.assign(u + 1, 0);
    heads_before_.assign((u + 1) * classes_, 0);
    for (std::size_t i = 0; i < u; ++i) {
      for (std::size_t c = 0; c < classes_; ++c)
        if (const std::int32_t n = class_heads[i * classes_ + c]; n != 0) delta_classes_.push_back({static_cast<std::int32_t>(c), block_tokens * n});
      delta_class_begin_[i + 1] = delta_classes_.size();
      whole_before_[i + 1] = whole_before_[i] + whole_[i];
      for (std::size_t c = 0; c < classes_; ++c)
        heads_before_[(i + 1) * classes_ + c] = heads_before_[i * classes_ + c] + (corrected(i) ? class_heads[i * classes_ + c] : 0);
    }

    // Explicit tiles off the head's own selected diagonals (those count once, as diagonal tiles),
    // merged over heads.
    for (std::size_t h = 0; h < heads; ++h) {
      const head_selection& head = selection.heads[h];
      for (const block_pair& b : head.blocks) {
        if (std::binary_search(head.slash_deltas.begin(), head.slash_deltas.end(), b.query_block - b.key_block)) continue;
        const std::int32_t tokens = class_tokens_[class_of[h] * nb + static_cast<std::size_t>(b.key_block)];
        const std::int64_t vertical = in_range(b.query_block, b.key_block) ? block_tokens * std::int64_t{tokens} : 0;
        explicit_by_query_.push_back({b.query_block, b.key_block, tile(b.query_block, b.key_block) - vertical});
      }
    }
    std::sort(explicit_by_query_.begin(), explicit_by_query_.end(), [](const weighted_tile& x, const weighted_tile& y) {
      return x.query_block != y.query_block ? x.query_block < y.query_block : x.key_block < y.key_block;
    });
    std::size_t kept = 0;  // one entry per tile
    for (std::size_t i = 0; i < explicit_by_query_.size(); ++i) {
      const weighted_tile& t = explicit_by_query_[i];
      if (kept > 0 && explicit_by_query_[kept - 1].query_block == t.query_block && explicit_by_query_[kept - 1].key_block == t.key_block)
        explicit_by_query_[kept - 1].entries += t.entries;
      else explicit_by_query_[kept++] = explicit_by_query_[i];
    }
    explicit_by_query_.resize(kept);
    explicit_by_key_ = explicit_by_query_;
    std::sort(explicit_by_key_.begin(), explicit_by_key_.end(), [](const weighted_tile& x, const weighted_tile& y) {
      return x.key_block != y.key_block ? x.key_block < y.key_block : x.query_block < y.query_block;
    });
  }

  /// The most heads: a tile's entries summed over heads fit 32 bits.
  static constexpr index_t max_heads = (index_t{1} << 30) / (block_tokens * block_tokens);

  [[nodiscard]] index_t num_blocks() const { return nb_; }
  /// Tiles on the union's diagonals and explicit tiles: what one gathering of all rows visits.
  [[nodiscard]] std::int64_t active_tiles() const {
    std::int64_t n = static_cast<std::int64_t>(explicit_by_query_.size());
    for (const index_t delta : deltas_) n += nb_ - (delta < 0 ? -delta : delta);
    return n;
  }
  [[nodiscard]] bool causal() const { return causal_; }
  /// Vertical tokens of key block k over all heads.
  [[nodiscard]] std::int64_t vertical_tokens(index_t k) const { return tokens_all_[static_cast<std::size_t>(k)]; }

  /// Whether a vertical token of k_block counts for the rows of q_block (outside active tiles).
  [[nodiscard]] bool in_range(index_t q_block, index_t k_block) const { return !causal_ || q_block > k_block; }

  [[nodiscard]] std::int64_t tile(index_t q_block, index_t k_block) const {
    return causal_ && q_block == k_block ? std::int64_t{block_tokens} * (block_tokens + 1) / 2 : std::int64_t{block_tokens} * block_tokens;
  }

  /// For the query blocks first + j (j < count), adds to rows[j * w + owner[k]] what their active
  /// tiles with key blocks k in [k_begin, k_end) add over the tiles' vertical entries. Along a
  /// diagonal consecutive query blocks meet consecutive key blocks: the correction for the heads'
  /// vertical tokens is a contiguous pass and the row updates are independent of each other, so a
  /// tile costs about one scattered add once count is some tens of blocks. `scratch`: a buffer.
  void add_rows(index_t first, index_t count, index_t k_begin, index_t k_end, const std::vector<index_t>& owner, std::int64_t* rows, std::size_t w,
                std::vector<std::int32_t>& scratch) const {
    if (k_begin >= k_end || count <= 0) return;
    // k = first + j - delta in [k_begin, k_end) for some j in [0, count).
    const auto i_begin = static_cast<std::size_t>(std::upper_bound(deltas_.begin(), deltas_.end(), first - k_end) - deltas_.begin());
    const auto i_end = static_cast<std::size_t>(std::upper_bound(deltas_.begin(), deltas_.end(), first + count - 1 - k_begin) - deltas_.begin());
    for (std::size_t i = i_begin; i < i_end; ++i) {
      const index_t k0 = first - deltas_[i];  // the key block of j = 0
      const auto j_begin = static_cast<std::size_t>(std::max<index_t>(0, k_begin - k0)), j_end = static_cast<std::size_t>(std::min(count, k_end - k0));
      if (j_begin >= j_end) continue;
      const std::int32_t* n = diagonal_entries(i, k0, j_begin, j_end, scratch);
      const index_t* rank = owner.data() + (static_cast<std::ptrdiff_t>(k0) + static_cast<std::ptrdiff_t>(j_begin));
      for (std::size_t j = j_begin; j < j_end; ++j) rows[j * w + static_cast<std::size_t>(rank[j - j_begin])] += n[j - j_begin];
    }
    if (explicit_by_query_.empty()) return;
    for (std::size_t j = 0; j < static_cast<std::size_t>(count); ++j)
      for (auto it = std::lower_bound(explicit_by_query_.begin(), explicit_by_query_.end(), block_pair{first + static_cast<index_t>(j), k_begin}, by_query);
           it != explicit_by_query_.end() && it->query_block == first + static_cast<index_t>(j) && it->key_block < k_end; ++it)
        rows[j * w + static_cast<std::size_t>(owner[static_cast<std::size_t>(it->key_block)])] += it->entries;
  }

  /// The same for the key blocks first + j: columns[j * w + owner[q]] gets their active tiles with
  /// query blocks q in [q_begin, q_end).
  void add_columns(index_t first, index_t count, index_t q_begin, index_t q_end, const std::vector<index_t>& owner, std::int64_t* columns, std::size_t w,
                   std::vector<std::int32_t>& scratch) const {
    if (q_begin >= q_end || count <= 0) return;
    // q = first + j + delta in [q_begin, q_end) for some j in [0, count).
    const auto i_begin = static_cast<std::size_t>(std::lower_bound(deltas_.begin(), deltas_.end(), q_begin - first - count + 1) - deltas_.begin());
    const auto i_end = static_cast<std::size_t>(std::upper_bound(deltas_.begin(), deltas_.end(), q_end - 1 - first) - deltas_.begin());
    for (std::size_t i = i_begin; i < i_end; ++i) {
      const index_t q0 = first + deltas_[i];  // the query block of j = 0
      const auto j_begin = static_cast<std::size_t>(std::max<index_t>(0, q_begin - q0)), j_end = static_cast<std::size_t>(std::min(count, q_end - q0));
      if (j_begin >= j_end) continue;
      const std::int32_t* n = diagonal_entries(i, first, j_begin, j_end, scratch);
      const index_t* rank = owner.data() + (static_cast<std::ptrdiff_t>(q0) + static_cast<std::ptrdiff_t>(j_begin));
      for (std::size_t j = j_begin; j < j_end; ++j) columns[j * w + static_cast<std::size_t>(rank[j - j_begin])] += n[j - j_begin];
    }
    if (explicit_by_key_.empty()) return;
    for (std::size_t j = 0; j < static_cast<std::size_t>(count); ++j)
      for (auto it = std::lower_bound(explicit_by_key_.begin(), explicit_by_key_.end(), block_pair{q_begin, first + static_cast<index_t>(j)}, by_key);
           it != explicit_by_key_.end() && it->key_block == first + static_cast<index_t>(j) && it->query_block < q_end; ++it)
        columns[j * w + static_cast<std::size_t>(owner[static_cast<std::size_t>(it->query_block)])] += it->entries;
  }

  /// among[i * w + j] = entries of the tile (first + i, first + j) for i, j < w: the round's tiles
  /// among its own blocks, diagonal by diagonal.
  void round_tiles(index_t first, std::size_t w, std::int64_t* among, std::vector<std::int32_t>& scratch) const {
    const auto count = static_cast<index_t>(w);
    for (std::size_t i = 0; i < w; ++i)
      for (std::size_t j = 0; j < w; ++j)
        among[i * w + j] = !causal_ || j < i ? block_tokens * tokens_all_[static_cast<std::size_t>(first) + j] : 0;
    const auto i_begin = static_cast<std::size_t>(std::lower_bound(deltas_.begin(), deltas_.end(), 1 - count) - deltas_.begin());
    const auto i_end = static_cast<std::size_t>(std::upper_bound(deltas_.begin(), deltas_.end(), count - 1) - deltas_.begin());
    for (std::size_t d = i_begin; d < i_end; ++d) {
      const index_t delta = deltas_[d];  // query lane i meets key lane i - delta
      const auto lane_begin = static_cast<std::size_t>(std::max<index_t>(0, delta)), lane_end = static_cast<std::size_t>(std::min(count, count + delta));
      const std::int32_t* n = diagonal_entries(d, first - delta, lane_begin, lane_end, scratch);
      for (std::size_t i = lane_begin; i < lane_end; ++i)
        among[i * w + static_cast<std::size_t>(static_cast<std::ptrdiff_t>(i) - delta)] += n[i - lane_begin];
    }
    if (explicit_by_query_.empty()) return;
    for (std::size_t i = 0; i < w; ++i)
      for (auto it = std::lower_bound(explicit_by_query_.begin(), explicit_by_query_.end(), block_pair{first + static_cast<index_t>(i), first}, by_query);
           it != explicit_by_query_.end() && it->query_block == first + static_cast<index_t>(i) && it->key_block < first + count; ++it)
        among[i * w + static_cast<std::size_t>(it->key_block - first)] += it->entries;
  }

  /// Each key block's entries over all query blocks, in O(num_blocks x classes with tokens per
  /// block): its vertical entries, the whole tiles of the diagonals that reach it, less the
  /// vertical entries those tiles' heads cover (prefix sums over the diagonals), and its explicit
  /// tiles.
  [[nodiscard]] std::vector<std::int64_t> key_costs() const {
    std::vector<std::int64_t> key(static_cast<std::size_t>(nb_));
    std::size_t i_begin = deltas_.size(), i_end = deltas_.size(), e = 0;  // diagonals in [-k, nb - 1 - k]; explicit tiles of key blocks < k
    for (index_t k = 0; k < nb_; ++k) {
      const auto kb = static_cast<std::size_t>(k);
      while (i_begin > 0 && deltas_[i_begin - 1] >= -k) --i_begin;
      while (i_end > 0 && deltas_[i_end - 1] > nb_ - 1 - k) --i_end;
      std::int64_t n = block_tokens * tokens_all_[kb] * (causal_ ? nb_ - 1 - k : nb_) + whole_before_[i_end] - whole_before_[i_begin];
      for (std::size_t p = token_begin_[kb]; p < token_begin_[kb + 1]; ++p) {
        const auto c = static_cast<std::size_t>(block_tokens_[p].first);
        n -= block_tokens * std::int64_t{block_tokens_[p].second} * (heads_before_[i_end * classes_ + c] - heads_before_[i_begin * classes_ + c]);
      }
      for (; e < explicit_by_key_.size() && explicit_by_key_[e].key_block == k; ++e) n += explicit_by_key_[e].entries;
      key[kb] = n;
    }
    return key;
  }

  /// Each block's entries as a query block and as a key block. The query side's vertical
  /// correction runs along each diagonal (contiguous, vectorised): O(num_blocks x diagonals).
  [[nodiscard]] block_costs costs() const {
    const auto nb = static_cast<std::size_t>(nb_);
    block_costs c{std::vector<std::int64_t>(nb, 0), std::vector<std::int64_t>(nb, 0)};
    // Query side: the vertical tokens its active tiles cover, per diagonal (q = k + delta).
    c.key_entries = key_costs();
    std::vector<std::int64_t> covered(nb, 0);
    for (std::size_t i = 0; i < deltas_.size(); ++i) {
      if (!corrected(i)) continue;
      const index_t delta = deltas_[i];
      const auto q_begin = static_cast<std::size_t>(std::max<index_t>(0, delta)), q_end = static_cast<std::size_t>(std::min(nb_, nb_ + delta));
      for (std::size_t p = delta_class_begin_[i]; p < delta_class_begin_[i + 1]; ++p) {
        const std::int32_t heads = delta_classes_[p].second;  // times 64
        const std::int32_t* tokens = class_tokens_.data() + static_cast<std::size_t>(delta_classes_[p].first) * nb +
                                      static_cast<std::size_t>(static_cast<std::ptrdiff_t>(q_begin) - delta);  // key block of q_begin
        for (std::size_t q = q_begin; q < q_end; ++q) covered[q] += heads * tokens[q - q_begin];
      }
    }
    std::int64_t all_tokens = 0;
    for (const std::int64_t t : tokens_all_) all_tokens += t;
    std::int64_t tokens_below = 0;  // vertical tokens of the key blocks before b
    for (index_t b = 0; b < nb_; ++b) {
      const auto bi = static_cast<std::size_t>(b);
      // As query: key blocks b - delta in [0, nb).
      const auto i_begin = static_cast<std::size_t>(std::lower_bound(deltas_.begin(), deltas_.end(), b - nb_ + 1) - deltas_.begin());
      const auto i_end = static_cast<std::size_t>(std::upper_bound(deltas_.begin(), deltas_.end(), b) - deltas_.begin());
      std::int64_t query = block_tokens * (causal_ ? tokens_below : all_tokens) + whole_before_[i_end] - whole_before_[i_begin] - covered[bi];
      for_explicit(explicit_by_query_, b, [](const weighted_tile& t) { return t.query_block; }, [&](std::int64_t n) { query += n; });
      c.query_entries[bi] = query;
      tokens_below += tokens_all_[bi];
    }
    return c;
  }

 private:
  struct weighted_tile {
    index_t query_block, key_block;
    std::int64_t entries;  // over the heads for which it is explicit, less their vertical entries
  };
  static bool by_query(const weighted_tile& x, const block_pair& y) {
    return x.query_block != y.query_block ? x.query_block < y.query_block : x.key_block < y.key_block;
  }
  static bool by_key(const weighted_tile& x, const block_pair& y) {
    return x.key_block != y.key_block ? x.key_block < y.key_block : x.query_block < y.query_block;
  }

  template <class Block, class F>
  static void for_explicit(const std::vector<weighted_tile>& tiles, index_t b, Block block, F&& f) {
    auto it = std::lower_bound(tiles.begin(), tiles.end(), b, [&](const weighted_tile& t, index_t x) { return block(t) < x; });
    for (; it != tiles.end() && block(*it) == b; ++it) f(it->entries);
  }

  /// Whether the tiles of diagonal i cover vertical entries (causal: not on the block diagonal).
  [[nodiscard]] bool corrected(std::size_t i) const { return !causal_ || deltas_[i] > 0; }

  /// What the heads selecting diagonal i add on its tiles with key blocks k0 + j, j in
  /// [j_begin, j_end), over the tiles' vertical entries: at index j - j_begin of a scratch row.
  const std::int32_t* diagonal_entries(std::size_t i, index_t k0, std::size_t j_begin, std::size_t j_end, std::vector<std::int32_t>& scratch) const {
    const std::size_t count = j_end - j_begin;
    if (scratch.size() < count) scratch.resize(count);
    std::int32_t* n = scratch.data();
    const auto whole = static_cast<std::int32_t>(whole_[i]);  // at most max_heads * 4096
    for (std::size_t j = 0; j < count; ++j) n[j] = whole;
    if (!corrected(i)) return n;
    const auto k_begin = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(k0) + static_cast<std::ptrdiff_t>(j_begin));
    for (std::size_t p = delta_class_begin_[i]; p < delta_class_begin_[i + 1]; ++p) {
      const std::int32_t heads = delta_classes_[p].second;  // times 64
      const std::int32_t* tokens = class_tokens_.data() + static_cast<std::size_t>(delta_classes_[p].first) * static_cast<std::size_t>(nb_) + k_begin;
      if (heads == block_tokens)  // one head of the class (per-head vertical tokens, as estimators give)
        for (std::size_t j = 0; j < count; ++j) n[j] -= block_tokens * tokens[j];
      else
        for (std::size_t j = 0; j < count; ++j) n[j] -= heads * tokens[j];
    }
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
  std::vector<std::int64_t> whole_;                           // [diagonal] its whole tiles' entries over the heads that select it
  std::vector<std::pair<std::int32_t, std::int32_t>> delta_classes_;  // per diagonal (CSR): (class, 64 x its heads that select it)
  std::vector<std::size_t> delta_class_begin_;                // [diagonals + 1] into delta_classes_
  std::vector<std::int64_t> whole_before_, heads_before_;     // prefix sums over the diagonals: whole_, in-range heads per class [diagonal, class]
  std::vector<weighted_tile> explicit_by_query_, explicit_by_key_;
};

}  // namespace detail

/// Each 64-token block's active entries as a query block and as a key block (see block_costs).
inline block_costs count_block_costs(const global_selection& selection) { return detail::stripe_tiles(selection).costs(); }


/// The most ranks balance_stripes takes: its pair-load table has W^2 entries and its cost grows
/// as num_blocks x W^2.
inline constexpr index_t max_balanced_world_size = 1024;

namespace detail {

/// sum_j x[j] y[j], in four partial sums (so that the additions do not wait on each other).
inline double dot(const double* x, const double* y, std::size_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  std::size_t j = 0;
  for (; j + 4 <= n; j += 4)
    for (std::size_t l = 0; l < 4; ++l) s[l] += x[j + l] * y[j + l];
  for (; j < n; ++j) s[0] += x[j] * y[j];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

/// Blocks whose tiles are gathered together, diagonal by diagonal: whole rounds, at least 128
/// blocks, so that a diagonal's setup is shared by enough tiles at small W.
inline index_t gather_batch(index_t world) { return world * std::max<index_t>(1, (128 + world - 1) / world); }

/// First pass of balance_stripes: round by round, heaviest block first, each block to the free
/// rank where it least raises the sum of squares of the pair loads. Entries with placed blocks are
/// exact; those with blocks still to come are counted as spread evenly over the ranks. `loads`
/// gets the exact pair loads of the placement: [query rank, KV rank].
inline std::vector<index_t> greedy_placement(const stripe_tiles& tiles, index_t world, std::vector<std::int64_t>& loads) {
  const index_t nb = tiles.num_blocks();
  const bool causal = tiles.causal();
  const auto w = static_cast<std::size_t>(world);
  // Estimated pair loads M[q][k] = x[q][k] + row_shift[q] + column_shift[k]: the shifts take the
  // rank-one updates (a placed block's entries leaving the evenly spread estimate) in O(W).
  std::vector<double> x(w * w, 0.0), row_shift(w, 0.0), column_shift(w, 0.0);
  std::vector<std::int64_t> tokens_done(w, 0), blocks_done(w, 0);  // per rank, over the finished rounds
  std::int64_t tokens_done_all = 0;
  std::vector<index_t> owner(static_cast<std::size_t>(nb), -1);
  // Per block of the round (position i): its active tiles' entries over the vertical ones with
  // the finished rounds' blocks, per rank, as query (rows) and as key (columns); the round's
  // tiles among its blocks; its entries as query and as key over all blocks. Causal: a block's
  // key blocks are all placed or in its round, so its query entries come from its row.
  const index_t batch = gather_batch(world);
  std::vector<std::int64_t> rows_before(static_cast<std::size_t>(batch) * w), columns_before(rows_before.size()), among(w * w), query_cost(w), key_cost(w);
  std::vector<std::int32_t> scratch;
  const std::vector<std::int64_t> query_cost_all = causal ? std::vector<std::int64_t>{} : tiles.costs().query_entries, key_cost_all = tiles.key_costs();
  // The block's exact entries with each rank's placed blocks (as query: row, as key: column), and
  // with the rest spread evenly.
  std::vector<std::int64_t> known_row(w), known_column(w);
  std::vector<double> row(w), column(w), x_column(w), x_column_sum(w, 0.0);  // x_column_sum = X^T 1
  std::vector<std::size_t> order(w), placed_in_round;
  std::vector<unsigned char> taken(w);
  placed_in_round.reserve(w);
  loads.assign(w * w, 0);
  const auto owner_of = [&](index_t b) { return static_cast<std::size_t>(owner[static_cast<std::size_t>(b)]); };

  for (index_t batch_begin = 0; batch_begin < nb; batch_begin += batch) {
    const index_t batch_end = std::min(nb, batch_begin + batch);
    std::fill(rows_before.begin(), rows_before.end(), 0);
    std::fill(columns_before.begin(), columns_before.end(), 0);
    tiles.add_rows(batch_begin, batch_end - batch_begin, 0, batch_begin, owner, rows_before.data(), w, scratch);
    if (!causal) tiles.add_columns(batch_begin, batch_end - batch_begin, 0, batch_begin, owner, columns_before.data(), w, scratch);
    for (index_t round_begin = batch_begin; round_begin < batch_end; round_begin += world) {
      // The batch's rounds before this one are placed now.
      std::int64_t* round_rows = rows_before.data() + static_cast<std::size_t>(round_begin - batch_begin) * w;
      std::int64_t* round_columns = columns_before.data() + static_cast<std::size_t>(round_begin - batch_begin) * w;
      tiles.add_rows(round_begin, world, batch_begin, round_begin, owner, round_rows, w, scratch);
      if (!causal) tiles.add_columns(round_begin, world, batch_begin, round_begin, owner, round_columns, w, scratch);
      tiles.round_tiles(round_begin, w, among.data(), scratch);
      for (std::size_t i = 0; i < w; ++i) {
        const index_t b = round_begin + static_cast<index_t>(i);
        key_cost[i] = key_cost_all[static_cast<std::size_t>(b)];
        query_cost[i] = causal ? block_tokens * tokens_done_all + std::accumulate(round_rows + i * w, round_rows + (i + 1) * w, std::int64_t{0}) +
                                     std::accumulate(among.begin() + static_cast<std::ptrdiff_t>(i * w), among.begin() + static_cast<std::ptrdiff_t>((i + 1) * w), std::int64_t{0})
                               : query_cost_all[static_cast<std::size_t>(b)];
      }
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return query_cost[a] + key_cost[a] > query_cost[b] + key_cost[b]; });
      std::fill(taken.begin(), taken.end(), 0);
      placed_in_round.clear();
      for (const std::size_t i : order) {
        const index_t b = round_begin + static_cast<index_t>(i);
        // Entries with the blocks of finished rounds (all below round_begin) ...
        const std::int64_t b_tokens = tiles.vertical_tokens(b);
        for (std::size_t r = 0; r < w; ++r) {
          known_row[r] = block_tokens * tokens_done[r] + round_rows[i * w + r];
          known_column[r] = causal ? 0 : block_tokens * b_tokens * blocks_done[r] + round_columns[i * w + r];
        }
        // ... and with the blocks of this round placed so far.
        for (const std::size_t o : placed_in_round) {
          const std::size_t r = owner_of(round_begin + static_cast<index_t>(o));
          known_row[r] += among[i * w + o];
          known_column[r] += among[o * w + i];
        }
        const std::int64_t self = among[i * w + i];
        // The rest, with blocks not placed yet, spread evenly.
        const std::int64_t known_row_sum = std::accumulate(known_row.begin(), known_row.end(), std::int64_t{0});
        const std::int64_t known_column_sum = std::accumulate(known_column.begin(), known_column.end(), std::int64_t{0});
        const double future_row = double(std::max<std::int64_t>(0, query_cost[i] - known_row_sum - self)) / double(w);
        const double future_column = double(std::max<std::int64_t>(0, key_cost[i] - known_column_sum - self)) / double(w);
        for (std::size_t r = 0; r < w; ++r) row[r] = double(known_row[r]) + future_row, column[r] = double(known_column[r]) + future_column;
        const double row_sum = double(known_row_sum) + future_row * double(w), column_sum = double(known_column_sum) + future_column * double(w);
        const double row_mean = row_sum / double(w), column_mean = column_sum / double(w);
        // X^T column = future_column X^T 1 + X^T known_column (causal: nonzero only for the round's placed blocks).
        for (std::size_t r = 0; r < w; ++r) x_column[r] = future_column * x_column_sum[r];
        for (std::size_t j = 0; j < w; ++j) {
          if (known_column[j] == 0) continue;
          const double c = double(known_column[j]);
          const double* xj = x.data() + j * w;
          for (std::size_t r = 0; r < w; ++r) x_column[r] += c * xj[r];
        }

        // Half the rise of sum(M^2) when b goes to rank r, less what is the same for every r.
        std::size_t best = w;
        double best_score = std::numeric_limits<double>::infinity();
        for (std::size_t r = 0; r < w; ++r) {
          if (taken[r]) continue;
          const double* xr = x.data() + r * w;
          const double x_row = dot(xr, row.data(), w);
          double score = row_shift[r] * row_sum + column_shift[r] * column_sum + (column[r] - column_mean) * (row[r] - row_mean) + x_row + x_column[r];
          score += double(self) * (xr[r] + row_shift[r] + column_shift[r] + row[r] + column[r]);
          if (score < best_score) best_score = score, best = r;
        }
        taken[best] = 1;
        owner[static_cast<std::size_t>(b)] = static_cast<index_t>(best);
        placed_in_round.push_back(i);
        for (std::size_t j = 0; j < w; ++j) {
          x[best * w + j] += row[j];
          x[j * w + best] += column[j];
          x_column_sum[j] += row[j];
          column_shift[j] -= row[j] / double(w);
          row_shift[j] -= column[j] / double(w);
          loads[best * w + j] += known_row[j];
          loads[j * w + best] += known_column[j];
        }
        x[best * w + best] += double(self);
        x_column_sum[best] += column_sum + double(self);
        loads[best * w + best] += self;
      }
      for (index_t b = round_begin; b < round_begin + world; ++b) {
        tokens_done[owner_of(b)] += tiles.vertical_tokens(b);
        tokens_done_all += tiles.vertical_tokens(b);
        ++blocks_done[owner_of(b)];
      }
    }
  }
  return owner;
}

/// Sum over j of r_j (dm_j + r_j) + c_j (dn_j + c_j), with r = row_a - row_b, dm = m_rb - m_ra,
/// c = column_a - column_b, dn = mt_rb - mt_ra: the rows' and columns' part of a swap's rise in
/// the sum of squares (four partial sums, so that the additions do not wait on each other).
inline double swap_lines(const double* row_a, const double* row_b, const double* m_ra, const double* m_rb, const double* column_a,
                         const double* column_b, const double* mt_ra, const double* mt_rb, std::size_t w) {
  const auto part = [w](const double* x_a, const double* x_b, const double* y_a, const double* y_b) {
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    std::size_t j = 0;
    for (; j + 4 <= w; j += 4)
      for (std::size_t l = 0; l < 4; ++l) {
        const double d = x_a[j + l] - x_b[j + l];
        s[l] += d * (y_b[j + l] - y_a[j + l] + d);
      }
    for (; j < w; ++j) {
      const double d = x_a[j] - x_b[j];
      s[0] += d * (y_b[j] - y_a[j] + d);
    }
    return (s[0] + s[1]) + (s[2] + s[3]);
  };
  return part(row_a, row_b, m_ra, m_rb) + part(column_a, column_b, mt_ra, mt_rb);
}

/// When refinement stops early (bounded sweeps with early exit): once a sweep lowers the pair
/// loads' sum of squared deviations by less than stalled_sweep of it; and, once the sweeps have
/// cost more than free_sweep_tiles tile visits (a few milliseconds), as soon as no pair load
/// exceeds the mean pair load by more than settled_pair_load: a fifth of a 5% imbalance target,
/// where a sweep costs about what the greedy pass does and gains a few tenths of a percent.
/// These are functions of the input alone, so the placement stays deterministic.
inline constexpr double stalled_sweep = 0.1;
inline constexpr double settled_pair_load = 0.01;
inline constexpr std::int64_t free_sweep_tiles = std::int64_t{1} << 22;

/// Second pass: within each round, swaps two blocks' ranks wherever that lowers the sum of
/// squares of the exact pair loads `loads` (kept up to date); stops after `passes` sweeps, a
/// sweep without a swap, or early (settled_pair_load, stalled_sweep). Per round, each block's
/// entries with the blocks outside the round are summed per rank once (they do not change while
/// the round's blocks swap), so a candidate swap costs O(W).
inline void refine_placement(const stripe_tiles& tiles, index_t world, std::vector<index_t>& owner, const std::vector<std::int64_t>& loads, int passes) {
  const index_t nb = tiles.num_blocks();
  const auto w = static_cast<std::size_t>(world);
  std::vector<double> m(w * w), mt(w * w);  // pair loads [query rank, KV rank] and transposed
  for (std::size_t i = 0; i < w; ++i)
    for (std::size_t j = 0; j < w; ++j) m[i * w + j] = mt[j * w + i] = double(loads[i * w + j]);
  std::vector<std::int64_t> tokens_all(w, 0), tokens_before(w, 0);  // per rank: vertical tokens of all its blocks, of those before the round
  for (index_t b = 0; b < nb; ++b) tokens_all[static_cast<std::size_t>(owner[static_cast<std::size_t>(b)])] += tiles.vertical_tokens(b);
  // Per block of the round (position i), per rank: entries with the rank's blocks, as query (row)
  // and as key (column): outside the round exactly, inside by the blocks' current ranks. The
  // active tiles with blocks outside the batch are gathered once per batch (those blocks keep
  // their ranks meanwhile), with the batch's other rounds once per round.
  const index_t batch = gather_batch(world);
  std::vector<std::int64_t> outside_row(static_cast<std::size_t>(batch) * w), outside_column(outside_row.size()), round_among(w * w);
  std::vector<std::int32_t> scratch;
  std::vector<double> row(w * w), column(w * w), among(w * w);  // among: (query block i, key block j) of the round
  std::vector<std::size_t> position(w);  // rank -> its block's position in the round
  std::vector<double> d_row(w), d_column(w);
  const auto rank_of = [&](index_t round_begin, std::size_t i) { return static_cast<std::size_t>(owner[static_cast<std::size_t>(round_begin) + i]); };

  const double mean_load = std::accumulate(m.begin(), m.end(), 0.0) / double(w * w);
  const auto deviation = [&] {
    double sum = 0.0;
    for (const double x : m) sum += (x - mean_load) * (x - mean_load);
    return sum;
  };
  const std::int64_t sweep_tiles = 2 * tiles.active_tiles();  // each active tile as a row's and as a column's
  for (int pass = 0; pass < passes; ++pass) {
    if (sweep_tiles * (pass + 1) > free_sweep_tiles && *std::max_element(m.begin(), m.end()) <= (1.0 + settled_pair_load) * mean_load) break;
    const double deviation_before = deviation();
    bool swapped = false;
    std::fill(tokens_before.begin(), tokens_before.end(), 0);
    for (index_t batch_begin = 0; batch_begin < nb; batch_begin += batch) {
      const index_t batch_end = std::min(nb, batch_begin + batch), count = batch_end - batch_begin;
      std::fill(outside_row.begin(), outside_row.end(), 0);
      std::fill(outside_column.begin(), outside_column.end(), 0);
      tiles.add_rows(batch_begin, count, 0, batch_begin, owner, outside_row.data(), w, scratch);
      tiles.add_rows(batch_begin, count, batch_end, nb, owner, outside_row.data(), w, scratch);
      tiles.add_columns(batch_begin, count, 0, batch_begin, owner, outside_column.data(), w, scratch);
      tiles.add_columns(batch_begin, count, batch_end, nb, owner, outside_column.data(), w, scratch);
      for (index_t round_begin = batch_begin; round_begin < batch_end; round_begin += world) {
        const index_t round_end = round_begin + world;
        std::int64_t* round_row = outside_row.data() + static_cast<std::size_t>(round_begin - batch_begin) * w;
        std::int64_t* round_column = outside_column.data() + static_cast<std::size_t>(round_begin - batch_begin) * w;
        tiles.add_rows(round_begin, world, batch_begin, round_begin, owner, round_row, w, scratch);
        tiles.add_rows(round_begin, world, round_end, batch_end, owner, round_row, w, scratch);
        tiles.add_columns(round_begin, world, batch_begin, round_begin, owner, round_column, w, scratch);
        tiles.add_columns(round_begin, world, round_end, batch_end, owner, round_column, w, scratch);
        const std::int64_t later_blocks = nb / world - round_begin / world - 1;  // per rank: one block per round
        for (std::size_t i = 0; i < w; ++i) position[rank_of(round_begin, i)] = i;
        for (std::size_t i = 0; i < w; ++i) {
          const index_t b = round_begin + static_cast<index_t>(i);
          const std::int64_t b_tokens = tiles.vertical_tokens(b);
          for (std::size_t k = 0; k < w; ++k) {
            // Vertical entries outside the round, as if no tile were active (each rank has one block in it).
            const std::int64_t tokens = tiles.causal() ? tokens_before[k] : tokens_all[k] - tiles.vertical_tokens(round_begin + static_cast<index_t>(position[k]));
            row[i * w + k] = double(round_row[i * w + k] + block_tokens * tokens);
            column[i * w + k] = double(round_column[i * w + k] + block_tokens * b_tokens * (tiles.causal() ? later_blocks : nb / world - 1));
          }
        }
        tiles.round_tiles(round_begin, w, round_among.data(), scratch);
        for (std::size_t i = 0; i < w * w; ++i) among[i] = double(round_among[i]);
        for (std::size_t i = 0; i < w; ++i)
          for (std::size_t j = 0; j < w; ++j) {
            row[i * w + rank_of(round_begin, j)] += among[i * w + j];
            column[j * w + rank_of(round_begin, i)] += among[i * w + j];
          }

        for (std::size_t a = 0; a < w; ++a)
          for (std::size_t b = a + 1; b < w; ++b) {
            const std::size_t ra = rank_of(round_begin, a), rb = rank_of(round_begin, b);
            // Block a's entries by rank minus block b's (d_row, d_column), the pair (a, b) and the
            // blocks themselves apart: the round's rows hold them at ra and rb.
            const double* row_a = row.data() + a * w;
            const double* row_b = row.data() + b * w;
            const double* column_a = column.data() + a * w;
            const double* column_b = column.data() + b * w;
            const double aa = among[a * w + a], ab = among[a * w + b], ba = among[b * w + a], bb = among[b * w + b];
            const double self = aa - bb, pair = ab - ba;
            const double d_row_ra = row_a[ra] - row_b[ra] - (aa - ba), d_row_rb = row_a[rb] - row_b[rb] - (ab - bb);
            const double d_column_ra = column_a[ra] - column_b[ra] - (aa - ab), d_column_rb = column_a[rb] - column_b[rb] - (ba - bb);
            // Swapping moves a's row and column from ra to rb and b's the other way:
            // dM = u (x) d_row + d_column (x) u + self (E_bb - E_aa) + pair (E_ba - E_ab), u = e_rb - e_ra.
            const auto change = [&](std::size_t i, std::size_t j, double row_j, double column_i) {
              const double ui = i == rb ? 1.0 : i == ra ? -1.0 : 0.0, uj = j == rb ? 1.0 : j == ra ? -1.0 : 0.0;
              double d = ui * row_j + column_i * uj;
              if (i == j) d += self * ui;  // +self at (rb, rb), -self at (ra, ra)
              else if (i == rb && j == ra) d += pair;
              else if (i == ra && j == rb) d -= pair;
              return d;
            };
            // Rows ra and rb and columns ra and rb change: sum of d (2 m + d) over their cells (the
            // lines' terms at ra and rb replaced by the four crossings).
            const double* m_ra = m.data() + ra * w;
            const double* m_rb = m.data() + rb * w;
            const double* mt_ra = mt.data() + ra * w;
            const double* mt_rb = mt.data() + rb * w;
            double rise = 2.0 * swap_lines(row_a, row_b, m_ra, m_rb, column_a, column_b, mt_ra, mt_rb, w);
            for (const std::size_t j : {ra, rb}) {
              const double r = row_a[j] - row_b[j], c = column_a[j] - column_b[j];
              rise -= 2.0 * (r * (m_rb[j] - m_ra[j] + r) + c * (mt_rb[j] - mt_ra[j] + c));
            }
            for (const std::size_t i : {ra, rb})
              for (const std::size_t j : {ra, rb}) {
                const double d = change(i, j, j == ra ? d_row_ra : d_row_rb, i == ra ? d_column_ra : d_column_rb);
                rise += d * (2.0 * m[i * w + j] + d);
              }
            if (rise >= -1e-9 * std::abs(m[ra * w + rb] + 1.0)) continue;
            for (std::size_t k = 0; k < w; ++k) d_row[k] = row_a[k] - row_b[k], d_column[k] = column_a[k] - column_b[k];
            d_row[ra] = d_row_ra, d_row[rb] = d_row_rb, d_column[ra] = d_column_ra, d_column[rb] = d_column_rb;
            const auto apply = [&](std::size_t i, std::size_t j) {
              const double d = change(i, j, d_row[j], d_column[i]);
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
    }
    if (!swapped || deviation() > (1.0 - stalled_sweep) * deviation_before) break;
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
/// blocks still to be placed count as spread evenly. Then up to `refine_passes` sweeps swap two
/// blocks of a round wherever that lowers the sum of squares of the exact loads, stopping early
/// once the loads are settled or a sweep gains little (detail::settled_pair_load, stalled_sweep).
/// The selection is read once per slash diagonal of the union of its heads' (not per head), so a
/// sweep costs O(num_blocks x (diagonals + W^2)); the result depends on the input alone.
/// Throws when seq_len is not a multiple of world_size * 64 or world_size exceeds
/// max_balanced_world_size.
inline sharding::placed_stripes balance_stripes(const global_selection& selection, index_t world_size, int refine_passes = 4) {
  if (world_size < 1 || world_size > max_balanced_world_size)
    throw invalid_argument("world_size", world_size,
                           "balance_stripes takes 1 to " + std::to_string(max_balanced_world_size) + " ranks (its cost grows as W^2)");
  if (refine_passes < 0) throw invalid_argument("refine_passes", refine_passes, "must not be negative");
  const detail::stripe_tiles tiles(selection);
  if (tiles.num_blocks() % world_size != 0)
    throw invalid_argument("seq_len", selection.seq_len,
                           "balance_stripes needs seq_len to be a multiple of world_size * 64 = " + std::to_string(std::int64_t{world_size} * block_tokens));
  std::vector<std::int64_t> loads;
  std::vector<index_t> owner = detail::greedy_placement(tiles, world_size, loads);
  detail::refine_placement(tiles, world_size, owner, loads, refine_passes);
  return sharding::placed_stripes(std::move(owner), world_size);
}

}  // namespace stria
