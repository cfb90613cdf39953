// SPDX-License-Identifier: Apache-2.0
// The local step index: per rank, per ring step, which KV tiles and vertical key tokens each
// local query block of each head attends to (CSR), with the transposed form for backward (DESIGN 6).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <limits>
#include <span>
#include <tuple>
#include <vector>

#include "stria/core/config.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tile.hpp"

namespace stria {

/// The tensors an index applies to. Rows are (query head, local query block); KV blocks and
/// vertical tokens are local to the source shard of the step.
struct step_index_shape {
  index_t num_heads = 0;         // query heads
  index_t num_query_blocks = 0;  // local query blocks of this rank
  index_t num_kv_blocks = 0;     // local KV blocks of the source shard
  bool causal = true;

  [[nodiscard]] constexpr index_t num_rows() const { return num_heads * num_query_blocks; }
  friend constexpr bool operator==(const step_index_shape&, const step_index_shape&) = default;
};

/// Which ring step of which distributed configuration the index was built for. A single-rank
/// index has world_size 1 and step 0.
struct step_index_origin {
  index_t seq_len = 0;  // global sequence length
  index_t world_size = 1;
  index_t rank = 0;
  index_t step = 0;
  index_t kv_source_rank = 0;

  friend constexpr bool operator==(const step_index_origin&, const step_index_origin&) = default;
};

/// A non-owning view of a step index (host or device pointers): what kernels and the host
/// reference consume. Row r = head * num_query_blocks + local_query_block.
struct step_index_view {
  step_index_shape shape;
  const index_t* query_global_block;  // [num_query_blocks]    global block of each local query block
  const index_t* kv_global_block;     // [num_kv_blocks]       global block of each local KV block
  // Forward form.
  const index_t* block_ptr;  // [num_rows + 1]
  const index_t* block_col;  // [block_ptr[num_rows]]  local KV blocks whose 64x64 tile is active, ascending
  const index_t* col_ptr;    // [num_rows + 1]
  const index_t* col_token;  // [col_ptr[num_rows]]    local KV tokens outside the row's active blocks, ascending
  // Transposed form, for dK/dV by KV block. Column c = head * num_kv_blocks + local_kv_block.
  const index_t* kv_query_ptr;  // [num_heads * num_kv_blocks + 1]
  const index_t* kv_query;      // local query blocks whose tile with this KV block is active, ascending
  // Vertical tokens transposed: per head the distinct tokens, per token the query blocks using it.
  const index_t* vtoken_head_ptr;   // [num_heads + 1]
  const index_t* vtoken;            // [vtoken_head_ptr[num_heads]]  distinct local KV tokens, ascending per head
  const index_t* vtoken_query_ptr;  // [vtoken_head_ptr[num_heads] + 1]
  const index_t* vtoken_query;      // local query blocks using the token, ascending

  STRIA_HOST_DEVICE constexpr index_t row(index_t head, index_t local_query_block) const {
    return head * shape.num_query_blocks + local_query_block;
  }
  /// A tile needs the causal mask only when its query and key blocks are the same global block.
  STRIA_HOST_DEVICE constexpr bool needs_causal_mask(index_t local_query_block, index_t local_kv_block) const {
    return shape.causal && query_global_block[local_query_block] == kv_global_block[local_kv_block];
  }
};

/// An owning host step index. `validate()` checks every invariant the kernels rely on.
struct step_index {
  step_index_shape shape;
  step_index_origin origin;
  std::vector<index_t> query_global_block;
  std::vector<index_t> kv_global_block;
  std::vector<index_t> block_ptr;
  std::vector<index_t> block_col;
  std::vector<index_t> col_ptr;
  std::vector<index_t> col_token;
  std::vector<index_t> kv_query_ptr;
  std::vector<index_t> kv_query;
  std::vector<index_t> vtoken_head_ptr;
  std::vector<index_t> vtoken;
  std::vector<index_t> vtoken_query_ptr;
  std::vector<index_t> vtoken_query;

  [[nodiscard]] step_index_view view() const {
    return {shape,           query_global_block.data(), kv_global_block.data(), block_ptr.data(),
            block_col.data(), col_ptr.data(),           col_token.data(),       kv_query_ptr.data(),
            kv_query.data(),  vtoken_head_ptr.data(),   vtoken.data(),          vtoken_query_ptr.data(),
            vtoken_query.data()};
  }

