// SPDX-License-Identifier: Apache-2.0
// Host dispatch/undispatch: a global tensor to per-rank shards and back, for any sharding policy.
#pragma once

#include <array>
#include <cstddef>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "stria/core/concepts.hpp"
#include "stria/core/error.hpp"
#include "stria/core/tensor_view.hpp"
#include "stria/core/tile.hpp"

namespace stria::sharding {

namespace detail {

/// Calls f(index) for every multi-index of `extents` (row-major order).
template <std::size_t Rank, class F>
void for_each_index(const std::array<index_t, Rank>& extents, F&& f) {
  for (index_t e : extents)
    if (e <= 0) return;
  std::array<index_t, Rank> idx{};
  while (true) {
    f(idx);
    std::size_t d = Rank;
    while (d-- > 0) {
      if (++idx[d] < extents[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
  }
}

template <class T, std::size_t Rank>
T& at(const tensor_view<T, Rank>& v, const std::array<index_t, Rank>& idx) {
  return [&]<std::size_t... D>(std::index_sequence<D...>) -> T& { return v(idx[D]...); }(std::make_index_sequence<Rank>{});
}

/// Checks shard count and extents against the global tensor; returns the layout.
template <class Global, class Shard>
shard_layout check_shards(const Global& global, std::span<const Shard> shards, std::size_t token_dim) {
  if (token_dim >= Global::rank)
    throw invalid_argument("token_dim", token_dim, "must name a dimension of the tensor (rank " + std::to_string(Global::rank) + ")");
  const index_t seq_len = global.extent(token_dim);
  const auto world = static_cast<index_t>(shards.size());
  if (world < 1) throw invalid_argument("shards.size()", 0, "must be at least 1 (one shard per rank)");
  if (seq_len % (world * block_tokens) != 0)
    throw invalid_argument("global.extent(token_dim) (seq_len)", seq_len,
                           "must be a multiple of world_size * 64 = " + std::to_string(world * block_tokens));
  for (std::size_t r = 0; r < shards.size(); ++r)
    for (std::size_t d = 0; d < Global::rank; ++d) {
      const index_t want = d == token_dim ? seq_len / world : global.extent(d);
      if (shards[r].extent(d) != want)
        throw invalid_argument("shards[" + std::to_string(r) + "].extent(" + std::to_string(d) + ")", shards[r].extent(d),
                               "must be " + std::to_string(want) + " (the global extent" +
                                   (d == token_dim ? " / world_size)" : ")"));
    }
  return {seq_len / block_tokens, world};
}

/// Copies block by block between the global tensor and the shards, in the direction `ToShards` says.
template <bool ToShards, sharding_policy P, class G, class S, std::size_t Rank>
void copy_blocks(const P& policy, const tensor_view<G, Rank>& global, std::span<const tensor_view<S, Rank>> shards,
                 std::size_t token_dim) {
  const shard_layout layout = check_shards(global, shards, token_dim);
  policy.validate(layout);
  std::array<index_t, Rank> extents{};
  for (std::size_t d = 0; d < Rank; ++d) extents[d] = global.extent(d);
  extents[token_dim] = block_tokens;  // iterate one block's tokens at a time
  for (index_t b = 0; b < layout.num_blocks; ++b) {
    const block_location where = policy.locate(layout, b);
    const auto& shard = shards[static_cast<std::size_t>(where.rank)];
    for_each_index(extents, [&](std::array<index_t, Rank> idx) {
      std::array<index_t, Rank> g = idx, s = idx;
      g[token_dim] += b * block_tokens;
      s[token_dim] += where.local_block * block_tokens;
      if constexpr (ToShards) at(shard, s) = at(global, g);
      else at(global, g) = at(shard, s);
    });
  }
}

template <std::size_t Rank>
std::string extents_text(const std::array<index_t, Rank>& extents) {
  std::ostringstream text;  // (not "[" + std::to_string(...): GCC 12 warns falsely on that, PR 105329)
  for (std::size_t d = 0; d < Rank; ++d) text << (d > 0 ? ", " : "[") << extents[d];
  text << "]";
  return text.str();
}

/// The elements of a row-major tensor of `extents`, for split and join, which lay views over vectors
/// and must not read or write past them; throws for a negative extent or a count past memory.
template <std::size_t Rank>
std::size_t element_count(const std::array<index_t, Rank>& extents, std::size_t token_dim) {
  if (token_dim >= Rank)
    throw invalid_argument("token_dim", token_dim, "must name a dimension of the tensor (rank " + std::to_string(Rank) + ")");
  std::size_t n = 1;
  for (std::size_t d = 0; d < Rank; ++d) {
    if (extents[d] < 0) throw invalid_argument("extents", extents_text(extents), "must not be negative");
    if (extents[d] > 0 && n > (std::numeric_limits<std::size_t>::max() >> 1) / static_cast<std::size_t>(extents[d]))
      throw invalid_argument("extents", extents_text(extents), "hold more elements than memory can");
    n *= static_cast<std::size_t>(extents[d]);
  }
  return n;
}

}  // namespace detail

/// Copies `global` into one shard per rank along `token_dim` (0 for [S, H, D] tensors, 1 for [H, S] LSE).
template <sharding_policy P, class T, std::size_t Rank>
void dispatch(const P& policy, tensor_view<const T, Rank> global, std::span<const tensor_view<T, Rank>> shards,
              std::size_t token_dim = 0) {
  detail::copy_blocks<true>(policy, global, shards, token_dim);
}

/// The inverse of dispatch: gathers the per-rank shards back into `global`.
template <sharding_policy P, class T, std::size_t Rank>
void undispatch(const P& policy, std::span<const tensor_view<const T, Rank>> shards, tensor_view<T, Rank> global,
                std::size_t token_dim = 0) {
  detail::copy_blocks<false>(policy, global, shards, token_dim);
}

/// Owning convenience over dispatch: a contiguous global tensor (row-major `extents`) as one
/// contiguous shard per rank, rank r at index r.
template <sharding_policy P, class T, std::size_t Rank>
std::vector<std::vector<T>> split(const P& policy, std::span<const T> global, std::array<index_t, Rank> extents, index_t world_size,
                                  std::size_t token_dim = 0) {
  if (world_size < 1) throw invalid_argument("world_size", world_size, "must be at least 1");
  if (const std::size_t elements = detail::element_count(extents, token_dim); global.size() != elements)
    throw invalid_argument("global.size()", global.size(),
                           "must equal the elements of extents " + detail::extents_text(extents) + " = " + std::to_string(elements));
  std::array<index_t, Rank> local = extents;
  local[token_dim] /= world_size;
  std::vector<std::vector<T>> shards(static_cast<std::size_t>(world_size), std::vector<T>(global.size() / static_cast<std::size_t>(world_size)));
  std::vector<tensor_view<T, Rank>> views;
  for (auto& shard : shards) views.emplace_back(shard.data(), local);
  dispatch(policy, tensor_view<const T, Rank>(global.data(), extents), std::span<const tensor_view<T, Rank>>(views), token_dim);
  return shards;
}

/// The inverse of split: the per-rank shards gathered into one contiguous global tensor.
template <sharding_policy P, class T, std::size_t Rank>
std::vector<T> join(const P& policy, const std::vector<std::vector<T>>& shards, std::array<index_t, Rank> extents, std::size_t token_dim = 0) {
  if (shards.empty()) throw invalid_argument("shards.size()", 0, "must be at least 1 (one shard per rank)");
  const std::size_t elements = detail::element_count(extents, token_dim);
  for (std::size_t r = 0; r < shards.size(); ++r)
    if (shards[r].size() * shards.size() != elements)
      throw invalid_argument("shards[" + std::to_string(r) + "].size()", shards[r].size(),
                             "must be 1/" + std::to_string(shards.size()) + " (one per shard) of the elements of extents " +
                                 detail::extents_text(extents) + " = " + std::to_string(elements));
  std::array<index_t, Rank> local = extents;
  local[token_dim] /= static_cast<index_t>(shards.size());
  std::vector<T> global(shards[0].size() * shards.size());
  std::vector<tensor_view<const T, Rank>> views;
  for (const auto& shard : shards) views.emplace_back(shard.data(), local);
  undispatch(policy, std::span<const tensor_view<const T, Rank>>(views), tensor_view<T, Rank>(global.data(), extents), token_dim);
  return global;
}

}  // namespace stria::sharding
