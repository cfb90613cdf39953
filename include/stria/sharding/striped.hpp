// SPDX-License-Identifier: Apache-2.0
// sharding::striped<G>: stripes of G tokens dealt round-robin, stripe t to rank t mod W (MTraining's
// striped layout). With G = 64 every rank sees each slash diagonal complete at one ring step.
#pragma once

#include <string>
#include <string_view>

#include "stria/core/concepts.hpp"
#include "stria/core/tile.hpp"
#include "stria/sharding/validate.hpp"

namespace stria::sharding {

template <index_t StripeTokens = block_tokens>
struct striped {
  static_assert(StripeTokens > 0 && StripeTokens % block_tokens == 0,
                "striped<G> needs G, the stripe length in tokens, to be a positive multiple of 64");
  static constexpr index_t stripe_tokens = StripeTokens;
  static constexpr index_t stripe_blocks = StripeTokens / block_tokens;
  static constexpr std::string_view name = "striped";

  void validate(shard_layout layout) const {
    detail::validate_layout(layout, stripe_blocks,
                            "striped<" + std::to_string(StripeTokens) +
                                "> sharding needs seq_len to be a positive multiple of world_size * " + std::to_string(StripeTokens));
  }

  STRIA_HOST_DEVICE constexpr index_t local_blocks(shard_layout layout) const { return layout.num_blocks / layout.world_size; }

  STRIA_HOST_DEVICE constexpr block_location locate(shard_layout layout, index_t global_block) const {
    const index_t stripe = global_block / stripe_blocks;
    return {stripe % layout.world_size, (stripe / layout.world_size) * stripe_blocks + global_block % stripe_blocks};
  }

  STRIA_HOST_DEVICE constexpr index_t global_block(shard_layout layout, block_location where) const {
    const index_t local_stripe = where.local_block / stripe_blocks;
    return (local_stripe * layout.world_size + where.rank) * stripe_blocks + where.local_block % stripe_blocks;
  }
};
static_assert(sharding_policy<striped<>>);
static_assert(sharding_policy<striped<256>>);

}  // namespace stria::sharding