  /// (query token, key token) pairs computed: full tiles, causal triangles of diagonal tiles, and
  /// 64 query rows per vertical token. The FLOP count of a step is 4 * D * this (forward).
  [[nodiscard]] std::int64_t active_entries() const {
    constexpr std::int64_t full_tile = std::int64_t{block_tokens} * block_tokens;
    constexpr std::int64_t triangle = std::int64_t{block_tokens} * (block_tokens + 1) / 2;
    std::int64_t entries = std::int64_t{block_tokens} * static_cast<std::int64_t>(col_token.size());
    const step_index_view v = view();
    for (index_t r = 0; r < shape.num_rows(); ++r) {
      const index_t q = r % shape.num_query_blocks;
      for (index_t e = block_ptr[r]; e < block_ptr[r + 1]; ++e)
        entries += v.needs_causal_mask(q, block_col[e]) ? triangle : full_tile;
    }
    return entries;
  }

  /// Throws stria::invalid_argument naming the field, head, row and value of the first broken rule:
  /// sizes, pointer arrays, sorted and duplicate-free rows, ranges, causality, vertical tokens that an
  /// active block already covers, and agreement of the transposed form with the forward form.
  void validate() const;
};

/// Builds the CSR and transposed forms from per-row lists (row = head * num_query_blocks + query
/// block). Rows are sorted; nothing else is changed, so `validate()` still reports duplicates,
/// out-of-range and non-causal entries.
/// An entry count as a CSR offset: the offsets are index_t, so a step index holds at most 2^31 - 1
/// entries of each kind (blocks, vertical tokens); past that it is an error, never a wrapped offset.
inline index_t csr_offset(std::size_t entries, const char* what) {
  if (entries > static_cast<std::size_t>(std::numeric_limits<index_t>::max()))
    throw invalid_argument(what, entries,
                           "exceed the 32-bit offsets of a step index (2147483647): fewer heads or tokens per rank, or more ranks");
  return static_cast<index_t>(entries);
}

inline step_index build_step_index(const step_index_shape& shape, const step_index_origin& origin,
                                   std::vector<index_t> query_global_block, std::vector<index_t> kv_global_block,
                                   std::vector<std::vector<index_t>> blocks_per_row,
                                   std::vector<std::vector<index_t>> tokens_per_row) {
  const auto rows = static_cast<std::size_t>(shape.num_rows());
  if (blocks_per_row.size() != rows)
    throw invalid_argument("blocks_per_row.size()", blocks_per_row.size(),
                           "must equal num_heads * num_query_blocks = " + std::to_string(rows));
  if (tokens_per_row.size() != rows)
    throw invalid_argument("tokens_per_row.size()", tokens_per_row.size(),
                           "must equal num_heads * num_query_blocks = " + std::to_string(rows));

  step_index index;
  index.shape = shape;
  index.origin = origin;
  index.query_global_block = std::move(query_global_block);
  index.kv_global_block = std::move(kv_global_block);

  auto flatten = [](std::vector<std::vector<index_t>>& lists, std::vector<index_t>& ptr, std::vector<index_t>& values, const char* what) {
    ptr.assign(1, 0);
    for (auto& list : lists) {
      std::sort(list.begin(), list.end());
      values.insert(values.end(), list.begin(), list.end());
      ptr.push_back(csr_offset(values.size(), what));
    }
  };
  flatten(blocks_per_row, index.block_ptr, index.block_col, "step index tiles");
  flatten(tokens_per_row, index.col_ptr, index.col_token, "step index vertical entries");

  // Transposed blocks: walking rows in order appends query blocks in ascending order. Entries
  // out of range are skipped here; validate() reports them from the forward form.
  const index_t nq = shape.num_query_blocks;
  const index_t nk = shape.num_kv_blocks;
  std::vector<std::vector<index_t>> queries_per_kv(static_cast<std::size_t>(shape.num_heads) * static_cast<std::size_t>(std::max(nk, 0)));
  std::vector<std::tuple<index_t, index_t, index_t>> vertical;  // (head, token, query block)
  for (index_t h = 0; h < shape.num_heads; ++h) {
    for (index_t q = 0; q < nq; ++q) {
      const auto r = static_cast<std::size_t>(h * nq + q);
      for (index_t k : blocks_per_row[r])
        if (k >= 0 && k < nk) queries_per_kv[static_cast<std::size_t>(h * nk + k)].push_back(q);
      for (index_t t : tokens_per_row[r]) vertical.emplace_back(h, t, q);
    }
  }
  flatten(queries_per_kv, index.kv_query_ptr, index.kv_query, "step index transposed tiles");

  std::sort(vertical.begin(), vertical.end());
  index.vtoken_head_ptr.assign(static_cast<std::size_t>(shape.num_heads) + 1, 0);
  index.vtoken_query_ptr.assign(1, 0);
  for (std::size_t i = 0; i < vertical.size(); ++i) {
    const auto [h, t, q] = vertical[i];
    const bool new_token = i == 0 || std::get<0>(vertical[i - 1]) != h || std::get<1>(vertical[i - 1]) != t;
    if (new_token) {
      if (i > 0) index.vtoken_query_ptr.push_back(static_cast<index_t>(index.vtoken_query.size()));
      index.vtoken.push_back(t);
      if (h >= 0 && h < shape.num_heads) ++index.vtoken_head_ptr[static_cast<std::size_t>(h) + 1];
    }
    index.vtoken_query.push_back(q);
  }
  if (!vertical.empty()) index.vtoken_query_ptr.push_back(static_cast<index_t>(index.vtoken_query.size()));
  for (std::size_t h = 0; h < static_cast<std::size_t>(shape.num_heads); ++h)
    index.vtoken_head_ptr[h + 1] += index.vtoken_head_ptr[h];
  return index;
}

namespace detail {

inline std::string indexed(const char* field, std::int64_t i) { return std::string(field) + "[" + std::to_string(i) + "]"; }

/// Checks a CSR pointer array: size, starts at 0, never decreases, ends at the value count.
inline void check_ptr(const std::vector<index_t>& ptr, std::size_t rows, std::size_t values, const char* ptr_name,
                      const char* values_name) {
  if (ptr.size() != rows + 1)
    throw invalid_argument(std::string(ptr_name) + ".size()", ptr.size(), "must be " + std::to_string(rows + 1));
  if (ptr[0] != 0) throw invalid_argument(indexed(ptr_name, 0), ptr[0], "must be 0");
  for (std::size_t r = 0; r < rows; ++r)
    if (ptr[r + 1] < ptr[r])
      throw invalid_argument(indexed(ptr_name, static_cast<std::int64_t>(r + 1)), ptr[r + 1],
                             "must not be less than the previous entry " + std::to_string(ptr[r]));
  if (static_cast<std::size_t>(ptr[rows]) != values)
    throw invalid_argument(indexed(ptr_name, static_cast<std::int64_t>(rows)), ptr[rows],
                           std::string("must equal ") + values_name + ".size() = " + std::to_string(values));
}

/// Checks that values[ptr[r]..ptr[r+1]) lie in [0, limit) and strictly increase; `row_kind` says
/// what a row is ("row" of the forward form, "column" of the transposed form, ...).
inline void check_rows_sorted(const std::vector<index_t>& ptr, const std::vector<index_t>& values, index_t limit,
                              const char* values_name, const char* row_kind) {
  for (std::size_t r = 0; r + 1 < ptr.size(); ++r) {
    for (index_t e = ptr[r]; e < ptr[r + 1]; ++e) {
      const index_t v = values[static_cast<std::size_t>(e)];
      const std::string row = std::string(row_kind) + " " + std::to_string(r);
      if (v < 0 || v >= limit)
        throw invalid_argument(indexed(values_name, e), v, "out of range [0, " + std::to_string(limit) + ") in " + row);
      const index_t previous = e > ptr[r] ? values[static_cast<std::size_t>(e - 1)] : -1;
      if (v == previous) throw invalid_argument(indexed(values_name, e), v, "duplicate entry in " + row);
      if (v < previous) throw invalid_argument(indexed(values_name, e), v, "not sorted ascending in " + row);
    }
  }
}

}  // namespace detail

inline void step_index::validate() const {
  using detail::indexed;
  if (shape.num_heads < 1) throw invalid_argument("shape.num_heads", shape.num_heads, "must be at least 1");
  if (shape.num_query_blocks < 1)
    throw invalid_argument("shape.num_query_blocks", shape.num_query_blocks, "must be at least 1");
  if (shape.num_kv_blocks < 1) throw invalid_argument("shape.num_kv_blocks", shape.num_kv_blocks, "must be at least 1");
  const index_t nq = shape.num_query_blocks;
  const index_t nk = shape.num_kv_blocks;
  const index_t heads = shape.num_heads;
  const auto rows = static_cast<std::size_t>(shape.num_rows());

  // Global block maps: sized, non-negative, ascending (every sharding keeps global order locally).
  auto check_global = [](const std::vector<index_t>& blocks, index_t n, const char* name) {
    if (blocks.size() != static_cast<std::size_t>(n))
      throw invalid_argument(std::string(name) + ".size()", blocks.size(), "must be " + std::to_string(n));
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (blocks[i] < 0) throw invalid_argument(indexed(name, static_cast<std::int64_t>(i)), blocks[i], "must be >= 0");
      if (i > 0 && blocks[i] <= blocks[i - 1])
        throw invalid_argument(indexed(name, static_cast<std::int64_t>(i)), blocks[i],
                               "must be greater than the previous local block's global block (local order keeps global order)");
    }
  };
  check_global(query_global_block, nq, "query_global_block");
  check_global(kv_global_block, nk, "kv_global_block");

