// SPDX-License-Identifier: Apache-2.0
// tile<64, 64, D>: the kernel tile shape and the tile sizes and softmax scale derived from it.
#pragma once

#include "stria/core/concepts.hpp"
#include "stria/core/config.hpp"

namespace stria {

/// Tokens in one block: the unit of sharding, of the sparse index and of a kernel tile side.
inline constexpr index_t block_tokens = 64;

/// Kernel tile traits: `BlockQ` query rows x `BlockKV` keys, head dimension `HeadDim`.
/// The index formats and kernels are written for 64x64 tiles; head_dim is 64 or 128.
template <index_t BlockQ, index_t BlockKV, index_t HeadDim>
struct tile {
  static_assert(BlockQ == block_tokens && BlockKV == block_tokens,
                "stria tiles are 64x64: use stria::tile<64, 64, HeadDim> (the sparse index is built on 64-token blocks)");
  static_assert(HeadDim == 64 || HeadDim == 128, "stria supports head_dim 64 and 128: use tile<64, 64, 64> or tile<64, 64, 128>");

  static constexpr index_t block_q = BlockQ;    // query rows per tile
  static constexpr index_t block_kv = BlockKV;  // keys per tile
  static constexpr index_t head_dim = HeadDim;

  static constexpr index_t q_elements = block_q * head_dim;    // one Q (or O, dO) tile
  static constexpr index_t kv_elements = block_kv * head_dim;  // one K (or V) tile

  /// 1/sqrt(head_dim), the usual softmax scale.
  static constexpr double default_softmax_scale = head_dim == 64 ? 0.125 : 0.08838834764831844055;
};

static_assert(tile_traits<tile<64, 64, 64>>);
static_assert(tile_traits<tile<64, 64, 128>>);

}  // namespace stria