  constexpr const char* row_kind = "row (head * num_query_blocks + local_query_block)";
  constexpr const char* column_kind = "column (head * num_kv_blocks + local_kv_block)";

  detail::check_ptr(block_ptr, rows, block_col.size(), "block_ptr", "block_col");
  detail::check_rows_sorted(block_ptr, block_col, nk, "block_col", row_kind);
  detail::check_ptr(col_ptr, rows, col_token.size(), "col_ptr", "col_token");
  detail::check_rows_sorted(col_ptr, col_token, nk * block_tokens, "col_token", row_kind);

  // Causality and coverage, row by row.
  for (index_t h = 0; h < heads; ++h) {
    for (index_t q = 0; q < nq; ++q) {
      const auto r = static_cast<std::size_t>(h * nq + q);
      const std::string where =
          " (head " + std::to_string(h) + ", local query block " + std::to_string(q) + ", global query block " +
          std::to_string(query_global_block[static_cast<std::size_t>(q)]) + ")";
      const index_t q_global = query_global_block[static_cast<std::size_t>(q)];
      for (index_t e = block_ptr[r]; e < block_ptr[r + 1]; ++e) {
        const index_t k = block_col[static_cast<std::size_t>(e)];
        if (shape.causal && kv_global_block[static_cast<std::size_t>(k)] > q_global)
          throw invalid_argument(indexed("block_col", e), k,
                                 "non-causal: KV block's global block " +
                                     std::to_string(kv_global_block[static_cast<std::size_t>(k)]) +
                                     " is after the query block" + where);
      }
      const auto row_blocks_begin = block_col.begin() + block_ptr[r];
      const auto row_blocks_end = block_col.begin() + block_ptr[r + 1];
      for (index_t e = col_ptr[r]; e < col_ptr[r + 1]; ++e) {
        const index_t t = col_token[static_cast<std::size_t>(e)];
        const index_t k = t / block_tokens;
        if (shape.causal && kv_global_block[static_cast<std::size_t>(k)] >= q_global)
          throw invalid_argument(indexed("col_token", e), t,
                                 "non-causal for part of the query block: a vertical token must precede the whole "
                                 "query block (global key block " +
                                     std::to_string(kv_global_block[static_cast<std::size_t>(k)]) + ")" + where);
        if (std::binary_search(row_blocks_begin, row_blocks_end, k))
          throw invalid_argument(indexed("col_token", e), t,
                                 "already covered by active KV block " + std::to_string(k) + " of the same row" + where);
      }
    }
  }

  // Transposed blocks must list exactly the forward entries.
  const auto columns = static_cast<std::size_t>(heads) * static_cast<std::size_t>(nk);
  detail::check_ptr(kv_query_ptr, columns, kv_query.size(), "kv_query_ptr", "kv_query");
  detail::check_rows_sorted(kv_query_ptr, kv_query, nq, "kv_query", column_kind);
  if (kv_query.size() != block_col.size())
    throw invalid_argument("kv_query.size()", kv_query.size(),
                           "must equal block_col.size() = " + std::to_string(block_col.size()) +
                               " (the transposed form lists the same tiles)");
  for (index_t h = 0; h < heads; ++h)
    for (index_t k = 0; k < nk; ++k) {
      const auto c = static_cast<std::size_t>(h * nk + k);
      for (index_t e = kv_query_ptr[c]; e < kv_query_ptr[c + 1]; ++e) {
        const index_t q = kv_query[static_cast<std::size_t>(e)];
        const auto r = static_cast<std::size_t>(h * nq + q);
        if (!std::binary_search(block_col.begin() + block_ptr[r], block_col.begin() + block_ptr[r + 1], k))
          throw invalid_argument(indexed("kv_query", e), q,
                                 "lists tile (head " + std::to_string(h) + ", query block " + std::to_string(q) +
                                     ", KV block " + std::to_string(k) + ") that the forward form does not have");
      }
    }

  // Transposed vertical tokens: per head distinct ascending tokens, each with the query blocks using it.
  detail::check_ptr(vtoken_head_ptr, static_cast<std::size_t>(heads), vtoken.size(), "vtoken_head_ptr", "vtoken");
  detail::check_rows_sorted(vtoken_head_ptr, vtoken, nk * block_tokens, "vtoken", "head");
  detail::check_ptr(vtoken_query_ptr, vtoken.size(), vtoken_query.size(), "vtoken_query_ptr", "vtoken_query");
  detail::check_rows_sorted(vtoken_query_ptr, vtoken_query, nq, "vtoken_query", "the query list of vtoken index");
  if (vtoken_query.size() != col_token.size())
    throw invalid_argument("vtoken_query.size()", vtoken_query.size(),
                           "must equal col_token.size() = " + std::to_string(col_token.size()) +
                               " (the transposed form lists the same vertical entries)");
  for (index_t h = 0; h < heads; ++h)
    for (index_t i = vtoken_head_ptr[static_cast<std::size_t>(h)]; i < vtoken_head_ptr[static_cast<std::size_t>(h) + 1]; ++i) {
      const index_t t = vtoken[static_cast<std::size_t>(i)];
      if (vtoken_query_ptr[static_cast<std::size_t>(i)] == vtoken_query_ptr[static_cast<std::size_t>(i) + 1])
        throw invalid_argument(indexed("vtoken", i), t, "has an empty query list (a listed token must be used)");
      for (index_t e = vtoken_query_ptr[static_cast<std::size_t>(i)]; e < vtoken_query_ptr[static_cast<std::size_t>(i) + 1]; ++e) {
        const index_t q = vtoken_query[static_cast<std::size_t>(e)];
        const auto r = static_cast<std::size_t>(h * nq + q);
        if (!std::binary_search(col_token.begin() + col_ptr[r], col_token.begin() + col_ptr[r + 1], t))
          throw invalid_argument(indexed("vtoken_query", e), q,
                                 "lists vertical token " + std::to_string(t) + " for (head " + std::to_string(h) +
                                     ", query block " + std::to_string(q) + ") that the forward form does not have");
      }
    }
}

/// The block entries of an index of `heads` heads over these local query and KV blocks (their
/// global blocks) that holds every tile causal attention (`causal`; else full attention) allows in
/// every row; -1 where the query blocks do not ascend.
/// Called by the device index builder for every index of every ring step: one merge walk, no copy,
/// where the KV blocks ascend too (every built-in sharding's do).
inline std::int64_t allowed_tiles(std::span<const index_t> query_global, std::span<const index_t> kv_global, bool causal, index_t heads) {
  if (!std::is_sorted(query_global.begin(), query_global.end())) return -1;
  if (!causal) return static_cast<std::int64_t>(query_global.size()) * static_cast<std::int64_t>(kv_global.size()) * heads;
  std::vector<index_t> sorted;
  if (!std::is_sorted(kv_global.begin(), kv_global.end())) {
    sorted.assign(kv_global.begin(), kv_global.end());
    std::sort(sorted.begin(), sorted.end());
    kv_global = sorted;
  }
  std::int64_t allowed = 0;
  std::size_t below = 0;  // KV blocks at or before the current query block (both ascend)
  for (const index_t q : query_global) {
    while (below < kv_global.size() && kv_global[below] <= q) ++below;
    allowed += static_cast<std::int64_t>(below);
  }
  return allowed * heads;
}

/// Whether an index with `tiles` block entries and `tokens` vertical ones holds all `allowed` tiles
/// (allowed_tiles) and nothing else: then, its query blocks ascending, the row of query block q + 1
/// holds every tile of q's (the paired Hopper forward's condition). A valid index holds each
/// allowed tile at most once per row, so the count decides.
inline bool holds_every_allowed_tile(std::int64_t allowed, std::int64_t tiles, std::int64_t tokens) {
  return allowed > 0 && tokens == 0 && tiles == allowed;
}

/// holds_every_allowed_tile for a host index, checked row by row rather than by count: every row's
/// blocks ascend strictly and are exactly the allowed ones, and there is no vertical token. For an
/// index that may not be valid (upload_step_index): a count alone would take duplicates for tiles.
inline bool holds_every_allowed_tile(const step_index& x) {
  const auto rows = static_cast<std::size_t>(x.shape.num_heads) * static_cast<std::size_t>(x.shape.num_query_blocks);
  if (x.shape.num_heads < 0 || x.shape.num_query_blocks < 0 || x.block_ptr.size() != rows + 1 ||
      x.query_global_block.size() != static_cast<std::size_t>(x.shape.num_query_blocks) ||
      x.kv_global_block.size() != static_cast<std::size_t>(x.shape.num_kv_blocks))
    return false;  // malformed: validate() says how
  if (!x.col_token.empty() || allowed_tiles(x.query_global_block, x.kv_global_block, x.shape.causal, x.shape.num_heads) <= 0) return false;
  for (index_t h = 0; h < x.shape.num_heads; ++h)
    for (index_t q = 0; q < x.shape.num_query_blocks; ++q) {
      const auto r = static_cast<std::size_t>(h * x.shape.num_query_blocks + q);
      if (x.block_ptr[r] < 0 || x.block_ptr[r + 1] < x.block_ptr[r] || static_cast<std::size_t>(x.block_ptr[r + 1]) > x.block_col.size()) return false;
      index_t expected = 0;  // the next allowed local KV block, in order
      for (index_t e = x.block_ptr[r]; e < x.block_ptr[r + 1]; ++e, ++expected) {
        while (expected < x.shape.num_kv_blocks && x.shape.causal &&
               x.kv_global_block[static_cast<std::size_t>(expected)] > x.query_global_block[static_cast<std::size_t>(q)])
          ++expected;
        if (expected >= x.shape.num_kv_blocks || x.block_col[static_cast<std::size_t>(e)] != expected) return false;
      }
      for (; expected < x.shape.num_kv_blocks; ++expected)  // none left out
        if (!x.shape.causal || x.kv_global_block[static_cast<std::size_t>(expected)] <= x.query_global_block[static_cast<std::size_t>(q)])
          return false;
    }
  return true;
}

/// Throws stria::invalid_argument unless `index` was built for `expected` (an index built for
/// another configuration must never be consumed silently).
inline void check_index_shape(const step_index_shape& index, const step_index_shape& expected) {
  auto check = [](const char* field, index_t got, index_t want, const char* what) {
    if (got != want)
      throw invalid_argument(std::string("index.shape.") + field, got,
                             std::string("the index was built for another configuration: the tensors have ") +
                                 std::to_string(want) + " " + what);
  };
  check("num_heads", index.num_heads, expected.num_heads, "query heads");
  check("num_query_blocks", index.num_query_blocks, expected.num_query_blocks, "local query blocks (q tokens / 64)");
  check("num_kv_blocks", index.num_kv_blocks, expected.num_kv_blocks, "local KV blocks (k tokens / 64)");
  if (index.causal != expected.causal)
    throw invalid_argument("index.shape.causal", index.causal ? "true" : "false",
                           std::string("the index was built for another configuration: the call asks for ") +
                               (expected.causal ? "causal" : "full") + " attention");
}

}  // namespace stria
